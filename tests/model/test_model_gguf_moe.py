"""GGUF files of the mixtures of experts (Mixtral: architecture llama with llama.expert_count;
Qwen3-MoE: qwen3moe) against transformers 5.25 and against the same weights loaded from their
Hugging Face directory.

Each case is a tiny transformers model with random weights (its own config class), saved with
`save_pretrained`, and its tensors written as llama.cpp's convert_hf_to_gguf.py writes them: the
gguf package's names, the router as ffn_gate_inp [E, dim], every layer's experts stacked into
ffn_gate_exps / ffn_up_exps [E, F, dim] and ffn_down_exps [E, dim, F], Q/K rows permuted for llama
files, and the header's expert_count, expert_used_count (qwen3moe: expert_feed_forward_length).
Logits within 1e-4 of transformers (float32); TP shards equal the HF-read ones; bad headers and
tensors are one-line errors naming the key or tensor.
"""

from __future__ import annotations

import dataclasses
import re

import gguf
import numpy as np
import pytest
import torch

from ringctx.model import load_model
from tests.helpers import assert_gguf_logits_match, assert_greedy_matches, one_thread_for_module, random_hf_model_of
from tests.model.test_model_families import prompt
from tests.model.test_model_gguf import llama_cpp_permute
from tests.model.test_model_gguf_families import _rounded, add_keys, write_tensors

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
SHORT, LONG = 20, 70

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=512)


def hf_config(name: str):
    import transformers

    return {
        # Mixtral: 4 experts of 32 units, top 2, head_dim != hidden / heads
        "mixtral": lambda: transformers.MixtralConfig(**SHAPE, head_dim=32, intermediate_size=32,
                                                      num_local_experts=4, num_experts_per_tok=2),
        # Qwen3-MoE as released (norm_topk_prob true): 5 experts of 24, top 3, a dense width of its own
        "qwen3moe": lambda: transformers.Qwen3MoeConfig(
            **SHAPE, head_dim=16, intermediate_size=80, moe_intermediate_size=24, num_experts=5,
            num_experts_per_tok=3, norm_topk_prob=True),
        # ... norm_topk_prob false: the file says so with qwen3moe.expert_weights_norm false
        "qwen3moe-unnormed": lambda: transformers.Qwen3MoeConfig(
            **SHAPE, head_dim=16, intermediate_size=80, moe_intermediate_size=24, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True),
    }[name]()


ARCH = {"mixtral": "llama", "qwen3moe": "qwen3moe", "qwen3moe-unnormed": "qwen3moe"}
CASES = list(ARCH)

_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def random_hf_model(name: str, seed: int = 0):
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    return random_hf_model_of(hf_config(name), seed)


def moe_gguf_tensors(hf, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter stores them: per-layer experts stacked by kind
    (transformers holds them fused as gate_up_proj [E, 2F, dim]: its gate rows, then its up rows)."""
    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    out = {}
    for hf_name, value in hf.state_dict().items():
        w = value.float().numpy()
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        match = _EXPERTS.match(hf_name)
        if match:
            blk, what = f"blk.{match.group(1)}", match.group(2)
            if what == "gate.weight":
                out[f"{blk}.ffn_gate_inp.weight"] = w
            elif what == "experts.down_proj":
                out[f"{blk}.ffn_down_exps.weight"] = w
            else:
                F = w.shape[1] // 2
                out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = w[:, :F], w[:, F:]
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_permute(w, c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads)
        out[name] = w
    return out


def moe_keys(hf, arch: str):
    """llama.cpp's header keys of the experts (on top of `add_keys`' dense ones)."""
    c = hf.config

    def keys(writer: gguf.GGUFWriter) -> None:
        writer.add_expert_count(c.num_experts if arch == "qwen3moe" else c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
            if not c.norm_topk_prob:
                writer.add_bool(f"{arch}.expert_weights_norm", False)
    return keys


def write_moe_gguf(path, hf, arch: str, keys=None, tensors=None) -> str:
    """hf's model as a GGUF file (float32); keys(writer) adds or overrides header keys; tensors
    replaces the stored ones."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_keys(writer, hf, arch)
    moe_keys(hf, arch)(writer)
    if keys is not None:
        keys(writer)
    write_tensors(writer, moe_gguf_tensors(hf, arch) if tensors is None else tensors)
    return str(path)


@pytest.fixture(scope="module", params=CASES)
def trio(request, tmp_path_factory):
    """(case, ringctx from GGUF, ringctx from the HF directory, transformers, GGUF path, directory)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = random_hf_model(request.param)
    hf.save_pretrained(directory)
    path = write_moe_gguf(directory / f"{request.param}.gguf", hf, ARCH[request.param])
    return (request.param, load_model(path, dtype=torch.float32, device="cpu"),
            load_model(str(directory), dtype=torch.float32, device="cpu"), hf, path, directory)


MEASURED: dict[str, float] = {}


def test_gguf_logits_match_transformers_and_the_hf_directory(trio):
    name, from_gguf, from_hf, hf, _, _ = trio
    assert_gguf_logits_match(name, from_gguf, from_hf, hf, (SHORT, LONG), MEASURED)


def test_gguf_greedy_tokens_equal_transformers(trio):
    name, from_gguf, _, hf, _, _ = trio
    assert_greedy_matches((name, from_gguf, hf, None), prompt(LONG - 8, seed=2), n=8)


def test_gguf_config_equals_the_hf_config(trio):
    """Every field as read from config.json: the experts' count, width, top k, renormalisation
    and rounding included (so the two fingerprints agree)."""
    name, from_gguf, from_hf, _, _, _ = trio
    ours, theirs = from_gguf.config, from_hf.config
    assert ours.experts(0) is not None and ours.experts(0).renormalize == (name != "qwen3moe-unnormed")
    assert _rounded(dataclasses.replace(ours, name="x").to_dict()) == \
        _rounded(dataclasses.replace(theirs, name="x").to_dict())


def test_report_measured_errors():
    """Prints the largest logits error of each case (run with -s)."""
    for name, err in MEASURED.items():
        print(f"{name}: GGUF logits rel err {err:.2e}")


def test_tensor_parallel_shards_equal_the_hf_ones(trio):
    """A TP rank reads its share of every expert out of the 3-D tensors: the same parameters as
    the same rank's shard read from the Hugging Face directory."""
    from ringctx.model.tensor_parallel import TensorParallel

    name, _, _, _, path, directory = trio
    for tp in (TensorParallel(2, 0), TensorParallel(3, 2)):
        theirs = dict(load_model(str(directory), dtype=torch.float32, device="cpu", tp=tp).named_parameters())
        for param_name, param in load_model(path, dtype=torch.float32, device="cpu", tp=tp).named_parameters():
            assert torch.equal(param, theirs[param_name]), (name, tp.rank, param_name)


def test_quantized_experts_load_as_their_dequantized_values(tmp_path):
    """Q8_0 expert tensors (each expert's rows whole quantization blocks): every expert's slab
    equals the gguf package's dequantization of the stored tensor, whole and as TP 2 shards."""
    from gguf.quants import dequantize, quantize

    from ringctx.model.tensor_parallel import TensorParallel

    hf = random_hf_model("mixtral")  # experts of 32 units: whole blocks of 32 both ways
    tensors = moe_gguf_tensors(hf, "llama")
    path = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_keys(writer, hf, "llama")
    moe_keys(hf, "llama")(writer)
    stored = {}
    for name, w in tensors.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if name.endswith("_exps.weight"):
            data = quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[name] = torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape))
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = load_model(str(path), dtype=torch.float32, device="cpu")
    F = hf.config.intermediate_size
    for i in range(hf.config.num_hidden_layers):
        moe = whole.layers[i].feed_forward
        assert torch.equal(moe.w13[:, :F], stored[f"blk.{i}.ffn_gate_exps.weight"])
        assert torch.equal(moe.w13[:, F:], stored[f"blk.{i}.ffn_up_exps.weight"])
        assert torch.equal(moe.w2, stored[f"blk.{i}.ffn_down_exps.weight"])
    shard = load_model(str(path), dtype=torch.float32, device="cpu", tp=TensorParallel(2, 1))
    w2 = shard.layers[1].feed_forward.w2
    assert torch.equal(w2, stored["blk.1.ffn_down_exps.weight"][:, :, F // 2:])


# ------------------------------------------------------------------------------------------------
# Bad input, one line each, before any rank computes


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return random_hf_model("mixtral")


def _load_error(path, match):
    with pytest.raises(ValueError, match=match) as info:
        load_model(str(path), dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


def test_an_expert_count_the_tensors_disagree_with(mixtral, tmp_path):
    path = write_moe_gguf(tmp_path / "m.gguf", mixtral, "llama", keys=lambda w: w.add_expert_count(3))
    _load_error(path, r"tensor 'blk\.0\.ffn_[\w.]+' has shape \(4, .*\), but the model config needs \(3, .*\)")


def test_a_router_of_another_width(mixtral, tmp_path):
    tensors = moe_gguf_tensors(mixtral, "llama")
    tensors["blk.1.ffn_gate_inp.weight"] = np.zeros((4, 63), dtype=np.float32)
    path = write_moe_gguf(tmp_path / "m.gguf", mixtral, "llama", tensors=tensors)
    _load_error(path, r"tensor 'blk\.1\.ffn_gate_inp\.weight' has shape \(4, 63\), but the model config needs "
                      r"\(4, 64\)")


def test_missing_expert_tensors_are_named(mixtral, tmp_path):
    tensors = moe_gguf_tensors(mixtral, "llama")
    del tensors["blk.1.ffn_up_exps.weight"]
    path = write_moe_gguf(tmp_path / "m.gguf", mixtral, "llama", tensors=tensors)
    _load_error(path, r"1 weight tensor\(s\) missing: blk\.1\.ffn_up_exps\.weight; the checkpoint is incomplete")


def test_experts_of_a_header_without_expert_count(mixtral, tmp_path):
    """A dense header over expert tensors: the first one is named as having no place."""
    path = write_moe_gguf(tmp_path / "m.gguf", mixtral, "llama", keys=lambda w: w.add_expert_count(0))
    _load_error(path, r"unexpected tensor 'blk\.0\.ffn_(gate_inp|\w+_exps)\.weight'")


@pytest.mark.parametrize("keys,message", [
    (lambda w: w.add_expert_used_count(5), r"llama\.expert_count=4, llama\.expert_used_count=5: experts_per_token=5 "
                                           r"is more than the layer's n_experts=4"),
    (lambda w: w.add_uint32("llama.expert_used_count", 0), r"llama\.expert_used_count=0 \(a positive count"),
    (lambda w: w.add_uint32("llama.expert_gating_func", 2), r"llama\.expert_gating_func=2 is not supported"),
])
def test_bad_expert_headers_in_one_line(mixtral, tmp_path, keys, message):
    path = write_moe_gguf(tmp_path / "m.gguf", mixtral, "llama", keys=keys)
    _load_error(path, message)


def test_experts_on_another_architecture_are_refused(tmp_path):
    """qwen2 with an expert_count (Qwen2-MoE: shared experts) stays refused in one line."""
    from ringctx.model.config_gguf import read_gguf_config

    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen2")
    for key, value in (("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 96),
                       ("attention.head_count", 4), ("expert_count", 8)):
        writer.add_uint32(f"qwen2.{key}", value)
    write_tensors(writer, {"token_embd.weight": np.zeros((256, 64), dtype=np.float32)})
    with pytest.raises(ValueError, match=r"qwen2\.expert_count=8 \(a mixture of experts\) is not supported yet on "
                                         r"architecture qwen2; ringctx reads the experts of llama, qwen3moe"):
        read_gguf_config(str(tmp_path / "q.gguf"))


def test_preset_qwen3_235b_a22b():
    """The published shape: 235.1B parameters of which 22.2B reach a token (the name's 235B-A22B),
    128 experts top 8 on all 94 layers, 262,144 positions (2507)."""
    from ringctx.model.presets import get_preset

    c = get_preset("qwen3-235b-a22b")
    assert round(c.n_params / 1e9, 1) == 235.1 and round(c.active_params / 1e9, 1) == 22.2
    assert c.feed_forward_summary() == "94 layers of 128 experts, top 8" and c.max_seq_len == 262144
    assert (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (4096, 64, 4, 128, 151936)


# ------------------------------------------------------------------------------------------------
# Gemma 4 26B-A4B (gemma4 with expert_count): the gguf package's names for the experts
# (ffn_gate_inp, ffn_gate_up_exps, ffn_down_exps, pre_ffw_norm_2, post_ffw_norm_1/2) and llama.cpp's
# converter's for the router's two scales, which the package does not name: router.scale as
# ffn_gate_inp.scale [dim], router.per_expert_scale as ffn_down_exps.scale [E].

_GEMMA4_EXPERTS = re.compile(r"model\.layers\.(\d+)\.(router\.scale|router\.per_expert_scale|experts\.gate_up_proj|"
                             r"experts\.down_proj)$")
_GEMMA4_STORED = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
                  "experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight"}


def gemma4_moe_gguf(path, hf, keys=None) -> str:
    """hf's Gemma 4 26B-A4B-shaped model as llama.cpp's gemma4 GGUF file (test_model_gguf_gemma4.py's
    writer for the rest)."""
    from types import SimpleNamespace

    from tests.model.test_model_gguf_gemma4 import add_gemma4_keys, gemma4_tensors

    state = hf.state_dict()
    experts = {n: v for n, v in state.items() if _GEMMA4_EXPERTS.match(n)}
    tensors = gemma4_tensors(SimpleNamespace(config=hf.config, state_dict=lambda: {
        n: v for n, v in state.items() if n not in experts}))
    for name, value in experts.items():
        match = _GEMMA4_EXPERTS.match(name)
        tensors[f"blk.{match.group(1)}.{_GEMMA4_STORED[match.group(2)]}"] = value.float().numpy()
    writer = gguf.GGUFWriter(str(path), "gemma4")
    add_gemma4_keys(writer, hf.config)
    writer.add_expert_count(hf.config.num_experts)
    writer.add_expert_used_count(hf.config.top_k_experts)
    writer.add_expert_feed_forward_length(hf.config.moe_intermediate_size)
    if keys is not None:
        keys(writer)
    write_tensors(writer, tensors)
    return str(path)


@pytest.fixture(scope="module", params=["gemma4-moe", "gemma4-moe-keqv"])
def gemma4_trio(request, tmp_path_factory):
    from tests.model.test_model_gemma4_moe import random_hf_model as random_gemma4

    directory = tmp_path_factory.mktemp(request.param)
    hf = random_gemma4(request.param)
    hf.save_pretrained(directory)
    path = gemma4_moe_gguf(directory / "g.gguf", hf)
    return (request.param, load_model(path, dtype=torch.float32, device="cpu"),
            load_model(str(directory), dtype=torch.float32, device="cpu"), hf, path, directory)


def test_gemma4_gguf_logits_match_transformers_and_the_hf_directory(gemma4_trio):
    test_gguf_logits_match_transformers_and_the_hf_directory(gemma4_trio)


def test_gemma4_gguf_greedy_tokens_equal_transformers(gemma4_trio):
    test_gguf_greedy_tokens_equal_transformers(gemma4_trio)


def test_gemma4_gguf_config_and_tp_shards_equal_the_hf_ones(gemma4_trio):
    name, from_gguf, from_hf, _, _, _ = gemma4_trio
    assert from_gguf.config.experts(0) == from_hf.config.experts(0)
    assert from_gguf.config.fingerprint() == from_hf.config.fingerprint()
    test_tensor_parallel_shards_equal_the_hf_ones(gemma4_trio)


def test_gemma4_gguf_bad_expert_input(tmp_path):
    """An expert count the tensors disagree with, a missing scale, top k above the count: one line each."""
    from tests.model.test_model_gemma4_moe import random_hf_model as random_gemma4

    hf = random_gemma4("gemma4-moe")
    _load_error(gemma4_moe_gguf(tmp_path / "a.gguf", hf, keys=lambda w: w.add_expert_count(5)),
                r"tensor 'blk\.0\.[\w.]+' has shape \(6.*\), but the model config needs \(5.*\)")
    _load_error(gemma4_moe_gguf(tmp_path / "b.gguf", hf, keys=lambda w: w.add_expert_used_count(7)),
                r"gemma4\.expert_count=6, gemma4\.expert_used_count=7: experts_per_token=7 is more than")
    path = tmp_path / "c.gguf"
    gemma4_moe_gguf(path, hf)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    del tensors["blk.2.ffn_down_exps.scale"]
    writer = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "gemma4")
    from tests.model.test_model_gguf_gemma4 import add_gemma4_keys

    add_gemma4_keys(writer, hf.config)
    writer.add_expert_count(6)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(hf.config.moe_intermediate_size)
    write_tensors(writer, tensors)
    _load_error(tmp_path / "d.gguf", r"1 weight tensor\(s\) missing: blk\.2\.ffn_down_exps\.scale; the checkpoint")


def test_per_expert_tensors_of_the_first_mixtral_files(mixtral, tmp_path):
    """llama.cpp's first Mixtral files stored blk.N.ffn_gate.E.weight per expert: named, with the fix."""
    tensors = moe_gguf_tensors(mixtral, "llama")
    gate = tensors.pop("blk.0.ffn_gate_exps.weight")
    tensors.update({f"blk.0.ffn_gate.{e}.weight": gate[e] for e in range(gate.shape[0])})
    path = write_moe_gguf(tmp_path / "m.gguf", mixtral, "llama", tensors=tensors)
    _load_error(path, r"tensor 'blk\.0\.ffn_gate\.\d\.weight' is one expert's matrix, the layout of llama\.cpp's "
                      r"first Mixtral files; .* re-convert the model with a current llama\.cpp")
