"""GGUF loading: every tensor type, llama.cpp's rotary permutation, RoPE scaling, bad files.

Small GGUF files are written here with gguf.GGUFWriter the way llama.cpp's converter writes them
(llama.cpp names, Q/K rows permuted for Llama). Types the gguf package can quantize are quantized
with gguf.quants.quantize; the K- and I-quants, which it can only dequantize, get random blocks with
sane scales. Each file is loaded by ringctx and by transformers (gguf_file=...), and every weight is
compared with the gguf package's own dequantization and with transformers' tensors.
"""

from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch

from ringctx.model.config import ModelConfig, RopeScaling
from ringctx.model.config_hf import hf_config_dict
from ringctx.model.presets import get_preset
from ringctx.model import load_model
from ringctx.model.weights_gguf import unpermute_rotary_rows
from tests.helpers import one_thread_for_module, rel_err

Q = gguf.GGMLQuantizationType

# Byte offsets of the float16 scale fields inside one block, for types gguf cannot quantize.
_F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
               Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}

ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ2_0,
             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)



def encode(w: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """w [rows, cols] float32 -> the bytes of a `qtype` tensor (quantized, or random blocks)."""
    if qtype not in _F16_FIELDS:
        return gguf.quants.quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(w.size // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.004, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(w.shape[0], -1)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, config: ModelConfig, arch: str = "llama", types=(Q.F32,), seed: int = 0,
               rope_freqs: list[float] | None = None, extra: dict[str, np.ndarray] | None = None,
               weights: dict[str, np.ndarray] | None = None, add_keys=None) -> dict[str, np.ndarray]:
    """A model of `config` as a GGUF file; matrices cycle through `types`. Returns the stored tensors.

    weights: llama.cpp-named float tensors in Hugging Face row order; random ones by default.
    add_keys: called with the GGUFWriter to add header keys (RoPE scaling, say).
    """
    rng = np.random.default_rng(seed)
    D, hq, hkv = config.head_dim, config.n_heads, config.n_kv_heads
    tensors: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0, 0.02, (config.vocab_size, config.dim))}
    if not config.tie_embeddings:
        tensors["output.weight"] = rng.normal(0, 0.02, (config.vocab_size, config.dim))
    tensors["output_norm.weight"] = rng.uniform(0.5, 1.5, config.dim)
    for i in range(config.n_layers):
        b = f"blk.{i}"
        tensors[f"{b}.attn_norm.weight"] = rng.uniform(0.5, 1.5, config.dim)
        tensors[f"{b}.ffn_norm.weight"] = rng.uniform(0.5, 1.5, config.dim)
        for name, rows in (("attn_q", hq * D), ("attn_k", hkv * D), ("attn_v", hkv * D)):
            tensors[f"{b}.{name}.weight"] = rng.normal(0, 0.02, (rows, config.dim))
            if config.qkv_bias:
                tensors[f"{b}.{name}.bias"] = rng.normal(0, 0.05, rows)
        tensors[f"{b}.attn_output.weight"] = rng.normal(0, 0.02, (config.dim, hq * D))
        if config.qk_norm:
            tensors[f"{b}.attn_q_norm.weight"] = rng.uniform(0.5, 1.5, D)
            tensors[f"{b}.attn_k_norm.weight"] = rng.uniform(0.5, 1.5, D)
        tensors[f"{b}.ffn_gate.weight"] = rng.normal(0, 0.02, (config.ffn_dim, config.dim))
        tensors[f"{b}.ffn_up.weight"] = rng.normal(0, 0.02, (config.ffn_dim, config.dim))
        tensors[f"{b}.ffn_down.weight"] = rng.normal(0, 0.02, (config.dim, config.ffn_dim))
    if weights is not None:
        assert weights.keys() == tensors.keys(), set(weights) ^ set(tensors)
        tensors = dict(weights)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("ringctx test model")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(hq)
    writer.add_head_count_kv(hkv)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(D)
    writer.add_key_length(D)  # as llama.cpp writes it: head_dim may differ from dim / heads
    writer.add_value_length(D)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_keys is not None:
        add_keys(writer)
    matrix_index = 0
    for name, w in tensors.items():
        w = w.astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_permute(w, hq if ".attn_q." in name else hkv)
        qtype = Q.F32
        if w.ndim == 2:
            qtype = types[matrix_index % len(types)]
            matrix_index += 1
        data = encode(w, qtype, rng)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        tensors[name] = data
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def load_transformers(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, local_files_only=True).eval()


def hf_state_for_ours(hf, config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' tensors rearranged into ringctx's parameter names (fused wqkv and w13)."""
    sd = hf.state_dict()
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not config.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(config.n_layers):
        h, o = f"model.layers.{i}", f"layers.{i}"
        out[f"{o}.attention_norm.weight"] = sd[f"{h}.input_layernorm.weight"]
        out[f"{o}.ffn_norm.weight"] = sd[f"{h}.post_attention_layernorm.weight"]
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            out[f"{o}.attention.wqkv.{kind}"] = torch.cat([sd[f"{h}.self_attn.{x}_proj.{kind}"] for x in "qkv"])
        out[f"{o}.attention.wo.weight"] = sd[f"{h}.self_attn.o_proj.weight"]
        out[f"{o}.feed_forward.w13.weight"] = torch.cat([sd[f"{h}.mlp.gate_proj.weight"], sd[f"{h}.mlp.up_proj.weight"]])
        out[f"{o}.feed_forward.w2.weight"] = sd[f"{h}.mlp.down_proj.weight"]
    return out


QUANT_CONFIG = ModelConfig(name="quant-test", vocab_size=64, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_dim=512, rope_theta=10000.0, max_seq_len=512, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def all_types_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "all-types.gguf"
    tensors = write_gguf(path, QUANT_CONFIG, types=ALL_TYPES)
    return str(path), tensors


def test_every_tensor_type_matches_gguf_and_transformers(all_types_file):
    path, _ = all_types_file
    ours = load_model(path, device="cpu")
    reader = gguf.GGUFReader(path)
    seen_types = {t.tensor_type for t in reader.tensors}
    assert set(ALL_TYPES) <= seen_types, "the test file must contain every type under test"
    config = ours.config
    D = config.head_dim
    params = dict(ours.named_parameters())
    # 1) against the gguf package's own dequantization, row block by row block
    rows = {"attn_q": (0, config.n_heads * D), "attn_k": (config.n_heads * D, (config.n_heads + config.n_kv_heads) * D),
            "attn_v": ((config.n_heads + config.n_kv_heads) * D, (config.n_heads + 2 * config.n_kv_heads) * D)}
    for t in reader.tensors:
        ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        ref = ref.reshape(tuple(reversed(t.shape.tolist())))
        name = t.name
        if name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            got = params[{"token_embd.weight": "tok_embeddings.weight", "output.weight": "output.weight",
                          "output_norm.weight": "norm.weight"}[name]]
        else:
            _, layer, kind, _ = name.split(".")
            o = f"layers.{layer}"
            if kind in rows:
                got = params[f"{o}.attention.wqkv.weight"][rows[kind][0]:rows[kind][1]]
                if kind != "attn_v":
                    ref = unpermute_rotary_rows(ref, config.n_heads if kind == "attn_q" else config.n_kv_heads)
            else:
                got = params[{"attn_norm": f"{o}.attention_norm.weight", "ffn_norm": f"{o}.ffn_norm.weight",
                              "attn_output": f"{o}.attention.wo.weight", "ffn_down": f"{o}.feed_forward.w2.weight",
                              "ffn_gate": f"{o}.feed_forward.w13.weight", "ffn_up": f"{o}.feed_forward.w13.weight"}[kind]]
                if kind == "ffn_gate":
                    got = got[: config.ffn_dim]
                elif kind == "ffn_up":
                    got = got[config.ffn_dim:]
        assert torch.equal(got, ref), f"{name} ({t.tensor_type.name})"
    # 2) against transformers' loading of the same file
    hf = load_transformers(path)
    for name, value in hf_state_for_ours(hf, config).items():
        assert torch.equal(params[name], value.float()), name
    ids = torch.arange(30) % config.vocab_size
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(ours.logits(ids), ref) < 1e-4


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)
    assert torch.equal(unpermute_rotary_rows(torch.from_numpy(llama_cpp_permute(w, 6)), 6), torch.from_numpy(w))


def gguf_weights_from_hf(hf, config: ModelConfig) -> dict[str, np.ndarray]:
    """transformers' tensors under llama.cpp names (Hugging Face row order; write_gguf permutes)."""
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not config.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    if config.qk_norm:
        names.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for i in range(config.n_layers):
        for ours, theirs in names.items():
            out[f"blk.{i}.{ours}.weight"] = sd[f"model.layers.{i}.{theirs}.weight"]
            if config.qkv_bias and ours in ("attn_q", "attn_k", "attn_v"):
                out[f"blk.{i}.{ours}.bias"] = sd[f"model.layers.{i}.{theirs}.bias"]
    return out


@pytest.mark.parametrize("case", ["llama-gqa3-q8", "llama-qkv-bias", "qwen2-bias-tied"])
def test_gguf_logits_match_transformers(case, tmp_path):
    """ringctx on a GGUF file against transformers on the weights it was written from."""
    import transformers

    tiny = get_preset("tiny")
    gqa3 = dict(n_heads=6, n_kv_heads=2, head_dim=16, dim=96)
    if case == "llama-gqa3-q8":
        config, arch, types = dataclasses.replace(tiny, **gqa3), "llama", (Q.Q8_0, Q.F16)
    elif case == "llama-qkv-bias":  # llama.cpp permutes the Q/K biases along with the weights
        config, arch, types = dataclasses.replace(tiny, **gqa3, qkv_bias=True), "llama", (Q.F32,)
    else:  # qwen2 keeps the Hugging Face row order: no permutation
        config, arch, types = dataclasses.replace(tiny, **gqa3, qkv_bias=True, tie_embeddings=True), "qwen2", (Q.F32,)
    hf_cfg = hf_config_dict(config)
    if case == "llama-qkv-bias":
        hf_cfg["attention_bias"] = True  # transformers' Llama then has an o_proj bias too: zero below
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05)
            if "o_proj.bias" in name:
                p.zero_()
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(path, config, arch=arch, types=types, weights=gguf_weights_from_hf(hf, config))
    ours = load_model(path, device="cpu")
    assert ours.config.qkv_bias == config.qkv_bias and ours.config.tie_embeddings == config.tie_embeddings
    ids = torch.arange(3, 45) % config.vocab_size
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    tol = 1e-4 if types == (Q.F32,) else 5e-2  # Q8_0 rounds the weights ringctx reads
    assert rel_err(ours.logits(ids), ref) < tol, case
    if case != "llama-qkv-bias":  # (transformers' GGUF loader drops Llama q/k/v biases)
        with torch.no_grad():
            ref_gguf = load_transformers(path)(ids[None]).logits[0]
        assert rel_err(ours.logits(ids), ref_gguf) < 1e-4, case


def test_llama31_rope_freqs_table_becomes_rope_scaling(tmp_path):
    """A Llama-3.1 GGUF stores RoPE scaling as rope_freqs.weight; ringctx recovers the parameters."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    config = dataclasses.replace(get_preset("tiny"), n_heads=2, n_kv_heads=1, head_dim=32, rope_theta=500000.0,
                                 max_seq_len=131072)
    plain = config.rope_inv_freq()
    table = scaling.frequency_divisors(plain)
    assert min(table) == 1.0 and max(table) == 8.0 and any(1.0 < d < 8.0 for d in table), "all three bands"
    path = tmp_path / "llama31.gguf"
    write_gguf(path, config, rope_freqs=table)
    loaded = load_model(str(path), device="cpu")
    assert loaded.config.rope_scaling == scaling
    bad = [d * 1.1 for d in table]
    write_gguf(path, config, rope_freqs=bad)
    with pytest.raises(ValueError, match="rope_freqs table does not follow the Llama-3.1"):
        load_model(str(path), device="cpu")


def test_bad_gguf_files(all_types_file, tmp_path):
    path, _ = all_types_file
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=r"truncated\.gguf: .*truncated"):
        load_model(str(truncated), device="cpu")
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"header-cut\.gguf: not a readable GGUF file"):
        load_model(str(header_cut), device="cpu")
    not_gguf = tmp_path / "garbage.gguf"
    not_gguf.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match=r"garbage\.gguf: not a GGUF file"):
        load_model(str(not_gguf), device="cpu")


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi\.gguf: unsupported architecture general\.architecture='phi2'"):
        load_model(str(path), device="cpu")


def test_unexpected_tensor_is_an_error(tmp_path):
    path = tmp_path / "extra.gguf"
    write_gguf(path, get_preset("tiny"), extra={"blk.0.attn_q_norm.weight": np.ones(16)})
    with pytest.raises(ValueError, match=r"extra\.gguf: unexpected tensor 'blk\.0\.attn_q_norm\.weight'"):
        load_model(str(path), device="cpu")
