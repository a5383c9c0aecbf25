"""What `ringctx info` (and `ringctx prefill`) say of the CPU kernels: the variant in use and why,
each kernel's state, and the dtype each phase computes in."""

from __future__ import annotations

import torch

from . import build, cpu_features, selection

KERNEL_NAMES = ("fused decode step", "fused short prefill", "GEMV", "int8 weights GEMV", "decode attention (model dtype)",
                "decode attention (int8, fp8)", "RMSNorm/RoPE/SwiGLU rows", "float32 flash attention",
                "AMX bf16 attention", "gated delta rule (float32)")
"""What `cpu_kernels_report` says of, one entry each."""


def cpu_kernels_report() -> dict:
    """What runs on this CPU, for `ringctx info` (builds the kernels): the variant and why it was
    chosen, the variants this CPU runs, and for each kernel "in use" or why it is not."""
    variant, why = build.choose_variant()
    lib = build.library()
    if lib is None:
        reason = build.kernel_error() or why
        kernels = {name: f"not in use: {reason} (PyTorch runs instead)" for name in KERNEL_NAMES}
    else:
        kernels = {name: "in use" for name in KERNEL_NAMES}
        if not variant.reads_int8_weights:
            kernels["int8 weights GEMV"] = (f"not in use: the {variant.name} variant widens int8 codes slower than "
                                            "it reads bf16 (--weights int8 decodes from the bf16 values)")
        if cpu_features.cpu_has_fast_bf16():
            kernels["fused short prefill"] = ("not in use: this CPU computes bf16 natively (a question's rows "
                                              "take the AMX or PyTorch kernels)")
        amx_reason = selection.amx_unavailable_reason()
        if amx_reason is not None:
            kernels["AMX bf16 attention"] = f"not in use: {amx_reason} (bf16 attention uses PyTorch's op)"
    return {
        "variant": None if lib is None else variant.name,
        "vector_floats": None if lib is None else variant.vector_floats,
        "why": why if lib is not None else (build.kernel_error() or why),
        "variants_this_cpu_runs": [v.name for v in build.VARIANTS if build.runs_here(v) is None],
        "kernels": kernels,
    }


def cpu_kernels_status() -> str:
    """One line of `cpu_kernels_report`: the variant in use, or why none is."""
    report = cpu_kernels_report()
    if report["variant"] is None:
        return report["why"]
    off = [f"{name} ({state[len('not in use: '):]})" for name, state in report["kernels"].items() if state != "in use"]
    return (f"{report['variant']} ({report['vector_floats']} floats a vector; {report['why']}): "
            + ", ".join(name for name, state in report["kernels"].items() if state == "in use")
            + (f"; not in use: {'; '.join(off)}" if off else ""))


def phase_dtypes(dtype: torch.dtype, device: str = "cpu") -> dict[str, str]:
    """Which dtype each phase computes in, and why, for a model held in `dtype` on `device`:
    {"prefill": sentence, "decode": sentence} (what `ringctx info` and `ringctx prefill` say)."""
    name = str(dtype).removeprefix("torch.")
    if dtype not in cpu_features.HALF_DTYPES:
        return {"prefill": f"{name}: the model's dtype", "decode": f"{name}: the model's dtype"}
    if not str(device).startswith("cpu"):
        return {"prefill": f"{name}: GPUs compute it natively (tensor cores)",
                "decode": f"{name}: GPUs compute it natively (tensor cores)"}
    if cpu_features.cpu_has_fast_bf16():
        native = f"{name}, natively: this CPU has AMX or AVX512-BF16 units that PyTorch uses"
        return {"prefill": native, "decode": native}
    return {"prefill": f"float32, rounded back to {name}: matmuls (from {name} weights read in place below "
                       f"{selection.UPCAST_MIN_ROWS} rows) and attention blocks, as PyTorch would emulate {name} here "
                       f"(no {name} units it may use)",
            "decode": f"{name}: one row per matmul, where converting the weights to float32 would cost more "
                      f"than the arithmetic it saves"}
