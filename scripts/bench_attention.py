"""Causal ring attention at W = 2 on this machine, side by side with the floor and the peers.

    python scripts/bench_attention.py [--seqs 8192 32768] [--dtypes bfloat16 float32] [--json out.json]

Shapes: one sequence of S tokens, 8 query heads, 2 KV heads, head dim 64, causal. In one run:
  floor          single-process unsharded SDPA with 2 threads (two ranks share these 2 cores, so
                 this is the best W = 2 can hope for)
  ringctx-pass-kv / ringctx-pass-q     ring_attention at W = 2, one thread per rank
  torch-ring     PyTorch's private _templated_ring_attention (load balancing on, CPU flash op)
  lucidrains     ring_flash_attn of ring-attention-pytorch (float32 only: it fails in bf16 on CPU)
Each W = 2 time is the slowest rank's, after a barrier. The implementations are interleaved round
by round (floor, then each ring, then the next round), so that a machine whose speed drifts
affects all of them alike; the table shows the median of --repeats rounds and the ratio to the
floor, and the largest difference of each output from the floor's. "vs torch-ring" is the median
over rounds of (ringctx's time / PyTorch ring's time in the same round): pairing by round
cancels most of this shared machine's drift, which is larger than the differences measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringctx.parallel import ShardLayout, ring_attention
from ringctx.parallel.launch import RankPool

HQ, HKV, D = 8, 2, 64
WORLD = 2
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_inputs(seq: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seq)
    return [torch.randn(seq, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)]


def time_floor(seq: int, dtype: torch.dtype, repeats: int, warmup: bool = True):
    torch.set_num_threads(2)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in make_inputs(seq, dtype))
    if warmup:  # kernel selection, thread pool start
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        times.append(time.perf_counter() - t0)
    return times, out[0].transpose(0, 1)


def ring_job(rank: int, world: int, seq: int, dtype_name: str, impl: str, repeats: int, warmup: bool = True):
    """Runs on each rank: time `impl` `repeats` times; returns (times, this rank's output rows)."""
    dtype = DTYPES[dtype_name]
    q, k, v = make_inputs(seq, dtype)
    layout = ShardLayout.balanced([seq], world)  # head-tail: the same placement PyTorch's ring expects
    ql, kl, vl = (layout.shard(x, rank) for x in (q, k, v))
    if impl.startswith("ringctx"):
        strategy = impl.removeprefix("ringctx-")
        run = lambda: ring_attention(ql, kl, vl, layout, strategy=strategy)[0]  # noqa: E731
    elif impl == "torch-ring":
        from torch.distributed.tensor.experimental._attention import _cp_options, _templated_ring_attention

        _cp_options.enable_load_balance = True
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (ql, kl, vl))
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        run = lambda: _templated_ring_attention(  # noqa: E731
            dist.group.WORLD, 2, op, qb, kb, vb, is_causal=True)[0][0].transpose(0, 1)
    elif impl == "lucidrains":
        from ring_attention_pytorch import ring_flash_attn

        # It reads KV head j % Hkv for query head j (PyTorch: j // G): permute the query heads.
        group = HQ // HKV
        perm = [h * group + g for g in range(group) for h in range(HKV)]
        # Contiguous shards (no striping; its causal path masks without skipping blocks anyway).
        rows = slice(rank * seq // world, (rank + 1) * seq // world)
        qb, kb, vb = q[rows][:, perm].unsqueeze(0), k[rows].unsqueeze(0), v[rows].unsqueeze(0)

        def run():
            o = ring_flash_attn(qb, kb, vb, None, True, 1024, True, False)[0]
            out = torch.empty_like(o)
            out[:, perm] = o
            return out
    else:
        raise ValueError(impl)
    if warmup and (impl != "lucidrains" or seq <= 8192):  # lucidrains at 32K costs minutes per run
        run()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return times, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", nargs="+", default=["ringctx-pass-kv", "ringctx-pass-q", "torch-ring", "lucidrains"])
    parser.add_argument("--lucidrains-max-seq", type=int, default=32768,
                        help="skip lucidrains above this length (about 2 minutes per run at 32K)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)  # logs keep every column
    results = []
    with RankPool(WORLD, backend="gloo", threads_per_rank=1, timeout=1800) as pool:
        for seq in args.seqs:
            if seq % (2 * WORLD):
                raise SystemExit(f"--seqs must be multiples of {2 * WORLD} (PyTorch's balanced ring needs it)")
            for dtype_name in args.dtypes:
                impls = [i for i in args.impls
                         if i != "lucidrains" or (dtype_name == "float32" and seq <= args.lucidrains_max_seq)]
                floor_times, times, outs = [], {i: [] for i in impls}, {}
                for round_index in range(args.repeats):
                    t, floor_out = time_floor(seq, DTYPES[dtype_name], 1, warmup=round_index == 0)
                    floor_times += t
                    for impl in impls:
                        if impl == "lucidrains" and round_index > 0:
                            continue  # one run: about 2 minutes at 32K
                        per_rank = pool.run(ring_job, seq, dtype_name, impl, 1, round_index == 0)
                        times[impl].append(max(r[0][0] for r in per_rank))
                        outs[impl] = per_rank
                row = {"seq": seq, "dtype": dtype_name, "floor_s": statistics.median(floor_times),
                       "floor_min_s": min(floor_times), "floor_times_s": floor_times, "impls": {}}
                console.print(f"S={seq} {dtype_name}: floor {row['floor_s']:.3f}s")
                for impl in impls:
                    per_rank = outs[impl]
                    if impl == "lucidrains":
                        out = torch.cat([r[1] for r in per_rank])
                    else:
                        out = ShardLayout.balanced([seq], WORLD).unshard([r[1] for r in per_rank])
                    diff = (out.float() - floor_out.float()).abs().max().item()
                    med = statistics.median(times[impl])
                    row["impls"][impl] = {"median_s": med, "min_s": min(times[impl]), "times_s": times[impl],
                                          "ratio_to_floor": med / row["floor_s"], "max_abs_diff_vs_floor": diff}
                    if impl.startswith("ringctx") and "torch-ring" in times:
                        paired = [a / b for a, b in zip(times[impl], times["torch-ring"])]
                        row["impls"][impl]["paired_ratio_to_torch_ring"] = statistics.median(paired)
                        row["impls"][impl]["paired_ratios_to_torch_ring"] = paired
                    console.print(f"  {impl}: {med:.3f}s ({med / row['floor_s']:.2f}x floor), max|diff| {diff:.2e}")
                results.append(row)

    table = Table(title=f"Causal attention, W={WORLD}, Hq={HQ}, Hkv={HKV}, D={D} (median seconds, ratio to floor)")
    impls = [i for i in args.impls if any(i in r["impls"] for r in results)]
    paired_cols = [i for i in impls if i.startswith("ringctx") and "torch-ring" in impls]
    for col in ["S", "dtype", "floor (SDPA, 2 threads)", *impls, *(f"{i} vs torch-ring" for i in paired_cols)]:
        table.add_column(col, justify="right")
    for r in results:
        cells = [f"{r['seq'] // 1024}K", r["dtype"], f"{r['floor_s']:.3f}"]
        for impl in impls:
            m = r["impls"].get(impl)
            cells.append(f"{m['median_s']:.3f} ({m['ratio_to_floor']:.2f}x)" if m else "-")
        for impl in paired_cols:
            m = r["impls"].get(impl, {})
            cells.append(f"{m['paired_ratio_to_torch_ring']:.3f}" if "paired_ratio_to_torch_ring" in m else "-")
        table.add_row(*cells)
    console.print(table)
    if args.json_path:
        meta = {"torch": torch.__version__, "world": WORLD, "hq": HQ, "hkv": HKV, "d": D,
                "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M")}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
