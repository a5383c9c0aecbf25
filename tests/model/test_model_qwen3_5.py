"""Linear-attention hybrids on one device against transformers 5.25 (pinned): Qwen3.5 / 3.6 dense,
their mixture of experts (a gated shared expert), Qwen3-Next (grouped in-projections in its
checkpoints) and the text model of Qwen3.5's image-text checkpoint, as tiny random models saved
with save_pretrained and read back by ringctx's loader.

Each case has Gated DeltaNet layers (3 of every 4, or as layer_types says) between gated
full-attention layers with partial rotary and (1 + w) q/k norms. Float32 logits within 1e-4 of
transformers' (measured ~2e-7), over prompts shorter than one block of the chunked form, across
blocks and at odd lengths; greedy decode (the recurrent form on the cache's states) picks
transformers' generate's tokens."""

import pytest
import torch

from tests.helpers import (assert_greedy_matches, assert_logits_match, one_thread_for_module, random_hf_model_of,
                           saved_hf_pair)

TRANSFORMERS_VERSION = "5.25.0"

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=4096)
EXPERTS = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def hf_config(name: str):
    """transformers' config of case `name` (its own config classes)."""
    import transformers

    if name == "qwen3.5":  # 3 linear + 1 full, twice
        return transformers.Qwen3_5TextConfig(**SMALL, num_hidden_layers=8)
    if name == "qwen3.5-moe":
        return transformers.Qwen3_5MoeTextConfig(**SMALL, **EXPERTS, num_hidden_layers=4)
    if name == "qwen3-next":  # its own layer order: full attention first and last
        return transformers.Qwen3NextConfig(**SMALL, **EXPERTS, num_hidden_layers=5, layer_types=[
            "full_attention", "linear_attention", "linear_attention", "linear_attention", "full_attention"])
    if name == "qwen3.5-vlm":  # the image-text checkpoint: its text model only
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                      num_position_embeddings=16)
        return transformers.Qwen3_5Config(text_config={**SMALL, "num_hidden_layers": 4}, vision_config=vision)
    raise KeyError(name)


def random_hf_model(name: str, seed: int = 0):
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    return random_hf_model_of(hf_config(name), seed)


CASES = ["qwen3.5", "qwen3.5-moe", "qwen3-next", "qwen3.5-vlm"]
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread_for_module()


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    return saved_hf_pair(request.param, random_hf_model, tmp_path_factory)


def test_logits_match_transformers(pair):
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 5, 64, 150)]
    assert_logits_match(pair, prompts, MEASURED)


def test_greedy_decode_matches_transformers(pair):
    assert_greedy_matches(pair, torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(7)), n=6)


def test_config_reads_the_layer_pattern(pair):
    name, ours, _, _ = pair
    config = ours.config
    want = {"qwen3.5": [0, 1, 2, 4, 5, 6], "qwen3.5-moe": [0, 1, 2], "qwen3-next": [1, 2, 3],
            "qwen3.5-vlm": [0, 1, 2]}[name]
    assert config.linear_layers == want
    assert config.attn_output_gate and config.norm_plus_one and config.qk_norm
    assert all(config.attention(i).rotary_dim == 4 for i in config.attention_layers)  # a quarter of 16
    assert all(h == 0 for i, (h, _) in enumerate(config.kv_shapes) if i in want)
    if name in ("qwen3.5-moe", "qwen3-next"):
        experts = config.experts(0)
        assert experts.shared_gate and experts.shared_ffn_dim == 24 and experts.renormalize
