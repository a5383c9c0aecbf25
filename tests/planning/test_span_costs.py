"""The planner counts each layer kind's real work: a window's or a chunk's keys, not all of them."""

import dataclasses
import random

import torch

from ringctx.attention.spans import Span
from ringctx.model.config import LayerAttention
from ringctx.model.presets import get_preset
from ringctx.planning.strategy import attention_flops, predict_costs, span_attention_flops, visible_keys
from ringctx.planning.work import chunk_flops


def test_visible_keys_counts_what_the_span_lets_each_token_see():
    rng = random.Random(0)
    for _ in range(300):
        span = Span(window=rng.choice([0, 1, 3, 10]), chunk=rng.choice([0, 4, 7]))
        first = rng.randint(0, 40)
        stop = first + rng.randint(0, 40)
        brute = sum(int(span.visible(torch.tensor([p]), torch.arange(p + 1)).sum()) for p in range(first, stop))
        assert visible_keys(first, stop, span) == brute, (span, first, stop)


def test_full_span_flops_are_the_ring_formula():
    assert span_attention_flops(1000, 5000, 64, Span()) == attention_flops(1000, 5000, 64)
    # a window of 100 over a long cache: 100 keys per token
    assert span_attention_flops(1000, 5000, 64, Span(window=100)) == 4 * 64 * 100 * 1000


def hybrid(model, window=512, every=6):
    """`model` with Gemma 3's pattern: 5 sliding layers to 1 global."""
    layers = tuple(LayerAttention() if (i + 1) % every == 0 else LayerAttention(window=window)
                   for i in range(model.n_layers))
    return dataclasses.replace(model, layer_attention=layers, name=model.name + "-hybrid")


def test_chunk_work_and_predicted_time_count_windowed_layers_as_cheaper():
    base = get_preset("llama3-8b")
    mixed = hybrid(base)
    tokens, cached = 8192, 120_000
    assert chunk_flops(tokens, cached, mixed) < 0.35 * chunk_flops(tokens, cached, base)
    for cp in (1, 4):
        full = predict_costs(tokens, cached, base, cp, "h100-rdma")
        windowed = predict_costs(tokens, cached, mixed, cp, "h100-rdma")
        for strategy in full:
            assert windowed[strategy].span_layers == base.n_layers - base.n_layers // 6
            assert windowed[strategy].n_layers == base.n_layers // 6
            assert windowed[strategy].total_s < 0.5 * full[strategy].total_s


def test_layers_with_their_own_head_shape_count_at_their_width():
    """Gemma 4 31B: 50 windowed layers of 16 KV heads x 256 and 10 full ones of 4 x 512. The cache's
    row bytes, a document's kept bytes, the chunk FLOPs and the ring's NKV take each layer's own."""
    from ringctx.planning.memory import document_kv_bytes, kv_row_bytes, layer_kv_row_bytes
    from ringctx.planning.strategy import linear_params_per_layer, ring_heads

    model = get_preset("gemma4-31b")
    windowed = [i for i in range(model.n_layers) if model.attention(i).window]
    assert len(windowed) == 50 and model.kv_shapes[0] == (16, 256) and model.kv_shapes[5] == (4, 512)
    rows = layer_kv_row_bytes(model, 1, "bfloat16")
    assert {rows[i] for i in windowed} == {2 * 16 * 256 * 2} and rows[5] == 2 * 4 * 512 * 2
    assert kv_row_bytes(model, 1, "bfloat16") == model.kv_bytes_per_token(2) == 50 * 16384 + 10 * 8192
    assert layer_kv_row_bytes(model, 1, "bfloat16", "int8")[5] == 2 * 4 * (512 + 4)  # a scale per head
    assert layer_kv_row_bytes(model, 8, "bfloat16")[:6] == [2 * 2 * 256 * 2] * 5 + [2 * 1 * 512 * 2]  # TP 8
    tokens = 1_000_000
    # a window of 1,024 keeps the 1,023 rows before the next token
    assert document_kv_bytes(model, rows, tokens) == 50 * 1023 * 16384 + 10 * tokens * 8192
    assert ring_heads(model, 1) == (32, 4) and ring_heads(get_preset("gemma3-27b"), 1) == (32, 16)
    # q/k/v/o of both shapes, summed over the layers
    attention = 50 * (5376 * (32 + 32) * 256 + 32 * 256 * 5376) + 10 * (5376 * (32 + 8) * 512 + 32 * 512 * 5376)
    assert linear_params_per_layer(model) * 60 == attention + 60 * 3 * 5376 * 21504
    # chunk FLOPs: each layer's attention at its own q width
    uniform = dataclasses.replace(model, layer_attention=tuple(
        dataclasses.replace(model.attention(i), head_dim=0, n_kv_heads=0) for i in range(model.n_layers)))
    gap = chunk_flops(4096, 8192, model) - chunk_flops(4096, 8192, uniform)
    linear_gap = 2 * 4096 * (linear_params_per_layer(model) - linear_params_per_layer(uniform)) * 60
    assert gap - linear_gap == 10 * (attention_flops(4096, 8192, 32 * 512) - attention_flops(4096, 8192, 32 * 256))
