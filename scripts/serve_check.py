"""One request through `ringctx serve`'s HTTP path, for scripts/gpu_check.sh (and --dry-run on a CPU).

    python scripts/serve_check.py --out DIR [--tokens 8000] [--budget-s 90] [--dry-run]

Starts `python -m ringctx serve --port 0` on this machine's default layout (one rank per GPU),
ingests a document of about --tokens tokens through POST /v1/documents, asks one streamed question
about it with the `openai` client; then, as a plain client (no documents API), sends another text of
the same length with a question twice, the second time another question: a miss, then a prefix-cache
hit. Writes DIR/serve_check.json: the ingest's seconds and strategies, each question's time to first
token and inter-token times (HTTP included), cached tokens and answer, and the server's own log
lines. Exit status 0 when every answer came back and the second plain question reused the first's
rows, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SENTENCE = "The harbour master logs every ship that passes the old lighthouse before dawn. "
NEEDLE = "The code word for the vault is heliotrope."


PLAIN_SENTENCE = "The ferry crosses the bay twice a day, and the ferryman counts the gulls on the pier. "
PLAIN_NEEDLE = "The boat that sails at dawn is the Marigold, and she carries salt."


def ask(client, model: str, messages: list[dict], extra_body: dict | None = None) -> dict:
    """One streamed greedy question: its answer, time to first token, inter-token time and usage."""
    t, times, pieces, usage = time.monotonic(), [], [], None
    stream = client.chat.completions.create(model=model, messages=messages, extra_body=extra_body or {},
                                            max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"answer": "".join(pieces), "time_to_first_token_s": round(times[0] - t, 4) if times else None,
            "inter_token_ms_median": round(statistics.median(gaps) * 1000, 2) if gaps else None,
            "usage": usage.model_dump() if usage else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8000, help="document length, about (16 tokens a sentence)")
    p.add_argument("--budget-s", type=float, default=90.0, help="give up after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="a short document (a CPU check of the script)")
    args = p.parse_args()
    import httpx
    import openai

    tokens = 300 if args.dry_run else args.tokens
    sentences = max(2, tokens // 16)
    document = SENTENCE * (sentences // 2) + NEEDLE + " " + SENTENCE * (sentences // 2)
    deadline = time.monotonic() + args.budget_s
    result: dict = {"tokens_asked": tokens, "ok": False}
    store = tempfile.mkdtemp(prefix="ringctx-serve-check-")
    server = subprocess.Popen([sys.executable, "-m", "ringctx", "serve", "--port", "0", "--store", store,
                               "--allow-long-context"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True).start()
    try:
        url = None
        while url is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            m = next((re.search(r"listening on (http://\S+)", line) for line in list(lines)
                      if "listening on" in line), None)
            url = m.group(1) if m else None
            time.sleep(0.1)
        result["start_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
        with httpx.Client(base_url=url, timeout=args.budget_s) as http:
            t = time.monotonic()
            doc = http.post("/v1/documents", json={"text": document, "name": "check"}).json()
            while doc["status"] == "ingesting":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the ingest did not finish within the budget: {doc}")
                time.sleep(0.05)
                doc = http.get(f"/v1/documents/{doc['id']}").json()
            result["ingest_s"] = round(time.monotonic() - t, 3)
            result["document"] = {k: doc[k] for k in ("status", "tokens", "chunks", "kv", "error")}
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.budget_s)
        model = client.models.list().data[0].id
        result.update(ask(client, model, [{"role": "user", "content": "What is the code word?"}],
                          extra_body={"document": doc["id"]}))
        plain = PLAIN_SENTENCE * (sentences // 2) + PLAIN_NEEDLE + " " + PLAIN_SENTENCE * (sentences // 2)
        result["plain_miss"] = ask(client, model, [{"role": "user", "content": plain + "\n\nWho sails at dawn?"}])
        result["plain_hit"] = ask(client, model, [{"role": "user", "content": plain + "\n\nWhat does she carry?"}])
        cached = (result["plain_hit"].get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        result["ok"] = bool(result["answer"] and result["plain_miss"]["answer"] and result["plain_hit"]["answer"]
                            and cached > 0)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        result["server_exit"] = server.returncode
        result["server_log"] = lines[-40:]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serve_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"serve check: ok={result['ok']} ingest {result.get('ingest_s')} s, first token "
          f"{result.get('time_to_first_token_s')} s, {result.get('inter_token_ms_median')} ms/token: "
          f"{result.get('answer', result.get('error'))!r}")
    for name in ("plain_miss", "plain_hit"):
        if name in result:
            r = result[name]
            print(f"serve check: {name}: first token {r.get('time_to_first_token_s')} s, cached tokens "
                  f"{(r.get('usage') or {}).get('prompt_tokens_details', {}).get('cached_tokens')}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
