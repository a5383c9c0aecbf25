"""Dual Chunk Attention: the block decomposition (`band_blocks` of a dual chunk span) and the
LSE merge of `span_attention` against the float64 reference that rotates and masks from scratch."""

import math

import pytest
import torch

from ringctx.attention.dual_chunk import DualChunk
from ringctx.attention.reference import reference_attention, reference_dual_chunk_attention, rotate_half_rope
from ringctx.attention.spans import KeyRows, LayerSoftmax, Run, Span, band_blocks, runs_of, span_attention

CHUNK, LOCAL = 16, 4  # L = 12: lengths 37 and 70 cross several chunks
D = 8
INV_FREQ = torch.tensor([10000.0 ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)


def rotated(dca: DualChunk, q, k, q_pos, k_pos, factor=1.0):
    """The fast path's inputs: keys at s mod L, the three query versions stacked as heads (float32)."""
    k_rot = rotate_half_rope(k, dca.key_positions(k_pos), INV_FREQ) * factor
    versions = [rotate_half_rope(q, p, INV_FREQ) * factor for p in dca.query_positions(q_pos)]
    return torch.cat(versions, dim=1).float(), k_rot.float()


@pytest.mark.parametrize("length, cached, hq, hkv", [(5, 0, 2, 2), (37, 0, 4, 2), (70, 0, 4, 1), (70, 29, 2, 1),
                                                     (24, 12, 2, 2)])
def test_dual_chunk_matches_float64_reference(length, cached, hq, hkv):
    """Queries at positions cached..length-1 over keys 0..length-1 (a cached prefix and the new
    rows as two sources, as a cache path gives them), GQA, odd lengths, several chunks."""
    torch.manual_seed(length + cached)
    dca = DualChunk(CHUNK, LOCAL)
    q = torch.randn(length - cached, hq, D, dtype=torch.float64)
    k = torch.randn(length, hkv, D, dtype=torch.float64)
    v = torch.randn(length, hkv, D, dtype=torch.float64)
    q_pos, k_pos = torch.arange(cached, length), torch.arange(length)
    q3, k_rot = rotated(dca, q, k, q_pos, k_pos)
    softmax = LayerSoftmax(0.3, span=Span(dual_chunk=dca.chunk_len))
    sources = [KeyRows(k_rot[:cached], v[:cached].float(), runs_of(k_pos[:cached])),
               KeyRows(k_rot[cached:], v[cached:].float(), runs_of(k_pos[cached:]))]
    out, lse = span_attention(q3, runs_of(q_pos), sources, softmax)
    ref_out, ref_lse = reference_dual_chunk_attention(q, k, v, q_pos, k_pos, INV_FREQ, CHUNK, LOCAL, 0.3)
    assert out.shape == (length - cached, hq, D)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_rows_out_of_position_order():
    """Key rows in arrival order (a decode rank's cache, a ring message): runs, not one range."""
    torch.manual_seed(3)
    dca = DualChunk(CHUNK, LOCAL)
    order = torch.cat([torch.arange(30, 45), torch.arange(0, 30)])  # rows hold positions 30..44, 0..29
    q = torch.randn(3, 2, D, dtype=torch.float64)
    k, v = torch.randn(45, 1, D, dtype=torch.float64), torch.randn(45, 1, D, dtype=torch.float64)
    q_pos = torch.tensor([44, 40, 12])
    q3, k_rot = rotated(dca, q, k, q_pos, order)
    softmax = LayerSoftmax(D ** -0.5, span=Span(dual_chunk=dca.chunk_len))
    out, lse = span_attention(q3, [Run(i, int(p), 1) for i, p in enumerate(q_pos)],
                              [KeyRows(k_rot, v.float(), runs_of(order))], softmax, one_sequence=False)
    ref_out, ref_lse = reference_dual_chunk_attention(q, k, v, q_pos, order, INV_FREQ, CHUNK, LOCAL)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_below_chunk_len_is_plain_rope_attention():
    """Fewer than L tokens: every pair is intra-chunk, so DCA is causal attention with plain RoPE."""
    torch.manual_seed(1)
    n = CHUNK - LOCAL
    q, k, v = (torch.randn(n, 2, D, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(n)
    out, lse = reference_dual_chunk_attention(q, k, v, pos, pos, INV_FREQ, CHUNK, LOCAL)
    plain = reference_attention(rotate_half_rope(q, pos, INV_FREQ), rotate_half_rope(k, pos, INV_FREQ), v,
                                torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


def test_length_factor_scales_scores_twice():
    """vLLM's length factor multiplies queries and keys: folded into the rotations, it is the
    reference's q_factors / k_factors."""
    dca = DualChunk(CHUNK, LOCAL, original_max_position=20)
    assert dca.length_factor(20) == 1.0 and dca.length_factor(5) == 1.0
    s = dca.length_factor(70)
    assert s == pytest.approx(0.1 * math.log(70 / 20) + 1.0)
    torch.manual_seed(4)
    q, k, v = torch.randn(70, 2, D, dtype=torch.float64), torch.randn(70, 1, D, dtype=torch.float64), \
        torch.randn(70, 1, D, dtype=torch.float64)
    pos = torch.arange(70)
    q3, k_rot = rotated(dca, q, k, pos, pos, factor=s)
    out, lse = span_attention(q3, runs_of(pos), [KeyRows(k_rot, v.float(), runs_of(pos))],
                              LayerSoftmax(D ** -0.5, span=Span(dual_chunk=dca.chunk_len)))
    f = torch.full((70,), s, dtype=torch.float64)
    ref_out, ref_lse = reference_dual_chunk_attention(q, k, v, pos, pos, INV_FREQ, CHUNK, LOCAL, q_factors=f,
                                                      k_factors=f)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_blocks_cover_each_pair_once_with_its_rotation():
    """Every (query, earlier key) pair lies in exactly one block, whose query version is the
    pair's chunk distance (capped at 2); no block holds a later key."""
    L = 12
    q_runs, k_runs = [Run(0, 5, 40), Run(40, 50, 3)], [Run(0, 0, 30), Run(30, 30, 30)]
    seen = {}
    for b in band_blocks(Span(dual_chunk=L), q_runs, k_runs):
        for i in range(b.q_start, b.q_end):
            for j in range(b.k_start, b.k_end):
                if b.causal and (j - b.k_start > i - b.q_start + b.q_offset):
                    continue
                p = 5 + i if i < 40 else 50 + i - 40
                s = j
                assert s <= p and (p, s) not in seen
                seen[(p, s)] = b.query
                assert b.query == min(p // L - s // L, 2)
    assert len(seen) == sum(p + 1 for p in [*range(5, 45), *range(50, 53)])


@pytest.mark.parametrize("chunk, local", [(8, 8), (8, 9), (0, 0), (8, -1)])
def test_nonsense_sizes_are_refused(chunk, local):
    with pytest.raises(ValueError, match="local_size < chunk_size"):
        DualChunk(chunk, local)
