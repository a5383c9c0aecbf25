"""A question's prefill in one C call (`FusedPrefill`, csrc/cpu_decode.c's ringctx_prefill_rows)
against the layer-by-layer path it replaces (`Block.forward` through PrefillRun): where it is taken,
the same logits and the same cache rows, bit for bit, on random bf16 models of several shapes; and
where the layer-by-layer path would take other kernels, it is not taken.

The fused call is made of the kernels the layer-by-layer path runs on a CPU without bf16 units
(small_linear's rows, the float32 flash kernel): the tests make ringctx treat this CPU as one
(ONEDNN_MAX_CPU_ISA=AVX2 keeps PyTorch off bf16 units, RINGCTX_AMX=0 the AMX kernels off), and run
once per kernel variant the machine has.
"""

from __future__ import annotations

import pytest
import torch

from ringctx.kernels import cpu_features
from ringctx.runtime import prefill
from ringctx.runtime.prefill import PrefillConfig, PrefillRun, cp_prefill
from ringctx.model import KVCache
from ringctx.model.decode_step import FusedPrefill
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.model.test_decode_step import SHAPES, random_model, threads  # noqa: F401 (threads: a fixture, 1 and 3)

pytestmark = pytest.mark.usefixtures("kernel_variant")

# Grouped-query shapes, so that a question's rows reach the flash kernel's FLASH_FROM_ROWS_PER_KV_HEAD
# query rows per KV head: group 3 from 14 tokens, 4 from 10, 2 from 20.
FUSED_SHAPES = ["gqa3-d64-bias-tied", "gqa4-d128", "gqa3-d48-odd-ffn", "qwen3-qknorm-yarn"]


@pytest.fixture
def float32_math(monkeypatch):
    """ringctx's choices as on a CPU without bf16 units (bf16 computed in float32, no AMX)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("RINGCTX_AMX", "0")
    cpu_features.cpu_has_fast_bf16.cache_clear()
    yield
    cpu_features.cpu_has_fast_bf16.cache_clear()


def document_cache(model, tokens: int, room: int, seed: int = 1) -> KVCache:
    """A cache holding `tokens` random tokens' rows (prefilled on this process), `room` rows free."""
    cache = KVCache.for_model(model.config, tokens + room, dtype=model.dtype, sliced=True)
    if tokens:
        ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
        cache = cp_prefill(model, ids, PrefillConfig(chunk_tokens=256), group="local", shard=cache).cache
    return cache


def copy_of(cache: KVCache) -> KVCache:
    other = KVCache(cache.n_layers, cache.max_tokens, cache.n_kv_heads, cache.head_dim, dtype=cache.dtype,
                    kv_dtype=cache.kv_dtype, sliced=True)
    for dst, src in zip(other.storage_tensors(), cache.storage_tensors()):
        dst.copy_(src)
    other.length = cache.length
    return other


def question(model, document: KVCache, rows: int, fused: bool, monkeypatch, slices=None):
    """Prefill `rows` random tokens over a copy of `document`: (logits, cache, fused calls made)."""
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(7))
    calls = []
    real_call = FusedPrefill.__call__

    def counted(self, *args):
        calls.append(args[-2:])
        return real_call(self, *args)

    with monkeypatch.context() as m:
        m.setattr(FusedPrefill, "__call__", counted)
        if not fused:
            m.setattr(prefill.FusedPrefill, "build", classmethod(lambda cls, model: None))
        run = PrefillRun(model, ids, PrefillConfig(chunk_tokens=64), group="local", shard=copy_of(document))
        sizes = list(slices or [None])
        while not run.done:
            run.step(sizes.pop(0) if sizes else None)
        result = run.finish()
    return result.logits, result.cache, calls


@needs_kernels
@pytest.mark.parametrize("shape", FUSED_SHAPES)
@pytest.mark.parametrize("rows,cached", [(14, 0), (20, 300), (27, 517), (32, 64)])
def test_fused_prefill_gives_the_layer_by_layer_bits(shape, rows, cached, threads, float32_math, monkeypatch):
    model = random_model(SHAPES[shape], torch.bfloat16)
    if shape.startswith("qwen3") and cached + rows > 64:
        cached = 40  # its YaRN factor applies past 64 positions: keep a question on both sides of it
    document = document_cache(model, cached, room=rows + 3)
    want_logits, want_cache, plain_calls = question(model, document, rows, False, monkeypatch)
    logits, cache, calls = question(model, document, rows, True, monkeypatch)
    assert not plain_calls and calls == [(0, model.config.n_layers)]  # taken, all layers in one call
    assert torch.equal(logits, want_logits)
    assert cache.length == want_cache.length == cached + rows
    for got, want in zip(cache.storage_tensors(), want_cache.storage_tensors()):
        assert torch.equal(got[:cached + rows], want[:cached + rows])


@needs_kernels
def test_fused_prefill_in_slices_gives_the_same_bits(float32_math, monkeypatch):
    """A chunk run a few layers at a time (what the scheduler does beside answers) takes the fused
    call per slice, with the bits of the whole chunk in one call."""
    model = random_model(SHAPES["gqa4-d128"], torch.bfloat16)
    document = document_cache(model, 200, room=20)
    whole, whole_cache, _ = question(model, document, 12, True, monkeypatch)
    layers = model.config.n_layers
    sliced, sliced_cache, calls = question(model, document, 12, True, monkeypatch, slices=[1, 2])
    assert calls == [(0, 1), (1, min(3, layers))] + ([(3, layers)] if layers > 3 else [])
    assert torch.equal(sliced, whole)
    for got, want in zip(sliced_cache.storage_tensors(), whole_cache.storage_tensors()):
        assert torch.equal(got[:212], want[:212])


@needs_kernels
def test_fused_prefill_is_not_taken_where_other_kernels_run(float32_math, monkeypatch):
    """Rows the layer-by-layer path gives other kernels: few rows (decode kernels, small_linear's
    lone rows), too few query rows per KV head over a document (the decode attention kernel),
    many rows (PyTorch's matmul), an 8-bit cache, a float32 model, a backend named."""
    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.bfloat16)
    fused = FusedPrefill.build(model)
    assert fused is not None
    cache = KVCache.for_model(model.config, 400, dtype=model.dtype, sliced=True)
    assert fused.takes(14, cache, 300, "auto") and fused.takes(9, cache, 0, "auto")
    assert not fused.takes(8, cache, 0, "auto")      # small_linear's lone rows, a decode step's size
    assert not fused.takes(13, cache, 300, "auto")   # 39 query rows per KV head: the decode kernel
    assert not fused.takes(33, cache, 300, "auto")   # PyTorch's matmul in float32
    assert not fused.takes(14, cache, 390, "auto")   # no room for the rows
    assert not fused.takes(14, cache, 300, "torch")
    int8 = KVCache.for_model(model.config, 400, dtype=model.dtype, kv_dtype="int8", sliced=True)
    assert not fused.takes(14, int8, 300, "auto")
    assert FusedPrefill.build(random_model(SHAPES["gqa3-d64-bias-tied"], torch.float32)) is None


@needs_kernels
def test_fused_prefill_is_not_built_where_bf16_runs_natively(monkeypatch):
    """On a CPU with bf16 units (or AMX) a question's rows take other kernels: no fused call."""
    monkeypatch.setattr(cpu_features, "cpu_has_fast_bf16", lambda: True)
    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.bfloat16)
    assert FusedPrefill.build(model) is None


@needs_kernels
def test_fused_prefill_is_kept_per_model_while_its_weights_stay(float32_math):
    """Built once per model (its weights' pointers unchanged), rebuilt when a weight is replaced,
    and never what keeps a model alive."""
    import gc
    import weakref

    model = random_model(SHAPES["gqa3-d64-bias-tied"], torch.bfloat16)
    first = FusedPrefill.build(model)
    assert first is not None and FusedPrefill.build(model) is first
    block = model.layers[-1].feed_forward
    block.w2.weight = torch.nn.Parameter(block.w2.weight.detach().clone(), requires_grad=False)
    rebuilt = FusedPrefill.build(model)
    assert rebuilt is not None and rebuilt is not first
    alive = weakref.ref(model)
    del model, block
    gc.collect()
    assert alive() is None
