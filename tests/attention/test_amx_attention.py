"""The "amx" attention backend (csrc/cpu_attention_amx.c) against the float64 reference.

It runs only on CPUs with AMX-BF16 (Sapphire Rapids and later) whose kernel grants the tile
state; elsewhere these tests are skipped and `attention_block` uses PyTorch's op. The bf16 rule
(docs/ARCHITECTURE.md): the error against float64 is at most twice that of PyTorch's own bf16 CPU op on the
same inputs; the LSE is checked tighter, since it feeds every ring merge.
"""

from __future__ import annotations

import pytest
import torch

from ringctx.attention import attention_block, reference_attention
from ringctx.kernels import cpu, selection
from tests.kernels.test_cpu_kernels import check_rounds_the_exact_product

needs_amx = pytest.mark.skipif(not selection.amx_available(),
                               reason=f"needs the AMX attention kernel: {selection.amx_unavailable_reason()}")


def rand(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def check(q, k, v, causal, softmax_scale=None):
    T, S = q.shape[0], k.shape[0]
    visible = torch.ones(T, S, dtype=torch.bool)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), visible.tril() if causal else visible,
                                           softmax_scale)
    out, lse = attention_block(q, k, v, causal=causal, softmax_scale=softmax_scale, backend="amx")
    torch_out, _ = attention_block(q, k, v, causal=causal, softmax_scale=softmax_scale, backend="torch")
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (q.shape[1], T)
    assert lse.dtype == torch.float32
    err, torch_err = (out.double() - ref_out).abs().max(), (torch_out.double() - ref_out).abs().max()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    return out, lse


@needs_amx
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("t", [1, 15, 16, 17, 63, 64, 65, 130, 1000])
def test_diagonal_blocks(hq, hkv, d, t):
    check(rand(t, hq, d, seed=t), rand(t, hkv, d, seed=t + 1), rand(t, hkv, d, seed=t + 2), causal=True)


@needs_amx
@pytest.mark.parametrize("d", [64, 96, 256])
@pytest.mark.parametrize("t,s", [(1, 50), (9, 1), (33, 200), (300, 77), (64, 64), (40, 127), (100, 1031)])
def test_full_blocks(d, t, s):
    check(rand(t, 6, d, seed=s), rand(s, 2, d, seed=s + 1), rand(s, 2, d, seed=s + 2), causal=False)


@needs_amx
@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_gives_the_same_bits(threads):
    q, k, v = rand(200, 6, 64, seed=1), rand(200, 2, 64, seed=2), rand(200, 2, 64, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, lse = check(q, k, v, causal=True)
        torch.set_num_threads(1)
        one_out, one_lse = attention_block(q, k, v, causal=True, backend="amx")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, one_out) and torch.equal(lse, one_lse)


@needs_amx
def test_peaked_scores_and_a_custom_scale():
    """Scores spread over hundreds: the running max moves block after block (the rescaling path)."""
    q, k, v = rand(300, 4, 64, seed=1, scale=6.0), rand(300, 2, 64, seed=2, scale=6.0), rand(300, 2, 64, seed=3)
    check(q, k, v, causal=True)
    check(q, k, v, causal=False, softmax_scale=0.05)


@needs_amx
def test_strided_views_are_read_in_place():
    """Token-major and head-major memory, and views into a fused q/k/v projection."""
    qkv = rand(150, 6 + 2 + 2, 64, seed=4)
    q, k, v = qkv[:, :6], qkv[:, 6:8], qkv[:, 8:]
    out, lse = check(q, k, v, causal=True)
    head_major = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
    out2, lse2 = attention_block(*head_major, causal=True, backend="amx")
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@needs_amx
def test_auto_uses_amx_for_bf16_blocks_it_takes():
    q, k, v = rand(40, 4, 64, seed=1), rand(40, 2, 64, seed=2), rand(40, 2, 64, seed=3)
    auto = attention_block(q, k, v, causal=True)
    amx = attention_block(q, k, v, causal=True, backend="amx")
    assert torch.equal(auto[0], amx[0]) and torch.equal(auto[1], amx[1])


@needs_amx
def test_what_amx_does_not_take_is_a_clear_error():
    q, k, v = rand(20, 4, 16, seed=1), rand(20, 2, 16, seed=2), rand(20, 2, 16, seed=3)
    with pytest.raises(ValueError, match="head_dim a multiple of 32"):
        attention_block(q, k, v, causal=True, backend="amx")
    with pytest.raises(ValueError, match="bf16"):
        attention_block(q.float(), k.float(), v.float(), backend="amx")
    out, _ = attention_block(q, k, v, causal=True)  # auto: PyTorch's op for what amx does not take
    assert out.shape == q.shape


def test_amx_backend_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(selection, "amx_available", lambda: False)
    q = rand(20, 4, 64, seed=1)
    with pytest.raises(ValueError, match="cannot run it"):
        attention_block(q, q[:, :2], q[:, :2], backend="amx")
    out, _ = attention_block(q, q[:, :2], q[:, :2], causal=True)  # auto falls back to PyTorch's op
    assert out.shape == q.shape


@needs_amx
@pytest.mark.parametrize("t", [5, 300])  # K read in place (few queries), K packed first (many)
@pytest.mark.parametrize("s", [64, 1000])  # whole key blocks; a partial last block
def test_keys_in_place_or_packed_give_the_same_bits(t, s):
    """A question over a cache: K and V are views into rows with room after them and both halves
    of a K/V pair side by side (a row stride that is not Hkv x D); the kernel reads K's rows in
    place for few queries and packs it for many, and either way gives what contiguous copies give."""
    kv = rand(s + 7, 2, 3, 64, seed=s)
    k, v = kv[:s, 0], kv[:s, 1]
    q = rand(t, 9, 64, seed=t)
    out, lse = check(q, k, v, causal=False)
    out2, lse2 = attention_block(q, k.contiguous(), v.contiguous(), causal=False, backend="amx")
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# -- cpu.amx_linear: a question's matmuls on the tiles (same file: same AMX requirement) --


@needs_amx
@pytest.mark.parametrize("rows", [9, 16, 17, 40, 48])
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (16, 32), (576, 1536), (48, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_rounds_the_exact_product(rows, n_out, n_in, with_bias):
    """Exact products, float32 sums, one rounding: small_linear's contract."""
    check_rounds_the_exact_product(cpu.amx_linear, rows, n_out, n_in, with_bias)


@needs_amx
def test_amx_linear_rows_do_not_depend_on_the_others_or_the_threads():
    """Each row's sums run over the same tiles in the same order: a row among 9 or 48, or with one
    thread, gives the same bits; and the model's linear() takes this path."""
    from ringctx.model.transformer import linear

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(48, 576, generator=g).bfloat16(), torch.randn(960, 576, generator=g).bfloat16()
    all_rows = cpu.amx_linear(x, w)
    assert torch.equal(cpu.amx_linear(x[20:29], w), all_rows[20:29])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.amx_linear(x, w), all_rows)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(linear(x[:16], w), all_rows[:16])


def test_amx_linear_declines_what_it_does_not_cover():
    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(16, 64).bfloat16()
    assert cpu.amx_linear(x[:8], w) is None  # decode-sized: small_linear's rows
    assert cpu.amx_linear(torch.randn(selection.AMX_LINEAR_ROWS[1] + 1, 64).bfloat16(), w) is None
    assert cpu.amx_linear(x.float(), w.float()) is None
    assert cpu.amx_linear(x[:, :48], w[:, :48]) is None  # in not a multiple of 32
    assert cpu.amx_linear(x, w[:24]) is None  # out not a multiple of 16
    assert cpu.amx_linear(x, torch.randn(64, 32).bfloat16().t()) is None  # not contiguous
    with torch.enable_grad():
        assert cpu.amx_linear(x, w.clone().requires_grad_()) is None


@needs_amx
@pytest.mark.parametrize("t,s", [(1, 2048), (5, 4100), (16, 8033), (40, 3000)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
def test_a_question_over_a_long_document_splits_the_keys(t, s, hq, hkv, d):
    """Few query units (one per KV head) over many keys: the kernel splits the keys into spans and
    merges their parts; against float64, and the same bits with any number of threads."""
    q, k, v = rand(t, hq, d, seed=t), rand(s, hkv, d, seed=s), rand(s, hkv, d, seed=s + 1)
    out, lse = check(q, k, v, causal=False)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            again = attention_block(q, k, v, causal=False, backend="amx")
            assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    finally:
        torch.set_num_threads(before)


# -- banded (sliding-window) causal blocks, offsets and logit soft-capping --------------------------
#
# The mask and the cap of the float32 flash kernel (tests/attention/test_flash_attention.py: query
# row i sees key row j iff j <= i + q_offset and (window == 0 or j > i + q_offset - window)),
# through cpu.amx_attention (attention_block's own arguments are another change's). Against the
# float64 reference with that explicit mask, by the bf16 rule: at most twice the error of PyTorch
# doing the same in bf16 (scores in float32 from bf16 inputs, unnormalised probabilities rounded to
# bf16 for P V, as a bf16 flash kernel does: `bf16_yardstick`); the LSE within 1e-5.

from tests.helpers import band_mask, capped_attention  # noqa: E402


def bf16_yardstick(q, k, v, visible, scale, softcap):
    """PyTorch's computation of the same block in bf16: float32 scores of the bf16 inputs (capped),
    masked, probabilities 2^(s - max) rounded to bf16 and multiplied by V in float32, divided by
    their float32 sum, the output rounded to bf16; rows that see no key 0."""
    group = q.shape[1] // k.shape[1]
    qh, kh = q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    s = torch.einsum("htd,hsd->hts", qh, kh) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    l = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("hts,hsd->htd", p.bfloat16().float(), vh) / torch.where(l > 0, l, torch.ones_like(l))
    return out.transpose(0, 1).bfloat16()


def check_band(q, k, v, q_offset, window, softcap, scale=None):
    T, S, D = q.shape[0], k.shape[0], q.shape[2]
    scale = D ** -0.5 if scale is None else scale
    visible = band_mask(T, S, True, q_offset, window)
    out, lse = cpu.amx_attention(q, k, v, causal=True, q_offset=q_offset, window=window, scale=scale, softcap=softcap)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (q.shape[1], T)
    ref_out, ref_lse = capped_attention(q.double(), k.double(), v.double(), visible, scale, softcap)
    if not softcap:  # the reference itself where it applies
        ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), visible, scale)
    empty = ~visible.any(dim=1)
    assert (out[empty] == 0).all() and (lse[:, empty] == -torch.inf).all()
    assert torch.isfinite(lse[:, ~empty]).all()
    err = (out.double() - ref_out).abs().max()
    torch_err = (bf16_yardstick(q, k, v, visible, scale, softcap).double() - ref_out).abs().max()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)
    torch.testing.assert_close(lse[:, ~empty].double(), ref_lse[:, ~empty], atol=1e-5, rtol=1e-5)
    return out, lse


AMX_BANDS = [  # (T, S, q_offset, window): windows about a 16-query tile and a 64-key block, and past S
    (37, 37, 0, 1), (37, 37, 0, 3), (61, 61, 0, 16), (97, 97, 0, 63), (153, 153, 0, 65), (250, 250, 0, 130),
    (61, 61, 0, 500), (50, 80, -10, 0), (120, 200, -30, 16), (300, 77, -100, 25), (40, 40, -60, 0),
    (100, 300, 200, 0), (100, 300, 200, 50), (97, 250, 153, 130), (5, 131, 126, 3), (33, 100, 150, 0),
    (33, 100, 150, 60), (1, 1, 0, 1), (7, 3, 0, 2),
]


@needs_amx
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 32), (8, 2, 128)])  # GQA groups 1 and 4
@pytest.mark.parametrize("t,s,q_offset,window", AMX_BANDS)
def test_banded_blocks(t, s, q_offset, window, hq, hkv, d, softcap):
    seed = t * 1000 + s + q_offset
    q, k, v = rand(t, hq, d, seed=seed), rand(s, hkv, d, seed=seed + 1), rand(s, hkv, d, seed=seed + 2)
    check_band(q, k, v, q_offset, window, softcap)


@needs_amx
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_a_long_band_with_peaked_scores(softcap):
    """1,000 queries (K packed: many rows), a window across many key blocks, scores spread over
    hundreds (the rescale path; capped near the cap)."""
    q, k, v = rand(1000, 9, 64, seed=1, scale=6.0), rand(1100, 3, 64, seed=2, scale=6.0), rand(1100, 3, 64, seed=3)
    check_band(q, k, v, 100, 257, softcap)
    check_band(q, k, v, -5, 0, softcap, scale=0.05)


@needs_amx
@pytest.mark.parametrize("t,s", [(9, 100), (100, 1031), (16, 4100)])  # 4100 keys: spans split and merged
def test_softcap_on_full_blocks(t, s):
    q, k, v = rand(t, 6, 64, seed=s, scale=3.0), rand(s, 2, 64, seed=s + 1, scale=3.0), rand(s, 2, 64, seed=s + 2)
    visible = band_mask(t, s, False)
    for softcap in (2.0, 50.0):
        out, lse = cpu.amx_attention(q, k, v, causal=False, scale=0.125, softcap=softcap)
        ref_out, ref_lse = capped_attention(q.double(), k.double(), v.double(), visible, 0.125, softcap)
        err = (out.double() - ref_out).abs().max()
        torch_err = (bf16_yardstick(q, k, v, visible, 0.125, softcap).double() - ref_out).abs().max()
        assert err <= 2 * torch_err + 1e-6, (softcap, err, torch_err)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@needs_amx
@pytest.mark.parametrize("threads", [1, 3])
def test_a_banded_rows_bits_depend_on_its_query_and_keys_alone(threads):
    """Key blocks no query of a tile sees are skipped (their probabilities would be exactly 0), so a
    query's bits are those it has in a block of its own tile's rows at their q_offset, with any
    number of threads; a window that cuts nothing gives the bits of no window; q_offset 0, window 0,
    T == S is the square diagonal block."""
    q, k, v = rand(400, 6, 64, seed=1), rand(450, 2, 64, seed=2), rand(450, 2, 64, seed=3)
    before = torch.get_num_threads()
    try:
        for softcap in (0.0, 10.0):
            torch.set_num_threads(threads)
            out, lse = cpu.amx_attention(q, k, v, causal=True, q_offset=40, window=150, scale=0.125, softcap=softcap)
            torch.set_num_threads(1)
            one = cpu.amx_attention(q, k, v, causal=True, q_offset=40, window=150, scale=0.125, softcap=softcap)
            assert torch.equal(out, one[0]) and torch.equal(lse, one[1])
            for a, b in ((0, 16), (32, 48), (256, 320)):  # whole query tiles (a tile's rows share its steps)
                part = cpu.amx_attention(q[a:b], k, v, causal=True, q_offset=40 + a, window=150, scale=0.125,
                                         softcap=softcap)
                assert torch.equal(part[0], out[a:b]) and torch.equal(part[1], lse[:, a:b]), (a, b)
            uncut = cpu.amx_attention(q, k, v, causal=True, q_offset=40, window=441, scale=0.125, softcap=softcap)
            whole = cpu.amx_attention(q, k, v, causal=True, q_offset=40, scale=0.125, softcap=softcap)
            assert torch.equal(uncut[0], whole[0]) and torch.equal(uncut[1], whole[1])
    finally:
        torch.set_num_threads(before)
    square = cpu.amx_attention(q, k[:400], v[:400], causal=True, scale=0.125)
    assert torch.equal(square[0], attention_block(q, k[:400], v[:400], causal=True, softmax_scale=0.125,
                                                  backend="amx")[0])
