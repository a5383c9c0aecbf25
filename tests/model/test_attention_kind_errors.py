"""Bad attention kinds are one-line errors naming what is wrong and the way out: from config.json
(read_hf_config), and from `ModelConfig` / `LayerAttention` built directly. (The GGUF reader's own
cases are in test_model_gguf_families.py.)"""

from __future__ import annotations

import json

import pytest

from ringctx.model.config import LayerAttention, ModelConfig, RopeScaling
from ringctx.model.config_hf import read_hf_config
from tests.model.test_model_families_long import SHAPE

GEMMA = {**SHAPE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8}
MINISTRAL = {**SHAPE, "model_type": "ministral", "head_dim": 16, "sliding_window": 8}


@pytest.mark.parametrize("config,message", [
    # a window of 0 or below where one is declared
    ({**SHAPE, "model_type": "mistral", "sliding_window": 0},
     r"sliding_attention layers with sliding_window=0 \(a positive window\): set sliding_window to the window"),
    ({**MINISTRAL, "sliding_window": -4, "layer_types": ["sliding_attention", "full_attention"]},
     r"sliding_window=-4 \(a positive window\)"),
    ({**GEMMA, "sliding_window": 0}, r"sliding_window=0 \(a positive window\)"),
    ({**MINISTRAL, "sliding_window": 2.5}, r"sliding_window=2.5 \(a positive window\)"),
    # a chunk size no model can have
    ({**MINISTRAL, "layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": 0},
     r"attention_chunk_size=0 \(a positive size\): set attention_chunk_size to the chunk in tokens"),
    ({**MINISTRAL, "layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": -8192},
     r"attention_chunk_size=-8192 \(a positive size\)"),
    # layer_types of the wrong length or with an unknown kind
    ({**MINISTRAL, "layer_types": ["sliding_attention"]},
     r"layer_types lists 1 layers for num_hidden_layers=2: give one entry per layer"),
    ({**MINISTRAL, "layer_types": ["full_attention", "mamba"]},
     r"layer_types entry 'mamba' \(ringctx computes full_attention, sliding_attention, chunked_attention\) is not "
     r"supported yet"),
    # Gemma 3's pattern of 0
    ({**GEMMA, "sliding_window_pattern": 0},
     r"sliding_window_pattern=0 \(a positive layer count: every n-th layer is full\); fix it, or give layer_types"),
    # kinds not supported yet: Gemma 3n's per-layer inputs, mixtures of experts
    ({"model_type": "gemma3n", "text_config": {"model_type": "gemma3n_text"}},
     r"Gemma 3n \(hidden_size_per_layer_input: per-layer inputs.*not supported yet"),
    ({**GEMMA, "hidden_size_per_layer_input": 256},
     r"per-layer inputs \(hidden_size_per_layer_input=256, Gemma 3n's\) is not supported yet"),
    ({**SHAPE, "model_type": "qwen2_moe", "num_experts": 128},
     r"model_type='qwen2_moe' \(a mixture of experts: num_experts=128, not supported yet"),
    ({"model_type": "llama4", "text_config": {**SHAPE, "model_type": "llama4_text", "moe_layers": [0, 2]}},
     r"moe_layers=\[0, 2\] names layers outside 0\.\.1 \(model_type llama4_text\)"),
    ({**SHAPE, "model_type": "llama", "num_experts": 8},
     r"mixture-of-experts layers \(num_experts=8\) is not supported yet"),
])
def test_bad_attention_kinds_in_config_json(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_a_gemma_pattern_reads_as_transformers_derives_it():
    """The default (6) and an explicit pattern, not divisible into the layer count (Gemma 3 1B: 26 layers)."""
    for pattern, full in ((None, [5]), (3, [2, 5])):
        config = read_hf_config({**GEMMA, "num_hidden_layers": 7, "sliding_window_pattern": pattern})
        assert [i for i in range(7) if not config.attention(i).window] == full


PLAIN = dict(name="m", vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64)


@pytest.mark.parametrize("build,message", [
    (lambda: LayerAttention(window=-1), r"window=-1: window is a positive count; give 0 for none"),
    (lambda: LayerAttention(chunk=-8), r"chunk=-8: chunk is a positive count; give 0 for none"),
    (lambda: LayerAttention(rotary_dim=-2), r"rotary_dim=-2: rotary_dim is a positive count"),
    (lambda: LayerAttention(rotary_dim=7), r"rotary_dim=7 must be even"),
    (lambda: LayerAttention(scale=-0.1), r"scale=-0.1 must be positive; give 0 for the default \(1/sqrt\(head_dim\)\)"),
    (lambda: LayerAttention(softcap=-30.0), r"softcap=-30.0 must be positive; give 0 for the default \(no soft-cap\)"),
    (lambda: LayerAttention(rope_theta=-1.0), r"rope_theta=-1.0 must be positive"),
    (lambda: LayerAttention(rope_scaling=RopeScaling(factor=8.0, rope_type="linear")),
     r"rope_scaling is set but rope_theta=0 .* give the layer's own rope_theta too, or drop its rope_scaling"),
    (lambda: LayerAttention(rope=False, rope_theta=10_000.0), r"rope=False \(a NoPE layer\) with its own rope_theta"),
    (lambda: ModelConfig(**PLAIN, layer_attention=(LayerAttention(window=4),) * 3),
     r"layer_attention describes 3 layers but the model has n_layers=2: give one LayerAttention per layer"),
    (lambda: ModelConfig(**PLAIN, layer_attention=(LayerAttention(rotary_dim=32),) * 2),
     r"layer 0 rotates 32 dims of a head of 16: rotary_dim is at most head_dim"),
])
def test_bad_attention_kinds_built_directly(build, message):
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert "\n" not in str(info.value)
