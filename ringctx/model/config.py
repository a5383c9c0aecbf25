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

from ..attention.dual_chunk import DualChunk
from ..attention.spans import Span


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope", "proportional")
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
    - "longrope" (Phi-3/3.5/4-mini): each frequency divided by its entry of `short_factor` or of
      `long_factor`; cos and sin multiplied by `attention_factor`. Which set: transformers takes the
      long factors for every position of a forward call whose largest position + 1 exceeds
      `original_max_position`, else the short ones. ringctx decides per prompt, not per call:
      `Transformer.rope(positions, sequence_end)` uses the long factors iff sequence_end (one past
      the last position of the whole prompt being prefilled; default the largest position + 1)
      exceeds original_max_position. A one-call prefill and every decode step then equal
      transformers; a prefill in chunks passes the prompt's end so that its first chunks rotate
      as its last one does (transformers, prefilling in one call, does the same). A prompt
      shorter than original_max_position whose decode runs past it keeps its short-factor keys
      while new tokens rotate with the long factors, as transformers' forward calls over a cache
      do; transformers' Phi3ForCausalLM.generate instead drops its cache once, at the first step
      past original_max_position, and prefills the whole sequence again with the long factors
      (ringctx's decode does not yet: its tokens from there on may differ from generate's).
    - "proportional" (Gemma 4's full layers): the first int(proportion * head_dim // 2) frequencies
      keep their plain value (the exponent over the whole head_dim), the others are 0 (those pairs
      do not turn), every one divided by `factor`; pairs are the whole head's (i, i + head_dim/2),
      unlike partial rotary (LayerAttention.rotary_dim), which rotates the first dims only.

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
    """yarn, longrope: the factor cos and sin are multiplied by (transformers' attention_scaling; 1.0
    for the others)."""
    long_factor: tuple[float, ...] = ()
    """longrope: per rotary frequency [rotary_dim // 2], its divisor past original_max_position."""
    short_factor: tuple[float, ...] = ()
    """longrope: per rotary frequency [rotary_dim // 2], its divisor within original_max_position."""
    proportion: float = 1.0
    """proportional: the share of each head's dims that turn (transformers' partial_rotary_factor)."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; ringctx computes "
                             f"{', '.join(ROPE_TYPES)} and plain RoPE")
        # tuples (saved configs hold lists): the scaling is hashed as a RoPE table's key
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        if self.rope_type == "longrope" and not (len(self.long_factor) == len(self.short_factor) > 0):
            raise ValueError(f"longrope needs long_factor and short_factor of one length (one per rotary "
                             f"frequency), got {len(self.long_factor)} and {len(self.short_factor)}")

    @property
    def switches_factors(self) -> bool:
        """True for longrope: the frequencies depend on the prompt's end (see the class docstring)."""
        return self.rope_type == "longrope"

    def scaled_inv_freq(self, inv_freq: "list[float]", rope_theta: float, long: bool = False) -> list[float]:
        """The plain rotary frequencies [rotary_dim // 2] (rope_theta^(-2i/rotary_dim)) with this scaling
        applied; long: longrope's long factors (else its short ones; ignored by the other types)."""
        if self.rope_type == "longrope":
            factors = self.long_factor if long else self.short_factor
            if len(factors) != len(inv_freq):
                raise ValueError(f"longrope has {len(factors)} factors for {len(inv_freq)} rotary frequencies")
            return [f / e for f, e in zip(inv_freq, factors)]
        if self.rope_type == "llama3":
            return [f / d for f, d in zip(inv_freq, self.frequency_divisors(inv_freq))]
        if self.rope_type == "linear":
            return [f / self.factor for f in inv_freq]
        if self.rope_type == "dynamic":  # inside the original context: plain (see the class docstring)
            return list(inv_freq)
        if self.rope_type == "proportional":  # transformers' _compute_proportional_rope_parameters
            turning = int(self.proportion * (2 * len(inv_freq)) // 2)
            return [f / self.factor if i < turning else 0.0 for i, f in enumerate(inv_freq)]
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
        elif self.rope_type == "longrope":
            d.update(original_max_position_embeddings=self.original_max_position, attention_factor=self.attention_factor,
                     long_factor=list(self.long_factor), short_factor=list(self.short_factor))
        elif self.rope_type == "proportional":
            d.update(partial_rotary_factor=self.proportion)
        return d

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any], max_position: int, problem,
                original_max_position: int | None = None) -> "RopeScaling | None":
        """The scaling of a config's `rope_parameters` / `rope_scaling` dict (None for plain RoPE).

        max_position: the config's max_position_embeddings (dynamic's limit, and yarn's and
        longrope's factor when the dict has none). original_max_position: a top-level
        original_max_position_embeddings (Phi-3's), which transformers prefers to the dict's.
        problem(text) -> the ValueError to raise for an unsupported entry.
        """
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type == "default":
            return None
        if rope_type == "proportional":  # its partial_rotary_factor is part of the formula
            return cls(factor=float(rope.get("factor") or 1.0), rope_type="proportional",
                       proportion=float(rope.get("partial_rotary_factor") or 1.0),
                       original_max_position=int(max_position))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise problem(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}")
        if rope_type not in ROPE_TYPES:
            raise problem(f"rope_type={rope_type!r} (ringctx computes default, {', '.join(ROPE_TYPES)})")
        original = rope.get("original_max_position_embeddings")
        if rope_type == "longrope":
            return cls._longrope_from_hf(rope, max_position, original_max_position or original or max_position,
                                         problem)
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


    @classmethod
    def _longrope_from_hf(cls, rope: Mapping[str, Any], max_position: int, original: int, problem) -> "RopeScaling":
        """transformers' _compute_longrope_parameters: factor defaults to max_position / original;
        attention_factor to sqrt(1 + ln(factor) / ln(original)) (1.0 for factor <= 1)."""
        long, short = rope.get("long_factor"), rope.get("short_factor")
        if not long or not short or len(long) != len(short):
            raise problem(f"rope_type='longrope' with long_factor={long!r} and short_factor={short!r} "
                          "(two lists of one length)")
        original = int(original)
        factor = rope.get("factor")
        factor = float(factor) if factor is not None else max_position / original
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return cls(factor=factor, original_max_position=original, rope_type="longrope",
                   attention_factor=float(attention_factor), long_factor=tuple(long), short_factor=tuple(short))


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
class LayerAttention:
    """How one decoder layer's attention sees and rotates, when it differs from plain causal
    attention with the model's RoPE (`ModelConfig.layer_attention`). Every path reads it: the
    single-device forward, the ring (which skips what the span excludes), decode and the cache.

    The defaults describe a plain layer, so a config only spells out what a layer changes."""

    window: int = 0
    """Sliding window W: a query at position p sees keys p-W+1..p. 0: no window."""
    chunk: int = 0
    """Aligned chunk C: a query at p sees the keys of its own chunk, from C * (p // C). 0: none."""
    rope: bool = True
    """False: a NoPE layer (no rotary embedding on q or k: Llama 4's global layers)."""
    rope_theta: float = 0.0
    """> 0: this layer's own RoPE base, with `rope_scaling` as its scaling (Gemma 3's local layers:
    base 10,000, unscaled, where the global ones use 1,000,000 scaled x8). 0: the model's base
    and scaling."""
    rope_scaling: RopeScaling | None = None
    """This layer's own scaling when rope_theta > 0 (None: plain); ignored otherwise."""
    rotary_dim: int = 0
    """Partial rotary: only the first rotary_dim dims of each head rotate (pairs (i, i + rotary_dim/2)),
    the rest pass through (Phi-4, Gemma 4's global layers). 0: the whole head_dim."""
    scale: float = 0.0
    """The softmax scale multiplying q.k. 0: 1/sqrt(head_dim)."""
    softcap: float = 0.0
    """> 0: scores become softcap * tanh(score / softcap) before the softmax."""
    sinks: bool = False
    """The layer has a learned sink logit per query head (weights `sinks` [Hq], gpt-oss)."""
    qk_norm_after_rope: bool = False
    """Each head's q and k are RMS-normalised, without a weight, after RoPE (eps: the model's
    norm_eps; in float32, rounded once): Llama 4's use_qk_norm, on its RoPE layers."""
    temperature_floor: int = 0
    """> 0: the query at global position p is multiplied by
    log1p(floor((p + 1) / temperature_floor)) * temperature_scale + 1 before attention
    (`query_temperature`; Llama 4's attn_temperature_tuning on its NoPE layers: floor_scale,
    attn_scale). Keys and values are untouched, so caches and the ring are unchanged. 0: none."""
    temperature_scale: float = 0.0
    """The slope of that temperature (Llama 4's attn_scale); read only with temperature_floor > 0."""
    dual_chunk: DualChunk | None = None
    """Dual Chunk Attention (Qwen2.5-1M's `dual_chunk_attention_config`, dense): keys rotate at
    their position mod chunk_len, queries three ways (attention/dual_chunk.py). None: plain RoPE."""
    head_dim: int = 0
    """> 0: this layer's own head width (q, k and v heads; Gemma 4 31B's full layers: 512 where its
    sliding ones have 256). Its KV cache rows, ring messages and RoPE are that wide. 0: the model's."""
    n_kv_heads: int = 0
    """> 0: this layer's own KV head count (Gemma 4 31B's full layers: 4 where its sliding ones have
    16); the model's n_heads must be a multiple of it. 0: the model's."""

    def __post_init__(self) -> None:
        for name in ("window", "chunk", "rotary_dim", "temperature_floor", "head_dim", "n_kv_heads"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerAttention: {name}={getattr(self, name)}: {name} is a positive count; "
                                 f"give 0 for none (no {'rotation limit' if name == 'rotary_dim' else name})")
        if self.rotary_dim % 2:
            raise ValueError(f"LayerAttention: rotary_dim={self.rotary_dim} must be even (dims rotate in pairs)")
        for name in ("rope_theta", "scale", "softcap"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerAttention: {name}={getattr(self, name)} must be positive; give 0 for the "
                                 f"default ({_LAYER_DEFAULTS[name]})")
        if self.rope_scaling is not None and self.rope_theta == 0:
            raise ValueError("LayerAttention: rope_scaling is set but rope_theta=0 (the model's RoPE, whose scaling "
                             "applies); give the layer's own rope_theta too, or drop its rope_scaling")
        if not self.rope and (self.rope_theta or self.rotary_dim or self.rope_scaling is not None):
            raise ValueError("LayerAttention: rope=False (a NoPE layer) with its own rope_theta, rope_scaling or "
                             "rotary_dim: a layer without RoPE rotates nothing; drop those or set rope=True")
        if self.temperature_scale and not self.temperature_floor:
            raise ValueError(f"LayerAttention: temperature_scale={self.temperature_scale} needs a positive "
                             "temperature_floor (the positions per step of the temperature)")
        if isinstance(self.dual_chunk, Mapping):  # a saved config's dict
            object.__setattr__(self, "dual_chunk", DualChunk(**self.dual_chunk))
        if self.dual_chunk is not None and (self.window or self.chunk or not self.rope or self.rotary_dim
                                            or self.rope_scaling is not None or self.qk_norm_after_rope
                                            or self.temperature_floor):
            raise ValueError("LayerAttention: dual chunk attention is computed for full layers with the whole "
                             "head rotating and unscaled RoPE (no window, chunk, NoPE, partial rotary, scaling, "
                             "norm after RoPE or query temperature)")

    def query_temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """The factor each query is multiplied by: positions [T] long (global) -> float32 [T], all
        1.0 without a temperature.

        transformers computes floor((p + 1.0) / floor_scale) and log1p in float32; here the floor
        is an exact integer division and log1p runs in float64 (rounded once to float32): the
        same values up to float32 rounding, and exact at positions float32 no longer holds."""
        if not self.temperature_floor:
            return torch.ones(positions.shape, dtype=torch.float32, device=positions.device)
        math_device = torch.device("cpu") if positions.device.type == "mps" else positions.device  # no float64
        steps = torch.div(positions.to(math_device) + 1, self.temperature_floor, rounding_mode="floor")
        factor = torch.log1p(steps.to(torch.float64)) * self.temperature_scale + 1.0
        return factor.to(positions.device, torch.float32)

    @property
    def span(self) -> Span:
        """Which earlier keys this layer's queries see."""
        return Span(window=self.window, chunk=self.chunk,
                    dual_chunk=self.dual_chunk.chunk_len if self.dual_chunk else 0)

    @property
    def is_plain(self) -> bool:
        """True for plain causal attention with the model's RoPE (the default)."""
        return self == LayerAttention()

    def describe(self) -> str:
        """A few words for tables: 'full', 'window 4096', 'chunk 8192', 'dual chunk 262144/8192',
        with ', NoPE' etc."""
        kind = f"window {self.window}" if self.window else f"chunk {self.chunk}" if self.chunk else \
            self.dual_chunk.describe() if self.dual_chunk else "full"
        extras = [] if self.rope else ["NoPE"]
        if self.sinks:
            extras.append("sinks")
        if self.softcap:
            extras.append(f"soft-cap {self.softcap:g}")
        if self.qk_norm_after_rope:
            extras.append("q/k norm")
        if self.temperature_floor:
            extras.append(f"temperature /{self.temperature_floor}")
        if self.n_kv_heads:
            extras.append(f"{self.n_kv_heads} KV heads")
        if self.head_dim:
            extras.append(f"head dim {self.head_dim}")
        return ", ".join([kind, *extras])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerAttention":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


_LAYER_DEFAULTS = {"rope_theta": "the model's RoPE", "scale": "1/sqrt(head_dim)", "softcap": "no soft-cap"}
"""What a 0 means in LayerAttention's float fields (for its error lines)."""

PLAIN_LAYER = LayerAttention()


ROUTERS = ("softmax-topk", "topk-softmax", "sigmoid-topk", "gemma4")
"""How a mixture of experts picks a token's experts (`Experts.router`)."""

EXPERT_ACTIVATIONS = ("swiglu", "clamped-swiglu")
"""How each expert joins its gate and up halves (`Experts.activation`)."""


@dataclass(frozen=True)
class Experts:
    """One decoder layer's mixture-of-experts feed-forward (`ModelConfig.layer_experts`), in place of
    the dense gated MLP: a router scores every expert for each token, the token goes through its
    `experts_per_token` best ones (each a SwiGLU MLP of its own weights), and their outputs, times
    the routing weights, are summed (model/moe.py computes it).

    Router "softmax-topk" (Mixtral, Qwen3-MoE): probabilities = softmax(x W_router^T) over every
    expert in float32; the k largest are kept (ties: the lower expert index wins), renormalised to
    sum 1 when `renormalize`.

    Router "topk-softmax" (gpt-oss): the k largest logits x W_router^T + b_router (ties: the lower
    expert index), then a softmax over those k only (`renormalize` does not apply: they sum to 1).

    Router "sigmoid-topk" (Llama 4's Llama4Router): the k largest logits x W_router^T are kept (ties:
    the lower expert index), each expert's score is sigmoid(logit) computed in float32 (no
    renormalising), and the score multiplies the expert's INPUT: the token goes through expert e as
    expert_e(score * x), whose output is added unweighted (`scales_inputs`).

    Router "gemma4" (Gemma 4 26B-A4B's Gemma4TextRouter): the router reads the residual x RMS-normed
    without a weight (eps norm_eps; float32, rounded to the activations' dtype), times its own
    `router_scale` [dim], times dim**-0.5; then softmax-topk as above, always renormalised, and
    each kept weight times the chosen expert's `per_expert_scale` [E]. With `beside_dense` the
    layer keeps its dense MLP too (model/transformer.py's Block)."""

    n_experts: int
    """E: experts in the layer (Mixtral's num_local_experts, Qwen3-MoE's num_experts)."""
    experts_per_token: int
    """k: experts each token goes through (num_experts_per_tok)."""
    expert_ffn_dim: int
    """F: each expert's hidden width (Mixtral's intermediate_size, Qwen3-MoE's moe_intermediate_size;
    under tensor parallelism this rank's share of it)."""
    router: str = "softmax-topk"
    """How the experts are picked: one of ROUTERS."""
    renormalize: bool = True
    """The k kept probabilities are divided by their sum (Mixtral: always; Qwen3-MoE: norm_topk_prob).
    Read by "softmax-topk" only ("topk-softmax" weights sum to 1 already)."""
    weights_in_model_dtype: bool = False
    """The routing weights are rounded to the activations' dtype before they multiply the experts'
    outputs (Qwen3-MoE: `.to(router_logits.dtype)`); False: they stay float32 (Mixtral). Only a
    bf16 / fp16 model sees the difference."""
    shared_ffn_dim: int = 0
    """Hidden width of a shared expert every token also goes through, a SwiGLU MLP of its own weights
    whose output is added to the routed experts' sum (Llama 4's shared_expert: intermediate_size;
    under tensor parallelism this rank's share of it); 0: none."""
    shared_gate: bool = False
    """The shared expert's output is multiplied by sigmoid(x w_gate) (a weight [dim] -> one scalar
    per token, in the model's dtype) before it is added: Qwen3-Next's and Qwen3.5-MoE's
    shared_expert_gate."""
    beside_dense: bool = False
    """The layer keeps its dense gated MLP (ffn_dim) and adds the experts beside it, each branch
    with its own norms, their sum normed once more (Gemma 4's enable_moe_block); False: the experts
    replace the dense MLP."""
    activation: str = "swiglu"
    """How an expert's gate g and up u halves become its hidden units: "swiglu", the model's gated
    activation (silu(g) * u for Mixtral, Qwen3-MoE, Llama 4; Gemma 4's GeGLU); "clamped-swiglu"
    (gpt-oss), with g clamped above at swiglu_limit and u to [-swiglu_limit, swiglu_limit]:
    (u + 1) * g * sigmoid(swiglu_alpha * g)."""
    bias: bool = False
    """Every expert has biases: on its gate and up rows ([2F] each expert, split under TP as the
    rows are) and on its down projection ([dim]); gpt-oss."""
    router_bias: bool = False
    """The router has a bias [E] added to its logits (gpt-oss)."""
    swiglu_alpha: float = 1.702
    """clamped-swiglu: the gain inside the sigmoid (gpt-oss's swiglu_alpha)."""
    swiglu_limit: float = 7.0
    """clamped-swiglu: the clamp of the gate (above) and of up (both sides) (gpt-oss's swiglu_limit)."""

    def __post_init__(self) -> None:
        for name in ("n_experts", "experts_per_token", "expert_ffn_dim"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) <= 0:
                raise ValueError(f"Experts: {name}={getattr(self, name)!r} must be a positive count")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"Experts: experts_per_token={self.experts_per_token} is more than the layer's "
                             f"n_experts={self.n_experts}: a token picks among the layer's experts")
        if self.router not in ROUTERS:
            raise ValueError(f"Experts: router={self.router!r} is not computed; ringctx has {', '.join(ROUTERS)}")
        if isinstance(self.shared_ffn_dim, bool) or self.shared_ffn_dim < 0:
            raise ValueError(f"Experts: shared_ffn_dim={self.shared_ffn_dim!r} must be a count of units (0: no "
                             "shared expert)")
        if self.shared_gate and not self.shared_ffn_dim:
            raise ValueError("Experts: shared_gate without a shared expert (shared_ffn_dim=0): give the shared "
                             "expert's width, or drop shared_gate")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"Experts: activation={self.activation!r} is not computed; ringctx has "
                             f"{', '.join(EXPERT_ACTIVATIONS)}")
        if self.activation == "clamped-swiglu" and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise ValueError(f"Experts: clamped-swiglu with swiglu_alpha={self.swiglu_alpha}, "
                             f"swiglu_limit={self.swiglu_limit}: both must be positive")

    @property
    def scales_inputs(self) -> bool:
        """The routing weight multiplies the expert's input, not its output (router "sigmoid-topk")."""
        return self.router == "sigmoid-topk"

    def params(self, dim: int, active: bool = False) -> int:
        """Weights of this feed-forward for a residual width `dim`: the router [E, dim] (and its
        bias [E]), each expert's gate, up and down (3 * dim * F, and with `bias` 2F + dim) and the
        shared expert's (3 * dim * shared_ffn_dim), Gemma 4's router scales (dim + E); active: only
        the experts one token goes through (k of them), the router and the shared expert."""
        experts = self.experts_per_token if active else self.n_experts
        router = self.n_experts * (dim + (1 if self.router_bias else 0))
        router += dim + self.n_experts if self.router == "gemma4" else 0  # router_scale, per_expert_scale
        biases = 2 * self.expert_ffn_dim + dim if self.bias else 0
        shared = 3 * dim * self.shared_ffn_dim + (dim if self.shared_gate else 0)
        return router + experts * (3 * dim * self.expert_ffn_dim + biases) + shared

    def describe(self) -> str:
        """A few words for tables: '8 experts, top 2' ('16 experts, top 1 and a shared expert'; Gemma
        4's: '..., beside a dense MLP')."""
        shared = (" and a gated shared expert" if self.shared_gate else " and a shared expert") \
            if self.shared_ffn_dim else ""
        beside = ", beside a dense MLP" if self.beside_dense else ""
        return f"{self.n_experts} experts, top {self.experts_per_token}{shared}{beside}"


def with_head_shape(layer: LayerAttention, head_dim: int, n_kv_heads: int, model_head_dim: int,
                    model_kv_heads: int) -> LayerAttention:
    """`layer` with its own head shape (head_dim, n_kv_heads) where that differs from the model's
    (model_head_dim, model_kv_heads): head_dim is then spelled out, n_kv_heads only where the count
    differs. One spelling for every reader (Gemma 4's config.json and GGUF), so that the same
    checkpoint read either way gives equal configs (and fingerprints)."""
    if (head_dim, n_kv_heads) == (model_head_dim, model_kv_heads):
        return layer
    return dataclasses.replace(layer, head_dim=head_dim, n_kv_heads=n_kv_heads if n_kv_heads != model_kv_heads else 0)


ATTENTION_KINDS = ("full causal", "sliding window", "aligned chunks", "NoPE layers",
                   "per-layer RoPE (base, scaling, partial rotary)", "soft-capped scores", "sink logits",
                   "per-layer softmax scale", "weightless q/k norm after RoPE", "query temperature by position",
                   "dual chunk attention (dense)", "per-layer head shape (head dim, KV heads)",
                   "gated output (sigmoid of a projection)", "Gated DeltaNet linear attention (hybrids)")
"""What a layer's attention may be in this build (LayerAttention's fields), for `ringctx info`."""

@dataclass(frozen=True)
class LinearShape:
    """A linear-attention layer in place of attention (`ModelConfig.layer_linear`): a Gated DeltaNet
    (Qwen3.5 / 3.6, Qwen3-Next; model/gated_deltanet.py computes it), whose widths these are
    (Qwen3.5's linear_* config keys). It keeps no KV rows: a sequence's state is its recurrent
    state [value_heads, key_dim, value_dim] (float32) and the convolution's last conv_width - 1
    inputs [conv_width - 1, channels]."""

    key_heads: int
    """Hk: query/key heads (linear_num_key_heads)."""
    value_heads: int
    """Hv: value heads, a multiple of Hk (linear_num_value_heads); q and k serve Hv / Hk of them each."""
    key_dim: int
    """Dk: a query/key head's width (linear_key_head_dim)."""
    value_dim: int
    """Dv: a value head's width (linear_value_head_dim)."""
    conv_width: int = 4
    """K: the causal convolution's taps (linear_conv_kernel_dim)."""

    def __post_init__(self) -> None:
        for name in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_width"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) <= 0:
                raise ValueError(f"LinearShape: {name}={getattr(self, name)!r} must be a positive count")
        if self.value_heads % self.key_heads:
            raise ValueError(f"LinearShape: value_heads={self.value_heads} is not a multiple of "
                             f"key_heads={self.key_heads}: each key head serves a whole group of value heads")

    @property
    def channels(self) -> int:
        """C: the convolution's channels (q | k | v)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def recurrent_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (float32)."""
        return 4 * self.value_heads * self.key_dim * self.value_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one sequence's whole state: the recurrent state and the convolution's inputs
        (in the model's dtype, `dtype_bytes` each)."""
        return self.recurrent_bytes + (self.conv_width - 1) * self.channels * dtype_bytes

    def params(self, dim: int) -> int:
        """Weights of the layer for a residual width `dim`: in-projections (q|k|v, z, b, a), the
        convolution, dt_bias and A_log, the output norm, the out-projection."""
        v = self.value_heads * self.value_dim
        return dim * (self.channels + v + 2 * self.value_heads) + self.channels * self.conv_width \
            + 2 * self.value_heads + self.value_dim + v * dim

    def describe(self) -> str:
        """A few words for tables: 'Gated DeltaNet 16/48 heads x 128'."""
        dims = f"{self.key_dim}" if self.key_dim == self.value_dim else f"{self.key_dim}/{self.value_dim}"
        return f"Gated DeltaNet {self.key_heads}/{self.value_heads} heads x {dims}"


MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""Gate activations of the gated MLP (`ModelConfig.mlp_activation`)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2-style bias,
    Qwen3-style q/k norms, Seed-OSS, Phi-3) and of the blocks that differ from Llama's in a few
    constants (Gemma 3: (1 + w) norms, four norms a block, GeGLU, scaled embeddings, a soft-capped
    head; Gemma 4: v norms and block scalars too: `is_llama_block` says whether a config uses any
    of them)."""

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
    layer_attention: tuple[LayerAttention, ...] = ()
    """Per layer, how its attention sees and rotates (sliding windows, chunks, NoPE, its own RoPE,
    sinks, soft-cap, scale); empty: every layer plain (see `attention`)."""
    mlp_activation: str = "silu"
    """The gate's activation in the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh
    approximation of GELU: Gemma's gelu_pytorch_tanh)."""
    norm_plus_one: bool = False
    """Every RMSNorm (q/k norms too) multiplies by (1 + weight) rather than weight (Gemma); the
    weights stay as stored, the 1 is added in float32 at each use (see transformer.RMSNorm)."""
    post_norms: bool = False
    """Each block also RMS-normalises its attention output and its MLP output before adding them to
    the residual (Gemma 2/3: four norms a block)."""
    embed_scale: float = 1.0
    """Token embeddings are multiplied by this, rounded to the weights' dtype (Gemma: sqrt(dim))."""
    final_softcap: float = 0.0
    """> 0: logits become final_softcap * tanh(logits / final_softcap) (Gemma 2/3's final_logit_softcapping)."""
    v_norm: bool = False
    """Each head's v is RMS-normalised without a weight (eps norm_eps; in float32, rounded once): Gemma 4."""
    layer_scalars: bool = False
    """Each block's output is multiplied by its own stored scalar (weights `layer_scalar` [1]: Gemma 4)."""
    layer_experts: tuple[Experts | None, ...] = ()
    """Per layer, its mixture-of-experts feed-forward, or None where the layer has the dense gated
    MLP of `ffn_dim` (Qwen3-MoE's mlp_only_layers / decoder_sparse_step); empty: every layer dense
    (see `experts`)."""
    layer_linear: tuple[LinearShape | None, ...] = ()
    """Per layer, the linear attention (a Gated DeltaNet) that replaces its attention, or None for an
    attention layer (Qwen3.5: three of every four layers linear); empty: every layer attends (see
    `linear`). A linear layer keeps no KV rows (`kv_shapes` gives it 0 heads) but a state."""
    attn_output_gate: bool = False
    """The attention layers' output is multiplied by sigmoid(x W_gate^T) per head dim before the
    output projection (Qwen3.5 / Qwen3-Next: q_proj gives each head's query and gate side by side;
    transformers computes it in the model's dtype)."""

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
        layers = tuple(self.layer_attention)
        if all(layer.is_plain for layer in layers):
            layers = ()  # one spelling of "every layer plain": fingerprints and files agree
        object.__setattr__(self, "layer_attention", layers)
        if layers and len(layers) != self.n_layers:
            raise ValueError(f"ModelConfig {self.name!r}: layer_attention describes {len(layers)} layers "
                             f"but the model has n_layers={self.n_layers}: give one LayerAttention per layer "
                             "(or none: every layer plain)")
        experts = tuple(Experts(**e) if isinstance(e, Mapping) else e for e in self.layer_experts)
        if all(e is None for e in experts):
            experts = ()  # one spelling of "every layer dense": fingerprints and files agree
        object.__setattr__(self, "layer_experts", experts)
        if experts and len(experts) != self.n_layers:
            raise ValueError(f"ModelConfig {self.name!r}: layer_experts describes {len(experts)} layers but the "
                             f"model has n_layers={self.n_layers}: give one Experts or None per layer")
        if any(e is not None and e.beside_dense for e in experts) and not self.post_norms:
            raise ValueError(f"ModelConfig {self.name!r}: experts beside the dense MLP (Gemma 4's) are computed in "
                             "Gemma's block: set post_norms")
        linear = tuple(LinearShape(**x) if isinstance(x, Mapping) else x for x in self.layer_linear)
        if all(x is None for x in linear):
            linear = ()  # one spelling of "every layer attends"
        object.__setattr__(self, "layer_linear", linear)
        if linear and len(linear) != self.n_layers:
            raise ValueError(f"ModelConfig {self.name!r}: layer_linear describes {len(linear)} layers but the model "
                             f"has n_layers={self.n_layers}: give one LinearShape or None per layer")
        if linear and all(x is not None for x in linear):
            raise ValueError(f"ModelConfig {self.name!r}: every layer is linear attention; a hybrid keeps some "
                             "attention layers (ringctx splits those layers' KV over the ranks)")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ModelConfig {self.name!r}: mlp_activation={self.mlp_activation!r} "
                             f"(one of {', '.join(MLP_ACTIVATIONS)})")
        if self.rope_scaling is not None and any(layer.dual_chunk and not layer.rope_theta for layer in layers):
            raise ValueError(f"ModelConfig {self.name!r}: dual chunk attention with rope_type "
                             f"{self.rope_scaling.rope_type!r}: DCA rotates with plain RoPE (as vLLM); drop one of them")
        if self.v_norm and any(layer.dual_chunk for layer in layers):
            raise ValueError(f"ModelConfig {self.name!r}: dual chunk attention with a v norm (Gemma 4's) is not "
                             "computed; DCA layers are Qwen2's")
        for i, layer in enumerate(layers):
            if layer.rotary_dim > self.head_dim_of(i):
                raise ValueError(f"ModelConfig {self.name!r}: layer {i} rotates {layer.rotary_dim} dims "
                                 f"of a head of {self.head_dim_of(i)}: rotary_dim is at most head_dim (0: all of it)")
            if self.n_heads % self.kv_heads_of(i):
                raise ValueError(f"ModelConfig {self.name!r}: n_heads={self.n_heads} is not a multiple of layer "
                                 f"{i}'s n_kv_heads={self.kv_heads_of(i)}")
            if layer.dual_chunk is not None and (layer.head_dim or layer.n_kv_heads):
                raise ValueError(f"ModelConfig {self.name!r}: layer {i}: dual chunk attention with the layer's "
                                 "own head shape is not computed (DCA layers are Qwen2's)")

    def attention(self, layer: int) -> LayerAttention:
        """How layer `layer`'s attention sees and rotates."""
        return self.layer_attention[layer] if self.layer_attention else PLAIN_LAYER

    def experts(self, layer: int) -> Experts | None:
        """Layer `layer`'s mixture of experts, or None: its feed-forward is the dense gated MLP."""
        return self.layer_experts[layer] if self.layer_experts else None

    @property
    def has_experts(self) -> bool:
        """True when some layer's feed-forward is a mixture of experts."""
        return bool(self.layer_experts)

    def ffn_params(self, layer: int, active: bool = False) -> int:
        """Weights of layer `layer`'s feed-forward: the dense MLP's 3 * dim * ffn_dim, or its
        experts' and router's (active: what one token reads, see `Experts.params`)."""
        experts = self.experts(layer)
        if experts is not None and experts.beside_dense:  # Gemma 4: the dense MLP, the experts, 3 more norms
            return 3 * self.dim * self.ffn_dim + experts.params(self.dim, active) + 3 * self.dim
        return 3 * self.dim * self.ffn_dim if experts is None else experts.params(self.dim, active)

    def linear(self, layer: int) -> LinearShape | None:
        """Layer `layer`'s linear attention, or None: it is an attention layer."""
        return self.layer_linear[layer] if self.layer_linear else None

    @property
    def has_linear(self) -> bool:
        """True when some layer is linear attention (a hybrid: Qwen3.5, Qwen3-Next)."""
        return bool(self.layer_linear)

    @property
    def attention_layers(self) -> list[int]:
        """The layers that attend (keep KV rows), in order: every layer but the linear ones."""
        return [i for i in range(self.n_layers) if self.linear(i) is None]

    @property
    def linear_layers(self) -> list[int]:
        """The linear-attention layers, in order."""
        return [i for i in range(self.n_layers) if self.linear(i) is not None]

    def linear_state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one sequence's linear-attention states over all layers (recurrent states in
        float32, convolution inputs in the model's dtype of `dtype_bytes`): what a document or a
        question holds besides its KV rows, whatever its length."""
        return sum(self.linear(i).state_bytes(dtype_bytes) for i in self.linear_layers)

    def head_dim_of(self, layer: int) -> int:
        """Layer `layer`'s head width (its q, k and v heads): its own, else the model's head_dim."""
        return self.attention(layer).head_dim or self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """Layer `layer`'s KV head count: its own, else the model's n_kv_heads."""
        return self.attention(layer).n_kv_heads or self.n_kv_heads

    @property
    def kv_shapes(self) -> list[tuple[int, int]]:
        """Per layer, (KV heads, head width) of its K and V rows: the cache's, the ring's and the
        document files' row shape of that layer (a linear-attention layer's: 0 heads, no bytes)."""
        return [(0 if self.linear(i) is not None else self.kv_heads_of(i), self.head_dim_of(i))
                for i in range(self.n_layers)]

    @property
    def widest_head_dim(self) -> int:
        """The widest layer's head width: what a buffer that serves every layer's heads is sized for."""
        return max(d for _, d in self.kv_shapes)

    @property
    def uniform_heads(self) -> bool:
        """True when every layer has the model's head shape (one KV row shape for the whole cache)."""
        return not self.layer_linear and all(not (layer.head_dim or layer.n_kv_heads) for layer in self.layer_attention)

    @property
    def layer_spans(self) -> list[Span]:
        """Each layer's `Span` (which earlier keys its queries see), in layer order."""
        return [self.attention(i).span for i in range(self.n_layers)]

    def kv_rows_kept(self, tokens: int) -> int:
        """KV rows a cache of `tokens` tokens keeps over all layers once its windowed and chunked
        layers dropped what later tokens cannot see (`KVCache.drop_unseen`): `tokens` per full
        layer, at most W (or the current chunk) per other layer."""
        return sum(span.kept_tokens(tokens) for i, span in enumerate(self.layer_spans) if self.linear(i) is None)

    def kv_elements_kept(self, tokens: int) -> int:
        """K or V elements (heads x head width per row) those kept rows hold over all layers: what
        a cache's bytes follow when layers differ in head shape (`kv_rows_kept` when they do not,
        times one row's elements)."""
        return sum(span.kept_tokens(tokens) * h * d for span, (h, d) in zip(self.layer_spans, self.kv_shapes))

    def decode_kv_rows(self, context: int) -> int:
        """K/V rows a decode step at position `context` reads over all layers: every earlier row in
        a full layer, the window's or the current chunk's in the others (and its own)."""
        return self.kv_rows_kept(context) + len(self.attention_layers)

    def attention_summary(self) -> str:
        """The layers' attention kinds in a few words: "30 full", or "25 window 1024 + 5 full"."""
        counts: dict[str, int] = {}
        for i in range(self.n_layers):
            linear = self.linear(i)
            text = self.attention(i).describe() if linear is None else linear.describe()
            counts[text] = counts.get(text, 0) + 1
        return " + ".join(f"{n} {text}" for text, n in counts.items())

    def feed_forward_summary(self) -> str:
        """The layers' feed-forward kinds in a few words: "48 layers of 128 experts, top 8", or
        "24 dense + 24 layers of 128 experts, top 8"."""
        counts: dict[str, int] = {}
        for i in range(self.n_layers):
            experts = self.experts(i)
            text = "dense" if experts is None else f"layers of {experts.describe()}"
            counts[text] = counts.get(text, 0) + 1
        return " + ".join(f"{n} {text}" for text, n in counts.items())

    @property
    def has_dual_chunk(self) -> bool:
        """True when some layer runs Dual Chunk Attention (its queries come in three rotations)."""
        return any(layer.dual_chunk is not None for layer in self.layer_attention)

    @property
    def has_plain_attention(self) -> bool:
        """True when every layer is plain causal attention with the model's RoPE."""
        return not self.layer_attention

    @property
    def is_llama_block(self) -> bool:
        """True when the blocks, embedding and head are Llama's (SwiGLU, weight-multiplied norms, two
        norms a block, unscaled embeddings, no logit soft-cap, no v norm or block scalars, no gated
        attention output, no linear-attention layers): what the
        fused CPU kernels compute."""
        return (self.mlp_activation == "silu" and not self.norm_plus_one and not self.post_norms
                and self.embed_scale == 1.0 and not self.final_softcap and not self.v_norm
                and not self.layer_scalars and not self.has_linear and not self.attn_output_gate)

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied; every expert of every layer)."""
        return self._params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one token reads: `n_params` with each mixture of experts counted as its
        router and the experts_per_token experts the token goes through (n_params for a dense model)."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        layers = 0
        for i, (hkv, d) in enumerate(self.kv_shapes):
            mlp = self.ffn_params(i, active)
            if self.linear(i) is not None:
                layers += self.linear(i).params(self.dim) + mlp + 2 * self.dim
                continue
            attn = self.dim * (self.n_heads + 2 * hkv) * d + self.n_heads * d * self.dim
            if self.attn_output_gate:  # the gate's rows beside q's
                attn += self.dim * self.n_heads * d
            if self.qkv_bias:
                attn += (self.n_heads + 2 * hkv) * d
            if self.attn_out_bias:
                attn += self.dim
            if self.attention(i).sinks:  # one sink logit per query head (gpt-oss)
                attn += self.n_heads
            if self.qk_norm:
                attn += 2 * d
            layers += attn + mlp + (4 if self.post_norms else 2) * self.dim + (1 if self.layer_scalars else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return layers + self.vocab_size * self.dim + head + self.dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes of K and V that one token adds to the cache over all layers."""
        return 2 * sum(h * d for h, d in self.kv_shapes) * element_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["layer_attention"] = tuple(LayerAttention.from_dict(x) for x in d.get("layer_attention") or ())
        d["layer_experts"] = tuple(None if x is None else Experts(**x) for x in d.get("layer_experts") or ())
        d["layer_linear"] = tuple(None if x is None else LinearShape(**x) for x in d.get("layer_linear") or ())
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
        if d.get("layer_attention"):
            d["layer_attention"] = [{k: v for k, v in layer.items() if getattr(PLAIN_LAYER, k) != v}
                                    for layer in d["layer_attention"]]
        if d.get("layer_experts"):
            d["layer_experts"] = [None if e is None else {k: v for k, v in e.items()
                                                          if _LATER_EXPERT_FIELDS.get(k, _MISSING) != v}
                                  for e in d["layer_experts"]]
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = {k: v for k, v in d["rope_scaling"].items()
                                 if _LATER_ROPE_FIELDS.get(k, _MISSING) != v}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def rope_inv_freq(self, layer: int | None = None, long: bool = False) -> list[float]:
        """Rotary angular frequencies per rotating pair of head dims [rotary_dim // 2], scaling
        applied (float64): the model's, or layer `layer`'s own (its base, scaling, rotary dims);
        long: longrope's long factors (see RopeScaling)."""
        theta, scaling, dims = self.rope_of(layer)
        plain = [theta ** (-(2 * i) / dims) for i in range(dims // 2)]
        return plain if scaling is None else scaling.scaled_inv_freq(plain, theta, long)

    def rope_of(self, layer: int | None = None) -> tuple[float, RopeScaling | None, int]:
        """(base, scaling, rotating dims) of layer `layer`'s RoPE (None: the model's)."""
        attention = PLAIN_LAYER if layer is None else self.attention(layer)
        dims = attention.rotary_dim or (self.head_dim if layer is None else self.head_dim_of(layer))
        if attention.rope_theta > 0:
            return attention.rope_theta, attention.rope_scaling, dims
        return self.rope_theta, self.rope_scaling, dims

    def rope_attention_factor(self, layer: int | None = None) -> float:
        """The factor RoPE's cos and sin are multiplied by (YaRN's; 1.0 otherwise)."""
        scaling = self.rope_of(layer)[1]
        return 1.0 if scaling is None else scaling.attention_factor

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
          original_max_position_embeddings states the scaled length itself (Gemma 3: linear x8,
          max_position_embeddings 131,072, a 128K model): max_seq_len.
        - longrope (Phi-3/3.5/4): max_seq_len, the long factors' length (131,072 over an
          original 4,096 for the 128K models).
        - proportional (Gemma 4): max_seq_len (it scales no length).
        - dual chunk attention (Qwen2.5-7B/14B-Instruct-1M; plain RoPE, see LayerAttention): its
          rotations never exceed chunk_size whatever the length, and the checkpoint states the
          length DCA extends to as max_position_embeddings (1,010,000 over a chunk_size of
          262,144): max_seq_len, the plain-RoPE line.
        """
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type in ("llama3", "dynamic", "longrope", "proportional"):
            return self.max_seq_len
        if scaling.rope_type == "linear" and scaling.original_max_position == self.max_seq_len:
            return self.max_seq_len  # no original length given: max_position_embeddings is the scaled one
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

_LATER_FIELDS = {"qk_norm": False, "layer_attention": (), "mlp_activation": "silu", "norm_plus_one": False,
                 "post_norms": False, "embed_scale": 1.0, "final_softcap": 0.0, "v_norm": False,
                 "layer_scalars": False, "layer_experts": (), "layer_linear": (), "attn_output_gate": False}
"""ModelConfig fields added after fingerprints were first stored, with their defaults."""
_LATER_ROPE_FIELDS = {"rope_type": "llama3", "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                      "attention_factor": 1.0, "long_factor": (), "short_factor": (), "proportion": 1.0}
"""RopeScaling fields added after fingerprints were first stored, with their defaults."""
_LATER_EXPERT_FIELDS = {"beside_dense": False, "activation": "swiglu", "bias": False, "router_bias": False,
                        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "shared_gate": False}
"""Experts fields added after MoE fingerprints were first stored (Gemma 4's, gpt-oss's), with their defaults."""
