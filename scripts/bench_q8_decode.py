#!/usr/bin/env python
"""Decode attention over an 8-bit KV cache on the CPU: the q8 kernels next to the bf16 ones.

    python scripts/bench_q8_decode.py [--rounds 11] [--no-evict] [--json out.json]

One decode step's two products over a long cache (csrc/cpu_kernels.c), SmolLM2's shape (9 query
heads, 3 KV heads, head dim 64, one token): `decode_scores` + `decode_pv` on a bf16 cache against
`decode_scores_q8` + `decode_pv_q8` on the same cache quantized to int8 and to fp8 (e4m3), and the
whole attention call around each (`attention_block` on the bf16 cache, `attention_block_quantized`
on the 8-bit one: the products plus the softmax in PyTorch). An 8-bit step reads half the bytes.

The variants alternate call by call (rotating the order each round), so that all see the same
machine state on a shared VM; shown are the median time of each and the median over rounds of the
per-round ratio to bf16. Before every call a 256 MB buffer is written, so that the cache comes
from memory as in a real step, where the other layers' caches have evicted it (--no-evict: hot).

Needs the CPU kernels (AVX-512 and a C compiler; the script says so and exits otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ringctx.attention import attention_block
from ringctx.attention.quant import attention_block_quantized, quantize_rows
from ringctx.kernels import build, cpu

HQ, HKV, D = 9, 3, 64
SHAPES = [(65536, 1), (65536, 2), (131072, 1), (131072, 2)]  # (cached tokens, threads)
VARIANTS = ("bf16", "int8", "fp8")


def time_shape(S: int, threads: int, rounds: int, evict: torch.Tensor | None) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(S)
    k, v = torch.randn(S, HKV, D, generator=g), torch.randn(S, HKV, D, generator=g)
    q = torch.randn(1, HQ, D, generator=g)
    qg = q.view(HKV, HQ // HKV, D).contiguous()  # T = 1: the rows of KV head h are its query heads
    probs = torch.rand(HKV, HQ // HKV, S, generator=g)
    scale = D ** -0.5
    caches = {"bf16": (k.bfloat16(), v.bfloat16())}
    for kind in ("int8", "fp8"):
        caches[kind] = quantize_rows(k, kind) + quantize_rows(v, kind)
    del k, v

    def kernels(name):
        if name == "bf16":
            kb, vb = caches[name]
            return lambda: (cpu.decode_scores(qg, kb, scale), cpu.decode_pv(probs, vb))
        kd, ks, vd, vs = caches[name]
        return lambda: (cpu.decode_scores_q8(qg, kd, ks, scale), cpu.decode_pv_q8(probs, vd, vs))

    def attention(name):
        if name == "bf16":
            kb, vb = caches[name]
            qb = q.bfloat16()
            return lambda: attention_block(qb, kb, vb)
        kd, ks, vd, vs = caches[name]
        return lambda: attention_block_quantized(q.bfloat16(), kd, ks, vd, vs)

    row = {"tokens": S, "threads": threads, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "evict": evict is not None}
    for what, make in (("kernels", kernels), ("attention", attention)):
        calls = {name: make(name) for name in VARIANTS}
        for f in calls.values():
            f()  # warm-up (and the kernel build)
        times = {name: [] for name in VARIANTS}
        for r in range(rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for name in order:
                if evict is not None:
                    evict.add_(1)
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
        for name in VARIANTS:
            row[f"{what}_{name}_s"] = times[name]
            row[f"{what}_{name}_median_s"] = statistics.median(times[name])
            if name != "bf16":
                row[f"{what}_{name}_ratio"] = statistics.median(a / b for a, b in zip(times[name], times["bf16"]))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=11, help="alternating calls of each variant per shape")
    p.add_argument("--no-evict", action="store_true", help="do not evict the cache before each call")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args()
    if build.library() is None:
        print(f"the CPU kernels are not available here: {build.kernel_error()}", file=sys.stderr)
        return 1

    from rich.console import Console
    from rich.table import Table

    evict = None if args.no_evict else torch.zeros(256 << 20, dtype=torch.uint8)
    rows = [time_shape(S, threads, args.rounds, evict) for S, threads in SHAPES]
    state = "hot cache" if args.no_evict else "cache evicted before each call"
    table = Table(title=f"decode attention, {HQ}/{HKV} heads, D {D}, 1 token: 8-bit vs bf16 cache "
                        f"({args.rounds} rounds, {state}; ms, ratio = paired median vs bf16)")
    for col in ("tokens", "threads", "bf16 kernels", "int8 kernels", "fp8 kernels", "bf16 call", "int8 call",
                "fp8 call"):
        table.add_column(col, justify="right")
    for r in rows:
        cells = [f"{r['tokens']:,}", str(r["threads"])]
        for what in ("kernels", "attention"):
            cells.append(f"{1e3 * r[f'{what}_bf16_median_s']:.2f}")
            cells += [f"{1e3 * r[f'{what}_{n}_median_s']:.2f} ({r[f'{what}_{n}_ratio']:.2f}x)" for n in ("int8", "fp8")]
        table.add_row(*cells)
    Console(width=140).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
