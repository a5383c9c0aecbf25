"""Float64 reference attention: the ground truth every fast path is tested against.

Slow and memory-hungry on purpose (it materializes the [Hq, T, S] score matrix), so keep inputs
small. It follows the same conventions as every other attention call in ringctx:

    q [T, Hq, D], k and v [S, Hkv, D]  ->  out [T, Hq, D] float64, lse [Hq, T] float64

`visible[t, s]` says whether query t may see key s; a query that sees no key gets out = 0 and
lse = -inf. `softcap` > 0 caps every scaled score s to softcap * tanh(s / softcap) before the
softmax (Gemma 2, gpt-oss style logit soft-capping); lse is over the capped scores.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention in float64 with an explicit boolean visibility mask.

    Args:
        q: [T, Hq, D] queries.
        k, v: [S, Hkv, D] keys and values; query head h reads KV head h // (Hq // Hkv).
        visible: [T, S] bool, True where query t may attend to key s; None means all visible.
        softmax_scale: defaults to 1/sqrt(D).
        softcap: > 0: scores become softcap * tanh(score / softcap) before the softmax.
        sinks: [Hq] sink logits, or None: each row's softmax gets one more term exp(sink[h]) in
            its denominator (a key with value 0 that every query sees); lse includes it.

    Returns:
        (out [T, Hq, D] float64, lse [Hq, T] float64, natural log).

    Example:
        >>> q = torch.randn(3, 4, 8); k = v = torch.randn(3, 2, 8)
        >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()
        >>> out, lse = reference_attention(q, k, v, causal)
        >>> out.shape, lse.shape
        (torch.Size([3, 4, 8]), torch.Size([4, 3]))
    """
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    q64 = q.double().transpose(0, 1)  # [Hq, T, D]
    k64 = k.double().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    v64 = v.double().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.einsum("htd,hsd->hts", q64, k64) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible.to(scores.device).unsqueeze(0), float("-inf"))
    if sinks is not None:  # one more column, seen by every row, whose value is 0
        sink_col = sinks.double().to(scores.device).view(Hq, 1, 1).expand(Hq, T, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
        v64 = torch.cat([v64, v64.new_zeros(Hq, 1, D)], dim=1)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, T]; -inf for rows with no visible key
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, torch.zeros_like(probs))
    out = torch.einsum("hts,hsd->htd", probs, v64).transpose(0, 1).contiguous()
    return out, lse


def causal_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    q_seq_ids: torch.Tensor | None = None,
    k_seq_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, S] bool mask: query sees key iff same sequence and key position <= query position."""
    visible = k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
    if q_seq_ids is not None and k_seq_ids is not None:
        visible &= q_seq_ids.unsqueeze(1) == k_seq_ids.unsqueeze(0)
    return visible


def band_mask(T: int, S: int, q_offset: int = 0, window: int = 0, device=None) -> torch.Tensor:
    """[T, S] bool mask of a causal (optionally sliding-window) block of T queries against S keys.

    Query row i sees key row j iff j <= i + q_offset and (window == 0 or j > i + q_offset - window):
    the block's queries sit q_offset positions after its first key, and a window W keeps the last
    W keys up to and including the query's own position. q_offset = 0, window = 0, T == S is the
    square causal block; rows may see no key (q_offset < 0, or a window past the keys).

    Example:
        >>> band_mask(3, 4, q_offset=1, window=2).int().tolist()
        [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    rel = torch.arange(T, device=device).unsqueeze(1) + q_offset - torch.arange(S, device=device).unsqueeze(0)
    visible = rel >= 0  # rel = (i + q_offset) - j: how far key j is behind query i
    if window > 0:
        visible &= rel < window
    return visible


def rotate_half_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64 (Hugging Face layout: pairs (i, i + D/2)) of x [T, H, D] at
    positions [T] with angular frequencies inv_freq [D/2] -> [T, H, D] float64."""
    angles = positions.double().view(-1, 1) * inv_freq.double().view(1, -1)  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).unsqueeze(1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).unsqueeze(1)
    x = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def reference_dual_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    chunk_size: int,
    local_size: int,
    softmax_scale: float | None = None,
    *,
    q_factors: torch.Tensor | None = None,
    k_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual Chunk Attention in float64 from scratch, as vLLM defines it (see attention/dual_chunk.py),
    on q [T, Hq, D], k, v [S, Hkv, D] *before* RoPE, at global positions q_positions [T] and
    k_positions [S] of one sequence (causal: key s is seen iff its position <= the query's).

    With L = chunk_size - local_size, keys rotate at s mod L; each (query, key) score uses the
    query rotated at p mod L when both lie in one chunk of L, at min(p mod L + L, chunk_size) when
    the key lies in the previous chunk, and at min(2L - 1, chunk_size) further back.
    q_factors [T] and k_factors [S] (default 1): vLLM's length factors, multiplying each query and key.

    Returns (out [T, Hq, D] float64, lse [Hq, T] float64), as `reference_attention`.
    """
    L = chunk_size - local_size
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    k_rot = rotate_half_rope(k, torch.remainder(k_positions, L), inv_freq)
    if k_factors is not None:
        k_rot = k_rot * k_factors.double().view(-1, 1, 1)
    k_rot = k_rot.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    intra = torch.remainder(q_positions, L)
    rotations = [intra, (intra + L).clamp(max=chunk_size), torch.full_like(intra, min(2 * L - 1, chunk_size))]
    scores = []
    for pos in rotations:
        q_rot = rotate_half_rope(q, pos, inv_freq)
        if q_factors is not None:
            q_rot = q_rot * q_factors.double().view(-1, 1, 1)
        scores.append(torch.einsum("htd,hsd->hts", q_rot.transpose(0, 1), k_rot) * scale)
    distance = (torch.div(q_positions.view(-1, 1), L, rounding_mode="floor")
                - torch.div(k_positions.view(1, -1), L, rounding_mode="floor"))  # [T, S] chunks apart
    chosen = torch.where(distance == 0, scores[0], torch.where(distance == 1, scores[1], scores[2]))
    visible = k_positions.view(1, -1) <= q_positions.view(-1, 1)
    chosen = chosen.masked_fill(~visible.unsqueeze(0), float("-inf"))
    v64 = v.double().transpose(0, 1).repeat_interleave(group, dim=0)
    lse = torch.logsumexp(chosen, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(chosen - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, torch.zeros_like(probs))
    return torch.einsum("hts,hsd->htd", probs, v64).transpose(0, 1).contiguous(), lse
