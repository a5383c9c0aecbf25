#!/usr/bin/env python
"""The TP all-reduce on this machine: shared-memory one-shot / two-shot against gloo, and a TP=2
decode step with each.

    python scripts/bench_allreduce.py [--worlds 2 4] [--dtypes float32 bfloat16] [--rounds 4]
                                      [--decode-steps 24] [--json out.json]

sum: one process, one thread: the sum of N = 2 and 4 buffers (64 KiB, 4 MiB) in rank order with
PyTorch's adds (bf16: widened to float32 first) and with the C kernel (csrc/cpu_token_ops.c's
ringctx_sum_buffers), medians of 7 samples.

messages: W ranks (one RankPool per W, one thread each) sum messages (each --dtypes) of 4 KiB - 1 MiB
(decode-sized: one token's activations are 2-8 KiB, a batch's up to 1 MiB) and 4-64 MiB
(prefill-sized: a chunk's) with ShmAllReduce forced to one-shot, forced to two-shot, and with
gloo's all_reduce, alternating within each round (a noisy machine slows all alike). A sample is
the mean time of a few calls; each sample's time is the slowest rank's; reported are the medians
over rounds and the ratios gloo / one-shot, gloo / two-shot and two-shot / one-shot (taken
within each round, then the median).

decode: Engine(--decode-models, nproc=2, tp=2), a short document (256 tokens, random ids) and a
greedy answer of --decode-steps tokens, with RINGCTX_TP_ALLREDUCE=group (gloo: before) and auto
(after), alternating for --rounds rounds; the median decode step of each, and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_decode import cpu_model  # scripts/ is on the path of a script run from it  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ALGORITHMS = ("one-shot", "two-shot", "gloo")


def calls_for(nbytes: int) -> int:
    """Calls per sample: enough to take a few ms at small sizes."""
    return 50 if nbytes <= 64 << 10 else 10 if nbytes <= 1 << 20 else 2


def kernel_sum(sources: list[torch.Tensor], out: torch.Tensor) -> None:
    """The C kernel itself, float32 too (kernels/selection.py gives it bf16 only, from these numbers)."""
    import ctypes

    from ringctx.kernels import build

    pointers = (ctypes.c_void_p * len(sources))(*(s.data_ptr() for s in sources))
    status = build.library().ringctx_sum_buffers(pointers, len(sources), out.numel(),
                                                  int(out.dtype == torch.bfloat16), out.data_ptr(), 1)
    assert status == 0, status


def bench_sum() -> list[dict]:
    from ringctx.parallel.allreduce import add_with_torch

    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for count in (2, 4):
            for nbytes in (64 << 10, 4 << 20):
                sources = [torch.randn(nbytes // dtype.itemsize).to(dtype) for _ in range(count)]
                out = torch.empty_like(sources[0])
                ways = {"torch": lambda: add_with_torch(sources, out),
                        "C": lambda: kernel_sum(sources, out)}
                us = {}
                for name, fn in ways.items():
                    samples = []
                    for _ in range(7):
                        t0 = time.perf_counter()
                        for _ in range(10):
                            fn()
                        samples.append((time.perf_counter() - t0) / 10)
                    us[name] = 1e6 * statistics.median(samples)
                rows.append({"dtype": str(dtype).split(".")[1], "buffers": count, "bytes": nbytes, "us": us})
                print(f"sum {rows[-1]['dtype']:8} N={count} {nbytes >> 10:>5} KiB  torch {us['torch']:8.1f} us  "
                      f"C {us['C']:8.1f} us  torch/C {us['torch'] / us['C']:.2f}", flush=True)
    return rows


def messages_job(rank: int, world: int, rounds: int, dtype: str) -> dict:
    """On every rank: {size: {algorithm: [seconds per call, one per round]}} of this rank."""
    import torch.distributed as dist

    from ringctx.parallel.allreduce import ShmAllReduce

    reducer = ShmAllReduce.create(None, timeout_s=60)
    out = {}
    for size in SIZES:
        dt = getattr(torch, dtype)
        x = torch.randn(size // dt.itemsize, generator=torch.Generator().manual_seed(rank)).to(dt)
        calls, times = calls_for(size), {a: [] for a in ALGORITHMS}
        for rnd in range(rounds + 1):  # round 0 warms up (page faults of the slots and buffers)
            order = ALGORITHMS[rnd % 3:] + ALGORITHMS[:rnd % 3]
            for algorithm in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    if algorithm == "gloo":
                        dist.all_reduce(x)
                    else:
                        reducer(x, algorithm)
                    x.mul_(0.5)  # keep the values bounded (the same work for every algorithm)
                elapsed = torch.tensor([(time.perf_counter() - t0) / calls])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if rnd:
                    times[algorithm].append(float(elapsed))
        out[size] = times
    return out


def bench_messages(world: int, rounds: int, dtypes: list[str]) -> list[dict]:
    from ringctx.parallel.launch import RankPool

    rows = []
    with RankPool(world, backend="gloo") as pool:
        for dtype in dtypes:
            rows += message_rows(world, dtype, pool.run(messages_job, rounds, dtype)[0])
    return rows


def message_rows(world: int, dtype: str, times: dict) -> list[dict]:
    rows = []
    for size, by in times.items():
        med = {a: statistics.median(t) for a, t in by.items()}
        ratio = {name: statistics.median(n / d for n, d in zip(by[a], by[b]))
                 for name, a, b in (("gloo/one-shot", "gloo", "one-shot"), ("gloo/two-shot", "gloo", "two-shot"),
                                    ("two-shot/one-shot", "two-shot", "one-shot"))}
        rows.append({"world": world, "dtype": dtype, "bytes": size, "us": {a: 1e6 * v for a, v in med.items()},
                     "ratios": ratio})
        print(f"W={world} {dtype:8} {size / 1024:>6.0f} KiB  " + "  ".join(f"{a} {1e6 * v:9.1f} us" for a, v in med.items())
              + "  " + "  ".join(f"{k} {v:.2f}" for k, v in ratio.items()), flush=True)
    return rows


def decode_once(model: str, choice: str, steps: int) -> float:
    """Median decode step (ms) of a TP=2 engine with RINGCTX_TP_ALLREDUCE=choice."""
    from ringctx.engine import Engine

    os.environ["RINGCTX_TP_ALLREDUCE"] = choice  # the spawned ranks read it at start-up
    g = torch.Generator().manual_seed(0)
    with Engine(model, nproc=2, tp=2, dtype="bfloat16") as engine:
        vocab = engine.model.full_config.vocab_size
        document = engine.ingest(torch.randint(3, vocab, (256,), generator=g).tolist(), chat=False)
        question = torch.randint(3, vocab, (8,), generator=g).tolist()
        generation = engine.generate(document, question, max_new_tokens=steps + 1, stop_token_ids=[])
        "".join(generation)
        return 1000 * statistics.median(generation.result.token_times_s)


def bench_decode(models: list[str], rounds: int, steps: int) -> list[dict]:
    rows = []
    for model in models:
        ms = {"group": [], "auto": []}
        for rnd in range(rounds):
            for choice in (("group", "auto") if rnd % 2 == 0 else ("auto", "group")):
                ms[choice].append(decode_once(model, choice, steps))
        ratio = statistics.median(g / a for g, a in zip(ms["group"], ms["auto"]))
        rows.append({"model": model, "step_ms_gloo": statistics.median(ms["group"]),
                     "step_ms_shm": statistics.median(ms["auto"]), "gloo/shm": ratio, "samples": ms})
        print(f"decode TP=2 {model}: gloo {statistics.median(ms['group']):.2f} ms/step, shared memory "
              f"{statistics.median(ms['auto']):.2f} ms/step, ratio {ratio:.2f}", flush=True)
    os.environ.pop("RINGCTX_TP_ALLREDUCE", None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode-models", nargs="*", default=["tiny"])
    parser.add_argument("--decode-rounds", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--parts", nargs="+", default=["sum", "messages", "decode"],
                        choices=["sum", "messages", "decode"])
    parser.add_argument("--json")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, {started}")
    result = {"cpu": cpu_model(), "cpus": os.cpu_count(), "date_utc": started, "load_start": os.getloadavg(),
              "sum": bench_sum() if "sum" in args.parts else None,
              "messages": [row for w in args.worlds for row in bench_messages(w, args.rounds, args.dtypes)]
              if "messages" in args.parts else None}
    if "decode" in args.parts:
        result["decode"] = bench_decode(args.decode_models, args.decode_rounds, args.decode_steps)
    result["load_end"] = os.getloadavg()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
