"""What this CPU computes natively, and how ringctx computes half-precision math when it cannot.

Without AMX or AVX512-BF16, PyTorch's CPU kernels emulate bf16 (and fp16) arithmetic: a bf16 GEMM
ran 4x slower than a float32 one here (8K x 576 x 3072: 508 ms vs 127 ms) and the fused flash
attention op 15% slower. On such CPUs ringctx computes big half-precision matmuls and attention
blocks in float32 and rounds the result back: the same contract as a native bf16 kernel (half
inputs, float32 accumulation, half output), with fewer roundings inside, and several times faster.
Small matmuls (decode steps) stay native: there, converting the weights would cost more than the
arithmetic it saves.
"""

from __future__ import annotations

import functools

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)

UPCAST_MIN_ROWS = 64
"""Fewest rows of activations for which a half-precision CPU matmul runs in float32: converting
the weight costs about as much as a 32-row native bf16 matmul here (measured: 64 rows 0.52x the
native time, 8-32 rows about equal, 1 row 1.8x)."""


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """True when the CPU computes bf16 natively (AMX or AVX512-BF16); read once from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def computes_in_float32(x: torch.Tensor) -> bool:
    """True when half-precision math on x should run in float32: a CPU tensor of a half dtype on a
    CPU without native bf16 arithmetic."""
    return x.dtype in HALF_DTYPES and x.device.type == "cpu" and not cpu_has_fast_bf16()
