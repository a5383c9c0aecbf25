"""ringctx's CUDA kernels (csrc/): loader, dispatch, and the pure-torch paths they replace.

Two kernels do in one pass what PyTorch does in several:

    merge_partials  N partial (out, lse) pairs -> merged (out, lse), float32 math, vectorized
    scatter_kv      a rank's KV shard -> the decode cache rows given by positions, K and V and
                    every layer in one launch

The extension is built with torch.utils.cpp_extension.load the first time a CUDA tensor needs
it (about a minute, once; ninja and the CUDA toolkit must be on the machine) and cached in
torch's extension directory (TORCH_EXTENSIONS_DIR) for later processes. CPU installs never
build anything. When the build is impossible or fails, the pure-torch path is used and
`extension_error()` says why (and one warning is issued).

Environment:
    RINGCTX_CSRC=0        never build or use the extension (torch paths only)
    RINGCTX_CSRC_DIR      directory holding the csrc sources (default: found next to the package)
    RINGCTX_CSRC_VERBOSE=1  show the compiler output of the build
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..kernels import paths

_SOURCES = ("bindings.cpp", "merge_partials.cu", "scatter_kv.cu")
_HEADERS = ("ringctx_kernels.h", "vec_io.cuh")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_PARTIALS = 64
"""Most partials the merge kernel takes in one launch (kMaxPartials in csrc/ringctx_kernels.h)."""

_lock = threading.Lock()
_module = None
_error: str | None = None
_tried = False
_off_in_scope = 0


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def csrc_dir(files: Sequence[str] = _SOURCES + _HEADERS) -> Path | None:
    """Where the CUDA kernel sources are (ringctx.kernels.paths.csrc_dir); None when not found."""
    return paths.csrc_dir(files)


def load_extension(*, verbose: bool | None = None):
    """The compiled extension module, building it on first use; None when unavailable.

    Never builds without a CUDA device (CPU installs stay build-free). A failed build is not
    retried in this process; `extension_error()` holds the reason.
    """
    global _module, _error, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        reason = _why_not_buildable()
        if reason is None:
            try:
                _module = _build(verbose)
            except Exception as e:  # noqa: BLE001 - compiler errors, missing ninja, ...
                reason = f"building the ringctx CUDA extension failed: {type(e).__name__}: {e}"
                warnings.warn(reason + " (using the pure-torch paths)", RuntimeWarning, stacklevel=2)
        _error = reason
        _tried = True
        return _module


def extension_available() -> bool:
    """True when the kernels are usable now (loads/builds on first call)."""
    return not _switched_off() and load_extension() is not None


def extension_error() -> str | None:
    """Why the extension is not in use, or None when it is (or was not tried yet)."""
    if _switched_off():
        return "disabled (RINGCTX_CSRC=0 or csrc_disabled())"
    return _error


@contextlib.contextmanager
def csrc_disabled() -> Iterator[None]:
    """Use the pure-torch paths inside this block (benchmarks compare both; not thread-local)."""
    global _off_in_scope
    _off_in_scope += 1
    try:
        yield
    finally:
        _off_in_scope -= 1


def _switched_off() -> bool:
    return _off_in_scope > 0 or os.environ.get("RINGCTX_CSRC", "1") == "0"


def _why_not_buildable() -> str | None:
    if os.environ.get("RINGCTX_CSRC", "1") == "0":
        return "disabled by RINGCTX_CSRC=0"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device: the extension is built only on GPU machines"
    if csrc_dir() is None:
        return f"csrc sources {', '.join(_SOURCES)} not found (set RINGCTX_CSRC_DIR)"
    return None


def _build(verbose: bool | None):
    from torch.utils.cpp_extension import load

    src = csrc_dir()
    assert src is not None
    if verbose is None:
        verbose = os.environ.get("RINGCTX_CSRC_VERBOSE") == "1"
    # torch.utils.cpp_extension compiles for the visible GPU's architecture unless
    # TORCH_CUDA_ARCH_LIST says otherwise, rebuilds only when a source changes, and keeps the
    # result under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions).
    return load(
        name="ringctx_csrc",
        sources=[str(src / s) for s in _SOURCES],
        extra_include_paths=[str(src)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],  # precise expf/logf: the merge must match the float32 torch path
        verbose=verbose,
    )


# ---------------------------------------------------------------------------------------------
# merge_partials
# ---------------------------------------------------------------------------------------------


def try_merge_partials_cuda(
    partials: Sequence[tuple[torch.Tensor, torch.Tensor]],
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Merge with the one-pass CUDA kernel, or return None when it does not apply.

    It applies when every tensor is on one CUDA device, the outs share a dtype in
    float32/float16/bfloat16, 1 <= N <= MAX_PARTIALS, and the extension loads. The caller
    (ringctx.attention.merge.merge_partials) falls back to its torch path on None.

    Args:
        partials: N pairs (out [T, H, D], lse [H, T]); lse natural log, any float dtype
            (converted to float32). Non-finite lse (-inf, +inf, NaN) marks a row the partial
            saw no key for: it contributes nothing there, whatever its out holds.
        out_dtype: dtype of the merged out; default the outs' dtype.

    Returns:
        (out [T, H, D] in out_dtype, lse [H, T] float32) with out = sum_i w_i out_i / sum_i w_i,
        w_i = exp(lse_i - max lse), lse = log sum_i exp(lse_i); rows empty everywhere get out = 0,
        lse = -inf. None when the kernel does not apply.
    """
    if not partials or len(partials) > MAX_PARTIALS or _switched_off():
        return None
    out0, _ = partials[0]
    if out0.device.type != "cuda" or out0.dtype not in _KERNEL_DTYPES or out0.dim() != 3:
        return None
    T, H, D = out0.shape
    for i, (o, lse) in enumerate(partials):
        if o.device != out0.device or lse.device != out0.device or o.dtype != out0.dtype:
            return None
        if o.shape != (T, H, D) or lse.shape != (H, T):
            raise ValueError(f"merge_partials: partial {i} has out {tuple(o.shape)} and lse {tuple(lse.shape)}, "
                             f"expected out {(T, H, D)} and lse {(H, T)}")
    ext = load_extension()
    if ext is None:
        return None
    out, lse = ext.merge_partials([o for o, _ in partials], [lse.float() for _, lse in partials])
    if out_dtype is not None and out_dtype != out.dtype:
        out = out.to(out_dtype)
    return out, lse


# ---------------------------------------------------------------------------------------------
# scatter_kv
# ---------------------------------------------------------------------------------------------


def scatter_kv(
    k_cache: torch.Tensor | Sequence[torch.Tensor],
    v_cache: torch.Tensor | Sequence[torch.Tensor] | None,
    k_shard: torch.Tensor | Sequence[torch.Tensor],
    v_shard: torch.Tensor | Sequence[torch.Tensor] | None,
    positions: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Write a KV shard into a cache in sequence order: cache[l][positions[i]] = shard[l][i].

    Args:
        k_cache, v_cache: the cache, written in place: per-layer tensors [P, Hkv, D] (a list,
            like KVCache.k), or one [L, P, Hkv, D] tensor, or one [P, Hkv, D] tensor (one layer).
            Row strides are free (slices of bigger buffers are fine). v_cache and v_shard may
            both be None (K only).
        k_shard, v_shard: the same layout with n rows per layer ([n, Hkv, D] each), same dtype,
            layer count, Hkv and D as the cache.
        positions: int [n], the cache row of each shard row, in [0, P) and distinct (with
            duplicates, which row lands is unspecified).
        check: raise IndexError if a position is outside [0, P). Costs one device sync on CUDA
            (the kernel skips such rows and raises a flag; it never writes out of bounds). On
            the torch path the bounds are always checked, before anything is written.

    On CUDA with the extension loaded: one kernel launch for K, V and every layer (needs each
    plane's (Hkv, D) part contiguous and one row stride per side). Otherwise one index_copy_ per
    layer and tensor.
    """
    dst, src = _scatter_planes(k_cache, v_cache, k_shard, v_shard, positions)
    if dst[0].device.type == "cuda" and not _switched_off():
        ext = load_extension()
        if ext is not None and _kernel_layout_ok(dst) and _kernel_layout_ok(src):
            flag = torch.zeros(1, dtype=torch.int32, device=dst[0].device)
            pos = positions.to(device=dst[0].device, dtype=torch.int64).contiguous()
            ext.scatter_kv(dst, src, pos, flag)
            if check and flag.item():
                raise IndexError(f"scatter_kv: a position is outside [0, {dst[0].shape[0]}) "
                                 "(those rows were not written)")
            return
    _scatter_torch(dst, src, positions)


def scatter_kv_torch(k_cache, v_cache, k_shard, v_shard, positions) -> None:
    """The pure-torch scatter (CPU path, fallback, benchmark baseline): index_copy_ per plane."""
    _scatter_torch(*_scatter_planes(k_cache, v_cache, k_shard, v_shard, positions), positions)


def _scatter_torch(dst, src, positions) -> None:
    P = dst[0].shape[0]
    pos = positions.to(device=dst[0].device, dtype=torch.int64)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= P):  # index_copy_ on CUDA would assert
        raise IndexError(f"scatter_kv: positions must lie in [0, {P}), got {int(pos.min())}..{int(pos.max())}")
    for d, s in zip(dst, src):
        d.index_copy_(0, pos, s)


def _planes(x, what: str) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.dim() == 3:
            return [x]
        if x.dim() == 4:
            return list(x.unbind(0))
        raise ValueError(f"scatter_kv: {what} must be [rows, Hkv, D], [L, rows, Hkv, D] or a list of "
                         f"[rows, Hkv, D], got shape {tuple(x.shape)}")
    planes = list(x)
    if not planes or any(not isinstance(p, torch.Tensor) or p.dim() != 3 for p in planes):
        raise ValueError(f"scatter_kv: {what} must be a non-empty list of [rows, Hkv, D] tensors")
    return planes


def _scatter_planes(k_cache, v_cache, k_shard, v_shard, positions):
    """Flatten to (cache planes, shard planes), K's layers then V's, and validate them."""
    if (v_cache is None) != (v_shard is None):
        raise ValueError("scatter_kv: give both v_cache and v_shard, or neither")
    dst, src = _planes(k_cache, "k_cache"), _planes(k_shard, "k_shard")
    if v_cache is not None:
        vd, vs = _planes(v_cache, "v_cache"), _planes(v_shard, "v_shard")
        if len(vd) != len(dst) or len(vs) != len(src):
            raise ValueError("scatter_kv: K and V have different layer counts")
        dst, src = dst + vd, src + vs
    if len(dst) != len(src):
        raise ValueError(f"scatter_kv: cache has {len(dst)} layers, shard {len(src)}")
    d0, s0 = dst[0], src[0]
    for d, s in zip(dst, src):
        if d.shape != d0.shape or s.shape != s0.shape:
            raise ValueError("scatter_kv: layers differ in shape")
        if d.shape[1:] != s.shape[1:]:
            raise ValueError(f"scatter_kv: cache {tuple(d.shape)} and shard {tuple(s.shape)} differ in (Hkv, D)")
        if d.dtype != d0.dtype or s.dtype != d0.dtype or d.device != d0.device or s.device != d0.device:
            raise ValueError(f"scatter_kv: caches and shards must share one dtype and device, got "
                             f"{d.dtype}/{s.dtype} on {d.device}/{s.device}")
    if positions.dim() != 1 or positions.dtype.is_floating_point or positions.numel() != s0.shape[0]:
        raise ValueError(f"scatter_kv: positions must be an integer [n] tensor with n = {s0.shape[0]}, "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    return dst, src


def _kernel_layout_ok(planes: list[torch.Tensor]) -> bool:
    """The kernel's layout rule: (Hkv, D) contiguous in every plane, one row stride for all."""
    p0 = planes[0]
    return all(p.stride(2) == 1 and p.stride(1) == p.shape[2] and p.stride(0) == p0.stride(0) for p in planes)
