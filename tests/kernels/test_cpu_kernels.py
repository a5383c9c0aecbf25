"""csrc/cpu_kernels.c and cpu_token_ops.c (decode-step kernels) against float64 references, once
per kernel variant this CPU runs (avx512, avx2, portable; tests/conftest.py's kernel_variant).

The kernels are built with the system C compiler on first use. Without a C compiler they are
unavailable by design (callers use PyTorch); these tests then check only that fallback.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringctx.attention import kernels as attention_kernels
from ringctx.kernels import build, cpu, cpu_features, report, selection
from tests.conftest import KERNEL_VARIANTS


BUILDABLE = bool(KERNEL_VARIANTS)
needs_kernels = pytest.mark.skipif(not BUILDABLE, reason="needs a C compiler (the portable variant runs on any CPU)")
pytestmark = pytest.mark.usefixtures("kernel_variant")


@needs_kernels
def test_kernels_build_and_load_here():
    assert build.library() is not None, build.kernel_error()
    assert build.kernel_error() is None


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (7, 33), (5, 1000)])
def test_small_linear_float32_matches_float64(rows, n_out, n_in):
    g = torch.Generator().manual_seed(rows + n_in)
    x, w, b = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g)
    got = cpu.small_linear(x, w, b)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().t() + b.double(), atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (7, 33), (130, 16), (5, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_rounds_the_exact_product(rows, n_out, n_in, with_bias):
    check_rounds_the_exact_product(cpu.small_linear, rows, n_out, n_in, with_bias)


@needs_kernels
@pytest.mark.parametrize("rows", [2, 9, 16, 31, 32])
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (7, 64), (130, 96), (5, 1024)])
def test_small_linear_gives_a_row_the_bits_it_has_alone(rows, n_out, n_in):
    """Rows four (AVX2, portable) and two at a time (each weight vector widened once for them all),
    up to the 32 rows a question's prefill sends on CPUs without bf16 units: each row's result is the
    same bits as that row alone (its sums in the same order), and rounds the exact product."""
    g = torch.Generator().manual_seed(rows * 7 + n_out)
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    w = torch.randn(n_out, n_in, generator=g).bfloat16()
    got = cpu.small_linear(x, w, max_rows=32)
    assert got is not None
    alone = torch.cat([cpu.small_linear(x[r:r + 1], w) for r in range(rows)])
    assert torch.equal(got, alone)
    check_rounds_the_exact_product(lambda x, w, b: cpu.small_linear(x, w, b, max_rows=32), rows, n_out, n_in,
                                   True)
    assert cpu.small_linear(x, w) is None or rows <= selection.MAX_ROWS  # MAX_ROWS unless told


def check_rounds_the_exact_product(linear, rows, n_out, n_in, with_bias):
    """A bf16 linear kernel (small_linear, amx_linear) with float32 sums and one rounding: nearly
    every element is the float64 product rounded to bf16, the rest one bf16 step away (summation
    order)."""
    g = torch.Generator().manual_seed(rows * 1000 + n_out)
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    w = torch.randn(n_out, n_in, generator=g).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if with_bias else None
    got = linear(x, w, b)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    exact = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    rounded = exact.to(torch.bfloat16)
    assert (got == rounded).float().mean() >= 0.99
    step = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)
    assert ((got.double() - exact).abs() <= step).all()


def test_small_linear_declines_what_it_does_not_cover():
    x, w = torch.randn(1, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    assert cpu.small_linear(x, w.float()) is None  # mixed dtypes
    assert cpu.small_linear(x.half(), w.half()) is None
    assert cpu.small_linear(torch.randn(selection.MAX_ROWS + 1, 32).bfloat16(), w) is None
    assert cpu.small_linear(x, torch.randn(32, 8).bfloat16().t()) is None  # not contiguous
    with torch.enable_grad():
        assert cpu.small_linear(x, w.clone().requires_grad_()) is None


def _reference(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    return torch.einsum("hts,shd->thd", torch.softmax(scores, -1), vv), torch.logsumexp(scores, -1)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# R = T Hq / Hkv query rows per KV head: 1-4 with D 64 or 128 take the grouped scores kernel on avx2
# (each key read once for all rows of its KV head), the rest the per-row one.
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (3, 8, 2, 64), (1, 4, 4, 128), (2, 6, 2, 32), (5, 12, 3, 16),
                                        (1, 4, 2, 80), (1, 8, 4, 64), (2, 8, 4, 128), (1, 32, 8, 128)])
@pytest.mark.parametrize("S", [1, 37, 1000])
def test_decode_attention_kernels_match_float64(dtype, T, Hq, Hkv, D, S):
    """attention_block's few-query path, through the kernels, against a float64 reference."""
    g = torch.Generator().manual_seed(S * 7 + D)
    cache_k = torch.randn(S + 5, Hkv, D, generator=g).to(dtype)
    cache_v = torch.randn(S + 5, Hkv, D, generator=g).to(dtype)
    k, v = cache_k[:S], cache_v[:S]  # a cache's first rows, as decode reads them
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    scale = 1 / math.sqrt(D)
    assert selection.decode_kernels_apply(q, k, v)
    out, lse = attention_kernels._decode_kernel_block(q, k, v, scale)
    assert out.dtype == dtype and out.shape == (T, Hq, D) and lse.shape == (Hq, T) and lse.dtype == torch.float32
    ref_out, ref_lse = _reference(q, k, v, scale)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
    else:  # one rounding of the output: at most PyTorch's error on the same bf16 inputs, doubled
        torch_out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(Hq // Hkv, 1).transpose(0, 1),
            v.repeat_interleave(Hq // Hkv, 1).transpose(0, 1), scale=scale).transpose(0, 1)
        bound = 2 * (torch_out.double() - ref_out).abs().max().item() + 1e-6
        assert (out.double() - ref_out).abs().max().item() <= bound


@needs_kernels
def test_decode_products_against_float64():
    """The two kernels alone: scale * Q K^T and P V per KV head over a token-major cache."""
    g = torch.Generator().manual_seed(1)
    qg, k, v = torch.randn(3, 4, 64, generator=g), torch.randn(50, 3, 64, generator=g), torch.randn(50, 3, 64, generator=g)
    scores = cpu.decode_scores(qg, k, 0.25)
    torch.testing.assert_close(scores.double(), 0.25 * torch.einsum("hrd,shd->hrs", qg.double(), k.double()),
                               atol=1e-5, rtol=0)
    probs = torch.rand(3, 4, 50, generator=g)
    torch.testing.assert_close(cpu.decode_pv(probs, v).double(),
                               torch.einsum("hrs,shd->hrd", probs.double(), v.double()), atol=1e-5, rtol=0)


@needs_kernels
def test_decode_attention_with_and_without_the_kernels_agree(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 9, 64, generator=g), torch.randn(300, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    with_kernels = attention_kernels.attention_block(q, k, v)
    monkeypatch.setattr(selection, "decode_kernels_apply", lambda *a: False)
    without = attention_kernels.attention_block(q, k, v)
    torch.testing.assert_close(with_kernels[0], without[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(with_kernels[1], without[1], atol=1e-6, rtol=0)


def test_decode_kernels_decline_unsupported_inputs():
    q, k = torch.randn(1, 4, 72), torch.randn(10, 2, 72)  # head dim not a multiple of 16
    assert not selection.decode_kernels_apply(q, k, k)
    q, k = torch.randn(1, 4, 64), torch.randn(10, 2, 64)
    assert not selection.decode_kernels_apply(q, k[::2], k[::2])  # strided cache rows
    assert not selection.decode_kernels_apply(q.half(), k.half(), k.half())
    assert not selection.decode_kernels_apply(torch.randn(17, 8, 64), k, k)  # 17 x 4 query rows per KV head > 64


def test_switched_off_means_pytorch(monkeypatch):
    monkeypatch.setenv("RINGCTX_CPU_KERNELS", "0")
    q, k = torch.randn(1, 4, 64), torch.randn(10, 2, 64)
    assert not selection.decode_kernels_apply(q, k, k)
    assert "RINGCTX_CPU_KERNELS=0" in build.kernel_error()


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("RINGCTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(build, "_errors", {})
    assert cpu.small_linear(torch.randn(1, 32).bfloat16(), torch.randn(8, 32).bfloat16()) is None
    assert build.library() is None
    assert "no-such-compiler" in build.kernel_error()


def test_the_c_sources_ship_inside_the_package():
    """ringctx/csrc links to the repository's csrc/, so that wheels (non-editable installs) carry the
    C and CUDA sources as package data and the kernels build there too."""
    from pathlib import Path

    import ringctx

    package_csrc = Path(ringctx.__file__).parent / "csrc"
    for name in build._SOURCES + (build._AMX_SOURCE, build._DETECT_SOURCE) + build._HEADERS:
        assert (package_csrc / name).is_file(), name


# ---------------------------------------------------------------- per-token ops over many rows


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 64), (300, 100), (5, 7)])
def test_rms_norm_rows_equal_f_rms_norm(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, 2 * dim, generator=g) * 3).to(dtype)[:, :dim]  # a strided view
    w = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    got, want = cpu.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (dim,), w, 1e-5)
    assert got.dtype == dtype and got.shape == (rows, dim)
    if dtype == torch.bfloat16:  # one rounding, as F.rms_norm: equal but for the odd sum-order flip
        assert (got == want).float().mean() >= 0.999
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
def test_rope_rows_equal_the_pytorch_formula(dtype, d):
    from ringctx.model.transformer import RopeAngles, apply_rotary

    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(50, 7, d, generator=g).to(dtype)
    angles = torch.arange(50).double()[:, None] * torch.rand(d // 2, generator=g).double()
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)[:, None]
    want = apply_rotary(qkv[:, :5], RopeAngles(cos, sin))
    untouched = qkv[:, 5:].clone()
    assert cpu.rope_(qkv[:, :5], cos, sin)  # in place on a view of the fused projection
    torch.testing.assert_close(qkv[:, :5], want, atol=1e-6, rtol=1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(qkv[:, :5], want)  # the same two roundings
    assert torch.equal(qkv[:, 5:], untouched)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ffn", [1536, 77])
def test_swiglu_rows_equal_silu_times_up(dtype, ffn):
    g = torch.Generator().manual_seed(ffn)
    gate_up = (torch.randn(40, 2 * ffn, generator=g) * 4).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :ffn].clone()).mul_(gate_up[:, ffn:])
    up = gate_up[:, ffn:].clone()
    assert cpu.swiglu_(gate_up, ffn)
    torch.testing.assert_close(gate_up[:, :ffn], want, atol=1e-6, rtol=1e-5)
    if dtype == torch.bfloat16:
        assert (gate_up[:, :ffn] == want).float().mean() >= 0.999
    assert torch.equal(gate_up[:, ffn:], up)


def test_row_ops_decline_what_they_do_not_cover():
    x = torch.randn(4, 8)
    assert cpu.rms_norm(x.half(), torch.ones(8).half(), 1e-5) is None
    assert cpu.rms_norm(x, torch.ones(8).bfloat16(), 1e-5) is None  # mixed dtypes
    assert not cpu.swiglu_(torch.randn(4, 10), 4)  # not [T, 2 ffn]
    assert not cpu.rope_(torch.randn(4, 2, 8), torch.randn(4, 1, 6), torch.randn(4, 1, 6))


# ---------------------------------------------------------------- which variant runs here


def test_the_variant_in_use_is_the_widest_this_cpu_runs():
    """avx512 on an AVX-512 CPU, avx2 on an AVX2-only one, portable elsewhere (arm64 included):
    the library that loads says which it is, and `info` names it."""
    build.use_variant(None)
    if not BUILDABLE:
        assert build.library() is None and report.cpu_kernels_report()["variant"] is None
        return
    widest = KERNEL_VARIANTS[0]
    assert build.active_variant().name == widest
    assert build.library().ringctx_simd_width() == build.active_variant().vector_floats
    info = report.cpu_kernels_report()
    assert info["variant"] == widest and info["variants_this_cpu_runs"] == KERNEL_VARIANTS
    assert info["kernels"]["fused decode step"] == "in use"
    assert widest in report.cpu_kernels_status()


def test_kernel_variant_fixture_runs_the_named_library(kernel_variant):
    if kernel_variant is None:
        pytest.skip("no C compiler: no variant to run")
    widths = {v.name: v.vector_floats for v in build.VARIANTS}
    assert build.library().ringctx_simd_width() == widths[kernel_variant]


def test_an_avx2_only_cpu_gets_the_avx2_variant(monkeypatch):
    if not build._is_x86_64():
        pytest.skip("x86-64 variants")
    build.use_variant(None)
    zen3 = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi2"})  # no AVX-512
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: zen3)
    variant, why = build.choose_variant()
    assert variant.name == "avx2"
    assert "not avx512: this CPU has no avx512bw, avx512f, avx512vl" in why
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert build.choose_variant()[0].name == "portable"


def test_a_variant_this_cpu_cannot_run_is_refused_with_the_flags_it_lacks(monkeypatch):
    build.use_variant(None)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c"}))
    monkeypatch.setenv("RINGCTX_CPU_ISA", "avx512")
    variant, why = build.choose_variant()
    if build._is_x86_64():
        assert variant is None and why == "RINGCTX_CPU_ISA=avx512 cannot run here: this CPU has no avx512bw, avx512f, avx512vl"
    monkeypatch.setenv("RINGCTX_CPU_ISA", "sse9")
    assert build.choose_variant()[0] is None and "not a variant" in build.choose_variant()[1]
    monkeypatch.setenv("RINGCTX_CPU_ISA", "portable")
    assert build.choose_variant()[0].name == "portable"
    with pytest.raises(ValueError, match="unknown CPU kernel variant"):
        build.use_variant("avx1024")
