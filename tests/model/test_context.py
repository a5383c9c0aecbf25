"""The trained context (ModelConfig.trained_context), the one guard over it (model/context.py:
context_problem, ContextGuard) and `--rope-scaling` (parse_rope_scaling, stretch_config), with a
stretched tiny Llama checked against transformers' YaRN on the same weights."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config import RopeScaling
from ringctx.model.config_hf import read_hf_config
from ringctx.model.context import (ContextGuard, ContextTooLong, LongContextWarning, context_problem,
                                   parse_rope_scaling, stretch_config)
from ringctx.model.presets import get_preset
from tests.helpers import rel_err
from tests.model.test_model_families import ORIGINAL, PAST, SHAPE, one_thread, prompt, rope  # noqa: F401

TINY = get_preset("tiny")  # plain RoPE, max_seq_len 4,096


def hf_dict(max_position: int, **rope_parameters) -> dict:
    return {"model_type": "llama", **SHAPE, "max_position_embeddings": max_position,
            "rope_parameters": {"rope_theta": 10000.0, **rope_parameters}}


def test_the_trained_context_per_rope_type():
    assert TINY.trained_context == 4096
    assert get_preset("llama3.1-8b").trained_context == 131072  # llama3: as stated (factor 8 over 8,192 is not it)
    # yarn as transformers writes it (max_position_embeddings = the post-YaRN length) and as model cards
    # tell users to add it (max_position_embeddings left at the original): 4 x 32,768 both ways
    for stated in (131072, 32768):
        cfg = read_hf_config(hf_dict(stated, rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))
        assert cfg.trained_context == 131072, stated
    # linear without an original states the scaled length (Gemma 3: x8, 131,072); with one, original x factor
    assert read_hf_config(hf_dict(2048, rope_type="linear", factor=4.0)).trained_context == 2048
    assert read_hf_config(hf_dict(2048, rope_type="linear", factor=4.0,
                                  original_max_position_embeddings=1024)).trained_context == 4096
    assert get_preset("gemma3-27b").trained_context == 131072
    assert get_preset("phi3-mini-128k").trained_context == 131072  # longrope: as stated
    # dynamic: as stated; ringctx computes no position past it
    assert read_hf_config(hf_dict(4096, rope_type="dynamic", factor=2.0)).trained_context == 4096


def test_the_policy_under_at_and_past_the_limit():
    assert context_problem(TINY, 4095) is None and context_problem(TINY, 4096) is None
    problem = context_problem(TINY, 4097)
    assert problem is not None and "\n" not in problem
    for words in ("4,097 tokens", "4,096 tokens", "tiny", "--rope-scaling yarn:2", "--allow-long-context",
                  "longer-context model"):
        assert words in problem, words


def test_the_policy_counts_cached_and_new_tokens_and_max_new_tokens():
    assert context_problem(TINY, 96, cached_tokens=4000) is None
    problem = context_problem(TINY, 97, cached_tokens=4000)
    assert "4,097 tokens (4,000 cached + 97 new)" in problem
    problem = context_problem(TINY, 10, cached_tokens=4000, max_new_tokens=256)
    assert "(4,000 cached + 10 new + 256 to generate)" in problem and "fewer new tokens" in problem
    assert context_problem(TINY, 10, cached_tokens=4000, max_new_tokens=86) is None


def test_a_stretched_or_scaled_model_has_the_longer_limit():
    stretched = stretch_config(TINY, "yarn:4")
    assert context_problem(stretched, 16384) is None and context_problem(stretched, 16385) is not None
    problem = context_problem(get_preset("llama3.1-8b"), 140000)
    assert "131,072" in problem and "without RoPE scaling of its own" in problem  # no second scaling proposed


def test_the_guard_refuses_or_warns_once():
    with pytest.raises(ContextTooLong, match="4,097 tokens") as caught:
        ContextGuard(TINY).check(97, cached_tokens=4000)
    assert isinstance(caught.value, ValueError) and (caught.value.total, caught.value.limit) == (4097, 4096)
    guard = ContextGuard(TINY, allow=True)
    with pytest.warns(LongContextWarning, match="--allow-long-context"):
        guard.check(5000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check(6000)  # once only
        ContextGuard(TINY).check(4096)


@pytest.mark.parametrize("spec, says", [
    ("yarn:0", "must be a number above 1"), ("yarn:1", "must be a number above 1"),
    ("yarn:-2", "must be a number above 1"), ("yarn:abc", "must be a number above 1"),
    ("yarn:inf", "must be a number above 1"), ("foo:2", "unknown type 'foo'"), ("yarn:", "yarn needs a factor"),
    ("linear", "linear needs a factor")])
def test_bad_rope_scaling_values_are_one_line(spec, says):
    with pytest.raises(ValueError, match=says) as caught:
        parse_rope_scaling(spec)
    assert "\n" not in str(caught.value) and repr(spec) in str(caught.value)


def test_rope_scaling_values():
    assert parse_rope_scaling(None) is None and parse_rope_scaling("none") is None and parse_rope_scaling("") is None
    assert parse_rope_scaling("yarn:4") == ("yarn", 4.0) and parse_rope_scaling("LINEAR:2.5") == ("linear", 2.5)
    assert stretch_config(TINY, "none") is TINY


def test_stretching_changes_the_trained_context_the_scaling_and_the_fingerprint():
    yarn = stretch_config(TINY, "yarn:4")
    assert yarn.trained_context == yarn.max_seq_len == 16384
    assert yarn.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0, original_max_position=4096,
                                            attention_factor=pytest.approx(0.1 * torch.tensor(4.0).log().item() + 1))
    linear = stretch_config(TINY, "linear:2")
    assert linear.trained_context == 8192 and linear.rope_scaling.rope_type == "linear"
    assert len({TINY.fingerprint(), yarn.fingerprint(), linear.fingerprint()}) == 3  # saved documents tell them apart
    with pytest.raises(ValueError, match="already scales its RoPE .llama3, factor 8: trained context 131,072"):
        stretch_config(get_preset("llama3.1-8b"), "yarn:2")


def test_yarn_4_at_load_equals_transformers_yarn_on_the_same_weights(tmp_path):
    """A plain tiny Llama (max_position_embeddings 32) loaded with rope_scaling="yarn:4" is the same
    model as transformers' Llama with rope_parameters yarn, factor 4 over 32 (and 128 positions)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=4 * ORIGINAL,
                                      **rope("yarn", factor=4.0, original_max_position_embeddings=ORIGINAL))
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05)
    yarn_dir, plain_dir = tmp_path / "yarn", tmp_path / "plain"
    hf.save_pretrained(yarn_dir)
    hf.save_pretrained(plain_dir)
    d = json.loads((plain_dir / "config.json").read_text())  # the same checkpoint without its scaling
    d.pop("rope_scaling", None)
    d.update(max_position_embeddings=ORIGINAL, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    (plain_dir / "config.json").write_text(json.dumps(d))

    plain = load_model(str(plain_dir), dtype=torch.float32, device="cpu")
    ours = load_model(str(plain_dir), dtype=torch.float32, device="cpu", rope_scaling="yarn:4")
    assert plain.config.rope_scaling is None and plain.config.trained_context == ORIGINAL
    assert ours.config.trained_context == 4 * ORIGINAL
    assert dataclasses.replace(ours.config, name="x") == dataclasses.replace(read_hf_config(yarn_dir), name="x")
    ids = prompt(PAST)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(ours.logits(ids), ref) < 1e-4
    assert rel_err(plain.logits(ids), ref) > 1e-3  # the stretch is what makes them equal
