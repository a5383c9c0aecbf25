"""Single-device attention blocks: the compute step of every ring algorithm.

Ring attention only ever needs two kinds of block (docs/ARCHITECTURE.md):

    full      every query sees every key (a KV block from earlier in the sequence, or the cache)
    diagonal  T == S and query i sees keys 0..i (a chunk against itself)

Which kind applies is decided by the caller from global positions and sequence ids, never by a
kernel's alignment rule for unequal lengths (PyTorch aligns causal masks top-left, flash-attn
bottom-right): `causal=True` is therefore only accepted for square blocks.

Backends:
    "torch"       PyTorch's fused flash op for the tensor's device (CPU: the AMX/AVX-512 op; CUDA:
                  the flash SDPA op, with KV heads expanded since it has no native GQA)
    "amx"         ringctx's bf16 flash kernel for CPUs with AMX (csrc/cpu_attention_amx.c), 1.2-1.9x
                  PyTorch's CPU op there (scripts/bench_cpu_attention.py); head_dim a multiple of 32
    "flash-attn"  Dao-AILab flash-attn (CUDA), if installed: native GQA, token-major layout
    "triton"      ringctx's own Triton kernels (CUDA; TRITON_INTERPRET=1 on CPU for tests): full blocks
                  of a few query rows per KV head (decode) split over the keys, the rest the
                  flash-attention forward
    "reference"   float64 reference (tests)
    "auto"        flash-attn on CUDA when installed, else "torch" (decode blocks: the Triton
                  decode kernel where triton is installed); on the CPU the decode kernel for full
                  blocks of a few query rows per KV head, "amx" for the other bf16 blocks it
                  takes, ringctx's float32 flash kernel (csrc/cpu_flash.c) for float32 blocks and
                  for bf16 ones on CPUs without bf16 units (computed in float32), else "torch"
"""

from __future__ import annotations

import functools
import math

import torch

from ..kernels import cpu, selection
from ..kernels.cpu_features import computes_in_float32
from .merge import PartialAccumulator, sanitize_lse
from .gpu_blocks import flash_attn_band_block, torch_band_block
from .reference import band_mask, reference_attention

BACKENDS = ("auto", "torch", "amx", "flash-attn", "triton", "reference")


@functools.lru_cache(maxsize=1)
def flash_attn_available() -> bool:
    """True when the optional flash-attn package imports (it needs CUDA)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to the device's default backend ("torch" on the CPU: `attention_block` picks "amx"
    per block where it applies); reject unknown names and backends this machine cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flash-attn" if device.type == "cuda" and flash_attn_available() else "torch"
    if backend == "flash-attn" and not flash_attn_available():
        raise ValueError("attention backend 'flash-attn' requested but flash-attn is not installed "
                         "(pip install 'ringctx[flash]' on a CUDA machine), or use backend 'torch'")
    if backend == "amx" and not (device.type == "cpu" and selection.amx_available()):
        raise ValueError("attention backend 'amx' requested but this machine cannot run it (it needs a CPU "
                         f"with AMX-BF16 and the CPU kernels: {selection.amx_unavailable_reason() or 'not a CPU tensor'}); "
                         "use backend 'torch'")
    return backend


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    backend: str = "auto",
    one_sequence: bool = False,
    q_offset: int = 0,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block of queries against one block of keys, with its log-sum-exp.

    Args:
        q: [T, Hq, D].
        k, v: [S, Hkv, D], Hq a multiple of Hkv; query head h reads KV head h // (Hq // Hkv).
        causal: False: a full block. True: a band: query i sees key j iff j <= i + q_offset and
            (window == 0 or j > i + q_offset - window). With q_offset 0 and no window a square
            diagonal block (T == S), query i sees 0..i; other bands come from a layer's span
            (attention/spans.py: sliding windows, blocks whose queries start after their keys).
        q_offset, window: the band (causal blocks only); see causal.
        softcap: > 0: scores become softcap * tanh(score / softcap) before the softmax.
        softmax_scale: defaults to 1/sqrt(D).
        backend: see the module docstring.
        one_sequence: the queries are one sequence's tokens (a prefill's block), so the kernel may
            be chosen by the number of rows alone (AMX from AMX_FROM_ROWS_PER_KV_HEAD rows per KV
            head, kernels/selection.py). False: they may be different sequences' (a batched decode
            step), and each row gets the same bits whatever else shares the call (the decode kernel
            up to its MAX_QUERY_ROWS_PER_KV_HEAD rows, as the fused batch step computes them).

    Returns:
        out [T, Hq, D] in q's dtype and lse [Hq, T] float32 (natural log). With S == 0 every row
        sees no key: out = 0, lse = -inf.

    Example:
        >>> q = torch.randn(6, 4, 32); k = v = torch.randn(6, 2, 32)
        >>> out, lse = attention_block(q, k, v, causal=True)
        >>> out.shape, lse.shape, lse.dtype
        (torch.Size([6, 4, 32]), torch.Size([4, 6]), torch.float32)
    """
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    if not causal and (q_offset or window):
        raise ValueError(f"q_offset={q_offset} and window={window} describe a causal band; "
                         "a full block (causal=False) takes neither")
    if window < 0:
        raise ValueError(f"window must be a positive token count (0: none), got {window}")
    band = causal and (q_offset != 0 or window != 0 or T != S)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if T == 0 or S == 0:  # the fused ops divide by zero (SIGFPE) on empty blocks
        return (torch.zeros_like(q),
                torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device))
    requested, backend = backend, resolve_backend(backend, q.device)
    if backend == "reference":
        visible = band_mask(T, S, q_offset, window, q.device) if causal else None
        out, lse = reference_attention(q, k, v, visible, scale, softcap=softcap)
        return out.to(q.dtype), lse.float()
    if band or softcap:
        return _band_or_capped_block(q, k, v, causal, q_offset, window, softcap, scale, backend, requested)
    if backend == "flash-attn":
        return _flash_attn_block(q, k, v, causal, scale)
    if backend == "triton":
        from .triton_attn import decode_applies, triton_attention_block, triton_decode_attention

        if not causal and decode_applies(q, k):  # decode: B query tokens against a long K/V
            return triton_decode_attention(q, k, v, softmax_scale=scale)
        return triton_attention_block(q, k, v, causal=causal, softmax_scale=scale)
    if q.device.type == "cuda":
        if requested == "auto" and not causal:
            # No flash-attn here: decode blocks take ringctx's split-K Triton kernel, which reads
            # each K/V row once for every query row, where PyTorch's op would expand the KV heads
            # (a copy of the whole block) and give each query head a program of its own.
            from .triton_attn import decode_applies, triton_available, triton_decode_attention

            if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.dtype == k.dtype == v.dtype \
                    and decode_applies(q, k) and triton_available(q.device):
                return triton_decode_attention(q, k, v, softmax_scale=scale)
        return _torch_cuda_block(q, k, v, causal, scale)
    # Which CPU kernel takes the block: the rules and thresholds are kernels/selection.py's, which
    # the fused prefill (model/decode_step.py) asks too.
    amx_first = (one_sequence and requested == "auto" and selection.amx_before_decode(T * (Hq // Hkv))
                 and selection.amx_attention_applies(q, k, v))
    flash_first = (one_sequence and requested == "auto" and selection.flash_before_decode(T * (Hq // Hkv))
                   and computes_in_float32(q) and selection.flash_attention_applies(q, k, v))
    if backend != "amx" and not causal and not (amx_first or flash_first) and selection.decode_kernels_apply(q, k, v):
        done = _decode_kernel_block(q, k, v, scale)
        if done is not None:
            return done
    if backend == "amx" or amx_first or (requested == "auto" and not selection.few_query_rows(T)
                                         and selection.amx_attention_applies(q, k, v)):
        if not selection.amx_attention_applies(q, k, v):
            raise ValueError(f"attention backend 'amx' takes bf16 CPU tensors with head_dim {selection.AMX_HEAD_DIMS}; "
                             f"got {q.dtype} q {tuple(q.shape)}; use backend 'torch'")
        return cpu.amx_attention(q, k, v, causal=causal, scale=scale)
    return _torch_cpu_block(q, k, v, causal, scale, own_kernel=requested == "auto")


def _band_or_capped_block(q, k, v, causal, q_offset, window, softcap, scale, backend, requested):
    """A block with a band (sliding window, an offset diagonal) or soft-capped scores: ringctx's CPU
    kernels take both (AMX for bf16 where it runs, else the float32 flash kernel, which widens
    bf16 as it reads); on CUDA the Triton kernel when asked for, flash-attn where its alignment
    fits; else PyTorch ops (gpu_blocks.torch_band_block, any device)."""
    if q.device.type == "cpu" and backend in ("torch", "amx"):
        band = dict(causal=causal, scale=scale, q_offset=q_offset, window=window, softcap=softcap)
        if (backend == "amx" or requested == "auto") and selection.amx_attention_applies(q, k, v):
            return cpu.amx_attention(q, k, v, **band)
        if backend == "amx":
            raise ValueError(f"attention backend 'amx' takes bf16 CPU tensors with head_dim {selection.AMX_HEAD_DIMS}; "
                             f"got {q.dtype} q {tuple(q.shape)}; use backend 'torch'")
        if selection.flash_attention_applies(q, k, v):
            out, lse = cpu.flash_attention(q, k, v, **band)
            return out.to(q.dtype), lse
    if not causal:  # a full block with a soft-cap: the band that reaches every key
        q_offset, window = k.shape[0] - 1, 0
    if backend == "triton" or (q.device.type == "cuda" and requested == "auto" and _triton_runs(q.device)):
        from .triton_attn import triton_attention_block

        return triton_attention_block(q, k, v, causal=True, softmax_scale=scale, q_offset=q_offset, window=window,
                                      softcap=softcap)
    if backend == "flash-attn":
        done = flash_attn_band_block(q, k, v, scale=scale, q_offset=q_offset, window=window, softcap=softcap)
        if done is not None:
            return done
    return torch_band_block(q, k, v, scale=scale, q_offset=q_offset, window=window, softcap=softcap)


def _triton_runs(device: torch.device) -> bool:
    from .triton_attn import triton_available

    return triton_available(device)


def group_queries(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """q [T, Hq, D] -> [Hkv, group * T, D] float32 contiguous: the query rows of every token grouped by
    the KV head they read (query head h reads KV head h // group), row g * T + t being head
    kv * group + g of token t. The layout of the CPU decode attention kernels."""
    T, Hq, D = q.shape
    group = Hq // Hkv
    return q.float().reshape(T, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * T, D).contiguous()


def ungroup_rows(out: torch.Tensor, lse: torch.Tensor, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `group_queries` for results: out [Hkv, group * T, D], lse [Hkv, group * T] ->
    out [T, Hq, D] in `dtype`, lse [Hq, T] float32."""
    Hkv, rows, D = out.shape
    group = rows // T
    lse = lse.reshape(Hkv * group, T)
    out = out.view(Hkv, group, T, D).permute(2, 0, 1, 3).reshape(T, Hkv * group, D)
    return out.to(dtype), lse


def _decode_kernel_block(q, k, v, scale):
    """A full block of a few query rows per KV head (decode steps: B query tokens, one per question
    about this document) through ringctx's one-pass CPU decode attention (csrc/cpu_kernels.c): every
    K and V row read once, in place, for all B x Hq query rows. None if the kernel refused."""
    T = q.shape[0]
    done = cpu.decode_attention(group_queries(q, k.shape[1]), k, v, scale)
    return None if done is None else ungroup_rows(*done, T, q.dtype)


def _small_query_block(q, k, v, scale):
    """Full block for a few queries without the CPU kernels: QK^T, softmax, PV in float32 as batched
    matmuls over [Hkv, S, D] views, GQA without expanding KV (query heads grouped by the KV head they
    read). The softmax is spelled out (max, exp, sum) so that the normaliser and the LSE come from
    one pass each."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = group_queries(q, Hkv)
    scores = torch.bmm(qg, k.float().permute(1, 2, 0)).mul_(scale)  # [Hkv, group*T, S]
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(row_max).exp_()  # unnormalised
    row_sum = probs.sum(dim=-1, keepdim=True)
    out = torch.bmm(probs, v.float().transpose(0, 1)).div_(row_sum)  # [Hkv, group*T, D]
    return ungroup_rows(out, (row_max + row_sum.log()).squeeze(-1), T, q.dtype)


def reads_kv_in_place(q: torch.Tensor, backend: str = "auto") -> bool:
    """True when attention_block's blocks for queries like q read K and V where they lie, in any
    row and head layout (ringctx's CPU flash kernels: AMX, or the float32 one widening a bf16
    model's K/V on a CPU without bf16 units; the decode kernel reads the cache's own layout), so
    that a caller need not pack them into one tensor."""
    if q.device.type != "cpu" or backend not in ("auto", "amx"):
        return False
    if selection.amx_available():
        return True
    # A float32 model's blocks keep packed, head-major K/V: its float32 flash kernel read the
    # cache's token-major rows 3-6% slower on long blocks (bf16 ones are widened into a buffer).
    return q.dtype == torch.bfloat16 and computes_in_float32(q) and backend == "auto" \
        and selection.flash_attention_built(q.shape[-1])


def _torch_cpu_block(q, k, v, causal, scale, own_kernel: bool = False):
    """A block on the CPU with PyTorch's fused op; own_kernel: float32 blocks take ringctx's flash
    kernel instead where it applies (0.77-0.91x the time of PyTorch's op on causal blocks,
    0.88-0.99x on full ones: AVX2 and AVX-512, 1-2 threads; docs/BENCHMARKS.md)."""
    if not causal and selection.few_query_rows(q.shape[0]):
        return _small_query_block(q, k, v, scale)
    if computes_in_float32(q):  # no bf16 units: float32 is faster and rounds only once
        if own_kernel and selection.flash_attention_applies(q, k, v):
            # the kernel widens bf16 as it reads (a question over a document's cache: no float32
            # copy of the document's rows; 0.83x the time for 16 tokens over 8K keys, the same for
            # a prefill's blocks: docs/BENCHMARKS.md)
            out, lse = cpu.flash_attention(q, k, v, causal=causal, scale=scale)
            return out.to(q.dtype), lse
        out, lse = _torch_cpu_block(q.float(), k.float(), v.float(), causal, scale, own_kernel)
        return out.to(q.dtype), lse
    if own_kernel and q.dtype == torch.float32 and selection.flash_attention_applies(q, k, v):
        return cpu.flash_attention(q, k, v, causal=causal, scale=scale)
    # The op wants [B, H, S, D]; a transposed view of our token-major tensors costs nothing, and
    # it returns out whose memory is token-major, so the transpose back is free too.
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb, kb, vb, 0.0, causal, scale=scale)[:2]
    return out[0].transpose(0, 1), lse[0]


def _torch_cuda_block(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    if group > 1:  # PyTorch's CUDA flash op has no native GQA
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        qb, kb, vb, 0.0, causal, False, scale=scale)[:2]
    return out[0].transpose(0, 1), sanitize_lse(lse[0, :, : q.shape[0]])


def _flash_attn_block(q, k, v, causal, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                  softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out[0], sanitize_lse(lse[0, :, : q.shape[0]])


def attention_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cached_k: torch.Tensor | None = None,
    cached_v: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of T new tokens of one sequence over its P cached tokens and causally itself.

    New token i (global position P + i) sees every cached token and new tokens 0..i: a full block
    against the cache merged with a diagonal block against the new keys.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] the new tokens' keys and values.
        cached_k, cached_v: [P, Hkv, D] or None (P = 0).

    Returns:
        out [T, Hq, D] in q's dtype, lse [Hq, T] float32.

    Example:
        >>> q = torch.randn(2, 4, 16); k = v = torch.randn(2, 2, 16); ck = cv = torch.randn(5, 2, 16)
        >>> out, lse = attention_with_cache(q, k, v, ck, cv)
        >>> out.shape
        torch.Size([2, 4, 16])
    """
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"attention_with_cache: {q.shape[0]} queries but {k.shape[0]} new keys")
    diagonal = attention_block(q, k, v, causal=True, softmax_scale=softmax_scale, backend=backend)
    if cached_k is None or cached_k.shape[0] == 0:
        return diagonal
    acc = PartialAccumulator(q.shape[0], q.shape[1], q.shape[2], device=q.device)
    acc.add(*attention_block(q, cached_k, cached_v, softmax_scale=softmax_scale, backend=backend, one_sequence=True),
            owned=True)
    acc.add(*diagonal)
    return acc.result(q.dtype)
