"""What this CPU computes natively, and how ringctx computes half-precision math when it cannot.

Without AMX or AVX512-BF16, PyTorch's CPU kernels emulate bf16 (and fp16) arithmetic: a bf16 GEMM
ran 4x slower than a float32 one here (8K x 576 x 3072: 508 ms vs 127 ms) and the fused flash
attention op 15% slower. On such CPUs ringctx computes big half-precision matmuls and attention
blocks in float32 and rounds the result back: the same contract as a native bf16 kernel (half
inputs, float32 accumulation, half output), with fewer roundings inside, and several times faster.
Small matmuls (decode steps) stay native: there, converting the weights would cost more than the
arithmetic it saves (the row count where that turns, UPCAST_MIN_ROWS, is kernels/selection.py's).

This module holds what the CPU is (its flags, its model name, whether PyTorch computes bf16
natively on it) and the dtype that follows; which kernel runs is kernels/selection.py's.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split(":", 1)[-1].split())
    except OSError:
        return frozenset()


# oneDNN instruction-set caps (ONEDNN_MAX_CPU_ISA) under which its matmuls still have bf16 units.
_ONEDNN_BF16_ISAS = {"ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
                     "AVX10_2_512", "AVX10_2_512_AMX_2"}


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """True when PyTorch computes bf16 natively here: the CPU has AMX or AVX512-BF16 (from
    /proc/cpuinfo) and PyTorch may use them. It may not when ATEN_CPU_CAPABILITY caps ATen below
    AVX-512 or ONEDNN_MAX_CPU_ISA caps oneDNN below its bf16 instruction sets: PyTorch then emulates
    bf16 as on an AVX2-only CPU, and ringctx treats the machine as one."""
    if not cpu_flags() & {"amx_bf16", "avx512_bf16"}:
        return False
    onednn_cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and onednn_cap in _ONEDNN_BF16_ISAS


def computes_in_float32(x: torch.Tensor) -> bool:
    """True when half-precision math on x should run in float32: a CPU tensor of a half dtype on a
    CPU without native bf16 arithmetic."""
    return x.dtype in HALF_DTYPES and x.device.type == "cpu" and not cpu_has_fast_bf16()


def cpu_model() -> str:
    """The CPU's model name (lscpu's "Model name"), or the architecture where it is not known."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compute_dtype(dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype a prefill's big matmuls and attention blocks compute in (see
    kernels/report.py's `phase_dtypes`)."""
    on_cpu = str(device).startswith("cpu")
    return torch.float32 if (dtype in HALF_DTYPES and on_cpu and not cpu_has_fast_bf16()) else dtype
