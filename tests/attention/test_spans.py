"""Attention spans (sliding windows, aligned chunks), bands, soft-cap and sinks against the float64
reference: the blocks `band_blocks` cuts cover exactly what the span lets each query see, every
backend computes a band as the reference does, and sinks enter once, after every merge."""

import itertools
import random

import pytest
import torch

from ringctx.attention import (Band, LayerSoftmax, PartialAccumulator, Run, Span, attention_block, band_blocks,
                               reference_attention, runs_of)
from ringctx.attention.reference import band_mask
from ringctx.attention.spans import KeyRows, span_attention


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check_close(out, lse, ref_out, ref_lse, tol=2e-5):
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (out.double() - ref_out).abs().max() < tol
    if seen.any():
        assert (lse.double()[seen] - ref_lse[seen]).abs().max() < tol
    assert (out.double()[~seen.t()] == 0).all()  # rows that see nothing: out 0


@pytest.mark.parametrize("t,s", [(1, 1), (7, 7), (5, 19), (300, 290)])
@pytest.mark.parametrize("q_offset", [-3, 0, 4, 400])
@pytest.mark.parametrize("window", [0, 1, 3, 50])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_band_matches_reference(t, s, q_offset, window, softcap):
    """Query i sees key j iff j <= i + q_offset and j > i + q_offset - window; rows seeing nothing
    get out 0 and lse -inf; GQA 4:1."""
    q, k, v = rand(t, 8, 16, seed=1), rand(s, 2, 16, seed=2), rand(s, 2, 16, seed=3)
    out, lse = attention_block(q, k, v, causal=True, q_offset=q_offset, window=window, softcap=softcap)
    check_close(out, lse, *reference_attention(q, k, v, band_mask(t, s, q_offset, window), softcap=softcap))


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_every_cpu_backend_computes_the_band(backend):
    q, k, v = rand(40, 4, 32, seed=1), rand(50, 4, 32, seed=2), rand(50, 4, 32, seed=3)
    out, lse = attention_block(q, k, v, causal=True, q_offset=12, window=9, backend=backend)
    check_close(out, lse, *reference_attention(q, k, v, band_mask(40, 50, 12, 9)))


def test_bf16_band_within_rounding():
    q, k, v = rand(64, 4, 32, seed=1), rand(64, 2, 32, seed=2), rand(64, 2, 32, seed=3)
    out, _ = attention_block(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, window=16)
    ref, _ = reference_attention(q, k, v, band_mask(64, 64, 0, 16))
    assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 3e-2


def covered(blocks, rows, keys):
    counts = torch.zeros(rows, keys, dtype=torch.int)
    for b in blocks:
        n, m = b.q_end - b.q_start, b.k_end - b.k_start
        seen = band_mask(n, m, b.q_offset, b.window) if b.causal else torch.ones(n, m, dtype=torch.bool)
        counts[b.q_start:b.q_end, b.k_start:b.k_end] += seen.int()
    return counts


def test_band_blocks_cover_what_each_query_sees_exactly_once():
    """Random spans and random position sets (queries in position runs, keys in any order, as a
    decode rank's rows or a ring message are): every visible pair in one block, nothing else."""
    rng = random.Random(0)
    for _ in range(400):
        span = Span(window=rng.choice([0, 1, 3, 7, 20]), chunk=rng.choice([0, 4, 9]))
        q_pos = torch.tensor(sorted(rng.sample(range(80), rng.randint(1, 30))))
        k_pos = torch.tensor(rng.sample(range(80), rng.randint(1, 40)))
        blocks = band_blocks(span, runs_of(q_pos), runs_of(k_pos))
        assert torch.equal(covered(blocks, len(q_pos), len(k_pos)), span.visible(q_pos, k_pos).int()), span


def test_band_blocks_skip_and_clip():
    """A window keeps only the keys it reaches (T*W work), marks wholly visible blocks full and
    leaves out key runs no query reaches; chunks cut queries at their boundaries."""
    assert band_blocks(Span(window=3), [Run(0, 10, 4)], [Run(0, 0, 14)]) == \
        [Band(0, 4, 8, 14, True, 2, 3)]
    assert band_blocks(Span(window=100), [Run(0, 10, 4)], [Run(0, 0, 5)]) == [Band(0, 4, 0, 5, False)]
    assert band_blocks(Span(window=3), [Run(0, 10, 4)], [Run(0, 0, 5)]) == []
    assert band_blocks(Span(chunk=4), [Run(0, 6, 4)], [Run(0, 0, 10)]) == \
        [Band(0, 2, 4, 8, True, 2, 0), Band(2, 4, 8, 10, True, 0, 0)]
    assert Span(window=5).kept_tokens(100) == 4 and Span(chunk=8).kept_tokens(100) == 4
    assert Span().kept_tokens(100) == 100
    with pytest.raises(ValueError, match="positive token counts"):
        Span(window=-1)


@pytest.mark.parametrize("span", [Span(), Span(window=5), Span(chunk=6), Span(window=4, chunk=9)])
@pytest.mark.parametrize("sinks", [False, True])
def test_span_attention_over_two_sources_with_sinks(span, sinks):
    """A cache's rows (out of order) and new rows, with softcap, scale and sinks, against the
    reference over the same keys with the span's mask; sinks applied once by `finish`."""
    rng = torch.Generator().manual_seed(5)
    cached_pos = torch.randperm(20, generator=rng)
    new_pos = torch.arange(20, 31)
    q = rand(11, 4, 16, seed=1)
    ck, cv, nk, nv = rand(20, 2, 16, seed=2), rand(20, 2, 16, seed=3), rand(11, 2, 16, seed=4), rand(11, 2, 16, seed=6)
    sink = rand(4, seed=7) if sinks else None
    softmax = LayerSoftmax(scale=0.3, softcap=4.0, span=span, sinks=sink)
    out, lse = span_attention(q, runs_of(new_pos), [KeyRows(ck, cv, runs_of(cached_pos)),
                                                    KeyRows(nk, nv, runs_of(new_pos))], softmax)
    got = softmax.finish(out, lse)
    k_pos = torch.cat([cached_pos, new_pos])
    ref, _ = reference_attention(q, torch.cat([ck, nk]), torch.cat([cv, nv]), span.visible(new_pos, k_pos),
                                 0.3, softcap=4.0, sinks=sink)
    assert (got.double() - ref).abs().max() < 2e-5


def test_sinks_enter_once_after_merging_partials():
    """Two partials merged, then the sink: equal to the reference with the sink column."""
    q, k, v = rand(6, 4, 8, seed=1), rand(10, 4, 8, seed=2), rand(10, 4, 8, seed=3)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    acc = PartialAccumulator(6, 4, 8)
    acc.add(*attention_block(q, k[:4], v[:4]), owned=True)
    acc.add(*attention_block(q, k[4:], v[4:]), owned=True)
    out, lse = acc.result(torch.float32)
    got = LayerSoftmax(scale=8 ** -0.5, sinks=sink).finish(out, lse)
    ref, _ = reference_attention(q, k, v, sinks=sink)
    assert (got.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("t,s,off,w", list(itertools.product([3, 33], [4, 40], [0, 10], [0, 6])))
def test_bands_with_empty_rows_merge_like_the_reference(t, s, off, w):
    """A band's partial merged with a full block over other keys: rows that saw nothing in the
    band take the other block's result unchanged."""
    q, k, v = rand(t, 2, 8, seed=1), rand(s, 2, 8, seed=2), rand(s, 2, 8, seed=3)
    k2, v2 = rand(5, 2, 8, seed=4), rand(5, 2, 8, seed=5)
    acc = PartialAccumulator(t, 2, 8)
    acc.add(*attention_block(q, k, v, causal=True, q_offset=off - 3, window=w), owned=True)
    acc.add(*attention_block(q, k2, v2), owned=True)
    out, _ = acc.result(torch.float32)
    mask = torch.cat([band_mask(t, s, off - 3, w), torch.ones(t, 5, dtype=torch.bool)], dim=1)
    ref, _ = reference_attention(q, torch.cat([k, k2]), torch.cat([v, v2]), mask)
    assert (out.double() - ref).abs().max() < 2e-5
