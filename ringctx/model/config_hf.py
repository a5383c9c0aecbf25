"""Reading (and writing) a Hugging Face `config.json`: the `ModelConfig` of a checkpoint, beside the
safetensors weight loader (weights_hf.py) and the planner call these."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from .config import LayerAttention, ModelConfig, RopeScaling


def _as_id_list(value: Any) -> list[int]:
    """An int, a list of ints or None (as in config.json's eos_token_id) as a list of ints."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


HF_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3")
"""Hugging Face `model_type`s ringctx's decoder runs."""


def _refuse_unsupported_features(d: Mapping[str, Any], model_type: str, unsupported) -> None:
    """Raise unsupported("key=value ...") for the first config entry ringctx would compute differently
    from transformers: sliding windows, experts, partial rotary, soft-capping, other activations."""
    if d.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act={d.get('hidden_act')!r} (only silu)")
    if d.get("mlp_bias"):
        raise unsupported("mlp_bias=true")
    if d.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise unsupported(f"partial_rotary_factor={d['partial_rotary_factor']}")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
                "num_experts_per_tok"):
        if d.get(key):
            raise unsupported(f"mixture-of-experts layers ({key}={d[key]})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise unsupported(f"soft-capping ({key}={d[key]})")


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""`layer_types` entries ringctx computes."""


def read_layer_attention(d: Mapping[str, Any], model_type: str, unsupported) -> tuple[LayerAttention, ...]:
    """Each layer's attention kind from a config dict, as transformers decides it per model type:

    - mistral: one sliding window on every layer whenever `sliding_window` is set (MistralModel
      ignores layer_types);
    - ministral and others: `layer_types`, else derived as transformers' config classes do:
      qwen2/qwen3 slide from layer `max_window_layers` on when `use_sliding_window`; ministral
      slides everywhere when `sliding_window` is set.
    An empty tuple when every layer is plain causal attention."""
    n_layers = int(d["num_hidden_layers"])
    window = d.get("sliding_window")
    if model_type == "mistral":
        kinds = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    elif d.get("layer_types"):
        kinds = list(d["layer_types"])
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window"):
            window = None  # transformers' Qwen2/Qwen3 configs drop the window unless it is used
    elif model_type in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers") or 0)
        slides = bool(d.get("use_sliding_window")) and window is not None
        kinds = ["sliding_attention" if slides and i >= first else "full_attention" for i in range(n_layers)]
    else:
        kinds = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    if len(kinds) != n_layers:
        raise unsupported(f"layer_types lists {len(kinds)} layers for num_hidden_layers={n_layers}")
    layers = []
    for kind in kinds:
        if kind not in LAYER_TYPES:
            raise unsupported(f"layer_types entry {kind!r} (ringctx computes {', '.join(LAYER_TYPES)})")
        if kind == "sliding_attention":
            if window is None or int(window) <= 0:
                raise unsupported(f"sliding_attention layers with sliding_window={window!r} (a positive window)")
            layers.append(LayerAttention(window=int(window)))
        elif kind == "chunked_attention":
            chunk = d.get("attention_chunk_size")
            if chunk is None or int(chunk) <= 0:
                raise unsupported(f"chunked_attention layers with attention_chunk_size={chunk!r} (a positive size)")
            layers.append(LayerAttention(chunk=int(chunk)))
        else:
            layers.append(LayerAttention())
    return tuple(layers) if any(not layer.is_plain for layer in layers) else ()


def read_hf_config(config: "Mapping[str, Any] | str | os.PathLike", *, name: str | None = None) -> ModelConfig:
    """The config of a Hugging Face checkpoint: a `config.json` dict, file or directory.

    Accepts model_type llama, mistral, ministral, qwen2 and qwen3 (sliding windows and
    `layer_types` included: `read_layer_attention`), with plain,
    llama3, linear, dynamic or yarn RoPE, in both the transformers 4 (`rope_scaling`,
    `rope_theta`) and 5 (`rope_parameters`) spellings. From a directory, the EOS ids of
    `generation_config.json` are added too (Llama-3 instruct models end turns with <|eot_id|>,
    listed only there). Anything ringctx would compute differently from transformers (mixtures
    of experts, partial rotary, soft-capping...) is rejected with a one-line
    ValueError naming the config key and its value.
    """
    source = "config"
    extra_eos: list[int] = []
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if os.path.isdir(path):
            directory, path = path, os.path.join(path, "config.json")
        else:
            directory = os.path.dirname(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file; a Hugging Face model directory needs a config.json")
        source = path
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON config ({e}); re-download or re-save the model") from None
        gen_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                extra_eos = _as_id_list(json.load(f).get("eos_token_id"))
        name = name or os.path.basename(os.path.normpath(directory)) or "hf-model"
    d = dict(config)
    model_type = d.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported architecture model_type={model_type!r} "
            f"(architectures={d.get('architectures')}); ringctx runs Llama-family decoders: "
            f"model_type {', '.join(HF_MODEL_TYPES)}")

    def unsupported(what: str) -> ValueError:
        return ValueError(f"{source}: {what} is not supported by ringctx's decoder (model_type {model_type})")

    _refuse_unsupported_features(d, model_type, unsupported)
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    absent = [key for key in required if d.get(key) is None]
    if absent:
        raise ValueError(f"{source}: the config lacks {', '.join(absent)}; it is incomplete or not a model config")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    max_position = int(d.get("max_position_embeddings") or 8192)
    rope_scaling = RopeScaling.from_hf(rope, max_position, unsupported)
    attention_bias = bool(d.get("attention_bias", False))
    n_heads = int(d["num_attention_heads"])
    eos = _as_id_list(d.get("eos_token_id"))
    eos += [i for i in extra_eos if i not in eos]
    return ModelConfig(
        name=name or "hf-model",
        vocab_size=int(d["vocab_size"]),
        dim=int(d["hidden_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        ffn_dim=int(d["intermediate_size"]),
        head_dim=int(d.get("head_dim") or 0),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        # Qwen2 always has q/k/v biases; Llama and Qwen3's attention_bias puts one on o_proj too.
        qkv_bias=model_type == "qwen2" or attention_bias,
        attn_out_bias=model_type in ("llama", "qwen3") and attention_bias,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        max_seq_len=max_position,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        layer_attention=read_layer_attention(d, model_type, unsupported),
    )


def hf_config_dict(self: ModelConfig) -> dict:
    """A transformers `config.json` dict for this config (LlamaConfig, Qwen2Config or Qwen3Config fields)."""
    if not self.has_plain_attention:
        raise ValueError(f"ModelConfig {self.name!r}: hf_config_dict writes plain Llama/Qwen configs; this one's "
                         "layers have windows, chunks or their own RoPE")
    qwen3 = self.qk_norm
    qwen2 = not qwen3 and self.qkv_bias and not self.attn_out_bias
    if qwen3 and self.qkv_bias != self.attn_out_bias:
        raise ValueError(f"ModelConfig {self.name!r}: Qwen3 has biases on all of q, k, v, o or on none")
    model_type = "qwen3" if qwen3 else "qwen2" if qwen2 else "llama"
    d: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [{"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[model_type] + "ForCausalLM"],
        "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
        "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
        "intermediate_size": self.ffn_dim, "head_dim": self.head_dim, "hidden_act": "silu",
        "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_embeddings,
        "max_position_embeddings": self.max_seq_len, "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
        (self.eos_token_ids[0] if self.eos_token_ids else None),
        "rope_theta": self.rope_theta,
    }
    if not qwen2:
        d["attention_bias"] = self.attn_out_bias
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
        rope.update(self.rope_scaling.to_hf())
    d["rope_parameters"] = rope
    d["rope_scaling"] = rope  # the transformers 4 spelling
    return d
