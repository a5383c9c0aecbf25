"""GGUF files of the windowed and long-context families against transformers 5.25 and against the
same weights loaded from their Hugging Face directory.

Each case is a tiny transformers model with random weights (its own config class), saved with
`save_pretrained`, and its tensors written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes
them: llama.cpp's tensor names (the gguf package's own name map), Q/K rows permuted for llama
files, Gemma 3's norm weights stored as 1 + w, Phi-3's fused attn_qkv / ffn_up and LongRoPE
factor tensors, and llama.cpp's header keys. ringctx loads both; logits must match transformers
within 1e-4 (float32) on prompts shorter and longer than the windows and LongRoPE's original
context. Bad headers (keys that disagree, kinds not supported yet) are one-line errors.
"""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_gguf import read_gguf_config
from tests.helpers import assert_gguf_logits_match, assert_tp_shards_are_slices, one_thread_for_module
from tests.model.test_model_families import prompt
from tests.model.test_model_families_long import LONG, ORIGINAL, SHAPE, SHORT, TRANSFORMERS_VERSION, WINDOW, _phi3_rope
from tests.model.test_model_gguf import llama_cpp_permute

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

GEMMA = dict(**{**SHAPE, "num_hidden_layers": 7}, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
             final_logit_softcapping=1.0, max_position_embeddings=512)
"""Gemma 3 as llama.cpp can state it: 7 layers so that its fixed pattern (every 6th full) shows,
query_pre_attn_scalar = head_dim (llama.cpp derives the scale from the layer count)."""


def hf_config(name: str):
    import transformers

    return {
        # Mistral 7B v0.1: one window on every layer (a llama file with attention.sliding_window).
        "mistral-window": lambda: transformers.MistralConfig(**SHAPE, head_dim=32, sliding_window=WINDOW,
                                                             max_position_embeddings=512),
        # Ministral: 3 sliding : 1 full by layer_types (a llama file with an integer pattern of 4).
        "ministral-pattern": lambda: transformers.MinistralConfig(
            **{**SHAPE, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW, max_position_embeddings=512,
            layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        # Qwen2 with use_sliding_window from layer max_window_layers on (a per-layer bool pattern).
        "qwen2-window": lambda: transformers.Qwen2Config(
            **{**SHAPE, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
            max_position_embeddings=512),
        # Seed-OSS: q/k/v biases, head_dim != hidden / heads (its MLP norm keeps the name post_attention_norm).
        "seed-oss": lambda: transformers.SeedOssConfig(**SHAPE, head_dim=32, max_position_embeddings=512),
        "phi3-longrope": lambda: transformers.Phi3Config(
            **SHAPE, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters=_phi3_rope(16)),
        "phi4-partial-window": lambda: transformers.Phi3Config(
            **SHAPE, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters=_phi3_rope(16, 0.75), sliding_window=WINDOW, tie_word_embeddings=True),
        "gemma3": lambda: transformers.Gemma3TextConfig(**GEMMA),
    }[name]()


ARCH = {"mistral-window": "llama", "ministral-pattern": "llama", "qwen2-window": "qwen2", "seed-oss": "seed_oss",
        "phi3-longrope": "phi3",
        "phi4-partial-window": "phi3", "gemma3": "gemma3"}
CASES = list(ARCH)


def random_hf_model(name: str, seed: int = 0):
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:  # Gemma's (1 + w) gains around 1 too
                p.copy_(torch.rand_like(p) - 0.5 if name == "gemma3" else torch.rand_like(p) + 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    return model


def gguf_tensors(hf, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter stores them (names, permutation, norm shift)."""
    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    out = {}
    for hf_name, value in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        w = value.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_permute(w, c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1  # Gemma3Model.norm_shift: Gemma3RMSNorm's (1 + w) gain, stored with the 1 added
        out[name] = w
    if arch == "phi3" and c.rope_parameters.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.asarray(c.rope_parameters["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(c.rope_parameters["short_factor"], dtype=np.float32)
    return out


def add_keys(writer: gguf.GGUFWriter, hf, arch: str) -> None:
    """llama.cpp's header keys for the model (its converter's, per architecture)."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    writer.add_pad_token_id(c.pad_token_id)
    rope = c.rope_parameters
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
        return
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":  # Phi3MiniModel: rotated dims, original context, LongRoPE's cos/sin factor
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        original = c.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        if rope.get("rope_type") == "longrope":  # TextModel.set_gguf_parameters' type key (recent llama.cpp)
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    else:
        writer.add_rope_dimension_count(head_dim)
    if getattr(c, "sliding_window", None) is not None:
        writer.add_sliding_window(c.sliding_window)
        kinds = getattr(c, "layer_types", None)
        if arch == "llama" and kinds and "full_attention" in kinds:  # Ministral: every 4th full
            writer.add_sliding_window_pattern(4)
        elif arch == "qwen2":
            writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])


def write_model_gguf(path, hf, arch: str, keys=None, tensors: dict[str, np.ndarray] | None = None,
                     matrices=gguf.GGMLQuantizationType.F32) -> None:
    """hf's model as a GGUF file, its matrices of type `matrices` (the rest float32); keys(writer)
    adds or overrides header keys."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_keys(writer, hf, arch)
    if keys is not None:
        keys(writer)
    write_tensors(writer, gguf_tensors(hf, arch) if tensors is None else tensors, matrices)


def write_tensors(writer, tensors: dict[str, np.ndarray], matrices=gguf.GGMLQuantizationType.F32) -> None:
    """Add `tensors` (matrices of type `matrices`, the rest float32) and write the file out."""
    for name, w in tensors.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 2 and matrices != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(w, matrices)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=matrices)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=CASES)
def trio(request, tmp_path_factory):
    """(case, ringctx from GGUF, ringctx from the HF directory, transformers), one set of weights."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = random_hf_model(request.param)
    hf.save_pretrained(directory)
    path = directory / f"{request.param}.gguf"
    write_model_gguf(path, hf, ARCH[request.param])
    return (request.param, load_model(str(path), dtype=torch.float32, device="cpu"),
            load_model(str(directory), dtype=torch.float32, device="cpu"), hf)


MEASURED: dict[str, float] = {}


def test_gguf_logits_match_transformers_and_the_hf_directory(trio):
    name, from_gguf, from_hf, hf = trio
    assert_gguf_logits_match(name, from_gguf, from_hf, hf, (SHORT, LONG), MEASURED)


def test_gguf_greedy_tokens_equal_transformers(trio):
    """Decode from the GGUF model (windows, Gemma 3's stored gains, LongRoPE past the original
    length) picks transformers' tokens."""
    name, from_gguf, _, hf = trio
    ids = prompt(LONG - 8, seed=2)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids[None], max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.numel():].tolist()
    assert from_gguf.generate(ids, max_new_tokens=6, stop_token_ids=[]).token_ids == ref, name


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "phi4-partial-window", "gemma3"])
def test_the_files_hold_what_transformers_gguf_loader_reads(name, tmp_path):
    """The test's writer against an independent reader of llama.cpp's layout: transformers' own GGUF
    loader (un-permuting llama Q/K, splitting Phi-3's fused tensors, subtracting Gemma's 1) gives
    back every source tensor."""
    from tests.model.test_model_gguf import load_transformers

    hf = random_hf_model(name)
    path = tmp_path / f"{name}.gguf"
    write_model_gguf(path, hf, ARCH[name])
    theirs = load_transformers(str(path)).state_dict()
    for key, value in hf.state_dict().items():
        assert torch.allclose(theirs[key], value, rtol=0, atol=1e-6), (name, key)


def _rounded(value):
    """A config dict with floats to 6 significant digits (GGUF stores float32 keys)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def test_gguf_config_equals_the_hf_config(trio):
    """Every field as read from config.json, but Gemma 3's gains: stored as 1 + w in GGUF, so its
    norms multiply by the stored weight (norm_plus_one False) where config.json's add the 1."""
    name, from_gguf, from_hf, _ = trio
    ours, theirs = from_gguf.config, from_hf.config
    if name == "gemma3":
        assert not ours.norm_plus_one and theirs.norm_plus_one
        ours = dataclasses.replace(ours, norm_plus_one=True)
        windows = [ours.attention(i).window for i in range(7)]
        assert windows == [WINDOW] * 5 + [0, WINDOW] and ours.attention(0).rope_theta == 10_000.0
    assert _rounded(dataclasses.replace(ours, name="x").to_dict()) == \
        _rounded(dataclasses.replace(theirs, name="x").to_dict())


@pytest.mark.parametrize("tp_size,matrices", [(2, "F32"), (4, "F32"), (2, "Q8_0")])
def test_phi3_fused_gguf_tensors_split_for_tensor_parallel_ranks(tp_size, matrices, tmp_path):
    """Each TP rank reads its heads' rows of attn_qkv and its hidden units' rows of the fused
    ffn_up (whole quantized rows, Q8_0 too): every parameter of its shard equals the same slice
    of the whole model's."""
    path = tmp_path / "phi3.gguf"
    write_model_gguf(path, random_hf_model("phi3-longrope"), "phi3", matrices=gguf.GGMLQuantizationType[matrices])
    assert_tp_shards_are_slices(path, tp_size)


def test_gemma3_query_scale_as_llama_cpp_derives_it(tmp_path):
    """llama.cpp has no query_pre_attn_scalar key: 1/sqrt(head_dim), except for the 27B model (62
    layers), 1/sqrt(embedding_length / head_count) = 1/sqrt(168)."""
    for layers, scale in ((62, 168 ** -0.5), (26, 0.0)):
        path = tmp_path / f"gemma3-{layers}.gguf"
        write_header(path, "gemma3", {"block_count": layers, "embedding_length": 5376, "attention.head_count": 32,
                                      "attention.head_count_kv": 16, "attention.key_length": 128,
                                      "attention.value_length": 128, "attention.sliding_window": 1024})
        config = read_gguf_config(str(path))
        assert config.attention(0).scale == scale and config.attention(5).window == 0, layers
        assert config.attention(0).window == 1024 and config.attention(0).rope_theta == 10_000.0


def test_report_measured_errors():
    for name, err in MEASURED.items():
        print(f"{name}: GGUF logits rel err {err:.2e}")


# ------------------------------------------------------------------------------------------------
# Bad headers: one line naming the key and what to do


_HEADER = {"block_count": 4, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
           "feed_forward_length": 128, "context_length": 512, "vocab_size": 256}


def write_header(path, arch: str, keys: dict, tensors: dict[str, np.ndarray] | None = None) -> None:
    """A GGUF file of header keys `{arch}.<key>` (lists: arrays; bools, ints, floats typed so) and
    a few tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {**_HEADER, **keys}.items():
        full = key if "." in key and key.split(".")[0] in ("general", "tokenizer") else f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_string(full, value)
    for name, w in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_FACTORS = {"rope_factors_long.weight": np.full(8, 2.0), "rope_factors_short.weight": np.ones(8)}


@pytest.mark.parametrize("arch,keys,tensors,message", [
    ("llama", {"attention.sliding_window": 0}, None, r"llama\.attention\.sliding_window=0: a window is a positive"),
    ("llama", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 0}, None,
     r"sliding_window_pattern=0: the pattern is a positive layer count"),
    ("qwen2", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False]}, None,
     r"sliding_window_pattern lists 2 layers, but qwen2\.block_count=4: give one entry per layer"),
    ("llama", {"attention.sliding_window_pattern": 4}, None,
     r"sliding_window_pattern without llama\.attention\.sliding_window: add the window or remove the pattern"),
    ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 4}, None,
     r"gemma3\.attention\.sliding_window_pattern=4 disagrees with Gemma 3's layers .*remove the key"),
    ("gemma3", {"attention.sliding_window": 8, "rope.freq_base_swa": 500000.0}, None,
     r"gemma3\.rope\.freq_base_swa=500000.0 disagrees .* remove the key"),
    ("gemma3", {"attention.sliding_window": 8, "attention.scale": 0.5}, None,
     r"gemma3\.attention\.scale=0.5 disagrees with Gemma 3's query scale"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, None, r"gemma3\.attn_logit_softcapping=50.0 is not supported"),
    ("llama", {"final_logit_softcapping": 30.0}, None, r"llama\.final_logit_softcapping=30.0 is not supported"),
    ("llama", {"attention.key_length": 32, "attention.value_length": 16}, None,
     r"llama\.attention\.key_length=32 but llama\.attention\.value_length=16: ringctx needs one head width"),
    ("llama", {"rope.dimension_count": 8}, None, r"llama\.rope\.dimension_count=8 < head dim 16\) are not supported"),
    ("phi3", {"rope.dimension_count": 12, "rope.scaling.original_context_length": 128}, _FACTORS,
     r"rope_factors_long\.weight has 8 entries, but phi3\.rope\.dimension_count=12 rotates 6 frequencies"),
    ("phi3", {"rope.scaling.original_context_length": 128},
     {"rope_factors_long.weight": np.ones(8)}, r"rope_factors_short\.weight is missing: re-convert"),
    ("phi3", {}, _FACTORS, r"without phi3\.rope\.scaling\.original_context_length .* add the key"),
    ("phi3", {"rope.scaling.type": "longrope", "rope.scaling.original_context_length": 128}, None,
     r"LongRoPE \(phi3\.rope\.scaling\.type='longrope' or a factor tensor\) needs both .* "
     r"rope_factors_long\.weight is missing"),
    ("phi3", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0,
              "rope.scaling.original_context_length": 128}, _FACTORS, r"a model has one RoPE scaling"),
    # experts are read (test_model_gguf_moe.py); counts that cannot be are named
    ("llama", {"expert_count": 8, "expert_used_count": 9}, None,
     r"llama\.expert_count=8, llama\.expert_used_count=9: experts_per_token=9 is more than the layer's n_experts=8"),
    ("qwen3moe", {"expert_count": 128}, None, r"qwen3moe\.expert_used_count=None \(a positive count of experts"),
    ("gemma3n", {}, None,
     r"gemma3n\.embedding_length_per_layer_input \(Gemma 3n's per-layer inputs.*not supported yet"),
    ("llama4", {"expert_count": 4, "expert_used_count": 5, "expert_feed_forward_length": 8}, None,
     r"llama4\.expert_count=4, llama4\.expert_used_count=5, .*experts_per_token=5 is more than the layer's n_experts=4"),
    ("llama4", {"attention.sliding_window": 0}, None, r"llama4\.attention\.sliding_window=0 .* is not supported yet"),
])  # gemma4's refusals: test_model_gguf_gemma4.py
def test_bad_gguf_headers_are_one_line_errors(arch, keys, tensors, message, tmp_path):
    path = tmp_path / "bad.gguf"
    write_header(path, arch, keys, tensors)
    with pytest.raises(ValueError, match=message) as info:
        read_gguf_config(str(path))
    assert "\n" not in str(info.value) and "bad.gguf" in str(info.value)


def test_phi3_longrope_header_of_older_converters(tmp_path):
    """Older llama.cpp converters wrote no rope.scaling.type for Phi-3, and a file may lack
    rope.scaling.attn_factor: the factor tensors alone make it LongRoPE, factor context / original
    and cos/sin factor sqrt(1 + ln(factor) / ln(original)) as transformers computes it."""
    path = tmp_path / "phi3-old.gguf"
    write_header(path, "phi3", {"rope.scaling.original_context_length": 128, "context_length": 512}, _FACTORS)
    scaling = read_gguf_config(str(path)).rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position) == ("longrope", 4.0, 128)
    assert scaling.long_factor == (2.0,) * 8 and scaling.short_factor == (1.0,) * 8
    assert abs(scaling.attention_factor - math.sqrt(1 + math.log(4.0) / math.log(128))) < 1e-12
