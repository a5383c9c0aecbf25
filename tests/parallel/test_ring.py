"""ring_attention on 1-4 gloo ranks against the float64 reference, both strategies."""

import pytest
import torch
import torch.nn.functional as F

from ringctx.attention import reference_attention
from ringctx.parallel import ShardLayout

from .ring_cases import bad_input_case, make_inputs, ring_case

WORLDS = [1, 2, 3, 4]
STRATEGIES = ["pass-kv", "pass-q"]

# Each spec: new tokens and cached tokens per sequence, heads, head dim.
SPECS = {
    "one-token": dict(new_lens=[1], cached_lens=[0], hq=4, hkv=4, d=64),
    "odd-7-gqa3-d80": dict(new_lens=[7], cached_lens=[0], hq=6, hkv=2, d=80),
    "130-gqa4": dict(new_lens=[130], cached_lens=[0], hq=8, hkv=2, d=64),
    "1000-mqa": dict(new_lens=[1000], cached_lens=[0], hq=4, hkv=1, d=64),
    "varseq-cached": dict(new_lens=[1, 257, 3, 40], cached_lens=[0, 5, 0, 100], hq=6, hkv=2, d=64),
    "cache-much-longer": dict(new_lens=[9], cached_lens=[700], hq=4, hkv=4, d=80),
    "tiny-with-cache": dict(new_lens=[3], cached_lens=[5], hq=3, hkv=1, d=64),
    "empty-seq-in-batch": dict(new_lens=[5, 0, 12], cached_lens=[2, 7, 0], hq=4, hkv=2, d=64),
}


def global_mask(spec):
    """[T_new, S] visibility over keys laid out per sequence as [cached_s, new_s]."""
    rows, cols = [], []
    for s, (t, p) in enumerate(zip(spec["new_lens"], spec["cached_lens"])):
        rows += [(s, p + i) for i in range(t)]
        cols += [(s, j) for j in range(p + t)]  # cached at positions 0..p-1, then new
    q_seq = torch.tensor([r[0] for r in rows]); q_pos = torch.tensor([r[1] for r in rows])
    k_seq = torch.tensor([c[0] for c in cols]); k_pos = torch.tensor([c[1] for c in cols])
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def keys_in_sequence_order(spec, new, cached):
    parts, n0, c0 = [], 0, 0
    for t, p in zip(spec["new_lens"], spec["cached_lens"]):
        parts += [cached[c0:c0 + p], new[n0:n0 + t]]
        n0, c0 = n0 + t, c0 + p
    return torch.cat(parts)


def reference(spec):
    q, k, v, ck, cv = make_inputs(spec)
    kk, vv = keys_in_sequence_order(spec, k, ck), keys_in_sequence_order(spec, v, cv)
    return reference_attention(q, kk, vv, global_mask(spec))


def torch_unsharded_bf16(spec):
    """The same computation done unsharded in bf16 by PyTorch (SDPA with an explicit mask)."""
    q, k, v, ck, cv = make_inputs(spec)
    kk, vv = keys_in_sequence_order(spec, k, ck), keys_in_sequence_order(spec, v, cv)
    qb, kb, vb = (x.bfloat16().transpose(0, 1).unsqueeze(0) for x in (q, kk, vv))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=global_mask(spec), enable_gqa=True)
    return out[0].transpose(0, 1)


def run_ring(pool, world, spec):
    results = pool.run(ring_case, spec)
    layout = ShardLayout.balanced(spec["new_lens"], world, spec["cached_lens"])
    out = layout.unshard([r[0] for r in results])
    lse = layout.unshard([r[1].t() for r in results]).t()
    return out, lse, [r[2] for r in results], layout


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(SPECS))
def test_ring_float32_matches_float64_reference(rank_pool, world, strategy, name):
    spec = dict(SPECS[name], dtype="float32", strategy=strategy, seed=hash(name) % 1000)
    out, lse, _, _ = run_ring(rank_pool(world), world, spec)
    ref_out, ref_lse = reference(spec)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", ["130-gqa4", "varseq-cached", "cache-much-longer"])
def test_ring_bf16_within_twice_pytorch_error(rank_pool, world, name):
    ref_out, _ = reference(dict(SPECS[name], seed=7))
    torch_err = (torch_unsharded_bf16(dict(SPECS[name], seed=7)).double() - ref_out).abs().max().item()
    for strategy in STRATEGIES:
        spec = dict(SPECS[name], dtype="bfloat16", strategy=strategy, seed=7)
        out, _, _, _ = run_ring(rank_pool(world), world, spec)
        assert out.dtype == torch.bfloat16
        err = (out.double() - ref_out).abs().max().item()
        assert err <= 2 * torch_err, f"{strategy}: ring bf16 error {err:.3g} > 2 x PyTorch's {torch_err:.3g}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_strategies_agree_and_bytes_match_formula(rank_pool, world):
    spec = dict(SPECS["varseq-cached"], dtype="bfloat16", seed=3)
    results = {}
    for strategy in STRATEGIES:
        out, lse, events, layout = run_ring(rank_pool(world), world, dict(spec, strategy=strategy))
        results[strategy] = out
        e, hq, hkv, d = 2, spec["hq"], spec["hkv"], spec["d"]
        for rank_events in events:
            ring = [b for kind, _, b in rank_events if kind.startswith("ring")]
            assert len(ring) == world - 1  # N-1 shifts; the last block is not sent on
            if strategy == "pass-kv":
                # K and V of max_i(P_i + T_i) rows at Hkv heads (never expanded to Hq).
                assert ring == [2 * layout.kv_message_rows * hkv * d * e] * (world - 1)
                assert not [k for k, _, _ in rank_events if k == "all2all"]
            else:
                assert ring == [layout.q_message_rows * hq * d * e] * (world - 1)
                a2a = [b for kind, _, b in rank_events if kind == "all2all"]
                assert a2a == [(world - 1) * layout.q_message_rows * hq * (d * e + 4)]
    torch.testing.assert_close(results["pass-kv"].float(), results["pass-q"].float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("what,needle", [
    ("rows", "query rows"),
    ("dtype", "dtype"),
    ("heads", "not a multiple"),
    ("strategy", "ranks disagree"),
    ("unknown-strategy", "unknown strategy"),
    ("layout", "ranks disagree"),
    ("world", "for 3 ranks but the group has 2"),
    ("cache-missing", "cached rows"),
    ("head-dim", "head_dim"),
])
def test_bad_input_raises_on_every_rank_without_hanging(rank_pool, what, needle):
    pool = rank_pool(2)
    messages = pool.run(bad_input_case, what)
    for rank, msg in enumerate(messages):
        assert msg is not None, f"rank {rank} raised nothing for {what}"
        assert needle in msg, msg
        assert msg.startswith("ring_attention: ")
    # The group is still usable afterwards: nothing is left half-sent.
    spec = dict(SPECS["odd-7-gqa3-d80"], dtype="float32", strategy="pass-kv", seed=1)
    out, _, _, _ = run_ring(pool, 2, spec)
    torch.testing.assert_close(out.double(), reference(spec)[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_exchange_equals_all_gather(rank_pool, world):
    """The decode's per-layer merge goes through shared memory between the ranks of a host: 200
    exchanges in a row (double-buffered, a rank late now and then) give exactly gloo's all-gather."""
    from .ring_cases import shm_exchange_case

    assert rank_pool(world).run(shm_exchange_case, 200) == [True] * world
