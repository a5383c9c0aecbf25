"""Decode-step kernels for CPUs with AVX-512 (csrc/cpu_kernels.c), with PyTorch as the fallback.

A decode step should take the time to read the weights and the KV cache once. Two places where
PyTorch on an AVX-512 CPU falls short of that (measured on one without bf16 units,
docs/BENCHMARKS.md):

    small_linear           x [T <= 8, in] @ W^T. PyTorch's bf16 matmul emulates bf16 arithmetic and
                           streamed the weights at half the memory's speed, no faster than float32
                           over twice the bytes. The kernel widens bf16 weights to float32 in
                           registers, prefetches the next rows, accumulates in float32 and rounds
                           once (the contract of a native bf16 GEMM). The model uses it for bf16;
                           for float32 PyTorch's GEMV is already at memory speed (measured equal).
    decode_scores,         a few queries over a token-major [S, Hkv, D] KV cache. PyTorch's bmm
    decode_pv              walked the cache strided and, in bf16, converted it to float32 first.
                           The kernels compute QK^T and PV reading each cache row once, in place;
                           the softmax between them stays in PyTorch (attention/kernels.py).

How: the C file has no PyTorch headers, so the system C compiler builds it in about a second the
first time it is needed; the library is cached under ~/.cache/ringctx (or $RINGCTX_CACHE_DIR),
keyed by a hash of the source and flags, written atomically, and called through ctypes (which
releases the GIL). Without a C compiler or AVX-512, `small_linear` returns None and
`decode_kernels_apply` False, and callers use PyTorch; `kernel_error()` says why.

Environment:
    RINGCTX_CPU_KERNELS=0   never build or use the kernels
    RINGCTX_CACHE_DIR       where the built library is kept (default ~/.cache/ringctx)
    CC                      the C compiler (default: cc, then gcc)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .cpu_features import cpu_has_fast_bf16

MAX_ROWS = 8
"""Most activation rows `small_linear` takes (decode steps and short inputs; a bf16 matmul of 64 or
more rows runs in float32 instead, see ringctx/cpu_features.py). Measured against PyTorch's bf16
matmul here: 1.5-2x faster at 1, 3 and 8 rows."""

_SOURCE = "cpu_kernels.c"
_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_error: str | None = None
_tried = False


def _source_path() -> Path | None:
    """csrc/cpu_kernels.c, found where the CUDA sources are looked for (see cuda_ext.csrc_dir)."""
    from .attention.cuda_ext import csrc_dir  # at call time: ringctx.attention imports this module

    directory = csrc_dir((_SOURCE,))
    return None if directory is None else directory / _SOURCE


def _cache_dir() -> Path:
    if os.environ.get("RINGCTX_CACHE_DIR"):
        return Path(os.environ["RINGCTX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ringctx"


def _compile(source: Path) -> Path:
    """The built library for `source`: compiled once into the cache, atomically, then reused."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join((compiler, *_CFLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_CFLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # concurrent ranks each write their own file; the last one wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _error, _tried
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        try:
            if os.environ.get("RINGCTX_CPU_KERNELS", "1") == "0":
                raise RuntimeError("disabled by RINGCTX_CPU_KERNELS=0")
            source = _source_path()
            if source is None:
                raise RuntimeError(f"csrc/{_SOURCE} not found (set RINGCTX_CSRC_DIR)")
            lib = ctypes.CDLL(str(_compile(source)))
            ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
            lib.ringctx_gemv.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, i32]
            lib.ringctx_gemv.restype = ctypes.c_int
            lib.ringctx_decode_scores.argtypes = [ptr, i64, i64, i64, ptr, i32, i64, f32, ptr, i32]
            lib.ringctx_decode_scores.restype = ctypes.c_int
            lib.ringctx_decode_pv.argtypes = [ptr, i64, i64, i64, ptr, i32, i64, ptr, i32]
            lib.ringctx_decode_pv.restype = ctypes.c_int
            if not lib.ringctx_cpu_kernels_supported():
                raise RuntimeError("this CPU has no AVX-512 (F, BW and VL)")
            _library = lib
        except Exception as e:  # noqa: BLE001 - no compiler, compile error, unsupported CPU: use PyTorch
            _error = f"bf16 CPU kernel unavailable: {e}"
        _tried = True
        return _library


def cpu_kernels_status() -> str:
    """One line for `ringctx info`: whether the kernels are in use here, or why not (builds them)."""
    if _load() is not None:
        return "available: decode attention, bf16 GEMV (AVX-512; csrc/cpu_kernels.c, built with the system C compiler)"
    return _error or "not in use"


def kernel_error() -> str | None:
    """Why the kernels are not in use (None when they are, or were not tried yet)."""
    return _error


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out] in x's dtype, or None where the kernel does
    not apply (the caller then uses F.linear).

    Applies to inference on the CPU with 1 <= T <= MAX_ROWS rows, weight contiguous, no gradient
    wanted, and x and weight both bf16 (on CPUs without bf16 arithmetic) or both float32.
    Float32 accumulation, one rounding at the end.
    """
    dtype = x.dtype
    if not (dtype == weight.dtype and (dtype == torch.float32 or (dtype == torch.bfloat16 and not cpu_has_fast_bf16()))
            and x.device.type == weight.device.type == "cpu" and x.dim() == 2 and weight.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1] and weight.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    lib = _load()
    if lib is None:
        return None
    rows, n_in = x.shape
    n_out = weight.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(rows, n_out, dtype=torch.float32)
    status = lib.ringctx_gemv(xf.data_ptr(), rows, n_in, weight.data_ptr(), int(dtype == torch.bfloat16), n_out,
                              y.data_ptr(), torch.get_num_threads())
    if status != 0:
        return None
    if bias is not None:
        y.add_(bias.float())
    return y.to(dtype)


MAX_QUERY_ROWS_PER_KV_HEAD = 64
"""Most query rows per KV head (GQA group x query tokens) the decode attention kernels take (MAX_R)."""


def decode_kernels_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `decode_scores` and `decode_pv` take these inputs (and the kernels are built):
    q [T, Hq, D], k and v [S, Hkv, D] contiguous, all float32 or all bf16, on the CPU, S >= 1,
    D a multiple of 16 up to 256, at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV head."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)
            and q.device.type == k.device.type == v.device.type == "cpu" and k.shape == v.shape
            and k.shape[0] > 0 and Hq % Hkv == 0 and D % 16 == 0 and D <= 256
            and Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD and k.is_contiguous() and v.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return _load() is not None


def decode_scores(qg: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor | None:
    """scale * Q K^T per KV head, reading the token-major cache in place (see decode_kernels_apply).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read;
    k: [S, Hkv, D]. Returns float32 [Hkv, R, S], or None if the kernel refused.
    """
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    S = k.shape[0]
    scores = torch.empty(Hkv, rows, S)
    status = lib.ringctx_decode_scores(qg.data_ptr(), Hkv, rows, D, k.data_ptr(), int(k.dtype == torch.bfloat16),
                                       S, scale, scores.data_ptr(), torch.get_num_threads())
    return scores if status == 0 else None


def decode_pv(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """P V per KV head, reading the token-major cache in place (see decode_kernels_apply).

    probs: [Hkv, R, S] float32 contiguous; v: [S, Hkv, D]. Returns float32 [Hkv, R, D], or None if
    the kernel refused (it allocates one partial sum per thread).
    """
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, S = probs.shape
    D = v.shape[2]
    out = torch.empty(Hkv, rows, D)
    status = lib.ringctx_decode_pv(probs.data_ptr(), Hkv, rows, S, v.data_ptr(), int(v.dtype == torch.bfloat16),
                                   D, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None
