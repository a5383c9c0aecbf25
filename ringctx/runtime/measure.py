"""This machine's hardware, measured by the engine's own ranks at start-up (`hardware="measured"`).

Without a calibrated profile (`ringctx calibrate`) the per-chunk rule would decide with the
built-in CPU profile's placeholder numbers (C = 1.79e11 FLOP/s where a 2-core Xeon's bf16 GEMMs
run at 3.3e12). Measured here instead, in a second or so, with every rank at once as a prefill
runs them: each rank's GEMM rate at the MLP's shapes of one chunk in the dtype it computes in,
while the others run theirs (they share the cores), and each rank's ring SendRecv of one
chunk's K/V-sized message to the next rank of its CP ring while every ring does the same. The
slowest rank's numbers go into the profile (`planning.hardware.measured_profile`), so every rank
builds the same one from the same all-gathered numbers and decides alike.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..kernels.cpu_features import compute_dtype
from ..parallel.comm import Ring
from ..planning.hardware import HardwareProfile, measured_profile
from ..planning.machine_speed import attention_flops_per_s, matmul_flops_per_s
from .rank_state import RankState

RING_MESSAGE_BYTES = 8 << 20
"""One timed SendRecv's message: about a 4K-token chunk's K/V of a small model's layer, large
enough that the latency is a small part of it."""

RING_REPEATS = 5
"""Timed SendRecvs (after one warm-up); the median counts."""

GEMM_ROWS = 512
"""Rows of the timed GEMMs: a prefill chunk's share of a rank at the small end."""

ATTENTION_ROWS = 1024
"""Query and key rows of the timed attention block: the size of a ring's blocks in a chunk of a few
thousand tokens on a few ranks (the kernel's rate is flat past a few hundred rows on a CPU)."""


def measure_hardware(state: RankState) -> HardwareProfile:
    """Measure this rank's GEMM rate and ring bandwidth together with every other rank, and return
    the profile every rank builds alike from the slowest rank's numbers. Call on every rank."""
    model, settings = state.model, state.settings
    dtype = compute_dtype(model.dtype, str(model.device))
    config = model.config
    flops = matmul_flops_per_s(min(GEMM_ROWS, state.chunk_tokens), config.dim, config.ffn_dim, dtype)
    rows = min(ATTENTION_ROWS, state.chunk_tokens)
    attention = attention_flops_per_s(rows, config.n_heads, config.n_kv_heads, config.head_dim, model.dtype)
    bandwidth = _ring_bandwidth(state) if state.mesh.cp_size > 1 else 0.0
    if state.world_size > 1:
        mine = torch.tensor([flops, bandwidth, attention], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(state.world_size)]
        dist.all_gather(every, mine)
        flops = min(float(t[0]) for t in every)
        bandwidth = min(float(t[1]) for t in every)
        attention = min(float(t[2]) for t in every)
    names = {str(model.dtype).removeprefix("torch."), str(dtype).removeprefix("torch.")}
    return measured_profile(settings.hardware, {name: flops for name in names},
                            bandwidth_bytes_per_s=bandwidth or None, ranks=state.mesh.cp_size,
                            attention={name: (rows, attention) for name in names})


def _ring_bandwidth(state: RankState) -> float:
    """Bytes/s of one SendRecv to the next rank of this rank's CP ring, all rings at once."""
    comm = Ring(state.mesh.cp_group)
    send = torch.zeros(RING_MESSAGE_BYTES, dtype=torch.uint8)
    recv = torch.empty_like(send)
    seconds = []
    for repeat in range(RING_REPEATS + 1):
        dist.barrier(group=state.mesh.cp_group)
        start = time.perf_counter()
        for work in comm.start_shift(send, recv):
            work.wait()
        if repeat:  # the first is a warm-up (buffers, connections)
            seconds.append(time.perf_counter() - start)
    return RING_MESSAGE_BYTES / statistics.median(seconds)
