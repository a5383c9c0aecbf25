"""ring_attention for windowed, chunked and soft-capped layers on 1-4 gloo ranks against the
float64 reference: cached rows out of position order on every rank, several sequences, GQA, odd
lengths, windows shorter and longer than a rank's piece, chunk boundaries inside pieces; and the
bytes: only rows some query sees travel."""

import pytest
import torch

from ringctx.attention import Span, reference_attention

from .ring_cases import make_inputs, span_layout, span_ring_case

SPECS = {
    # window shorter than a piece (130 tokens over 2N pieces): a neighbour's last rows only
    "window-5-gqa4": dict(new_lens=[130], cached_lens=[0], hq=8, hkv=2, d=32, window=5),
    # window longer than a piece, with a cache dealt out of order
    "window-70-cached": dict(new_lens=[61], cached_lens=[90], hq=4, hkv=2, d=32, window=70),
    # chunks of 16: boundaries inside pieces, cached tokens in earlier chunks
    "chunk-16-varseq": dict(new_lens=[37, 1, 50], cached_lens=[20, 3, 0], hq=6, hkv=3, d=16, chunk=16),
    # a window with soft-cap and its own scale, one sequence empty
    "window-softcap": dict(new_lens=[23, 0, 9], cached_lens=[4, 6, 30], hq=4, hkv=4, d=16, window=9,
                           softcap=3.0, scale=0.2),
    "window-1": dict(new_lens=[17], cached_lens=[5], hq=2, hkv=1, d=16, window=1),
}


def reference(spec):
    """Keys per sequence [cached in position order, new]; mask from the span by position."""
    q, k, v, ck, cv = make_inputs(spec)
    span = Span(window=spec.get("window", 0), chunk=spec.get("chunk", 0))
    keys, values, q_seq, q_pos, k_seq, k_pos = [], [], [], [], [], []
    n0, c0 = 0, 0
    for s, (t, p) in enumerate(zip(spec["new_lens"], spec["cached_lens"])):
        keys += [ck[c0:c0 + p], k[n0:n0 + t]]
        values += [cv[c0:c0 + p], v[n0:n0 + t]]
        q_seq += [s] * t
        q_pos += list(range(p, p + t))
        k_seq += [s] * (p + t)
        k_pos += list(range(p + t))
        n0, c0 = n0 + t, c0 + p
    q_seq, q_pos, k_seq, k_pos = (torch.tensor(x) for x in (q_seq, q_pos, k_seq, k_pos))
    mask = span.visible(q_pos, k_pos) & (q_seq[:, None] == k_seq[None, :])
    return reference_attention(q, torch.cat(keys), torch.cat(values), mask, spec.get("scale"),
                               softcap=spec.get("softcap", 0.0))


# A span layer takes its own exchange whichever strategy is named: pass-Q is checked on one case.
CASES = [(name, "pass-kv") for name in SPECS] + [("window-70-cached", "pass-q")]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name,strategy", CASES)
def test_span_ring_matches_float64_reference(rank_pool, world, strategy, name):
    spec = dict(SPECS[name], dtype="float32", strategy=strategy, seed=sum(map(ord, name)))
    results = rank_pool(world).run(span_ring_case, spec)
    layout, _ = span_layout(spec, world)
    out = layout.unshard([r[0] for r in results])
    lse = layout.unshard([r[1].t() for r in results]).t()
    ref_out, ref_lse = reference(spec)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_a_short_window_sends_only_the_rows_it_sees(rank_pool, world):
    """Window 5 over 130 new tokens: each rank sends, per piece boundary it owns, at most the last
    4 rows (K and V, 2 heads of 32 float32), not its whole KV message as a ring would."""
    spec = dict(SPECS["window-5-gqa4"], dtype="float32", strategy="pass-kv", seed=1)
    results = rank_pool(world).run(span_ring_case, spec)
    row_bytes = 2 * spec["hkv"] * spec["d"] * 4
    for rank, (_, _, events) in enumerate(results):
        sent = sum(b for kind, _, b in events if kind == "span-kv")
        assert 0 < sent <= 2 * 4 * row_bytes, (rank, sent)  # two pieces, W-1 rows each
        assert not any(kind.startswith("ring") for kind, _, _ in events)
