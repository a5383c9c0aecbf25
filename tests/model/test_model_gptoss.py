"""gpt-oss against transformers 5.25's GptOssForCausalLM: alternating sliding / full layers, a
learned sink logit per head, YaRN (truncate false, as the checkpoints), attention biases on q/k/v
and o, and on every layer a mixture of experts with a biased router (top-k of the logits, then a
softmax over those k) and biased experts with the clamped SwiGLU (gate and up interleaved in the
checkpoint). The swiglu_limit is lowered so that random weights reach the clamps.

As tests/model/test_model_moe.py: the reference is transformers' own model from its config class,
random weights (sinks and biases non-zero), saved with save_pretrained and read by ringctx's loader;
float32 on the CPU. Plus routing ties, tensor-parallel shards, the MXFP4 expert layout of openai's
checkpoints (blocks and scales written here by `quantize_mxfp4`, read back against transformers'
own dequantizer) and bf16.
"""

from __future__ import annotations

import copy
import json

import gguf
import numpy as np
import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config import Experts
from ringctx.model.config_hf import read_hf_config
from ringctx.model.moe import route
from ringctx.model.weights_gptoss import dequantize_mxfp4, quantize_mxfp4
from tests.helpers import (assert_tp_shards_are_slices,
                           assert_greedy_matches, assert_logits_match, hf_logits, one_thread_for_module,
                           random_hf_model_of, rel_err, saved_hf_pair)
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
"""The oracle (FAMILIES.md: transformers 4.x rounded routing weights differently)."""

WINDOW = 8
LIMIT = 0.3
"""swiglu_limit of the tiny model (7.0 in the checkpoints): random weights give gate / up values of
about +-0.4, so a good share of them is clamped (`test_the_clamps_are_reached`)."""


def hf_config(layers: int = 4):
    """GptOssConfig of the tiny model: 64 wide, 4 heads of 16 (2 KV heads), layers alternating
    sliding 8 / full (the config class's own default pattern), 4 experts of 32 units, top 2, YaRN
    x4 over 64 positions."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    return transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, swiglu_limit=LIMIT, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})


def random_hf_model(name: str = "gpt-oss", seed: int = 0):
    """transformers' tiny gpt-oss, every parameter random; sinks of std 1 (large enough to take a
    visible share of each softmax row)."""
    model = random_hf_model_of(hf_config(), seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """("gpt-oss", ringctx model, transformers model, directory) with the same weights."""
    return saved_hf_pair("gpt-oss", random_hf_model, tmp_path_factory)


MEASURED: dict[str, float] = {}
"""The largest errors measured (printed with -s: the report's numbers)."""


def test_logits_match_transformers(pair):
    """Prompts shorter and much longer than the window (70 > 8)."""
    assert_logits_match(pair, [prompt(20), prompt(70)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    assert_greedy_matches(pair, prompt(40, seed=2), n=8)


def test_config_is_read_as_written(pair):
    _, ours, hf, _ = pair
    c, text = ours.config, hf.config
    assert [a.window for a in c.layer_attention] == [WINDOW, 0, WINDOW, 0]
    assert all(a.sinks for a in c.layer_attention)
    assert c.qkv_bias and c.attn_out_bias and c.head_dim == 16
    assert c.rope_scaling.rope_type == "yarn" and not c.rope_scaling.truncate and c.rope_theta == 150000.0
    for i in range(c.n_layers):
        e = c.experts(i)
        assert (e.n_experts, e.experts_per_token, e.expert_ffn_dim) == (4, 2, 32)
        assert (e.router, e.router_bias, e.bias, e.activation) == ("topk-softmax", True, True, "clamped-swiglu")
        assert (e.swiglu_alpha, e.swiglu_limit) == (text.swiglu_alpha, LIMIT) and e.weights_in_model_dtype
    assert c.n_params == sum(p.numel() for p in hf.parameters())  # sinks and every bias counted


def test_the_clamps_are_reached(pair):
    """The tiny model's gate and up values cross swiglu_limit (so the clamps are tested)."""
    _, ours, _, _ = pair
    moe, x = ours.layers[0].feed_forward, torch.randn(50, ours.config.dim)
    gate_up = x @ moe.w13[0].T + moe.b13[0]
    assert (gate_up.abs() > LIMIT).float().mean() > 0.2


def test_defaults_of_a_config_that_leaves_them_out():
    """GptOssConfig's defaults: alternating layers from a sliding one, yarn x32 over 4096 with
    truncate false, theta 150000, 128 experts top 4; openai's config.json spells its YaRN as
    rope_scaling (transformers 4)."""
    c = read_hf_config({"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32})
    assert [a.window for a in c.layer_attention] == [128, 0, 128, 0] and c.head_dim == 64
    s = c.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position, s.truncate) == ("yarn", 32.0, 4096, False)
    assert c.rope_theta == 150000.0 and c.experts(0).n_experts == 128 and c.experts(0).experts_per_token == 4
    openai = read_hf_config({"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
                             "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                                                    "beta_fast": 32.0, "beta_slow": 1.0,
                                                                    "truncate": False,
                                                                    "original_max_position_embeddings": 4096},
                             "quantization_config": {"quant_method": "mxfp4"}})
    assert openai.rope_scaling == s


def test_fingerprints_of_other_mixtures_keep_their_value():
    """The Experts fields gpt-oss added are left out of fingerprints at their defaults."""
    from ringctx.model.config import ModelConfig

    c = ModelConfig("m", 256, 64, 2, 4, 2, 96, layer_experts=(Experts(4, 2, 32),) * 2)
    assert c.fingerprint() == "b7d56295e2f25b0e"  # main's value before these fields


def test_bf16_within_twice_transformers_bf16_error(pair):
    """bf16 by the project's rule (test_model_moe.py's): ringctx's bf16 logits at most twice as far
    from a float64 forward as transformers' own bf16 forward; and within 3e-2 of it (measured on
    this prompt: 7.0e-3; transformers' bf16 forward 1.9e-1 from the same reference)."""
    _, _, hf, directory = pair
    ids = prompt(60)
    with torch.no_grad():
        exact = copy.deepcopy(hf).double()
        exact.set_experts_implementation("eager")  # grouped_mm takes no float64
        ref = exact(ids[None]).logits[0]
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0]
    ours = load_model(str(directory), dtype=torch.bfloat16, device="cpu").logits(ids)
    MEASURED["bf16 ours vs float64"], MEASURED["bf16 transformers vs float64"] = rel_err(ours, ref), rel_err(theirs, ref)
    assert rel_err(ours, ref) <= 2 * rel_err(theirs, ref), (rel_err(ours, ref), rel_err(theirs, ref))
    assert rel_err(ours, ref) < 3e-2


# ------------------------------------------------------------------------------------------------
# The router


def test_topk_softmax_ties_go_to_the_lower_expert():
    """Equal logits: the lower expert index is kept, alone and in a batch; the k weights are a
    softmax over the k kept logits only."""
    experts = Experts(n_experts=5, experts_per_token=2, expert_ffn_dim=8, router="topk-softmax", renormalize=False)
    tied = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.0],
                         [0.0, 2.0, 1.0, 2.0, 1.0],
                         [1.0, 3.0, 2.0, 2.0, 2.0]])
    weights, chosen = route(tied, experts)
    assert chosen.tolist() == [[0, 1], [1, 3], [1, 2]]
    kept = tied.gather(1, chosen)
    assert torch.equal(weights, torch.softmax(kept, -1)) and weights.dtype == torch.float32
    for row in range(3):
        alone_w, alone_c = route(tied[row:row + 1], experts)
        assert torch.equal(alone_c, chosen[row:row + 1]) and torch.equal(alone_w, weights[row:row + 1])


def test_tied_experts_equal_transformers(tmp_path):
    """Experts 1 and 2 of every layer made identical (router rows and biases, weights, biases):
    every token ties between them, and whichever transformers' topk keeps, the logits agree."""
    hf = random_hf_model()
    with torch.no_grad():
        for layer in hf.model.layers:
            router, experts = layer.mlp.router, layer.mlp.experts
            for p in (router.weight, router.bias, experts.gate_up_proj, experts.gate_up_proj_bias,
                      experts.down_proj, experts.down_proj_bias):
                p[2] = p[1]
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert_logits_match(("tied", ours, hf, tmp_path), [prompt(30)])


# ------------------------------------------------------------------------------------------------
# Tensor parallelism


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tensor_parallel_shards_are_slices_of_the_whole_model(pair, tp_size):
    """Each TP rank holds its share of every expert's hidden units (w13 rows and their biases b13,
    w2 columns), its query heads' sinks, the router and the down biases whole; init_random's index
    (`_full_rows`) names the same slices."""
    _, ours, _, directory = pair
    assert_tp_shards_are_slices(directory, tp_size, dict(ours.named_parameters()))


def test_tensor_parallel_partial_outputs_sum_to_the_whole_layer(pair):
    """The experts' partial outputs of TP 2 (the down bias added by rank 0 only) sum to the whole
    layer's output (each rank's all-reduce left out: `reducer` returns its input)."""
    from ringctx.model.tensor_parallel import TensorParallel

    _, ours, _, directory = pair
    x = torch.randn(33, ours.config.dim)
    whole = ours.layers[1].feed_forward.forward(x)
    partial = [load_model(str(directory), dtype=torch.float32, device="cpu",
                          tp=TensorParallel(2, rank, reducer=lambda t: 0)).layers[1].feed_forward.forward(x)
               for rank in range(2)]
    assert rel_err(partial[0] + partial[1], whole) < 1e-5
    assert rel_err(partial[0], whole) > 1e-2  # neither half alone


# ------------------------------------------------------------------------------------------------
# MXFP4: openai's checkpoint layout


def mxfp4_of(values: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 (blocks [..., G, 16], scales [..., G]) of the shape of values [..., G * 32]:
    random codes, scales 2^-6..2^-3 (weights of the size of the model's)."""
    g = torch.Generator().manual_seed(seed)
    *lead, width = values.shape
    scales = torch.randint(121, 125, (*lead, width // 32), generator=g, dtype=torch.uint8)
    blocks = torch.randint(0, 256, (*lead, width // 32, 16), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_equals_transformers_and_quantize_inverts_it():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = mxfp4_of(torch.empty(3, 10, 64), seed=5)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G * 32, R]: transposed
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), ours.to(torch.bfloat16))
    assert torch.equal(quantize_mxfp4(ours, scales), blocks)


def write_mxfp4_checkpoint(hf, directory, broken: str = "", split: bool = False) -> None:
    """hf (its experts' weights replaced by MXFP4 values first) saved with openai's layout: the
    experts' gate_up_proj / down_proj as *_blocks and *_scales ([E, rows, cols / 32, 16] and
    [E, rows, cols / 32], rows = the output units: 2F interleaved, or D), the rest as
    save_pretrained writes it. broken: "size" writes one layer's blocks a group short, "scales"
    leaves one layer's scales out; split: the scales in a second file of a sharded checkpoint
    (with its index), apart from their blocks."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)  # [E, in, out]
                blocks, scales = mxfp4_of(param.transpose(1, 2), seed=10 * i + len(proj))
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                quantized[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    hf.save_pretrained(directory)
    tensors, scale_tensors = load_file(f"{directory}/model.safetensors"), {}
    for stem, (blocks, scales) in quantized.items():
        del tensors[stem]
        if broken == "size" and stem.startswith("model.layers.1.") and stem.endswith("down_proj"):
            blocks, scales = blocks[:, :, 1:], scales[:, :, 1:]
        tensors[stem + "_blocks"] = blocks
        if not (broken == "scales" and stem.startswith("model.layers.2.") and stem.endswith("gate_up_proj")):
            (scale_tensors if split else tensors)[stem + "_scales"] = scales
    if split:
        import os

        os.remove(f"{directory}/model.safetensors")
        files = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": scale_tensors}
        for file, part in files.items():
            save_file(part, f"{directory}/{file}")
        with open(f"{directory}/model.safetensors.index.json", "w") as f:
            json.dump({"weight_map": {name: file for file, part in files.items() for name in part}}, f)
    else:
        save_file(tensors, f"{directory}/model.safetensors")
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    with open(f"{directory}/config.json", "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "scales-in-another-shard"])
def test_mxfp4_experts_load_dequantized(tmp_path, split):
    """An MXFP4 checkpoint's experts dequantized at load: the logits of transformers' model holding
    the same dequantized values, whole and as a TP 2 shard's parameters; blocks and scales in one
    file or in two shards."""
    from ringctx.model.tensor_parallel import TensorParallel

    hf = random_hf_model(seed=3)
    write_mxfp4_checkpoint(hf, tmp_path, split=split)
    ours = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    ids = prompt(40)
    err = rel_err(ours.logits(ids), hf_logits(hf, ids))
    MEASURED["mxfp4 logits"] = err
    assert err < 1e-4
    shard = load_model(str(tmp_path), dtype=torch.float32, device="cpu", tp=TensorParallel(2, 1))
    F = 16  # rank 1's half of each expert's 32 units
    assert torch.equal(shard.layers[0].feed_forward.w13[:, :F], ours.layers[0].feed_forward.w13[:, F:2 * F])
    assert torch.equal(shard.layers[0].feed_forward.w2, ours.layers[0].feed_forward.w2[:, :, F:])


@pytest.mark.parametrize("broken,message", [
    ("size", r"MXFP4 blocks of the wrong size: model\.layers\.1\.mlp\.experts\.down_proj_blocks \(4, 64, 0, 16\)"),
    ("scales", r"model\.layers\.2\.mlp\.experts\.gate_up_proj_blocks has no gate_up_proj_scales"),
])
def test_bad_mxfp4_experts_in_one_line(tmp_path, broken, message):
    write_mxfp4_checkpoint(random_hf_model(), tmp_path, broken=broken)
    with pytest.raises(ValueError, match=message) as info:
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_report_measured_errors():
    """Prints the errors measured above (run with -s)."""
    for name, err in MEASURED.items():
        print(f"gpt-oss {name}: rel err {err:.2e}")


# ------------------------------------------------------------------------------------------------
# Presets and the planner


@pytest.mark.parametrize("name,total,active,layers,experts", [("gpt-oss-20b", 20.91e9, 4.19e9, 24, 32),
                                                                ("gpt-oss-120b", 116.83e9, 5.71e9, 36, 128)])
def test_presets_have_the_published_shapes(name, total, active, layers, experts):
    """The model card's totals; active: the card's 3.61B / 5.13B plus the 0.58B embedding table it
    leaves out."""
    from ringctx.model.presets import get_preset

    c = get_preset(name)
    assert abs(c.n_params - total) < 0.005e9 and abs(c.active_params - active) < 0.005e9
    assert c.attention_summary() == f"{layers // 2} window 128, sinks + {layers // 2} full, sinks"
    assert c.feed_forward_summary() == f"{layers} layers of {experts} experts, top 4"
    assert c.trained_context == 131072 and c.rope_scaling.attention_factor == pytest.approx(1 + 0.1 * 3.4657359)


def test_plan_of_gpt_oss_120b_at_its_whole_context():
    """`ringctx plan --model gpt-oss-120b --tokens 131072` on one H100 host: fits, the sliding
    layers' KV counted as their windows (half the rows kept)."""
    from click.testing import CliRunner

    from ringctx.cli import main

    result = CliRunner().invoke(main, ["plan", "--model", "gpt-oss-120b", "--tokens", "131072",
                                       "--hardware", "h100-rdma", "--hosts", "1", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output[result.output.index("{"):])
    assert plan["fits"] is True


# ------------------------------------------------------------------------------------------------
# GGUF: llama.cpp's gpt-oss files


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """hf's tensors as llama.cpp's converter (GptOssModel) writes them: gate_up_proj transposed and
    split into ffn_gate_exps (even units) and ffn_up_exps (odd), down_proj transposed, the FFN's
    norm as post_attention_norm, sinks as attn_sinks.weight."""
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
             **{f"self_attn.{p}_proj.{k}": f"attn_{'output' if p == 'o' else p}.{k}"
                for p in "qkvo" for k in ("weight", "bias")}}
    out = {}
    for name, value in hf.state_dict().items():
        w = value.float().numpy()
        if not name.startswith("model.layers."):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w
            continue
        i, rest = name.split(".", 3)[2:]
        blk = f"blk.{i}"
        if rest == "mlp.experts.gate_up_proj":
            w = w.transpose(0, 2, 1)
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = w[:, 0::2], w[:, 1::2]
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"{blk}.ffn_gate_exps.bias"], out[f"{blk}.ffn_up_exps.bias"] = w[:, 0::2], w[:, 1::2]
        elif rest == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = w.transpose(0, 2, 1)
        else:
            out[f"{blk}.{names[rest]}"] = w
    return out


def write_gguf(path, hf, experts=gguf.GGMLQuantizationType.F32) -> None:
    """hf as a gpt-oss GGUF file: llama.cpp's header keys (the shared writer's, plus the experts and
    YaRN GptOssModel.set_gguf_parameters adds, and the tiny model's lowered swiglu limit), its expert
    matrices of type `experts`."""
    from tests.model.test_model_gguf_families import add_keys

    c = hf.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    add_keys(writer, hf, "gpt-oss")
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    if c.swiglu_limit != 7.0:  # llama.cpp's converter writes none: gpt-oss's 7.0 is the reader's default
        writer.add_swiglu_clamp_exp([c.swiglu_limit] * c.num_hidden_layers)
    for name, w in gguf_tensors(hf).items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if "_exps.weight" in name and experts != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(w, experts)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=experts)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_equals_the_hf_directory(pair, tmp_path):
    """A gpt-oss GGUF file of the same weights: the same config (fingerprint) and parameters, whole
    and as a TP 2 shard, hence transformers' logits."""
    from ringctx.model.tensor_parallel import TensorParallel

    _, ours, hf, directory = pair
    write_gguf(tmp_path / "gpt-oss.gguf", hf)
    from_gguf = load_model(str(tmp_path / "gpt-oss.gguf"), dtype=torch.float32, device="cpu")
    assert from_gguf.config.fingerprint() == ours.config.fingerprint()
    whole = dict(ours.named_parameters())
    for name, param in from_gguf.named_parameters():
        assert torch.equal(param, whole[name]), name
    shard = load_model(str(tmp_path / "gpt-oss.gguf"), dtype=torch.float32, device="cpu", tp=TensorParallel(2, 1))
    expected = load_model(str(directory), dtype=torch.float32, device="cpu", tp=TensorParallel(2, 1))
    for name, param in shard.named_parameters():
        assert torch.equal(param, dict(expected.named_parameters())[name]), name
    assert_logits_match(("gguf", from_gguf, hf, tmp_path), [prompt(30)])


def test_gguf_mxfp4_experts_are_dequantized(pair, tmp_path):
    """Expert matrices stored as GGUF MXFP4 (the gguf package's type and dequantizer): read back as
    the gguf package dequantizes them."""
    _, ours, hf, _ = pair
    write_gguf(tmp_path / "mxfp4.gguf", hf, experts=gguf.GGMLQuantizationType.MXFP4)
    model = load_model(str(tmp_path / "mxfp4.gguf"), dtype=torch.float32, device="cpu")
    up = gguf_tensors(hf)["blk.1.ffn_up_exps.weight"]
    stored = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(up), gguf.GGMLQuantizationType.MXFP4),
                                    gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(model.layers[1].feed_forward.w13[:, 32:], torch.from_numpy(stored))
    assert not torch.equal(model.layers[1].feed_forward.w13, ours.layers[1].feed_forward.w13)  # 4 bits: not exact
    assert rel_err(model.logits(prompt(20)), ours.logits(prompt(20))) < 0.2


def test_bad_gpt_oss_experts_in_one_line(tmp_path):
    """A limit of 0, or an activation ringctx does not compute: one line naming the value."""
    config = {"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32, "num_local_experts": 4,
              "num_experts_per_tok": 2, "swiglu_limit": 0.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"clamped-swiglu with swiglu_alpha=1.702, swiglu_limit=0.0: both must be "
                                         r"positive \(model_type gpt_oss\)") as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)
    with pytest.raises(ValueError, match=r"activation='gelu' is not computed; ringctx has swiglu, clamped-swiglu"):
        Experts(n_experts=4, experts_per_token=2, expert_ffn_dim=8, activation="gelu")
