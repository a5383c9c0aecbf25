"""ringctx's own Triton flash-attention forward kernel, returning (out, lse).

It computes exactly the block kinds ring attention needs (docs/ARCHITECTURE.md), in ringctx's conventions:

    q [T, Hq, D], k and v [S, Hkv, D], token-major, no batch dim
    out [T, Hq, D] in q's dtype, lse [Hq, T] float32 natural log
    GQA: query head h reads KV head h // (Hq // Hkv); KV is never expanded (pointer math only)
    causal=False  a full block: every query sees every key (T != S allowed)
    causal=True   a band: query i sees key j iff j <= i + q_offset and (window == 0 or
                  j > i + q_offset - window); q_offset = 0, window = 0, T == S is the square
                  diagonal block; T != S and any q_offset are allowed (sliding-window layers)
    softcap > 0   every scaled score s becomes softcap * tanh(s / softcap) before the softmax
    a row that sees no key (S == 0, a zero-length key sequence, or a band that misses every key):
    out = 0, lse = -inf, never NaN

Only the key tiles some row of a query tile sees are visited (both ends of a band), so a window W
costs about T * W, not T * S.

Packed variable-length sequences (`cu_seqlens_q`, `cu_seqlens_k`, cumulative lengths starting
at 0, like flash-attn's varlen API) make one launch compute several independent blocks: queries of
sequence b see only keys of sequence b, fully or (causal) as a square diagonal block.

Inputs bf16 / fp16 / fp32, accumulation always float32; fp32 inputs use IEEE fp32 matmuls (not
TF32), so the fp32 path is accurate to ~1e-6. Head dims up to 128 (64, 80 and 128 are tested;
80 runs in a 128-wide tile, masked).

On a GPU the kernel is autotuned over a few tile shapes per (head dim, causal, dtype) on first use
(set RINGCTX_TRITON_AUTOTUNE=0 to take the first, heuristic config). On CPU it runs only in
Triton's interpreter (TRITON_INTERPRET=1), which the tests use with float32 inputs.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from ..kernels.selection import MAX_QUERY_ROWS_PER_KV_HEAD

_LOG2E = 1.4426950408889634  # scores are kept in base 2 inside the kernel: exp2 is one instruction

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 128  # the tile configs are sized (shared memory, registers) for head dims up to 128


def triton_attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seqlens_k: torch.Tensor | Sequence[int] | None = None,
    q_offset: int = 0,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block against a key block with the Triton kernel.

    Args:
        q: [T, Hq, D] float16/bfloat16/float32 on CUDA (or CPU under TRITON_INTERPRET=1).
        k, v: [S, Hkv, D], same dtype and device as q; Hq must be a multiple of Hkv.
        causal: False: full block, every query sees every key (q_offset and window must be 0).
            True: a band, query row i sees key row j iff j <= i + q_offset and (window == 0 or
            j > i + q_offset - window); T != S allowed (packed: per sequence, local rows, and the
            sequences square as below). q_offset = window = 0 with T == S: the diagonal block.
        softmax_scale: multiplies q.k; defaults to 1/sqrt(D).
        q_offset: (causal) how many key rows the first query row sits after the first key row;
            any integer (rows with i + q_offset < 0 see no key).
        window: (causal) 0: no lower bound; W > 0: a row sees its last W key positions, its own
            included (Mistral's / Gemma's sliding window W; flash-attn's window_size=(W - 1, 0)).
        softcap: > 0: scores s = softmax_scale * q.k become softcap * tanh(s / softcap) before
            the softmax (lse over the capped scores); 0: no cap.
        cu_seqlens_q, cu_seqlens_k: optional packed sequences, int [B + 1] cumulative lengths
            (0, l_1, l_1 + l_2, ..., T) and (..., S). Query rows of sequence b see only key rows
            of sequence b. Give both or neither; with causal=True they must be equal (each
            sequence's block is square); a key length of 0 gives that sequence's queries
            out = 0, lse = -inf. Read once on the host (one device sync if they are on GPU).

    Returns:
        out [T, Hq, D] in q's dtype (contiguous), lse [Hq, T] float32, natural log.

    Example (needs a GPU, so not a doctest)::

        q = torch.randn(1024, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = v = torch.randn(1024, 2, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = triton_attention_block(q, k, v, causal=True)   # [1024, 8, 128], [8, 1024]
    """
    plan = _plan(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, q_offset, window, softcap)
    return _forward(q, k, v, plan)


def decode_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when a full block of q [T, Hq, D] against k [S, Hkv, D] is a decode block for
    `triton_decode_attention`: at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV head (one tile:
    the B query tokens of the questions about one document, as many as the CPU decode kernel
    takes, kernels/selection.py), S >= 1, head dim up to 128 (the caller checks dtypes and devices
    as for `triton_attention_block`)."""
    T, Hq, D = q.shape
    S, Hkv = k.shape[:2]
    return T >= 1 and S >= 1 and Hkv >= 1 and Hq % Hkv == 0 and Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD \
        and D <= _MAX_HEAD_DIM


def triton_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    splits: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A full block of a few query rows per KV head against a long K/V (decode: one token of each of
    B questions about one document), split over the keys (flash-decoding).

    The block kernel above gives each query head's rows a program of their own that walks all S
    keys: at T = B a handful of programs stream the whole cache, each KV head read once per query
    head of its group. Here one program takes every query row of one KV head (the GQA group times
    the T tokens, one tile) over one slice of the keys, so each K and V row is read once for all the
    rows, and the slices fill the GPU; a second kernel merges the slices' partial (out, lse) by
    log-sum-exp.

    Args:
        q: [T, Hq, D]; k, v: [S, Hkv, D] (float16/bfloat16/float32, one dtype, one device), with
            Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD; unit stride along D (others any).
        softmax_scale: defaults to 1/sqrt(D).
        splits: key slices (default: enough programs for the GPU's SMs, a few in the interpreter).
        softcap: > 0: scores s become softcap * tanh(s / softcap) before the softmax; 0: none.
            (A decode block is always full: no band here; the caller slices a window's keys.)

    Returns:
        out [T, Hq, D] in q's dtype and lse [Hq, T] float32 (natural log); S == 0: zeros and -inf.
    """
    plan = _plan(q, k, v, False, softmax_scale, None, None, 0, 0, softcap)  # validation, as the block kernel's
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    if T and not decode_applies(q, k) and S:
        raise ValueError(f"triton_decode_attention: {Hq // Hkv * T} query rows per KV head (at most "
                         f"{MAX_QUERY_ROWS_PER_KV_HEAD}) or head dim {D} (at most {_MAX_HEAD_DIM}); use triton_attention_block")
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    if S == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))

    import triton

    interp = _interpret_mode()
    group = Hq // Hkv
    block_n = 16 if interp else 64
    block_r = max(16, triton.next_power_of_2(group * T))  # tl.dot needs tiles of at least 16
    if splits is None:
        # GPU: about two programs per SM (Hkv of them per slice), slices of at least 4 key tiles
        programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = max(1, min(-(-programs // Hkv), triton.cdiv(S, 4 * block_n)))
    splits = max(1, min(int(splits), triton.cdiv(S, block_n)))
    slice_keys = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n  # whole tiles per slice
    splits = triton.cdiv(S, slice_keys)
    part_out = torch.empty((splits, Hq, T, D), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((splits, Hq, T), dtype=torch.float32, device=q.device)
    # 16-bit inputs use the tensor cores with float32 accumulation on a GPU; the interpreter has no
    # working bf16 math, so there (and for float32 inputs) everything is float32, IEEE dots.
    f32 = interp or q.dtype == torch.float32
    kernels = _decode_kernels()
    kernels[0][(splits, Hkv)](
        q, k, v, part_out, part_lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        T, S, slice_keys, plan.score_mul, plan.score_cap,
        GROUP=group, SOFTCAP=plan.softcap > 0, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_R=block_r, BLOCK_N=block_n,
        F32_MATH=f32, num_warps=4, num_stages=1 if interp else 3)
    # The interpreter truncates float32 -> bf16 stores (a GPU rounds to nearest): there the merge
    # writes float32 and PyTorch rounds.
    merged = torch.empty((T, Hq, D), device=q.device) if interp and q.dtype != torch.float32 else out
    kernels[1][(Hq * T,)](
        part_out, part_lse, merged, lse, merged.stride(0), merged.stride(1), T, splits,
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
    if merged is not out:
        out.copy_(merged)
    return out, lse


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernel can run on `device` (default: CUDA if present, else CPU).

    CUDA needs the triton package; CPU needs it too and TRITON_INTERPRET=1 (tests only: slow).
    """
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a triton build that fails to initialize
        return False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return _interpret_mode()


# ---------------------------------------------------------------------------------------------
# Host side: validation and launch planning
# ---------------------------------------------------------------------------------------------


class _Plan:
    """Everything the launch needs, validated. Plain attributes; built only by `_plan`."""

    __slots__ = ("causal", "scale", "cu_q", "cu_k", "n_seqs", "max_seqlen_q", "seqlen_q", "seqlen_k",
                 "q_offset", "window", "softcap", "score_mul", "score_cap")


def _plan(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, q_offset=0, window=0, softcap=0.0) -> _Plan:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"triton_attention_block: q, k, v must be [tokens, heads, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    S, Hkv, Dk = k.shape
    if v.shape != k.shape or Dk != D:
        raise ValueError(f"triton_attention_block: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"[S, Hkv, {D}]")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"triton_attention_block: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"triton_attention_block: q, k, v must share one of float16/bfloat16/float32, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"triton_attention_block: q, k, v on different devices "
                         f"({q.device}, {k.device}, {v.device})")
    if not 0 < D <= _MAX_HEAD_DIM:
        raise ValueError(f"triton_attention_block: head_dim {D} not in 1..{_MAX_HEAD_DIM}")
    if not triton_available(q.device):
        raise RuntimeError("the Triton attention backend needs the triton package and a CUDA device "
                           "(on CPU only the interpreter works: set TRITON_INTERPRET=1, tests only)")

    p = _Plan()
    p.causal = bool(causal)
    p.scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
    p.q_offset, p.window, p.softcap = _band(causal, q_offset, window, softcap)
    # Scores in base 2: s * log2(e), or with the cap softcap * tanh(s / softcap) * log2(e), the
    # kernel's tanh argument being q.k * score_mul and its result scaled by score_cap.
    if p.softcap > 0:
        p.score_mul, p.score_cap = p.scale / p.softcap, p.softcap * _LOG2E
    else:
        p.score_mul, p.score_cap = p.scale * _LOG2E, 1.0
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("triton_attention_block: give both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is None:
        # A window that excludes no key of any row (W > T - 1 + q_offset) is no window: one
        # kernel variant fewer, and no lower-edge mask work in the kernel.
        if p.window and p.window > T - 1 + p.q_offset:
            p.window = 0
        p.cu_q = p.cu_k = None
        p.n_seqs, p.max_seqlen_q, p.seqlen_q, p.seqlen_k = 1, T, T, S
        return p

    cq = _cumulative_lengths(cu_seqlens_q, T, "cu_seqlens_q")
    ck = _cumulative_lengths(cu_seqlens_k, S, "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ValueError(f"triton_attention_block: cu_seqlens_q has {len(cq) - 1} sequences, "
                         f"cu_seqlens_k {len(ck) - 1}")
    if causal and cq != ck:
        raise ValueError("triton_attention_block: causal packed blocks must be square per sequence "
                         "(cu_seqlens_q == cu_seqlens_k)")
    if len(cq) - 1 > 65535:
        raise ValueError("triton_attention_block: at most 65535 packed sequences per call")
    p.cu_q = torch.tensor(cq, dtype=torch.int32, device=q.device)
    p.cu_k = p.cu_q if cq == ck else torch.tensor(ck, dtype=torch.int32, device=q.device)
    p.n_seqs = len(cq) - 1
    p.max_seqlen_q = max((b - a for a, b in zip(cq, cq[1:])), default=0)
    p.seqlen_q, p.seqlen_k = T, S  # unused by the kernel in varlen mode
    return p


def _band(causal, q_offset, window, softcap) -> tuple[int, int, float]:
    """Validated (q_offset, window, softcap) of a block (see `triton_attention_block`)."""
    q_offset, window, softcap = int(q_offset), int(window), float(softcap)
    if not causal and (q_offset or window):
        raise ValueError(f"triton_attention_block: q_offset={q_offset} and window={window} need causal=True "
                         "(a full block sees every key)")
    if window < 0:
        raise ValueError(f"triton_attention_block: window={window} must be >= 0 (0: no window)")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"triton_attention_block: softcap={softcap} must be a finite number >= 0 (0: no cap)")
    # The kernel forms the band's ends in 64 bits, but a launch argument must fit 32, and its masks
    # use window + BLOCK_N in 32 bits: windows below 2^30 (a billion tokens) are plenty.
    if not (-2**31 < q_offset < 2**31 and window < 2**30):
        raise ValueError(f"triton_attention_block: q_offset={q_offset} beyond 32 bits or window={window} "
                         "beyond 2^30")
    return q_offset, window, softcap


def _cumulative_lengths(cu, total: int, name: str) -> list[int]:
    values = cu.tolist() if isinstance(cu, torch.Tensor) else [int(x) for x in cu]
    if isinstance(cu, torch.Tensor) and (cu.dim() != 1 or cu.dtype.is_floating_point):
        raise ValueError(f"triton_attention_block: {name} must be a 1-D integer tensor")
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(f"triton_attention_block: {name} must start at 0 and end at {total}, got {values}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"triton_attention_block: {name} must be non-decreasing, got {values}")
    if total >= 2**31:
        raise ValueError(f"triton_attention_block: {name}: {total} rows exceed int32 offsets")
    return values


def _forward(q, k, v, plan: _Plan, *, config: tuple[int, int] | None = None):
    """Launch the kernel. `config` = (BLOCK_M, BLOCK_N) pins the tiles (tests use it to cover
    several tilings in the interpreter); None autotunes on GPU / picks 32x16 in the interpreter."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    if S == 0:  # nothing to see; the kernel would do the same, but why launch it
        return out.zero_(), lse.fill_(float("-inf"))
    # The kernel needs unit stride along D; heads and tokens may have any stride (views are fine).
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))

    import triton

    interp = _interpret_mode()
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs tiles of at least 16
    args = (
        q, k, v, out, lse,
        plan.cu_q if plan.cu_q is not None else lse,  # dummy pointer when not varlen (never read)
        plan.cu_k if plan.cu_k is not None else lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        T, plan.seqlen_q, plan.seqlen_k, plan.q_offset, plan.window,
        plan.score_mul, plan.score_cap,
        # Autotuning key only: the best tiles differ between a 512-token ring block and a
        # 16K one, so tune per power-of-two length bucket (256 .. 16384).
        min(max(triton.next_power_of_2(plan.max_seqlen_q), 256), 16384),
    )
    meta = dict(
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, CAUSAL=plan.causal, VARLEN=plan.cu_q is not None,
        WINDOW=plan.window > 0, SOFTCAP=plan.softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit
    )
    grid = lambda m: (triton.cdiv(plan.max_seqlen_q, m["BLOCK_M"]), Hq, plan.n_seqs)  # noqa: E731
    kernels = _kernels()
    if config is not None or interp or os.environ.get("RINGCTX_TRITON_AUTOTUNE", "1") == "0":
        if config is not None:
            bm, bn, warps, stages = config[0], config[1], 4, 2
        elif interp:
            bm, bn, warps, stages = 32, 16, 4, 1  # small tiles: the interpreter is slow per element
        else:
            c = _gpu_configs(block_d, q.dtype)[0]
            bm, bn, warps, stages = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        if bm % bn:
            raise ValueError(f"BLOCK_M={bm} must be a multiple of BLOCK_N={bn}")
        kernels.plain[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    else:
        kernels.tuned[grid](*args, **meta)
    return out, lse


def _interpret_mode() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _gpu_configs(block_d: int, dtype: torch.dtype):
    """Candidate tiles. BLOCK_M must be a multiple of BLOCK_N (the causal split relies on it).

    16-bit: 128-row query tiles keep the tensor cores busy (H100/H200 class: wgmma, 8 warps);
    fp32 with IEEE dots has no tensor-core path and far larger tiles in bytes: keep them small.
    The first config of each list is the untuned default (RINGCTX_TRITON_AUTOTUNE=0).
    """
    import triton

    C = triton.Config
    if dtype == torch.float32:
        return [C({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2),
                C({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2)]
    if block_d <= 64:
        return [C({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
                C({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
                C({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=4),
                C({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3)]
    return [C({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
            C({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
            C({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
            C({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3)]


class _Kernels:
    __slots__ = ("plain", "tuned")


_KERNELS: dict[bool, _Kernels] = {}
_DECODE_KERNELS: dict[bool, tuple] = {}


def _decode_kernels() -> tuple:
    """(split kernel, merge kernel) of `triton_decode_attention`, jitted on first use (see `_kernels`)."""
    interp = _interpret_mode()
    _bind_device_functions(interp)
    if interp not in _DECODE_KERNELS:
        import triton

        _DECODE_KERNELS[interp] = (
            triton.jit(_decode_split_kernel, do_not_specialize=["T", "seqlen_k", "slice_keys"]),
            triton.jit(_decode_merge_kernel, do_not_specialize=["T", "splits"]))
    return _DECODE_KERNELS[interp]


_DEVICE_FUNCTIONS: dict[bool, dict] = {}


def _bind_device_functions(interp: bool) -> None:
    """Bind the kernels' helper functions (`_tanh`) as globals, jitted for this mode.

    The compiler accepts only jitted callees, and a function jitted for the GPU cannot be called
    inside the interpreter (nor the reverse): like the kernels, they are jitted on first use, per
    mode; compile-only tests call this with interp=False before building a kernel.
    """
    if interp not in _DEVICE_FUNCTIONS:
        import triton

        _DEVICE_FUNCTIONS[interp] = {"_tanh": triton.jit(_tanh_f32)}
    globals().update(_DEVICE_FUNCTIONS[interp])


def _kernels() -> _Kernels:
    """The jitted kernel, built on first use rather than at import.

    triton.jit decides at decoration time whether it compiles for the GPU or wraps the function
    for the interpreter (TRITON_INTERPRET). Deciding lazily makes the outcome independent of
    which module imported this one first, e.g. a test that sets TRITON_INTERPRET=1 at collection.
    """
    interp = _interpret_mode()
    _bind_device_functions(interp)
    if interp not in _KERNELS:
        import triton

        # Lengths and the lse row stride change with every chunk: don't specialize on them
        # (that would recompile whenever a length crosses a multiple of 16).
        plain = triton.jit(_attn_fwd_kernel,
                           do_not_specialize=["lse_stride_h", "seqlen_q", "seqlen_k", "q_offset", "window",
                                              "seq_bucket"])
        ks = _Kernels()
        ks.plain = plain
        ks.tuned = None
        if not interp:
            def prune(configs, named_args, **kwargs):  # noqa: ARG001 - triton's signature
                return _gpu_configs(kwargs["BLOCK_D"], named_args["Q"].dtype)

            all_configs = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c
                           for d in (64, 128) for dt in (torch.float32, torch.bfloat16)
                           for c in _gpu_configs(d, dt)}
            ks.tuned = triton.autotune(
                configs=list(all_configs.values()),
                key=["HEAD_DIM", "CAUSAL", "VARLEN", "WINDOW", "SOFTCAP", "GROUP", "seq_bucket"],  # + dtypes
                prune_configs_by={"early_config_prune": prune},
            )(plain)
        _KERNELS[interp] = ks
    return _KERNELS[interp]


# ---------------------------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------------------------
# Written as a plain function and jitted lazily (see `_kernels`); `tl` resolves from the module
# globals at compile time. triton is optional: without it this module still imports (annotations
# are strings under `from __future__ import annotations`) and `triton_available()` says False.
try:
    import triton.language as tl
except Exception:  # noqa: BLE001 - ImportError or a broken install; reported by triton_available
    tl = None


def _tanh_f32(x):
    """tanh in float32 from exp2 alone (the interpreter has no libdevice): the odd Taylor series
    to x^11 below |x| = 0.3 (error < 1e-9 there, where 1 - e^-2|x| would cancel), and
    (1 - e^-2|x|) / (1 + e^-2|x|) above (relative error a few ulp)."""
    ax = tl.abs(x)
    t = tl.math.exp2(ax * -2.8853900817779268)  # e^(-2|x|), in (0, 1]: never overflows
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * -0.008863235529902197)))))
    y = tl.where(ax < 0.3, small, big)
    return tl.where(x < 0, -y, y)


# The name the kernels call; `_bind_device_functions` rebinds it to the jitted helper of the mode
# in use before any kernel is built (the plain function would do only in the interpreter).
_tanh = _tanh_f32


def _attn_fwd_kernel(
    Q, K, V, Out, Lse, CuQ, CuK,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    lse_stride_h, seqlen_q, seqlen_k, q_offset, window,
    score_mul,  # softmax_scale * log2(e); with SOFTCAP softmax_scale / softcap (the tanh's argument)
    score_cap,  # with SOFTCAP softcap * log2(e), else unused
    seq_bucket,  # unused by the code: only part of the autotuning key
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program = BLOCK_M query rows of one head of one sequence. Grid (m blocks, Hq, seqs).
    # CAUSAL: row i sees key j iff j <= i + q_offset and (not WINDOW or j > i + q_offset - window),
    # rows and keys counted from their sequence's start.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if VARLEN:
        # 64-bit starts: row offsets times strides exceed 2^31 at million-token lengths.
        q_start = tl.load(CuQ + seq).to(tl.int64)
        q_len = (tl.load(CuQ + seq + 1) - tl.load(CuQ + seq)).to(tl.int32)
        k_start = tl.load(CuK + seq).to(tl.int64)
        k_len = (tl.load(CuK + seq + 1) - tl.load(CuK + seq)).to(tl.int32)
    else:
        q_start = 0
        q_len = seqlen_q
        k_start = 0
        k_len = seqlen_k
    if CAUSAL and not WINDOW:
        # Causal work grows with the row block; launch the heaviest blocks first so the
        # short ones fill the tail of the grid. (A window's blocks cost about the same.)
        m_block = tl.num_programs(0) - 1 - pid_m
    else:
        m_block = pid_m
    if m_block * BLOCK_M >= q_len:  # varlen: this sequence is shorter than the longest one
        return

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < q_len
    kv_head = head // GROUP  # GQA by pointer arithmetic: KV is never expanded

    # 64-bit row offsets: T * Hq * D exceeds 2^31 elements at million-token lengths.
    q_rows = q_start + offs_m.to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + k_start * stride_kt + kv_head * stride_kh
    v_base = V + k_start * stride_vt + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The keys this row block visits, in three stages over tiles of the BLOCK_N grid:
    #   stage 0 [tile_lo, full_lo)  masked: the band's lower edge (a window), seen by some rows
    #   stage 1 [full_lo, full_hi)  whole tiles every real row of the block sees: no mask work
    #   stage 2 [full_hi, band_hi)  masked: the diagonal edge, or a full block's ragged last tile
    # Tiles no row sees are never visited: a window W costs about T * W, not T * S. The band's
    # ends are formed in 64 bits (q_offset and window may each be near 2^31) and clamped to
    # [0, k_len] before they become loop bounds.
    if CAUSAL:
        diag_first = (m_block * BLOCK_M).to(tl.int64) + q_offset  # the first row's last key
        diag_last = (tl.minimum((m_block + 1) * BLOCK_M, q_len) - 1).to(tl.int64) + q_offset  # the last real row's
        band_hi = tl.minimum(tl.maximum(diag_last + 1, 0), k_len).to(tl.int32)
        full_hi = tl.minimum(tl.maximum(diag_first + 1, 0), k_len).to(tl.int32)
        if WINDOW:
            band_lo = tl.minimum(tl.maximum(diag_first - window + 1, 0), k_len).to(tl.int32)
            full_lo = tl.minimum(tl.maximum(diag_last - window + 1, 0), k_len).to(tl.int32)
        else:
            band_lo = 0
            full_lo = 0
    else:
        band_lo = 0
        full_lo = 0
        band_hi = k_len
        full_hi = k_len
    tile_lo = (band_lo // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, tile_lo)
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    if full_hi <= full_lo:  # no whole tile seen by every row: all of [tile_lo, band_hi) is masked
        full_lo = tile_lo
        full_hi = tile_lo
    for stage in tl.static_range(3):
        if stage == 0:
            start = tile_lo
            end = full_lo
        elif stage == 1:
            start = full_lo
            end = full_hi
        else:
            start = full_hi
            end = band_hi
        if stage != 0 or WINDOW:  # without a window stage 0 is always empty: not even emitted
            for start_n in range(start, end, BLOCK_N):
                cols = start_n + offs_n
                kv_off = cols.to(tl.int64)[:, None]
                k_ptrs = k_base + kv_off * stride_kt + offs_d[None, :]
                v_ptrs = v_base + kv_off * stride_vt + offs_d[None, :]
                if stage == 1:
                    if BLOCK_D == HEAD_DIM:  # whole tiles in bounds: plain (vectorized, async) loads
                        kt = tl.load(k_ptrs)
                        vt = tl.load(v_ptrs)
                    else:
                        kt = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                        vt = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
                else:
                    kv_mask = (cols < k_len)[:, None] & d_ok[None, :]
                    kt = tl.load(k_ptrs, mask=kv_mask, other=0.0)
                    vt = tl.load(v_ptrs, mask=kv_mask, other=0.0)
                s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * score_mul
                if SOFTCAP:
                    s = _tanh(s) * score_cap
                if stage != 1:
                    visible = (cols < k_len)[None, :]
                    if CAUSAL:
                        # rel = (i + q_offset) - j, how far key j is behind row i, in 32 bits: the
                        # tile's lag (first row's diagonal - first key) plus the in-tile offsets.
                        # Clamping the lag to [-BLOCK_M, window + BLOCK_N] changes no comparison
                        # (beyond it every rel of the tile is < 0, or >= window / > 0 alike).
                        if WINDOW:
                            top = window + BLOCK_N
                        else:
                            top = BLOCK_N
                        lag = tl.minimum(tl.maximum(diag_first - start_n, -BLOCK_M), top).to(tl.int32)
                        rel = (tl.arange(0, BLOCK_M) + lag)[:, None] - offs_n[None, :]
                        visible = visible & (rel >= 0)
                        if WINDOW:
                            visible = visible & (rel < window)
                    s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                if stage != 1:
                    # A row with no visible key so far has m_new = -inf; shift by 0 instead so that
                    # exp2(-inf - -inf) = NaN never happens (p and alpha come out as exact zeros).
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_use = m_new
                p = tl.math.exp2(s - m_use[:, None])
                alpha = tl.math.exp2(m_i - m_use)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
                m_i = m_new

    empty = l_i == 0.0  # the row saw no key: out = 0, lse = -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(Lse + head.to(tl.int64) * lse_stride_h + q_rows, lse, mask=m_ok)


def _decode_split_kernel(
    Q, K, V, PartOut, PartLse,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    T, seqlen_k, slice_keys,
    score_mul,  # softmax_scale * log2(e); with SOFTCAP softmax_scale / softcap
    score_cap,  # with SOFTCAP softcap * log2(e), else unused
    GROUP: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, F32_MATH: tl.constexpr,
):
    # One program = every query row of one KV head (row i: head kv * GROUP + i // T, token i % T)
    # over keys [split * slice_keys, (split + 1) * slice_keys). Grid (splits, Hkv). Partials are
    # normalised by their own sum; PartOut [splits, Hq, T, D], PartLse [splits, Hq, T] (natural log).
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    r_ok = offs_r < GROUP * T
    head = kv_head * GROUP + offs_r // T
    tok = offs_r % T
    q = tl.load(Q + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if F32_MATH:
        q = q.to(tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    start = split * slice_keys
    end = tl.minimum(start + slice_keys, seqlen_k)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols < end)[:, None] & d_ok[None, :]
        kv_off = cols.to(tl.int64)[:, None]
        kt = tl.load(k_base + kv_off * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(v_base + kv_off * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if F32_MATH:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * score_mul
        else:
            s = tl.dot(q, tl.trans(kt)) * score_mul
        if SOFTCAP:
            s = _tanh(s) * score_cap
        s = tl.where((cols < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile of a slice holds a key
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_MATH:
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new

    empty = l_i == 0.0  # a slice past the keys (not launched) or padding rows
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    row = split.to(tl.int64) * (tl.num_programs(1) * GROUP * T) + head.to(tl.int64) * T + tok  # [splits, Hq, T]
    tl.store(PartOut + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(PartLse + row, lse, mask=r_ok)


def _decode_merge_kernel(
    PartOut, PartLse, Out, Lse, stride_ot, stride_oh, T, splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program = one (query head, token) row: out = sum_s e^(lse_s - lse) out_s, lse = log sum_s
    # e^(lse_s), over the splits in order. Grid (Hq * T,).
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    top = float("-inf")
    for s in range(0, splits):
        top = tl.maximum(top, tl.load(PartLse + s * rows + row))
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, splits):
        ls = tl.load(PartLse + s * rows + row)
        w = tl.where(ls == float("-inf"), 0.0, tl.exp(ls - tl.where(top == float("-inf"), 0.0, top)))
        total += w
        acc += w * tl.load(PartOut + (s * rows + row) * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    head = row // T
    tok = row % T
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + head * T + tok, tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total))))
