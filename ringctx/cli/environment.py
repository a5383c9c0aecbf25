"""What this machine offers ringctx: versions, devices, attention and distributed backends."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import platform

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
from ..planning.machine_speed import auto_dtype


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> dict:
    """A flat dict describing the environment (also `ringctx info --json`)."""
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
    dtype_auto = auto_dtype()
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
        "dtype_auto": dataclasses.asdict(dtype_auto),
        # what a model in dtype auto's choice computes each phase in here, and why
        "compute_dtypes": phase_dtypes(getattr(torch, dtype_auto.dtype), "cuda" if cuda else "cpu"),
    }

