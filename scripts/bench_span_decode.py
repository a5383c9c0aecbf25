"""The fused decode step against the layer path on a model with windowed layers, in one process:
`smollm2-135m-sliding` (bf16, random weights) over one cache of --tokens random rows (no prefill),
the two alternated round by round on that cache, each round with its own read-bandwidth reading.

    python scripts/bench_span_decode.py [--tokens 32768] [--rounds 5] [--threads 2] [--model NAME]

Prints per round: the memory floor (`decode_bytes_per_token` at this machine's read bandwidth:
weights, and each layer's K/V rows it sees), the fused step's ms/token (median of 3) and the
layer path's (`forward_with_cache`: what runs where the fused step does not apply), both over the
floor; then the medians and the paired speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ringctx.kernels.cpu_features import cpu_model
from ringctx.model import KVCache
from ringctx.model.decode_step import DecodeStep
from ringctx.model.loader import load_model
from ringctx.planning.machine_speed import decode_bytes_per_token, read_bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-sliding")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="bfloat16")
    cache = KVCache.for_model(model.config, args.tokens + 8 * args.rounds + 8, dtype=model.dtype)
    g = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:  # random rows: a step's time does not depend on their values
        t[:args.tokens].copy_(torch.randn(t[:args.tokens].shape, generator=g).to(t.dtype) * 0.5)
    cache.length = args.tokens
    fused, layers = DecodeStep(model, cache), DecodeStep(model, cache, fused=False)
    if not fused.is_fused:
        raise SystemExit(f"the fused step does not apply to {args.model} here (no kernels?)")
    rounds = []
    with torch.inference_mode():
        fused(5), layers(5)  # warm-up
        for r in range(args.rounds):
            floor = 1e3 * decode_bytes_per_token(model, cache.length) / read_bandwidth(threads=args.threads)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fused(5)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            layers(5)
            fused_ms, layers_ms = statistics.median(times) * 1e3, (time.perf_counter() - t0) * 1e3
            rounds.append((fused_ms / floor, layers_ms / floor, layers_ms / fused_ms))
            print(f"round {r}: floor {floor:.2f} ms; fused {fused_ms:.2f} ms ({fused_ms / floor:.2f}x); "
                  f"layers {layers_ms:.1f} ms ({layers_ms / floor:.2f}x)", flush=True)
    print(f"{cpu_model()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.model}, {args.tokens} tokens, "
          f"{args.threads} threads: fused {statistics.median(r[0] for r in rounds):.2f}x the floor, layer path "
          f"{statistics.median(r[1] for r in rounds):.2f}x, paired speed-up {statistics.median(r[2] for r in rounds):.2f}x")


if __name__ == "__main__":
    main()
