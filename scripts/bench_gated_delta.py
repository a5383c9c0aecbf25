#!/usr/bin/env python
"""The gated delta rule on this CPU: ringctx's C kernel (csrc/cpu_gated_delta.c) against PyTorch, and
a decode step against the memory floor.

    python scripts/bench_gated_delta.py [--heads 48] [--dk 128] [--dv 128] [--batch 1 4] [--layers 48]
                                        [--pieces 64 512] [--rounds 9] [--threads N]
                                        [--json out.json]

decode: `recurrent_step` of B sequences (attention/gated_delta.py; Qwen3.5/3.6-27B's linear layers
by default: 48 value heads of 128 x 128, 3 MiB of float32 state per layer and sequence) over --layers
layers' states in turn, as a model's step visits them, so that each call finds its states in memory,
not in a cache (B x layers x 3 MiB, past the L3). With the kernel, and with PyTorch
(RINGCTX_CPU_KERNELS=0: its token step over [B, H, ...]), alternating within each round. Per B:

    kernel_ms, torch_ms   median time of one layer's step (MiB: the layer's states, B H Dk Dv 4 bytes)
    torch/kernel          torch's time over the kernel's, paired within each round, median
    floor_ms              the states read and written once (2 B H Dk Dv 4 bytes) over the read
                          bandwidth measured here before and after (the better reading;
                          ringctx.planning.machine_speed.read_bandwidth)
    kernel/floor          kernel_ms / floor_ms
    mul_ ms, k/mul_       an in-place pass over the same states (PyTorch's S.mul_: each byte read and
                          written once, as by the kernel, alternating with it) and the kernel's time
                          over it, paired: the floor as this machine's memory meets a read-and-write
    GB/s                  the states' bytes read and written per second by the kernel

pieces: one sequence's piece of T tokens from a start state (B = 1): `recurrent` through the kernel,
PyTorch's token loop, PyTorch's chunked form (ChunkForm.build then .scan: what a prefill runs) and
the chunked form's state carry alone (ChunkForm.scan of a built form: what a C scan could replace);
and a piece's summary for context parallelism (PieceSummary: the end states from zero and, with v =
0, from I) by two kernel recurrences against ChunkForm.build then PieceSummary.of; median ms of
--rounds // 3 + 1 rounds, alternating, and each one's time over the kernel's.

Prints an 80-column table per part and writes --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=48, help="value heads of a layer (Qwen3.5-27B: 48)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences per decode step")
    p.add_argument("--layers", type=int, default=48, help="states visited in turn (a model's linear layers)")
    p.add_argument("--pieces", type=int, nargs="*", default=[64, 512], help="piece lengths (tokens)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="threads of the kernel and PyTorch (default: torch's)")
    p.add_argument("--json", metavar="PATH", default="bench_gated_delta.json")
    return p.parse_args()


def inputs(B: int, T: int, H: int, Dk: int, Dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """float32 q, k [B, T, H, Dk] L2-normalised (q scaled by Dk^-0.5), v [B, T, H, Dv], g in [-1, 0],
    beta in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1) for _ in "qk")
    return (q * Dk ** -0.5, k, torch.randn(B, T, H, Dv, generator=gen), -torch.rand(B, T, H, generator=gen),
            torch.rand(B, T, H, generator=gen))


class KernelsOff:
    """RINGCTX_CPU_KERNELS=0 within the block (kernels/build.py reads it at every call): PyTorch runs."""

    def __enter__(self):
        self.before = os.environ.get("RINGCTX_CPU_KERNELS")
        os.environ["RINGCTX_CPU_KERNELS"] = "0"

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("RINGCTX_CPU_KERNELS")
        else:
            os.environ["RINGCTX_CPU_KERNELS"] = self.before


def bench_decode(args) -> list[dict]:
    from ringctx.attention.gated_delta import recurrent_step

    rows = []
    H, Dk, Dv = args.heads, args.dk, args.dv
    for B in args.batch:
        q, k, v, g, beta = (x[:, 0] for x in inputs(B, 1, H, Dk, Dv))
        states = [torch.randn(B, H, Dk, Dv) * 0.1 for _ in range(args.layers)]

        def step(way: str) -> float:
            """One layer's step, averaged over a pass over every layer's states."""
            t0 = time.perf_counter()
            for s in states:
                if way == "in_place_pass":
                    s.mul_(0.9999)
                else:
                    recurrent_step(q, k, v, g, beta, s)
            return (time.perf_counter() - t0) / len(states)

        ways = ("kernel", "torch", "in_place_pass")
        times = {way: [] for way in ways}
        for r in range(args.rounds + 1):  # round 0 warms up
            for way in ways[r % 3:] + ways[:r % 3]:
                if way == "torch":
                    with KernelsOff():
                        t = step(way)
                else:
                    t = step(way)
                if r:
                    times[way].append(t)
        nbytes = 2 * B * H * Dk * Dv * 4
        kernel = statistics.median(times["kernel"])
        print(f"B={B}: kernel {1e3 * kernel:.3f} ms, torch {1e3 * statistics.median(times['torch']):.3f} ms",
              flush=True)
        rows.append({"batch": B, "heads": H, "dk": Dk, "dv": Dv, "layers": args.layers,
                     "kernel_ms": 1e3 * kernel, "torch_ms": 1e3 * statistics.median(times["torch"]),
                     "torch_over_kernel": statistics.median(t / c for t, c in zip(times["torch"], times["kernel"])),
                     "in_place_pass_ms": 1e3 * statistics.median(times["in_place_pass"]),
                     "kernel_over_in_place_pass": statistics.median(
                         c / p for c, p in zip(times["kernel"], times["in_place_pass"])),
                     "state_bytes_read_and_written": nbytes, "kernel_gb_per_s": nbytes / kernel / 1e9,
                     "kernel_ms_rounds": [1e3 * t for t in times["kernel"]],
                     "torch_ms_rounds": [1e3 * t for t in times["torch"]]})
    return rows


def bench_pieces(args) -> list[dict]:
    from ringctx.attention.gated_delta import ChunkForm, PieceSummary, recurrent

    rows = []
    H, Dk, Dv = args.heads, args.dk, args.dv
    start = torch.randn(H, Dk, Dv) * 0.1
    for T in args.pieces:
        q, k, v, g, beta = (x[0] for x in inputs(1, T, H, Dk, Dv, seed=T))
        form = ChunkForm.build(q, k, v, g, beta)

        def torch_loop():
            with KernelsOff():
                recurrent(q, k, v, g, beta, start)

        zeros, eye = torch.zeros(T, H, Dk), torch.eye(Dk).expand(H, Dk, Dk)

        def kernel_summary():  # what PieceSummary holds, from the recurrence (tests/attention/test_gated_delta_kernel.py)
            recurrent(q, k, v, g, beta)
            recurrent(q, k, zeros, g, beta, eye)

        ways = {"kernel": lambda: recurrent(q, k, v, g, beta, start), "torch_loop": torch_loop,
                "torch_chunked": lambda: ChunkForm.build(q, k, v, g, beta).scan(start),
                "torch_scan": lambda: form.scan(start), "kernel_summary": kernel_summary,
                "torch_summary": lambda: PieceSummary.of(ChunkForm.build(q, k, v, g, beta))}
        times = {name: [] for name in ways}
        names = list(ways)
        for r in range(args.rounds // 3 + 2):  # round 0 warms up
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                ways[name]()
                if r:
                    times[name].append(time.perf_counter() - t0)
        row = {"tokens": T, "heads": H, "dk": Dk, "dv": Dv}
        for name in names:
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
            row[f"{name}_over_kernel"] = statistics.median(t / c for t, c in zip(times[name], times["kernel"]))
        rows.append(row)
        print(f"T={T}: " + ", ".join(f"{n} {row[f'{n}_ms']:.1f} ms" for n in names), flush=True)
    return rows


def main() -> None:
    args = parse_args()
    from ringctx.kernels import build
    from ringctx.kernels.cpu_features import cpu_model
    from ringctx.planning.machine_speed import read_bandwidth

    if args.threads:
        torch.set_num_threads(args.threads)
    variant = build.active_variant()
    if variant is None:
        raise SystemExit(f"the CPU kernels do not run here: {build.kernel_error()}")
    threads = torch.get_num_threads()
    print(f"{cpu_model()}: {variant.name} kernels, {threads} threads", flush=True)
    bandwidths = [read_bandwidth()]
    decode = bench_decode(args)
    bandwidths.append(read_bandwidth())
    bandwidth = max(bandwidths)  # the floor at the better of the two readings: a step can be no faster
    for r in decode:
        r["floor_ms"] = 1e3 * r["state_bytes_read_and_written"] / bandwidth
        r["kernel_over_floor"] = r["kernel_ms"] / r["floor_ms"]
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (the better of {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)})")
    print(f"\ndecode step of one layer: {args.heads} heads of {args.dk} x {args.dv}, {args.layers} layers' states "
          f"in turn, medians of {args.rounds}")
    print(f"{'B':>2} {'MiB':>5} {'kernel ms':>9} {'torch ms':>8} {'torch/k':>7} {'floor ms':>8} {'k/floor':>7} "
          f"{'mul_ ms':>7} {'k/mul_':>6} {'GB/s':>5}")
    for r in decode:
        print(f"{r['batch']:>2} {r['state_bytes_read_and_written'] / 2 / 2**20:>5.1f} {r['kernel_ms']:>9.3f} "
              f"{r['torch_ms']:>8.3f} {r['torch_over_kernel']:>7.2f} {r['floor_ms']:>8.3f} "
              f"{r['kernel_over_floor']:>7.2f} {r['in_place_pass_ms']:>7.3f} {r['kernel_over_in_place_pass']:>6.2f} "
              f"{r['kernel_gb_per_s']:>5.1f}")
    pieces = bench_pieces(args) if args.pieces else []
    if pieces:
        print("\none sequence's piece of T tokens from a start state, ms (x the kernel's, paired medians)")
        print(f"{'T':>6} {'kernel':>9} {'torch loop':>18} {'torch chunked':>18} {'torch scan only':>18}")
        for r in pieces:
            cells = [f"{r[f'{n}_ms']:.1f} ({r[f'{n}_over_kernel']:.2f}x)" for n in ("torch_loop", "torch_chunked",
                                                                                   "torch_scan")]
            print(f"{r['tokens']:>6} {r['kernel_ms']:>9.1f} " + " ".join(f"{c:>18}" for c in cells))
        print("\na piece's summary for context parallelism (transition and contribution), ms")
        print(f"{'T':>6} {'kernel (2 recurrences)':>24} {'torch (build, PieceSummary.of)':>32} {'torch/kernel':>13}")
        for r in pieces:
            print(f"{r['tokens']:>6} {r['kernel_summary_ms']:>24.1f} {r['torch_summary_ms']:>32.1f} "
                  f"{r['torch_summary_ms'] / r['kernel_summary_ms']:>13.2f}")
    with open(args.json, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "cpu": cpu_model(),
                   "machine": platform.machine(), "variant": variant.name, "threads": threads,
                   "read_bandwidth_bytes_per_s": bandwidth,
                   "read_bandwidth_readings": bandwidths, "args": vars(args), "decode": decode, "pieces": pieces},
                  f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
