"""A served ingest SIGKILLed past half its chunks, and the restarted server finishing it.

    python scripts/bench_serve_resume.py [--tokens 8192] [--nproc auto] [--chunk-tokens 1024]
                                         [--json out.json] [-- extra `ringctx serve` options]

1. `ringctx serve` (the embedded SmolLM2, loopback, a port the OS picks) on a new store ingests a
   document of about --tokens tokens whole: its ingest time W and chunk count n.
2. The same server ingests a second document of the same length; once more than half its chunks
   are done the server is SIGKILLed (its ranks exit as rank 0's pipes close).
3. A server restarted on the store resumes the ingest by itself. Timed: its start-up (process start
   to the first /health 200) and from that /health to the document's "ready".
Target: health-to-ready at most the remaining chunks' share of W ((n - done) / n x W) plus the
resume's own start-up (reading the checkpoint back), which the table shows apart. The answer to
a question on the resumed document is compared with the one on the whole one (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from ringctx.kernels.cpu_features import cpu_model

LISTENING = re.compile(r"ringctx serve: listening on (http://[\d.]+:\d+)")
WORDS = ("the harbour master counts the boats that leave at dawn and the ones that come back before the "
         "storm while the lighthouse keeper writes every name into a heavy book").split()


class Server:
    def __init__(self, store: str, args: list[str]):
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "ringctx", "serve", "--port", "0", "--store", store, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.proc.stdout], daemon=True).start()
        self.url = None
        while self.url is None:
            for line in list(self.lines):
                if m := LISTENING.search(line):
                    self.url = m.group(1)
            if self.proc.poll() is not None:
                raise SystemExit("the server did not start:\n" + "".join(self.lines)[-3000:])
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, timeout=600)
        while True:  # the first /health that answers 200
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        self.healthy = time.monotonic()

    def doc(self, doc_id: str) -> dict:
        return self.http.get(f"/v1/documents/{doc_id}").json()

    def wait_ready(self, doc_id: str) -> dict:
        while (d := self.doc(doc_id))["status"] == "ingesting":
            time.sleep(0.02)
        return d

    def ask(self, doc_id: str) -> str:
        r = self.http.post("/v1/chat/completions", json={
            "model": "smollm2-135m", "document": doc_id, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Who writes the names down?"}]})
        return r.json()["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--nproc", default="auto")
    parser.add_argument("--chunk-tokens", type=int, default=1024,
                        help="8 chunks for 8K tokens: past half is then a chunk boundary before the end")
    parser.add_argument("--json", default=None)
    args, extra = parser.parse_known_args()
    serve = ["--nproc", args.nproc, "--chunk-tokens", str(args.chunk_tokens),
             *[a for a in extra if a != "--"]]
    text = " ".join(WORDS[i % len(WORDS)] for i in range(int(args.tokens * 0.95)))
    store = tempfile.mkdtemp(prefix="ringctx-bench-resume-")
    report = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "serve_args": serve}
    try:
        first = Server(store, serve)
        t0 = time.monotonic()
        whole = first.wait_ready(first.http.post("/v1/documents", json={"text": text, "name": "whole"}).json()["id"])
        report["whole_ingest_s"] = time.monotonic() - t0
        report["tokens"], report["chunks"] = whole["tokens"], whole["chunks"]["total"]
        doc = first.http.post("/v1/documents", json={"text": text, "name": "killed"}).json()
        while (done := first.doc(doc["id"])["chunks"]["done"]) <= report["chunks"] // 2:
            time.sleep(0.01)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        report["done_at_kill"] = done
        time.sleep(2)  # its ranks exit as rank 0's pipes close
        second = Server(store, serve)
        report["startup_s"] = second.healthy - second.started
        resumed = second.wait_ready(doc["id"])
        report["health_to_ready_s"] = time.monotonic() - second.healthy
        report["status"] = resumed["status"]
        # the remaining chunks' share of the whole ingest by their own seconds there (later chunks
        # attend to more: a share by count would understate them)
        seconds = whole["chunks"]["seconds"]
        report["remaining_share_of_whole_s"] = report["whole_ingest_s"] * sum(seconds[done:]) / sum(seconds)
        again = resumed["chunks"]["seconds"][done:]  # what the restarted server computed
        report["resumed_chunks_s"] = sum(again)
        report["resume_overhead_s"] = report["health_to_ready_s"] - sum(again)
        report["same_answer"] = second.ask(doc["id"]) == second.ask(whole["id"])
        second.proc.send_signal(signal.SIGTERM)
        second.proc.wait(timeout=120)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    print(f"{report['cpu']}, {report['date']}, `ringctx serve {' '.join(serve)}`")
    print(f"{report['tokens']:,}-token document in {report['chunks']} chunks; whole ingest "
          f"{report['whole_ingest_s']:.1f} s; killed after {report['done_at_kill']} chunks")
    print(f"the restarted server: its chunks {report['resumed_chunks_s']:.1f} s, the rest of health->ready "
          f"{report['resume_overhead_s']:.1f} s (reading the checkpoint back, the hand-off, the first chunk's warm-up)")
    print(f"{'start-up s':>11} {'health->ready s':>16} {'remaining share s':>18} {'ratio':>6} {'same answer':>12}")
    print(f"{report['startup_s']:>11.1f} {report['health_to_ready_s']:>16.1f} "
          f"{report['remaining_share_of_whole_s']:>18.1f} "
          f"{report['health_to_ready_s'] / max(report['remaining_share_of_whole_s'], 1e-9):>6.2f} "
          f"{str(report['same_answer']):>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
