"""Model families and RoPE variants against transformers: Qwen3, Mistral with a wide head_dim,
Llama with yarn / linear / dynamic RoPE, from safetensors directories and GGUF files.

Every reference is built with transformers' own config class, given random weights, saved with
`save_pretrained` and loaded by ringctx from that directory. The scaled-RoPE configs have a small
original context (32 positions), so prompts past it are cheap. float32 on the CPU throughout.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest
import torch

from ringctx.model.config import ModelConfig, RopeScaling
from ringctx.model.config_hf import read_hf_config
from ringctx.model import load_model
from tests.helpers import one_thread_for_module, random_hf_model_of, rel_err
from tests.model.test_model_gguf import gguf_weights_from_hf, write_gguf

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

ORIGINAL = 32
"""Original context of the scaled-RoPE configs: INSIDE tokens stay within it, PAST go beyond."""
INSIDE, PAST = 20, 90

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def rope(rope_type: str, **params) -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **params}}


def hf_config(name: str):
    """The transformers config of case `name`."""
    import transformers

    yarn = dict(factor=4.0, original_max_position_embeddings=ORIGINAL)
    cases = {
        # Qwen3: q/k norms, YaRN (its 128K recipe, scaled down), tied embeddings.
        "qwen3-yarn-tied": lambda: transformers.Qwen3Config(
            **SHAPE, head_dim=32, max_position_embeddings=4 * ORIGINAL, tie_word_embeddings=True,
            **rope("yarn", **yarn)),
        # Qwen3 with attention_bias (q, k, v and o biases), head_dim != hidden / heads, plain RoPE.
        "qwen3-bias": lambda: transformers.Qwen3Config(
            **{**SHAPE, "hidden_size": 48}, head_dim=32, attention_bias=True, max_position_embeddings=512,
            tie_word_embeddings=False),
        # Llama with YaRN's mscale / mscale_all_dim attention factor and beta_fast.
        "llama-yarn-mscale": lambda: transformers.LlamaConfig(
            **SHAPE, max_position_embeddings=8 * ORIGINAL, **rope(
                "yarn", factor=8.0, original_max_position_embeddings=ORIGINAL, beta_fast=16.0, mscale=0.8,
                mscale_all_dim=0.5)),
        "llama-linear": lambda: transformers.LlamaConfig(
            **SHAPE, max_position_embeddings=512, **rope("linear", factor=2.0)),
        # dynamic NTK: plain RoPE up to max_position_embeddings; ringctx refuses past it (below).
        "llama-dynamic": lambda: transformers.LlamaConfig(
            **SHAPE, max_position_embeddings=PAST, **rope("dynamic", factor=2.0)),
        # Mistral-Nemo style: head_dim 32 with hidden 64 and 4 heads (not 16), no sliding window.
        "mistral-head-dim": lambda: transformers.MistralConfig(
            **SHAPE, head_dim=32, sliding_window=None, max_position_embeddings=512, tie_word_embeddings=False),
    }
    return cases[name]()


CASES = ["qwen3-yarn-tied", "qwen3-bias", "llama-yarn-mscale", "llama-linear", "llama-dynamic", "mistral-head-dim"]


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`, every parameter random (biases and norms too)."""
    return random_hf_model_of(hf_config(name), seed)


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(case name, ringctx model, transformers model, directory) with the same weights."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = random_hf_model(request.param)
    hf.save_pretrained(directory)
    return request.param, load_model(str(directory), dtype=torch.float32, device="cpu"), hf, directory


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_is_read_as_written(pair):
    name, ours, hf, _ = pair
    c = ours.config
    assert (c.head_dim, c.n_heads, c.n_kv_heads, c.dim) == (hf.config.head_dim, 4, 2, hf.config.hidden_size)
    assert c.qk_norm == name.startswith("qwen3")
    assert c.tie_embeddings == hf.config.tie_word_embeddings
    assert c.qkv_bias == c.attn_out_bias == (name == "qwen3-bias")
    kind = hf.config.rope_parameters.get("rope_type", "default")
    assert (c.rope_scaling.rope_type if c.rope_scaling else "default") == kind


def test_rope_angles_equal_transformers_inside_and_past_the_original_context(pair):
    """cos/sin at global positions (as a ring rank past the original context computes them),
    against transformers' rotary embedding for the same positions; and different from plain
    RoPE wherever the config scales it (so the logits checks below cannot pass vacuously)."""
    name, ours, hf, _ = pair
    last = PAST if name != "llama-dynamic" else hf.config.max_position_embeddings
    positions = torch.arange(last)
    x = torch.zeros(1, last, ours.config.head_dim)
    with torch.no_grad():
        ref_cos, ref_sin = (t[0] for t in hf.model.rotary_emb(x, positions[None]))
    got = ours.rope(positions)
    half = ours.config.head_dim // 2
    # transformers computes the angles in float32 (ringctx in float64): ~1e-6 apart at these positions
    assert rel_err(got.cos[:, 0], ref_cos) < 1e-5 and rel_err(got.sin[:, 0, half:], ref_sin[:, half:]) < 1e-5
    plain = torch.outer(positions.double(), torch.tensor(
        dataclasses.replace(ours.config, rope_scaling=None).rope_inv_freq(), dtype=torch.float64)).cos()
    scaled_here = ours.config.rope_scaling is not None and name != "llama-dynamic"
    assert ((got.cos[:, 0, :half].double() - plain).abs().max() > 1e-3) == scaled_here


def test_logits_match_transformers_inside_and_past_the_original_context(pair):
    name, ours, hf, _ = pair
    lengths = (INSIDE, hf.config.max_position_embeddings) if name == "llama-dynamic" else (INSIDE, PAST)
    for n in lengths:
        ids = prompt(n)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        assert rel_err(ours.logits(ids), ref) < 1e-4, (name, n)


def test_greedy_tokens_equal_transformers(pair):
    """ringctx's decode loop (the fused CPU step where the kernels are built) picks the same tokens."""
    name, ours, hf, _ = pair
    ids = prompt(INSIDE if name == "llama-dynamic" else PAST - 8, seed=2)
    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.numel():].tolist()
    assert ours.generate(ids, max_new_tokens=6, stop_token_ids=[]).token_ids == ref, name


def test_dynamic_rope_past_its_context_is_refused_not_approximated(pair):
    name, ours, hf, _ = pair
    if name != "llama-dynamic":
        assert ours.config.rope_scaling is None or ours.config.rope_scaling.position_limit is None
        return
    with pytest.raises(ValueError, match=rf"{PAST + 1} tokens go past position {PAST}, where rope_type 'dynamic'"):
        ours.logits(prompt(PAST + 1))


# ------------------------------------------------------------------------------------------------
# GGUF files written from the same weights


def _yarn_keys(writer: gguf.GGUFWriter) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(ORIGINAL)


def _linear_keys(writer: gguf.GGUFWriter) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)


@pytest.mark.parametrize("name,arch,keys", [("qwen3-yarn-tied", "qwen3", _yarn_keys),
                                            ("llama-linear", "llama", _linear_keys)])
def test_gguf_logits_match_transformers(name, arch, keys, tmp_path):
    """Qwen3 (q/k norm tensors, Hugging Face row order) and Llama (llama.cpp's permuted Q/K rows)
    with their RoPE scaling in the rope.scaling.* keys; past the original context."""
    hf = random_hf_model(name)
    hf.save_pretrained(tmp_path)
    config = read_hf_config(tmp_path)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(path, config, arch=arch, weights=gguf_weights_from_hf(hf, config), add_keys=keys)
    ours = load_model(path, device="cpu")
    assert dataclasses.replace(ours.config, name="x", bos_token_id=None, eos_token_ids=(), max_seq_len=0) == \
        dataclasses.replace(config, name="x", bos_token_id=None, eos_token_ids=(), max_seq_len=0)
    ids = prompt(PAST)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(ours.logits(ids), ref) < 1e-4, name


# ------------------------------------------------------------------------------------------------
# Refusals: one line naming the config key and value


BASE = {"model_type": "llama", **SHAPE}


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral", "sliding_window": 0}, r"sliding_window=0 \(a positive window\)"),
    ({"model_type": "ministral", "layer_types": ["full_attention", "linear_attention"]},
     r"layer_types entry 'linear_attention'"),
    ({"model_type": "ministral", "layer_types": ["full_attention"]}, r"layer_types lists 1 layers"),
    ({"model_type": "ministral", "layer_types": ["chunked_attention", "full_attention"]},
     r"attention_chunk_size=None \(a positive size\)"),
    ({"model_type": "qwen2_moe", "num_experts": 8}, r"unsupported architecture model_type='qwen2_moe'"),
    ({"num_experts": 8}, r"mixture-of-experts layers \(num_experts=8\)"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     r"rope_type='longrope'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"yarn.*without original_max_position_embeddings"),
])
def test_unsupported_features_are_refused_in_one_line(change, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_old_configs_keep_their_fingerprint():
    """KV files and documents store ModelConfig.to_dict(): one saved before RopeScaling had a
    rope_type still loads, as llama3, with the same fingerprint."""
    old = {"name": "m", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
           "head_dim": 16, "rope_theta": 500000.0, "norm_eps": 1e-5, "qkv_bias": False, "attn_out_bias": False,
           "tie_embeddings": False, "max_seq_len": 8192, "bos_token_id": None, "eos_token_ids": [],
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position": 8192}}
    config = ModelConfig.from_dict(old)
    assert config.rope_scaling == RopeScaling() and config.rope_scaling.rope_type == "llama3"
    # the hash of the dict as stored before (only the name and max_seq_len are left out)
    import hashlib

    before = {k: v for k, v in old.items() if k not in ("name", "max_seq_len")}
    assert config.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert dataclasses.replace(config, qk_norm=True).fingerprint() != config.fingerprint()
