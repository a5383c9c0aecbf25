"""The dense long-context families against transformers 5.25: Seed-OSS, Mistral-Small 3.x /
Magistral (mistral3's text model), Phi-3 / Phi-4-mini (fused tensors, LongRoPE, partial rotary),
Gemma 3 (gemma3_text and gemma3's text model).

As in test_model_families.py, every reference is built with transformers' own config class, given
random weights (norms and biases too), saved with `save_pretrained` and loaded by ringctx from that
directory; float32 on the CPU. Sliding windows and LongRoPE's original length are small (8 to 32
positions) so that the prompts run past them cheaply.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_hf import read_hf_config
from tests.helpers import (assert_tp_shards_are_slices,
                           assert_greedy_matches, assert_logits_match, one_thread_for_module, rel_err,
                           saved_hf_pair)
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
"""The oracle these tests were written against (5.x saves image-text models under model.language_model.)."""

WINDOW = 8
"""Sliding window of the windowed cases."""
ORIGINAL = 32
"""LongRoPE's original context: SHORT prompts stay within it, LONG ones go past it."""
SHORT, LONG = 20, 70

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


PIXTRAL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
               image_size=32, patch_size=8)
"""A tiny vision tower: ringctx ignores it, transformers needs one to build the model."""


GEMMA = dict(**{**SHAPE, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
             final_logit_softcapping=1.0, max_position_embeddings=512)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


def _phi3_rope(head_dim: int, partial: float = 1.0) -> dict:
    half = int(head_dim * partial) // 2
    gen = torch.Generator().manual_seed(3)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": (1.0 + torch.rand(half, generator=gen)).tolist(),
            "long_factor": (1.0 + 8 * torch.rand(half, generator=gen)).tolist()}


def hf_config(name: str):
    """The transformers config of case `name`."""
    import transformers

    cases = {
        # Seed-OSS: q/k/v biases, o bias off (its default) and on, head_dim != hidden / heads.
        "seed-oss": lambda: transformers.SeedOssConfig(**SHAPE, head_dim=32, max_position_embeddings=512),
        "seed-oss-out-bias": lambda: transformers.SeedOssConfig(
            **SHAPE, head_dim=16, attention_out_bias=True, max_position_embeddings=512, tie_word_embeddings=True),
        # Mistral-Small 3.x / Magistral: Mistral3ForConditionalGeneration around a Mistral text model
        # (head_dim 128 of hidden 5120 / 32 heads there; here 32 of 64 / 4), its lm_head untied...
        "mistral3": lambda: transformers.Mistral3Config(
            text_config=transformers.MistralConfig(**SHAPE, head_dim=32, sliding_window=None,
                                                   max_position_embeddings=512, tie_word_embeddings=False),
            vision_config=transformers.PixtralVisionConfig(**PIXTRAL), image_token_index=255,
            tie_word_embeddings=False),
        # ... or tied by the wrapper's tie_word_embeddings (Mistral3Config's default), with a window.
        "mistral3-tied-window": lambda: transformers.Mistral3Config(
            text_config=transformers.MistralConfig(**SHAPE, sliding_window=WINDOW, max_position_embeddings=512),
            vision_config=transformers.PixtralVisionConfig(**PIXTRAL), image_token_index=255),
        # Phi-3/3.5-mini-128k: fused qkv_proj and gate_up_proj, LongRoPE over a short original context
        # (factor and attention_factor from max_position_embeddings / original_max_position_embeddings).
        "phi3-longrope": lambda: transformers.Phi3Config(
            **SHAPE, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters=_phi3_rope(16)),
        # Phi-4-mini: partial rotary (0.75 of each head rotates), LongRoPE; plus Phi-3-mini-4k's window.
        "phi4-partial-window": lambda: transformers.Phi3Config(
            **SHAPE, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters=_phi3_rope(16, 0.75), sliding_window=WINDOW, tie_word_embeddings=True),
        # Gemma 3 1B (gemma3_text): sliding layers with their own RoPE base, full ones with linear x8
        # over 1e6, query_pre_attn_scalar != head_dim, a final logit soft-cap (the released configs
        # have none; a small one here so that tanh bends).
        "gemma3-text": lambda: transformers.Gemma3TextConfig(**GEMMA),
        # Gemma 3 4B-27B (gemma3): the same text model inside Gemma3ForConditionalGeneration.
        "gemma3-vlm": lambda: transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**{**GEMMA, "final_logit_softcapping": None}),
            vision_config=transformers.SiglipVisionConfig(**SIGLIP), mm_tokens_per_image=4, image_token_index=255,
            boi_token_index=253, eoi_token_index=254),
    }
    return cases[name]()


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`, every parameter random (biases and norms too)."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    torch.manual_seed(seed)
    config = hf_config(name)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "text_config") else \
        transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:  # Gemma's (1 + w) norms get w around 0 the same way: (1 + w) in 0.5..1.5
                p.copy_(torch.rand_like(p) - 0.5 if "gemma" in name else torch.rand_like(p) + 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    return model


CASES = ["seed-oss", "seed-oss-out-bias", "mistral3", "mistral3-tied-window", "phi3-longrope", "phi4-partial-window",
         "gemma3-text", "gemma3-vlm"]


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(case name, ringctx model, transformers model, directory) with the same weights."""
    return saved_hf_pair(request.param, random_hf_model, tmp_path_factory)



MEASURED: dict[str, float] = {}
"""The largest logits rel err per case (printed at the end with -s: the report's numbers)."""


def test_logits_match_transformers(pair):
    assert_logits_match(pair, [prompt(SHORT), prompt(LONG)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    """ringctx's decode loop picks the same tokens as transformers' generate."""
    assert_greedy_matches(pair, prompt(LONG - 8, seed=2))


def test_config_is_read_as_written(pair):
    name, ours, hf, directory = pair
    c = ours.config
    text = hf.config.get_text_config()
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
        text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads, text.vocab_size)
    n_hf = sum(p.numel() for n, p in hf.named_parameters() if "vision" not in n and "multi_modal" not in n)
    assert c.n_params == n_hf, (name, c.n_params, n_hf)
    if name.startswith("seed-oss"):
        assert c.qkv_bias and c.attn_out_bias == text.attention_out_bias and c.is_llama_block
    if name.startswith("phi"):
        scaling = c.rope_scaling
        assert scaling.rope_type == "longrope" and scaling.original_max_position == ORIGINAL
        rope = text.rope_parameters
        assert scaling.short_factor == tuple(rope["short_factor"]) and scaling.long_factor == tuple(rope["long_factor"])
        assert scaling.factor == 4.0 and abs(scaling.attention_factor - (1 + math.log(4) / math.log(ORIGINAL)) ** 0.5) < 1e-12
        rotary = [layer.rotary_dim for layer in c.layer_attention]
        assert rotary == ([12, 12] if "partial" in name else [])
    if name.startswith("gemma3"):
        assert (c.norm_plus_one, c.post_norms, c.mlp_activation, c.qk_norm) == (True, True, "gelu_tanh", True)
        assert c.embed_scale == 64 ** 0.5 and c.final_softcap == (1.0 if name == "gemma3-text" else 0.0)
        assert c.tie_embeddings and not c.is_llama_block
        assert c.rope_theta == 1e6 and c.rope_scaling.rope_type == "linear" and c.rope_scaling.factor == 8.0
        sliding = c.attention(0)
        assert (sliding.window, sliding.rope_theta, sliding.rope_scaling, sliding.scale) == (WINDOW, 1e4, None, 24 ** -0.5)
        assert (c.attention(2).window, c.attention(2).rope_theta, c.attention(2).scale) == (0, 0.0, 24 ** -0.5)
    if name.startswith("mistral3"):
        assert c.tie_embeddings == hf.config.tie_word_embeddings and c.is_llama_block
        assert [layer.window for layer in c.layer_attention] == ([WINDOW] * 2 if "window" in name else [])


def test_report_measured_errors():
    """Prints the largest logits error of each case (run with -s)."""
    for name, err in MEASURED.items():
        print(f"{name}: logits rel err {err:.2e}")


# ------------------------------------------------------------------------------------------------
# LongRoPE's choice of factors


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-partial-window"])
def test_longrope_switches_at_the_original_length_like_transformers(name, tmp_path):
    """The short factors up to ORIGINAL tokens, the long ones past it (for every position of the
    call); angles equal transformers' rotary embedding either way. With sequence_end, the first
    chunk of a long prompt rotates as the whole prompt does (what the prefill engine passes)."""
    hf = random_hf_model(name)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    rotary = ours.config.attention(0).rotary_dim or ours.config.head_dim
    for n in (ORIGINAL, ORIGINAL + 1, LONG):
        positions = torch.arange(n)
        with torch.no_grad():
            ref_cos, ref_sin = (t[0] for t in hf.model.rotary_emb(torch.zeros(1, n, 16), positions[None]))
        got = ours.rope(positions).for_layer(0)
        assert got.cos.shape[-1] == rotary
        assert rel_err(got.cos[:, 0], ref_cos) < 1e-5 and rel_err(got.sin[:, 0, rotary // 2:], ref_sin[:, rotary // 2:]) < 1e-5
    whole = ours.rope(torch.arange(LONG)).for_layer(0)
    first = ours.rope(torch.arange(10), sequence_end=LONG).for_layer(0)
    alone = ours.rope(torch.arange(10)).for_layer(0)
    assert torch.equal(first.cos, whole.cos[:10]) and torch.equal(first.sin, whole.sin[:10])
    assert not torch.allclose(alone.cos, whole.cos[:10])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_phi3_fused_tensors_split_for_tensor_parallel_ranks(tp_size, tmp_path):
    """Each TP rank reads its heads' rows of qkv_proj and its hidden units' rows of gate_up_proj:
    every parameter of its shard equals the same slice of the whole model's."""
    random_hf_model("phi3-longrope").save_pretrained(tmp_path)
    assert_tp_shards_are_slices(tmp_path, tp_size)


def test_longrope_decode_across_the_original_length_keeps_the_short_keys(tmp_path):
    """A prompt inside the original context whose answer runs past it: each decode step rotates its
    token with the factors of its own end, over the keys already cached, as transformers' forward
    calls over a cache do (logits of every step within 1e-4). transformers' generate differs from
    both at the crossing: Phi3ForCausalLM.prepare_inputs_for_generation drops the cache there and
    prefills again with the long factors (ringctx's decode does not: see RopeScaling)."""
    hf = random_hf_model("phi3-longrope")
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    ids = prompt(ORIGINAL - 3, seed=4)
    steps = []
    head = ours.head
    ours.head = lambda x: steps.append(head(x)[-1]) or steps[-1][None]
    tokens = ours.generate(ids, max_new_tokens=8, stop_token_ids=[]).token_ids
    assert len(steps) >= 8
    with torch.no_grad():
        out = hf(input_ids=ids[None], use_cache=True)
        cache = out.past_key_values
        for i, token in enumerate(tokens):
            assert rel_err(steps[i], out.logits[0, -1]) < 1e-4, i
            assert int(out.logits[0, -1].argmax()) == token
            out = hf(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)


# ------------------------------------------------------------------------------------------------
# Config spellings and refusals


def test_gemma3_older_config_spelling_reads_as_the_newer():
    """Configs saved before transformers 5 (the released Gemma 3 ones) spell the two RoPEs as
    rope_theta + rope_scaling (full layers) and rope_local_base_freq (sliding layers, unscaled),
    and the layer kinds as sliding_window_pattern: the same ModelConfig as the nested spelling."""
    common = {**SHAPE, "model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 512,
              "query_pre_attn_scalar": 32, "max_position_embeddings": 131072}
    old = read_hf_config({**common, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6})
    new = read_hf_config({**common, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                 "rope_theta": 1_000_000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}})
    assert old == new
    assert [layer.window for layer in new.layer_attention] == [512] * 5 + [0]
    assert new.attention(0).scale == 0.0  # query_pre_attn_scalar == head_dim: the default scale


def test_mistral3_as_published_keeps_its_lm_head():
    """Mistral-Small 3.1's config.json has tie_word_embeddings neither at the top nor in text_config
    (and its checkpoint carries language_model.lm_head.weight): untied, Mistral's default."""
    config = read_hf_config({"model_type": "mistral3", "text_config": {**SHAPE, "model_type": "mistral",
                                                                         "head_dim": 32, "sliding_window": None}})
    assert not config.tie_embeddings and config.has_plain_attention


GEMMA_BASE = {**SHAPE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8}


@pytest.mark.parametrize("config,message", [
    ({**SHAPE, "model_type": "gemma4_text"}, r"per-layer embeddings \(hidden_size_per_layer_input=256"),
    ({"model_type": "gemma4", "text_config": {**SHAPE, "model_type": "gemma4_text", "hidden_size_per_layer_input": 0,
                                              "num_kv_shared_layers": 2}},
     r"KV sharing across layers \(num_kv_shared_layers=2\)"),
    ({"model_type": "gemma3n", "text_config": {"model_type": "gemma3n_text"}}, r"Gemma 3n"),
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3n_text"}}, r"Gemma 3n"),
    ({"model_type": "mistral3", "text_config": {**SHAPE, "model_type": "ministral3"}},
     r"llama_4_scaling_beta scales each query"),
    ({"model_type": "mistral3", "text_config": {**SHAPE, "model_type": "mistral",
                                                "rope_parameters": {"llama_4_scaling_beta": 0.1}}},
     r"llama_4_scaling_beta=0.1"),
    ({"model_type": "mistral3", "vision_config": {}}, r"text_config.model_type=None"),
    ({**GEMMA_BASE, "attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0"),
    ({**GEMMA_BASE, "use_bidirectional_attention": True}, r"use_bidirectional_attention=true"),
    ({**GEMMA_BASE, "hidden_activation": "gelu"}, r"hidden_activation='gelu'"),
    ({**SHAPE, "model_type": "phi3", "partial_rotary_factor": 0.1}, r"partial_rotary_factor=0.1 \(rotates 1 of 16"),
    ({**SHAPE, "model_type": "seed_oss", "mlp_bias": True}, r"mlp_bias=true"),
    ({**SHAPE, "model_type": "llama", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                          "long_factor": [2.0] * 8}}, r"rope_type='longrope' on"),
])
def test_unsupported_variants_are_refused_in_one_line(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


# ------------------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("name,billions", [("gemma3-27b", 27.0), ("mistral-small-24b", 23.6), ("phi3-mini-128k", 3.82),
                                           ("seed-oss-36b", 36.2), ("qwen2.5-14b-instruct-1m", 14.8)])
def test_long_context_presets_have_the_published_sizes_and_plan(name, billions):
    """Parameter counts as published (text models of the image-text ones), within rounding; `plan` takes them."""
    from ringctx.model.presets import get_preset
    from ringctx.planning.prefill_plan import plan_prefill

    config = get_preset(name)
    assert abs(config.n_params / 1e9 - billions) < 0.05, config.n_params
    assert plan_prefill(config, 4, "h100-rdma", tokens=131072, chunk_tokens=32768) is not None
    on_meta = load_model(name, device="meta")
    assert sum(p.numel() for p in on_meta.parameters()) == config.n_params


def test_new_config_fields_round_trip_and_enter_the_fingerprint_only_when_set():
    """KV files store ModelConfig.to_dict() as JSON: the Gemma block fields and LongRoPE's factor
    lists come back equal (lists as tuples), and a Llama config's fingerprint is what it was."""
    from ringctx.model.presets import get_preset

    for name in ("gemma3-27b", "phi3-mini-128k"):
        config = get_preset(name)
        again = type(config).from_dict(json.loads(json.dumps(config.to_dict())))
        assert again == config and again.fingerprint() == config.fingerprint()
    llama = get_preset("llama3.1-8b")
    # (test_model_families.py's test_old_configs_keep_their_fingerprint pins a stored hash)
    import dataclasses

    for change in (dict(norm_plus_one=True), dict(post_norms=True), dict(mlp_activation="gelu_tanh"),
                   dict(embed_scale=2.0), dict(final_softcap=30.0)):
        assert dataclasses.replace(llama, **change).fingerprint() != llama.fingerprint(), change
