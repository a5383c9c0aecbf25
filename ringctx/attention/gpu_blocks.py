"""Banded (sliding-window) and soft-capped attention blocks on CUDA without ringctx's Triton kernel:
through Dao-AILab flash-attn where its mask matches, else through plain PyTorch ops.

Both compute the block of `triton_attention_block(..., causal=True, q_offset, window, softcap)`:

    q [T, Hq, D], k and v [S, Hkv, D]; GQA: query head h reads KV head h // (Hq // Hkv)
    query row i sees key row j iff j <= i + q_offset and (window == 0 or j > i + q_offset - window)
    softcap > 0: each score s = scale * q.k becomes softcap * tanh(s / softcap) before the softmax
    returns out [T, Hq, D] in q's dtype, lse [Hq, T] float32 (natural log, over the capped scores)
    a row that sees no key: out = 0, lse = -inf

flash-attn aligns its causal diagonal to the bottom-right corner (query i sees keys up to
i + S - T), so it computes this band only when q_offset == S - T; `flash_attn_band_block` returns
None otherwise (and for inputs flash-attn does not take) and the caller falls back, e.g. to
`torch_band_block`, which takes any band on any device (CPU too: that is how it is tested).
"""

from __future__ import annotations

import math

import torch

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's kernels: head dims up to 256, multiples of 8


def flash_attn_window_size(T: int, S: int, q_offset: int, window: int) -> tuple[int, int] | None:
    """flash-attn's `window_size` for the band of T queries against S keys, or None when its
    bottom-right-aligned causal mask cannot express it.

    flash_attn_func(causal=True, window_size=(left, 0)) lets query i see keys j with
    i + S - T - left <= j <= i + S - T (left = -1: no lower bound). Ours is
    i + q_offset - window < j <= i + q_offset, so it matches iff q_offset == S - T, with
    left = window - 1 (window > 0) or -1 (window == 0).

    Example:
        >>> flash_attn_window_size(4, 10, 6, 3), flash_attn_window_size(4, 10, 6, 0)
        ((2, 0), (-1, 0))
        >>> flash_attn_window_size(4, 10, 0, 3) is None  # a ring block whose queries start at key 0
        True
    """
    if window < 0:
        raise ValueError(f"flash_attn_window_size: window={window} must be >= 0 (0: no window)")
    if q_offset != S - T:
        return None
    return (window - 1 if window > 0 else -1, 0)


def flash_attn_band_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_offset: int,
    window: int,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The band block (module docstring) through flash-attn's `flash_attn_func`, or None.

    Args:
        q: [T, Hq, D]; k, v: [S, Hkv, D]; one dtype, one device, Hq a multiple of Hkv.
        scale: multiplies q.k (before the cap).
        q_offset, window: the band (module docstring); window 0: no lower bound.
        softcap: > 0 caps the scores (needs flash-attn >= 2.6); 0: none.

    Returns:
        (out [T, Hq, D] in q's dtype, lse [Hq, T] float32), or None when flash-attn cannot
        compute this block: q_offset != S - T (its diagonal is bottom-right aligned), inputs not
        float16/bfloat16 on CUDA, or a head dim flash-attn lacks (over 256, not a multiple of 8).
        The caller then falls back (`torch_band_block`, the Triton kernel). flash-attn is
        imported only here: ImportError when it is not installed.
    """
    T, Hq, D = _check(q, k, v, window, softcap, "flash_attn_band_block")
    S = k.shape[0]
    window_size = flash_attn_window_size(T, S, q_offset, window)
    if window_size is None:
        return None
    if T == 0 or S == 0:
        return _empty(q)
    if (q.device.type != "cuda" or q.dtype not in _FLASH_DTYPES or D % 8 or D > _FLASH_MAX_HEAD_DIM
            or any(x.stride(-1) != 1 for x in (q, k, v))):
        return None
    from flash_attn import flash_attn_func

    extra = {"softcap": float(softcap)} if softcap > 0 else {}  # older releases lack the argument
    out, lse, _ = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=float(scale),
                                  causal=True, window_size=window_size, return_attn_probs=True, **extra)
    # Rows that see no key (T > S: the first T - S rows) come back with lse = +inf (some
    # releases) and out = 0; older releases padded lse's rows to a multiple of 128.
    lse = lse[0, :, :T].float()
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
    out = out[0]
    empty = torch.isinf(lse).transpose(0, 1).unsqueeze(-1)  # [T, Hq, 1]
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out), lse


def torch_band_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_offset: int,
    window: int,
    softcap: float = 0.0,
    max_score_bytes: int = 256 << 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The band block (module docstring) through PyTorch ops, any band, any device.

    Explicit float32 scores, tiled over query rows: each tile of rows takes only the key rows
    its band reaches (at most rows + window - 1 with a window), so memory stays at about
    `max_score_bytes` of scores (a few such buffers: scores, probabilities) whatever T and S,
    and a window W costs about T * W. Products and the softmax are float32 (inputs widened,
    IEEE float32 matmuls unless the process enabled TF32), KV heads are never expanded (the
    GQA group is folded into the rows of one matmul per KV head).

    Args:
        q: [T, Hq, D]; k, v: [S, Hkv, D]; one dtype, one device, Hq a multiple of Hkv.
        scale: multiplies q.k (before the cap).
        q_offset: any integer; window: >= 0 (0: no lower bound); softcap: >= 0 (0: none).
        max_score_bytes: the float32 score tile's budget in bytes.

    Returns:
        out [T, Hq, D] in q's dtype, lse [Hq, T] float32; rows that see no key: 0 and -inf.

    Example:
        >>> q = torch.randn(5, 4, 8); k = v = torch.randn(7, 2, 8)
        >>> out, lse = torch_band_block(q, k, v, scale=0.35, q_offset=2, window=3)
        >>> out.shape, lse.shape
        (torch.Size([5, 4, 8]), torch.Size([4, 5]))
    """
    T, Hq, D = _check(q, k, v, window, softcap, "torch_band_block")
    S, Hkv = k.shape[:2]
    group = Hq // Hkv
    out, lse = _empty(q)
    if T == 0 or S == 0:
        return out, lse
    # Rows per tile: the score tile [Hq, rows, keys] in float32 within the budget, keys being
    # at most rows + window - 1 (a window) or S.
    rows = T
    while rows > 1 and Hq * rows * min(S, rows + window - 1 if window else S) * 4 > max_score_bytes:
        rows = (rows + 1) // 2
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        # The keys some row of [r0, r1) sees: (r0 + q_offset - window, r1 - 1 + q_offset].
        k_lo = min(max(r0 + q_offset - window + 1, 0), S) if window else 0
        k_hi = min(max(r1 + q_offset, 0), S)
        if k_hi <= k_lo:
            continue  # no row of the tile sees a key: out = 0, lse = -inf as initialised
        n, m = k_hi - k_lo, r1 - r0
        qt = q[r0:r1].float().transpose(0, 1).reshape(Hkv, group * m, D)  # head kv * group + j
        kt = k[k_lo:k_hi].float().transpose(0, 1)  # [Hkv, n, D]
        vt = v[k_lo:k_hi].float().transpose(0, 1)
        s = torch.matmul(qt, kt.transpose(1, 2)).mul_(scale)  # [Hkv, group * m, n]
        if softcap > 0:
            s = s.div_(softcap).tanh_().mul_(softcap)
        rel = (torch.arange(r0, r1, device=q.device) + q_offset).unsqueeze(1) \
            - torch.arange(k_lo, k_hi, device=q.device).unsqueeze(0)  # (i + q_offset) - j
        visible = rel >= 0
        if window:
            visible &= rel < window
        s = s.view(Hkv, group, m, n).masked_fill_(~visible, float("-inf"))
        top = s.amax(-1, keepdim=True)  # -inf only for rows that see nothing
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        p = s.sub_(top).exp_()  # exp(-inf) = 0 for masked keys
        total = p.sum(-1, keepdim=True)
        o = torch.matmul(p.view(Hkv, group * m, n), vt).view(Hkv, group, m, D)
        empty = total == 0
        o = o / torch.where(empty, torch.ones_like(total), total)
        out[r0:r1] = o.reshape(Hq, m, D).transpose(0, 1).to(q.dtype)
        lse[:, r0:r1] = torch.where(empty, float("-inf"), top + torch.log(total)).reshape(Hq, m)
    return out, lse


def _check(q, k, v, window, softcap, name) -> tuple[int, int, int]:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"{name}: q [T, Hq, D], k and v [S, Hkv, D] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{name}: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if k.dtype != q.dtype or v.dtype != q.dtype or not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must share one dtype and device")
    if window < 0:
        raise ValueError(f"{name}: window={window} must be >= 0 (0: no window)")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"{name}: softcap={softcap} must be a finite number >= 0 (0: no cap)")
    return T, Hq, D


def _empty(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out = 0 [T, Hq, D] in q's dtype and lse = -inf [Hq, T]: every row sees nothing (yet)."""
    T, Hq, D = q.shape
    return (torch.zeros((T, Hq, D), dtype=q.dtype, device=q.device),
            torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device))
