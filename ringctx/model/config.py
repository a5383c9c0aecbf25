"""Model shapes as dataclasses, and presets with real shapes.

A `ModelConfig` describes a Llama-family decoder completely enough to build it, to cost it
(the planner) and to check that a KV cache file belongs to it. Presets carry the shapes of real
models; with random weights they serve benchmarks and planning without any download.

    >>> cfg = get_preset("llama3-405b")
    >>> cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    (128, 8, 128)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping


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
    """Context length the model was trained for (informational; ringctx does not cap prompts)."""
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

    # ----------------------------------------------------------------------------------------
    # Constructors from checkpoint headers

    @classmethod
    def from_hf_config(cls, config: "Mapping[str, Any] | str | os.PathLike", *, name: str | None = None) -> "ModelConfig":
        """The config of a Hugging Face checkpoint: a `config.json` dict, file or directory.

        Accepts model_type llama, mistral (without sliding window), qwen2 and qwen3, with plain,
        llama3, linear, dynamic or yarn RoPE, in both the transformers 4 (`rope_scaling`,
        `rope_theta`) and 5 (`rope_parameters`) spellings. From a directory, the EOS ids of
        `generation_config.json` are added too (Llama-3 instruct models end turns with <|eot_id|>,
        listed only there). Anything ringctx would compute differently from transformers (sliding
        windows, mixtures of experts, partial rotary, soft-capping...) is rejected with a one-line
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
        return cls(
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
        )

    def to_hf_config(self) -> dict:
        """A transformers `config.json` dict for this config (LlamaConfig, Qwen2Config or Qwen3Config fields)."""
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

    @classmethod
    def from_gguf(cls, gguf_file: "str | os.PathLike | Any", *, name: str | None = None) -> "ModelConfig":
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
        cfg = cls(
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


_MISSING = object()

_LATER_FIELDS = {"qk_norm": False}
"""ModelConfig fields added after fingerprints were first stored, with their defaults."""
_LATER_ROPE_FIELDS = {"rope_type": "llama3", "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                      "attention_factor": 1.0}
"""RopeScaling fields added after fingerprints were first stored, with their defaults."""


def _as_id_list(value: Any) -> list[int]:
    """An int, a list of ints or None (as in config.json's eos_token_id) as a list of ints."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    # Mistral's window is on whenever it is set; Qwen2/Qwen3 keep a window size but use it only
    # with use_sliding_window; transformers 5 also lists each layer's kind in layer_types.
    if model_type == "mistral" and d.get("sliding_window") is not None:
        raise unsupported(f"sliding-window attention (sliding_window={d['sliding_window']})")
    if d.get("use_sliding_window"):
        raise unsupported(f"sliding-window attention (use_sliding_window={d['use_sliding_window']})")
    kinds = set(d.get("layer_types") or ())
    if kinds - {"full_attention"}:
        raise unsupported(f"layer_types with {sorted(kinds - {'full_attention'})} (only full_attention)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
                "num_experts_per_tok"):
        if d.get(key):
            raise unsupported(f"mixture-of-experts layers ({key}={d[key]})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise unsupported(f"soft-capping ({key}={d[key]})")


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


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
        rope_theta=10000.0, max_seq_len=4096, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
        rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_seq_len=8192,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
        rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_seq_len=32768,
        eos_token_ids=(151643, 151645),
    ),
    "llama3.2-1b": ModelConfig(
        name="llama3.2-1b", vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
        max_seq_len=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    # Shapes of published checkpoints, from their config.json files on the Hugging Face hub
    # (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B, Qwen/Qwen2.5-7B-Instruct-1M); parameter counts
    # 8.03B, 8.19B and 7.62B. Qwen3-8B's own config has plain RoPE over 40,960 positions (its
    # model card adds yarn, factor 4 over 32,768, for 128K); Qwen2.5-7B-Instruct-1M's
    # dual_chunk_attention_config is vLLM's sparse approximation, which transformers and ringctx
    # do not apply (full attention).
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, rope_scaling=RopeScaling(), norm_eps=1e-5, max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
        head_dim=128, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, max_seq_len=40960,
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "qwen2.5-7b-instruct-1m": ModelConfig(
        name="qwen2.5-7b-instruct-1m", vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
        ffn_dim=18944, rope_theta=10000000.0, norm_eps=1e-5, qkv_bias=True, max_seq_len=1010000,
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
        rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
}
"""Model shapes by preset name. `smollm2-135m` is also the embedded default model (real weights)."""


def get_preset(name: str) -> ModelConfig:
    """The preset config called `name`; a clear error listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
