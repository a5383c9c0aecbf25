#!/usr/bin/env python
"""Many questions about one document decoded together: aggregate tokens/s, inter-token time, bytes.

    python scripts/bench_batch.py [--tokens 8192] [--kv-dtypes model fp8] [--concurrency 1 2 4 8 16]
                                  [--steps 32] [--rounds 3] [--decode-ranks 2] [--weights model int8]
                                  [--json out.json]

SmolLM2-135M in bf16, one document of --tokens random token ids prefilled over the decode ranks
(all the ranks: --decode-ranks, 2 by default). For each KV storage (the model dtype, fp8) and each
concurrency B, B questions (8 tokens each, different) join the engine's batch and decode --steps
greedy tokens together (Engine.batch: one step for all, the document's rows read once per step for
all B); beside them, in the same run, the lone path (Engine.generate: one question, the fused decode
step). Per configuration:

    step_ms            median time of one batched step (= each request's inter-token time)
    tokens_per_s       aggregate answer tokens per second: B / step
    vs_lone            tokens_per_s over the lone path's, paired within each round, median
    itl_vs_b1          the inter-token time over B = 1's, paired within each round, median
    bytes_per_step     what a step must read at least (machine_speed.decode_bytes_per_token, the decode
                       floor's own count): the weights once, the document's KV rows
                       once, every question's own rows
    floor_ms           bytes_per_step / the read bandwidth measured here (ringctx.planning.machine_speed)
    vs_floor           step_ms / floor_ms

The configurations alternate within each round (a machine whose speed drifts slows all alike);
ratios are taken within a round, then their median. Prints a table and writes --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

MODEL = "smollm2-135m"
QUESTION_TOKENS = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="document length in tokens")
    p.add_argument("--kv-dtypes", nargs="+", default=["model", "fp8"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-ranks", type=int, default=2)
    p.add_argument("--weights", nargs="+", choices=["model", "int8"], default=["model"],
                   help="weights formats to run, each with every kv dtype (int8: ringctx.model.int8_weights)")
    p.add_argument("--json", metavar="PATH", default="bench_batch.json")
    return p.parse_args()


def questions(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (QUESTION_TOKENS,), generator=g).tolist() for _ in range(count)]


def time_batch(engine, document, qs: list[list[int]], steps: int) -> list[float]:
    """Seconds of each of `steps` batched steps with every question of `qs` running."""
    batch = engine.batch()
    members = [batch.join(document, q, max_new_tokens=steps + 1, stop_token_ids=[]) for q in qs]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - t0)
    for member in members:
        batch.leave(member)
    return times


def time_lone(engine, document, q: list[int], steps: int) -> list[float]:
    """Seconds of each decode step of one answer on the lone path (Engine.generate)."""
    generation = engine.generate(document, q, max_new_tokens=steps + 1, stop_token_ids=[])
    "".join(generation)
    return list(generation.result.token_times_s)


def run_kv_dtype(args, kv_dtype: str, weights: str, bandwidth: float) -> list[dict]:
    from ringctx.engine import Engine
    from ringctx.planning.machine_speed import decode_bytes_per_token

    rows = []
    with Engine(MODEL, nproc=args.decode_ranks, dtype="bfloat16", kv_dtype=kv_dtype, allow_long_context=True,
                decode_ranks=args.decode_ranks, weights=weights) as engine:
        vocab = engine.model.config.vocab_size
        ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        t0 = time.perf_counter()
        document = engine.ingest(ids, chunk_tokens=min(args.tokens, 4096))
        print(f"weights {weights}, kv {kv_dtype}: {args.tokens} tokens prefilled in {time.perf_counter() - t0:.0f} s", flush=True)
        kv_per_token = document.cache.bytes_per_token  # every KV head of every layer, this storage
        qs = questions(max(args.concurrency), vocab)
        lone, batched = [], {b: [] for b in args.concurrency}
        for _ in range(args.rounds):
            lone.append(statistics.median(time_lone(engine, document, qs[0], args.steps)))
            for b in args.concurrency:
                batched[b].append(statistics.median(time_batch(engine, document, qs[:b], args.steps)))
        for b in args.concurrency:
            own = b * (QUESTION_TOKENS + args.steps // 2)  # each question's own rows, on average over the steps
            nbytes = decode_bytes_per_token(engine.model, args.tokens + own, kv_per_token)
            step = statistics.median(batched[b])
            rows.append({
                "weights": weights, "kv_dtype": kv_dtype, "batch": b, "step_ms": 1000 * step, "tokens_per_s": b / step,
                "vs_lone": statistics.median(b * lone[r] / batched[b][r] for r in range(args.rounds)),
                "itl_vs_b1": statistics.median(batched[b][r] / batched[args.concurrency[0]][r]
                                               for r in range(args.rounds)),
                "bytes_per_step": nbytes, "floor_ms": 1000 * nbytes / bandwidth,
                "vs_floor": step / (nbytes / bandwidth), "step_ms_rounds": [1000 * t for t in batched[b]]})
        nbytes = decode_bytes_per_token(engine.model, args.tokens + QUESTION_TOKENS + args.steps // 2, kv_per_token)
        rows.append({"weights": weights, "kv_dtype": kv_dtype, "batch": "lone", "step_ms": 1000 * statistics.median(lone),
                     "tokens_per_s": 1 / statistics.median(lone), "vs_lone": 1.0, "itl_vs_b1": None,
                     "bytes_per_step": nbytes, "floor_ms": 1000 * nbytes / bandwidth,
                     "vs_floor": statistics.median(lone) / (nbytes / bandwidth),
                     "step_ms_rounds": [1000 * t for t in lone]})
    return rows


def main() -> int:
    args = parse_args()
    from ringctx.kernels.cpu_features import cpu_model
    from ringctx.planning.machine_speed import read_bandwidth

    bandwidth = read_bandwidth()
    print(f"{cpu_model()}: read bandwidth {bandwidth / 1e9:.1f} GB/s; SmolLM2 bf16, {args.tokens} tokens, "
          f"{args.decode_ranks} decode ranks, {args.steps} steps x {args.rounds} rounds", flush=True)
    rows = []
    for weights in args.weights:
        for kv_dtype in args.kv_dtypes:
            rows += run_kv_dtype(args, kv_dtype, weights, bandwidth)
    print(f"{'W':>5} {'kv':>6} {'B':>5} {'step ms':>8} {'tok/s':>8} {'vs lone':>8} {'ITL/B1':>7} {'MB/step':>8} "
          f"{'floor ms':>9} {'vs floor':>9}")
    for r in rows:
        itl = f"{r['itl_vs_b1']:.2f}" if r["itl_vs_b1"] is not None else "-"
        print(f"{r['weights']:>5} {r['kv_dtype']:>6} {str(r['batch']):>5} {r['step_ms']:8.1f} {r['tokens_per_s']:8.1f} "
              f"{r['vs_lone']:8.2f} {itl:>7} {r['bytes_per_step'] / 1e6:8.1f} {r['floor_ms']:9.1f} "
              f"{r['vs_floor']:9.2f}")
    report = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "machine": platform.machine(),
              "read_bandwidth_bytes_per_s": bandwidth, "model": MODEL, "dtype": "bfloat16", "args": vars(args),
              "rows": rows}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
