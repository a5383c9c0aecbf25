"""Model shapes as dataclasses: `ModelConfig` and its RoPE scaling.

A `ModelConfig` describes a Llama-family decoder completely enough to build it, to cost it
(the planner) and to check that a KV cache file belongs to it. Its readers sit beside the weight
loaders (config_hf.py: Hugging Face config.json; config_gguf.py: GGUF headers); presets.py holds
the shapes of real models by name; they import this module, never the other way round."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn")
"""Rotary scaling types ringctx computes as transformers does (`rope_type` in Hugging Face configs)."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling for contexts longer than pre-training, as transformers computes it
    (`transformers.modeling_rope_utils`); `rope_type` says which formula, and each formula reads
    only its own fields (the others keep their defaults).

    - "llama3" (Llama-3.1): factor, low_freq_factor, high_freq_factor, original_max_position.
    - "linear" (position interpolation): every frequency divided by `factor`.
    - "dynamic" (dynamic NTK): plain RoPE up to `original_max_position` (transformers' max_position_embeddings).
      Past it transformers recomputes the frequencies from the length of the whole sequence, so a
      token's angle would depend on how long the prompt is: ringctx refuses those positions
      (`Transformer.rope`) rather than compute something else.
    - "yarn" (YaRN, e.g. Qwen3 at 128K): factor, original_max_position, beta_fast, beta_slow,
      truncate; cos and sin are multiplied by `attention_factor`.

    The field order and the llama3 default keep configs saved before other types existed loadable.
    """

    factor: float = 8.0
    """How much longer than `original_max_position` the scaled context is."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position / high_freq_factor are left unchanged."""
    original_max_position: int = 8192
    """The context length the model was pre-trained with before scaling."""
    rope_type: str = "llama3"
    """Which formula: one of ROPE_TYPES."""
    beta_fast: float = 32.0
    """yarn: dimensions turning more than beta_fast times over the original context keep their frequency."""
    beta_slow: float = 1.0
    """yarn: dimensions turning fewer than beta_slow times are divided by `factor`; a linear ramp between."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole dimensions (transformers' default)."""
    attention_factor: float = 1.0
    """yarn: the factor cos and sin are multiplied by (transformers' attention_scaling; 1.0 for the others)."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; ringctx computes "
                             f"{', '.join(ROPE_TYPES)} and plain RoPE")

    def scaled_inv_freq(self, inv_freq: "list[float]", rope_theta: float) -> list[float]:
        """The plain rotary frequencies [head_dim // 2] (rope_theta^(-2i/head_dim)) with this scaling applied."""
        if self.rope_type == "llama3":
            return [f / d for f, d in zip(inv_freq, self.frequency_divisors(inv_freq))]
        if self.rope_type == "linear":
            return [f / self.factor for f in inv_freq]
        if self.rope_type == "dynamic":  # inside the original context: plain (see the class docstring)
            return list(inv_freq)
        return self._yarn_inv_freq(inv_freq, rope_theta)

    def _yarn_inv_freq(self, inv_freq: "list[float]", base: float) -> list[float]:
        """transformers' _compute_yarn_parameters: fast-turning dimensions extrapolate (keep their
        frequency), slow ones interpolate (divided by factor), with a linear ramp in between."""
        half = len(inv_freq)
        dim = 2 * half

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        scaled = []
        for i, f in enumerate(inv_freq):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
            scaled.append(f / self.factor * ramp + f * (1.0 - ramp))
        return scaled

    def frequency_divisors(self, inv_freq: "list[float]") -> list[float]:
        """llama3: per rotary frequency, the number the plain frequency is divided by (1.0 = unchanged).

        Long wavelengths (beyond original_max_position / low_freq_factor) are slowed down by
        `factor`, short ones (below original_max_position / high_freq_factor) are kept, and the
        band between is interpolated smoothly in frequency. This is the same table llama.cpp
        stores as the `rope_freqs.weight` tensor of Llama-3.1 GGUF files.
        """
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        divisors = []
        for f in inv_freq:
            wavelen = 2.0 * math.pi / f
            if wavelen < high_wavelen:
                divisors.append(1.0)
            elif wavelen > low_wavelen:
                divisors.append(self.factor)
            else:
                smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor)
                divisors.append(1.0 / ((1.0 - smooth) / self.factor + smooth))
        return divisors

    @property
    def position_limit(self) -> int | None:
        """The first position this scaling cannot compute exactly (dynamic), or None: no limit."""
        return self.original_max_position if self.rope_type == "dynamic" else None

    def to_hf(self) -> dict[str, Any]:
        """The `rope_parameters` entries transformers reads for this scaling (without rope_theta)."""
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                     original_max_position_embeddings=self.original_max_position)
        elif self.rope_type == "yarn":
            d.update(original_max_position_embeddings=self.original_max_position, beta_fast=self.beta_fast,
                     beta_slow=self.beta_slow, truncate=self.truncate, attention_factor=self.attention_factor)
        return d

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any], max_position: int, problem) -> "RopeScaling | None":
        """The scaling of a config's `rope_parameters` / `rope_scaling` dict (None for plain RoPE).

        max_position: the config's max_position_embeddings (dynamic's limit, and yarn's factor
        when the dict has none). problem(text) -> the ValueError to raise for an unsupported entry.
        """
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type == "default":
            return None
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise problem(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}")
        if rope_type not in ROPE_TYPES:
            raise problem(f"rope_type={rope_type!r} (ringctx computes default, {', '.join(ROPE_TYPES)})")
        original = rope.get("original_max_position_embeddings")
        if rope_type == "llama3":
            return cls(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                       high_freq_factor=float(rope["high_freq_factor"]), original_max_position=int(original))
        if rope_type == "linear":
            return cls(factor=float(rope["factor"]), rope_type="linear", original_max_position=int(original or
                                                                                                   max_position))
        if rope_type == "dynamic":  # transformers' dynamic NTK scales past max_position_embeddings
            return cls(factor=float(rope["factor"]), rope_type="dynamic", original_max_position=int(max_position))
        if original is None:
            raise problem("rope_type='yarn' without original_max_position_embeddings")
        factor = rope.get("factor")
        factor = float(factor) if factor is not None else max_position / int(original)
        return cls(factor=factor, original_max_position=int(original), rope_type="yarn",
                   beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                   truncate=bool(rope.get("truncate", True)),
                   attention_factor=yarn_attention_factor(factor, rope.get("attention_factor"), rope.get("mscale"),
                                                          rope.get("mscale_all_dim")))


def yarn_attention_factor(factor: float, attention_factor: float | None = None, mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin multiplier, by transformers' rules: an explicit attention_factor wins; else
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are given and
    non-zero; else get_mscale(factor) = 0.1 ln(factor) + 1 (1.0 for factor <= 1)."""
    if attention_factor is not None:
        return float(attention_factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2-style bias,
    Qwen3-style q/k norms)."""

    name: str
    """Human-readable name: a preset name or the file the config was read from."""
    vocab_size: int
    """Number of token ids; valid ids are 0 .. vocab_size-1."""
    dim: int
    """Model (residual stream) width D."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Query heads NH."""
    n_kv_heads: int
    """Key/value heads NKV (grouped-query attention); n_heads must be a multiple of it."""
    ffn_dim: int
    """Hidden width of the SwiGLU MLP."""
    head_dim: int = 0
    """Per-head width DH; 0 means dim // n_heads."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | None = None
    """Rotary scaling (llama3, linear, dynamic or yarn), or None for plain RoPE."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    qkv_bias: bool = False
    """Whether the q/k/v projections have a bias (Qwen2 style)."""
    attn_out_bias: bool = False
    """Whether the attention output projection has a bias too (Llama configs with attention_bias=true)."""
    tie_embeddings: bool = False
    """Whether the output head shares the token embedding matrix."""
    qk_norm: bool = False
    """Whether each head's q and k are RMS-normalised before RoPE (Qwen3): weights [head_dim], eps norm_eps."""
    max_seq_len: int = 8192
    """The checkpoint's max_position_embeddings (GGUF: context_length); the context prompts are held to
    is `trained_context`, which reads it (model/context.py holds the guard)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the tokenizer has one."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end generation."""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        attn = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.n_heads * self.head_dim * self.dim
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        if self.attn_out_bias:
            attn += self.dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.vocab_size * self.dim + head + self.dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes of K and V that one token adds to the cache over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    def fingerprint(self) -> str:
        """A short hash of the shapes and constants (not the name), to match caches and ranks.

        Fields added after KV files were first saved are left out while they hold their default,
        so an older file's fingerprint still matches the same model."""
        d = self.to_dict()
        d.pop("name")
        d.pop("max_seq_len")
        for key, default in _LATER_FIELDS.items():
            if d.get(key) == default:
                d.pop(key)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = {k: v for k, v in d["rope_scaling"].items()
                                 if _LATER_ROPE_FIELDS.get(k, _MISSING) != v}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def rope_inv_freq(self) -> list[float]:
        """Rotary angular frequencies per pair of head dims [head_dim // 2], scaling applied (float64)."""
        plain = [self.rope_theta ** (-(2 * i) / self.head_dim) for i in range(self.head_dim // 2)]
        if self.rope_scaling is None:
            return plain
        return self.rope_scaling.scaled_inv_freq(plain, self.rope_theta)

    @property
    def rope_attention_factor(self) -> float:
        """The factor RoPE's cos and sin are multiplied by (YaRN's; 1.0 otherwise)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.attention_factor

    @property
    def trained_context(self) -> int:
        """The longest sequence (prompt and answer) the model was trained for, as extended by the
        checkpoint's own RoPE scaling: the one rule, per rope type (a new type adds its line here).

        - plain RoPE, llama3, dynamic: max_seq_len (max_position_embeddings) as the checkpoint
          states it. Llama-3.1 states the extended length there (131,072 over an original 8,192
          with factor 8: llama3's factor is not the ratio); dynamic NTK states the original, and
          ringctx computes no position past it (RopeScaling.position_limit).
        - yarn, linear: the longer of max_seq_len and original_max_position x factor. transformers'
          convention is max_position_embeddings = the post-YaRN length (it warns when that ratio
          differs from factor), but model cards tell users to add a yarn block (factor 4 over
          32,768) and leave max_position_embeddings as it was (Qwen2.5: 32,768, Qwen3: 40,960);
          vLLM then takes original x factor, and so does this rule. A linear config without
          original_max_position_embeddings reads max_position_embeddings as the original (vLLM's
          max_position_embeddings x factor).
        """
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type in ("llama3", "dynamic"):
            return self.max_seq_len
        if scaling.rope_type in ("yarn", "linear"):
            return max(self.max_seq_len, int(round(scaling.original_max_position * scaling.factor)))
        raise ValueError(f"ModelConfig.trained_context has no rule for rope_type {scaling.rope_type!r}")


_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: "torch.dtype | str | None") -> "torch.dtype | None":
    """A torch dtype from a dtype or a name like 'bf16', 'float32' (None stays None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPE_NAMES))}") from None


_MISSING = object()

_LATER_FIELDS = {"qk_norm": False}
"""ModelConfig fields added after fingerprints were first stored, with their defaults."""
_LATER_ROPE_FIELDS = {"rope_type": "llama3", "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                      "attention_factor": 1.0}
"""RopeScaling fields added after fingerprints were first stored, with their defaults."""
