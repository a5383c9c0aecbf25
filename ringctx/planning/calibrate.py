"""`ringctx calibrate`: measure this machine and the live process group, write a hardware profile.

What is measured (every number is the median of repeats; the profile's `notes` keep the
conditions):

    attention   attention_block (the engine's kernel) on the model's heads and dtype: full blocks
                of q rows x max(q, 1024) keys and square causal blocks, by q rows; one tiny
                call gives the per-call overhead. One thread, the other ranks idle.
    linear      one decoder block of the model (random weights, attention replaced by zeros) at one
                token and a few token counts; time = overhead + linear FLOPs / rate is fitted to them
                (`fit_linear_block`): the rate prices norms, RoPE and elementwise work too, the
                overhead is the fixed cost of a layer (layer_overhead_s: what a one-token block
                takes beyond its FLOPs). The plain GEMMs of the block's shapes are reported alongside.
    threads     the same block and an attention call with all host cores vs one thread (a
                single-rank engine uses every core): the compute scale of a ring of 1.
    live group  on N ranks at once (RankPool of N gloo ranks, or the torchrun group):
                ring SendRecv (Ring.start_shift) over message sizes -> latency + bytes/BW fit;
                all_to_all over sizes -> latency + bytes/BW fit; all_reduce over sizes -> the
                tensor-parallel link among local ranks (tp_latency_s, tp_bandwidth_bytes_per_s:
                latency + 2*(N-1)/N*bytes/BW, as the cost model prices a TP all-reduce); the same
                compute on every rank at once vs rank 0 alone -> compute scale of N ranks sharing
                the host; a SendRecv during attention compute -> the share of the transfer that
                hides (comm_overlap); tiny ring_attention calls per strategy -> fixed overhead
                per call.
    ring model  ring_attention itself, both strategies, on a small (T, P) design: the fixed cost
                per call of each strategy, the compute factor inside the ring and the effective
                bandwidth of the travelling bytes are fitted to it (`fit_ring_model`) and replace
                the microbenchmark's numbers of that ring size; the raw ones stay in the samples.

`calibrate()` returns a `Calibration` (the profile plus the raw samples); `save_profile` writes
the profile, which `load_profile`, the planner, choose_strategy and the Engine read.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ringctx.kernels.cpu_features import cpu_model
from ringctx.model.config import ModelConfig
from ringctx.model.loader import DEFAULT_MODEL
from ringctx.parallel.ring import PASS_KV, PASS_Q, STRATEGIES
from ringctx.planning.hardware import (
    EmpiricalRuleCoefficients, HardwareProfile, RingCalibration, ThroughputPoint,
    canonical_dtype,
)
from ringctx.planning.prefill_plan import resolve_model_config


@dataclass(frozen=True)
class CalibrationSettings:
    """What to measure and how often."""

    model: ModelConfig
    """Whose attention heads and linear shapes are measured."""
    dtypes: tuple[str, ...] = ("bfloat16",)
    """Canonical dtype names to measure compute in (communication is measured in the first)."""
    cp_sizes: tuple[int, ...] = (2,)
    """Ring sizes to measure a live group of (ignored under torchrun: the launched world)."""
    repeats: int = 5
    """Timed repeats of every measurement (after one warm-up)."""
    attention_rows: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    """Query rows of the attention calls measured."""
    linear_tokens: tuple[int, ...] = (256, 1024)
    """Token counts of the decoder-block measurement; the largest gives linear_flops_per_s."""
    message_bytes: tuple[int, ...] = (4096, 65536, 524288, 2097152, 8388608)
    """SendRecv and all_to_all sizes (bytes one rank sends)."""
    quick: bool = False
    """A short run (tests): fewer sizes and repeats; numbers are rougher."""
    ring_tokens: tuple[int, ...] = (64, 256, 1024)
    """New tokens T of the ring_attention cases timed to fit the ring model (see fit_ring_model)."""
    ring_miss_rates: tuple[float, ...] = (0.01, 0.05, 0.25, 1.0)
    """Miss rates T/(T+P) of those cases."""
    ring_case_seconds: float = 0.3
    """Cases predicted (before the fit) to take longer than this per call are left out."""
    tp_size: int = 0
    """Group size whose all-reduce (the engine's: parallel/allreduce.py) gives the tensor-parallel link (tp_latency_s, tp_bandwidth_bytes_per_s);
    0: the smallest measured group. It is measured as one of cp_sizes."""

    @classmethod
    def make(cls, model: "ModelConfig | str" = DEFAULT_MODEL, *, dtypes=("bfloat16",), cp_sizes=(2,),
             quick: bool = False, repeats: int | None = None, tp_size: int = 0) -> "CalibrationSettings":
        model = resolve_model_config(model)
        dtypes = tuple(dict.fromkeys(canonical_dtype(d) for d in dtypes))
        if not dtypes:
            raise ValueError("give at least one dtype to calibrate")
        for d in dtypes:
            if d == "float8":
                raise ValueError("float8 attention is not measurable with the torch CPU kernels; "
                                 "calibrate bfloat16, float16 or float32")
        if tp_size and tp_size < 2:
            raise ValueError(f"--tp must be at least 2 to measure a tensor-parallel all-reduce, got {tp_size}")
        cp_sizes = tuple(sorted(set(int(n) for n in cp_sizes) | ({tp_size} if tp_size else set())))
        if any(n < 1 for n in cp_sizes):
            raise ValueError(f"ring sizes must be >= 1, got {list(cp_sizes)}")
        if quick:
            return cls(model, dtypes, cp_sizes, repeats or 2, (16, 128), (128,), (4096, 262144, 1048576), True,
                       (32, 256), (0.05, 1.0), 0.1, tp_size)
        return cls(model, dtypes, cp_sizes, repeats or 5, tp_size=tp_size)


@dataclass
class Calibration:
    """The outcome of `calibrate`: the profile and what it was made from."""

    profile: HardwareProfile
    samples: dict[str, Any] = field(default_factory=dict)
    """Raw measurements (seconds) and fits, for --json and for the record."""
    seconds: float = 0.0
    """Wall time of the calibration."""

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.to_dict(), "samples": self.samples, "seconds": self.seconds}


# ----------------------------------------------------------------------------- timing helpers


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1, budget_s: float | None = None) -> float:
    """Median wall time of fn() over `repeats` calls after `warmup` untimed ones.

    With `budget_s`, slow calls are repeated less: at most budget_s / (first warm-up time) times,
    but at least twice.
    """
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        if i == 0 and budget_s is not None:
            repeats = max(2, min(repeats, int(budget_s / max(time.perf_counter() - t0, 1e-9))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_latency_bandwidth(nbytes, seconds) -> tuple[float, float]:
    """Fit seconds = latency + bytes / bandwidth; returns (latency_s, bandwidth_bytes_per_s).

    Least squares on relative errors (small and large messages count alike), with latency >= 0
    and bandwidth > 0 enforced (a negative intercept is refitted through the origin).
    """
    x = np.asarray(nbytes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(y.min()) if len(y) else 0.0, float(x.max() / max(y.max(), 1e-12)) if len(x) else 1e9
    w = 1.0 / y
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if lat < 0 or inv_bw <= 0:
        if inv_bw <= 0:  # times do not grow with size: all latency
            return float(np.median(y)), float(x.max() / max(np.median(y), 1e-12) * 1e3)
        lat = 0.0
        inv_bw = float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    return float(lat), float(1.0 / inv_bw)


def _host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


def cpu_features() -> list[str]:
    """Matrix-engine flags of the CPU (AMX, AVX-512 BF16/FP16) from /proc/cpuinfo; [] if none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(f for f in flags if f.startswith("amx") or f in ("avx512_bf16", "avx512_fp16"))
    except OSError:
        pass
    return []


# ----------------------------------------------------------------------------- single-process compute


def _qkv(rows: int, keys: int, model: ModelConfig, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, model.n_heads, model.head_dim, generator=g).to(dtype)
    k = torch.randn(keys, model.n_kv_heads, model.head_dim, generator=g).to(dtype)
    v = torch.randn(keys, model.n_kv_heads, model.head_dim, generator=g).to(dtype)
    return q, k, v


MEASUREMENT_BUDGET_S = 1.0
"""Seconds one attention measurement may take (its repeats are cut to fit, down to two)."""


def full_block_keys(rows: int) -> int:
    """Keys of the full blocks measured for `rows` query rows: as many as rows, at least 1024."""
    return max(rows, 1024)


def measure_attention(model: ModelConfig, dtype: str, rows: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Full and causal attention_block throughput by query rows, and the per-call overhead.

    Returns {"overhead_s", "full": [(rows, keys, seconds, flops_per_s)], "causal": [(rows, seconds,
    flops_per_s)]}; FLOP/s are computed on (time - overhead), as the cost model adds the overhead
    per call.
    """
    from ringctx.attention import attention_block

    tdtype = getattr(torch, dtype)
    D = model.n_heads * model.head_dim
    q, k, v = _qkv(1, 1, model, tdtype)
    overhead = median_seconds(lambda: attention_block(q, k, v), max(5, repeats * 2), warmup=3)
    full, causal = [], []
    for r in rows:
        keys = full_block_keys(r)
        q, k, v = _qkv(r, keys, model, tdtype, seed=r)
        t = median_seconds(lambda: attention_block(q, k, v), repeats, budget_s=MEASUREMENT_BUDGET_S)
        full.append((r, keys, t, 4 * r * keys * D / max(t - overhead, 0.2 * t)))
        q, k, v = _qkv(r, r, model, tdtype, seed=r + 1)
        t = median_seconds(lambda: attention_block(q, k, v, causal=True), repeats, budget_s=MEASUREMENT_BUDGET_S)
        causal.append((r, t, 2 * r * r * D / max(t - overhead, 0.2 * t)))
    return {"overhead_s": overhead, "full": full, "causal": causal}


def _one_block_model(model: ModelConfig, dtype: str):
    """A 1-layer Transformer of `model`'s shapes with random weights (small vocabulary)."""
    from ringctx.model.weights import empty_model, init_random

    # its first attention layer as it is (a hybrid's linear layers are costed from their formula)
    i = model.attention_layers[0]
    config = dataclasses.replace(model, n_layers=1, vocab_size=min(model.vocab_size, 1024), name=f"{model.name}-1layer",
                                 layer_attention=model.layer_attention[i:i + 1], layer_experts=model.layer_experts[i:i + 1],
                                 layer_linear=())
    net = empty_model(config, dtype=getattr(torch, dtype), device="cpu")
    init_random(net, 0)
    return net.eval()


def _zero_attend(layer, q, k, v):
    return torch.zeros_like(q)


LAYER_OVERHEAD_TOKENS = 1
"""Token count of the smallest decoder-block measurement: its time beyond its FLOPs is the fixed
cost of a layer (the intercept of `fit_linear_block`)."""


def measure_linear(model: ModelConfig, dtype: str, tokens: tuple[int, ...], repeats: int, net=None) -> dict[str, Any]:
    """Decoder-block time without attention, and plain GEMMs of its shapes, by token count.

    `tokens` and LAYER_OVERHEAD_TOKENS are measured. Returns {"block": [(tokens, seconds,
    flops_per_s)], "gemm": [(tokens, seconds, flops_per_s)]} with FLOPs = 2 * tokens *
    linear_params_per_layer, token counts ascending.
    """
    from ringctx.planning.strategy import linear_params_per_layer

    net = net or _one_block_model(model, dtype)
    block = net.layers[0]
    tdtype = getattr(torch, dtype)
    params = linear_params_per_layer(model)
    weights = [block.attention.wqkv.weight, block.attention.wo.weight, block.feed_forward.w13.weight,
               block.feed_forward.w2.weight]
    out = {"block": [], "gemm": []}
    with torch.inference_mode():
        for t in sorted({LAYER_OVERHEAD_TOKENS, *tokens}):
            x = torch.randn(t, model.dim).to(tdtype)
            rope = net.rope(torch.arange(t))
            secs = median_seconds(lambda: block(x, rope, _zero_attend, 0), repeats)
            out["block"].append((t, secs, 2 * t * params / secs))
            inputs = [torch.randn(t, w.shape[1]).to(tdtype) for w in weights]
            secs = median_seconds(lambda: [torch.nn.functional.linear(i, w) for i, w in zip(inputs, weights)], repeats)
            out["gemm"].append((t, secs, 2 * t * params / secs))
    return out


def fit_linear_block(block: list, params_per_layer: int) -> tuple[float, float]:
    """(layer_overhead_s, flops_per_s) from measure_linear's block rows: seconds = overhead + FLOPs / rate.

    The same fit as messages' latency + bytes / bandwidth (`fit_latency_bandwidth`, relative
    errors, overhead >= 0), with FLOPs = 2 * tokens * params_per_layer in place of bytes.
    """
    flops = [2 * t * params_per_layer for t, _s, _f in block]
    return fit_latency_bandwidth(flops, [secs for _t, secs, _f in block])


def measure_thread_scaling(model: ModelConfig, dtype: str, repeats: int, cores: int, net=None,
                           tokens: int = 1024) -> dict[str, Any]:
    """Speed of all `cores` threads relative to one on a decoder block and an attention call."""
    from ringctx.attention import attention_block

    net = net or _one_block_model(model, dtype)
    tdtype = getattr(torch, dtype)
    block = net.layers[0]
    x = torch.randn(tokens, model.dim).to(tdtype)
    rope = net.rope(torch.arange(tokens))
    q, k, v = _qkv(tokens // 2, tokens, model, tdtype)
    before = torch.get_num_threads()

    def work():
        block(x, rope, _zero_attend, 0)
        attention_block(q, k, v)

    times: dict[int, list[float]] = {1: [], cores: []}
    try:
        with torch.inference_mode():
            for threads in (1, cores):  # warm-up
                torch.set_num_threads(threads)
                work()
            for i in range(max(3, repeats)):  # paired rounds: the host's load drifts between them
                for threads in ((1, cores) if i % 2 == 0 else (cores, 1)):
                    torch.set_num_threads(threads)
                    t0 = time.perf_counter()
                    work()
                    times[threads].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    ratios = [a / b for a, b in zip(times[1], times[cores])]
    return {"cores": cores, "seconds_1_thread": statistics.median(times[1]),
            f"seconds_{cores}_threads": statistics.median(times[cores]), "speedup": statistics.median(ratios)}


# ----------------------------------------------------------------------------- live-group measurements


def _max_over_ranks(seconds: float, group=None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed_collective(fn: Callable[[], Any], repeats: int, group=None) -> float:
    """Median over repeats of the slowest rank's time of fn(), every repeat started at a barrier."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(_max_over_ranks(time.perf_counter() - t0, group))
    return statistics.median(times)


def live_group_job(rank: int, world: int, settings: dict) -> dict[str, Any]:
    """Run on every rank of a live group (RankPool job, or SPMD under torchrun).

    settings: model (ModelConfig dict), dtype, repeats, message_bytes. Returns (on every rank)
    the raw timings: sendrecv and all2all by size, compute alone/concurrent, overlap, tiny
    ring_attention calls per strategy.
    """
    from ringctx.attention import attention_block
    from ringctx.parallel.comm import Ring, all_to_all_equal, wait_all
    from ringctx.parallel.layout import ShardLayout
    from ringctx.parallel.ring import ring_attention

    model = ModelConfig.from_dict(settings["model"])
    dtype = getattr(torch, settings["dtype"])
    repeats = settings["repeats"]
    esize = torch.empty(0, dtype=dtype).element_size()
    out: dict[str, Any] = {"world": world, "threads": torch.get_num_threads()}
    if world > 1:
        from ringctx.parallel.allreduce import make_all_reduce
        from ringctx.planning.strategy import allreduce_bus_bytes

        ring = Ring(None)
        reduce = make_all_reduce(None, torch.device("cpu"))  # the engine's TP all-reduce, chosen by size
        sendrecv, a2a, allreduce = [], [], []
        for nb in settings["message_bytes"]:
            send = torch.zeros(max(1, nb // esize), dtype=dtype)
            recv = torch.empty_like(send)
            sendrecv.append((nb, _timed_collective(lambda: wait_all(ring.start_shift(send, recv)), repeats)))
            per_peer = max(1, nb // esize // (world - 1))
            chunks = torch.zeros(world, per_peer, dtype=dtype)
            a2a.append(((world - 1) * per_peer * esize, _timed_collective(lambda: all_to_all_equal(chunks, None), repeats)))
            # a TP all-reduce of an nb-byte activation buffer among the local ranks, as the engine
            # runs it (parallel/allreduce.py: shared memory on one host, else the group's), priced
            # by the bytes each rank moves (as the cost model's tp_allreduce_bytes counts them)
            buffer = torch.zeros(max(1, nb // esize), dtype=dtype)
            allreduce.append((allreduce_bus_bytes(buffer.numel() * esize, world),
                              _timed_collective(lambda: reduce(buffer), repeats)))
        out["sendrecv"], out["all2all"], out["allreduce"] = sendrecv, a2a, allreduce

    # compute: rank 0 alone (the others wait at a barrier), then every rank at once
    q, k, v = _qkv(256, 1024, model, dtype, seed=rank)
    x = torch.randn(256, 1536).to(dtype)
    w = torch.randn(1536, 1536).to(dtype)

    def work():
        attention_block(q, k, v)
        torch.nn.functional.linear(x, w)

    # paired rounds (alone, then together) so that the host's drifting load cancels in the ratio
    work()
    alone_s, together_s = [], []
    for _ in range(max(5, repeats)):
        alone = 0.0
        if rank == 0:  # one thread, like the compute tables
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                t0 = time.perf_counter()
                work()
                alone = time.perf_counter() - t0
            finally:
                torch.set_num_threads(threads)
        dist.barrier()
        t0 = time.perf_counter()
        work()
        together = time.perf_counter() - t0
        times = torch.tensor([alone, together], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        alone_s.append(float(times[0]))
        together_s.append(float(times[1]))
    ratios = [a / b for a, b in zip(alone_s, together_s)]
    out["compute_alone_s"] = statistics.median(alone_s)
    out["compute_together_s"] = statistics.median(together_s)
    out["compute_scale"] = statistics.median(ratios)

    if world > 1:
        # overlap: a SendRecv of a pass-KV-sized message while attention runs
        comp = median_seconds(lambda: attention_block(q, k, v), repeats)
        nb = settings["message_bytes"][-1]
        send = torch.zeros(max(1, nb // esize), dtype=dtype)
        recv = torch.empty_like(send)
        comm_alone = _timed_collective(lambda: wait_all(ring.start_shift(send, recv)), repeats)
        comp_alone = _timed_collective(lambda: attention_block(q, k, v), repeats)

        def both():
            works = ring.start_shift(send, recv)
            attention_block(q, k, v)
            wait_all(works)

        both_s = _timed_collective(both, repeats)
        out["overlap"] = {"compute_s": comp_alone, "comm_s": comm_alone, "both_s": both_s, "message_bytes": nb,
                          "compute_rank_s": comp}

        # tiny ring_attention calls: fixed overhead per strategy
        tiny = {}
        T = 8 * 2 * world
        layout = ShardLayout.balanced([T], world)
        qq, kk, vv = _qkv(layout.num_new(rank), layout.num_new(rank), model, dtype, seed=7 + rank)
        for strategy in STRATEGIES:
            tiny[strategy] = _timed_collective(
                lambda: ring_attention(qq, kk, vv, layout, strategy=strategy), max(repeats, 5))
        out["tiny_ring"] = {"new_tokens": T, "seconds": tiny}
    return out


def _live_settings(settings: CalibrationSettings, dtype: str) -> dict[str, Any]:
    return {"model": settings.model.to_dict(), "dtype": dtype, "repeats": settings.repeats,
            "message_bytes": list(settings.message_bytes)}


def ring_design(settings: CalibrationSettings, hw: HardwareProfile, world: int, dtype: str) -> list[tuple[int, int]]:
    """The (T, P) cases timed to fit the ring model: settings' T x miss rates, the slow ones left out."""
    from ringctx.planning.strategy import predict_costs

    cases = []
    for T in settings.ring_tokens:
        for m in settings.ring_miss_rates:
            P = max(0, round(T / m) - T)
            costs = predict_costs(T, P, settings.model, world, hw, dtype=dtype)
            if max(c.attention_s for c in costs.values()) <= settings.ring_case_seconds:
                cases.append((T, P))
    return cases


def _nonnegative_lstsq(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |A x - y| with x >= 0 (active set: drop negative coefficients and refit)."""
    free = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(A[:, free], y, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        del free[int(np.argmin(sol))]  # the most negative one is pinned to 0
    return x


OVERLAP_GRID = tuple(i / 10 for i in range(11))
"""Values of comm_overlap tried by `fit_ring_model` (the rest of its unknowns are linear)."""


def fit_ring_model(measurements: list[dict[str, Any]], hw: HardwareProfile, model: ModelConfig, world: int,
                   dtype: str) -> tuple[RingCalibration, dict[str, Any]]:
    """Fit the ring numbers of `world` to timed ring_attention calls of both strategies.

    For a given overlap f the cost model is linear in four unknowns (compute and byte counts from
    the profile's tables, latencies from the microbenchmarks):
        pass-KV: t = o_kv + k*compute + (N-1)*step(k*c, latency + x*KV message bytes)
        pass-Q : t = o_q  + k*compute + (N-1)*step(k*c, latency + x*Q message bytes) + 2*all2all latency
                     + x*All2All bytes
    with step(c, m) = m - f*min(c, m) beyond the compute c of one ring step (`overlapped_seconds`),
    o = the fixed cost of one call per strategy, k = how much slower attention runs inside the ring
    than the tables x compute scale say, x = 1/effective bandwidth of the bytes that travel while
    the ranks compute. For each f of OVERLAP_GRID, (o_kv, o_q, k, x) >= 0 are solved by least
    squares on relative errors (the min() is evaluated at the f-free solution), and the f with the
    smallest error wins. The ring's numbers become: overhead_s = o, attention_factor = k, bandwidth
    (and All2All bandwidth) = 1/x, comm_overlap = f (compute_scale, which the linear layers use
    too, stays as measured). Returns the RingCalibration and the details.
    """
    from ringctx.planning.strategy import predict_strategy_cost

    ring = hw.ring_sizes[world]
    base = dataclasses.replace(ring, comm_overlap=0.0, overhead_s={s: 0.0 for s in STRATEGIES},
                               attention_factor=1.0)
    probe = dataclasses.replace(hw, ring_sizes={**hw.ring_sizes, world: base})
    cases = []
    for m in measurements:
        T, P = m["new_tokens"], m["cached_tokens"]
        for s in STRATEGIES:
            c = predict_strategy_cost(s, T, P, model, world, probe, dtype=dtype)
            fixed = 2 * ring.all2all_latency_s if s != PASS_KV else 0.0
            cases.append((s, c, fixed, m["seconds"][s]))

    def solve(f: float, k0: float, x0: float):
        rows, targets, weights = [], [], []
        for s, c, fixed, t in cases:
            step_comm = ring.latency_s + x0 * c.sendrecv_bytes
            hidden = f * min(k0 * c.compute_s, step_comm)  # evaluated at the previous solution
            rows.append([s == PASS_KV, s != PASS_KV, world * c.compute_s,
                         (world - 1) * c.sendrecv_bytes + c.all2all_bytes])
            targets.append(t - fixed - (world - 1) * (ring.latency_s - hidden))
            weights.append(1.0 / t)
        A = np.asarray(rows, dtype=np.float64) * np.asarray(weights)[:, None]
        y = np.asarray(targets) * np.asarray(weights)
        sol = _nonnegative_lstsq(A, y)
        return sol, float(np.sum((A @ sol - y) ** 2))

    (o_kv, o_q, k, x), _ = solve(0.0, 1.0, 0.0)
    best = None
    for f in OVERLAP_GRID:
        sol, err = solve(f, k if k > 0 else 1.0, x)
        for _ in range(3):  # refine the min() at the new solution
            sol, err = solve(f, sol[2] if sol[2] > 0 else 1.0, sol[3])
        if best is None or err < best[2] - 1e-12:
            best = (f, sol, err)
    f, (o_kv, o_q, k, x), _ = best
    k = k if k > 0 else 1.0
    bw = 1.0 / x if x > 0 else max(ring.bandwidth_bytes_per_s, ring.all2all_bandwidth_bytes_per_s) * 10
    fitted = dataclasses.replace(ring, attention_factor=float(k), bandwidth_bytes_per_s=bw,
                                 all2all_bandwidth_bytes_per_s=bw, comm_overlap=f,
                                 overhead_s={PASS_KV: float(o_kv), PASS_Q: float(o_q)})
    check = dataclasses.replace(hw, ring_sizes={**hw.ring_sizes, world: fitted})
    errors = []
    for m in measurements:
        for s in STRATEGIES:
            pred = predict_strategy_cost(s, m["new_tokens"], m["cached_tokens"], model, world, check,
                                         dtype=dtype).attention_s
            errors.append(pred / m["seconds"][s] - 1)
    details = {"overhead_s": {PASS_KV: float(o_kv), PASS_Q: float(o_q)}, "compute_factor": float(k),
               "effective_bandwidth_bytes_per_s": bw, "comm_overlap": f, "cases": len(measurements),
               "median_abs_error": float(np.median(np.abs(errors))) if errors else None,
               "max_abs_error": float(np.max(np.abs(errors))) if errors else None}
    return fitted, details


def _ring_calibration(live: dict[str, Any], hw: HardwareProfile, model: ModelConfig, dtype: str) -> RingCalibration:
    """A RingCalibration from live_group_job's result; overheads are what the model misses on tiny calls."""
    from ringctx.planning.strategy import predict_strategy_cost

    world = live["world"]
    scale = live.get("compute_scale") or live["compute_alone_s"] / live["compute_together_s"]
    if world == 1:
        return RingCalibration(cp_size=1, threads_per_rank=live["threads"], compute_scale=scale, latency_s=0.0,
                               bandwidth_bytes_per_s=hw.bandwidth_bytes_per_s, all2all_latency_s=0.0,
                               all2all_bandwidth_bytes_per_s=hw.bandwidth_bytes_per_s, comm_overlap=1.0,
                               overhead_s={s: 0.0 for s in STRATEGIES})
    lat, bw = fit_latency_bandwidth(*zip(*live["sendrecv"]))
    a2a_lat, a2a_bw = fit_latency_bandwidth(*zip(*live["all2all"]))
    ov = live["overlap"]
    hidden = ov["compute_s"] + ov["comm_s"] - ov["both_s"]
    overlap = min(1.0, max(0.0, hidden / max(1e-12, min(ov["compute_s"], ov["comm_s"]))))
    ring = RingCalibration(cp_size=world, threads_per_rank=live["threads"], compute_scale=scale, latency_s=lat,
                           bandwidth_bytes_per_s=bw, all2all_latency_s=a2a_lat, all2all_bandwidth_bytes_per_s=a2a_bw,
                           comm_overlap=overlap, overhead_s={s: 0.0 for s in STRATEGIES})
    probe = dataclasses.replace(hw, ring_sizes={**hw.ring_sizes, world: ring})
    T = live["tiny_ring"]["new_tokens"]
    overhead = {}
    for s in STRATEGIES:
        cost = predict_strategy_cost(s, T, 0, model, world, probe, dtype=dtype)
        overhead[s] = max(0.0, live["tiny_ring"]["seconds"][s] - cost.attention_s)
    return dataclasses.replace(ring, overhead_s=overhead)


def fit_rules_to_cost_model(hw: HardwareProfile, model: ModelConfig, cp_sizes, dtypes,
                            max_tokens: int = 1 << 17, decimals: int = 4) -> tuple[EmpiricalRuleCoefficients, ...]:
    """Empirical-rule coefficients fitted to the calibrated cost model's choices ("cost" rule).

    Grid: T, P in {round(2**(k/4))} up to `max_tokens` (and P = 0); source "fit-to-cost-model".
    """
    from ringctx.planning.strategy import fit_empirical_rule, fitting_grid, predict_costs

    T, P = fitting_grid(max_tokens)
    rules = []
    for N in cp_sizes:
        if N < 2:
            continue
        for dtype in dtypes:
            labels = []
            for t, p in zip(T.tolist(), P.tolist()):
                costs = predict_costs(int(t), int(p), model, N, hw, dtype=dtype)
                labels.append(costs[PASS_KV].attention_s <= costs[PASS_Q].attention_s)
            a, b, c, _ = fit_empirical_rule(T, P, labels)
            a, b, c = (round(x, decimals) for x in (a, b, c))
            h = a * np.log(T) + b * np.log(T / (T + P)) + c
            agreement = round(float(np.mean((h > 0) == np.asarray(labels))), decimals)
            rules.append(EmpiricalRuleCoefficients(a=a, b=b, c=c, cp_size=N, n_heads=model.n_heads,
                                                   n_kv_heads=model.n_kv_heads, dtype=dtype,
                                                   source="fit-to-cost-model", agreement=agreement))
    return tuple(rules)


def calibrate(settings: CalibrationSettings, *, name: str | None = None, progress: Callable[[str], None] | None = None,
              pools: dict[int, Any] | None = None) -> Calibration:
    """Measure this host and live groups of `settings.cp_sizes` ranks; build a HardwareProfile.

    Under torchrun (WORLD_SIZE > 1 and a process group initialised) use `calibrate_spmd` instead.
    `pools` maps ring sizes to existing RankPools to reuse (tests); others are started and closed
    here. `progress` receives one line per stage.
    """
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    cores = _host_cores()
    model = settings.model
    samples: dict[str, Any] = {"host": _host_info(cores)}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compute = {}
        for dtype in settings.dtypes:
            say(f"attention throughput ({dtype}, {len(settings.attention_rows)} sizes, 1 thread)")
            attention = measure_attention(model, dtype, settings.attention_rows, settings.repeats)
            say(f"decoder-block linear throughput ({dtype})")
            net = _one_block_model(model, dtype)
            linear = measure_linear(model, dtype, settings.linear_tokens, settings.repeats, net=net)
            compute[dtype] = {"attention": attention, "linear": linear}
        say(f"thread scaling (1 vs {cores} threads)")
        scaling = measure_thread_scaling(model, settings.dtypes[0], settings.repeats, cores,
                                         tokens=max(settings.linear_tokens))
    finally:
        torch.set_num_threads(before)
    samples["compute"] = compute
    samples["thread_scaling"] = scaling
    profile = _compute_profile(settings, compute, scaling, cores, name)

    rings: dict[int, RingCalibration] = {1: profile.ring_sizes[1]}
    dtype = settings.dtypes[0]
    samples["live"], samples["ring_fit"] = {}, {}
    from ringctx.parallel.launch import RankPool

    for world in settings.cp_sizes:
        if world == 1:
            continue
        say(f"live group of {world} gloo ranks: SendRecv, all_to_all, compute sharing, overlap")
        pool = (pools or {}).get(world)
        own = None if pool is not None else RankPool(world, backend="gloo",
                                                     threads_per_rank=max(1, cores // world))
        try:
            live = (pool or own).run(live_group_job, _live_settings(settings, dtype))[0]
            samples["live"][str(world)] = live
            rings[world] = _ring_calibration(live, dataclasses.replace(profile, ring_sizes=rings), model, dtype)
            current = dataclasses.replace(profile, ring_sizes=rings)
            cases = ring_design(settings, current, world, dtype)
            say(f"live group of {world} gloo ranks: ring_attention, {len(cases)} cases x 2 strategies")
            timed = (pool or own).run(ring_strategy_job, {"model": model.to_dict(), "dtype": dtype, "cases": cases,
                                                          "repeats": settings.repeats})[0]
        finally:
            if own is not None:
                own.close()
        rings[world], details = fit_ring_model(timed, current, model, world, dtype)
        samples["ring_fit"][str(world)] = {**details, "measurements": timed}
    profile = _finish_profile(profile, rings, settings, samples)
    say("fitting the empirical rule to the calibrated cost model")
    profile = dataclasses.replace(profile, empirical_rules=fit_rules_to_cost_model(
        profile, model, sorted(rings), settings.dtypes))
    return Calibration(profile=profile, samples=samples, seconds=time.perf_counter() - start)


def calibrate_spmd(settings: CalibrationSettings, *, name: str | None = None,
                   progress: Callable[[str], None] | None = None, join_torchrun: bool = False) -> Calibration | None:
    """Calibrate inside an initialised process group (torchrun): call on every rank.

    Rank 0 measures compute while the others wait, then every rank runs the live-group job on
    the launched world. Returns the Calibration on rank 0, None elsewhere. `join_torchrun`: join
    torchrun's gloo group from the environment first when no group is initialised; `progress` is
    called on rank 0 only.
    """
    if join_torchrun and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (progress if rank == 0 else None) or (lambda _msg: None)
    start = time.perf_counter()
    calibration = None
    if rank == 0:
        calibration = calibrate(dataclasses.replace(settings, cp_sizes=(1,)), name=name, progress=say)
    dist.barrier()
    say(f"live group of {world} ranks (torchrun): SendRecv, all_to_all, compute sharing, overlap, ring_attention")
    live = live_group_job(rank, world, _live_settings(settings, settings.dtypes[0]))
    profile, rings, cases = None, None, None
    if rank == 0:
        profile = calibration.profile
        rings = dict(profile.ring_sizes)
        rings[world] = _ring_calibration(live, profile, settings.model, settings.dtypes[0])
        cases = ring_design(settings, dataclasses.replace(profile, ring_sizes=rings), world, settings.dtypes[0])
    shared = [cases]
    dist.broadcast_object_list(shared, src=0)
    timed = ring_strategy_job(rank, world, {"model": settings.model.to_dict(), "dtype": settings.dtypes[0],
                                            "cases": shared[0], "repeats": settings.repeats})
    if rank != 0:
        return None
    rings[world], details = fit_ring_model(timed, dataclasses.replace(profile, ring_sizes=rings), settings.model,
                                           world, settings.dtypes[0])
    calibration.samples["live"] = {str(world): live}
    calibration.samples["ring_fit"] = {str(world): {**details, "measurements": timed}}
    profile = _finish_profile(profile, rings, dataclasses.replace(settings, cp_sizes=(world,)), calibration.samples)
    profile = dataclasses.replace(profile, empirical_rules=fit_rules_to_cost_model(
        profile, settings.model, sorted(rings), settings.dtypes))
    calibration.profile = profile
    calibration.seconds = time.perf_counter() - start
    return calibration


def _host_info(cores: int) -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": cores, "cpu_features": cpu_features(),
            "torch": torch.__version__, "load_average": load,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _compute_profile(settings: CalibrationSettings, compute: dict, scaling: dict, cores: int,
                     name: str | None) -> HardwareProfile:
    from ringctx.planning.strategy import linear_params_per_layer

    full, causal, linear, peak = {}, {}, {}, {}
    overheads, layer_overheads = [], []
    for dtype, c in compute.items():
        att = c["attention"]
        overheads.append(att["overhead_s"])
        full[dtype] = tuple(ThroughputPoint(r, f) for r, _k, _t, f in att["full"])
        causal[dtype] = tuple(ThroughputPoint(r, f) for r, _t, f in att["causal"])
        layer_overhead, linear[dtype] = fit_linear_block(c["linear"]["block"], linear_params_per_layer(settings.model))
        layer_overheads.append(layer_overhead)
        peak[dtype] = max([f for *_, f in att["full"]] + [f for *_, f in c["linear"]["gemm"]])
    single = RingCalibration(cp_size=1, threads_per_rank=cores, compute_scale=scaling["speedup"], latency_s=0.0,
                             bandwidth_bytes_per_s=1e9, all2all_latency_s=0.0, all2all_bandwidth_bytes_per_s=1e9,
                             comm_overlap=1.0, overhead_s={s: 0.0 for s in STRATEGIES})
    host = socket.gethostname()
    return HardwareProfile(
        name=name or f"calibrated-{host}",
        description=(f"calibrated by `ringctx calibrate` on {host}: {cpu_model()}, {cores} cores shared by the "
                     f"local ranks, gloo, torch {torch.__version__}"),
        calibrated=True, peak_flops=peak, achieved_fraction=1.0, bandwidth_bytes_per_s=1e9, latency_s=0.0,
        memory_bytes=_host_memory_bytes(), attention_throughput=full, attention_causal_throughput=causal,
        attention_call_overhead_s=statistics.median(overheads), linear_flops_per_s=linear, host_cores=cores,
        ring_sizes={1: single}, layer_overhead_s=statistics.median(layer_overheads),
    )


def _finish_profile(profile: HardwareProfile, rings: dict[int, RingCalibration], settings: CalibrationSettings,
                    samples: dict) -> HardwareProfile:
    measured = [n for n in sorted(rings) if n > 1]
    primary = rings[measured[0]] if measured else None
    host = samples["host"]
    gemm = {d: max(c["linear"]["gemm"])[2] for d, c in samples["compute"].items()}
    notes = (
        f"Measured {host['time']} on {host['hostname']} ({host['cpu']}, {host['cores']} cores, matrix-engine flags: "
        f"{', '.join(host['cpu_features']) or 'none (no AMX, no avx512_bf16)'}), load average {host['load_average']}; "
        f"model shapes of {settings.model.name}, dtypes {', '.join(settings.dtypes)}, {settings.repeats} repeats"
        f"{' (quick run: rough numbers)' if settings.quick else ''}. "
        "Compute tables: one thread with the other ranks idle; peak_flops = the best of them (achieved_fraction 1). "
        "linear_flops_per_s and layer_overhead_s: time = overhead + FLOPs / rate fitted to whole decoder blocks "
        "without attention (norms, RoPE, SiLU included) from one token up; plain GEMMs gave "
        + ", ".join(f"{d} {g / 1e9:.3g} GFLOP/s" for d, g in gemm.items()) + ". "
        f"tp_latency_s and tp_bandwidth_bytes_per_s: the engine's TP all-reduce (shared memory by size on one host) "
        f"among {settings.tp_size or 'the smallest measured group of'} local ranks, "
        "latency + 2*(N-1)/N*bytes / bandwidth. "
        "memory_bytes is the host RAM, shared by the local ranks (the planner divides it by N). "
        f"Ring sizes measured: {', '.join(str(n) for n in measured) or 'none'}; others are scaled from the nearest "
        "(HardwareProfile.ring). Rerun `ringctx calibrate` after changing the machine, the torch version or the load."
    )
    if primary is None:
        return dataclasses.replace(profile, ring_sizes=rings, notes=notes)
    tp_group = settings.tp_size if str(settings.tp_size) in samples["live"] else measured[0]
    tp_latency, tp_bandwidth = fit_latency_bandwidth(*zip(*samples["live"][str(tp_group)]["allreduce"]))
    samples["tp_link"] = {"group_size": tp_group, "latency_s": tp_latency, "bandwidth_bytes_per_s": tp_bandwidth}
    return dataclasses.replace(profile, ring_sizes=rings, latency_s=primary.latency_s,
                               bandwidth_bytes_per_s=primary.bandwidth_bytes_per_s,
                               comm_overlap=primary.comm_overlap, tp_latency_s=tp_latency,
                               tp_bandwidth_bytes_per_s=tp_bandwidth, notes=notes)


# ----------------------------------------------------------------------------- strategy timings (benchmarks)


def ring_strategy_job(rank: int, world: int, settings: dict) -> list[dict[str, Any]]:
    """Time ring_attention with pass-KV and with pass-Q for (T, P) cases; call on every rank.

    settings: model (ModelConfig dict), dtype, cases [(T, P), ...], repeats. One sequence of T new
    tokens over P cached ones (split evenly), the model's heads, per-layer attention only. Each
    repeat runs both strategies back to back in alternating order, each started at a barrier and
    timed on the slowest rank. Returns per case {new_tokens, cached_tokens, seconds: {strategy:
    median}, kv_over_q: median over rounds of time(pass-KV) / time(pass-Q) (robust to the load
    drifting between rounds), samples: {strategy: [...]}} (the same on every rank).
    """
    from ringctx.parallel.layout import ShardLayout
    from ringctx.parallel.ring import ring_attention

    model = ModelConfig.from_dict(settings["model"])
    dtype = getattr(torch, settings["dtype"])
    repeats = settings["repeats"]
    results = []
    for T, P in settings["cases"]:
        layout = ShardLayout.balanced([T], world, cached_lens=[P])
        n, c = layout.num_new(rank), layout.num_cached(rank)
        q, k, v = _qkv(n, n, model, dtype, seed=1000 + rank)
        cached = {}
        if c:
            _, ck, cv = _qkv(1, c, model, dtype, seed=2000 + rank)
            cached = dict(cached_k=ck, cached_v=cv)
        samples: dict[str, list[float]] = {s: [] for s in STRATEGIES}

        def run(strategy: str) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            ring_attention(q, k, v, layout, strategy=strategy, **cached)
            return _max_over_ranks(time.perf_counter() - t0)

        for s in STRATEGIES:  # warm-up
            run(s)
        for i in range(repeats):
            for s in (STRATEGIES if i % 2 == 0 else STRATEGIES[::-1]):
                samples[s].append(run(s))
        ratios = [a / b for a, b in zip(samples[STRATEGIES[0]], samples[STRATEGIES[1]])]
        results.append({"new_tokens": T, "cached_tokens": P,
                        "seconds": {s: statistics.median(v) for s, v in samples.items()},
                        "kv_over_q": statistics.median(ratios), "samples": samples})
    return results


def spmd_calibration_job(rank: int, world: int, settings: CalibrationSettings):
    """`calibrate_spmd` as a RankPool job (tests of the torchrun path on an existing group)."""
    return calibrate_spmd(settings)
