"""The one-pass decode attention (csrc/cpu_kernels.c `ringctx_decode_attention`) as continuous
batching calls it: the B query tokens of the questions about one document, q [B, Hq, D], against
the document's K/V slice, `attention_block(q, k, v, causal=False)` or `attention_block_quantized`
for 8-bit caches. Against the float64 reference on random inputs, once per kernel variant this CPU
runs (tests/conftest.py's kernel_variant): float32, bf16, int8 and fp8 caches, GQA groups 1, 3 and
4, B = 1..9 query tokens, S = 0, 1, odd, and long enough to cross several key tiles and the split
of the keys over two threads, head dims 64 and 128 (alternating with B).
"""

from __future__ import annotations

import math

import pytest
import torch

from ringctx.attention import attention_block, reference_attention
from ringctx.attention.quant import attention_block_quantized, dequantize_rows, quantize_rows
from ringctx.kernels import cpu, selection
from tests.kernels.test_cpu_kernels import needs_kernels

pytestmark = [pytest.mark.usefixtures("kernel_variant"), needs_kernels]

HKV = 3
LONG = 2500  # > one tile (at most 256 keys) per thread, with the keys split over 2 threads


@pytest.fixture(autouse=True)
def two_threads():
    """The keys split over two threads (merged by LSE), whatever else runs on this machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _spy(monkeypatch, name):
    """Count the calls of kernels/cpu.py's <name>: the tests check that the kernel, not a fallback, ran."""
    calls, real = [], getattr(cpu, name)

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, name, spy)
    return calls


def _inputs(B, group, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HKV * group, D, generator=g)
    # rows of different magnitudes, so that a kernel reading another head's row or scale is far off
    k = torch.randn(S, HKV, D, generator=g) * torch.exp(0.5 * torch.randn(S, HKV, 1, generator=g))
    v = torch.randn(S, HKV, D, generator=g) * torch.exp(0.5 * torch.randn(S, HKV, 1, generator=g))
    return q, k, v


def _check(out, lse, ref_out, ref_lse, q, out_tol, lse_tol=1e-5):
    """out within out_tol of the largest |output| (per element), lse within lse_tol relative."""
    B, Hq, D = q.shape
    assert out.shape == (B, Hq, D) and out.dtype == q.dtype
    assert lse.shape == (Hq, B) and lse.dtype == torch.float32
    if ref_lse.numel() and torch.isneginf(ref_lse).all():  # S == 0
        assert torch.isneginf(lse).all() and (out == 0).all()
        return
    torch.testing.assert_close(lse.double(), ref_lse, rtol=lse_tol, atol=lse_tol)
    largest = max(1.0, ref_out.abs().max().item())
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=out_tol * largest)


@pytest.mark.parametrize("S", [0, 1, 37, LONG])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("B", range(1, 10))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_dtype_cache_matches_float64(dtype, B, group, S, monkeypatch):
    D = 64 if B % 2 else 128  # both head dims over every group and length, at half the cases
    q, k, v = (x.to(dtype) for x in _inputs(B, group, S, D, seed=S + 10 * B + group + D))
    calls = _spy(monkeypatch, "decode_attention")
    monkeypatch.setattr(selection, "amx_attention_applies", lambda *a: False)  # the decode kernel at every size
    out, lse = attention_block(q, k, v, causal=False)
    assert len(calls) == (1 if S else 0)  # S == 0 returns before any kernel
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double())
    # float32: 1e-5 relative. bf16: the float32 result rounded once to bf16 (half a step: 2^-9
    # relative), plus the float32 error.
    _check(out, lse, ref_out, ref_lse, q, out_tol=1e-5 if dtype == torch.float32 else 2 ** -8)


@pytest.mark.parametrize("S", [0, 1, 37, LONG])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("B", range(1, 10))
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_cache_matches_float64_on_dequantized_kv(kind, B, group, S, monkeypatch):
    D = 64 if B % 2 else 128  # both head dims over every group and length, at half the cases
    q, k, v = _inputs(B, group, S, D, seed=S + 10 * B + group + D + 1)
    (kd, ks), (vd, vs) = quantize_rows(k, kind), quantize_rows(v, kind)
    calls = _spy(monkeypatch, "decode_attention_q8")
    out, lse = attention_block_quantized(q, kd, ks, vd, vs)
    assert len(calls) == (1 if S else 0)
    ref_out, ref_lse = reference_attention(q.double(), dequantize_rows(kd, ks, torch.float64),
                                           dequantize_rows(vd, vs, torch.float64))
    _check(out, lse, ref_out, ref_lse, q, out_tol=1e-5)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("S", [0, 1, 17, LONG])
def test_kernel_alone_matches_float64_and_is_deterministic(cache, S):
    """ringctx_decode_attention on its own, [Hkv, R, D] rows (R = 27: 9 tokens of a group of 3):
    out and lse per row, S == 0 included (zeros, -inf), the same bits on a second run (the threads'
    partials merge in thread order)."""
    q, k, v = _inputs(9, 3, S, 64, seed=S + 5)
    qg = q.view(9, HKV, 3, 64).permute(1, 2, 0, 3).reshape(HKV, 27, 64).contiguous()
    if cache in ("int8", "fp8"):
        (kd, ks), (vd, vs) = quantize_rows(k, cache), quantize_rows(v, cache)
        run = lambda: cpu.decode_attention_q8(qg, kd, ks, vd, vs, 0.125)  # noqa: E731
        k64, v64 = dequantize_rows(kd, ks, torch.float64), dequantize_rows(vd, vs, torch.float64)
    else:
        k, v = k.to(getattr(torch, cache)), v.to(getattr(torch, cache))
        run = lambda: cpu.decode_attention(qg, k, v, 0.125)  # noqa: E731
        k64, v64 = k.double(), v.double()
    out, lse = run()
    assert out.shape == (HKV, 27, 64) and lse.shape == (HKV, 27)
    scores = 0.125 * torch.einsum("hrd,shd->hrs", qg.double(), k64)
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.einsum("hrs,shd->hrd", torch.softmax(scores, -1), v64) if S else torch.zeros(HKV, 27, 64,
                                                                                                  dtype=torch.float64)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5 * max(1.0, ref_out.abs().max().item()))
    again = run()
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("group", [1, 3])
def test_batch_rows_equal_each_query_alone(cache, D, group):
    """Continuous batching's promise at the kernel: a query token's output and LSE are the same bits
    whatever other tokens share the call (each row's sums run over the same tiles in the same
    order, whichever register tiling its number of rows takes, and whether a bf16 block is widened
    once for all rows or as each row reads it: group 1 alone is one row per KV head, 9 tokens of
    group 3 are 27)."""
    q, k, v = _inputs(9, group, LONG, D, seed=3)
    if cache in ("int8", "fp8"):
        (kd, ks), (vd, vs) = quantize_rows(k, cache), quantize_rows(v, cache)
        attend = lambda x: attention_block_quantized(x, kd, ks, vd, vs)  # noqa: E731
    else:
        dtype = getattr(torch, cache)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        attend = lambda x: attention_block(x, k, v)  # noqa: E731
    out, lse = attend(q)
    for b in (0, 4, 8):
        alone = attend(q[b:b + 1])
        assert torch.equal(alone[0][0], out[b]) and torch.equal(alone[1][:, 0], lse[:, b])
    pair = attend(q[2:4])
    assert torch.equal(pair[0], out[2:4]) and torch.equal(pair[1], lse[:, 2:4])


def test_rows_past_the_kernel_take_the_other_paths(monkeypatch):
    """More than MAX_QUERY_ROWS_PER_KV_HEAD (64) rows per KV head: no decode kernel; still exact."""
    q, k, v = _inputs(22, 3, 100, 64, seed=4)  # 66 rows per KV head
    calls = _spy(monkeypatch, "decode_attention")
    out, lse = attention_block(q, k, v)
    assert not calls
    _check(out, lse, *reference_attention(q.double(), k.double(), v.double()), q, out_tol=1e-5)
    assert math.isfinite(lse.min().item())


def test_queries_may_be_a_strided_view(monkeypatch):
    """q as the engine may hold it, the query heads of a fused [B, Hq + 2 Hkv, D] projection."""
    qkv, k, v = _inputs(4, 5, 300, 64, seed=6)  # [4, 15, 64]: 9 query heads, then 6 more
    q = qkv[:, :9]
    assert not q.is_contiguous()
    calls = _spy(monkeypatch, "decode_attention")
    out, lse = attention_block(q, k, v)
    assert calls
    _check(out, lse, *reference_attention(q.double(), k.double(), v.double()), q, out_tol=1e-5)


@pytest.mark.parametrize("B", [1, 5, 6, 21])
def test_amx_takes_blocks_of_many_query_rows_per_kv_head(B, monkeypatch):
    """Where AMX applies (this CPU's variant has it), full blocks of one sequence's queries with
    AMX_FROM_ROWS_PER_KV_HEAD rows per KV head or more take it (the decode kernel is bound by
    arithmetic there); without bf16 units, from FLASH_FROM_ROWS_PER_KV_HEAD the float32 flash
    kernel; fewer rows, or rows of several sequences, take the decode kernel."""
    from ringctx.kernels.selection import AMX_FROM_ROWS_PER_KV_HEAD, FLASH_FROM_ROWS_PER_KV_HEAD
    from ringctx.kernels.cpu_features import computes_in_float32

    q, k, v = (x.bfloat16() for x in _inputs(B, 3, LONG, 64, seed=B))
    decode, amx = _spy(monkeypatch, "decode_attention"), _spy(monkeypatch, "amx_attention")
    flash = _spy(monkeypatch, "flash_attention")
    out, lse = attention_block(q, k, v, causal=False, one_sequence=True)
    uses_amx = selection.amx_available() and 3 * B >= AMX_FROM_ROWS_PER_KV_HEAD
    uses_flash = (not uses_amx and computes_in_float32(q) and 3 * B >= FLASH_FROM_ROWS_PER_KV_HEAD
                  and selection.flash_attention_applies(q, k, v))
    assert (len(amx), len(flash), len(decode)) == (int(uses_amx), int(uses_flash), int(not (uses_amx or uses_flash)))
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double())
    _check(out, lse, ref_out, ref_lse, q, out_tol=2 ** -8)
    attention_block(q, k, v, causal=False)  # rows that may be different sequences': the decode kernel
    assert len(decode) == 1 + int(not (uses_amx or uses_flash))
