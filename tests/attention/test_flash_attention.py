"""ringctx's float32 flash attention (csrc/cpu_flash.c) against the float64 reference, on every
kernel variant this machine runs (the `kernel_variant` fixture: an AVX-512 machine checks the AVX2
and portable builds too).

It computes the prefill's attention blocks in float32: float32 models, and bf16 models on CPUs
without bf16 units. Float32 rule: within 2e-6 of float64 (output and LSE) at these sizes, no worse
than PyTorch's own float32 op by more than 2x; a row's bits depend on its query and the keys alone
(not the threads, the other rows, or how many tokens the block has), so answers do not depend on
how a prompt was cut.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ringctx import cpu_kernels
from ringctx.attention import attention_block, reference_attention


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def needs_kernel(q, k, v):
    if not cpu_kernels.flash_attention_applies(q, k, v):
        pytest.skip(f"the flash kernel does not take head dim {q.shape[2]} on the "
                    f"{getattr(cpu_kernels.active_variant(), 'name', 'no')} variant (or no kernels here)")


@contextlib.contextmanager
def torch_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check(q, k, v, causal, softmax_scale=None):
    needs_kernel(q, k, v)
    T, S = q.shape[0], k.shape[0]
    visible = torch.ones(T, S, dtype=torch.bool)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), visible.tril() if causal else visible,
                                           softmax_scale)
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    out, lse = cpu_kernels.flash_attention(q, k, v, causal=causal, scale=scale)
    torch_out, torch_lse = attention_block(q, k, v, causal=causal, softmax_scale=softmax_scale, backend="torch")
    assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == (q.shape[1], T)
    err, torch_err = (out.double() - ref_out).abs().max().item(), (torch_out.double() - ref_out).abs().max().item()
    assert err <= max(2e-6, 2 * torch_err), (err, torch_err)
    lse_err, torch_lse_err = (lse.double() - ref_lse).abs().max().item(), (torch_lse.double() - ref_lse).abs().max().item()
    assert lse_err <= max(2e-6, 2 * torch_lse_err), (lse_err, torch_lse_err)
    return out, lse


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (6, 1)])
@pytest.mark.parametrize("d", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("t", [1, 5, 6, 7, 33, 60, 61, 97, 250])
def test_diagonal_blocks(kernel_variant, hq, hkv, d, t):
    check(rand(t, hq, d, seed=t), rand(t, hkv, d, seed=t + 1), rand(t, hkv, d, seed=t + 2), causal=True)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("t,s", [(1, 50), (9, 1), (33, 200), (300, 77), (64, 64), (40, 127), (100, 1031),
                                 (30, 4100), (500, 3841)])  # keys in 3 spans: shared out, or per unit
def test_full_blocks(kernel_variant, d, t, s):
    check(rand(t, 6, d, seed=s), rand(s, 2, d, seed=s + 1), rand(s, 2, d, seed=s + 2), causal=False)


def test_peaked_scores_and_a_custom_scale(kernel_variant):
    """Scores spread over hundreds: the running max moves block after block (the rescale), and
    keys far below a row's max (their exponentials at the bottom of float32's range)."""
    q, k, v = rand(300, 4, 64, seed=1, scale=6.0), rand(300, 2, 64, seed=2, scale=6.0), rand(300, 2, 64, seed=3)
    check(q, k, v, causal=True)
    check(q, k, v, causal=False, softmax_scale=0.05)
    check(q, k, v, causal=False, softmax_scale=3.0)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_rows_bits_depend_on_nothing_else(kernel_variant, threads):
    """The same bits whatever the threads, the rows beside a row, and the block's length: a causal
    block's first n rows are the causal block of its first n tokens, and a full block's rows the
    same as those rows alone."""
    q, k, v = rand(200, 6, 64, seed=1), rand(200, 2, 64, seed=2), rand(200, 2, 64, seed=3)
    needs_kernel(q, k, v)
    with torch_threads(threads):
        out, lse = cpu_kernels.flash_attention(q, k, v, causal=True, scale=0.125)
    with torch_threads(1):
        one_out, one_lse = cpu_kernels.flash_attention(q, k, v, causal=True, scale=0.125)
    assert torch.equal(out, one_out) and torch.equal(lse, one_lse)
    for n in (1, 37, 96, 131):
        part_out, part_lse = cpu_kernels.flash_attention(q[:n], k[:n], v[:n], causal=True, scale=0.125)
        assert torch.equal(part_out, out[:n]) and torch.equal(part_lse, lse[:, :n])
    full_out, full_lse = cpu_kernels.flash_attention(q, k, v, causal=False, scale=0.125)
    some_out, some_lse = cpu_kernels.flash_attention(q[50:53], k, v, causal=False, scale=0.125)
    assert torch.equal(some_out, full_out[50:53]) and torch.equal(some_lse, full_lse[:, 50:53])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spans_shared_out_or_per_unit_give_the_same_bits(kernel_variant, threads):
    """A full block of many keys goes in spans merged in order: a few rows (their spans shared over
    the threads) have the bits they have among many rows (each unit's spans on one thread)."""
    q, k, v = rand(700, 9, 64, seed=5), rand(4500, 3, 64, seed=6), rand(4500, 3, 64, seed=7)
    needs_kernel(q, k, v)
    with torch_threads(threads):
        many_out, many_lse = cpu_kernels.flash_attention(q, k, v, causal=False, scale=0.125)
        for rows in (slice(0, 1), slice(3, 35), slice(600, 700)):
            few_out, few_lse = cpu_kernels.flash_attention(q[rows], k, v, causal=False, scale=0.125)
            assert torch.equal(few_out, many_out[rows]) and torch.equal(few_lse, many_lse[:, rows])


def test_strided_views_are_read_in_place(kernel_variant):
    """Views into a fused q/k/v projection and into a cache with room after its rows: the same bits
    as contiguous copies."""
    qkv = rand(150, 6 + 2 + 2, 64, seed=4)
    q, k, v = qkv[:, :6], qkv[:, 6:8], qkv[:, 8:]
    out, lse = check(q, k, v, causal=True)
    out2, lse2 = cpu_kernels.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                                             scale=64 ** -0.5)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_auto_takes_it_for_float32_blocks_and_for_bf16_without_bf16_units(kernel_variant, monkeypatch):
    q, k, v = rand(40, 4, 64, seed=1), rand(40, 2, 64, seed=2), rand(40, 2, 64, seed=3)
    needs_kernel(q, k, v)
    auto = attention_block(q, k, v, causal=True)
    own = cpu_kernels.flash_attention(q, k, v, causal=True, scale=64 ** -0.5)
    assert torch.equal(auto[0], own[0]) and torch.equal(auto[1], own[1])
    # a bf16 model on a CPU without bf16 units computes its blocks in float32, with this kernel
    import ringctx.attention.kernels as kernels

    monkeypatch.setattr(kernels, "computes_in_float32", lambda x: x.dtype == torch.bfloat16)
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, lse = attention_block(qb, kb, vb, causal=True)
    ref = cpu_kernels.flash_attention(qb.float(), kb.float(), vb.float(), causal=True, scale=64 ** -0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref[0].bfloat16()) and torch.equal(lse, ref[1])


def test_what_it_does_not_take_is_refused(kernel_variant):
    q = rand(20, 4, 64, seed=1)
    assert not cpu_kernels.flash_attention_applies(q.bfloat16(), q[:, :2].bfloat16(), q[:, :2].bfloat16())
    assert not cpu_kernels.flash_attention_applies(q[:, :, :18], q[:, :2, :18], q[:, :2, :18])
    assert not cpu_kernels.flash_attention_applies(q, q[:, :3], q[:, :3])  # 4 query heads over 3 KV heads
    needs_kernel(q, q[:, :2], q[:, :2])
    with pytest.raises(RuntimeError, match="status -1"):
        cpu_kernels.flash_attention(q, q[:10, :2], q[:10, :2], causal=True, scale=0.125)  # causal needs T == S
