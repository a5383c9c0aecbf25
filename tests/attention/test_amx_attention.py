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
