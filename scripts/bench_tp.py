#!/usr/bin/env python
"""Tensor parallelism on this machine: peak memory per TP rank, and CP against TP for one prefill.

    python scripts/bench_tp.py memory  [--tp 1 2 3] [--model smollm2-135m] [--dtype float32] [--tokens 2048]
    python scripts/bench_tp.py prefill [--tokens 16384] [--rounds 2] [--dtype bfloat16]
    ... [--json out.json]

memory: for each TP size, T fresh ranks (gloo, one process each) build the (1, T) mesh, load their
shard of the model (a TP rank reads only its slices of a GGUF or safetensors file; presets draw
only their slices of the random weights), then prefill --tokens synthetic tokens. Reported per
rank: the peak RSS (Linux VmHWM) over loading and prefill, less the RSS of the same process after
it imported everything and ran a tiny model (the runtime every rank pays at any T), against the
target "weights / T + what is not sharded" = the bytes of the rank's own parameters (norms whole,
vocabulary, heads and MLP split) + its KV cache. For GGUF files it also prints what the gguf
package's reader takes to parse the file's metadata (the tokenizer's vocabulary): every rank pays
that while loading, at any T (the reader is dropped before the weights arrive, so the load peaks
at the larger of the two).

prefill: the same --tokens prefill (chunks of 4096) at (cp, tp) = (2, 1) and (1, 2) on 2 ranks, of
the qwen2.5-0.5b preset (random weights; 14 query / 2 KV heads: SmolLM2's 9 query heads do not
split over 2 TP ranks), alternating for --rounds rounds (a noisy machine slows both alike); the ratio is taken
within each round, then the median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench_decode import cpu_model  # scripts/ is on the path of a script run from it


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["memory", "prefill"])
    p.add_argument("--model", nargs="+", default=None,
                   help="memory: models (default smollm2-135m and the llama3.2-1b preset, random weights); "
                        "prefill: the model (default the qwen2.5-0.5b preset)")
    p.add_argument("--tp", type=int, nargs="+", default=None, help="memory: TP sizes (default per model)")
    p.add_argument("--dtype", default=None, help="default: float32 for memory, bfloat16 for prefill")
    p.add_argument("--tokens", type=int, default=None, help="default: 2048 for memory, 16384 for prefill")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--rank-job", nargs=5, help=argparse.SUPPRESS)  # internal: model tp rank port dtype
    return p.parse_args()


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------------- memory


DEFAULT_TP = {"smollm2-135m": [1, 3], "llama3.2-1b": [1, 2, 4]}  # 9 query heads: tp 1, 3; 32: tp 1, 2, 4


def rank_job(model_name: str, tp: int, rank: int, port: int, dtype: str, tokens: int) -> dict:
    """One rank of the memory run: join, load the shard, prefill; RSS readings as a dict."""
    import torch.distributed as dist

    from ringctx.runtime.prefill import PrefillConfig, cp_prefill
    from ringctx.model import load_model
    from ringctx.engine.startup import tensor_parallel
    from ringctx.parallel.mesh import build_mesh
    from ringctx.telemetry import reset_peak_rss

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    store = dist.TCPStore("127.0.0.1", port, tp, is_master=rank == 0, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp)
    mesh = build_mesh(tp, rank, tp, "cpu")
    # The runtime every rank pays at any T: modules, the CPU kernels, the allocator's arenas. A tiny
    # model's prefill in this process brings them in before the baseline is read.
    import gc

    import gguf  # noqa: F401  (the GGUF reader's modules)

    from ringctx.telemetry import release_free_memory

    warm = load_model("tiny", dtype=dtype, device="cpu")
    cp_prefill(warm, torch.arange(64), PrefillConfig(chunk_tokens=64), group="local")
    del warm
    gc.collect()
    release_free_memory()
    dist.barrier()
    reset_peak_rss()
    baseline = rss_bytes("VmRSS")
    t0 = time.perf_counter()
    model = load_model(model_name, dtype=dtype, device="cpu", tp=tensor_parallel(mesh, "cpu"))
    load_s = time.perf_counter() - t0
    after_load = rss_bytes("VmHWM")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    config = PrefillConfig(chunk_tokens=min(tokens, 1024), strategy="pass-kv")
    t0 = time.perf_counter()
    result = cp_prefill(model, ids, config, group=mesh.cp_group)
    prefill_s = time.perf_counter() - t0
    kv_bytes = result.cache.length * result.cache.bytes_per_token if result.cache is not None else 0
    peak = max(after_load, rss_bytes("VmHWM"))  # the prefill starts a new window (cp_prefill resets it)
    dist.destroy_process_group()
    return {"rank": rank, "baseline_rss": baseline, "load_peak_over_baseline": after_load - baseline,
            "peak_over_baseline": peak - baseline, "param_bytes": param_bytes, "kv_bytes": kv_bytes,
            "load_s": load_s, "prefill_s": prefill_s}


def gguf_reader_bytes(name: str) -> int:
    """Resident memory the gguf package's reader takes to parse a GGUF file's metadata (in a fresh
    process; 0 for models that are not GGUF files). Every rank pays it while loading, at any T."""
    from ringctx.model.presets import PRESETS

    if name in PRESETS and name != "smollm2-135m":
        return 0
    code = ("import gguf, sys; sys.path.insert(0, %r); from bench_tp import rss_bytes; "
            "from ringctx.model.loader import embedded_gguf_path, _classify_path; "
            "p = embedded_gguf_path() if %r == 'smollm2-135m' else _classify_path(%r)[1]; "
            "b = rss_bytes('VmRSS'); r = gguf.GGUFReader(p); print(rss_bytes('VmRSS') - b)"
            % (os.path.dirname(os.path.abspath(__file__)), name, name))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def run_memory(models: list[str], tps: list[int] | None, dtype: str, tokens: int) -> list[dict]:
    from ringctx.model.loader import load_model

    rows = []
    for name in models:
        full = load_model(name, dtype=dtype, device="meta")
        whole_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
        parse = gguf_reader_bytes(name)
        if parse:
            print(f"{name}: the gguf reader's metadata parse alone takes {parse / 2**20:.1f} MiB", flush=True)
        for tp in tps or DEFAULT_TP.get(name, [1, 2]):
            port = 29700 + tp + 10 * len(rows)
            procs = [subprocess.Popen([sys.executable, __file__, "memory", "--rank-job", name, str(tp), str(r), str(port),
                                       dtype, "--tokens", str(tokens)], stdout=subprocess.PIPE, text=True)
                     for r in range(tp)]
            results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            for r in results:
                r.update(model=name, tp=tp, dtype=dtype, tokens=tokens, whole_param_bytes=whole_bytes,
                         gguf_reader_bytes=parse)
                # weights / T + the unsharded rest: this rank's own parameters; plus its KV cache
                r["target"] = r["param_bytes"] + r["kv_bytes"]
                r["peak_over_target"] = r["peak_over_baseline"] / r["target"]
                rows.append(r)
                print(f"{name:14s} tp={tp} rank {r['rank']}: peak {r['peak_over_baseline'] / 2**20:8.1f} MiB over the "
                      f"runtime (load {r['load_peak_over_baseline'] / 2**20:8.1f}), own weights "
                      f"{r['param_bytes'] / 2**20:8.1f} MiB (whole model / T = {whole_bytes / tp / 2**20:8.1f}), "
                      f"KV {r['kv_bytes'] / 2**20:6.1f} MiB -> {r['peak_over_target']:.2f}x target; "
                      f"load {r['load_s']:.1f} s, prefill {r['prefill_s']:.1f} s", flush=True)
    return rows


# --------------------------------------------------------------------------------------- prefill


def one_prefill(model: str, cp: int, tp: int, tokens: int, dtype: str) -> dict:
    """A fresh `ringctx prefill` at (cp, tp) on cp * tp ranks; its JSON stats."""
    out = f"/tmp/ringctx-bench-tp-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "ringctx", "prefill", "--model", model, "--tokens", str(tokens), "--chunk-tokens", "4096",
           "--nproc", str(cp * tp), "--tp", str(tp), "--dtype", dtype, "--json", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        stats = json.load(f)
    os.unlink(out)
    return stats


def run_prefill(model: str, tokens: int, rounds: int, dtype: str) -> list[dict]:
    rows = []
    for round_index in range(rounds):
        order = [(2, 1), (1, 2)] if round_index % 2 == 0 else [(1, 2), (2, 1)]
        times = {}
        for cp, tp in order:
            stats = one_prefill(model, cp, tp, tokens, dtype)
            times[cp, tp] = stats["ttft_s"]
            rows.append({"round": round_index, "cp": cp, "tp": tp, "ttft_s": stats["ttft_s"],
                         "bytes_sent_per_rank": stats["bytes_sent_per_rank"],
                         "tp_bytes_per_rank": stats["tp_bytes_per_rank"],
                         "peak_rss_bytes_per_rank": stats["peak_rss_bytes_per_rank"],
                         "strategies": [c["strategy"] for c in stats["chunks"]]})
            print(f"round {round_index}: cp={cp} tp={tp}: {stats['ttft_s']:.1f} s, sent per rank "
                  f"{[round(b / 2**20, 1) for b in stats['bytes_sent_per_rank']]} MiB", flush=True)
        print(f"round {round_index}: (1,2) / (2,1) = {times[1, 2] / times[2, 1]:.2f}", flush=True)
    ratios = [r12["ttft_s"] / r21["ttft_s"] for r21, r12 in zip(
        [r for r in rows if r["tp"] == 1], [r for r in rows if r["tp"] == 2])]
    print(f"median ratio TP 2 / CP 2 time: {statistics.median(ratios):.2f} over {len(ratios)} rounds")
    return rows


def main() -> None:
    args = parse_args()
    if args.rank_job:
        name, tp, rank, port, dtype = args.rank_job
        print(json.dumps(rank_job(name, int(tp), int(rank), int(port), dtype, args.tokens or 2048)))
        return
    if args.what == "memory":
        rows = run_memory(args.model or ["smollm2-135m", "llama3.2-1b"], args.tp, args.dtype or "float32",
                          args.tokens or 2048)
    else:
        rows = run_prefill((args.model or ["qwen2.5-0.5b"])[0], args.tokens or 16384, args.rounds,
                           args.dtype or "bfloat16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "what": args.what,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
