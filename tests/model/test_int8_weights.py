"""Int8 weights (ringctx/model/int8_weights.py): the quantizer, and the decode kernels that read the
codes (cpu.small_linear_int8, the fused lone and batch steps) against the same model
read as bf16, once per CPU kernel variant here.

The contract: a quantized model is an ordinary model whose weights are codes * 2^exponents (exact
in bf16), and the kernels reading the codes sum the same products in the same order as over those
bf16 values, so every result below is compared bit for bit.
"""

from __future__ import annotations


import pytest
import torch

from ringctx.kernels import build, cpu, selection
from ringctx.model import KVCache, forward_with_cache
from ringctx.model.decode_step import DecodeStep, FusedBatchStep
from ringctx.model.int8_weights import (GROUP, MIN_EXPONENT, check_int8_model, check_weights, code_bytes, int8_of,
                                        quantize, quantize_model, quantized_matrices)
from ringctx.model.presets import get_preset
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.model.test_decode_step import SHAPES, prefilled, random_model, threads  # noqa: F401
from tests.model.test_decode_step_batch import fused_batch, with_documents

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

# Every matrix whole groups of 64 inputs, a tied head with biases, Qwen3's head norms; and one
# model (dim 96, ffn 200) where only wo is: the kernels then mix int8 and bf16 matrices.
INT8_SHAPES = ["gqa2-d16", "gqa3-d64-bias-tied", "qwen3-qknorm-yarn", "gqa4-d128"]


def matrix(out, n, seed, scale=0.05):
    """Weights whose groups span magnitudes: row r scaled by 2^(r % 9 - 4)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g) * scale * 2.0 ** (torch.arange(out)[:, None] % 9 - 4)
    return w


# ------------------------------------------------------------------------------ the quantizer

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_are_the_codes_times_powers_of_two_rounded_to_nearest(dtype):
    w = matrix(37, 4 * GROUP, seed=1).to(dtype)
    w[3, :GROUP] = 0  # an all-zero group
    w[4, GROUP:2 * GROUP] = 0
    w[4, GROUP + 5] = 127 * 2.0 ** -7  # a group whose largest value is exactly 127 * 2^e
    w[5, :GROUP] = 1e-39 if dtype == torch.float32 else 0  # below 127 * 2^MIN_EXPONENT
    codes, exponents, values = quantize(w)
    assert codes.dtype == exponents.dtype == torch.int8 and values.dtype == dtype
    assert codes.shape == w.shape and exponents.shape == (37, 4)
    assert codes.abs().max() <= 127
    scale = torch.ldexp(torch.ones(37, 4, dtype=torch.float64), exponents.long()).repeat_interleave(GROUP, 1)
    assert torch.equal(values.double(), codes.double() * scale)  # exact
    assert torch.equal(values.bfloat16().double(), values.double())  # a bf16 value whatever the dtype
    assert ((w.double() - values.double()).abs() <= scale / 2).all()  # round to nearest
    # the smallest exponent that holds the group: one less would need a code past 127
    amax = w.double().abs().view(37, 4, GROUP).amax(-1)
    smaller = torch.ldexp(torch.full_like(amax, 127.0), exponents.long() - 1)
    assert ((amax > smaller) | (exponents == MIN_EXPONENT)).all()
    assert exponents[4, 1] == -7 and codes[4, GROUP + 5] == 127


def test_quantizing_the_values_again_changes_nothing():
    """Lossless again: a TP shard or a reload that quantizes values already quantized gets the
    same codes (and the same values)."""
    codes, exponents, values = quantize(matrix(64, 3 * GROUP, seed=2).bfloat16())
    again = quantize(values)
    assert torch.equal(again[0], codes) and torch.equal(again[1], exponents) and torch.equal(again[2], values)


def test_a_row_parallel_shard_of_whole_groups_quantizes_as_the_whole_matrix():
    """Under TP, wo and w2 are split by inputs and each rank quantizes its shard: with shards of
    whole groups the ranks' codes are the whole matrix's."""
    w = matrix(48, 6 * GROUP, seed=3).bfloat16()
    whole = quantize(w)
    for rank in range(3):
        cols = slice(rank * 2 * GROUP, (rank + 1) * 2 * GROUP)
        shard = quantize(w[:, cols].contiguous())
        assert torch.equal(shard[0], whole[0][:, cols]) and torch.equal(shard[2], whole[2][:, cols])


def test_what_int8_weights_refuse():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize(torch.randn(4, 96))
    with pytest.raises(ValueError, match="unknown weights 'int4'"):
        check_weights("int4")
    with pytest.raises(ValueError, match="bfloat16 or float32.*--dtype bf16"):
        check_weights("int8", "fp16")
    check_weights("int8", "bf16"), check_weights("int8", None), check_weights("model", "fp16")
    smollm2 = get_preset("smollm2-135m")  # 9 heads x 64 = 576 and ffn 1536
    assert check_int8_model(smollm2, 1) is None and check_int8_model(smollm2, 3) is None
    assert "tp=2" in check_int8_model(smollm2, 2) and "576 / 2" in check_int8_model(smollm2, 2)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        quantize_model(random_model(SHAPES["gqa2-d16"], torch.float16))


def test_quantize_model_rounds_every_matrix_once_and_keeps_codes_for_bf16_cpu_models():
    config = SHAPES["gqa3-d64-bias-tied"]
    model = random_model(config, torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    added = quantize_model(model)
    assert model.weights_format == "int8"
    linears = quantized_matrices(model)
    assert len(linears) == 4 * config.n_layers
    for linear in linears:
        codes = int8_of(linear.weight)
        assert codes is not None
        assert torch.equal(quantize(linear.weight)[0], codes.codes)  # the values are the codes' values
    assert added == sum(int8_of(m.weight).codes.numel() + int8_of(m.weight).exponents.numel() for m in linears)
    assert added == code_bytes(config)  # what `ringctx plan --weights int8` counts, from the config alone
    for name, p in model.named_parameters():  # norms, biases, the (tied) embedding and head untouched
        if "norm" in name or name.endswith("bias") or "tok_embeddings" in name:
            assert torch.equal(p, before[name]), name
    assert int8_of(model.output.weight) is None
    # a later in-place write (a reload) makes the codes stale: the kernels then read the weights
    with torch.no_grad():
        model.layers[0].attention.wo.weight.mul_(2)
    assert int8_of(model.layers[0].attention.wo.weight) is None
    # float32: the same values, no codes (the kernels read float32 weights)
    model32 = random_model(config, torch.float32)
    assert quantize_model(model32) == 0 and all(int8_of(m.weight) is None for m in quantized_matrices(model32))
    assert torch.equal(model32.layers[1].feed_forward.w2.weight.bfloat16().float(),
                       model32.layers[1].feed_forward.w2.weight)


# ------------------------------------------------------------------------------ the kernels

@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (7, 128), (130, 64), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_int8_equals_small_linear_over_the_values(rows, n_out, n_in, with_bias, monkeypatch):
    monkeypatch.setattr(selection, "INT8_MAX_ROWS", selection.MAX_ROWS)  # the kernel takes more rows
    codes, exponents, values = quantize(matrix(n_out, n_in, seed=n_out + n_in).bfloat16())
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    bias = torch.randn(n_out, generator=g).bfloat16() if with_bias else None
    got = cpu.small_linear_int8(x, codes, exponents, bias)
    want = cpu.small_linear(x, values, bias)
    if not selection.reads_int8_weights():  # the portable variant reads the values (faster there)
        assert got is None
        return
    assert got is not None and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    exact = x.double() @ values.double().t() + (bias.double() if with_bias else 0)
    assert (got == exact.bfloat16()).float().mean() >= 0.99


@needs_kernels
def test_small_linear_int8_declines_what_it_does_not_cover():
    codes, exponents, _ = quantize(matrix(8, 128, seed=5))
    x = torch.randn(1, 128).bfloat16()
    assert cpu.small_linear_int8(x.float(), codes, exponents) is None  # float32 activations
    assert cpu.small_linear_int8(torch.randn(selection.INT8_MAX_ROWS + 1, 128).bfloat16(), codes,
                                         exponents) is None  # more rows read the values
    assert cpu.small_linear_int8(x, codes, exponents[:, :1].contiguous()) is None  # exponents' shape
    assert cpu.small_linear_int8(x[:, :96], codes[:, :96].contiguous(), exponents) is None  # not whole groups
    assert cpu.small_linear_int8(x, codes.t().contiguous().t(), exponents) is None  # not contiguous


def quantized_pair(shape, seed=0):
    """A random bf16 model quantized, and a switch that drops (False) or restores (True) its codes:
    without them every kernel reads the bf16 values instead."""
    model = random_model(SHAPES[shape], torch.bfloat16, seed=seed)
    quantize_model(model)
    kept = {id(m.weight): m.weight._ringctx_int8 for m in quantized_matrices(model)}

    def use_codes(on: bool):
        for m in quantized_matrices(model):
            m.weight._ringctx_int8 = kept[id(m.weight)] if on else None

    return model, use_codes


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["model", "int8", "fp8"])
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_the_fused_lone_step_over_codes_equals_it_over_the_values(shape, kv_dtype, threads):  # noqa: F811
    model, use_codes = quantized_pair(shape)
    base = prefilled(model, 150, room=6)
    logits = {}
    for codes in (True, False):
        use_codes(codes)
        cache = KVCache.for_model(model.config, base.max_tokens, dtype=model.dtype, kv_dtype=kv_dtype)
        for layer in range(cache.n_layers):
            cache.update(layer, 0, base.k[layer][:base.length], base.v[layer][:base.length])
        cache.length = base.length
        step = DecodeStep(model, cache)
        assert step.is_fused
        token, out = 3, []
        for _ in range(4):
            out.append(step(token)[0])
            token = int(out[-1].argmax())
        logits[codes] = torch.stack(out)
    assert torch.equal(logits[True], logits[False])


@needs_kernels
def test_the_fused_step_reads_the_codes_where_the_variant_does():
    """The comparisons above are not vacuous: with its codes spoiled the step's logits move (and
    on the portable variant, which reads the bf16 values, they do not)."""
    model, use_codes = quantized_pair("gqa2-d16")
    cache = prefilled(model, 40)
    one, three = with_documents(model, 1, 1), with_documents(model, 3, 1)
    first = DecodeStep(model, cache)(5)
    first_one = fused_batch(FusedBatchStep.build(model), one.copy(), [1])
    first_three = fused_batch(FusedBatchStep.build(model), three.copy(), [1, 2, 3])
    int8_of(model.layers[1].feed_forward.w2.weight).codes.zero_()
    cache.length -= 1
    moved = selection.reads_int8_weights()
    assert torch.equal(DecodeStep(model, cache)(5), first) is not moved
    assert torch.equal(fused_batch(FusedBatchStep.build(model), one.copy(), [1]), first_one) is not moved
    # past INT8_MAX_ROWS rows the batch step reads the values
    assert torch.equal(fused_batch(FusedBatchStep.build(model), three.copy(), [1, 2, 3]), first_three)
    assert selection.reads_int8_weights() is (build.active_variant().name in ("avx512", "avx2"))


@needs_kernels
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_short_inputs_through_pytorch_read_the_codes_alike(shape):
    """A few tokens through the model's own linear() (small_linear_int8): as over the values."""
    model, use_codes = quantized_pair(shape)
    ids = torch.tensor([5, 9, 2, 7, 1])
    logits = {}
    for codes in (True, False):
        use_codes(codes)
        cache = prefilled(model, 30)
        with torch.inference_mode():
            logits[codes] = forward_with_cache(model, ids, cache, logits="all")
    assert torch.equal(logits[True], logits[False])


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["model", "fp8"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "gqa4-d128"])
def test_the_fused_batch_step_over_codes_equals_it_over_the_values(shape, batch, kv_dtype, threads):  # noqa: F811
    model, use_codes = quantized_pair(shape)
    setup = with_documents(model, batch, 2, kv_dtype)
    tokens = [(5 * i + 1) % model.config.vocab_size for i in range(batch)]
    logits = {}
    for codes in (True, False):
        use_codes(codes)
        step = FusedBatchStep.build(model)
        assert step is not None
        run = setup.copy()
        logits[codes] = torch.stack([fused_batch(step, run, tokens) for _ in range(2)])
    assert torch.equal(logits[True], logits[False])
