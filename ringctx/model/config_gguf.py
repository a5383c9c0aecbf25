"""Reading a GGUF file's header: the `ModelConfig` it describes and its typed fields, beside the
GGUF weight loader (weights_gguf.py) and the planner call `read_gguf_config`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .config import _MISSING, ModelConfig, RopeScaling, yarn_attention_factor


def read_gguf_field(field: Any) -> Any:
    """The Python value of a `gguf.ReaderField` (`reader.fields[key]`): int, float, bool, str, or a list of them."""
    from gguf import GGUFValueType

    def scalar(part: Any, vtype: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        if vtype == GGUFValueType.FLOAT32:  # 1e-5 stored as float32 reads back as 9.99999974e-06
            return float(str(part.astype("float32")[0]))
        return bool(value) if vtype == GGUFValueType.BOOL else value

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""GGUF `general.architecture`s ringctx's decoder runs."""


def _gguf_rope_scaling(arch: str, get, source: str) -> RopeScaling | None:
    """The linear or YaRN scaling named by a GGUF header's rope.scaling.* keys (None: plain, or
    Llama-3.1's rope_freqs table, read separately)."""
    kind = get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    factor = float(get(f"{arch}.rope.scaling.factor", 1.0))
    original = int(get(f"{arch}.rope.scaling.original_context_length", 0) or get(f"{arch}.context_length", 8192))
    if kind == "linear":
        return RopeScaling(factor=factor, rope_type="linear", original_max_position=original)
    if kind == "yarn":
        for key in ("yarn_ext_factor", "yarn_log_multiplier"):
            if get(f"{arch}.rope.scaling.{key}", None) not in (None, -1.0, 0.0):
                raise ValueError(f"{source}: {arch}.rope.scaling.{key}={get(f'{arch}.rope.scaling.{key}')} is "
                                 "not supported (ringctx computes transformers' YaRN)")
        attn = float(get(f"{arch}.rope.scaling.attn_factor", 1.0))
        return RopeScaling(factor=factor, rope_type="yarn", original_max_position=original,
                           beta_fast=float(get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=attn * yarn_attention_factor(factor))
    raise ValueError(f"{source}: {arch}.rope.scaling.type={kind!r} is not supported "
                     "(ringctx reads plain, linear, yarn and Llama-3.1 RoPE from GGUF files)")


def _fit_llama3_rope(cfg: ModelConfig, table: list[float], hint: int | None, source: str) -> RopeScaling:
    """The Llama-3.1 RopeScaling whose frequency divisors reproduce a GGUF `rope_freqs` table."""
    if len(table) != cfg.head_dim // 2:
        raise ValueError(f"{source}: rope_freqs has {len(table)} entries, expected head_dim/2 = {cfg.head_dim // 2}")
    plain = dataclasses.replace(cfg, rope_scaling=None).rope_inv_freq()
    factor = max(table)
    contexts = [hint] if hint else []
    contexts += [c for c in (8192, 4096, 2048, 16384, 32768, 65536, 131072) if c not in contexts]
    for original in contexts:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            candidate = RopeScaling(factor, low, high, int(original))
            divisors = candidate.frequency_divisors(plain)
            if all(abs(a - b) <= 1e-4 * b for a, b in zip(divisors, table)):
                return candidate
    raise ValueError(f"{source}: the rope_freqs table does not follow the Llama-3.1 scaling formula; "
                     "this RoPE variant is not supported")


def read_gguf_config(gguf_file: "str | os.PathLike | Any", *, name: str | None = None) -> ModelConfig:
    """The config stored in a GGUF file's header (a path or an open `gguf.GGUFReader`).

    Supports general.architecture llama (also Mistral and Llama 3 files), qwen2 and qwen3. A
    Llama-3.1 file carries its RoPE scaling as the `rope_freqs.weight` table; it is matched
    against the Llama-3.1 formula to recover `rope_scaling`. Linear and YaRN scaling are read
    from the rope.scaling.* keys; llama.cpp multiplies its `attn_factor` key by YaRN's own
    0.1 ln(factor) + 1, so that product is transformers' attention_factor.
    """
    import gguf

    reader = gguf_file if isinstance(gguf_file, gguf.GGUFReader) else gguf.GGUFReader(os.fspath(gguf_file), "r")
    source = str(getattr(reader.data, "filename", None) or "GGUF file")
    fields = reader.fields

    def get(key: str, default: Any = _MISSING) -> Any:
        if key in fields:
            return read_gguf_field(fields[key])
        if default is _MISSING:
            raise ValueError(f"{source}: GGUF header lacks {key!r}; the file is incomplete or not a model file")
        return default

    arch = get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture general.architecture={arch!r}; "
                         f"ringctx runs Llama-family decoders: GGUF architecture {', '.join(GGUF_ARCHITECTURES)}")
    for key in (f"{arch}.expert_count", f"{arch}.attention.sliding_window"):
        if get(key, None):
            raise ValueError(f"{source}: {key}={get(key)} is not supported by ringctx's decoder "
                             "(mixture of experts / sliding-window attention)")
    tensors = {t.name: t for t in reader.tensors}
    n_heads = int(get(f"{arch}.attention.head_count"))
    n_kv = get(f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer counts: only a uniform model is supported
        if len(set(n_kv)) != 1:
            raise ValueError(f"{source}: per-layer KV head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    dim = int(get(f"{arch}.embedding_length"))
    head_dim = int(get(f"{arch}.attention.key_length", dim // n_heads))
    if int(get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{source}: key and value head widths differ; not supported")
    if int(get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{source}: partial rotary embeddings (rope.dimension_count "
                         f"{get(f'{arch}.rope.dimension_count')} < head dim {head_dim}) are not supported")
    rope_scaling = _gguf_rope_scaling(arch, get, source)
    rope_theta = float(get(f"{arch}.rope.freq_base", 10000.0))
    vocab = get(f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else \
            int(tensors["token_embd.weight"].shape[-1])
    eos = [get(k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id")]
    cfg = ModelConfig(
        name=name or os.path.basename(source),
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(get(f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        ffn_dim=int(get(f"{arch}.feed_forward_length")),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        attn_out_bias="blk.0.attn_output.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        qk_norm=arch == "qwen3",  # llama.cpp's qwen3 always has attn_q_norm / attn_k_norm
        max_seq_len=int(get(f"{arch}.context_length", 8192)),
        bos_token_id=get("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )
    if "rope_freqs.weight" in tensors and rope_scaling is None:
        from gguf.quants import dequantize

        table = [float(x) for x in dequantize(tensors["rope_freqs.weight"].data,
                                              tensors["rope_freqs.weight"].tensor_type).reshape(-1)]
        hint = get(f"{arch}.rope.scaling.original_context_length", None)
        cfg = dataclasses.replace(cfg, rope_scaling=_fit_llama3_rope(cfg, table, hint, source))
    return cfg
