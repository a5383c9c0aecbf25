#!/usr/bin/env python
"""Answers in flight while a burst of new questions joins the batch, by `--join-share`.

    python scripts/bench_join_burst.py [--tokens 8000] [--burst 8] [--join-shares 1e9 1.0] [--rounds 2]

In process (ringctx.engine.Scheduler over Engine(nproc=1, dtype="auto"), the layout `ringctx serve`
picks on a small CPU): one document of --tokens tokens is ingested; per join share and round, two
greedy answers about it stream (150 tokens each), and once each has 6 tokens, --burst new
questions about the same document arrive at once (submitted between two steps). Reported: the two
running answers' inter-token gap without the burst (their median), their largest and median gap
while the burst joins (from its arrival to the last burst question's first token), and the burst
questions' median and last time to first token. A join share of 1e9 is the bound switched off
(every question that fits the token budget joins in the step it arrives).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import bench_serve  # its neighbour in scripts/ (on the path when run as a script)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8000, help="the document's length in tokens")
    p.add_argument("--burst", type=int, default=8, help="questions arriving at once")
    p.add_argument("--join-shares", type=float, nargs="+", default=[1e9, 1.0], help="Scheduler join_share settings")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.burst + 2 > len(bench_serve.QUESTIONS):
        p.error(f"at most {len(bench_serve.QUESTIONS) - 2} questions in a burst")

    import torch

    from ringctx.kernels.cpu_features import cpu_model
    from ringctx.engine import Engine
    from ringctx.engine.scheduler import Scheduler, Text
    from ringctx.engine.work_items import Prefill, Question
    from ringctx.model.loader import embedded_gguf_path
    from ringctx.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(embedded_gguf_path())
    text, _ = bench_serve.make_document(args.tokens, 1, tokenizer)
    scheduler = Scheduler(lambda: Engine(nproc=1, dtype="auto", allow_long_context=True))
    engine = scheduler.engine
    rendered, suffix = engine.document_text(text)
    ids = torch.tensor(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    # questions framed as `ringctx serve` frames them
    ingest = Prefill(ids, as_document=True, decode_room=512, frame=(suffix, {"chat": True}))
    document = scheduler.submit_prefill(ingest).wait().document
    questions = [scheduler.call(lambda q=q: engine.question_ids(document, q)) for q in bench_serve.QUESTIONS]
    bench_serve.log(f"{cpu_model()}, {os.cpu_count()} cores; {document.length:,}-token document, bf16; "
                    f"2 answers in flight, a burst of {args.burst}")

    def ask(i: int, max_new_tokens: int):
        sampling = dict(max_new_tokens=max_new_tokens, temperature=0)
        return scheduler.submit_question(Question(questions[i], len(questions[i]), sampling, document=document))

    def arrivals(ticket, times: list) -> None:
        for event in ticket:
            if isinstance(event, Text):
                times.append(time.perf_counter())

    print(f"{'join share':>10} {'quiet':>7} {'largest gap':>12} {'x':>5} {'median gap':>11} {'TTFT median':>12} "
          f"{'TTFT last':>10}")
    try:
        for share in args.join_shares:
            for _ in range(args.rounds):
                scheduler.join_share = share
                running = [[], []]
                threads = [threading.Thread(target=arrivals, args=(ask(i, 150), running[i])) for i in range(2)]
                for t in threads:
                    t.start()
                while min(len(r) for r in running) < 6:
                    time.sleep(0.005)
                t0 = time.perf_counter()
                burst = scheduler.call(lambda: [ask(2 + i, 24) for i in range(args.burst)])
                firsts = [[] for _ in burst]
                burst_threads = [threading.Thread(target=arrivals, args=(b, f)) for b, f in zip(burst, firsts)]
                for t in burst_threads:
                    t.start()
                for t in burst_threads + threads:
                    t.join()
                t1 = max(f[0] for f in firsts)
                quiet = statistics.median(b - a for r in running for a, b in zip(r, r[1:]) if b < t0)
                inside = [b - a for r in running for a, b in zip(r, r[1:]) if a < t1 and b > t0]
                ttft = sorted(f[0] - t0 for f in firsts)
                print(f"{share:>10g} {1e3 * quiet:>5.1f}ms {1e3 * max(inside):>10.0f}ms {max(inside) / quiet:>5.1f} "
                      f"{1e3 * statistics.median(inside):>9.0f}ms {1e3 * statistics.median(ttft):>10.0f}ms "
                      f"{1e3 * ttft[-1]:>8.0f}ms", flush=True)
    finally:
        scheduler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
