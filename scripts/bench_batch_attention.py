#!/usr/bin/env python
"""Decode attention of B questions about one document on the CPU: the one-pass kernel against the
two-pass one it replaced, per kernel variant, against the machine's read bandwidth.

    python scripts/bench_batch_attention.py [--rounds 7] [--tokens 8192 32768] [--batches 1 2 4 8 16]
                                            [--variants avx512 avx2 portable] [--json out.json]

The call continuous batching makes on every decode step, per layer: the B query tokens (one per
question) against the document's K/V, SmolLM2's shape (9 query heads, 3 KV heads, head dim 64),
`attention_block(q [B, 9, 64], k, v)` on a bf16 cache and `attention_block_quantized` on an fp8
one. "new" is that call (csrc/cpu_kernels.c `ringctx_decode_attention`: each K and V row read once
for all B x 9 query rows, online softmax, keys split over the threads); "old" is the path it
replaced, the two kernels `decode_scores` and `decode_pv` (or their q8 forms) with the softmax
between them in PyTorch, which also read each row once for all rows but write the [3, 3B, S] scores
out and back.

Old and new alternate call by call (the order flips every round), so that both see the same
machine state on a shared VM; shown are the median time of each, the median over rounds of the
per-round ratio new / old, and the bytes of K and V (with fp8's scales) read per call over the
median time as a fraction of the read bandwidth (ringctx.planning.machine_speed.read_bandwidth, measured in
the same run with the same threads). Each call reads the next of several layers' caches, together
at least twice the last-level cache, so that K and V come from memory as in a real decode step.
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

from ringctx.attention import attention_block
from ringctx.attention.kernels import group_queries, ungroup_rows
from ringctx.attention.quant import attention_block_quantized, quantize_rows
from ringctx.kernels import build, cpu
from ringctx.planning.machine_speed import read_bandwidth

HQ, HKV, D = 9, 3, 64
ROTATION_BYTES = 1 << 30  # the caches one shape's calls rotate over (> 2x this VM's 480 MiB L3)


def _old_two_pass(q, k, v, scale):
    """The path attention_block took before the one-pass kernel: scores out, softmax in PyTorch, PV."""
    qg = group_queries(q, HKV)
    scores = cpu.decode_scores(qg, k, scale)
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(row_max).exp_()
    row_sum = probs.sum(dim=-1, keepdim=True)
    out = cpu.decode_pv(probs, v).div_(row_sum)
    return ungroup_rows(out, (row_max + row_sum.log()).squeeze(-1), q.shape[0], q.dtype)


def _old_two_pass_q8(q, kd, ks, vd, vs, scale):
    qg = group_queries(q, HKV)
    scores = cpu.decode_scores_q8(qg, kd, ks, scale)
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(row_max).exp_()
    row_sum = probs.sum(dim=-1, keepdim=True)
    out = cpu.decode_pv_q8(probs, vd, vs).div_(row_sum)
    return ungroup_rows(out, (row_max + row_sum.log()).squeeze(-1), q.shape[0], q.dtype)


def layer_caches(S: int, cache: str) -> tuple[list, int]:
    """Copies of one random layer cache ([S, 3, 64] K and V, bf16 or fp8 with scales), enough of
    them to fill ROTATION_BYTES; and the bytes one call reads."""
    g = torch.Generator().manual_seed(S)
    k, v = torch.randn(S, HKV, D, generator=g), torch.randn(S, HKV, D, generator=g)
    one = (k.bfloat16(), v.bfloat16()) if cache == "bf16" else quantize_rows(k, "fp8") + quantize_rows(v, "fp8")
    nbytes = sum(t.numel() * t.element_size() for t in one)
    return [tuple(t.clone() for t in one) for _ in range(max(2, ROTATION_BYTES // nbytes))], nbytes


def time_pair(calls: dict, layers: list, rounds: int) -> dict:
    """Median seconds of old and new over `rounds` alternating calls, each on the next layer."""
    times = {name: [] for name in calls}
    at = 0
    for name in calls:  # warm-up (and the kernel build)
        calls[name](layers[0])
    for r in range(rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            at = (at + 1) % len(layers)
            t0 = time.perf_counter()
            calls[name](layers[at])
            times[name].append(time.perf_counter() - t0)
    return {"old_s": statistics.median(times["old"]), "new_s": statistics.median(times["new"]),
            "ratio": statistics.median(n / o for n, o in zip(times["new"], times["old"])), "times": times}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7, help="alternating calls of old and new per row")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--variants", nargs="+", default=[v.name for v in build.VARIANTS
                                                     if build.runs_here(v) is None])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args()
    if build.library() is None:
        print(f"the CPU kernels are not available here: {build.kernel_error()}", file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    bandwidth_before = read_bandwidth(threads=threads)
    scale = D ** -0.5
    rows = []
    for S in args.tokens:
        for cache in ("bf16", "fp8"):
            layers, nbytes = layer_caches(S, cache)
            for variant in args.variants:
                build.use_variant(variant)
                for B in args.batches:
                    q = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(B)).bfloat16()
                    if cache == "bf16":
                        calls = {"old": lambda c: _old_two_pass(q, c[0], c[1], scale),
                                 "new": lambda c: attention_block(q, c[0], c[1])}
                    else:
                        calls = {"old": lambda c: _old_two_pass_q8(q, *c, scale),
                                 "new": lambda c: attention_block_quantized(q, *c)}
                    row = {"tokens": S, "cache": cache, "variant": variant, "B": B, "kv_bytes": nbytes,
                           **time_pair(calls, layers, args.rounds)}
                    rows.append(row)
                    print(f"S={S} {cache} {variant} B={B}: old {1e3 * row['old_s']:.2f} ms, new "
                          f"{1e3 * row['new_s']:.2f} ms, new/old {row['ratio']:.2f}, new reads "
                          f"{nbytes / row['new_s'] / 1e9:.1f} GB/s", flush=True)
            build.use_variant(None)
            del layers
    bandwidth = max(bandwidth_before, read_bandwidth(threads=threads))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode attention, SmolLM2 shape ({HQ}/{HKV} heads, D {D}), B query tokens, {threads} threads, "
                        f"{args.rounds} rounds; read bandwidth {bandwidth / 1e9:.1f} GB/s; ms (median), new/old = "
                        "paired median ratio, 'of bw' = K/V bytes / new's median time / read bandwidth")
    for col in ("tokens", "cache", "variant", "B", "old ms", "new ms", "new/old", "new of bw", "old of bw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['tokens']:,}", r["cache"], r["variant"], str(r["B"]), f"{1e3 * r['old_s']:.2f}",
                      f"{1e3 * r['new_s']:.2f}", f"{r['ratio']:.2f}", f"{r['kv_bytes'] / r['new_s'] / bandwidth:.2f}",
                      f"{r['kv_bytes'] / r['old_s'] / bandwidth:.2f}")
    Console(width=160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "cpu": cpu, "threads": threads, "read_bandwidth_bytes_s": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
