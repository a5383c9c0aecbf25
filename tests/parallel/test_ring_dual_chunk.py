"""ring_attention of a Dual Chunk Attention layer on 1-4 gloo ranks against the float64
reference: the three query rotations travel nowhere (pass-KV, also when pass-Q is asked for),
cached rows out of position order on every rank, several sequences, GQA, pieces and chunks that
cross DCA chunk boundaries (chunk_size 16, local_size 4: chunk_len 12)."""

import pytest
import torch

from ringctx.attention.dual_chunk import DualChunk
from ringctx.attention.reference import reference_dual_chunk_attention, rotate_half_rope
from ringctx.attention.spans import LayerSoftmax, Span
from ringctx.parallel import CommStats, ring_attention

from .ring_cases import make_inputs, span_layout

DCA = DualChunk(16, 4)
SPECS = {
    "one-sequence-cached": dict(new_lens=[61], cached_lens=[30], hq=4, hkv=2, d=16),
    "three-sequences": dict(new_lens=[37, 1, 50], cached_lens=[20, 3, 0], hq=6, hkv=3, d=16),
}


def inv_freq(d: int) -> torch.Tensor:
    return torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)


def positions(spec):
    """(new-token positions, cached-token positions), each sequence's after its cached ones."""
    new = torch.cat([torch.arange(p, p + t) for t, p in zip(spec["new_lens"], spec["cached_lens"])])
    cached = torch.cat([torch.arange(p) for p in spec["cached_lens"]])
    return new, cached


def dual_chunk_ring_case(rank: int, world: int, spec: dict):
    """This rank's share of the rotated inputs (queries in three versions) through ring_attention."""
    q, k, v, ck, cv = make_inputs(spec)
    new_pos, cached_pos = positions(spec)
    freq = inv_freq(spec["d"])
    q3 = torch.cat([rotate_half_rope(q, p, freq) for p in DCA.query_positions(new_pos)], dim=1).float()
    k_rot = rotate_half_rope(k, DCA.key_positions(new_pos), freq).float()
    ck_rot = rotate_half_rope(ck, DCA.key_positions(cached_pos), freq).float()
    layout, cached_rows = span_layout(spec, world)
    starts = [sum(spec["cached_lens"][:s]) for s in range(len(spec["new_lens"]))]
    rows = torch.cat([cached_rows[rank][s] + starts[s] for s in range(len(starts))])
    cached = dict(cached_k=ck_rot[rows], cached_v=cv[rows]) if layout.num_cached(rank) else {}
    stats = CommStats()
    out, lse = ring_attention(layout.shard(q3, rank), layout.shard(k_rot, rank), layout.shard(v, rank), layout,
                              strategy=spec["strategy"], stats=stats,
                              softmax=LayerSoftmax(spec["d"] ** -0.5, span=Span(dual_chunk=DCA.chunk_len)), **cached)
    return out, lse, [e.kind for e in stats.events]


def reference(spec):
    """Each sequence's queries over its cached and new keys, from the unrotated inputs."""
    q, k, v, ck, cv = make_inputs(spec)
    outs, lses, n0, c0 = [], [], 0, 0
    for t, p in zip(spec["new_lens"], spec["cached_lens"]):
        keys, values = torch.cat([ck[c0:c0 + p], k[n0:n0 + t]]), torch.cat([cv[c0:c0 + p], v[n0:n0 + t]])
        out, lse = reference_dual_chunk_attention(q[n0:n0 + t], keys, values, torch.arange(p, p + t),
                                                  torch.arange(p + t), inv_freq(spec["d"]), DCA.chunk_size,
                                                  DCA.local_size)
        outs.append(out)
        lses.append(lse)
        n0, c0 = n0 + t, c0 + p
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name,strategy", [("one-sequence-cached", "pass-kv"), ("three-sequences", "pass-kv"),
                                           ("one-sequence-cached", "pass-q")])
def test_dual_chunk_ring_matches_float64_reference(rank_pool, world, name, strategy):
    spec = dict(SPECS[name], strategy=strategy, seed=sum(map(ord, name)))
    results = rank_pool(world).run(dual_chunk_ring_case, spec)
    layout, _ = span_layout(spec, world)
    out = layout.unshard([r[0] for r in results])
    lse = layout.unshard([r[1].t() for r in results]).t()
    ref_out, ref_lse = reference(spec)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    if world > 1:  # pass-KV's ring shifts (after the agreement check), whatever was asked
        assert {kind for r in results for kind in r[2]} == {"check", "ring-kv"}, results[0][2]
