"""ringctx's float32 flash attention (csrc/cpu_flash.c) against the float64 reference, on every
kernel variant this machine runs (the `kernel_variant` fixture: an AVX-512 machine checks the AVX2
and portable builds too).

It computes the prefill's attention blocks in float32: float32 models, and bf16 models on CPUs
without bf16 units. Float32 rule: within 2e-6 of float64 (output and LSE) at these sizes, no worse
than PyTorch's own float32 op by more than 2x; a row's bits depend on its query and the keys alone
(not the threads, the other rows, or how many tokens the block has), so answers do not depend on
how a prompt was cut. bf16 inputs are widened as the kernel reads them: the same bits as on their
float32 copies.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ringctx.attention import attention_block, reference_attention
from ringctx.kernels import build, cpu, selection


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def needs_kernel(q, k, v):
    if not selection.flash_attention_applies(q, k, v):
        pytest.skip(f"the flash kernel does not take head dim {q.shape[2]} on the "
                    f"{getattr(build.active_variant(), 'name', 'no')} variant (or no kernels here)")


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
    out, lse = cpu.flash_attention(q, k, v, causal=causal, scale=scale)
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
        out, lse = cpu.flash_attention(q, k, v, causal=True, scale=0.125)
    with torch_threads(1):
        one_out, one_lse = cpu.flash_attention(q, k, v, causal=True, scale=0.125)
    assert torch.equal(out, one_out) and torch.equal(lse, one_lse)
    for n in (1, 37, 96, 131):
        part_out, part_lse = cpu.flash_attention(q[:n], k[:n], v[:n], causal=True, scale=0.125)
        assert torch.equal(part_out, out[:n]) and torch.equal(part_lse, lse[:, :n])
    full_out, full_lse = cpu.flash_attention(q, k, v, causal=False, scale=0.125)
    some_out, some_lse = cpu.flash_attention(q[50:53], k, v, causal=False, scale=0.125)
    assert torch.equal(some_out, full_out[50:53]) and torch.equal(some_lse, full_lse[:, 50:53])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spans_shared_out_or_per_unit_give_the_same_bits(kernel_variant, threads):
    """A full block of many keys goes in spans merged in order: a few rows (their spans shared over
    the threads) have the bits they have among many rows (each unit's spans on one thread)."""
    q, k, v = rand(700, 9, 64, seed=5), rand(4500, 3, 64, seed=6), rand(4500, 3, 64, seed=7)
    needs_kernel(q, k, v)
    with torch_threads(threads):
        many_out, many_lse = cpu.flash_attention(q, k, v, causal=False, scale=0.125)
        for rows in (slice(0, 1), slice(3, 35), slice(600, 700)):
            few_out, few_lse = cpu.flash_attention(q[rows], k, v, causal=False, scale=0.125)
            assert torch.equal(few_out, many_out[rows]) and torch.equal(few_lse, many_lse[:, rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_units_that_read_each_block_together_keep_their_bits(kernel_variant, dtype):
    """A thread takes up to 4 units of a head together (each block of keys read, and bf16 widened,
    once for all of them), fewer where that would leave too few items for the threads: a causal
    block's units of different lengths, and a full block's spans, have the bits they have with
    other threads, alone, and on float32 copies."""
    q, k, v = rand(1000, 9, 64, seed=7), rand(2500, 3, 64, seed=8), rand(2500, 3, 64, seed=9)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    needs_kernel(q, k, v)
    for causal, keys in ((True, 1000), (False, 2500)):
        runs = []
        for threads in (1, 2, 3):
            with torch_threads(threads):
                runs.append(cpu.flash_attention(q, k[:keys], v[:keys], causal=causal, scale=0.125))
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), causal
        rows = slice(0, 77) if causal else slice(500, 577)
        alone = cpu.flash_attention(q[rows], k[:77] if causal else k, v[:77] if causal else v,
                                            causal=causal, scale=0.125)
        assert torch.equal(alone[0], runs[0][0][rows]) and torch.equal(alone[1], runs[0][1][:, rows]), causal
        if dtype == torch.bfloat16:
            copies = cpu.flash_attention(q.float(), k[:keys].float(), v[:keys].float(), causal=causal,
                                                 scale=0.125)
            assert torch.equal(copies[0], runs[0][0]) and torch.equal(copies[1], runs[0][1]), causal


def test_strided_views_are_read_in_place(kernel_variant):
    """Views into a fused q/k/v projection and into a cache with room after its rows: the same bits
    as contiguous copies."""
    qkv = rand(150, 6 + 2 + 2, 64, seed=4)
    q, k, v = qkv[:, :6], qkv[:, 6:8], qkv[:, 8:]
    out, lse = check(q, k, v, causal=True)
    out2, lse2 = cpu.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                                             scale=64 ** -0.5)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_auto_takes_it_for_float32_blocks_and_for_bf16_without_bf16_units(kernel_variant, monkeypatch):
    q, k, v = rand(40, 4, 64, seed=1), rand(40, 2, 64, seed=2), rand(40, 2, 64, seed=3)
    needs_kernel(q, k, v)
    auto = attention_block(q, k, v, causal=True)
    own = cpu.flash_attention(q, k, v, causal=True, scale=64 ** -0.5)
    assert torch.equal(auto[0], own[0]) and torch.equal(auto[1], own[1])
    # a bf16 model on a CPU without bf16 units computes its blocks in float32, with this kernel
    import ringctx.attention.kernels as kernels

    monkeypatch.setattr(kernels, "computes_in_float32", lambda x: x.dtype == torch.bfloat16)
    monkeypatch.setattr(selection, "amx_available", lambda: False)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, lse = attention_block(qb, kb, vb, causal=True)
    ref = cpu.flash_attention(qb.float(), kb.float(), vb.float(), causal=True, scale=64 ** -0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref[0].bfloat16()) and torch.equal(lse, ref[1])


@pytest.mark.parametrize("causal,t,s,hq,hkv,d", [
    (True, 1, 1, 4, 4, 32), (True, 61, 61, 9, 3, 64), (True, 250, 250, 6, 1, 128), (True, 131, 131, 8, 2, 16),
    (False, 16, 8192, 9, 3, 64),  # a question's tokens over a document's cache: its spans shared out
    (False, 13, 127, 6, 2, 48), (False, 300, 4100, 4, 2, 64), (False, 5, 250, 2, 1, 256)])
def test_bf16_inputs_give_the_bits_of_their_float32_copies(kernel_variant, causal, t, s, hq, hkv, d):
    """bf16 q, k, v (K and V as a token-major cache with room after its rows, q a view of a fused
    projection) against the kernel on their float32 values: equal bit for bit, partial tiles and
    blocks included, and within the float32 rule of float64 on those values."""
    qkv = rand(t, hq + 2, d, seed=t + s).bfloat16()
    q = qkv[:, 1:hq + 1]
    cache_k, cache_v = rand(s + 9, hkv, d, seed=s).bfloat16(), rand(s + 9, hkv, d, seed=s + 1).bfloat16()
    k, v = cache_k[:s], cache_v[:s]
    needs_kernel(q, k, v)
    out, lse = cpu.flash_attention(q, k, v, causal=causal, scale=d ** -0.5)
    out32, lse32 = check(q.float(), k.float(), v.float(), causal)
    assert out.dtype == torch.float32 and torch.equal(out, out32) and torch.equal(lse, lse32)


def test_a_bf16_questions_block_over_a_document_takes_the_kernel_from_40_rows(kernel_variant, monkeypatch):
    """On a CPU without bf16 units, a bf16 sequence's block over a document's cache takes the flash
    kernel from FLASH_FROM_ROWS_PER_KV_HEAD query rows per KV head (reading the cache in place), the
    decode kernel below; batches of questions (not one sequence) keep the decode kernel. Either way
    within float32's rounding of float64."""
    import ringctx.attention.kernels as kernels

    monkeypatch.setattr(kernels, "computes_in_float32", lambda x: x.dtype == torch.bfloat16)
    monkeypatch.setattr(selection, "amx_available", lambda: False)
    k, v = rand(3000, 3, 64, seed=1).bfloat16(), rand(3000, 3, 64, seed=2).bfloat16()
    rows = selection.FLASH_FROM_ROWS_PER_KV_HEAD
    for tokens in (rows // 3 - 1, -(-rows // 3), 21):
        q = rand(tokens, 9, 64, seed=tokens).bfloat16()
        needs_kernel(q, k, v)
        flash = cpu.flash_attention(q, k, v, causal=False, scale=0.125)
        decode = kernels._decode_kernel_block(q, k, v, 0.125)
        assert decode is not None
        out, lse = attention_block(q, k, v, causal=False, one_sequence=True)
        assert torch.equal(lse, (flash if tokens * 3 >= rows else decode)[1]), tokens
        ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), torch.ones(tokens, 3000).bool())
        assert (out.double() - ref_out).abs().max() <= 2 ** -7 * ref_out.abs().max()  # one bf16 rounding
        assert (lse.double() - ref_lse).abs().max() <= 2e-5
        _, batch_lse = attention_block(q, k, v, causal=False)  # B questions' rows, not one sequence
        assert torch.equal(batch_lse, decode[1])


def test_what_it_does_not_take_is_refused(kernel_variant):
    q = rand(20, 4, 64, seed=1)
    assert not selection.flash_attention_applies(q.bfloat16(), q[:, :2], q[:, :2])  # mixed dtypes
    assert not selection.flash_attention_applies(q.half(), q[:, :2].half(), q[:, :2].half())
    assert not selection.flash_attention_applies(q[:, :, :18], q[:, :2, :18], q[:, :2, :18])
    assert not selection.flash_attention_applies(q, q[:, :3], q[:, :3])  # 4 query heads over 3 KV heads
    needs_kernel(q, q[:, :2], q[:, :2])
    with pytest.raises(RuntimeError, match="status -1"):
        cpu.flash_attention(q, q[:, :2], q[:, :2], causal=True, scale=0.0)  # scale must be > 0
    # causal blocks of T != S are taken (a ring block at an offset: test_banded_blocks)
    out, lse = cpu.flash_attention(q, q[:10, :2], q[:10, :2], causal=True, scale=0.125)
    assert out.shape == q.shape and torch.isinf(lse[:, 10:]).sum() == 0


# -- banded (sliding-window) causal blocks, offsets and logit soft-capping --------------------------
#
# A ring block of queries against a contiguous range of keys: query row i sees key row j iff
# j <= i + q_offset and (window == 0 or j > i + q_offset - window), T and S any (tests/helpers.py's
# band_mask). Checked against reference_attention with that explicit mask (capped_attention in
# float64 where softcap > 0: the same math with the cap), by the float32 rule above (PyTorch's
# yardstick: the same computation in float32); bf16 inputs give the bits of their float32 copies.

from tests.helpers import band_mask, capped_attention  # noqa: E402

BANDS = [  # (T, S, q_offset, window)
    (37, 37, 0, 1), (37, 37, 0, 3), (61, 61, 0, 11), (97, 97, 0, 12), (153, 153, 0, 130),  # windows about a tile
    (250, 250, 0, 121), (61, 61, 0, 500),  # a block's worth (120 keys) and more than S
    (50, 80, -10, 0), (120, 200, -30, 16), (300, 77, -100, 25), (40, 40, -60, 0),  # negative: some or all rows see nothing
    (100, 300, 200, 0), (100, 300, 200, 50), (97, 250, 153, 130), (5, 131, 126, 3),  # positive: a later block of queries
    (33, 100, 150, 0), (33, 100, 150, 60), (1, 1, 0, 1), (7, 3, 0, 2),  # q_offset past S; tiny blocks
]


def check_band(q, k, v, q_offset, window, softcap, scale=None):
    """The kernel on q, k, v (float32, or bf16 then also against their float32 copies) against the
    float64 reference with the band's mask; returns (out, lse)."""
    needs_kernel(q, k, v)
    T, S, D = q.shape[0], k.shape[0], q.shape[2]
    scale = D ** -0.5 if scale is None else scale
    visible = band_mask(T, S, True, q_offset, window)
    out, lse = cpu.flash_attention(q, k, v, causal=True, q_offset=q_offset, window=window, scale=scale, softcap=softcap)
    assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == (q.shape[1], T)
    if q.dtype == torch.bfloat16:
        out32, lse32 = cpu.flash_attention(q.float(), k.float(), v.float(), causal=True, q_offset=q_offset,
                                           window=window, scale=scale, softcap=softcap)
        assert torch.equal(out, out32) and torch.equal(lse, lse32)
    q64, k64, v64 = q.double(), k.double(), v.double()
    if softcap:
        ref_out, ref_lse = capped_attention(q64, k64, v64, visible, scale, softcap)
    else:
        ref_out, ref_lse = reference_attention(q64, k64, v64, visible, scale)
    torch_out, torch_lse = capped_attention(q.float(), k.float(), v.float(), visible, scale, softcap, torch.float32)
    empty = ~visible.any(dim=1)  # rows that see no key: exactly 0 and -inf
    assert torch.equal(ref_lse.isinf(), empty.expand_as(ref_lse))
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and (lse[:, empty] == -torch.inf).all()
    assert (out[empty] == 0).all()
    err, torch_err = (out.double() - ref_out).abs().max().item(), (torch_out.double() - ref_out).abs().max().item()
    assert err <= max(2e-6, 2 * torch_err), (err, torch_err)
    seen = ~empty
    if seen.any():
        lse_err = (lse[:, seen].double() - ref_lse[:, seen]).abs().max().item()
        torch_lse_err = (torch_lse[:, seen].double() - ref_lse[:, seen]).abs().max().item()
        assert lse_err <= max(2e-6, 2 * torch_lse_err), (lse_err, torch_lse_err)
    return out, lse


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 32)])  # GQA groups 1 and 4
@pytest.mark.parametrize("t,s,q_offset,window", BANDS)
def test_banded_blocks(kernel_variant, t, s, q_offset, window, hq, hkv, d, softcap):
    seed = t * 1000 + s + q_offset
    q, k, v = rand(t, hq, d, seed=seed), rand(s, hkv, d, seed=seed + 1), rand(s, hkv, d, seed=seed + 2)
    check_band(q, k, v, q_offset, window, softcap)
    check_band(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_offset, window, softcap)


@pytest.mark.parametrize("d", [16, 128, 256])
@pytest.mark.parametrize("t,s,q_offset,window", [(61, 61, 0, 11), (100, 300, 200, 50), (120, 200, -30, 16)])
def test_banded_blocks_other_head_dims(kernel_variant, t, s, q_offset, window, d):
    q, k, v = rand(t, 6, d, seed=t + d), rand(s, 3, d, seed=s + d + 1), rand(s, 3, d, seed=s + d + 2)
    check_band(q, k, v, q_offset, window, 0.0)
    check_band(q, k, v, q_offset, window, 5.0)


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_a_long_band_over_many_blocks_with_peaked_scores(kernel_variant, softcap):
    """1,000 tokens, a window across many key blocks (not a multiple of a tile), GQA 3 (units of 32
    tokens), scores spread over hundreds (the running max moves; capped near the cap)."""
    q, k, v = rand(1000, 9, 64, seed=1, scale=6.0), rand(1100, 3, 64, seed=2, scale=6.0), rand(1100, 3, 64, seed=3)
    check_band(q, k, v, 100, 257, softcap)
    check_band(q, k, v, -5, 0, softcap, scale=0.05)


@pytest.mark.parametrize("t,s", [(1, 50), (300, 77), (30, 4100)])  # 4100 keys: three spans, shared out
def test_softcap_on_full_blocks(kernel_variant, t, s):
    q, k, v = rand(t, 6, 64, seed=s, scale=3.0), rand(s, 2, 64, seed=s + 1, scale=3.0), rand(s, 2, 64, seed=s + 2)
    needs_kernel(q, k, v)
    for softcap in (2.0, 50.0):
        out, lse = cpu.flash_attention(q, k, v, causal=False, scale=0.125, softcap=softcap)
        ref_out, ref_lse = capped_attention(q.double(), k.double(), v.double(), band_mask(t, s, False), 0.125, softcap)
        torch_out, torch_lse = capped_attention(q, k, v, band_mask(t, s, False), 0.125, softcap, torch.float32)
        err, torch_err = (out.double() - ref_out).abs().max().item(), (torch_out.double() - ref_out).abs().max().item()
        assert err <= max(2e-6, 2 * torch_err), (softcap, err, torch_err)
        lse_err, torch_lse_err = (lse.double() - ref_lse).abs().max(), (torch_lse.double() - ref_lse).abs().max()
        assert lse_err <= max(2e-6, 2 * torch_lse_err), (softcap, lse_err, torch_lse_err)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_banded_rows_bits_depend_on_its_query_and_keys_alone(kernel_variant, threads):
    """The key tiles skipped at either end of the band are those whose probabilities would be exactly
    0 for every row of a unit, so a row's bits are those it has alone (as a one-row block at its own
    q_offset), among other rows, with any number of threads, and a window that cuts nothing gives
    the bits of no window; q_offset 0, window 0, T == S is the square diagonal block."""
    q, k, v = rand(400, 6, 64, seed=1), rand(450, 2, 64, seed=2), rand(450, 2, 64, seed=3)
    needs_kernel(q, k, v)
    for softcap in (0.0, 10.0):
        with torch_threads(threads):
            out, lse = cpu.flash_attention(q, k, v, causal=True, q_offset=40, window=150, scale=0.125, softcap=softcap)
        with torch_threads(1):
            one = cpu.flash_attention(q, k, v, causal=True, q_offset=40, window=150, scale=0.125, softcap=softcap)
        assert torch.equal(out, one[0]) and torch.equal(lse, one[1])
        for a, b in ((0, 1), (37, 133), (250, 251), (300, 400)):
            part = cpu.flash_attention(q[a:b], k, v, causal=True, q_offset=40 + a, window=150, scale=0.125,
                                       softcap=softcap)
            assert torch.equal(part[0], out[a:b]) and torch.equal(part[1], lse[:, a:b]), (a, b)
        uncut = cpu.flash_attention(q, k, v, causal=True, q_offset=40, window=441, scale=0.125, softcap=softcap)
        whole = cpu.flash_attention(q, k, v, causal=True, q_offset=40, scale=0.125, softcap=softcap)
        assert torch.equal(uncut[0], whole[0]) and torch.equal(uncut[1], whole[1])
    square = cpu.flash_attention(q, k[:400], v[:400], causal=True, scale=0.125)
    explicit = cpu.flash_attention(q, k[:400], v[:400], causal=True, q_offset=0, window=0, scale=0.125, softcap=0.0)
    assert torch.equal(square[0], explicit[0]) and torch.equal(square[1], explicit[1])


def test_a_band_or_an_offset_without_causal_is_refused():
    """Raised by the wrapper before any kernel runs (so also where there are no kernels)."""
    q = rand(20, 4, 64, seed=1)
    k = q[:, :2]
    with pytest.raises(ValueError, match="causal"):
        cpu.flash_attention(q, k, k, causal=False, window=8, scale=0.125)
    with pytest.raises(ValueError, match="causal"):
        cpu.flash_attention(q, k, k, causal=False, q_offset=-3, scale=0.125)
    with pytest.raises(ValueError, match="window"):
        cpu.flash_attention(q, k, k, causal=True, window=-1, scale=0.125)
    with pytest.raises(ValueError, match="softcap"):
        cpu.flash_attention(q, k, k, causal=True, softcap=-1.0, scale=0.125)
    with pytest.raises(ValueError, match="causal"):
        cpu.amx_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), causal=False, window=8, scale=0.125)
    with pytest.raises(ValueError, match="causal"):
        cpu.amx_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), causal=False, q_offset=2, scale=0.125)
