"""GGUF files of the linear-attention hybrids (llama.cpp's qwen35, qwen35moe, qwen3next) against
transformers 5.25 and against the same weights loaded from their Hugging Face directory.

Each case is a tiny transformers model with random weights (its own config class: Qwen3.5 dense,
with YaRN too, Qwen3.5-MoE, Qwen3-Next), saved with `save_pretrained`, and written as GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it (`converted_tensors`, `converter_keys`, following its
Qwen3NextModel and _LinearAttentionVReorderBase classes step by step): the gguf package's names,
A_log stored as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the convolution squeezed to [C, K],
every norm but the Gated DeltaNet's stored as 1 + w, Qwen3-Next's in_proj_qkvz reordered into
attn_qkv (q | k | v) and attn_gate (z), Qwen3.5's value heads moved into llama.cpp's tiled order,
experts stacked by kind, and the header's ssm.* keys, full_attention_interval and partial
rope.dimension_count. ringctx loads both; logits must match transformers within 1e-5 (float32)
and the directory's within 1e-6, greedy tokens transformers', the configs must be equal
(fingerprints too) and the parameters the directory's. Also: TP shards, Q8_0 matrices, experts
fused as ffn_gate_up_exps, an older Qwen3-Next file's ssm_in, a multi-token-prediction block past
the trunk. Other recurrences' files (Mamba, RWKV, Kimi Linear) and bad hybrid headers are
one-line errors.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from ringctx.model import load_model
from ringctx.model.config_gguf import read_gguf_config
from tests.helpers import assert_gguf_logits_match, assert_tp_shards_are_slices, one_thread_for_module, random_hf_model_of, rel_err
from tests.model.test_model_families import prompt
from tests.model.test_model_gguf_families import _rounded, write_header, write_tensors

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

TRANSFORMERS_VERSION = "5.25.0"
SHORT, LONG = 20, 70
INTERVAL = 4
"""full_attention_interval: transformers' default layer_types (every 4th layer attends), as the
converter writes it; the configs below keep those layer_types."""

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             max_position_embeddings=512, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


def hf_config(name: str):
    import transformers

    return {
        # Qwen3.5 dense: 2 key heads serving 4 value heads (the converter's tiled value heads show)
        "qwen35": lambda: transformers.Qwen3_5TextConfig(**SHAPE, intermediate_size=96, linear_num_key_heads=2,
                                                         linear_num_value_heads=4),
        # Qwen3.5-MoE: no dense width (the converter writes no feed_forward_length), tied embeddings, Hv = 3 Hk
        "qwen35moe": lambda: transformers.Qwen3_5MoeTextConfig(**SHAPE, **MOE, linear_num_key_heads=2,
                                                               linear_num_value_heads=6, tie_word_embeddings=True),
        # Qwen3-Next: grouped projections in_proj_qkvz / in_proj_ba, Hv = 2 Hk
        "qwen3next": lambda: transformers.Qwen3NextConfig(**SHAPE, **MOE, intermediate_size=96,
                                                          linear_num_key_heads=2, linear_num_value_heads=4),
        # Qwen3.5 past its trained context (its 1M): YaRN over the rotated half of each head
        "qwen35-yarn": lambda: transformers.Qwen3_5TextConfig(
            **SHAPE, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}),
    }[name]()


CASES = {"qwen35": "qwen35", "qwen35moe": "qwen35moe", "qwen3next": "qwen3next",
         "qwen3next-ssm_in": "qwen3next", "qwen35-yarn": "qwen35"}
"""Case -> its GGUF architecture (its model: `hf_config(case)`, but qwen3next-ssm_in: qwen3next's
model in an older converter's file, the checkpoint's grouped in_proj_qkvz stored whole as ssm_in)."""


def random_hf_model(name: str, seed: int = 0):
    import transformers

    assert transformers.__version__ == TRANSFORMERS_VERSION
    model = random_hf_model_of(hf_config(name), seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith(("A_log", "dt_bias")):  # decays of several speeds
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in param_name and "linear_attn" not in param_name:  # zero-centred: gains 1 + w around 1
                p.copy_(torch.rand_like(p) - 0.5)
    return model


def _reorder_v_heads(t: torch.Tensor, dim: int, hk: int, group: int, width: int) -> torch.Tensor:
    """The converter's _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key
    head (k G + g) -> llama.cpp's tiled order (g Hk + k) along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hk, group, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def converted_tensors(hf, arch: str, legacy_ssm_in: bool = False) -> dict[str, np.ndarray]:
    """hf's tensors as convert_hf_to_gguf.py writes them for `arch` (module docstring), in float32."""
    c = hf.config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    group = hv // hk
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, w in hf.state_dict().items():
        w = w.float()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch != "qwen3next" and hk != hv and "linear_attn." in name:  # _LinearAttentionVReorderBase
            if ".in_proj_qkv." in name:
                w = torch.cat([w[:2 * hk * dk], _reorder_v_heads(w[2 * hk * dk:], 0, hk, group, dv)])
            elif ".in_proj_z." in name:
                w = _reorder_v_heads(w, 0, hk, group, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                w = _reorder_v_heads(w, 0, hk, group, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                w = _reorder_v_heads(w.unsqueeze(-1), 0, hk, group, 1).squeeze(-1)
            elif ".conv1d" in name:
                w = w.squeeze()
                w = torch.cat([w[:2 * hk * dk], _reorder_v_heads(w[2 * hk * dk:], 0, hk, group, dv)])
            elif ".out_proj." in name:
                w = _reorder_v_heads(w, 1, hk, group, dv)
        # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            w = -torch.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            w = w.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if "in_proj_qkvz.weight" in name and not legacy_ssm_in:  # [q, k, v, z] per key head -> q | k | v, z
            split = [dk, dk, group * dv, group * dv]
            q, k, v, z = torch.split(w.t().contiguous().view(-1, hk, sum(split)), split, dim=-1)
            flat = [part.contiguous().view(c.hidden_size, -1) for part in (q, k, v, z)]
            out[f"{blk}.attn_qkv.weight"] = torch.cat(flat[:3], dim=-1).t().numpy()
            out[f"{blk}.attn_gate.weight"] = flat[3].t().numpy()
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel: [E, 2F, dim] -> gate, up [E, F, dim]
            F = w.shape[1] // 2
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = w[:, :F].numpy(), w[:, F:].numpy()
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[f"{blk}.ffn_down_exps.weight"] = w.numpy()
            continue
        mapped = names.get_name(name)  # A_log: no suffix (blk.N.ssm_a)
        if mapped is None:
            base, suffix = name.rsplit(".", 1)
            mapped = f"{names.get_name(base)}.{suffix}"
        out[mapped] = w.numpy()
    return out


def converter_keys(hf, arch: str):
    """keys(writer): the header convert_hf_to_gguf.py writes (TextModel's, Qwen2MoeModel's and
    Qwen3NextModel's set_gguf_parameters)."""
    c = hf.config
    rope = c.rope_parameters
    types = ["linear_attention" if (i + 1) % INTERVAL else "full_attention" for i in range(c.num_hidden_layers)]
    assert list(c.layer_types) == types  # the file states the layers by full_attention_interval only

    def keys(writer: gguf.GGUFWriter) -> None:
        writer.add_block_count(c.num_hidden_layers)
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        if getattr(c, "intermediate_size", None) is not None:
            writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_bos_token_id(c.bos_token_id)
        writer.add_eos_token_id(c.eos_token_id)
        if arch != "qwen35":
            writer.add_expert_count(c.num_experts)
            writer.add_expert_used_count(c.num_experts_per_tok)
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
            writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        writer.add_ssm_state_size(c.linear_key_head_dim)
        writer.add_ssm_group_count(c.linear_num_key_heads)
        writer.add_ssm_time_step_rank(c.linear_num_value_heads)
        writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        writer.add_full_attention_interval(INTERVAL)
        writer.add_rope_dimension_count(int(c.head_dim * rope["partial_rotary_factor"]))
    return keys


def write_hybrid_gguf(path, hf, arch: str, keys=None, tensors=None, legacy_ssm_in: bool = False,
                      matrices=gguf.GGMLQuantizationType.F32) -> str:
    """hf's model as a GGUF file (`converted_tensors`); its matrices whose rows are whole blocks of
    type `matrices` in that type (not the convolution [C, K], as llama.cpp's converter keeps it),
    the rest float32; keys(writer) adds header keys after the converter's; tensors replaces the
    stored ones."""
    writer = gguf.GGUFWriter(str(path), arch)
    converter_keys(hf, arch)(writer)
    if keys is not None:
        keys(writer)
    block = gguf.GGML_QUANT_SIZES[matrices][0]
    for name, w in (converted_tensors(hf, arch, legacy_ssm_in) if tensors is None else tensors).items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 2 and w.shape[1] % block == 0 and matrices != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(w, matrices)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=matrices)
        else:
            writer.add_tensor(name, w)
    write_tensors(writer, {})
    return str(path)


@pytest.fixture(scope="module", params=list(CASES))
def trio(request, tmp_path_factory):
    """(case, ringctx from GGUF, ringctx from the HF directory, transformers)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    hf = random_hf_model(name.removesuffix("-ssm_in"))
    hf.save_pretrained(directory)
    path = write_hybrid_gguf(directory / f"{name}.gguf", hf, CASES[name], legacy_ssm_in=name.endswith("ssm_in"))
    return (name, load_model(path, dtype=torch.float32, device="cpu"),
            load_model(str(directory), dtype=torch.float32, device="cpu"), hf)


MEASURED: dict[str, float] = {}


def test_gguf_logits_match_transformers_and_the_hf_directory(trio):
    name, from_gguf, from_hf, hf = trio
    # against the HF directory: the same weights but A_log's rounding
    assert_gguf_logits_match(name, from_gguf, from_hf, hf, (SHORT, LONG), MEASURED, tol=1e-5, tol_directory=1e-6)


def test_gguf_greedy_tokens_equal_transformers(trio):
    """Decode from the GGUF model (the linear layers' states carried token to token) picks
    transformers' tokens."""
    name, from_gguf, _, hf = trio
    ids = prompt(LONG - 8, seed=2)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids[None], max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.numel():].tolist()
    assert from_gguf.generate(ids, max_new_tokens=6, stop_token_ids=[]).token_ids == ref, name


def test_gguf_config_equals_the_hf_config(trio):
    """Every field as read from config.json (the norms' stored 1 + w are undone by the loader, so
    norm_plus_one holds as in the checkpoint), and so the fingerprint."""
    name, from_gguf, from_hf, _ = trio
    ours, theirs = from_gguf.config, from_hf.config
    assert ours.fingerprint() == theirs.fingerprint(), name
    assert _rounded(dataclasses.replace(ours, name="x").to_dict()) == \
        _rounded(dataclasses.replace(theirs, name="x").to_dict())
    assert ours.has_linear and ours.attn_output_gate and ours.norm_plus_one


def test_gguf_parameters_equal_the_hf_directory_ones(trio):
    """Every transform the converter applied is undone: each parameter equals the one read from
    the checkpoint, exactly, but for A_log (within a rounding of exp and log) and the zero-centred
    norms, whose gains 1 + w are equal (the file holds float32 1 + w, not w's last bits)."""
    name, from_gguf, from_hf, _ = trio
    theirs = dict(from_hf.named_parameters())
    for key, value in from_gguf.named_parameters():
        if key.endswith("A_log"):
            assert torch.allclose(value, theirs[key], rtol=0, atol=1e-6), (name, key)
        elif key.endswith("norm.weight"):  # every norm of ours but the Gated DeltaNet's norm_weight
            assert torch.equal(1 + value, 1 + theirs[key]), (name, key)
        else:
            assert torch.equal(value, theirs[key]), (name, key)


def test_report_measured_errors():
    for name, err in MEASURED.items():
        print(f"{name}: GGUF logits rel err {err:.2e}")


@pytest.mark.parametrize("name,matrices", [("qwen35", "F32"), ("qwen3next", "Q8_0")])
def test_hybrid_gguf_tensors_split_for_tensor_parallel_ranks(name, matrices, tmp_path):
    """Each TP rank of 2 reads its key heads' (and their value heads') rows of the linear layers
    (value heads untiled first), its query heads' rows of attn_q's query and gate, its experts'
    share (Q8_0 matrices too): every parameter of its shard equals the same slice of the whole model's."""
    path = write_hybrid_gguf(tmp_path / f"{name}.gguf", random_hf_model(name), CASES[name],
                             matrices=gguf.GGMLQuantizationType[matrices])
    assert_tp_shards_are_slices(path, 2, what=(name,))


def test_quantized_hybrid_gguf_loads_its_dequantized_values(tmp_path):
    """Q8_0 matrices (each row whole blocks; the convolution and 1-D tensors stay float32, as
    llama.cpp's converter keeps them): the model equals the one loaded from a float32 file of the
    same dequantized values, the transforms (value-head order, the norms' 1) applied after."""
    hf = random_hf_model("qwen35moe")
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = converted_tensors(hf, "qwen35moe")
    rounded = {k: (gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w), q8), q8)
                   if w.ndim == 2 and w.shape[1] % 32 == 0 else w) for k, w in tensors.items()}
    assert any(not np.array_equal(rounded[k], tensors[k]) for k in tensors)
    quantized = load_model(write_hybrid_gguf(tmp_path / "q8.gguf", hf, "qwen35moe", matrices=q8),
                           dtype=torch.float32, device="cpu")
    exact = load_model(write_hybrid_gguf(tmp_path / "f32.gguf", hf, "qwen35moe", tensors=rounded),
                       dtype=torch.float32, device="cpu")
    theirs = dict(exact.named_parameters())
    for key, value in quantized.named_parameters():
        assert torch.equal(value, theirs[key]), key
    ids = prompt(SHORT)
    assert rel_err(quantized.logits(ids), exact.logits(ids)) == 0.0


def test_fused_gate_up_experts_load_as_the_stacked_ones(tmp_path):
    """A file written with the converter's --fuse-gate-up-exps (each layer's ffn_gate_up_exps [E,
    2F, dim]: torch.cat of gate and up on dim 1, as ModelBase.modify_tensors fuses them) gives the
    model of the file with ffn_gate_exps / ffn_up_exps, under TP 2 too."""
    hf = random_hf_model("qwen3next")
    tensors = converted_tensors(hf, "qwen3next")
    fused = {k: v for k, v in tensors.items() if not k.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight"))}
    for i in range(hf.config.num_hidden_layers):
        fused[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate(
            [tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]], axis=1)
    stacked = dict(load_model(write_hybrid_gguf(tmp_path / "stacked.gguf", hf, "qwen3next"), dtype=torch.float32,
                              device="cpu").named_parameters())
    path = write_hybrid_gguf(tmp_path / "fused.gguf", hf, "qwen3next", tensors=fused)
    for key, value in load_model(path, dtype=torch.float32, device="cpu").named_parameters():
        assert torch.equal(value, stacked[key]), key
    assert_tp_shards_are_slices(path, 2, whole=stacked, what=("fused",))


def test_prediction_blocks_past_the_trunk_are_left_out(tmp_path):
    """A file with nextn_predict_layers = 1 (llama.cpp's qwen35 keeps a multi-token-prediction
    block after the trunk's, counted in block_count): the trunk is the model, the block's
    tensors are not read."""
    hf = random_hf_model("qwen35")
    n = hf.config.num_hidden_layers
    tensors = converted_tensors(hf, "qwen35")
    extra = {name.replace(f"blk.{n - 3}.", f"blk.{n}."): w for name, w in tensors.items()
             if name.startswith(f"blk.{n - 3}.")}  # an attention block's tensors, as the MTP block has
    extra[f"blk.{n}.nextn.eh_proj.weight"] = np.zeros((64, 128), dtype=np.float32)

    def keys(writer):
        writer.add_nextn_predict_layers(1)
        writer.kv_data[0]["qwen35.block_count"].value = n + 1  # the converter counts the block in

    path = write_hybrid_gguf(tmp_path / "mtp.gguf", hf, "qwen35", keys=keys, tensors={**tensors, **extra})
    model = load_model(path, dtype=torch.float32, device="cpu")
    assert model.config.n_layers == n
    ids = prompt(SHORT)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert rel_err(model.logits(ids), ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# Headers: the layer kinds as llama.cpp reads them, and one line naming what is wrong


_SSM = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
        "ssm.inner_size": 64, "attention.key_length": 16, "attention.value_length": 16, "rope.dimension_count": 4}


def test_recurrent_layers_array_states_the_layer_kinds(tmp_path):
    """attention.recurrent_layers (one bool per block, true: linear) wins over
    full_attention_interval, as in llama.cpp's loaders; without either, every 4th layer attends."""
    path = tmp_path / "kinds.gguf"
    write_header(path, "qwen35", {**_SSM, "full_attention_interval": 2,
                                  "attention.recurrent_layers": [True, False, False, True]})
    config = read_gguf_config(str(path))
    assert [config.linear(i) is not None for i in range(4)] == [True, False, False, True]
    assert config.linear(0).value_heads == 4 and config.linear(0).value_dim == 16
    write_header(path, "qwen35", _SSM)
    assert [read_gguf_config(str(path)).linear(i) is not None for i in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("arch,keys,message", [
    ("mamba", {}, r"general\.architecture='mamba' computes Mamba's selective state space, a recurrence ringctx "
                  r"does not compute; it runs the Gated DeltaNet hybrids qwen35, qwen35moe, qwen3next"),
    ("rwkv7", {}, r"general\.architecture='rwkv7' computes RWKV-7's time mixing, a recurrence"),
    ("kimi-linear", {}, r"'kimi-linear' computes Kimi Linear's delta attention \(KDA\), a recurrence"),
    ("qwen35", {**_SSM, "ssm.inner_size": 62}, r"qwen35\.ssm\.inner_size=62.*inner_size a multiple of time_step_rank"),
    ("qwen35", {**_SSM, "ssm.time_step_rank": 3, "ssm.inner_size": 48},
     r"qwen35\.ssm\.group_count=2, .*value_heads=3 is not a multiple of key_heads=2"),
    ("qwen35", {**_SSM, "full_attention_interval": 0}, r"qwen35\.full_attention_interval=0: a positive layer count"),
    ("qwen35", {**_SSM, "full_attention_interval": 5}, r"every layer of the file is linear attention"),
    ("qwen35", {**_SSM, "attention.recurrent_layers": [True, False]},
     r"qwen35\.attention\.recurrent_layers=\[True, False\]: give one bool per block \(4"),
    ("qwen35", {**_SSM, "rope.dimension_sections": [1, 1, 1, 0]},
     r"qwen35\.rope\.dimension_sections=\[1, 1, 1, 0\] turn 6 dims, but qwen35\.rope\.dimension_count=4"),
    ("qwen35", {**_SSM, "nextn_predict_layers": 4}, r"qwen35\.nextn_predict_layers=4 with qwen35\.block_count=4"),
    ("qwen3next", {**_SSM, "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 8,
                   "expert_shared_feed_forward_length": 1.5},
     r"qwen3next\.expert_shared_feed_forward_length=1\.5 \(a count of units\)"),
    ("qwen35", {"ssm.conv_kernel": 4}, r"GGUF header lacks 'qwen35\.ssm\.group_count'"),
])
def test_bad_hybrid_headers_are_one_line_errors(arch, keys, message, tmp_path):
    path = tmp_path / "bad.gguf"
    write_header(path, arch, keys)
    with pytest.raises(ValueError, match=message) as info:
        read_gguf_config(str(path))
    assert "\n" not in str(info.value) and "bad.gguf" in str(info.value)


def test_text_rope_sections_covering_the_rotated_dims_are_plain_rope(tmp_path):
    """Qwen3.5's multimodal sections (mrope_section [11, 11, 10] for 64 rotated dims; here 2 pairs)
    turn a text token as plain partial RoPE: the config is the one without the key."""
    path = tmp_path / "sections.gguf"
    write_header(path, "qwen35", {**_SSM, "rope.dimension_sections": [1, 1, 0, 0]})
    with_sections = read_gguf_config(str(path))
    write_header(path, "qwen35", _SSM)
    assert with_sections == read_gguf_config(str(path))
    assert with_sections.attention(3).rotary_dim == 4


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("blk.0.ssm_a"), r"1 weight tensor\(s\) missing: blk\.0\.ssm_a; the checkpoint is incomplete"),
    (lambda t: t.update({"blk.1.attn_qkv.weight": t["blk.1.attn_qkv.weight"][:-16]}),
     r"tensor 'blk\.1\.attn_qkv\.weight' has shape \(112, 64\), but the model config needs \(128, 64\)"),
    (lambda t: t.update({"blk.3.attn_q.weight": t["blk.3.attn_q.weight"][:32]}),
     r"tensor 'blk\.3\.attn_q\.weight' has shape \(32, 64\), but the model config needs \(128, 64\) \(each query "
     r"head's rows, then its output gate's\)"),
    (lambda t: t.update({"blk.0.ssm_in.weight": np.zeros((192, 64), np.float32)}),  # qwen3next's, not qwen35's
     r"unexpected tensor 'blk\.0\.ssm_in\.weight': ringctx's Llama-family decoder has no place for it"),
])
def test_bad_hybrid_tensors_are_one_line_errors(change, message, tmp_path):
    hf = random_hf_model("qwen35")
    tensors = converted_tensors(hf, "qwen35")
    change(tensors)
    path = write_hybrid_gguf(tmp_path / "bad.gguf", hf, "qwen35", tensors=tensors)
    with pytest.raises(ValueError, match=message) as info:
        load_model(path, dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value) and "bad.gguf" in str(info.value)
