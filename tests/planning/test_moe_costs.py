"""Mixtures of experts in the planner: memory holds every expert, time follows the experts a token
reaches (experts_per_token of them per sparse layer), and a decode step reads only those."""

import dataclasses

import pytest
import torch

from ringctx.model.config import Experts
from ringctx.model.presets import get_preset
from ringctx.planning.machine_speed import decode_bytes_per_token
from ringctx.planning.memory import weight_bytes_per_rank
from ringctx.planning.strategy import linear_flops, linear_params_per_layer


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)])
def test_presets_have_their_published_parameter_counts(name, total, active):
    """The model cards' counts: every parameter, and the ones one token goes through."""
    config = get_preset(name)
    assert abs(config.n_params / total - 1) < 0.01 and abs(config.active_params / active - 1) < 0.02
    assert all(e is not None for e in config.layer_experts)  # both: every layer sparse


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_memory_counts_every_expert_and_time_the_active_ones(name):
    config = get_preset(name)
    for tp in (1, 2, 4):
        assert weight_bytes_per_rank(config, tp, "bfloat16") == -(-config.n_params * 2 // tp)
    attention = sum(config.dim * (config.n_heads + 2 * h) * d + config.n_heads * d * config.dim
                    for h, d in config.kv_shapes)
    experts = config.experts(0)
    per_token = experts.n_experts * config.dim + experts.experts_per_token * 3 * config.dim * experts.expert_ffn_dim
    assert linear_params_per_layer(config) == (attention + config.n_layers * per_token) // config.n_layers
    every_expert = (attention + sum(config.ffn_params(i) for i in range(config.n_layers))) // config.n_layers
    assert linear_flops(1000, config, 1) == 2 * 1000 * linear_params_per_layer(config) < 2 * 1000 * every_expert / 3


def test_mixed_dense_and_sparse_layers_average_their_costs():
    """Qwen3-MoE's dense layers (mlp_only_layers) cost their MLP, the sparse ones their k experts."""
    base = get_preset("qwen3-30b-a3b")
    experts = base.experts(0)
    mixed = dataclasses.replace(base, layer_experts=tuple(None if i % 2 else experts for i in range(base.n_layers)))
    dense = 3 * base.dim * base.ffn_dim
    ffn = [dense if i % 2 else experts.params(base.dim, active=True) for i in range(base.n_layers)]
    attention = linear_params_per_layer(dataclasses.replace(base, layer_experts=())) - dense
    assert linear_params_per_layer(mixed) == attention + sum(ffn) // base.n_layers
    assert mixed.n_params == base.n_params - base.n_layers // 2 * (experts.params(base.dim) - dense)


def test_feed_forward_summary():
    assert get_preset("qwen3-30b-a3b").feed_forward_summary() == "48 layers of 128 experts, top 8"
    base = get_preset("mixtral-8x7b")
    mixed = dataclasses.replace(base, layer_experts=(None,) * 16 + base.layer_experts[16:])
    assert mixed.feed_forward_summary() == "16 dense + 16 layers of 8 experts, top 2"


def test_a_decode_step_reads_the_router_and_its_experts_only():
    from ringctx.model.weights import empty_model

    config = dataclasses.replace(get_preset("tiny"), layer_experts=(None, Experts(8, 2, 32)))
    model = empty_model(config, dtype=torch.float32, device="meta")
    every = sum(p.numel() for p in model.parameters()) * 4 - config.vocab_size * config.dim * 4  # one embedding row
    unread = 6 * 3 * config.dim * 32 * 4  # 6 of the 8 experts' gate, up and down
    assert decode_bytes_per_token(model, 0) == every - unread
