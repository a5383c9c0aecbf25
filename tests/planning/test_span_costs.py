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
