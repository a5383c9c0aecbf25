"""The fused decode step (csrc/cpu_decode.c via ringctx/model/decode_step.py) against the PyTorch
path it replaces (`forward_with_cache` on one token), on random models of many shapes.

float32: the same logits and cache rows to float32 rounding. bf16: the two paths round at the
same places but sum in other orders, so a bf16 value may land one step away; the rule is the one
of docs/ARCHITECTURE.md: the fused step's error against a float32 computation from the same state is at most
twice the PyTorch bf16 path's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringctx.kernels import cpu
from ringctx.model.config import RopeScaling, yarn_attention_factor
from ringctx.model.presets import get_preset
from ringctx.model import KVCache, forward_with_cache
from ringctx.model.decode_step import DecodeStep, FusedStep
from ringctx.model.weights import empty_model
from tests.helpers import rel_err
from tests.kernels.test_cpu_kernels import needs_kernels

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

TINY = get_preset("tiny")

# Head widths 16/32/48 take the kernels' generic paths, 64 and 128 their register tiles; group
# sizes 1-4 cover every tile height of the PV kernel.
SHAPES = {
    "mha-d32": dataclasses.replace(TINY, n_heads=2, n_kv_heads=2, head_dim=32),
    "gqa2-d16": TINY,
    "gqa3-d64-bias-tied": dataclasses.replace(TINY, dim=128, n_heads=6, n_kv_heads=2, head_dim=64, qkv_bias=True,
                                              attn_out_bias=True, tie_embeddings=True),
    "gqa4-d128": dataclasses.replace(TINY, dim=96, n_heads=4, n_kv_heads=1, head_dim=128, ffn_dim=200),
    "gqa3-d48-odd-ffn": dataclasses.replace(TINY, dim=80, n_heads=3, n_kv_heads=1, head_dim=48, ffn_dim=77),
    # Qwen3: per-head q/k norms in the kernel; YaRN's factor on cos/sin, past its original 64 positions.
    "qwen3-qknorm-yarn": dataclasses.replace(TINY, n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True,
                                             rope_scaling=RopeScaling(factor=4.0, original_max_position=64,
                                                                      rope_type="yarn",
                                                                      attention_factor=yarn_attention_factor(4.0))),
}
PROMPT = 300  # crosses the kernels' 16-key blocks, 32-key V blocks and 256-key softmax tiles


def random_model(config, dtype, seed=0):
    """Random weights large enough that attention is far from uniform and norms matter."""
    model = empty_model(config, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 2 else 0.3))
    return model.to(dtype)


def prefilled(model, n_tokens, room=8, seed=1):
    cache = KVCache.for_model(model.config, n_tokens + room, dtype=model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        if n_tokens:
            forward_with_cache(model, ids, cache, logits="none")
    return cache


def copy_of(cache, dtype=None):
    dtype = dtype or cache.dtype
    other = KVCache(cache.n_layers, cache.max_tokens, cache.n_kv_heads, cache.head_dim, dtype=dtype)
    for dst, src in zip(other.k + other.v, cache.k + cache.v):
        dst[: cache.length].copy_(src[: cache.length])
    other.length = cache.length
    return other


@pytest.fixture(params=[1, 3], ids=lambda t: f"{t}threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def step_both(model, reference, fused_cache, tolerance):
    """Four greedy steps on the PyTorch path (over `reference`) and the fused one (over
    `fused_cache`): float32 logits [1, vocab] within `tolerance` relative at every step."""
    plain, fused = DecodeStep(model, reference, fused=False), DecodeStep(model, fused_cache)
    assert fused.is_fused and not plain.is_fused
    token = 3
    with torch.inference_mode():
        for _ in range(4):
            want, got = plain(token), fused(token)
            assert got.dtype == torch.float32 and got.shape == want.shape == (1, model.config.vocab_size)
            assert rel_err(got, want) < tolerance
            token = int(want.argmax())
    assert fused_cache.length == reference.length == PROMPT + 4


@needs_kernels
@pytest.mark.parametrize("shape", list(SHAPES))
def test_float32_steps_equal_the_pytorch_path(shape, threads):
    model = random_model(SHAPES[shape], torch.float32)
    reference = prefilled(model, PROMPT)
    fused_cache = copy_of(reference)
    step_both(model, reference, fused_cache, 2e-5)
    for a, b in zip(fused_cache.k + fused_cache.v, reference.k + reference.v):
        torch.testing.assert_close(a[: reference.length], b[: reference.length], atol=2e-5, rtol=1e-5)


def quantized_copy(cache, kv_dtype):
    """The same rows in an 8-bit cache (quantized as KVCache.update does it)."""
    other = KVCache(cache.n_layers, cache.max_tokens, cache.n_kv_heads, cache.head_dim, dtype=cache.dtype,
                    kv_dtype=kv_dtype)
    for layer in range(cache.n_layers):
        other.update(layer, 0, cache.k[layer][:cache.length], cache.v[layer][:cache.length])
    other.length = cache.length
    return other


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "gqa4-d128"])
def test_8bit_cache_steps_equal_the_pytorch_path(shape, kv_dtype, threads):
    """The fused step over an 8-bit cache: the rows it writes are the bytes and scales PyTorch's
    quantizer writes (a code one step away where a float32 K/V value itself differs in the last
    bit), and the logits those of the PyTorch path over the same cache."""
    model = random_model(SHAPES[shape], torch.float32)
    rows = prefilled(model, PROMPT)
    reference, fused_cache = quantized_copy(rows, kv_dtype), quantized_copy(rows, kv_dtype)
    step_both(model, reference, fused_cache, 1e-4)
    new = slice(PROMPT, PROMPT + 4)
    for layer in range(model.config.n_layers):
        for a, b in zip(fused_cache.storage_tensors(layer)[2:], reference.storage_tensors(layer)[2:]):
            torch.testing.assert_close(a[new], b[new], rtol=1e-5, atol=0)  # scales
        for a, b in zip(fused_cache.read_rows(layer, PROMPT, PROMPT + 4), reference.read_rows(layer, PROMPT, PROMPT + 4)):
            step = b.abs().amax(dim=-1, keepdim=True) / (127 if kv_dtype == "int8" else 8)
            assert bool(((a - b).abs() <= step + 1e-6).all())
        for a, b in zip(fused_cache.storage_tensors(layer)[:2], reference.storage_tensors(layer)[:2]):
            same = (a[new].view(torch.uint8) == b[new].view(torch.uint8)).float().mean()
            assert same > 0.97, same  # nearly every code identical


@needs_kernels
def test_e4m3_rounding_matches_pytorch():
    """Every float32 magnitude class the kernel's fp8 encoder meets (subnormals, ties, the 448 top)
    gives PyTorch's float8_e4m3fn byte."""
    values = torch.cat([torch.linspace(-448, 448, 20001), torch.linspace(-0.02, 0.02, 4001),
                        torch.tensor([0.0, -0.0, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -6, 448.0, -448.0, 0.0146484375])])
    ours = cpu.encode_e4m3(values)
    assert torch.equal(ours, values.to(torch.float8_e4m3fn).view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_step_is_as_accurate_as_the_pytorch_path(shape, threads):
    model = random_model(SHAPES[shape], torch.bfloat16)
    exact_model = random_model(SHAPES[shape], torch.bfloat16).float()  # the same bf16 weights, in float32
    state = prefilled(model, PROMPT)
    plain_cache, fused_cache = copy_of(state), copy_of(state)
    with torch.inference_mode():
        exact = DecodeStep(exact_model, copy_of(state, torch.float32), fused=False)(7)
        plain = DecodeStep(model, plain_cache, fused=False)(7)
        fused_step = DecodeStep(model, fused_cache)
        assert fused_step.is_fused
        fused = fused_step(7)
    plain_err, fused_err = rel_err(plain, exact), rel_err(fused, exact)
    assert plain_err > 0  # bf16 rounding happened: the rule below is not vacuous
    assert fused_err <= 2 * plain_err, (fused_err, plain_err)
    # Rounded at the same places as the PyTorch path: the new K/V rows come out (nearly) bit-equal;
    # skipping one of the roundings (e.g. in RoPE) leaves 70-85% of them equal here.
    new_rows = [(a[PROMPT], b[PROMPT]) for a, b in zip(plain_cache.k + plain_cache.v, fused_cache.k + fused_cache.v)]
    same = torch.stack([(a == b).float().mean() for a, b in new_rows])
    assert same.min() >= 0.95, same


@needs_kernels
def test_first_token_with_more_threads_than_keys(threads):
    """Position 0: one key, so some threads have no keys at all (their partials must not count)."""
    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.float32)
    a, b = prefilled(model, 0), prefilled(model, 0)
    with torch.inference_mode():
        want, got = DecodeStep(model, a, fused=False)(5), DecodeStep(model, b)(5)
    assert rel_err(got, want) < 2e-5
    torch.testing.assert_close(b.k[0][:1], a.k[0][:1])


@needs_kernels
def test_generation_uses_the_fused_step_and_matches_the_pytorch_path(monkeypatch):
    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.float32)
    prompt = torch.randint(0, model.config.vocab_size, (50,), generator=torch.Generator().manual_seed(3))
    fused = model.generate(prompt, max_new_tokens=12, stop_token_ids=[])
    calls = []
    monkeypatch.setattr(FusedStep, "build", classmethod(lambda cls, m, c, shared_rows=0: calls.append(1)))
    plain = model.generate(prompt, max_new_tokens=12, stop_token_ids=[])
    assert calls == [1] and fused.token_ids == plain.token_ids


def test_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    """Head widths that are not a multiple of 16, other dtypes, no kernel library: the PyTorch path."""
    odd = random_model(dataclasses.replace(TINY, n_heads=2, n_kv_heads=1, head_dim=24), torch.float32)
    assert not DecodeStep(odd, prefilled(odd, 5)).is_fused
    half = random_model(TINY, torch.float16)
    assert not DecodeStep(half, prefilled(half, 5)).is_fused
    model = random_model(TINY, torch.float32)
    monkeypatch.setenv("RINGCTX_CPU_KERNELS", "0")  # no kernel library: build.library() is None
    cache = prefilled(model, 5)
    step = DecodeStep(model, cache)
    assert not step.is_fused
    with torch.inference_mode():
        assert step(4).shape == (1, model.config.vocab_size) and cache.length == 6


@needs_kernels
def test_bad_token_and_full_cache_are_clear_errors():
    model = random_model(TINY, torch.float32)
    cache = prefilled(model, 3, room=1)
    step = DecodeStep(model, cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        step(model.config.vocab_size)
    with torch.inference_mode():
        step(1)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        step(1)
