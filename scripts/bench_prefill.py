"""End-to-end chunked prefill of SmolLM2-135M at W = 1 and W = 2, side by side in one run.

    python scripts/bench_prefill.py [--tokens 16384 65536] [--chunks 4096 16384] [--worlds 1 2]
                                    [--dtype auto] [--json out.json]

For each (tokens, chunk size, W) one `ringctx prefill` runs in a fresh Python process (a fresh
`Engine`; W = 1 runs inside that process, W = 2 spawns its ranks from it), so that no earlier
configuration's memory is counted in a later one's peak RSS: time to first token, tokens/s, the strategy mix,
bytes moved per rank, and peak RSS per rank against weights + KV shard. The memory check follows
issue 4: peak RSS while prefilling the chunks, less the RSS of an idle process that imported
torch, divided by (weights + KV shard), should be at most 1.3. The hand-off is reported on its
own: there the decode rank (rank 0) holds the whole KV cache, so its peak is divided by
(weights + full KV cache); the other ranks' by (weights + KV shard) again. W = 1 and W = 2 share this machine's cores, so W = 2 should come
within 1.25x of W = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import ringctx


def idle_torch_rss() -> int:
    """Peak RSS of a fresh Python process after `import torch` (the fixed cost of every rank)."""
    code = "import torch, resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run_one(tokens: int, chunk: int, world: int, dtype: str, repeats: int) -> dict:
    ids = torch.randint(0, 49152, (tokens,), generator=torch.Generator().manual_seed(0))
    with ringctx.Engine("smollm2-135m", nproc=world, dtype=dtype, chunk_tokens=chunk,
                        allow_long_context=True) as engine:
        engine.prefill(ids[: min(tokens, 2 * world * 64)], decode_room=0)  # warm-up (kernels, allocator)
        runs = [engine.prefill(ids, decode_room=0) for _ in range(repeats)]
        weights = weight_bytes(engine.model)
        model_dtype = str(engine.model.dtype).removeprefix("torch.")
    ttfts = [r.stats.ttft_s for r in runs]
    stats = runs[0].stats
    mix: dict[str, int] = {}
    for c in stats.chunks:
        mix[c.strategy] = mix.get(c.strategy, 0) + 1
    return {"tokens": tokens, "chunk_tokens": chunk, "world_size": world, "dtype": model_dtype,
            "ttft_s": statistics.median(ttfts), "ttft_runs_s": ttfts, "tokens_per_s": tokens / statistics.median(ttfts),
            "strategy_mix": mix, "bytes_sent_per_rank": stats.bytes_sent_per_rank,
            "peak_rss_bytes_per_rank": stats.peak_rss_bytes_per_rank,
            "handoff_peak_rss_bytes_per_rank": stats.handoff_peak_rss_bytes_per_rank,
            "kv_shard_bytes_per_rank": stats.kv_shard_bytes_per_rank, "weight_bytes": weights}


def run_in_fresh_process(tokens: int, chunk: int, world: int, dtype: str, repeats: int) -> dict:
    """run_one in a new interpreter (this script with --one), its row read back as JSON."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(tokens), str(chunk), str(world),
           "--dtype", dtype, "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"configuration T={tokens} chunk={chunk} W={world} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--one", type=int, nargs=3, metavar=("TOKENS", "CHUNK", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child of the main run: one configuration, its row as JSON on stdout
        print(json.dumps(run_one(*args.one, args.dtype, args.repeats)))
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)  # logs keep every column
    idle = idle_torch_rss()
    rows = []
    for tokens in args.tokens:
        for chunk in args.chunks:
            if chunk > tokens:
                continue
            for world in args.worlds:
                t0 = time.perf_counter()
                row = run_in_fresh_process(tokens, chunk, world, args.dtype, args.repeats)
                shards = row["kv_shard_bytes_per_rank"]
                row["memory_ratio_per_rank"] = [(rss - idle) / (row["weight_bytes"] + kv)
                                                for rss, kv in zip(row["peak_rss_bytes_per_rank"], shards)]
                held_after = [sum(shards)] + shards[1:]  # rank 0 gathers the whole cache
                row["handoff_memory_ratio_per_rank"] = [(rss - idle) / (row["weight_bytes"] + kv) for rss, kv
                                                        in zip(row["handoff_peak_rss_bytes_per_rank"], held_after)]
                rows.append(row)
                console.print(f"T={tokens} chunk={chunk} W={world}: TTFT {row['ttft_s']:.1f} s "
                              f"({row['tokens_per_s']:.0f} tok/s), mix {row['strategy_mix']} "
                              f"[{time.perf_counter() - t0:.0f} s wall]")
    base = {(r["tokens"], r["chunk_tokens"]): r["ttft_s"] for r in rows if r["world_size"] == 1}
    table = Table(title=f"SmolLM2-135M chunked prefill on {os.cpu_count()} cores (median TTFT of {args.repeats})")
    for col in ("tokens", "chunk", "W", "dtype", "TTFT s", "tokens/s", "vs W=1", "strategy mix", "sent/rank MiB",
                "peak RSS/rank MiB", "(RSS-idle)/(weights+KV)", "hand-off RSS/rank MiB", "hand-off ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        ref = base.get((r["tokens"], r["chunk_tokens"]))
        r["ratio_to_w1"] = r["ttft_s"] / ref if ref else None
        table.add_row(f"{r['tokens']:,}", f"{r['chunk_tokens']:,}", str(r["world_size"]), r["dtype"],
                      f"{r['ttft_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['ratio_to_w1']:.2f}x" if r["ratio_to_w1"] else "-",
                      ", ".join(f"{k} {v}" for k, v in r["strategy_mix"].items()),
                      "/".join(f"{b / 2**20:.0f}" for b in r["bytes_sent_per_rank"]),
                      "/".join(f"{b / 2**20:.0f}" for b in r["peak_rss_bytes_per_rank"]),
                      "/".join(f"{m:.2f}" for m in r["memory_ratio_per_rank"]),
                      "/".join(f"{b / 2**20:.0f}" for b in r["handoff_peak_rss_bytes_per_rank"]),
                      "/".join(f"{m:.2f}" for m in r["handoff_memory_ratio_per_rank"]))
    console.print(table)
    console.print(f"idle process after import torch: {idle / 2**20:.0f} MiB peak RSS")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"idle_torch_rss_bytes": idle, "date": time.strftime("%Y-%m-%d %H:%M"),
                       "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
