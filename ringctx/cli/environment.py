"""What this machine offers ringctx: versions, devices, attention and distributed backends."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import statistics

import torch

from ..attention.kernels import flash_attn_available
from ..kernels.build import active_variant
from ..parallel.launch import available_backends
from ..kernels.cpu_features import cpu_has_fast_bf16, cpu_model
from ..kernels.report import cpu_kernels_report, phase_dtypes
from ..kernels.selection import amx_available
from ..host_memory import huge_pages_report
from ..model.config import ATTENTION_KINDS
from ..model.config_gguf import GGUF_ARCHITECTURES
from ..model.config_hf import HF_MODEL_TYPES
from ..planning.machine_speed import (BF16_MARGIN, RATIO_CONFIDENCE, REMEASURE_COMMAND, DtypeChoice, auto_dtype,
                                      choice_path, next_measurement)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report(measure_dtype: bool = False) -> dict:
    """A flat dict describing the environment (also `ringctx info --json`). dtype auto's choice
    is the cached one (measured only when there is none), measured afresh with `measure_dtype`."""
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    attention = ["torch (CPU flash op)"]
    if active_variant() is not None:  # `auto` takes them per block (attention/kernels.py)
        attention.append("auto: ringctx's CPU decode and float32 flash kernels")
    if amx_available():
        attention.append("amx (ringctx's bf16 kernel on AMX)")
    if cuda:
        attention.append("torch (CUDA flash SDPA)")
    if flash_attn_available():
        attention.append("flash-attn")
    if importlib.util.find_spec("triton") is not None:
        attention.append("triton" + ("" if cuda else " (interpreter only: TRITON_INTERPRET=1)"))
    dtype_auto = auto_dtype(measure="now" if measure_dtype else "if missing")
    distributed = available_backends()
    return {
        "ringctx": _version("ringctx"),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "gguf", "safetensors", "triton", "flash-attn",
                                              "fla-core")},
        "cpu": f"{cpu_model()} ({platform.machine()}), {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
               f"PyTorch kernels {torch.backends.cpu.get_cpu_capability()}, big bf16 matmuls "
               + ("native (bf16 units)" if cpu_has_fast_bf16() else "in float32 (no bf16 units PyTorch may use)"),
        "gpus": gpus,
        "attention_backends": attention,
        "model_families": {"hugging_face_model_types": list(HF_MODEL_TYPES),
                           "gguf_architectures": list(GGUF_ARCHITECTURES)},
        "attention_kinds": list(ATTENTION_KINDS),
        "distributed_backends": distributed,
        "cpu_kernels": cpu_kernels_report(),
        "huge_pages": huge_pages_report(),
        "dtype_auto": dtype_auto_report(dtype_auto),
        # what a model in dtype auto's choice computes each phase in here, and why
        "compute_dtypes": phase_dtypes(getattr(torch, dtype_auto.dtype), "cuda" if cuda else "cpu"),
    }


def dtype_auto_report(choice: DtypeChoice) -> dict:
    """`ringctx info`'s dtype_auto: the choice, whether it is settled and why, its numbers (the
    median step per dtype and its interquartile range over the rounds decided by, the ratio and
    its interval against the margin), each measurement's conditions, when it is measured again,
    the command that measures afresh and the cache file."""
    report = {"dtype": choice.dtype, "status": choice.status, "status_why": choice.status_why, "why": choice.why}
    if not choice.step_ms:  # a GPU: nothing measured
        return report
    used = choice.decided_by()
    quartiles = {name: [round(q, 3) for q in _quartiles([t for m in used for t in m.rounds_ms[name]])]
                 for name in ("float32", "bfloat16")} if used else {}
    report |= {
        "step_ms": choice.step_ms,
        "step_ms_interquartile": quartiles,
        "ratio": choice.ratio,
        f"ratio_interval_{RATIO_CONFIDENCE:.0%}": choice.ratio_interval,
        "margin": BF16_MARGIN,
        "measured": choice.measured,
        "measurements": [{"at": m.at, "rounds": len(m.ratios), "others_cpu_share": m.others_cpu_share,
                          "load_average": m.load_average, "cores": m.cpus, "under_load": m.loaded,
                          "decided_by": m in used, "kernels": m.kernels, "threads": m.threads}
                         for m in choice.measurements],
        "next": next_measurement(choice)[1],
        "measure_afresh": REMEASURE_COMMAND,
        "cache_file": str(choice_path()),
    }
    return report


def _quartiles(values: list[float]) -> list[float]:
    """[first quartile, third quartile] of `values` (both the value itself when there is one)."""
    if len(values) < 2:
        return values * 2
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]
