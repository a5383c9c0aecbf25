"""Single-device attention blocks and merging against the float64 reference."""

import pytest
import torch
import torch.nn.functional as F

from ringctx.attention import (PartialAccumulator, attention_block, attention_with_cache, merge_partials,
                               reference_attention, resolve_backend)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("t,s,causal", [(1, 1, True), (37, 37, True), (5, 19, False), (64, 3, False)])
def test_block_float32_matches_reference(hq, hkv, d, t, s, causal):
    q, k, v = rand(t, hq, d, seed=1), rand(s, hkv, d, seed=2), rand(s, hkv, d, seed=3)
    out, lse = attention_block(q, k, v, causal=causal)
    visible = torch.ones(t, s, dtype=torch.bool)
    ref_out, ref_lse = reference_attention(q, k, v, visible.tril() if causal else visible)
    assert out.shape == (t, hq, d) and lse.shape == (hq, t) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_block_bf16_within_twice_pytorch_sdpa_error():
    q, k, v = rand(200, 8, 64, seed=1), rand(200, 2, 64, seed=2), rand(200, 2, 64, seed=3)
    ref_out, _ = reference_attention(q, k, v, torch.ones(200, 200, dtype=torch.bool).tril())
    qb, kb, vb = (x.bfloat16().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    out, _ = attention_block(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16
    sdpa_err = (sdpa.double() - ref_out).abs().max()
    assert (out.double() - ref_out).abs().max() <= 2 * sdpa_err


def test_softmax_scale_is_applied():
    q, k, v = rand(9, 4, 32, seed=1), rand(9, 2, 32, seed=2), rand(9, 2, 32, seed=3)
    out, lse = attention_block(q, k, v, softmax_scale=0.3)
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_empty_key_block_gives_zero_and_minus_inf():
    q = rand(5, 4, 16)
    out, lse = attention_block(q, rand(0, 2, 16), rand(0, 2, 16))
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.isneginf(lse).all() and lse.shape == (4, 5)
    out, lse = attention_block(rand(0, 4, 16), rand(3, 2, 16), rand(3, 2, 16))
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


def test_a_full_block_takes_no_band():
    with pytest.raises(ValueError, match="a full block \\(causal=False\\) takes neither"):
        attention_block(rand(3, 2, 8), rand(5, 2, 8), rand(5, 2, 8), q_offset=2)
    with pytest.raises(ValueError, match="window must be a positive token count"):
        attention_block(rand(3, 2, 8), rand(5, 2, 8), rand(5, 2, 8), causal=True, window=-1)


def test_unknown_backend_and_missing_flash_attn_are_clear_errors():
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("cudnn", torch.device("cpu"))
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        resolve_backend("flash-attn", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_reference_backend_matches_torch_backend():
    q, k, v = rand(11, 6, 16, seed=1), rand(11, 3, 16, seed=2), rand(11, 3, 16, seed=3)
    a = attention_block(q, k, v, causal=True, backend="reference")
    b = attention_block(q, k, v, causal=True, backend="torch")
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,p", [(1, 0), (6, 1), (4, 50), (33, 7)])
def test_attention_with_cache_matches_reference(t, p):
    q, k, v = rand(t, 6, 32, seed=1), rand(t, 2, 32, seed=2), rand(t, 2, 32, seed=3)
    ck, cv = rand(p, 2, 32, seed=4), rand(p, 2, 32, seed=5)
    out, lse = attention_with_cache(q, k, v, ck, cv)
    visible = torch.ones(t, p + t, dtype=torch.bool)
    visible[:, p:] = torch.ones(t, t, dtype=torch.bool).tril()
    ref_out, ref_lse = reference_attention(q, torch.cat([ck, k]), torch.cat([cv, v]), visible)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_of_key_splits_equals_whole():
    q, k, v = rand(13, 4, 16, seed=1), rand(40, 2, 16, seed=2), rand(40, 2, 16, seed=3)
    parts = [attention_block(q, k[a:b], v[a:b]) for a, b in [(0, 7), (7, 8), (8, 40)]]
    out, lse = merge_partials(parts)
    ref_out, ref_lse = reference_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_handles_empty_rows_and_kernel_quirks():
    out_a = torch.ones(3, 1, 2)
    lse_a = torch.tensor([[0.0, float("-inf"), float("inf")]])  # +inf: another kernel's "empty row"
    out_b = torch.full((3, 1, 2), float("nan"))  # garbage in rows the kernel marks empty
    lse_b = torch.full((1, 3), float("-inf"))
    out, lse = merge_partials([(out_a, lse_a), (out_b, lse_b)])
    assert not torch.isnan(out).any()
    assert torch.equal(out[0], torch.ones(1, 2)) and lse[0, 0] == 0
    assert torch.equal(out[1:], torch.zeros(2, 1, 2))
    assert torch.isneginf(lse[0, 1:]).all()


def test_merge_is_stable_for_huge_lse():
    out_a, out_b = torch.full((1, 1, 1), 2.0), torch.full((1, 1, 1), 4.0)
    lse = torch.tensor([[300.0]])  # exp(300) overflows float32: only a max-shifted merge survives
    out, merged = merge_partials([(out_a, lse), (out_b, lse)])
    assert out.item() == pytest.approx(3.0, rel=1e-5) and merged.item() == pytest.approx(300.6931472, rel=1e-6)


def test_accumulator_row_ranges_and_validation():
    acc = PartialAccumulator(4, 1, 1)
    acc.add(torch.full((2, 1, 1), 5.0), torch.zeros(1, 2), row_start=2)
    out, lse = acc.result(torch.float32)
    assert out.flatten().tolist() == [0, 0, 5, 5] and torch.isneginf(lse[0, :2]).all()
    with pytest.raises(ValueError, match="partial 1"):
        merge_partials([(torch.zeros(2, 1, 1), torch.zeros(1, 2)), (torch.zeros(3, 1, 1), torch.zeros(1, 3))])
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulator_merges_in_c_as_in_pytorch(monkeypatch, dtype):
    """PartialAccumulator.add runs its merge in one C pass where the CPU kernels are built
    (cpu.merge_rows): against PyTorch's ops on partials with empty-row markers (+inf, NaN,
    -inf LSE over garbage), row ranges, a head-strided LSE and an output view."""
    from ringctx.kernels import build, cpu

    if build.library() is None:
        pytest.skip(f"no CPU kernels here: {build.kernel_error()}")
    g = torch.Generator().manual_seed(5)
    parts = []
    for rows, start in ((9, 0), (4, 2), (9, 0), (3, 6)):
        out = torch.randn(rows, 4, 2, 16, generator=g).to(dtype)[:, :, 0]  # a view: head stride 32
        lse = (torch.randn(rows, 4, generator=g) * 3).t()  # [H, rows], head stride 1
        lse[0, 0], lse[1, -1], lse[2, 1] = float("inf"), float("nan"), float("-inf")
        out[0, 0], out[-1, 1], out[1, 2] = float("nan"), float("nan"), float("inf")  # garbage where empty
        parts.append((out, lse, start))
    results = []
    for use_c in (True, False):
        if not use_c:
            monkeypatch.setattr(cpu, "merge_rows", lambda *a: False)
        acc = PartialAccumulator(9, 4, 16)
        for out, lse, start in parts:
            acc.add(out, lse, row_start=start)
        results.append(acc.result(torch.float32))
    (c_out, c_lse), (t_out, t_lse) = results
    assert not torch.isnan(c_out).any() and torch.equal(torch.isneginf(c_lse), torch.isneginf(t_lse))
    torch.testing.assert_close(c_out, t_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c_lse, t_lse, atol=1e-6, rtol=1e-6)


def test_accumulator_adopts_only_owned_full_partials():
    """owned=True lets the first full float32 partial become the state (no copy); other partials,
    and everything merge_partials is given, are never modified."""
    q, k, v = rand(9, 4, 16, seed=1), rand(30, 2, 16, seed=2), rand(30, 2, 16, seed=3)
    first, second = attention_block(q, k[:12], v[:12]), attention_block(q, k[12:], v[12:])
    kept = [t.clone() for t in (*first, *second)]
    acc = PartialAccumulator(9, 4, 16)
    acc.add(*first, owned=True)
    assert acc.out is first[0]  # adopted
    acc.add(*second)  # not owned: read only
    out, lse = acc.result(torch.float32)
    assert out is first[0] and torch.equal(second[0], kept[2]) and torch.equal(second[1], kept[3])
    ref_out, ref_lse = reference_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    a, b = attention_block(q, k[:12], v[:12]), attention_block(q, k[12:], v[12:])
    merge_partials([a, b])
    assert torch.equal(a[0], kept[0]) and torch.equal(b[0], kept[2])  # inputs untouched
    partial_rows = PartialAccumulator(9, 4, 16)
    partial_rows.add(first[0][:4].clone(), first[1][:, :4].clone(), owned=True)  # covers 4 of 9 rows
    assert partial_rows.out.shape == (9, 4, 16) and torch.isneginf(partial_rows.lse[:, 4:]).all()


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_query_path_matches_reference(t, dtype):
    # Decode-sized blocks take the batched-matmul path; same conventions, same accuracy rule.
    q, k, v = rand(t, 9, 64, seed=1, dtype=dtype), rand(700, 3, 64, seed=2, dtype=dtype), rand(700, 3, 64, seed=3, dtype=dtype)
    out, lse = attention_block(q, k, v)
    ref_out, ref_lse = reference_attention(q, k, v)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (t, 9, 64)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    if dtype == torch.bfloat16:  # the 2x rule against PyTorch's own bf16 SDPA
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        sdpa = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)[0].transpose(0, 1)
        assert (out.double() - ref_out).abs().max() <= 2 * (sdpa.double() - ref_out).abs().max()
