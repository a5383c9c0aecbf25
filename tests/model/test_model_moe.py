"""Mixtures of experts against transformers 5.25: Mixtral (every layer sparse, weights always
renormalised; with and without a sliding window) and Qwen3-MoE (norm_topk_prob true and false,
dense and sparse layers mixed by mlp_only_layers and decoder_sparse_step, attention biases).

As in test_model_families_long.py, every reference is transformers' own model built from its config
class, given random weights, saved with `save_pretrained` (per-expert safetensors) and loaded by
ringctx from that directory; float32 on the CPU. Plus the router's ties, a decode step reading only
its experts, the parameter counts, tensor-parallel shards, and bad input in one line each.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config import Experts, ModelConfig
from ringctx.model.config_hf import read_hf_config
from ringctx.model.moe import route
from tests.helpers import (assert_tp_shards_are_slices,
                           assert_greedy_matches, assert_logits_match, one_thread_for_module,
                           random_hf_model_of, rel_err, saved_hf_pair)
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
"""The oracle (transformers 4.x rounded the routing weights differently: FAMILIES.md's traps)."""

WINDOW = 8
SHORT, LONG = 20, 70

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=512)


def hf_config(name: str):
    """The transformers config of case `name`."""
    import transformers

    cases = {
        # Mixtral: 4 experts of 32 units, top 2 on every layer, head_dim != hidden / heads.
        "mixtral": lambda: transformers.MixtralConfig(**SHAPE, head_dim=32, intermediate_size=32,
                                                      num_local_experts=4, num_experts_per_tok=2),
        # ... top 3 of 6, with Mistral's window on every layer, tied embeddings.
        "mixtral-window": lambda: transformers.MixtralConfig(**SHAPE, intermediate_size=24, num_local_experts=6,
                                                             num_experts_per_tok=3, sliding_window=WINDOW,
                                                             tie_word_embeddings=True),
        # Qwen3-MoE as released (norm_topk_prob true), layer 1 dense (mlp_only_layers) of 3.
        "qwen3-moe-norm": lambda: transformers.Qwen3MoeConfig(
            **{**SHAPE, "num_hidden_layers": 3}, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
        # The config class's default (norm_topk_prob false), every 2nd layer sparse (1 and 3 of 4), biases.
        "qwen3-moe-step": lambda: transformers.Qwen3MoeConfig(
            **{**SHAPE, "num_hidden_layers": 4}, head_dim=16, intermediate_size=80, moe_intermediate_size=24,
            num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, attention_bias=True),
    }
    return cases[name]()


SPARSE = {"mixtral": [0, 1], "mixtral-window": [0, 1], "qwen3-moe-norm": [0, 2], "qwen3-moe-step": [1, 3]}
"""The layers with experts in each case (transformers' decoder layers decide the same: checked below)."""


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`, every parameter random (norms around 1)."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    return random_hf_model_of(hf_config(name), seed)


CASES = list(SPARSE)


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(case name, ringctx model, transformers model, directory) with the same weights."""
    return saved_hf_pair(request.param, random_hf_model, tmp_path_factory)


MEASURED: dict[str, float] = {}
"""The largest logits rel err per case (printed at the end with -s: the report's numbers)."""


def test_logits_match_transformers(pair):
    assert_logits_match(pair, [prompt(SHORT), prompt(LONG)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    """ringctx's decode loop (one row a step: each step through its own top-k experts) picks the
    same tokens as transformers' generate."""
    assert_greedy_matches(pair, prompt(LONG - 8, seed=2), n=8)


def test_config_is_read_as_written(pair):
    name, ours, hf, _ = pair
    c = ours.config
    text = hf.config
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == SPARSE[name] == [i for i in range(c.n_layers) if c.experts(i) is not None]
    mixtral = name.startswith("mixtral")
    for i in sparse:
        e = c.experts(i)
        assert (e.n_experts, e.experts_per_token) == (text.num_local_experts, text.num_experts_per_tok)
        assert e.expert_ffn_dim == (text.intermediate_size if mixtral else text.moe_intermediate_size)
        assert e.renormalize == (True if mixtral else text.norm_topk_prob)
        assert e.weights_in_model_dtype == (not mixtral)
    assert c.ffn_dim == text.intermediate_size and c.qk_norm == (not mixtral)
    assert [a.window for a in c.layer_attention] == ([WINDOW] * 2 if name == "mixtral-window" else [])
    assert c.n_params == sum(p.numel() for p in hf.parameters())  # a tied head counted once by both


def test_bf16_within_twice_transformers_bf16_error(pair):
    """bf16 by the project's rule: logits at most twice as far from a float64 forward (transformers'
    eager experts in float64) as transformers' own bf16 forward (its default grouped_mm experts)."""
    import copy

    name, _, hf, directory = pair
    ids = prompt(60)
    with torch.no_grad():
        exact = copy.deepcopy(hf).double()
        exact.set_experts_implementation("eager")  # grouped_mm takes no float64
        ref = exact(ids[None]).logits[0]
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0]
    ours = load_model(str(directory), dtype=torch.bfloat16, device="cpu").logits(ids)
    assert rel_err(ours, ref) <= 2 * rel_err(theirs, ref), (name, rel_err(ours, ref), rel_err(theirs, ref))


def test_active_parameters_count_the_experts_a_token_reaches(pair):
    name, ours, hf, _ = pair
    c = ours.config
    unread = sum((e.n_experts - e.experts_per_token) * 3 * c.dim * e.expert_ffn_dim
                 for e in c.layer_experts if e is not None)
    assert c.active_params == c.n_params - unread < c.n_params


def test_report_measured_errors():
    """Prints the largest logits error of each case (run with -s)."""
    for name, err in MEASURED.items():
        print(f"{name}: logits rel err {err:.2e}")


# ------------------------------------------------------------------------------------------------
# The router and the grouping


def test_ties_go_to_the_lower_expert_whatever_the_batch():
    """Equal probabilities: the lower expert index is kept (torch.topk, which transformers calls,
    does not say; on this CPU it kept experts 1 and 3 of four equal ones), alone and in a batch."""
    experts = Experts(n_experts=5, experts_per_token=2, expert_ffn_dim=8)
    tied = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.0],      # four equal: experts 0 and 1
                         [0.0, 2.0, 1.0, 2.0, 1.0],      # 1 and 3 tie on top
                         [1.0, 3.0, 2.0, 2.0, 2.0]])     # the best, then three equal: 1 and 2
    weights, chosen = route(tied, experts)
    assert chosen.tolist() == [[0, 1], [1, 3], [1, 2]]
    assert torch.allclose(weights.sum(-1), torch.ones(3)) and weights.dtype == torch.float32
    for row in range(3):
        alone_w, alone_c = route(tied[row:row + 1], experts)
        assert torch.equal(alone_c, chosen[row:row + 1]) and torch.equal(alone_w, weights[row:row + 1])
    kept, _ = route(tied, Experts(n_experts=5, experts_per_token=2, expert_ffn_dim=8, renormalize=False))
    assert torch.allclose(kept, torch.softmax(tied, -1).sort(-1, descending=True).values[:, :2])


def test_tied_experts_equal_transformers(tmp_path):
    """Experts 1 and 2 of every sparse layer made identical (router rows and weights): every token
    ties between them, and whichever transformers' topk keeps, the logits are the same."""
    hf = random_hf_model("mixtral-window")
    with torch.no_grad():
        for layer in hf.model.layers:
            moe = layer.mlp
            moe.gate.weight[2] = moe.gate.weight[1]
            moe.experts.gate_up_proj[2] = moe.experts.gate_up_proj[1]
            moe.experts.down_proj[2] = moe.experts.down_proj[1]
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert_logits_match(("tied", ours, hf, tmp_path), [prompt(SHORT), prompt(LONG)])


def test_a_decode_row_reads_only_its_experts(pair):
    """One row through a sparse layer: the experts it does not choose may hold NaN (never read)."""
    name, ours, _, _ = pair
    layer = SPARSE[name][0]
    moe = ours.layers[layer].feed_forward
    x = torch.randn(1, ours.config.dim) * 3
    expected = moe.forward(x)
    _, chosen = route(x @ moe.router.weight.T, moe.experts)
    w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
    try:
        with torch.no_grad():
            unread = [e for e in range(moe.experts.n_experts) if e not in chosen[0].tolist()]
            moe.w13[unread] = float("nan")
            moe.w2[unread] = float("nan")
        assert torch.equal(moe.forward(x), expected)
    finally:
        with torch.no_grad():
            moe.w13.copy_(w13)
            moe.w2.copy_(w2)


def test_no_rows(pair):
    """A rank holding no tokens (a short prompt over many ranks) runs the block on 0 rows."""
    name, ours, _, _ = pair
    moe = ours.layers[SPARSE[name][0]].feed_forward
    assert moe.forward(torch.empty(0, ours.config.dim)).shape == (0, ours.config.dim)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tensor_parallel_shards_are_slices_of_the_whole_model(pair, tp_size):
    """Each TP rank reads its share of every expert's hidden units (w13 gate and up rows, w2
    columns), the router whole; init_random's index (`_full_rows`) names the same slices."""
    name, ours, _, directory = pair
    assert_tp_shards_are_slices(directory, tp_size, dict(ours.named_parameters()), (name,))


def test_random_weights_under_tensor_parallelism_are_slices_of_the_whole_model(pair):
    """init_random (presets' weights) draws each TP rank's share of every expert: the same values
    as the whole model's slices (each expert's gate and up rows, its down columns)."""
    from ringctx.model.tensor_parallel import TensorParallel
    from ringctx.model.weights import empty_model, init_random

    c = pair[1].config
    whole = empty_model(c, dtype=torch.float32, device="cpu")
    init_random(whole)
    expected = dict(whole.named_parameters())
    for rank in range(2):
        shard = empty_model(c, dtype=torch.float32, device="cpu", tp=TensorParallel(2, rank))
        init_random(shard)
        for layer in range(c.n_layers):
            if c.experts(layer) is None:
                continue
            width = c.experts(layer).expert_ffn_dim
            a, b = rank * width // 2, (rank + 1) * width // 2
            w13, w2 = (f"layers.{layer}.feed_forward.{w}" for w in ("w13", "w2"))
            params = dict(shard.named_parameters())
            gate, up = expected[w13][:, a:b], expected[w13][:, width + a:width + b]
            assert torch.equal(params[w13], torch.cat([gate, up], 1))
            assert torch.equal(params[w2], expected[w2][:, :, a:b])


def test_fused_expert_tensors_load_as_the_per_expert_ones(pair, tmp_path):
    """save_pretrained(save_original_format=False) writes transformers' in-memory layout
    (mlp.gate.weight, mlp.experts.gate_up_proj [E, 2F, dim], mlp.experts.down_proj [E, dim, F]):
    the same parameters, whole and as TP 2 shards."""
    from ringctx.model.tensor_parallel import TensorParallel

    name, ours, hf, directory = pair
    hf.save_pretrained(tmp_path, save_original_format=False)
    for tp in (TensorParallel(), TensorParallel(2, 1)):
        per_expert = load_model(str(directory), dtype=torch.float32, device="cpu", tp=tp)
        fused = dict(load_model(str(tmp_path), dtype=torch.float32, device="cpu", tp=tp).named_parameters())
        for param_name, param in per_expert.named_parameters():
            assert torch.equal(fused[param_name], param), (name, tp.rank, param_name)


# ------------------------------------------------------------------------------------------------
# Bad input


def _saved_mixtral(tmp_path):
    random_hf_model("mixtral").save_pretrained(tmp_path)
    return tmp_path


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_fewer_experts_in_the_config_than_in_the_weights(tmp_path):
    directory = _saved_mixtral(tmp_path)
    _edit_config(directory, num_local_experts=3)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d\.block_sparse_moe\.experts\.3\.w\d\.weight' is "
                                         r"expert 3 of layer \d, but the config's layer \d has 3 experts \(0\.\.2\); "
                                         r"the expert count .* does not match the weights") as info:
        load_model(str(directory), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_more_experts_in_the_config_than_in_the_weights(tmp_path):
    """The router is 5 wide in the config, 4 in the file: named with both shapes (or, read first,
    the tensors of expert 4 named as missing)."""
    directory = _saved_mixtral(tmp_path)
    _edit_config(directory, num_local_experts=5)
    with pytest.raises(ValueError, match=r"block_sparse_moe\.gate\.weight' has shape \(4, 64\), but the model config "
                                         r"needs \(5, 64\)|missing: .*experts\.4\.") as info:
        load_model(str(directory), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_fused_expert_tensors_of_another_count(tmp_path):
    random_hf_model("mixtral").save_pretrained(tmp_path, save_original_format=False)
    _edit_config(tmp_path, num_local_experts=5)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d\.mlp\.(experts\.\w+|gate\.weight)' has shape "
                                         r"\(4, .*\), but the model config needs \(5, .*\) \(experts, their width, "
                                         r"the model width\); the weights do not match the config") as info:
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_a_router_of_another_width_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _saved_mixtral(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = torch.zeros(5, 64)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' has shape "
                                         r"\(5, 64\), but the model config needs \(4, 64\); the weights do not match"):
        load_model(str(directory), dtype=torch.float32, device="cpu")


def test_missing_expert_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _saved_mixtral(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 weight tensor\(s\) missing: model\.layers\.1\.block_sparse_moe\.experts\.2"
                                         r"\.w3\.weight; the checkpoint is incomplete") as info:
        load_model(str(directory), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_a_dense_layer_given_experts_in_the_weights(tmp_path):
    """qwen3_moe whose config makes layer 1 dense while the file has its experts."""
    random_hf_model("qwen3-moe-step").save_pretrained(tmp_path)
    _edit_config(tmp_path, decoder_sparse_step=4)  # only layer 3 sparse now
    with pytest.raises(ValueError, match=r"is expert \d of layer 1, but the config's layer 1 has a dense MLP"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


MOE = {**{k: v for k, v in SHAPE.items() if k != "max_position_embeddings"}, "intermediate_size": 96}


@pytest.mark.parametrize("config,message", [
    ({**MOE, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
     r"num_local_experts=2, num_experts_per_tok=3, intermediate_size=96: experts_per_token=3 is more than the "
     r"layer's n_experts=2"),
    ({**MOE, "model_type": "qwen3_moe", "num_experts": 4, "decoder_sparse_step": 0},
     r"decoder_sparse_step=0 \(a positive layer count: every n-th layer is sparse\)"),
    ({**MOE, "model_type": "qwen3_moe", "num_experts": 4, "mlp_only_layers": [5]},
     r"mlp_only_layers=\[5\] names layers outside 0\.\.1"),
    ({**MOE, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": -1},
     r"moe_intermediate_size=-1 \(a count of experts or units\)"),
    ({**MOE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 0},
     r"experts_per_token=0 must be a positive count"),
    ({**MOE, "model_type": "mixtral", "hidden_act": "gelu"}, r"hidden_act='gelu' \(only silu\)"),
    # the other mixtures of experts stay refused
    ({**MOE, "model_type": "qwen2_moe", "num_experts": 32},
     r"model_type='qwen2_moe' \(a mixture of experts: num_experts=32, not supported yet"),
    ({**MOE, "model_type": "qwen3", "num_experts": 8}, r"mixture-of-experts layers \(num_experts=8\) is not supported"),
])
def test_bad_expert_configs_in_one_line(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_expert_aliases_and_all_dense():
    """num_experts (Qwen3MoeConfig's name) and num_local_experts (what it saves) read alike; no
    experts at all is a dense model whose fingerprint is the same dense Qwen3's (fingerprints of
    configs without experts are unchanged)."""
    base = {**MOE, "model_type": "qwen3_moe", "moe_intermediate_size": 16, "num_experts_per_tok": 2}
    a = read_hf_config({**base, "num_experts": 4})
    b = read_hf_config({**base, "num_local_experts": 4})
    assert a == b and a.experts(0).n_experts == 4
    dense = read_hf_config({**base, "num_experts": 0})
    assert dense.layer_experts == () and not dense.has_experts
    assert dense.fingerprint() == read_hf_config({**MOE, "model_type": "qwen3"}).fingerprint()


def test_config_round_trip_and_refusals():
    c = read_hf_config({**MOE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                        "mlp_only_layers": [0]})
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.fingerprint() != read_hf_config({**MOE, "model_type": "qwen3_moe", "num_experts": 0}).fingerprint()
    from ringctx.model.int8_weights import check_int8_model

    assert "mixture-of-experts" in check_int8_model(c)
    with pytest.raises(ValueError, match="layer_experts describes 1 layers but the model has n_layers=2"):
        ModelConfig(name="x", vocab_size=8, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=8,
                    layer_experts=(Experts(4, 2, 8),))
    with pytest.raises(ValueError, match="shared_ffn_dim=-1 must be a count of units"):
        Experts(4, 2, 8, shared_ffn_dim=-1)
