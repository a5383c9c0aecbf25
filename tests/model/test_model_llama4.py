"""Llama 4's attention against transformers 5.25's Llama4ForCausalLM (and the text model of
Llama4ForConditionalGeneration), with every layer dense (moe_layers=[]): interleaved rotary pairs
(the checkpoint's q/k rows permuted at load), aligned chunks on the RoPE layers with weightless
q/k norms after RoPE, and NoPE layers whose queries are scaled by log1p(floor((p + 1) / floor_scale))
* attn_scale + 1.

As in test_model_families_long.py, each reference is built with transformers' own config class,
given random weights, saved with `save_pretrained` and loaded by ringctx from that directory;
float32 on the CPU. The chunks (16) and floor_scale (8) are small, so that chunk boundaries fall
inside the prompts and the temperature changes many times within them.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_hf import read_hf_config
from tests.helpers import (assert_tp_shards_are_slices,
                           assert_greedy_matches, assert_logits_match, hf_logits, one_thread_for_module,
                           random_hf_model_of, rel_err, saved_hf_pair)
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
CHUNK = 16
"""attention_chunk_size of the RoPE layers."""
FLOOR = 8
"""floor_scale: the NoPE layers' query temperature steps every FLOOR positions."""
SHORT, LONG = 20, 70

TEXT = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=64, intermediate_size_mlp=128, moe_layers=[], no_rope_layers=[1, 1, 0, 1],
            attention_chunk_size=CHUNK, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=FLOOR,
            attn_scale=0.5, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
"""A tiny Llama 4 text model: layers 0, 1 and 3 chunked with RoPE and q/k norms, layer 2 global NoPE
with the temperature (attn_scale larger than the released 0.1, so that it weighs)."""

VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
"""A tiny vision tower: ringctx ignores it, transformers needs one to build the model."""


def hf_config(name: str):
    import transformers

    cases = {
        "llama4-text": lambda: transformers.Llama4TextConfig(**TEXT),
        # Scout's llama3 RoPE scaling (low_freq_factor == high_freq_factor), biases on q/k/v/o (the
        # permuted rows include the q and k biases), tied embeddings, two NoPE layers
        "llama4-text-scaled-bias": lambda: transformers.Llama4TextConfig(
            **{**TEXT, "no_rope_layers": [0, 1, 1, 0]}, attention_bias=True, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 32}),
        # Llama4ForConditionalGeneration: the same text model as language_model.*
        "llama4-vlm": lambda: transformers.Llama4Config(
            text_config=transformers.Llama4TextConfig(**TEXT), vision_config=transformers.Llama4VisionConfig(**VISION),
            image_token_index=255, boi_token_index=253, eoi_token_index=254),
    }
    return cases[name]()


def random_hf_model(name: str, seed: int = 0):
    """transformers' model of case `name`, every parameter random (norms and biases too)."""
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    return random_hf_model_of(hf_config(name), seed)


CASES = ["llama4-text", "llama4-text-scaled-bias", "llama4-vlm"]


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(case name, ringctx model, transformers model, directory) with the same weights."""
    return saved_hf_pair(request.param, random_hf_model, tmp_path_factory)



MEASURED: dict[str, float] = {}
"""The largest logits rel err per case (printed at the end with -s: the report's numbers)."""


def test_logits_match_transformers(pair):
    assert_logits_match(pair, [prompt(SHORT), prompt(LONG)], MEASURED)


def test_greedy_tokens_equal_transformers(pair):
    """ringctx's decode loop (one query a step: its temperature from its own position) picks the
    same tokens as transformers' generate."""
    assert_greedy_matches(pair, prompt(LONG - 8, seed=2))


def test_config_is_read_as_written(pair):
    name, ours, hf, _ = pair
    c = ours.config
    text = hf.config.get_text_config()
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size, c.ffn_dim) == (
        text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
        text.vocab_size, text.intermediate_size_mlp)
    n_hf = sum(p.numel() for n, p in hf.named_parameters() if "vision" not in n and "multi_modal" not in n)
    assert c.n_params == n_hf, (name, c.n_params, n_hf)
    for i, rope in enumerate(text.no_rope_layers):
        kind = c.attention(i)
        assert kind.rope == bool(rope) and kind.chunk == (CHUNK if rope else 0), (name, i)
        assert kind.qk_norm_after_rope == bool(rope)
        assert (kind.temperature_floor, kind.temperature_scale) == ((0, 0.0) if rope else (FLOOR, 0.5))
    assert c.is_llama_block and not c.qk_norm
    if "bias" in name:
        assert c.qkv_bias and c.attn_out_bias and c.tie_embeddings
        assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 16.0


def test_report_measured_errors():
    """Prints the largest logits error of each case (run with -s)."""
    for name, err in MEASURED.items():
        print(f"{name}: logits rel err {err:.2e}")


# ------------------------------------------------------------------------------------------------
# Each ingredient matters (the oracle tests above could not pass without it)


def test_each_llama4_ingredient_moves_the_logits(tmp_path, monkeypatch):
    """Leaving out the q/k row permutation, the q/k norms or the temperature puts the logits far
    outside the 1e-4 the oracle tests hold them to."""
    import ringctx.model.weights_hf as weights_hf

    hf = random_hf_model("llama4-text")
    hf.save_pretrained(tmp_path)
    ids = prompt(LONG)
    ref = hf_logits(hf, ids)
    errors = {}
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    errors["all"] = rel_err(model.logits(ids), ref)
    for block in model.layers:
        block.attention.norm_after_rope_eps = None
    errors["no q/k norm"] = rel_err(model.logits(ids), ref)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    model._temperature_layers = []
    errors["no temperature"] = rel_err(model.logits(ids), ref)
    monkeypatch.setattr(weights_hf, "permute_interleaved_rotary", lambda value, head_dim: value)
    errors["rows as stored"] = rel_err(load_model(str(tmp_path), dtype=torch.float32, device="cpu").logits(ids), ref)
    assert errors["all"] < 1e-4 and min(errors.values()) == errors["all"], errors
    assert all(err > 1e-2 for what, err in errors.items() if what != "all"), errors


def test_query_temperature_is_transformers_formula():
    """log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, exact integers in the floor (float32
    (p + 1.0) stops being exact past 2^24), 1.0 below floor_scale - 1."""
    from ringctx.model.config import LayerAttention

    kind = LayerAttention(rope=False, temperature_floor=8192, temperature_scale=0.1)
    positions = torch.tensor([0, 8190, 8191, 16383, 1_000_000, 2**24 + 8191, 10**9])
    want = torch.tensor([torch.log1p(torch.tensor(float((p + 1) // 8192), dtype=torch.float64)) * 0.1 + 1
                         for p in positions.tolist()], dtype=torch.float32)
    got = kind.query_temperature(positions)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] > 1.0
    assert torch.equal(LayerAttention().query_temperature(positions), torch.ones(7))
    with pytest.raises(ValueError, match="temperature_scale=0.1 needs a positive temperature_floor"):
        LayerAttention(temperature_scale=0.1)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_permuted_rows_split_for_tensor_parallel_ranks(tp_size, tmp_path):
    """Each TP rank permutes its own heads' rows: every parameter of its shard equals the same slice
    of the whole model's (the permutation stays inside each head)."""
    random_hf_model("llama4-text-scaled-bias").save_pretrained(tmp_path)
    assert_tp_shards_are_slices(tmp_path, tp_size)


def test_bf16_logits_stay_close_to_float32_transformers(tmp_path):
    """In bf16 (weights and activations) the greedy pick of every position of a 70-token prompt
    equals float32 transformers' where its top two logits are apart."""
    hf = random_hf_model("llama4-text")
    hf.save_pretrained(tmp_path)
    ids = prompt(LONG)
    ref = hf_logits(hf, ids)
    got = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu").logits(ids)
    assert rel_err(got, ref) < 3e-2
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * ref.abs().max()
    assert clear.sum() > 10 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


# ------------------------------------------------------------------------------------------------
# Config spellings and refusals


def test_transformers_defaults_fill_a_sparse_config():
    """A config.json that leaves Llama 4's keys out reads as Llama4TextConfig's defaults: every 4th
    layer NoPE with the temperature (8,192, 0.1), the others in chunks of 8,192 with q/k norms."""
    import transformers

    sparse = {"model_type": "llama4_text", "vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 8,
              "num_attention_heads": 16, "intermediate_size": 64, "moe_layers": []}
    config = read_hf_config(sparse)
    reference = transformers.Llama4TextConfig(**{k: v for k, v in sparse.items() if k != "model_type"})
    assert (config.head_dim, config.n_kv_heads, config.ffn_dim, config.norm_eps, config.rope_theta,
            config.max_seq_len) == (reference.head_dim, reference.num_key_value_heads, reference.intermediate_size_mlp, reference.rms_norm_eps,
        reference.rope_parameters["rope_theta"], reference.max_position_embeddings)
    assert [config.attention(i).rope for i in range(8)] == [bool(r) for r in reference.no_rope_layers]
    assert config.attention(3).temperature_floor == 8192 and config.attention(3).temperature_scale == 0.1
    assert config.attention(0).chunk == 8192 and config.attention(0).qk_norm_after_rope


def test_layers_without_qk_norm_or_temperature_or_chunks():
    """use_qk_norm false (Maverick), attn_temperature_tuning false, attention_chunk_size null: the
    layers keep only what is on."""
    base = {**TEXT, "model_type": "llama4_text"}
    config = read_hf_config({**base, "use_qk_norm": False, "attn_temperature_tuning": False,
                             "attention_chunk_size": None})
    assert [config.attention(i).describe() for i in range(4)] == ["full", "full", "full, NoPE", "full"]


@pytest.mark.parametrize("config,message", [
    ({**TEXT, "model_type": "llama4_text", "no_rope_layers": [1, 0]}, r"no_rope_layers lists 2 layers"),
    ({**TEXT, "model_type": "llama4_text", "floor_scale": 0.5}, r"floor_scale=0.5"),
    ({**TEXT, "model_type": "llama4_text", "hidden_act": "gelu"}, r"hidden_act='gelu'"),
])
def test_unsupported_llama4_variants_are_refused_in_one_line(config, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        read_hf_config(tmp_path)
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_tiny_llama4_preset_has_llama4_attention():
    """The preset of the 1M-token run: chunked RoPE layers with q/k norms, a NoPE layer with the
    released models' temperature; declined by the fused C paths (they compute plain layers)."""
    from ringctx.model.decode_step import _layers_fit
    from ringctx.model.presets import get_preset

    config = get_preset("tiny-llama4")
    assert config.attention_summary() == "3 chunk 8192, q/k norm + 1 full, NoPE, temperature /8192"
    assert config.attention(3).temperature_scale == 0.1
    again = type(config).from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.fingerprint() == config.fingerprint()
    assert not _layers_fit(load_model("tiny-llama4", dtype=torch.float32, device="cpu"))
