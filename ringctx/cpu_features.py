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
import os
import platform

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)

UPCAST_MIN_ROWS = 33
"""Fewest rows of activations for which a half-precision CPU matmul runs in float32 where the CPU
has no bf16 units (the weight converted, then the float32 GEMM); fewer rows, such as a question's
prefill, take the decode kernels' product (cpu_kernels.small_linear), which reads the bf16 weight in
place and widens each weight vector once for four rows (AVX2) or two (AVX-512). PyTorch's emulated
bf16 matmul took 1.5-3.9x the time of the float32 route. SmolLM2's 120 block matrices, 2 threads,
2026-12-05, the kernel's time (two-row tile) over the float32 route's: capped at AVX2, 8 rows 0.46,
16 rows 0.68, 24 rows 0.98, 32 rows 0.97, 48 rows 1.27; AVX-512 without bf16 units, 16 rows 0.55,
32 rows 0.79, 48 rows 0.99; the four-row tile took 0.82-0.96x the two-row one's time on AVX2
(docs/BENCHMARKS.md)."""


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
    from .cpu_kernels import cpu_flags

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


def phase_dtypes(dtype: torch.dtype, device: str = "cpu") -> dict[str, str]:
    """Which dtype each phase computes in, and why, for a model held in `dtype` on `device`:
    {"prefill": sentence, "decode": sentence} (what `ringctx info` and `ringctx prefill` say)."""
    name = str(dtype).removeprefix("torch.")
    if dtype not in HALF_DTYPES:
        return {"prefill": f"{name}: the model's dtype", "decode": f"{name}: the model's dtype"}
    if not str(device).startswith("cpu"):
        return {"prefill": f"{name}: GPUs compute it natively (tensor cores)",
                "decode": f"{name}: GPUs compute it natively (tensor cores)"}
    if cpu_has_fast_bf16():
        native = f"{name}, natively: this CPU has AMX or AVX512-BF16 units that PyTorch uses"
        return {"prefill": native, "decode": native}
    return {"prefill": f"float32, rounded back to {name}: matmuls (from {name} weights read in place below "
                       f"{UPCAST_MIN_ROWS} rows) and attention blocks, as PyTorch would emulate {name} here "
                       f"(no {name} units it may use)",
            "decode": f"{name}: one row per matmul, where converting the weights to float32 would cost more "
                      f"than the arithmetic it saves"}


def compute_dtype(dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype a prefill's big matmuls and attention blocks compute in (see `phase_dtypes`)."""
    on_cpu = str(device).startswith("cpu")
    return torch.float32 if (dtype in HALF_DTYPES and on_cpu and not cpu_has_fast_bf16()) else dtype
