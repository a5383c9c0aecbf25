"""Inter-token time of answers in flight while `ringctx serve` ingests a new document.

    python scripts/bench_ingest_itl.py [--tokens 8000] [--answers 2] [--max-tokens 96]
                                       [--chunk-tokens default 4096] [--ingest-shares 1.0 0.5]
                                       [--json out.json]

For each --chunk-tokens setting (`default`: serve's own) and each --ingest-shares setting, a fresh
`ringctx serve --port 0` on the embedded SmolLM2 (dtype auto) ingests document A; then, twice over:

    quiet      --answers streamed questions about A, nothing else running
    ingesting  the same questions, and a new --tokens document B posted once each answer has had
               STEADY_DELTAS tokens (so the ingest runs beside them, after their joins)

Each answer's inter-token gaps (client side, between streamed content deltas) are split into those
that fell inside B's ingest (from its POST to `ready`) and the rest. Per setting: the quiet median
gap; the median, 90th percentile and largest gap during the ingest, as ratios to the quiet median;
how long B took to ingest beside the answers and alone. Beside answers the scheduler runs whole
layers of the ingest's chunk in each step, about --ingest-share decode steps' worth, so the share
sets the typical gap and one layer of one chunk (the chunk size) the longest.

Then `--arrivals` questions about A arrive one by one, at seeded random moments, while a new
--tokens document ingests with nothing else running: each one's time to first token against the
same questions' with nothing running ("quiet TTFT"). With nothing decoding the scheduler runs the
ingest in slices of about IDLE_SLICE_S (engine/scheduler.py), so such a question waits one slice
before it joins, not the rest of a chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time

import bench_serve  # its neighbour in scripts/ (on the path when run as a script)
log, median, make_document, MODEL_ID = bench_serve.log, bench_serve.median, bench_serve.make_document, bench_serve.MODEL_ID


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of values (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

QUESTIONS = ["What is the document about? Answer in detail.", "Summarise the first part of the document at length.",
             "List the people the document mentions and what they do.", "Describe the places in the document."]


def ingest(http, text: str, name: str) -> tuple[str, float, float]:
    """POST a document and wait until it is ready: (id, POST time, seconds to ready)."""
    t0 = time.perf_counter()
    doc = http.post("/v1/documents", json={"text": text, "name": name}).json()
    while True:
        info = http.get(f"/v1/documents/{doc['id']}").json()
        if info["status"] == "ready":
            return doc["id"], t0, time.perf_counter() - t0
        if info["status"] == "failed":
            raise RuntimeError(f"ingest failed: {info}")
        time.sleep(0.05)


STEADY_DELTAS = 4
"""Content deltas each answer has received before document B is posted: the questions' joins (each
question's prefill, run between the other's tokens) lie before the window measured."""


def stream(client, question: str, document: str, max_tokens: int, steady: threading.Event, out: list) -> None:
    """One streamed greedy answer; appends the arrival time of each content delta to out and sets
    `steady` once STEADY_DELTAS have come."""
    chunks = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": question}],
                                            extra_body={"document": document}, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    for chunk in chunks:
        for choice in chunk.choices or ():
            if choice.delta and choice.delta.content:
                out.append(time.perf_counter())
                if len(out) >= STEADY_DELTAS:
                    steady.set()


def run_answers(client, http, doc_a: str, args, new_document: str | None) -> dict:
    """--answers streamed answers about doc_a; with new_document, it is ingested beside them."""
    times = [[] for _ in range(args.answers)]
    steady = [threading.Event() for _ in range(args.answers)]
    threads = [threading.Thread(target=stream, args=(client, QUESTIONS[i % len(QUESTIONS)], doc_a, args.max_tokens,
                                                     steady[i], times[i])) for i in range(args.answers)]
    for t in threads:
        t.start()
    window = None
    if new_document is not None:
        for e in steady:
            e.wait(timeout=300)
        _, t0, seconds = ingest(http, new_document, "B")
        window = (t0, t0 + seconds)
    for t in threads:
        t.join()
    inside, outside = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            (inside if window and a < window[1] and b > window[0] else outside).append(b - a)
    return {"gaps_inside": inside, "gaps_outside": outside, "ingest_s": None if window is None else window[1] - window[0],
            "deltas": [len(ts) for ts in times]}


def first_token_s(client, question: str, document: str) -> float:
    """Seconds from sending a streamed greedy question to its first content delta."""
    t0 = time.perf_counter()
    chunks = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": question}],
                                            extra_body={"document": document}, max_tokens=4, temperature=0,
                                            stream=True)
    first = None
    for chunk in chunks:
        for choice in chunk.choices or ():
            if first is None and choice.delta and choice.delta.content:
                first = time.perf_counter() - t0
    return first


def run_arrivals(client, http, doc_a: str, n: int, new_document: str) -> dict:
    """n questions about doc_a, each sent at a seeded random moment while new_document ingests
    alone (the next one after the last one's answer), and the same questions with nothing running."""
    quiet = [first_token_s(client, QUESTIONS[i % len(QUESTIONS)], doc_a) for i in range(n)]
    rng = random.Random(7)
    doc = http.post("/v1/documents", json={"text": new_document, "name": "C"}).json()
    during = []
    for i in range(n):
        time.sleep(rng.uniform(0.1, 1.0))  # a moment somewhere in a chunk (chunks take seconds here)
        if http.get(f"/v1/documents/{doc['id']}").json()["status"] != "ingesting":
            break
        during.append(first_token_s(client, QUESTIONS[i % len(QUESTIONS)], doc_a))
    while http.get(f"/v1/documents/{doc['id']}").json()["status"] == "ingesting":
        time.sleep(0.05)
    return {"quiet_ttft": quiet, "arrival_ttft": during}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8000, help="the ingested document's length in tokens")
    p.add_argument("--answers", type=int, default=2, help="answers streaming during the ingest")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    p.add_argument("--chunk-tokens", nargs="+", default=["default", "4096"],
                   help="serve --chunk-tokens settings to compare ('default': serve's own)")
    p.add_argument("--ingest-shares", nargs="+", default=["1.0", "0.5"],
                   help="serve --ingest-share settings to compare (each with each chunk setting)")
    p.add_argument("--arrivals", type=int, default=6,
                   help="questions arriving one by one during an ingest with nothing else running (0: skip)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import httpx
    import openai

    from ringctx.kernels.cpu_features import cpu_model
    from ringctx.model.loader import embedded_gguf_path
    from ringctx.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(embedded_gguf_path())
    text_a, _ = make_document(2000, 1, tokenizer)
    log(f"{cpu_model()}, {os.cpu_count()} cores; document B {args.tokens:,} tokens; {args.answers} answers x "
        f"{args.max_tokens} tokens")
    rows = []
    for setting, share in [(c, s) for c in args.chunk_tokens for s in args.ingest_shares]:
        work = tempfile.mkdtemp(prefix="bench_ingest_itl_")
        extra = ("--ingest-share", share) + (() if setting == "default" else ("--chunk-tokens", setting))
        server = bench_serve.start_ringctx(os.path.join(work, "store"), os.path.join(work, "serve.log"), None, "auto",
                                           600.0, extra)
        try:
            http = httpx.Client(base_url=server.url, timeout=600)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
            doc_a, _, _ = ingest(http, text_a, "A")
            text_b, _ = make_document(args.tokens, 2, tokenizer)
            _, _, alone_s = ingest(http, text_b, "B alone")  # warm-up, and the ingest's time alone
            quiet = run_answers(client, http, doc_a, args, None)
            busy = run_answers(client, http, doc_a, args, make_document(args.tokens, 3, tokenizer)[0])
            arrivals = (run_arrivals(client, http, doc_a, args.arrivals, make_document(args.tokens, 4, tokenizer)[0])
                        if args.arrivals else {"quiet_ttft": [], "arrival_ttft": []})
        finally:
            server.stop()
            shutil.rmtree(work, ignore_errors=True)
        q = median(quiet["gaps_outside"])
        inside = busy["gaps_inside"]
        row = {"chunk_tokens": setting, "ingest_share": float(share), "quiet_gap_ms": q * 1e3,
               "ingest_gap_median_ms": median(inside) * 1e3 if inside else None,
               "ingest_gap_p90_ms": percentile(inside, 0.9) * 1e3 if inside else None,
               "ingest_gap_max_ms": max(inside) * 1e3 if inside else None,
               "median_ratio": median(inside) / q if inside else None,
               "p90_ratio": percentile(inside, 0.9) / q if inside else None, "max_ratio": max(inside) / q if inside else None,
               "gaps_during_ingest": len(inside), "ingest_beside_s": busy["ingest_s"], "ingest_alone_s": alone_s,
               "quiet_ttft_ms": median(arrivals["quiet_ttft"]) * 1e3 if arrivals["quiet_ttft"] else None,
               "arrival_ttft_ms": [t * 1e3 for t in arrivals["arrival_ttft"]]}
        rows.append(row)
        log(f"chunk {setting}, share {share}: quiet {row['quiet_gap_ms']:.1f} ms; during the ingest median "
            f"{row['ingest_gap_median_ms']:.1f} ms ({row['median_ratio']:.2f}x), p90 {row['ingest_gap_p90_ms']:.1f} ms, max {row['ingest_gap_max_ms']:.0f} ms "
            f"({row['max_ratio']:.1f}x) over {len(inside)} gaps; ingest {busy['ingest_s']:.1f} s beside the answers, "
            f"{alone_s:.1f} s alone")
        if row["arrival_ttft_ms"]:
            log(f"  questions arriving during an idle ingest: first token {median(row['arrival_ttft_ms']):.0f} ms "
                f"median, {max(row['arrival_ttft_ms']):.0f} ms max over {len(row['arrival_ttft_ms'])} (quiet "
                f"{row['quiet_ttft_ms']:.0f} ms)")
    print(f"\n{'chunk':>7} {'share':>5} {'quiet':>6} {'median':>7} {'x':>5} {'p90':>6} {'x':>5} {'max':>6} {'x':>5} "
          f"{'beside':>7} {'alone':>6} {'TTFT':>6} {'arriving':>13}")
    print(f"{'':>7} {'':>5} {'ms':>6} {'ms':>7} {'':>5} {'ms':>6} {'':>5} {'ms':>6} {'':>5} {'s':>7} {'s':>6} "
          f"{'ms':>6} {'median/max ms':>13}")
    for r in rows:
        arriving = (f"{median(r['arrival_ttft_ms']):.0f}/{max(r['arrival_ttft_ms']):.0f}" if r["arrival_ttft_ms"]
                    else "-")
        quiet_ttft = f"{r['quiet_ttft_ms']:.0f}" if r["quiet_ttft_ms"] is not None else "-"
        print(f"{r['chunk_tokens']:>7} {r['ingest_share']:>5.2f} {r['quiet_gap_ms']:>6.1f} {r['ingest_gap_median_ms']:>7.1f} "
              f"{r['median_ratio']:>5.2f} {r['ingest_gap_p90_ms']:>6.1f} {r['p90_ratio']:>5.2f} "
              f"{r['ingest_gap_max_ms']:>6.0f} {r['max_ratio']:>5.1f} {r['ingest_beside_s']:>7.1f} {r['ingest_alone_s']:>6.1f} "
              f"{quiet_ttft:>6} {arriving:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows,
                       "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
