#!/usr/bin/env python
"""One attention block on the CPU: ringctx's AMX kernel next to PyTorch's fused CPU op.

    python scripts/bench_cpu_attention.py [--rounds 9] [--json out.json]

Both are called through `ringctx.attention.attention_block` on the same bf16 inputs (head-major
memory, as the ring hands them over), `backend="amx"` against `backend="torch"`, alternating call
by call, so that both see the same machine state: on a shared VM a core's speed changes within
seconds (for instance when the other hardware thread of its physical core gets busy). Shown per
block: the median time of each, and the median over rounds of the per-round ratio (AMX / PyTorch).
The shapes are the ring's blocks at W = 2 for 8K and 32K tokens (8/2 heads, D 64), a D = 128
block (Llama-3), and SmolLM2's 8K prefill block (9/3 heads) with 2 threads.

Needs a CPU with AMX-BF16 (the script says so and exits otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ringctx import cpu_kernels
from ringctx.attention import attention_block

# (name, queries, keys, query heads, KV heads, head dim, causal, threads)
BLOCKS = [
    ("4K x 4K causal", 4096, 4096, 8, 2, 64, True, 1),
    ("2K x 4K full", 2048, 4096, 8, 2, 64, False, 1),
    ("16K x 16K causal", 16384, 16384, 8, 2, 64, True, 1),
    ("4K x 4K causal, D 128", 4096, 4096, 8, 2, 128, True, 1),
    ("8K x 8K causal, 9/3 heads, 2 threads", 8192, 8192, 9, 3, 64, True, 2),
]


def head_major(rows: int, heads: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(heads, rows, dim, generator=generator).bfloat16().transpose(0, 1)


def time_block(name, T, S, hq, hkv, d, causal, threads, rounds):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(T + S + d)
    q, k, v = head_major(T, hq, d, g), head_major(S, hkv, d, g), head_major(S, hkv, d, g)
    calls = {b: (lambda b=b: attention_block(q, k, v, causal=causal, backend=b)) for b in ("amx", "torch")}
    outs = {b: f() for b, f in calls.items()}  # warm-up; also the outputs compared below
    times = {b: [] for b in calls}
    for r in range(rounds):
        for b in (("amx", "torch") if r % 2 == 0 else ("torch", "amx")):
            t0 = time.perf_counter()
            calls[b]()
            times[b].append(time.perf_counter() - t0)
    ratios = [a / t for a, t in zip(times["amx"], times["torch"])]
    return {"block": name, "queries": T, "keys": S, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "causal": causal, "threads": threads, "amx_s": times["amx"], "torch_s": times["torch"],
            "amx_median_s": statistics.median(times["amx"]), "torch_median_s": statistics.median(times["torch"]),
            "paired_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "max_abs_diff": (outs["amx"][0].float() - outs["torch"][0].float()).abs().max().item()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9, help="alternating calls of each per block")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args()
    if not cpu_kernels.amx_available():
        print(f"the AMX kernel is not available here: {cpu_kernels.amx_unavailable_reason()}", file=sys.stderr)
        return 1

    from rich.console import Console
    from rich.table import Table

    rows = [time_block(*block, args.rounds) for block in BLOCKS]
    table = Table(title=f"bf16 attention block, ringctx AMX kernel vs PyTorch's CPU op ({args.rounds} rounds)")
    for col in ("block", "AMX kernel", "PyTorch op", "AMX / PyTorch (paired)", "per-round range", "max |diff|"):
        table.add_column(col, justify="left" if col == "block" else "right")
    for r in rows:
        table.add_row(r["block"], f"{r['amx_median_s'] * 1e3:.1f} ms", f"{r['torch_median_s'] * 1e3:.1f} ms",
                      f"{r['paired_ratio']:.3f}", f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}",
                      f"{r['max_abs_diff']:.2e}")
    Console(width=160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "rounds": args.rounds,
                       "results": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
