"""Gemma 4 26B-A4B's mixture of experts against transformers 5.25 (Gemma4TextConfig's
enable_moe_block): on every layer the dense GeGLU MLP and 128 experts side by side, each branch
with its own norms (post_feedforward_layernorm_1; pre_ / post_feedforward_layernorm_2), their sum
normed by post_feedforward_layernorm; the router (Gemma4TextRouter) reads the residual, RMS-normed
without a weight, times its scale [dim] and dim**-0.5, softmax, top-k, renormalised, times the
chosen experts' per_expert_scale; the experts are GeGLU too, stored fused ([E, 2F, dim], [E, dim, F]).

References as in test_model_gemma4.py: transformers' own config class, random weights (the router's
scales and every norm around 1, the block scalars too), save_pretrained, loaded by ringctx; float32.
Plus TP shards, a decode row reading only its experts, the preset, and bad input in one line each.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_hf import read_hf_config
from ringctx.model.moe import route
from tests.helpers import (assert_tp_shards_are_slices,
                           assert_greedy_matches, assert_logits_match, one_thread_for_module, rel_err,
                           saved_hf_pair)
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
WINDOW = 8
SHORT, LONG = 20, 70

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0,
            sliding_window=WINDOW, max_position_embeddings=512, final_logit_softcapping=3.0, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, enable_moe_block=True, num_experts=6, top_k_experts=2,
            moe_intermediate_size=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
"""A tiny Gemma 4 26B-A4B: 6 experts of 24 units, top 2, beside a dense MLP of 96 on every layer."""


def hf_config(name: str):
    import transformers

    cases = {
        "gemma4-moe": lambda: transformers.Gemma4TextConfig(**TEXT),
        # the 26B's attention in small: full layers with 32-dim heads and one KV head, keys as
        # values; top 3 of 5 experts, an untied head
        "gemma4-moe-keqv": lambda: transformers.Gemma4TextConfig(
            **{**TEXT, "global_head_dim": 32, "num_experts": 5, "top_k_experts": 3}, attention_k_eq_v=True,
            num_global_key_value_heads=1, tie_word_embeddings=False),
        # as published: the text model of Gemma4ForConditionalGeneration (model.language_model.*)
        "gemma4-moe-vlm": lambda: transformers.Gemma4Config(
            text_config=transformers.Gemma4TextConfig(**TEXT), audio_config=None,
            vision_config=transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, head_dim=16, global_head_dim=16)),
    }
    return cases[name]()


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`: matrices N(0, 0.1); norms, the router's scale and
    per_expert_scale and the block scalars uniform in 0.5..1.5 (1 at init: trained values differ)."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    torch.manual_seed(seed)
    config = hf_config(name)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "text_config") else \
        transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            gain = "norm" in param_name or param_name.endswith(("router.scale", "per_expert_scale"))
            p.copy_(torch.rand_like(p) + 0.5 if gain else torch.randn_like(p) * 0.1)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    return model


CASES = ["gemma4-moe", "gemma4-moe-keqv", "gemma4-moe-vlm"]


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    return saved_hf_pair(request.param, random_hf_model, tmp_path_factory)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The first case alone (tests whose point one case makes: the fused tensors are read alike)."""
    return saved_hf_pair(CASES[0], random_hf_model, tmp_path_factory)


MEASURED: dict[str, float] = {}


def test_logits_match_transformers(pair):
    assert_logits_match(pair, [prompt(SHORT), prompt(LONG)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    """Decode (one row a step, each through its own top-k experts) picks transformers' tokens."""
    assert_greedy_matches(pair, prompt(LONG - 8, seed=2), n=8)


def test_config_is_read_as_written(pair):
    name, ours, hf, _ = pair
    c = ours.config
    text = hf.config.get_text_config()
    for i in range(c.n_layers):
        e = c.experts(i)
        assert (e.n_experts, e.experts_per_token, e.expert_ffn_dim) == (
            text.num_experts, text.top_k_experts, text.moe_intermediate_size)
        assert e.router == "gemma4" and e.beside_dense and e.renormalize and not e.weights_in_model_dtype
    assert c.ffn_dim == text.intermediate_size and c.mlp_activation == "gelu_tanh"
    if name == "gemma4-moe":  # parameters: transformers' plus its block scalars (buffers there)
        assert c.n_params == sum(p.numel() for p in hf.parameters()) + c.n_layers
        unread = c.n_layers * (text.num_experts - text.top_k_experts) * 3 * c.dim * text.moe_intermediate_size
        assert c.active_params == c.n_params - unread


def test_report_measured_errors():
    """Prints the largest logits error of each case (run with -s)."""
    for name, err in MEASURED.items():
        print(f"{name}: logits rel err {err:.2e}")


def test_router_equals_gemma4_text_router(pair):
    """ringctx's router (norm, scales, softmax, top-k, renormalise, per-expert scale) picks the
    experts and weights transformers' Gemma4TextRouter does, for rows of any scale."""
    name, ours, hf, _ = pair
    model = hf.model.language_model if hasattr(hf.model, "language_model") else hf.model
    theirs, moe = model.layers[1].router, ours.layers[1].feed_forward
    x = torch.randn(50, ours.config.dim) * torch.logspace(-2, 2, 50)[:, None]
    with torch.no_grad():
        _, their_weights, their_chosen = theirs(x)
    weights, chosen = route(moe.router_logits(x), moe.experts, moe.per_expert_scale)
    (mine, my_order), (their, their_order) = chosen.sort(-1), their_chosen.sort(-1)  # as sets of experts
    assert torch.equal(mine, their)
    assert torch.allclose(weights.gather(1, my_order), their_weights.gather(1, their_order), rtol=1e-5, atol=0)


def test_a_decode_row_reads_only_its_experts(pair):
    """One row through a layer: the experts it does not choose may hold NaN (never read)."""
    _, ours, _, _ = pair
    block = ours.layers[0]
    moe = block.feed_forward
    x, h = torch.randn(1, ours.config.dim), torch.randn(1, ours.config.dim) * 3
    expected = moe.forward(x, h)
    _, chosen = route(moe.router_logits(h), moe.experts, moe.per_expert_scale)
    w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
    try:
        with torch.no_grad():
            unread = [e for e in range(moe.experts.n_experts) if e not in chosen[0].tolist()]
            moe.w13[unread] = float("nan")
            moe.w2[unread] = float("nan")
        assert torch.equal(moe.forward(x, h), expected)
    finally:
        with torch.no_grad():
            moe.w13.copy_(w13)
            moe.w2.copy_(w2)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tensor_parallel_shards_are_slices_of_the_whole_model(plain, tp_size):
    """Each TP rank reads its share of the dense MLP and of every expert's hidden units out of
    the fused tensors (gate and up rows, down columns); the router and its scales whole.
    init_random's index (`_full_rows`) names the same slices."""
    _, ours, _, directory = plain
    assert_tp_shards_are_slices(directory, tp_size, dict(ours.named_parameters()))


def test_bf16_within_twice_transformers_bf16_error(plain):
    """bf16 by the project's rule: logits at most twice as far from a float64 forward as
    transformers' own bf16 forward."""
    import copy

    _, _, hf, directory = plain
    ids = prompt(60)
    with torch.no_grad():
        exact = copy.deepcopy(hf).double()
        exact.set_experts_implementation("eager")  # grouped_mm takes no float64
        ref = exact(ids[None]).logits[0]
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0]
    ours = load_model(str(directory), dtype=torch.bfloat16, device="cpu").logits(ids)
    assert rel_err(ours, ref) <= 2 * rel_err(theirs, ref), (rel_err(ours, ref), rel_err(theirs, ref))


def test_preset_gemma4_26b():
    """The published shape: 25.2B parameters of which 3.8B reach a token (Google's model card:
    25.2B total, 3.8B active), every layer 128 experts top 8 beside a dense MLP."""
    from ringctx.model.presets import get_preset

    c = get_preset("gemma4-26b")
    assert round(c.n_params / 1e9, 1) == 25.2 and round(c.active_params / 1e9, 1) == 3.8
    assert c.feed_forward_summary() == "30 layers of 128 experts, top 8, beside a dense MLP"
    assert [c.kv_heads_of(i) for i in range(6)] == [8] * 5 + [2] and c.head_dim_of(5) == 512


# ------------------------------------------------------------------------------------------------
# Bad input, one line each


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The plain case's tensors and config, to edit copies of."""
    from safetensors.torch import load_file

    directory = tmp_path_factory.mktemp("gemma4-moe-saved")
    random_hf_model("gemma4-moe").save_pretrained(directory)
    return load_file(directory / "model.safetensors"), json.loads((directory / "config.json").read_text())


def _write(directory, tensors, config):
    from safetensors.torch import save_file

    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _load_error(directory, match):
    with pytest.raises(ValueError, match=match) as info:
        load_model(directory, dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_an_expert_count_the_tensors_disagree_with(saved, tmp_path):
    tensors, config = saved
    _load_error(_write(tmp_path, tensors, {**config, "num_experts": 5}),
                r"tensor 'model\.layers\.\d\.(experts\.\w+|router\.\w+)' has shape \(6.*\), but the model config needs "
                r"\(5.*\)")


def test_a_router_of_another_width(saved, tmp_path):
    tensors, config = saved
    tensors = {**tensors, "model.layers.2.router.proj.weight": torch.zeros(6, 65)}
    _load_error(_write(tmp_path, tensors, config), r"tensor 'model\.layers\.2\.router\.proj\.weight' has shape "
                                                   r"\(6, 65\), but the model config needs \(6, 64\)")


def test_missing_expert_tensors_are_named(saved, tmp_path):
    tensors, config = saved
    tensors = {k: v for k, v in tensors.items() if k not in ("model.layers.1.experts.down_proj",
                                                             "model.layers.3.router.per_expert_scale")}
    _load_error(_write(tmp_path, tensors, config), r"2 weight tensor\(s\) missing: model\.layers\.1\.experts\."
                                                   r"down_proj, model\.layers\.3\.router\.per_expert_scale; the "
                                                   r"checkpoint is")


def test_experts_in_the_file_but_not_in_the_config(saved, tmp_path):
    tensors, config = saved
    _load_error(_write(tmp_path, tensors, {**config, "enable_moe_block": False}),
                r"tensor 'model\.layers\.\d\.experts\.\w+' holds experts of layer \d, but the config gives that layer "
                r"none \(enable_moe_block is not true|unexpected tensor 'model\.layers\.\d\.(router|pre_feedforward)")


@pytest.mark.parametrize("changes,message", [
    ({"top_k_experts": 7}, r"num_experts=6, top_k_experts=7, moe_intermediate_size=24: experts_per_token=7 is more "
                           r"than the layer's n_experts=6"),
    ({"num_experts": None}, r"enable_moe_block=true with num_experts=None \(a positive count"),
    ({"moe_intermediate_size": 0}, r"enable_moe_block=true with moe_intermediate_size=0 \(a positive count"),
])
def test_bad_expert_configs_in_one_line(saved, changes, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**saved[1], **changes}))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_fingerprints_and_round_trip():
    """The new Experts fields leave the other mixtures' fingerprints as they were stored (the
    field at its default is left out); a Gemma 4 MoE config round-trips through its dict and
    differs from the dense one; experts beside a dense MLP outside Gemma's block are refused."""
    import dataclasses

    from ringctx.model.config import Experts, ModelConfig
    from ringctx.model.presets import get_preset

    assert get_preset("qwen3-30b-a3b").fingerprint() == "0c6b47c3ec5e5971"  # as before Gemma 4's experts
    assert get_preset("mixtral-8x7b").fingerprint() == "9d22ecba2ec035ca"
    c = get_preset("gemma4-26b")
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.fingerprint() != dataclasses.replace(c, layer_experts=()).fingerprint()
    with pytest.raises(ValueError, match=r"experts beside the dense MLP \(Gemma 4's\) are computed in Gemma's block"):
        ModelConfig(name="x", vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8,
                    layer_experts=(Experts(4, 2, 8, router="gemma4", beside_dense=True),))
