#!/usr/bin/env python
"""Decode over a KV cache split across decode ranks: ms per token and peak memory per decode rank.

    python scripts/bench_decode.py [--contexts 8192 32768 131072] [--decode-ranks 1 2]
                                   [--kv-dtypes model fp8 int8] [--steps 32] [--rounds 2] [--json out.json]

Each context is prefilled once (SmolLM2-135M, bf16, two ranks, random token ids) and saved as a
document under --docs; contexts of --tile-above tokens or more are instead the largest prefilled
context's KV rows repeated (a 128K prefill takes about an hour on 2 cores; decode reads the same
bytes whatever they hold, but the tokens it picks there mean nothing). Every configuration then runs in a fresh Python process (so that no earlier
one's memory counts in its peak): an Engine with N ranks, all of them decode ranks, loads the
document (an 8-bit kv dtype quantizes the bf16 rows as they are read), asks a 16-token question
and decodes --steps greedy tokens. Reported per configuration: the median decode step, and per
decode rank the peak RSS (Linux VmHWM from before the load to the end of the answer) less an
idle process that imported torch, against the target weights + 1.1 x KV/N + 100 MiB. The
configurations alternate for --rounds rounds (a noisy machine slows all alike); ratios are taken
within a round against N = 1 and the model dtype, then their median over rounds.

`--merge` also times one layer's decode attention over a split cache in the two ways the decode
can merge it, at 2 ranks: all-gather of every rank's (out, lse) (what ringctx does), and the
paper's ring pass-Q (Algorithm 4, ringctx.ring_attention with the one query token travelling).
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

from ringctx.kernels.cpu_features import cpu_model

MODEL = "smollm2-135m"
QUESTION_TOKENS = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--decode-ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kv-dtypes", nargs="+", default=["model", "fp8", "int8"])
    p.add_argument("--steps", type=int, default=32, help="decode steps per answer")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--docs", default=".bench/docs", help="where the prefilled documents are kept")
    p.add_argument("--tile-above", type=int, default=65536,
                   help="contexts this long or longer repeat a prefilled document's rows instead")
    p.add_argument("--merge", action="store_true", help="also time all-gather vs pass-Q merging of one layer")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration, print JSON
    return p.parse_args()




def document_path(docs: str, context: int) -> str:
    return os.path.join(docs, f"{MODEL}-bf16-{context}.kv")


def prefill_document(docs: str, context: int) -> float:
    """Prefill `context` random tokens over two ranks and save the document; seconds taken."""
    from ringctx.engine import Engine

    os.makedirs(docs, exist_ok=True)
    start = time.perf_counter()
    with Engine(MODEL, nproc=2, dtype="bfloat16", allow_long_context=True) as engine:
        ids = torch.randint(0, engine.model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
        document = engine.ingest(ids.tolist(), chunk_tokens=min(context, 8192))
        engine.save_document(document, document_path(docs, context))
    return time.perf_counter() - start


def tile_document(docs: str, source: int, context: int) -> None:
    """A `context`-token document made of the `source`-token one's KV rows repeated (positions and
    token ids continued), for decode timing only."""
    from ringctx.runtime.documents import read_document, save_document_slices
    from ringctx.model import KVCache, load_model

    model = load_model(MODEL, dtype="bfloat16")
    whole, ids, extra = read_document(document_path(docs, source), model)
    if context % source:
        raise SystemExit(f"--tile-above: {context} is not a multiple of the prefilled {source}")
    big = KVCache.for_model(model.config, context, dtype=model.dtype)
    for layer in range(big.n_layers):
        for dst, src in zip(big.storage_tensors(layer), whole.storage_tensors(layer)):
            dst.view(context // source, source, *dst.shape[1:]).copy_(src[:source].unsqueeze(0))
    big.length = context
    save_document_slices(document_path(docs, context), big, ids.repeat(context // source), model,
                         {**extra, "tiled_from": source}, group=None, rank=0, world=1)


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_hwm(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run_one(spec: dict) -> dict:
    """One configuration in this process (see the module docstring)."""
    from ringctx.engine import Engine

    n, kv_dtype = spec["decode_ranks"], spec["kv_dtype"]
    with Engine(MODEL, nproc=n, dtype="bfloat16", decode_ranks=n, kv_dtype=kv_dtype,
                allow_long_context=True) as engine:
        pids = [os.getpid()] + [w.pid for w in engine.worker_processes]
        for pid in pids:
            reset_hwm(pid)
        t0 = time.perf_counter()
        document = engine.load_document(spec["path"])
        load_s = time.perf_counter() - t0
        question = torch.randint(0, 1000, (QUESTION_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
        generation = engine.generate(document, question, max_new_tokens=spec["steps"] + 1, stop_token_ids=[])
        "".join(generation)
        result = generation.result
        rows = engine.document_rows(document)
        peaks = [vm_hwm(pid) for pid in pids]
        weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in engine.model.parameters()}.values())
        per_token = document.cache.bytes_per_token
    return {"decode_ranks": n, "kv_dtype": kv_dtype, "context": spec["context"], "load_s": load_s,
            "step_ms": 1000 * statistics.median(result.token_times_s), "ttft_ms": 1000 * result.time_to_first_token_s,
            "rows_per_rank": rows, "kv_bytes_per_rank": [r * per_token for r in rows], "kv_bytes_per_token": per_token,
            "weights_bytes": weights, "peak_rss_per_rank": peaks, "tokens": result.token_ids}


def idle_torch_rss() -> int:
    code = "import torch, resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def run_in_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"configuration {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- merge: all-gather vs pass-Q


def _merge_worker(rank: int, world: int, port: int, rows: int, repeats: int, queue) -> None:
    import torch.distributed as dist

    from ringctx.attention import PartialAccumulator, attention_block
    from ringctx.parallel import ShardLayout, ring_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    hq, hkv, d = 9, 3, 64
    ck = torch.randn(rows, hkv, d, generator=g).bfloat16()
    cv = torch.randn(rows, hkv, d, generator=g).bfloat16()
    q = torch.randn(1, hq, d).bfloat16()
    layout = ShardLayout.balanced([1], world, cached_counts=[[rows]] * world)
    mine = layout.num_new(rank)

    def all_gather():
        out, lse = attention_block(q, ck, cv)
        packed = torch.cat([out.float().reshape(-1), lse.reshape(-1)])
        everyone = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(everyone, packed)
        acc = PartialAccumulator(1, hq, d)
        for part in everyone:
            acc.add(part[:hq * d].view(1, hq, d), part[hq * d:].view(hq, 1))
        return acc.out

    def pass_q():
        return ring_attention(q[:mine], q[:mine, :hkv], q[:mine, :hkv], layout, cached_k=ck, cached_v=cv,
                              strategy="pass-q", check_across_ranks=False)

    times = {"all-gather": [], "pass-q": []}
    for i in range(repeats):
        for name, fn in (("all-gather", all_gather), ("pass-q", pass_q)) if i % 2 == 0 else \
                (("pass-q", pass_q), ("all-gather", all_gather)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    if rank == 0:
        queue.put({k: 1e3 * statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def time_merges(rows_per_rank: int, repeats: int = 40) -> dict:
    import torch.multiprocessing as mp

    from ringctx.parallel.launch import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_merge_worker, args=(r, 2, port, rows_per_rank, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    return result


# ----------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch": torch.__version__, "model": MODEL, "dtype": "bfloat16", "steps": args.steps}
    console.print(f"[dim]{meta['date']}, {meta['cpu']}, {meta['cores']} cores[/dim]")
    idle = idle_torch_rss()
    prefill_s = {}
    prefilled = [c for c in args.contexts if c < args.tile_above]
    for context in sorted(args.contexts):
        if os.path.isdir(document_path(args.docs, context)):
            continue
        if context < args.tile_above or not prefilled:
            console.print(f"[dim]prefilling {context:,} tokens (once) ...[/dim]")
            prefill_s[context] = prefill_document(args.docs, context)
        else:
            console.print(f"[dim]{context:,} tokens: the {max(prefilled):,}-token document's rows repeated[/dim]")
            tile_document(args.docs, max(prefilled), context)
    configs = [(c, n, k) for c in args.contexts for n in args.decode_ranks for k in args.kv_dtypes]
    runs = {cfg: [] for cfg in configs}
    for round_index in range(args.rounds):
        order = configs if round_index % 2 == 0 else configs[::-1]
        for c, n, k in order:
            spec = {"context": c, "decode_ranks": n, "kv_dtype": k, "steps": args.steps,
                    "path": document_path(args.docs, c)}
            runs[(c, n, k)].append(run_in_child(spec))
            console.print(f"[dim]round {round_index + 1}: {c:,} tokens, {n} decode rank(s), {k}: "
                          f"{runs[(c, n, k)][-1]['step_ms']:.1f} ms/token[/dim]")

    table = Table(title=f"decode of {MODEL} (bf16) over a split KV cache, {meta['cpu']}, {meta['date']}")
    for col in ("context", "decode ranks", "kv dtype", "ms/token", "vs 1 rank", "vs model dtype", "KV/rank",
                "peak RSS - idle torch, per rank", "target", "met"):
        table.add_column(col, justify="right")
    rows = []
    for c, n, k in configs:
        mine = runs[(c, n, k)]
        base_rank = runs.get((c, 1, k)) or mine
        base_dtype = runs.get((c, n, "model")) or mine
        vs_rank = statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(mine, base_rank))
        vs_dtype = statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(mine, base_dtype))
        last = mine[-1]
        used = [max(r["peak_rss_per_rank"][i] for r in mine) - idle for i in range(n)]
        target = [last["weights_bytes"] + 1.1 * kv + 100 * 2 ** 20 for kv in last["kv_bytes_per_rank"]]
        row = {"context": c, "decode_ranks": n, "kv_dtype": k, "step_ms": statistics.median(r["step_ms"] for r in mine),
               "step_ms_per_round": [r["step_ms"] for r in mine], "paired_vs_one_rank": vs_rank,
               "paired_vs_model_dtype": vs_dtype, "kv_bytes_per_rank": last["kv_bytes_per_rank"],
               "peak_rss_less_idle_per_rank": used, "target_per_rank": target,
               "memory_target_met": all(u <= t for u, t in zip(used, target)),
               "same_tokens_as_one_rank": mine[-1]["tokens"] == base_rank[-1]["tokens"]}
        rows.append(row)
        gib = 2 ** 30
        table.add_row(f"{c:,}", str(n), k, f"{row['step_ms']:.1f}", f"{vs_rank:.2f}", f"{vs_dtype:.2f}",
                      f"{last['kv_bytes_per_rank'][0] / gib:.2f} GiB", ", ".join(f"{u / gib:.2f}" for u in used) + " GiB",
                      f"{target[0] / gib:.2f} GiB", "yes" if row["memory_target_met"] else "NO")
    console.print(table)
    merge = None
    if args.merge:
        merge = {c: time_merges(c // 2) for c in args.contexts}
        t = Table(title="one layer's decode attention over 2 ranks: merging the partials")
        for col in ("context", "all-gather ms", "pass-Q ring ms", "pass-Q / all-gather"):
            t.add_column(col, justify="right")
        for c, m in merge.items():
            t.add_row(f"{c:,}", f"{m['all-gather']:.3f}", f"{m['pass-q']:.3f}", f"{m['pass-q'] / m['all-gather']:.2f}")
        console.print(t)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "idle_torch_rss": idle, "prefill_s": prefill_s, "rows": rows, "merge": merge},
                      f, indent=1)


if __name__ == "__main__":
    main()
