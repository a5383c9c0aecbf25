"""GGUF files of Gemma 4's dense text models (llama.cpp's `gemma4` architecture) against
transformers 5.25 and against the same weights loaded from their Hugging Face directory.

Each case is test_model_gemma4.py's tiny random Gemma 4 (transformers' own config class), saved
with `save_pretrained`, and written as GGUF the way llama.cpp's converter (Gemma4Model in its
conversion/gemma.py) writes it:

- keys: attention.key_length / value_length = the full layers' head width (global_head_dim),
  *_swa = the sliding layers' (head_dim); attention.head_count_kv one count per layer where the
  full layers have their own (num_global_key_value_heads, with attention_k_eq_v), else one count;
  rope.freq_base / rope.freq_base_swa the full and sliding RoPE bases; rope.dimension_count /
  _swa the whole head widths; attention.sliding_window and attention.sliding_window_pattern (one
  bool per layer, true: sliding); attention.shared_kv_layers and
  embedding_length_per_layer_input 0; final_logit_softcapping when set;
- tensors: the gguf package's gemma4 names; norm weights stored as they are (w: Gemma 4's norms
  are not 1 + w); no Q/K permutation; the block scalars as blk.N.layer_output_scale.weight [1];
  no attn_v on a layer whose values are its keys (attention_k_eq_v); `rope_freqs.weight`
  [global_head_dim / 2]: 1.0 for the pairs the full layers' proportional RoPE turns, 1e30 after.

llama.cpp's gemma4 graph runs such a file as transformers runs the model (q/k norms, a weightless
v norm, softmax scale 1, keys as values where attn_v is absent, the block scalar last); ringctx
loads it; logits must match transformers within 1e-4 (float32) on prompts shorter and longer than
the window. What llama.cpp's gemma4 carries and ringctx does not compute (per-layer inputs, KV
sharing) and keys that disagree are one-line errors naming the key or tensor (the 26B-A4B's experts:
test_model_gguf_moe.py).
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_gguf import read_gguf_config
from ringctx.model.config_hf import read_hf_config
from tests.helpers import assert_gguf_logits_match, assert_tp_shards_are_slices, one_thread_for_module
from tests.model.test_model_families import prompt
from tests.model.test_model_gemma4 import GEMMA4_31B, LONG, SHORT, random_hf_model
from tests.model.test_model_gguf_families import _rounded, write_header, write_tensors

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

CASES = ["gemma4-text", "gemma4-heads", "gemma4-keqv-bias"]
"""Full layers of the sliding layers' head shape; of their own (32-dim heads, 1 KV head, keys as
values: the 31B's layout in small); keys as values at the sliding shape with biases, an untied
head and full layers in the middle (llama.cpp's gemma4 loads no bias tensors: the converter
writes them, ringctx reads them as transformers computes them)."""


def layer_shapes(text) -> list[tuple[int, int]]:
    """Per layer, (KV heads, head width) as Gemma4TextConfig builds them."""
    return [(text.per_layer_config[i].num_key_value_heads, text.per_layer_config[i].head_dim)
            for i in range(text.num_hidden_layers)]


def add_gemma4_keys(writer: gguf.GGUFWriter, text) -> None:
    """Gemma4Model.set_gguf_parameters' keys for a Gemma4TextConfig (its global_head_dim and
    num_global_key_value_heads recovered from the full layers' shape: transformers 5.25 saves
    them as per_layer_config)."""
    sliding = [kind == "sliding_attention" for kind in text.layer_types]
    shapes = layer_shapes(text)
    full_kv, full_dim = next(shape for shape, s in zip(shapes, sliding) if not s)
    swa_kv, swa_dim = next(shape for shape, s in zip(shapes, sliding) if s)  # the config's head_dim, KV heads
    rope = text.rope_parameters
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    if text.attention_k_eq_v:  # the converter's array, from num_global_key_value_heads
        writer.add_head_count_kv([swa_kv if s else full_kv for s in sliding])
    else:
        writer.add_head_count_kv(swa_kv)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(swa_dim)
    writer.add_value_length_swa(swa_dim)
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(swa_dim)
    if text.final_logit_softcapping:
        writer.add_final_logit_softcapping(text.final_logit_softcapping)
    writer.add_sliding_window(text.sliding_window)
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_bos_token_id(text.bos_token_id)
    writer.add_eos_token_id(text.eos_token_id)
    writer.add_pad_token_id(text.pad_token_id)


def proportional_table(full_dim: int, partial: float) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors' rope_freqs: 1.0 per turning pair, 1e30 per still one."""
    turning = int(full_dim * partial / 2)
    return np.asarray([1.0] * turning + [1e30] * (full_dim // 2 - turning), dtype=np.float32)


def gemma4_tensors(hf) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter stores them."""
    text = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, text.num_hidden_layers)
    out = {}
    for hf_name, value in hf.state_dict().items():
        if hf_name == "lm_head.weight" and text.tie_word_embeddings:
            continue
        if hf_name.endswith("layer_scalar"):  # Gemma4Model.filter_tensors names it ...layer_scalar.weight
            hf_name += ".weight"
        base, suffix = hf_name.rsplit(".", 1)
        out[f"{names.get_name(base)}.{suffix}"] = value.float().numpy()
    full_dim = next(d for (_, d), kind in zip(layer_shapes(text), text.layer_types) if kind == "full_attention")
    out["rope_freqs.weight"] = proportional_table(
        full_dim, text.rope_parameters["full_attention"]["partial_rotary_factor"])
    return out


def write_gemma4_gguf(path, hf, matrices=gguf.GGMLQuantizationType.F32) -> None:
    """hf's model as llama.cpp's gemma4 GGUF file, its matrices of type `matrices`."""
    writer = gguf.GGUFWriter(str(path), "gemma4")
    add_gemma4_keys(writer, hf.config)
    write_tensors(writer, gemma4_tensors(hf), matrices)


@pytest.fixture(scope="module", params=CASES)
def trio(request, tmp_path_factory):
    """(case, ringctx from GGUF, ringctx from the HF directory, transformers, the GGUF file), one set
    of weights."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = random_hf_model(request.param)
    hf.save_pretrained(directory)
    path = directory / f"{request.param}.gguf"
    write_gemma4_gguf(path, hf)
    return (request.param, load_model(str(path), dtype=torch.float32, device="cpu"),
            load_model(str(directory), dtype=torch.float32, device="cpu"), hf, path)


MEASURED: dict[str, float] = {}


def test_the_file_is_written_as_llama_cpp_writes_it(trio):
    """The layout the loader is tested on: no attn_v where keys are values, per-layer KV counts
    with the 31B's layout, the proportional table."""
    name, _, _, hf, path = trio
    reader = gguf.GGUFReader(str(path), "r")
    tensors = {t.name for t in reader.tensors}
    full = [i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"]
    assert all((f"blk.{i}.attn_v.weight" in tensors) == (not hf.config.attention_k_eq_v) for i in full), name
    assert all(f"blk.{i}.attn_v.weight" in tensors for i in range(hf.config.num_hidden_layers) if i not in full)
    kv = reader.fields["gemma4.attention.head_count_kv"]
    assert (len(kv.data) > 1) == hf.config.attention_k_eq_v and "rope_freqs.weight" in tensors


def test_gguf_logits_match_transformers_and_the_hf_directory(trio):
    name, from_gguf, from_hf, hf, _ = trio
    assert_gguf_logits_match(name, from_gguf, from_hf, hf, (SHORT, LONG), MEASURED)


def test_gguf_greedy_tokens_equal_transformers(trio):
    name, from_gguf, _, hf, _ = trio
    ids = prompt(LONG - 8, seed=2)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids[None], max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.numel():].tolist()
    assert from_gguf.generate(ids, max_new_tokens=6, stop_token_ids=[]).token_ids == ref, name


def test_gguf_config_and_weights_equal_the_hf_directorys(trio):
    """Every config field as read from config.json (head shapes per layer, both RoPEs with the
    proportional share from the table, scale 1, v norm, block scalars, soft-cap), and every
    parameter bit for bit (float32 files; v rows copied from k where the file has no attn_v)."""
    name, from_gguf, from_hf, _, _ = trio
    ours, theirs = from_gguf.config, from_hf.config
    assert ours.kv_shapes == theirs.kv_shapes and ours.uniform_heads == (name != "gemma4-heads")
    assert ours.rope_scaling.rope_type == "proportional" and ours.rope_scaling.proportion == 0.25
    assert _rounded(dataclasses.replace(ours, name="x").to_dict()) == \
        _rounded(dataclasses.replace(theirs, name="x").to_dict())
    hf_params = dict(from_hf.named_parameters())
    for param_name, param in from_gguf.named_parameters():
        assert torch.equal(param, hf_params[param_name]), (name, param_name)


def test_report_measured_errors():
    for name, err in MEASURED.items():
        print(f"{name}: GGUF logits rel err {err:.2e}")


@pytest.mark.parametrize("case,tp_size,matrices", [("gemma4-heads", 2, "F32"), ("gemma4-keqv-bias", 2, "Q8_0")])
def test_tensor_parallel_ranks_read_their_slices(case, tp_size, matrices, tmp_path):
    """Each TP rank reads its heads' rows at each layer's own head shape (keys copied into its
    values where the file has no attn_v, whole quantized rows too): every parameter of its shard
    equals the same slice of the whole model's."""
    path = tmp_path / f"{case}.gguf"
    write_gemma4_gguf(path, random_hf_model(case), matrices=gguf.GGMLQuantizationType[matrices])
    assert_tp_shards_are_slices(path, tp_size, what=(case,))


# ------------------------------------------------------------------------------------------------
# Headers: the 31B's layout, and what is refused in one line


def gemma4_31b_header() -> dict:
    """GEMMA4_31B (test_model_gemma4.py's 31B-like config) as llama.cpp's converter writes its keys."""
    c = GEMMA4_31B
    sliding = [(i + 1) % 6 != 0 for i in range(c["num_hidden_layers"])]
    return {"block_count": c["num_hidden_layers"], "embedding_length": c["hidden_size"],
            "feed_forward_length": c["intermediate_size"], "context_length": c["max_position_embeddings"],
            "vocab_size": c["vocab_size"], "attention.head_count": c["num_attention_heads"],
            "attention.head_count_kv": [c["num_key_value_heads"] if s else c["num_global_key_value_heads"]
                                        for s in sliding],
            "attention.key_length": c["global_head_dim"], "attention.value_length": c["global_head_dim"],
            "attention.key_length_swa": c["head_dim"], "attention.value_length_swa": c["head_dim"],
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 10_000.0,
            "rope.dimension_count": c["global_head_dim"], "rope.dimension_count_swa": c["head_dim"],
            "attention.sliding_window": c["sliding_window"], "attention.sliding_window_pattern": sliding,
            "final_logit_softcapping": c["final_logit_softcapping"], "attention.shared_kv_layers": 0,
            "embedding_length_per_layer_input": 0}


def test_gemma4_31b_layout_reads_as_its_hf_config(tmp_path):
    """A 31B-shaped header (512-dim heads and 4 KV heads on the full layers, 256 and 16 on the
    sliding ones; a quarter of the full heads' pairs turning) gives the config config.json gives."""
    path = tmp_path / "gemma4-31b.gguf"
    write_header(path, "gemma4", gemma4_31b_header(),
                 {"rope_freqs.weight": proportional_table(512, 0.25), "blk.0.layer_output_scale.weight": np.ones(1)})
    ours = read_gguf_config(str(path))
    (tmp_path / "config.json").write_text(json.dumps(GEMMA4_31B))
    theirs = read_hf_config(tmp_path)
    assert ours.kv_shapes[:6] == [(16, 256)] * 5 + [(4, 512)] and ours.n_params == theirs.n_params
    assert _rounded(dataclasses.replace(ours, name="x").to_dict()) == \
        _rounded(dataclasses.replace(theirs, name="x").to_dict())


_SMALL = {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, True, True, False],
          "attention.key_length": 32, "attention.value_length": 32, "attention.key_length_swa": 16,
          "attention.value_length_swa": 16, "rope.dimension_count": 32, "rope.dimension_count_swa": 16}
"""A small gemma4 header (4 layers: 3 sliding with 16-dim heads, 1 full with 32) to break key by key."""
_TABLE = {"rope_freqs.weight": proportional_table(32, 0.25)}


@pytest.mark.parametrize("keys,tensors,message", [
    ({"embedding_length_per_layer_input": 256}, None,
     r"gemma4\.embedding_length_per_layer_input=256 \(Gemma 4's per-layer inputs \(E2B, E4B\)\) is not supported yet"),
    ({}, {"per_layer_token_embd.weight": np.ones((4, 8))},
     r"tensor per_layer_token_embd\.weight \(Gemma 4's per-layer inputs"),
    ({"attention.shared_kv_layers": 2}, None, r"gemma4\.attention\.shared_kv_layers=2 \(KV sharing across layers\)"),
    # the 26B-A4B's experts are read (test_model_gguf_moe.py); an incomplete header is named
    ({"expert_count": 128, "expert_used_count": 8}, None,
     r"gemma4\.expert_feed_forward_length=None \(a positive count of experts or units\) with gemma4\.expert_count=128"),
    ({"attention.value_length_swa": 32}, None,
     r"gemma4\.attention\.key_length_swa=16 but gemma4\.attention\.value_length_swa=32"),
    ({"rope.dimension_count_swa": 8}, None, r"gemma4\.rope\.dimension_count_swa=8 for sliding heads of 16 dims"),
    ({"rope.dimension_count": 8}, None, r"gemma4\.rope\.dimension_count=8 < head dim 32\) are not supported"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, None,
     r"gemma4\.rope\.scaling\.type='linear' is not supported on gemma4"),
    ({"attention.scale": 0.0625}, None, r"gemma4\.attention\.scale=0\.0625 disagrees with Gemma 4's softmax scale 1"),
    ({}, {"rope_freqs.weight": np.ones(8)},
     r"rope_freqs\.weight has 8 entries, but gemma4's full layers have heads of 32"),
    ({}, {"rope_freqs.weight": np.asarray([1.0, 2.0, 4.0] + [8.0] * 13)},
     r"is not Gemma 4's proportional RoPE table"),
    ({"attention.head_count_kv": [2, 2, 2]}, None,
     r"gemma4\.attention\.head_count_kv lists 3 layers, but gemma4\.block_count=4"),
    ({"attention.head_count": [4, 4, 2, 4]}, None,
     r"per-layer gemma4\.attention\.head_count \[2, 4\] is not supported"),
    ({"attention.sliding_window": None}, None, r"GGUF header lacks 'gemma4\.attention\.sliding_window'"),
    ({"attn_logit_softcapping": 50.0}, None, r"gemma4\.attn_logit_softcapping=50\.0 is not supported"),
])
def test_bad_gemma4_headers_are_one_line_errors(keys, tensors, message, tmp_path):
    path = tmp_path / "bad.gguf"
    header = {k: v for k, v in {**_SMALL, **keys}.items() if v is not None}
    write_header(path, "gemma4", header, {**_TABLE, **(tensors or {})})
    with pytest.raises(ValueError, match=message) as info:
        read_gguf_config(str(path))
    assert "\n" not in str(info.value) and "bad.gguf" in str(info.value)


def test_small_header_reads(tmp_path):
    """The header the refusals break reads cleanly: 3 sliding layers of the model's shape, 1 full
    layer of its own width, the proportional RoPE on it, the swa base defaulting to freq_base."""
    path = tmp_path / "small.gguf"
    write_header(path, "gemma4", _SMALL, _TABLE)
    c = read_gguf_config(str(path))
    assert c.kv_shapes == [(2, 16)] * 3 + [(2, 32)] and c.head_dim == 16 and c.n_kv_heads == 2
    assert [c.attention(i).window for i in range(4)] == [8, 8, 8, 0]
    assert c.attention(0).rope_theta == 10_000.0 and c.attention(3).rope_theta == 0.0
    assert c.rope_scaling.proportion == 0.25 and not c.layer_scalars and c.v_norm
