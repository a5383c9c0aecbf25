"""Gemma 4's dense text model against transformers 5.25 (Gemma4ForCausalLM, and the text model of
Gemma4ForConditionalGeneration): Gemma's block with plain (w) norms, q/k norms before RoPE, a
weightless v norm, softmax scale 1, a stored scalar per block, 5 sliding : 1 full layers, the full
ones with "proportional" RoPE (a quarter of each head's pairs turning), keys as values on the full
layers (attention_k_eq_v), a final soft-cap; full layers with their own head shape (the 31B's:
512-dim heads and 4 KV heads where its sliding layers have 256 and 16), here 32 and 1 against 16 and 2.

What ringctx refuses, in one line each: per-layer embeddings (E2B/E4B), KV sharing across layers,
bidirectional attention (the 26B-A4B's experts: test_model_gemma4_moe.py).

Built as test_model_families_long.py builds its references: transformers' own config class, random
weights (norms, biases and the block scalars too), save_pretrained, loaded by ringctx; float32.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_hf import read_hf_config
from tests.helpers import (assert_tp_shards_are_slices,
                           assert_greedy_matches, assert_logits_match, hf_logits, one_thread_for_module,
                           rel_err, saved_hf_pair)
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
WINDOW = 8
SHORT, LONG = 20, 70

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0,
            sliding_window=WINDOW, max_position_embeddings=512, final_logit_softcapping=3.0, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
"""A tiny Gemma 4 text model whose full layers keep the sliding layers' head shape."""


def hf_config(name: str):
    import transformers

    cases = {
        "gemma4-text": lambda: transformers.Gemma4TextConfig(**TEXT),
        # the full layers' values are their keys (no v_proj), biases everywhere, an untied head,
        # layer kinds as listed (the last forced to full, as Gemma4TextConfig does)
        "gemma4-keqv-bias": lambda: transformers.Gemma4TextConfig(
            **{**TEXT, "final_logit_softcapping": None}, attention_k_eq_v=True, num_global_key_value_heads=2,
            attention_bias=True, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "full_attention", "sliding_attention"]),
        # the 31B's layout in small: full layers with 32-dim heads and one KV head (keys as values),
        # sliding layers with 16-dim heads and two
        "gemma4-heads": lambda: transformers.Gemma4TextConfig(
            **{**TEXT, "global_head_dim": 32}, attention_k_eq_v=True, num_global_key_value_heads=1),
        "gemma4-vlm": lambda: transformers.Gemma4Config(
            text_config=transformers.Gemma4TextConfig(**TEXT), audio_config=None,
            vision_config=transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, head_dim=16, global_head_dim=16)),
    }
    return cases[name]()


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`, every parameter random, the block scalars too."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    torch.manual_seed(seed)
    config = hf_config(name)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "text_config") else \
        transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in param_name else torch.randn_like(p) * 0.1)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("layer_scalar"):  # saved with the weights; 1 at init, trained values differ
                b.copy_(torch.rand_like(b) + 0.5)
    return model


CASES = ["gemma4-text", "gemma4-keqv-bias", "gemma4-heads", "gemma4-vlm"]


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    return saved_hf_pair(request.param, random_hf_model, tmp_path_factory)



MEASURED: dict[str, float] = {}


def test_logits_match_transformers(pair):
    assert_logits_match(pair, [prompt(SHORT), prompt(LONG)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    assert_greedy_matches(pair, prompt(LONG - 8, seed=2))


def test_config_is_read_as_written(pair):
    name, ours, hf, _ = pair
    c = ours.config
    text = hf.config.get_text_config()
    sliding = text.per_layer_config[0]  # the model's head shape is its sliding layers'
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size, c.ffn_dim) == (
        text.hidden_size, text.num_hidden_layers, text.num_attention_heads, sliding.num_key_value_heads,
        sliding.head_dim, text.vocab_size, text.intermediate_size)
    hf_text = {n: p for n, p in [*hf.named_parameters(), *hf.named_buffers()]
               if ("layers." in n and n.endswith("layer_scalar")) or (
                   n in dict(hf.named_parameters()) and "vision" not in n and "embed_vision" not in n)}
    keqv = name == "gemma4-keqv-bias"
    # ringctx holds v rows for the k_eq_v (full) layers too (a copy of k's): count them once more
    full = [i for i in range(c.n_layers) if not c.attention(i).window]
    bias = 1 if keqv else 0
    extra = sum(c.kv_heads_of(i) * c.head_dim_of(i) * (c.dim + bias) for i in full) \
        if name in ("gemma4-keqv-bias", "gemma4-heads") else 0
    assert c.n_params == sum(p.numel() for p in hf_text.values()) + extra, name
    layer_config = text.per_layer_config
    assert c.kv_shapes == [(layer_config[i].num_key_value_heads, layer_config[i].head_dim)
                           for i in range(c.n_layers)], name
    assert c.uniform_heads == (name != "gemma4-heads")
    assert (c.norm_plus_one, c.post_norms, c.qk_norm, c.v_norm, c.layer_scalars, c.mlp_activation) == (
        False, True, True, True, True, "gelu_tanh")
    assert c.rope_scaling.rope_type == "proportional" and c.rope_scaling.proportion == 0.25 and c.rope_theta == 1e6
    windows = [c.attention(i).window for i in range(c.n_layers)]
    assert windows == ([WINDOW, 0, WINDOW, WINDOW, 0, 0] if keqv else [WINDOW] * 5 + [0])
    assert all(c.attention(i).scale == 1.0 for i in range(c.n_layers))
    assert all(c.attention(i).rope_theta == (1e4 if windows[i] else 0.0) for i in range(c.n_layers))
    assert c.final_softcap == (0.0 if keqv else 3.0) and not c.is_llama_block


def test_report_measured_errors():
    for name, err in MEASURED.items():
        print(f"{name}: logits rel err {err:.2e}")


def test_each_gemma4_ingredient_moves_the_logits(tmp_path):
    """Without the v norm, the block scalars or the proportional RoPE's zero frequencies (all
    pairs turning instead), the logits leave the 1e-4 the oracle tests hold them to."""
    import dataclasses

    hf = random_hf_model("gemma4-text")
    hf.save_pretrained(tmp_path)
    ids = prompt(LONG)
    ref = hf_logits(hf, ids)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    errors = {"all": rel_err(model.logits(ids), ref)}
    for block in model.layers:
        block.attention.v_norm_eps = None
    errors["no v norm"] = rel_err(model.logits(ids), ref)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    for block in model.layers:
        block.layer_scalar = None
    errors["no block scalars"] = rel_err(model.logits(ids), ref)
    config = load_model(str(tmp_path), dtype=torch.float32, device="meta").config
    turning = dataclasses.replace(config, rope_scaling=dataclasses.replace(config.rope_scaling, proportion=1.0))
    state = load_model(str(tmp_path), dtype=torch.float32, device="cpu").state_dict()
    from ringctx.model.weights import empty_model

    every_pair = empty_model(turning, dtype=torch.float32, device="cpu")
    every_pair.load_state_dict(state)
    every_pair.tie_weights()
    errors["every pair turning"] = rel_err(every_pair.logits(ids), ref)
    assert errors["all"] < 1e-4 and all(err > 1e-3 for what, err in errors.items() if what != "all"), errors


@pytest.mark.parametrize("tp_size", [2])
def test_keys_as_values_split_for_tensor_parallel_ranks(tp_size, tmp_path):
    """Each TP rank copies its own KV heads' k rows into its v rows: its shard equals the same slice
    of the whole model's."""
    random_hf_model("gemma4-keqv-bias").save_pretrained(tmp_path)
    assert_tp_shards_are_slices(tmp_path, tp_size)


GEMMA4_31B = {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376, "intermediate_size": 21504,
              "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
              "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
              "hidden_size_per_layer_input": 0, "sliding_window": 1024, "max_position_embeddings": 262144,
              "final_logit_softcapping": 30.0}
"""A Gemma 4 31B-like text config (written here, not read from a downloaded config.json: no hub):
256-dim heads on the sliding layers, 512 on the full ones; the other numbers are illustrative."""

BASE = {**TEXT, "model_type": "gemma4_text"}


@pytest.mark.parametrize("config,shapes", [
    (GEMMA4_31B, {"full": (4, 512), "sliding": (16, 256)}),
    ({"model_type": "gemma4", "text_config": GEMMA4_31B}, {"full": (4, 512), "sliding": (16, 256)}),
    ({**BASE, "global_head_dim": 32}, {"full": (2, 32), "sliding": (2, 16)}),  # no k_eq_v: KV heads as is
    ({**BASE, "global_head_dim": 32, "num_global_key_value_heads": 1}, {"full": (2, 32), "sliding": (2, 16)}),
    ({**BASE, "per_layer_config": {"5": {"head_dim": 16, "num_key_value_heads": 1}}},
     {"full": (1, 16), "sliding": (2, 16)}),
    ({**BASE, "per_layer_config": {}}, {"full": (2, 16), "sliding": (2, 16)}),
    ({k: v for k, v in BASE.items() if k != "global_head_dim"}, {"full": (2, 512), "sliding": (2, 16)}),
])
def test_full_layers_head_shapes_are_read_as_gemma4_text_config(config, shapes, tmp_path):
    """Each layer's (KV heads, head dim) as Gemma4TextConfig builds its per_layer_config: global_head_dim
    (default 512) on every full layer, num_global_key_value_heads only with attention_k_eq_v, or the
    per_layer_config a saved config.json lists."""
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = read_hf_config(tmp_path)
    text = config.get("text_config", config)
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    want = [(hf.per_layer_config[i].num_key_value_heads, hf.per_layer_config[i].head_dim)
            for i in range(hf.num_hidden_layers)]
    assert ours.kv_shapes == want
    kinds = ["full" if t == "full_attention" else "sliding" for t in hf.layer_types]
    assert want == [shapes[kind] for kind in kinds]


@pytest.mark.parametrize("config,message", [
    ({**BASE, "per_layer_config": {"9": {"head_dim": 32}}}, r"per_layer_config names layer 9 of a model of 6"),
    ({**BASE, "per_layer_config": {"5": {"head_dim": "wide"}}}, r"per_layer_config\[5\].*are counts"),
    ({**BASE, "per_layer_config": {"5": {"num_key_value_heads": 3}}}, r"per_layer_config\[5\]: 3 KV heads.*not a multiple of layer 5's n_kv_heads"),
    ({k: v for k, v in BASE.items() if k != "hidden_size_per_layer_input"},
     r"per-layer embeddings \(hidden_size_per_layer_input=256"),
    ({**BASE, "num_kv_shared_layers": 2}, r"KV sharing across layers \(num_kv_shared_layers=2\)"),
    # experts are read (test_model_gemma4_moe.py); without top_k_experts they are incomplete
    ({**BASE, "enable_moe_block": True, "num_experts": 8}, r"enable_moe_block=true with top_k_experts=None"),
    ({**BASE, "use_bidirectional_attention": "all"}, r"use_bidirectional_attention='all'"),
])
def test_unsupported_gemma4_variants_are_refused_in_one_line(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_proportional_rope_frequencies_equal_transformers():
    """A quarter of the head's frequencies turn (exponents over the whole head_dim), the rest are 0."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.Gemma4TextConfig(**{**TEXT, "head_dim": 64, "global_head_dim": 64})
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf, None, layer_type="full_attention")
    ours = read_hf_config({**BASE, "head_dim": 64, "global_head_dim": 64})
    got = torch.tensor(ours.rope_inv_freq())
    assert got.shape == want.shape and torch.allclose(got.float(), want, rtol=1e-6, atol=0)
    assert int((got > 0).sum()) == 8
