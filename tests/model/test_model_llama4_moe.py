"""Llama 4's mixture of experts against transformers 5.25's Llama4ForCausalLM (and the text model of
Llama4ForConditionalGeneration): the "sigmoid-topk" router (the k largest logits, their sigmoid
scaling the expert's INPUT), the shared expert added to the routed sum, MoE layers interleaved
with dense ones (interleave_moe_layer_step, or moe_layers listed), dense layers as wide as
intermediate_size_mlp and experts as wide as intermediate_size, on top of Llama 4's attention
(tests/model/test_model_llama4.py's chunks, q/k norms and NoPE temperature).

As in test_model_families_long.py, each reference is transformers' own model built from its config
class, given random weights, saved with `save_pretrained` (Llama 4's fused expert tensors:
experts.gate_up_proj [E, dim, 2F], experts.down_proj [E, F, dim]) and loaded by ringctx from that
directory; float32 on the CPU. Plus each ingredient shown to matter, the router's ties, the
parameter counts, tensor-parallel shards and bad input in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config import Experts, ModelConfig
from ringctx.model.config_hf import read_hf_config
from ringctx.model.moe import route
from tests.helpers import (SavedHFModels, assert_greedy_matches, assert_logits_match, hf_logits,
                           one_thread_for_module, random_hf_model_of, rel_err)
from tests.model.test_model_families import prompt
from tests.model.test_model_llama4 import TEXT, VISION

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
SHORT, LONG = 20, 70

MOE = {**TEXT, "moe_layers": None, "interleave_moe_layer_step": 2, "num_local_experts": 4, "num_experts_per_tok": 1,
       "intermediate_size": 32, "intermediate_size_mlp": 96}
"""TEXT's tiny Llama 4 (layers 0, 1, 3 chunked with RoPE, layer 2 NoPE) with experts on every 2nd
layer (1 and 3): 4 experts of 32 units, top 1, a shared expert of 32; dense layers of 96."""


def hf_config(name: str):
    import transformers

    cases = {
        "llama4-moe": lambda: transformers.Llama4TextConfig(**MOE),
        # moe_layers listed (0, 2, 3: a NoPE layer among them), top 2 of 4 (two routed experts summed),
        # biases, tied embeddings
        "llama4-moe-top2": lambda: transformers.Llama4TextConfig(
            **{**MOE, "moe_layers": [0, 2, 3], "num_experts_per_tok": 2}, attention_bias=True,
            tie_word_embeddings=True),
        # Llama4ForConditionalGeneration: the text model as language_model.*, its vision tower ignored
        "llama4-moe-vlm": lambda: transformers.Llama4Config(
            text_config=transformers.Llama4TextConfig(**MOE), vision_config=transformers.Llama4VisionConfig(**VISION),
            image_token_index=255, boi_token_index=253, eoi_token_index=254),
    }
    return cases[name]()


SPARSE = {"llama4-moe": [1, 3], "llama4-moe-top2": [0, 2, 3], "llama4-moe-vlm": [1, 3]}
"""The layers with experts in each case (transformers' is_moe_layer: checked below)."""


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`, every parameter random (norms and biases too)."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    return random_hf_model_of(hf_config(name), seed)


def text_model(hf):
    """The Llama4TextModel inside a causal LM or an image-text model."""
    return getattr(hf, "language_model", hf).model


CASES = list(SPARSE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (directory, transformers model), each saved once for the module."""
    return SavedHFModels(random_hf_model, tmp_path_factory)


@pytest.fixture(scope="module", params=CASES)
def pair(request, saved):
    """(case name, ringctx model, transformers model, directory) with the same weights."""
    directory, hf = saved[request.param]
    return request.param, load_model(directory, dtype=torch.float32, device="cpu"), hf, directory


MEASURED: dict[str, float] = {}
"""The largest logits rel err per case (printed at the end with -s: the report's numbers)."""


def test_logits_match_transformers(pair):
    assert_logits_match(pair, [prompt(SHORT), prompt(LONG)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    """ringctx's decode loop (one row a step through its own expert and the shared one) picks the
    same tokens as transformers' generate."""
    assert_greedy_matches(pair, prompt(LONG - 8, seed=2), n=8)


def test_config_is_read_as_written(pair):
    name, ours, hf, _ = pair
    c, text = ours.config, hf.config.get_text_config()
    sparse = [i for i, layer in enumerate(text_model(hf).layers) if layer.is_moe_layer]
    assert sparse == SPARSE[name] == [i for i in range(c.n_layers) if c.experts(i) is not None]
    for i in sparse:
        e = c.experts(i)
        assert (e.n_experts, e.experts_per_token, e.expert_ffn_dim, e.shared_ffn_dim) == (
            text.num_local_experts, text.num_experts_per_tok, text.intermediate_size, text.intermediate_size)
        assert e.router == "sigmoid-topk" and e.scales_inputs and not e.renormalize and e.weights_in_model_dtype
    assert c.ffn_dim == text.intermediate_size_mlp
    n_hf = sum(p.numel() for n, p in hf.named_parameters() if "vision" not in n and "multi_modal" not in n)
    assert c.n_params == n_hf, (name, c.n_params, n_hf)
    unread = sum((e.n_experts - e.experts_per_token) * 3 * c.dim * e.expert_ffn_dim
                 for e in c.layer_experts if e is not None)
    assert c.active_params == c.n_params - unread < c.n_params  # the shared expert is read by every token
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c  # a KV file's manifest keeps the experts


def test_bf16_moe_block_equals_transformers_bit_for_bit(pair):
    """In bf16 each MoE layer, given the same input rows, outputs exactly Llama4TextMoe's bits: the
    router's logits, the sigmoid scores rounded to bf16, the input scaled in bf16, the routed sum
    rounded once and added to the shared expert's output in bf16, in transformers' order.

    (The whole model is held to the block, not to the project's "twice transformers' bf16 error"
    rule: with random weights a token whose top experts nearly tie picks another expert in bf16
    than in float64, a jump of the logits that lands on ringctx's or transformers' side by
    which rounding of the attention comes first; measured on the two cases and seeds 0-1, ringctx's
    bf16 error was 0.8-3.5% and transformers' 0.9-3.2%, each the larger in two of four.)"""
    import copy

    name, _, hf, directory = pair
    ours = load_model(str(directory), dtype=torch.bfloat16, device="cpu")
    theirs = text_model(copy.deepcopy(hf).to(torch.bfloat16))
    x = torch.randn(300, ours.config.dim, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        for i in SPARSE[name]:
            expected, _ = theirs.layers[i].feed_forward(x)
            assert torch.equal(ours.layers[i].feed_forward(x), expected), (name, i)


def test_report_measured_errors():
    """Prints the largest logits error of each case (run with -s)."""
    for name, err in MEASURED.items():
        print(f"{name}: logits rel err {err:.2e}")


# ------------------------------------------------------------------------------------------------
# Each ingredient matters (the oracle tests above could not pass without it)


def test_each_moe_ingredient_moves_the_logits(saved, monkeypatch):
    """Scaling the expert's output instead of its input, leaving out the shared expert, or routing
    by softmax: each puts the logits far outside the 1e-4 the oracle tests hold them to (the top-2
    case: three MoE layers, two experts a token)."""
    import dataclasses

    name = "llama4-moe-top2"
    directory, hf = saved[name]
    ids = prompt(LONG)
    ref = hf_logits(hf, ids)
    errors = {"all": rel_err(load_model(str(directory), dtype=torch.float32, device="cpu").logits(ids), ref)}
    model = load_model(str(directory), dtype=torch.float32, device="cpu")
    for i in SPARSE[name]:
        model.layers[i].feed_forward.shared_w2.data.zero_()
    errors["no shared expert"] = rel_err(model.logits(ids), ref)
    model = load_model(str(directory), dtype=torch.float32, device="cpu")
    for i in SPARSE[name]:
        moe = model.layers[i].feed_forward
        moe.experts = dataclasses.replace(moe.experts, router="softmax-topk")
    errors["softmax router"] = rel_err(model.logits(ids), ref)
    with monkeypatch.context() as m:
        m.setattr(Experts, "scales_inputs", property(lambda self: False))
        model = load_model(str(directory), dtype=torch.float32, device="cpu")
        errors["weights on the outputs"] = rel_err(model.logits(ids), ref)
    assert errors["all"] < 1e-4 and min(errors.values()) == errors["all"], errors
    assert all(err > 1e-3 for what, err in errors.items() if what != "all"), errors


def test_sigmoid_router_keeps_the_largest_logits_lower_index_first():
    """The k largest logits (ties: the lower expert index, alone and in a batch), their sigmoid as the
    weights, not renormalised."""
    experts = Experts(n_experts=5, experts_per_token=2, expert_ffn_dim=8, router="sigmoid-topk", renormalize=False)
    logits = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.0],
                           [0.0, 2.0, 1.0, 2.0, 1.0],
                           [-1.0, -3.0, -2.0, -2.0, -2.0]])
    weights, chosen = route(logits, experts)
    assert chosen.tolist() == [[0, 1], [1, 3], [0, 2]]
    assert torch.equal(weights, torch.sigmoid(logits.gather(1, chosen))) and weights.dtype == torch.float32
    for row in range(3):
        alone_w, alone_c = route(logits[row:row + 1], experts)
        assert torch.equal(alone_c, chosen[row:row + 1]) and torch.equal(alone_w, weights[row:row + 1])


def test_a_decode_row_reads_only_its_experts(pair):
    """One row through a sparse layer: the experts it does not choose may hold NaN (never read);
    the shared expert is read."""
    name, ours, _, _ = pair
    moe = ours.layers[SPARSE[name][0]].feed_forward
    x = torch.randn(1, ours.config.dim) * 3
    expected = moe.forward(x)
    _, chosen = route(x @ moe.router.weight.T, moe.experts)
    saved = [p.detach().clone() for p in (moe.w13, moe.w2)]
    try:
        with torch.no_grad():
            unread = [e for e in range(moe.experts.n_experts) if e not in chosen[0].tolist()]
            moe.w13[unread] = float("nan")
            moe.w2[unread] = float("nan")
        assert torch.equal(moe.forward(x), expected)
        assert moe.forward(torch.empty(0, ours.config.dim)).shape == (0, ours.config.dim)
    finally:
        with torch.no_grad():
            for p, value in zip((moe.w13, moe.w2), saved):
                p.copy_(value)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tensor_parallel_shards_are_slices_of_the_whole_model(saved, tp_size):
    """Each TP rank reads its share of every expert's and of the shared expert's hidden units
    (from the fused, transposed tensors), the router whole; init_random's index (`_full_rows`)
    names the same slices, and the random weights it draws per rank are those slices too."""
    from ringctx.model.tensor_parallel import TensorParallel
    from ringctx.model.weights import _full_rows, empty_model, init_random, keep_index

    directory, _ = saved["llama4-moe-vlm"]
    ours = load_model(directory, dtype=torch.float32, device="cpu")
    whole = dict(ours.named_parameters())
    random_whole = empty_model(ours.config, dtype=torch.float32, device="cpu")
    init_random(random_whole)
    random_params = dict(random_whole.named_parameters())
    for rank in range(tp_size):
        tp = TensorParallel(tp_size, rank)
        shard = load_model(str(directory), dtype=torch.float32, device="cpu", tp=tp)
        random_shard = empty_model(ours.config, dtype=torch.float32, device="cpu", tp=tp)
        init_random(random_shard)
        for (param_name, param), random_param in zip(shard.named_parameters(), random_shard.parameters()):
            _, rows, cols = _full_rows(shard, param_name, param)
            for source, value in ((whole, param), (random_params, random_param)):
                expected = source[param_name][rows]
                expected = expected if cols is None else expected[keep_index(cols)]
                assert torch.equal(value, expected), (rank, param_name)
        a, b = tp.shared_ffn(ours.config, 1)
        assert shard.layers[1].feed_forward.shared_w13.shape == (2 * (b - a), ours.config.dim)


# ------------------------------------------------------------------------------------------------
# Bad input


def test_an_expert_count_the_tensors_disagree_with_is_one_line(tmp_path):
    """config.json says 3 experts, the fused tensors hold 4: one line naming the tensor and both shapes."""
    hf = random_hf_model("llama4-moe")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj' has shape \(4, .*needs \(3, ") as info:
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("keys,wrapped", [
    ({"moe_layers": [1, 3]}, False), ({"interleave_moe_layer_step": 2}, False), ({}, False),
    ({"interleave_moe_layer_step": 3}, False), ({"moe_layers": [0]}, True), ({"moe_layers": []}, False),
])
def test_moe_layers_are_read_as_llama4_text_config_decides(keys, wrapped, tmp_path):
    """moe_layers when listed, else every interleave_moe_layer_step-th layer (step 1, the default:
    every layer); from a config.json, the multimodal wrapper's text_config too. No MoE layer: a
    dense model (layer_experts empty)."""
    import transformers

    text = {**{k: v for k, v in MOE.items() if k != "moe_layers"}, **keys}
    expected = transformers.Llama4TextConfig(**text).moe_layers
    config = {"model_type": "llama4_text", **text}
    if wrapped:
        config = {"model_type": "llama4", "text_config": config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = read_hf_config(tmp_path)
    assert [i for i in range(read.n_layers) if read.experts(i) is not None] == expected
    assert read.has_experts == bool(expected)


@pytest.mark.parametrize("keys,message", [
    ({"moe_layers": [1, 4]}, r"moe_layers=\[1, 4\] names layers outside 0\.\.3"),
    ({"num_experts_per_tok": 5}, r"experts_per_token=5 is more than the layer's n_experts=4"),
    ({"num_local_experts": 0}, r"num_local_experts=0 \(a positive count of experts or units\)"),
])
def test_bad_expert_keys_are_one_line(keys, message):
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config({**MOE, "model_type": "llama4_text", **keys})
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# Presets and the planner


@pytest.mark.parametrize("name,total,active,sparse", [("llama4-scout", 109e9, 17e9, 48),
                                                      ("llama4-maverick", 400e9, 17e9, 24)])
def test_presets_have_their_published_parameter_counts(name, total, active, sparse):
    """Meta's counts (Scout 109B, Maverick 400B, 17B active each; theirs include the vision tower's
    ~1B, the presets are the text model), and which layers are sparse (Maverick: every 2nd)."""
    from ringctx.model.presets import get_preset

    config = get_preset(name)
    assert abs(config.n_params / total - 1) < 0.02 and abs(config.active_params / active - 1) < 0.02
    assert sum(e is not None for e in config.layer_experts) == sparse
    assert all(e.shared_ffn_dim == e.expert_ffn_dim == 8192 for e in config.layer_experts if e is not None)
    assert [config.attention(i).chunk for i in range(4)] == [8192, 8192, 8192, 0]


def test_a_decode_step_of_tiny_llama4_reads_the_router_its_expert_and_the_shared_one():
    """tiny-llama4's two MoE layers: a token reads 1 of 4 experts and the shared expert."""
    from ringctx.model.presets import get_preset
    from ringctx.model.weights import empty_model
    from ringctx.planning.machine_speed import decode_bytes_per_token

    config = get_preset("tiny-llama4")
    model = empty_model(config, dtype=torch.float32, device="meta")
    every = sum(p.numel() for p in model.parameters()) * 4 - config.vocab_size * config.dim * 4  # one embedding row
    unread = 2 * 3 * 3 * config.dim * 128 * 4  # two layers, 3 of 4 experts' gate, up and down
    assert decode_bytes_per_token(model, 0) == every - unread
    assert config.feed_forward_summary() == "2 dense + 2 layers of 4 experts, top 1 and a shared expert"


def test_a_10m_token_scout_plan_counts_the_global_layers_kv_and_every_expert():
    """`ringctx plan --model llama4-scout --tokens 10000000` on 4 hosts of 8 H200s (CP 8 x TP 4,
    chunks of 131,072): the weights are every expert's over TP 4, and the decode slice keeps the 12
    NoPE layers' rows and the current chunk of 8,192 of the 36 chunked ones (about a quarter)."""
    from ringctx.planning.prefill_plan import plan_prefill

    plan = plan_prefill("llama4-scout", 8, "h200", tokens=10_000_000, chunk_tokens=131072, tp_size=4)
    d = json.loads(plan.to_json())
    assert d["memory"]["weights_bytes"] == -(-107_769_861_120 * 2 // 4)
    dec = d["decode"]
    share = dec["kv_slice_bytes"] / dec["kv_slice_all_rows_bytes"]
    assert 0.25 <= share < 0.251, share
    assert dec["fits"] is True


# ------------------------------------------------------------------------------------------------
# GGUF (llama.cpp's llama4)


GGUF_TEXT = {**MOE, "num_experts_per_tok": 2, "attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
             "no_rope_layers": None,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
"""MOE with top 2, Scout's RoPE scaling (llama3, factor 16, low = high frequency factor 1 over
8,192: the 3 slowest of the 8 frequencies divided by 16), and the layers llama.cpp's llama4
loader fixes whatever the header says (chunks of 8,192, every 4th layer NoPE, floor 8,192 and
scale 0.1), so that the file and the Hugging Face directory describe one model."""


def llama4_gguf_tensors(hf) -> dict[str, np.ndarray]:
    """hf's tensors as llama.cpp's Llama4Model converter writes them: the names of gguf's llama4
    tensor map; experts.gate_up_proj [E, dim, 2F] transposed and split into ffn_gate_exps and
    ffn_up_exps [E, F, dim], experts.down_proj [E, F, dim] transposed into ffn_down_exps [E, dim, F];
    q/k rows as stored (undo_permute False: the checkpoint's interleaved pairs)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, hf.config.num_hidden_layers)
    out = {}
    for hf_name, value in hf.state_dict().items():
        w = value.float().numpy()
        if hf_name.endswith("experts.gate_up_proj"):
            gate, up = np.split(w.transpose(0, 2, 1), 2, axis=1)
            stem = hf_name.removesuffix("gate_up_proj")
            out[f"{names.get_name(stem + 'gate_proj')}.weight"] = gate
            out[f"{names.get_name(stem + 'up_proj')}.weight"] = up
        elif hf_name.endswith("experts.down_proj"):
            out[f"{names.get_name(hf_name)}.weight"] = w.transpose(0, 2, 1)
        else:
            base, suffix = hf_name.rsplit(".", 1)
            out[f"{names.get_name(base)}.{suffix}"] = w
    if hf.config.rope_parameters.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors' table
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        c = hf.config
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        plain = 1.0 / c.rope_parameters["rope_theta"] ** (torch.arange(0, c.head_dim, 2) / c.head_dim)
        out["rope_freqs.weight"] = (plain / scaled).float().numpy()
    return out


def write_llama4_gguf(path, hf, tensors: dict[str, np.ndarray] | None = None) -> None:
    """hf's model as a llama4 GGUF file with the keys llama.cpp's converter writes (feed_forward_length:
    the dense layers' intermediate_size_mlp; expert_feed_forward_length: intermediate_size)."""
    import gguf

    from tests.model.test_model_gguf_families import write_tensors

    c = hf.config
    writer = gguf.GGUFWriter(str(path), "llama4")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size_mlp)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_interleave_moe_layer_step(c.interleave_moe_layer_step)
    write_tensors(writer, llama4_gguf_tensors(hf) if tensors is None else tensors)


@pytest.fixture(scope="module")
def gguf_trio(tmp_path_factory):
    """(ringctx from the GGUF file, ringctx from the HF directory, transformers, the file), one set of weights."""
    import transformers

    directory = tmp_path_factory.mktemp("llama4-gguf")
    hf = random_hf_model_of(transformers.Llama4TextConfig(**GGUF_TEXT), seed=3)
    hf.save_pretrained(directory)
    path = directory / "llama4.gguf"
    write_llama4_gguf(path, hf)
    return (load_model(str(path), dtype=torch.float32, device="cpu"),
            load_model(str(directory), dtype=torch.float32, device="cpu"), hf, path)


def test_gguf_logits_equal_the_hf_directory_and_transformers(gguf_trio):
    from_gguf, from_hf, hf, _ = gguf_trio
    assert from_gguf.config.fingerprint() == from_hf.config.fingerprint()
    assert from_gguf.config.rope_scaling.factor == 16.0 and from_gguf.config.rope_scaling.high_freq_factor == 1.0
    for ids in (prompt(SHORT), prompt(LONG)):
        ref = hf_logits(hf, ids)
        got = from_gguf.logits(ids)
        MEASURED["llama4-moe-gguf"] = max(MEASURED.get("llama4-moe-gguf", 0.0), rel_err(got, ref))
        assert rel_err(got, ref) < 1e-4 and rel_err(got, from_hf.logits(ids)) < 1e-5


@pytest.mark.parametrize("tp_size", [2, 3])
def test_gguf_tensor_parallel_shards_equal_the_hf_directory_shards(gguf_trio, tp_size):
    """A TP rank reads its share of every 3-D expert tensor and of the shared expert from the file."""
    from ringctx.model.tensor_parallel import TensorParallel

    _, _, _, path = gguf_trio
    for rank in range(tp_size):
        tp = TensorParallel(tp_size, rank)
        from_gguf = load_model(str(path), dtype=torch.float32, device="cpu", tp=tp)
        from_hf = load_model(str(path.parent), dtype=torch.float32, device="cpu", tp=tp)
        hf_params = dict(from_hf.named_parameters())
        for name, param in from_gguf.named_parameters():
            assert torch.equal(param, hf_params[name]), (rank, name)


def test_gguf_expert_tensors_that_disagree_with_the_header_are_one_line(gguf_trio, tmp_path):
    """Three experts' tensors under a header of four; an expert tensor missing."""
    _, _, hf, _ = gguf_trio
    tensors = llama4_gguf_tensors(hf)
    short = {**tensors, "blk.1.ffn_up_exps.weight": tensors["blk.1.ffn_up_exps.weight"][:3]}
    write_llama4_gguf(tmp_path / "short.gguf", hf, short)
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up_exps\.weight' has shape \(3, 32, 64\), but the model "
                                         r"config needs \(4, 32, 64\)") as info:
        load_model(str(tmp_path / "short.gguf"), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)
    missing = {k: v for k, v in tensors.items() if k != "blk.3.ffn_down_exps.weight"}
    write_llama4_gguf(tmp_path / "missing.gguf", hf, missing)
    with pytest.raises(ValueError, match=r"weight tensor\(s\) missing: blk\.3\.ffn_down_exps\.weight;"):
        load_model(str(tmp_path / "missing.gguf"), dtype=torch.float32, device="cpu")
