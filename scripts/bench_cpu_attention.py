#!/usr/bin/env python
"""One attention block on the CPU: ringctx's kernel next to PyTorch's fused CPU op.

    python scripts/bench_cpu_attention.py [--kernel amx|float32|float32-bf16] [--rounds 9] [--json out.json]
    python scripts/bench_cpu_attention.py --window 1024 [--kernel ...] [--threads 1]

--kernel amx (default): the bf16 AMX kernel (csrc/cpu_attention_amx.c), on bf16 inputs; needs a
CPU with AMX-BF16 (the script says so and exits otherwise). --kernel float32: the float32 flash
kernel (csrc/cpu_flash.c), on float32 inputs, the variant RINGCTX_CPU_ISA names or the widest this
CPU runs; to measure it as on a CPU without AVX-512, cap PyTorch too: `RINGCTX_CPU_ISA=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`. --kernel
float32-bf16: the same kernel on bf16 inputs, widened as it reads them (what a bf16 model's prefill
runs on a CPU without bf16 units), PyTorch's float32 op on their float32 copies.

Both sides get the same inputs (head-major memory, as the ring hands them over), alternating call
by call, so that both see the same machine state: on a shared VM a core's speed changes within
seconds (for instance when the other hardware thread of its physical core gets busy). Shown per
block: the median time of each, its GFLOP/s (a causal block counted at half its area), and the
median over rounds of the per-round ratio (ringctx / PyTorch). The shapes are the ring's blocks at
W = 2 for 8K and 32K tokens (8/2 heads, D 64), a D = 128 block (Llama-3), and SmolLM2's prefill
blocks (9/3 heads; float32: the blocks `ringctx prefill` runs at W = 2, one thread a rank).

--window W: instead, ringctx's kernel alone on a sliding-window block (8K x 8K, 8/2 heads, D 64,
causal, window W: each query sees its last W keys) next to the full causal block of the same
shape, alternating call by call; shown: both medians and their paired ratio. The kernels skip the
key tiles outside the band, so the ratio should approach the work's, about W / (S / 2) plus the
band's ragged ends (a unit of queries spans a band wider than W by its own length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ringctx.attention import attention_block
from ringctx.kernels import build, cpu, selection

# (name, queries, keys, query heads, KV heads, head dim, causal, threads)
FLOAT32_BLOCKS = [
    ("2K x 2K causal, 9/3 heads", 2048, 2048, 9, 3, 64, True, 1),
    ("2K x 4K full, 9/3 heads", 2048, 4096, 9, 3, 64, False, 1),
    ("1K x 6K full, 9/3 heads", 1024, 6144, 9, 3, 64, False, 1),
    ("4K x 4K causal", 4096, 4096, 8, 2, 64, True, 1),
    ("4K x 4K causal, D 128", 4096, 4096, 8, 2, 128, True, 1),
    ("4K x 4K causal, 9/3 heads, 2 threads", 4096, 4096, 9, 3, 64, True, 2),
    ("2K x 4K full, 9/3 heads, 2 threads", 2048, 4096, 9, 3, 64, False, 2),
]
BLOCKS = [
    ("4K x 4K causal", 4096, 4096, 8, 2, 64, True, 1),
    ("2K x 4K full", 2048, 4096, 8, 2, 64, False, 1),
    ("16K x 16K causal", 16384, 16384, 8, 2, 64, True, 1),
    ("4K x 4K causal, D 128", 4096, 4096, 8, 2, 128, True, 1),
    ("8K x 8K causal, 9/3 heads, 2 threads", 8192, 8192, 9, 3, 64, True, 2),
]


def head_major(rows: int, heads: int, dim: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(heads, rows, dim, generator=generator).to(dtype).transpose(0, 1)


def time_block(kernel, name, T, S, hq, hkv, d, causal, threads, rounds):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(T + S + d)
    dtype = torch.float32 if kernel == "float32" else torch.bfloat16
    q, k, v = head_major(T, hq, d, g, dtype), head_major(S, hkv, d, g, dtype), head_major(S, hkv, d, g, dtype)
    if kernel == "amx":
        ours = lambda: attention_block(q, k, v, causal=causal, backend="amx")  # noqa: E731
    else:
        ours = lambda: cpu.flash_attention(q, k, v, causal=causal, scale=d ** -0.5)  # noqa: E731
    if kernel == "float32-bf16":  # PyTorch's float32 op on the float32 copies of the same values
        q32, k32, v32 = q.float(), k.float(), v.float()
        theirs = lambda: attention_block(q32, k32, v32, causal=causal, backend="torch")  # noqa: E731
    else:
        theirs = lambda: attention_block(q, k, v, causal=causal, backend="torch")  # noqa: E731
    calls = {"ringctx": ours, "torch": theirs}
    outs = {b: f() for b, f in calls.items()}  # warm-up; also the outputs compared below
    times = {b: [] for b in calls}
    for r in range(rounds):
        for b in (("ringctx", "torch") if r % 2 == 0 else ("torch", "ringctx")):
            t0 = time.perf_counter()
            calls[b]()
            times[b].append(time.perf_counter() - t0)
    ratios = [a / t for a, t in zip(times["ringctx"], times["torch"])]
    flops = 4 * T * S * hq * d * (0.5 if causal else 1.0)
    return {"block": name, "queries": T, "keys": S, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "causal": causal, "threads": threads, "ringctx_s": times["ringctx"], "torch_s": times["torch"],
            "ringctx_median_s": statistics.median(times["ringctx"]),
            "torch_median_s": statistics.median(times["torch"]),
            "ringctx_gflops": flops / statistics.median(times["ringctx"]) / 1e9,
            "torch_gflops": flops / statistics.median(times["torch"]) / 1e9,
            "paired_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "max_abs_diff": (outs["ringctx"][0].float() - outs["torch"][0].float()).abs().max().item()}


WINDOW_BLOCK = (8192, 8192, 8, 2, 64)  # queries, keys, query heads, KV heads, head dim


def time_window(kernel, window, threads, rounds):
    """The kernel on WINDOW_BLOCK causal with `window` against the same block without one."""
    T, S, hq, hkv, d = WINDOW_BLOCK
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(T + S + d)
    dtype = torch.float32 if kernel == "float32" else torch.bfloat16
    q, k, v = head_major(T, hq, d, g, dtype), head_major(S, hkv, d, g, dtype), head_major(S, hkv, d, g, dtype)
    run = cpu.amx_attention if kernel == "amx" else cpu.flash_attention
    calls = {"windowed": lambda: run(q, k, v, causal=True, window=window, scale=d ** -0.5),
             "full causal": lambda: run(q, k, v, causal=True, scale=d ** -0.5)}
    for f in calls.values():  # warm-up
        f()
    times = {b: [] for b in calls}
    for r in range(rounds):
        for b in (("windowed", "full causal") if r % 2 == 0 else ("full causal", "windowed")):
            t0 = time.perf_counter()
            calls[b]()
            times[b].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["windowed"], times["full causal"])]
    return {"block": f"{T // 1024}K x {S // 1024}K causal, {hq}/{hkv} heads, D {d}", "window": window,
            "threads": threads, "windowed_s": times["windowed"], "full_causal_s": times["full causal"],
            "windowed_median_s": statistics.median(times["windowed"]),
            "full_causal_median_s": statistics.median(times["full causal"]),
            "paired_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            # the visible (query, key) pairs of each, per head: the work the ratio should follow
            "work_ratio": sum(min(window, i + 1) for i in range(T)) / (T * (T + 1) / 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=("amx", "float32", "float32-bf16"), default="amx",
                   help="which of ringctx's kernels (float32-bf16: the float32 kernel on bf16 inputs)")
    p.add_argument("--rounds", type=int, default=9, help="alternating calls of each per block")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--window", type=int, default=0,
                   help="time a sliding-window block of this window against the full causal one instead")
    p.add_argument("--threads", type=int, default=1, help="threads for --window")
    args = p.parse_args()
    if args.kernel == "amx" and not selection.amx_available():
        print(f"the AMX kernel is not available here: {selection.amx_unavailable_reason()}", file=sys.stderr)
        return 1
    if args.kernel != "amx" and build.active_variant() is None:
        print(f"the CPU kernels are not available here: {build.kernel_error()}", file=sys.stderr)
        return 1

    from rich.console import Console
    from rich.table import Table

    from ringctx.kernels.cpu_features import cpu_model

    variant = "AMX" if args.kernel == "amx" else f"float32 flash, {build.active_variant().name}"
    if args.kernel == "float32-bf16":
        variant += ", bf16 inputs"
    if args.window > 0:
        r = time_window(args.kernel, args.window, args.threads, args.rounds)
        table = Table(title=f"{cpu_model()}: ringctx ({variant}), window {args.window} vs full causal "
                            f"({args.rounds} rounds, {args.threads} thread(s))")
        for col in ("block", "windowed", "full causal", "ratio (paired)", "range", "work ratio"):
            table.add_column(col, justify="left" if col == "block" else "right")
        table.add_row(r["block"], f"{r['windowed_median_s'] * 1e3:.1f} ms", f"{r['full_causal_median_s'] * 1e3:.1f} ms",
                      f"{r['paired_ratio']:.3f}", f"{r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}",
                      f"{r['work_ratio']:.3f}")
        Console(width=120).print(table)
        rows = [r]
    else:
        rows = [time_block(args.kernel, *block, args.rounds) for block in
                (BLOCKS if args.kernel == "amx" else FLOAT32_BLOCKS)]
        print_table(rows, variant, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "torch": torch.__version__,
                       "kernel": args.kernel, "rounds": args.rounds, "window": args.window, "results": rows}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


def print_table(rows, variant, rounds):
    from rich.console import Console
    from rich.table import Table

    from ringctx.kernels.cpu_features import cpu_model

    table = Table(title=f"{cpu_model()}: attention block, ringctx ({variant}) vs PyTorch's CPU op "
                        f"({rounds} rounds)")
    for col in ("block", "ringctx", "PyTorch", "GFLOP/s", "ratio (paired)", "range", "max |diff|"):
        table.add_column(col, justify="left" if col == "block" else "right")
    for r in rows:
        table.add_row(r["block"], f"{r['ringctx_median_s'] * 1e3:.1f} ms", f"{r['torch_median_s'] * 1e3:.1f} ms",
                      f"{r['ringctx_gflops']:.0f} / {r['torch_gflops']:.0f}", f"{r['paired_ratio']:.3f}",
                      f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}", f"{r['max_abs_diff']:.1e}")
    Console(width=120).print(table)


if __name__ == "__main__":
    sys.exit(main())
