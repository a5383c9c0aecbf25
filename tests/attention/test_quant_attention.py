"""8-bit KV caches (ringctx/attention/quant.py): quantization, attention over int8 / fp8 K and V,
and the CPU decode kernels that read them in place (csrc/cpu_kernels.c), against float64 references
computed on the dequantized keys and values.

The kernels are built with the system C compiler on first use. Where this CPU cannot run them (no
AVX-512 F/BW/VL, no compiler) their tests are skipped with the loader's reason; everything else
then checks the blocked PyTorch path.
"""

from __future__ import annotations

import os

import pytest
import torch

from ringctx.attention import attention_block, reference_attention
from ringctx.attention import quant
from ringctx.attention.quant import attention_block_quantized, dequantize_rows, quantize_rows
from ringctx.kernels import build, cpu, selection
from tests.kernels.test_cpu_kernels import BUILDABLE

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

KINDS = ("int8", "fp8")


def require_kernels():
    """Skip (with the loader's reason) where this CPU cannot build or run the kernels; a failed
    build on a CPU that can is a failure."""
    if build.library() is not None:
        return
    reason = build.kernel_error() or "CPU kernels unavailable"
    if BUILDABLE and os.environ.get("RINGCTX_CPU_KERNELS", "1") != "0":
        pytest.fail(reason)
    pytest.skip(reason)


def _kv(S, Hkv, D, seed, spread=0.5):
    """K or V values whose rows differ in magnitude by factors of exp(spread * N(0, 1)), so that a
    kernel ignoring the per-row scales, or reading another head's, is far off. (Wider spreads make
    scores of ~100, whose float32 rounding alone is ~1e-5.)"""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, Hkv, D, generator=g) * torch.exp(spread * torch.randn(S, Hkv, 1, generator=g))


def _quantized(S, Hkv, D, kind, seed, spread=0.5):
    x, y = _kv(S, Hkv, D, seed, spread), _kv(S, Hkv, D, seed + 1, spread)
    (kd, ks), (vd, vs) = quantize_rows(x, kind), quantize_rows(y, kind)
    return kd, ks, vd, vs


def _reference(q, kd, ks, vd, vs, scale=None):
    """Float64 attention over the dequantized keys and values."""
    return reference_attention(q.double(), dequantize_rows(kd, ks, torch.float64), dequantize_rows(vd, vs, torch.float64),
                               softmax_scale=scale)


def _kernels_off(monkeypatch):
    monkeypatch.setattr(selection, "decode_q8_kernels_apply", lambda *a: False)


def _count_kernel_calls(monkeypatch):
    calls = []
    real = cpu.decode_attention_q8

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu, "decode_attention_q8", spy)
    return calls


# ---------------------------------------------------------------- quantize_rows / dequantize_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 16), (37, 3, 64), (5, 2, 128)])
def test_int8_round_trip_is_within_half_a_step(dtype, shape):
    x = _kv(*shape, seed=shape[0], spread=2.0).to(dtype)
    data, scale = quantize_rows(x, "int8")
    assert data.dtype == torch.int8 and data.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    assert (data.abs().amax(-1) == 127).all()  # each row's largest magnitude uses the whole range
    back = dequantize_rows(data, scale)
    assert back.dtype == torch.float32 and back.shape == x.shape
    err = (back - x.float()).abs()
    assert (err <= scale.unsqueeze(-1) * (0.5 + 1e-4)).all()
    assert dequantize_rows(data, scale, dtype).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 16), (37, 3, 64), (5, 2, 128)])
def test_fp8_round_trip_keeps_three_mantissa_bits(dtype, shape):
    x = _kv(*shape, seed=shape[0] + 1, spread=2.0).to(dtype)
    data, scale = quantize_rows(x, "fp8")
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and scale.shape == x.shape[:2]
    assert (data.float().abs().amax(-1) == 448).all()
    back = dequantize_rows(data, scale)
    err = (back - x.float()).abs()
    # Relative 2^-4 (half a step of a 3-bit mantissa); below e4m3's normal range (2^-6 of the scale)
    # the steps are absolute: 2^-9 of the scale, half of it at most.
    bound = 2.0 ** -4 * x.float().abs() + scale.unsqueeze(-1) * 2.0 ** -10
    assert (err <= bound * (1 + 1e-5)).all()
    assert not back.isnan().any()


@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_tiny_rows_quantize_without_nan(kind):
    x = _kv(4, 2, 16, seed=3)
    x[1] = 0.0  # a zero row: scale 0, exact zeros back
    x[2, 0] = 1e-40  # amax below float32's normal range: the scale's reciprocal would be infinite
    x[2, 0, ::2] = 0.0
    data, scale = quantize_rows(x, kind)
    back = dequantize_rows(data, scale)
    assert (scale[1] == 0).all() and (data[1].float() == 0).all() and (back[1] == 0).all()
    assert not back.isnan().any() and not data.float().isnan().any()
    assert (back[2, 0] - x[2, 0]).abs().max() <= 1e-40
    alone = quantize_rows(x[[0, 3]], kind)  # rows are independent of their neighbours
    assert torch.equal(alone[0].view(torch.uint8), data[[0, 3]].view(torch.uint8)) and torch.equal(alone[1], scale[[0, 3]])


def test_fp8_dequantize_is_exact_for_every_byte():
    """dequantize_rows widens fp8 with a bit trick on the CPU: every byte (but the NaN patterns,
    never written) must give PyTorch's value times the scale, bit for bit, in every dtype."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    data = codes.view(torch.float8_e4m3fn).reshape(-1, 1, 1).repeat(1, 2, 8)[:, :, ::2]  # strided, too
    assert torch.equal(data[:, 0, 0].view(torch.uint8), codes)
    scale = torch.rand(data.shape[:2], generator=torch.Generator().manual_seed(0)) * 1e-3
    want = data.float() * scale.unsqueeze(-1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_rows(data, scale, dtype), want.to(dtype))


def test_quantize_rows_rejects_float_formats():
    with pytest.raises(ValueError, match="not an 8-bit format"):
        quantize_rows(torch.randn(2, 1, 16), "bfloat16")


# ---------------------------------------------------------------- attention against float64

def _assert_matches_reference(out, lse, ref_out, ref_lse, q, lse_atol=1.5e-5, out_rel=5e-6):
    """Float32 against float64 on the same (dequantized) values. The values here reach ~10 and the
    sums run over up to 4097 keys, so the bound is relative to the largest output: the worst seen
    over this file's cases was 2.9e-6 of it (both paths), and 7e-6 in the LSE."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=out_rel * max(1.0, ref_out.abs().max().item()), rtol=0)


@pytest.mark.parametrize("S", [1, 5, 1000, 4097])
@pytest.mark.parametrize("T,path", [(1, "kernels"), (1, "blocked"), (3, "kernels"), (3, "blocked"), (17, "blocked")])
@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_matches_float64_on_dequantized_kv(kind, group, D, T, S, path, monkeypatch):
    """4097 keys cross the default block_rows (4096); T = 17 checks the blocked path at many rows."""
    if path == "kernels":
        require_kernels()
    else:
        _kernels_off(monkeypatch)
    Hkv = 2
    kd, ks, vd, vs = _quantized(S, Hkv, D, kind, seed=S + D + T)
    q = torch.randn(T, Hkv * group, D, generator=torch.Generator().manual_seed(group))
    calls = _count_kernel_calls(monkeypatch)
    out, lse = attention_block_quantized(q, kd, ks, vd, vs)
    assert bool(calls) == (path == "kernels")
    _assert_matches_reference(out, lse, *_reference(q, kd, ks, vd, vs), q)


@pytest.mark.parametrize("S,block_rows", [(5, 2), (1000, 7), (4097, 1000), (64, 64), (65, 64)])
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("kind", KINDS)
def test_small_blocks_merge_exactly(kind, T, S, block_rows, monkeypatch):
    _kernels_off(monkeypatch)
    kd, ks, vd, vs = _quantized(S, 3, 64, kind, seed=S)
    q = torch.randn(T, 9, 64, generator=torch.Generator().manual_seed(T))
    rows = []
    real = quant.dequantize_rows
    monkeypatch.setattr(quant, "dequantize_rows", lambda d, s, dt=torch.float32: rows.append(d.shape[0]) or real(d, s, dt))
    out, lse = attention_block_quantized(q, kd, ks, vd, vs, softmax_scale=0.3, block_rows=block_rows)
    assert max(rows) <= block_rows and sum(rows) == 2 * S  # never the whole cache at once, every key once
    ref_out, ref_lse = _reference(q, kd, ks, vd, vs, 0.3)
    # Each merge rounds the running LSE in float32, and the weights exp(lse_i - lse) carry that
    # error into the output, so the error grows with the number of merges: 1000 keys in blocks of
    # 7 (142 merges) were 1.5e-6 off in the LSE (relative) and 2.4e-5 of the largest output.
    merges = -(-S // block_rows) - 1
    _assert_matches_reference(out, lse, ref_out, ref_lse, q, lse_atol=max(1.5e-5, 3e-6 * ref_lse.abs().max().item()),
                              out_rel=5e-6 + 3e-7 * merges)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("S,T", [(0, 1), (0, 3), (0, 17), (5, 0), (0, 0)])
def test_empty_keys_or_queries(kind, S, T):
    kd, ks, vd, vs = _quantized(S, 2, 32, kind, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(T, 4, 32).to(dtype)
        out, lse = attention_block_quantized(q, kd, ks, vd, vs)
        assert out.shape == (T, 4, 32) and out.dtype == dtype and (out == 0).all()
        assert lse.shape == (4, T) and lse.dtype == torch.float32 and torch.isneginf(lse).all()


@pytest.mark.parametrize("path", ["kernels", "blocked"])
@pytest.mark.parametrize("S", [5, 1000, 4097])
@pytest.mark.parametrize("T,group,D", [(1, 3, 64), (3, 4, 128), (1, 1, 16), (17, 3, 64)])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_error_at_most_twice_pytorch_bf16(kind, T, group, D, S, path, monkeypatch):
    """The rule of docs/ARCHITECTURE.md: at most 2x the error of attention_block in bf16 on the same dequantized K/V
    cast to bf16, against float64 on the dequantized values."""
    if path == "kernels" and T <= 8:
        require_kernels()
    else:
        _kernels_off(monkeypatch)
    kd, ks, vd, vs = _quantized(S, 2, D, kind, seed=S * 3 + D)
    q = torch.randn(T, 2 * group, D, generator=torch.Generator().manual_seed(T + D)).bfloat16()
    ref_out, ref_lse = _reference(q, kd, ks, vd, vs)
    out, lse = attention_block_quantized(q, kd, ks, vd, vs, block_rows=1000)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    base_out, base_lse = attention_block(q, dequantize_rows(kd, ks, torch.bfloat16), dequantize_rows(vd, vs, torch.bfloat16))
    bound = 2 * (base_out.double() - ref_out).abs().max().item() + 1e-6
    assert (out.double() - ref_out).abs().max().item() <= bound
    lse_bound = 2 * (base_lse.double() - ref_lse).abs().max().item() + 1e-5
    assert (lse.double() - ref_lse).abs().max().item() <= lse_bound


# ---------------------------------------------------------------- the two paths agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 37, 1000, 4097])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (3, 8, 2, 128), (1, 4, 4, 16), (8, 16, 2, 64), (2, 6, 2, 80)])
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_and_blocked_path_agree(kind, T, Hq, Hkv, D, S, dtype, monkeypatch):
    require_kernels()
    kd, ks, vd, vs = _quantized(S, Hkv, D, kind, seed=S + T)
    q = torch.randn(T, Hq, D, generator=torch.Generator().manual_seed(D)).to(dtype)
    calls = _count_kernel_calls(monkeypatch)
    fast = attention_block_quantized(q, kd, ks, vd, vs)
    assert calls, "the decode kernels did not run"
    with monkeypatch.context() as m:
        _kernels_off(m)
        # float32 blocks, so that the comparison is between the two paths' float32 math
        blocked = attention_block_quantized(q.float(), kd, ks, vd, vs)
    assert len(calls) == 1
    largest = max(1.0, blocked[0].abs().max().item())  # outputs reach ~10: a float32 step there is ~1e-6
    torch.testing.assert_close(fast[1], blocked[1], atol=1e-6, rtol=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(fast[0], blocked[0], atol=2e-6 * largest, rtol=0)
    else:  # both round the same float32 result once, apart from ties
        torch.testing.assert_close(fast[0], blocked[0].bfloat16(), atol=2 ** -7 * blocked[0].abs().max().item(), rtol=0)


def test_kernel_path_is_the_default_for_decode_steps(monkeypatch):
    require_kernels()
    kd, ks, vd, vs = _quantized(300, 3, 64, "int8", seed=0)
    calls = _count_kernel_calls(monkeypatch)
    attention_block_quantized(torch.randn(1, 9, 64), kd, ks, vd, vs)
    attention_block_quantized(torch.randn(1, 9, 64).bfloat16(), kd, ks, vd, vs, backend="torch")
    assert len(calls) == 2
    attention_block_quantized(torch.randn(1, 9, 64), kd, ks, vd, vs, backend="reference")
    # 22 tokens x a GQA group of 3: past MAX_QUERY_ROWS_PER_KV_HEAD (64) rows per KV head
    attention_block_quantized(torch.randn(22, 9, 64), kd, ks, vd, vs)
    assert len(calls) == 2


def test_switched_off_kernels_leave_the_blocked_path(monkeypatch):
    monkeypatch.setenv("RINGCTX_CPU_KERNELS", "0")
    kd, ks, vd, vs = _quantized(50, 3, 64, "fp8", seed=2)
    q = torch.randn(1, 9, 64)
    assert not selection.decode_q8_kernels_apply(q, kd, ks, vd, vs)
    _assert_matches_reference(*attention_block_quantized(q, kd, ks, vd, vs), *_reference(q, kd, ks, vd, vs), q)


def test_kernels_decline_what_they_do_not_cover():
    kd, ks, vd, vs = _quantized(10, 2, 64, "int8", seed=0)
    q = torch.randn(1, 4, 64)
    if build.library() is not None:
        assert selection.decode_q8_kernels_apply(q, kd, ks, vd, vs)
        assert selection.decode_q8_kernels_apply(q, kd.view(torch.float8_e4m3fn), ks, vd, vs)  # mixed formats
    k72, s72, v72, w72 = _quantized(10, 2, 72, "int8", seed=0)
    assert not selection.decode_q8_kernels_apply(torch.randn(1, 4, 72), k72, s72, v72, w72)  # D % 16
    assert not selection.decode_q8_kernels_apply(q, kd[::2], ks[::2], vd[::2], vs[::2])  # strided rows
    assert not selection.decode_q8_kernels_apply(q, kd, ks.double(), vd, vs)
    assert not selection.decode_q8_kernels_apply(q, kd.float(), ks, vd.float(), vs)  # not 8-bit
    assert not selection.decode_q8_kernels_apply(torch.randn(33, 4, 64), kd, ks, vd, vs)  # 66 rows per KV head
    assert not selection.decode_q8_kernels_apply(q, kd[:0], ks[:0], vd[:0], vs[:0])


def test_strided_caches_take_the_blocked_path():
    kd, ks, vd, vs = _quantized(40, 2, 64, "int8", seed=4)
    q = torch.randn(1, 4, 64)
    out, lse = attention_block_quantized(q, kd[::2], ks[::2], vd[::2], vs[::2])
    _assert_matches_reference(out, lse, *_reference(q, kd[::2], ks[::2], vd[::2], vs[::2]), q)


def test_invalid_inputs_are_value_errors():
    kd, ks, vd, vs = _quantized(10, 2, 64, "int8", seed=0)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="head_dim"):
        attention_block_quantized(torch.randn(1, 4, 32), kd, ks, vd, vs)
    with pytest.raises(ValueError, match="head_dim"):
        attention_block_quantized(torch.randn(1, 3, 64), kd, ks, vd, vs)  # 3 query heads, 2 KV heads
    with pytest.raises(ValueError, match="scales"):
        attention_block_quantized(q, kd, ks[:5], vd, vs)
    with pytest.raises(ValueError, match="int8"):
        attention_block_quantized(q, kd.float(), ks, vd.float(), vs)
    with pytest.raises(ValueError, match="float32"):
        attention_block_quantized(q, kd, ks.bfloat16(), vd, vs)
    with pytest.raises(ValueError, match="block_rows"):
        attention_block_quantized(q, kd, ks, vd, vs, block_rows=0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_block_quantized(q, kd, ks, vd, vs, backend="nope")


# ---------------------------------------------------------------- the C kernels themselves


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("S", [1, 3, 16, 17, 1031])
@pytest.mark.parametrize("R,D", [(1, 64), (3, 64), (5, 128), (2, 16), (4, 80), (8, 256), (1, 128)])
@pytest.mark.parametrize("kind", KINDS)
def test_q8_kernels_against_float64(kind, R, D, S, threads):
    """Scores and PV of the kernels on their own: each KV head's rows against that head's keys,
    every row with its own scale."""
    require_kernels()
    Hkv = 3
    kd, ks, vd, vs = _quantized(S, Hkv, D, kind, seed=S * 10 + R, spread=1.5)
    g = torch.Generator().manual_seed(D)
    qg = torch.randn(Hkv, R, D, generator=g)
    k64, v64 = dequantize_rows(kd, ks, torch.float64), dequantize_rows(vd, vs, torch.float64)
    scores = cpu.decode_scores_q8(qg, kd, ks, 0.3)
    want = 0.3 * torch.einsum("hrd,shd->hrs", qg.double(), k64)
    assert scores.shape == (Hkv, R, S) and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), want, atol=2e-6 * want.abs().max().item(), rtol=1e-6)
    probs = torch.rand(Hkv, R, S, generator=g)
    out = cpu.decode_pv_q8(probs, vd, vs)
    want = torch.einsum("hrs,shd->hrd", probs.double(), v64)
    assert out.shape == (Hkv, R, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-6 * want.abs().max().item(), rtol=1e-6)
    # Deterministic: per-thread partial sums are added in thread order.
    assert torch.equal(cpu.decode_pv_q8(probs, vd, vs), out)
    assert torch.equal(cpu.decode_scores_q8(qg, kd, ks, 0.3), scores)


@pytest.mark.parametrize("kind", KINDS)
def test_q8_kernels_widen_every_byte_exactly(kind):
    """All 256 bytes (fp8: but its NaN patterns 0x7f and 0xff, never written) through both kernels,
    one per key, with unit scales: each score and output is the byte's value, bit for bit."""
    require_kernels()
    codes = torch.tensor([b for b in range(256) if kind == "int8" or b & 0x7F != 0x7F], dtype=torch.uint8)
    S, D = codes.shape[0], 32
    data = torch.zeros(S, 2, D, dtype=torch.uint8)
    data[:, 1, 5] = codes  # head 1, element 5; head 0 and the other elements are zero bytes
    data = data.view(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    values = data[:, 1, 5].float()
    scale = torch.ones(S, 2)
    q = torch.zeros(2, 1, D)
    q[1, 0, 5] = 1.0
    scores = cpu.decode_scores_q8(q, data, scale, 1.0)
    assert torch.equal(scores[1, 0], values) and (scores[0] == 0).all()
    for j in (0, 1, S // 2, S - 1):  # PV with one-hot weights picks one key's row
        probs = torch.zeros(2, 1, S)
        probs[:, 0, j] = 1.0
        out = cpu.decode_pv_q8(probs, data, scale)
        assert out[1, 0, 5] == values[j] and (out[0] == 0).all() and (out[1, 0, :5] == 0).all()


def test_q8_kernels_read_each_heads_own_rows_and_scales():
    """A key visible in one head only, scaled per (token, head): a kernel mixing up heads or the
    scale layout ([S, Hkv], token-major) fails here."""
    require_kernels()
    S, Hkv, D = 40, 4, 64
    data = torch.zeros(S, Hkv, D, dtype=torch.int8)
    scale = torch.zeros(S, Hkv)
    for h in range(Hkv):
        data[7 * h + 1, h, :] = h + 1
        scale[7 * h + 1, h] = 10.0 ** h
    q = torch.ones(Hkv, 2, D)
    scores = cpu.decode_scores_q8(q, data, scale, 1.0)
    for h in range(Hkv):
        expected = torch.zeros(S)
        expected[7 * h + 1] = D * (h + 1) * 10.0 ** h
        torch.testing.assert_close(scores[h, 0], expected, rtol=1e-6, atol=0)
    out = cpu.decode_pv_q8(torch.ones(Hkv, 2, S), data, scale)
    for h in range(Hkv):
        torch.testing.assert_close(out[h], torch.full((2, D), (h + 1) * 10.0 ** h), rtol=1e-6, atol=0)


def test_kv_element_bytes_count_the_scales():
    assert quant.kv_element_bytes("int8", 64, 2) == 1 + 4 / 64
    assert quant.kv_element_bytes("fp8", 128, 2) == 1 + 4 / 128
    assert quant.kv_element_bytes("model", 64, 2) == 2.0
    assert quant.storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert quant.storage_dtype("model", torch.bfloat16) == torch.bfloat16
