#!/usr/bin/env python
"""Per-token step time of batched decode: the fused batch kernel against the PyTorch batch path,
beside a lone answer, alternating in one process.

    python scripts/bench_batch_decode.py [--rounds 3] [--threads N] [--model smollm2-135m]

One Engine (nproc=1) with a 2048-token random document. Each round runs, for each side ("fused":
BatchDecoder's FusedBatchStep, "torch": its PyTorch layer-by-layer path), a lone answer
(Engine.generate: the fused step with one row, the same on both sides) and ask_many with B = 1, 4, 8
questions; 24 tokens each, no stop token. A step's time is the median of question 0's
token_times_s. Printed: every round, then per-row medians and the paired ratios.
"""

import argparse
import statistics

import torch

import ringctx

QUESTIONS = ["What is the code?", "Who wrote this?", "Summarize the text.", "What number appears first?",
             "Name a place mentioned.", "What is the last word?", "Is there a date?", "What language is it?"]
BATCHES = (1, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}", flush=True)
    kw = {"max_new_tokens": 24, "temperature": 0, "stop_token_ids": []}
    with ringctx.Engine(args.model, nproc=1, allow_long_context=True) as engine:
        doc = engine.ingest(torch.randint(100, 20000, (2048,)))
        for _ in engine.ask_many(doc, QUESTIONS[:1], **kw):  # creates the batch decoder (and warms up)
            pass
        decoder = engine.state.batch
        fused = decoder._fused
        print(f"fused batch step available: {fused is not None}", flush=True)
        times: dict[tuple, list[float]] = {}
        for r in range(args.rounds):
            for side in ("fused", "torch"):
                decoder._fused = fused if side == "fused" else None
                lone = engine.generate(doc, torch.randint(100, 20000, (12,)), **kw)
                "".join(lone)
                times.setdefault(("lone", side), []).append(statistics.median(lone.result.token_times_s))
                for b in BATCHES:
                    many = engine.ask_many(doc, QUESTIONS[:b], **kw)
                    for _ in many:
                        pass
                    times.setdefault((b, side), []).append(statistics.median(many.results[0].token_times_s))
                print(f"round {r} {side:5s}: " + ", ".join(f"{k[0]} {v[-1] * 1e3:6.1f} ms" for k, v in times.items()
                                                         if k[1] == side), flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        lone = statistics.median(times[("lone", "fused")] + times[("lone", "torch")])
        print(f"lone answer's step (both sides' rounds): {lone * 1e3:.1f} ms")
        for b in BATCHES:
            f, t = med[(b, "fused")], med[(b, "torch")]
            print(f"B={b}: fused {f * 1e3:.1f} ms, torch {t * 1e3:.1f} ms per step; torch/fused {t / f:.2f}x; "
                  f"fused/lone {f / lone:.2f}x; fused per token {f / b * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
