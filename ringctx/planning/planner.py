"""Planning a (chunked) context-parallel prefill: strategy per chunk, predicted times, memory.

`plan_prefill` splits a prompt of `tokens` new tokens (after `cached` tokens already in the KV
cache) into chunks of `chunk_tokens`; chunk k has T_k new tokens over P_k = cached + T_0 + ... +
T_(k-1) cached ones. For every chunk it asks `choose_strategy` for pass-KV or pass-Q and the cost
model for the predicted time of both; the time to first token is the sum of the chosen times plus
the LM head on the last token. Memory is estimated per rank (per GPU under TP) and compared with
the hardware profile.

After the prefill the KV cache stays split by token position over `decode_ranks` devices of one
host, each holding the weights (/ TP) and a balanced slice of every layer's K/V; `plan_decode`
estimates one such device and the plan fits only when both the prefill ranks and the decode
devices do. `kv_dtype` ("model", a float, "fp8", "int8") is how both sides store the cache.

`propose_mesh` chooses the mesh for a number of hosts: it plans every (cp, tp) with TP inside a
host and proposes the smallest TP whose prefill GPU fits (the paper's TP inside, CP across hosts).

    >>> from ringctx.model.config import get_preset
    >>> plan = plan_prefill(get_preset("llama3-8b"), 4, "h100-rdma", tokens=131072, chunk_tokens=32768)
    >>> [e.strategy for e in plan.entries]
    ['pass-kv', 'pass-kv', 'pass-kv', 'pass-kv']
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from ringctx.attention.quant import check_kv_dtype, is_quantized, kv_element_bytes
from ringctx.model.config import PRESETS, ModelConfig, get_preset
from ringctx.hub import local_model_path
from ringctx.planning.hardware import HardwareProfile, canonical_dtype, element_bytes, load_profile
from ringctx.planning.strategy import (
    LSE_BYTES, PASS_KV, PASS_Q, RULES, STRATEGIES, StrategyChoice, StrategyCost, all2all_bytes_per_rank,
    cached_rows_per_rank, choose_strategy, local_heads, predict_costs, tokens_per_rank,
)

MEMORY_USABLE_FRACTION = 0.9
"""Share of a rank's memory a plan may fill; the rest absorbs allocator fragmentation, the CUDA
context or Python runtime, and temporaries the estimate leaves out."""

MIN_DEFAULT_CHUNK_TOKENS = 256
"""Smallest chunk `default_chunk_tokens` proposes: below it, per-message latency and kernel
launches dominate and pass-KV's transfer cannot hide under compute (Eq. 2)."""

HIDDEN_BUFFERS = 4
"""Residual-stream-sized buffers alive in one layer: residual, normed input, attention output, MLP
output."""

DECODE_ROOM_TOKENS = 256
"""KV rows the decode cache keeps beyond the prompt for generated tokens (the engine's default
`decode_room`)."""

DEQUANT_BLOCK_TOKENS = 4096
"""Rows of an 8-bit KV slice that decode attention widens at a time (K and V of one layer, float32):
the slice is read block by block, never dequantized whole, so only one block is alive. The default
`block_rows` of ringctx.attention.quant.attention_block_quantized."""

FALLBACK_KV_DTYPE = "fp8"
"""The 8-bit format a refused plan suggests when its own kv_dtype fits no decode-rank count (int8 is
the same size)."""


# ----------------------------------------------------------------------------- memory formulas


def weight_bytes_per_rank(model: ModelConfig, tp_size: int, weight_dtype: str) -> int:
    """Weights on one GPU: n_params * e_w / TP (every CP rank holds a full TP shard of the model;
    embeddings and LM head are taken as vocab-parallel, so they split too)."""
    return -(-model.n_params * element_bytes(weight_dtype) // tp_size)


def kv_row_bytes(model: ModelConfig, tp_size: int, dtype: str, kv_dtype: str = "model") -> int:
    """Bytes one token adds to one GPU's KV cache over all layers: 2 * n_layers * NKV_local * DH * e_kv.

    e_kv = kv_element_bytes(kv_dtype, DH, e(dtype)): e(dtype) for "model", the float's own size, or
    1 + 4/DH for fp8/int8 (one byte per element and a float32 scale per token and KV head), so one
    head's row is DH * e or DH + 4 bytes, always a whole number.
    """
    _, kv_heads = local_heads(model, tp_size)
    head_row = round(model.head_dim * kv_element_bytes(kv_dtype, model.head_dim, element_bytes(dtype)))
    return 2 * model.n_layers * kv_heads * head_row


def kv_cache_bytes_per_rank(model: ModelConfig, rows_per_rank: int, tp_size: int, dtype: str,
                            kv_dtype: str = "model") -> int:
    """KV shard on one GPU: rows * kv_row_bytes = rows * 2 * n_layers * NKV_local * DH * e_kv.

    With tp_size = 1 and kv_dtype "model" this is rows * model.kv_bytes_per_token(e). The shard is
    stored in kv_dtype (chunks are quantized as they are appended), while ring messages stay in
    `dtype` (activation_bytes_per_rank). The planner takes rows = ceil(cached/N) + the sum over
    chunks of tokens_per_rank(T_k, N) (the fullest rank of each chunk's balanced sharding), which
    is (cached+tokens)/N when 2N divides every chunk and N the cache.
    """
    return rows_per_rank * kv_row_bytes(model, tp_size, dtype, kv_dtype)


def layer_activation_bytes(model: ModelConfig, tp_size: int, rows: int, dtype: str) -> int:
    """One layer's activations for `rows` tokens on one GPU, ring buffers and logits left out:
    the hidden, qkv, mlp and accumulator terms of `activation_bytes_per_rank` with t = rows."""
    heads, kv_heads = local_heads(model, tp_size)
    e, DH = element_bytes(dtype), model.head_dim
    hidden = HIDDEN_BUFFERS * rows * model.dim * e
    qkv = rows * (heads + 2 * kv_heads) * DH * e
    mlp = 3 * rows * (model.ffn_dim // tp_size) * e
    accumulator = rows * heads * (DH + 1) * LSE_BYTES
    return hidden + qkv + mlp + accumulator


def activation_bytes_per_rank(model: ModelConfig, cp_size: int, tp_size: int, chunk_tokens: int,
                              max_cached_per_rank: int, strategy: str, dtype: str) -> int:
    """Working set of one layer for one chunk on one GPU (layers run one after the other in
    inference, so only one layer's activations are alive). With t = tokens_per_rank(chunk, N)
    (about chunk/N) and e = bytes per element:

      hidden      4 * t * dim * e                      (HIDDEN_BUFFERS residual-sized buffers)
      qkv         t * (NH + 2*NKV)_local * DH * e
      mlp         3 * t * ffn/TP * e                   (gate, up, their product)
      accumulator t * NH_local * (DH + 1) * 4           (float32 output and LSE of the merge)
      ring        pass-KV: 2 * (max_i P_i + t) * 2 * NKV_local * DH * e   (send and receive buffer)
                  pass-Q : 2 * t * NH_local * DH * e  +  2 * All2All bytes  (Q in flight, partials
                           held for and received from the N-1 other ranks); 0 when N = 1
      logits      vocab * 4                            (float32, last token only)
    """
    heads, kv_heads = local_heads(model, tp_size)
    e, DH, t = element_bytes(dtype), model.head_dim, tokens_per_rank(chunk_tokens, cp_size)
    if cp_size == 1:
        ring = 0
    elif strategy == PASS_KV:
        ring = 2 * (max_cached_per_rank + t) * 2 * kv_heads * DH * e
    elif strategy == PASS_Q:
        ring = 2 * t * heads * DH * e + 2 * all2all_bytes_per_rank(chunk_tokens, cp_size, heads, DH, e)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    return layer_activation_bytes(model, tp_size, t, dtype) + ring + model.vocab_size * 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one rank (one GPU under TP) during the prefill."""

    weights_bytes: int
    """Model weights: n_params * e_w / TP."""
    kv_cache_bytes: int
    """KV-cache shard after the prefill: (cached + tokens)/N rows of all layers, in the kv dtype."""
    activation_bytes: int
    """Largest one-layer working set over the chunks (chunk activations and ring buffers)."""
    capacity_bytes: float
    """Memory of one rank in the hardware profile."""
    usable_bytes: float
    """capacity * MEMORY_USABLE_FRACTION: what the plan may fill."""

    @property
    def total_bytes(self) -> int:
        """weights + KV cache + activations."""
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        """Whether total_bytes <= usable_bytes."""
        return self.total_bytes <= self.usable_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}


# ----------------------------------------------------------------------------- the decode side


def max_decode_ranks(hardware: HardwareProfile, tp_size: int) -> int:
    """Most decode ranks one host holds: its devices // TP (a decode rank spans TP devices)."""
    return hardware.host_devices() // tp_size


def default_decode_ranks(hardware: HardwareProfile, cp_size: int, tp_size: int) -> int:
    """Every rank of the decode host: its devices // TP, or the CP ranks when the job has fewer."""
    return min(max_decode_ranks(hardware, tp_size), cp_size)


def decode_slice_tokens(context_tokens: int, decode_ranks: int) -> int:
    """Cache rows of one decode device: ceil((context + DECODE_ROOM_TOKENS) / D), the balanced split."""
    return -(-(context_tokens + DECODE_ROOM_TOKENS) // decode_ranks)


def decode_workspace_bytes(model: ModelConfig, tp_size: int, slice_tokens: int, dtype: str,
                           kv_dtype: str) -> dict[str, int]:
    """Working memory of one decode step on one decode device, by term (e = bytes of `dtype`):

      token_activation_bytes  one token through one layer: layer_activation_bytes at t = 1
                              (4 residual-sized buffers, q/k/v, the MLP's three, the float32
                              accumulator and LSE)
      scores_bytes            NH_local * slice_tokens * 4: float32 attention scores of one layer,
                              every query head against this device's slice
      logits_bytes            vocab * 4: float32 logits of the token
      dequant_bytes           8-bit caches only: K and V of one DEQUANT_BLOCK_TOKENS block (or the
                              whole slice if shorter) of one layer widened to float32,
                              2 * rows * NKV_local * DH * 4; 0 for float caches (read in place)
    """
    heads, kv_heads = local_heads(model, tp_size)
    block = min(slice_tokens, DEQUANT_BLOCK_TOKENS) if is_quantized(kv_dtype) else 0
    return {
        "token_activation_bytes": layer_activation_bytes(model, tp_size, 1, dtype),
        "scores_bytes": heads * slice_tokens * 4,
        "logits_bytes": model.vocab_size * 4,
        "dequant_bytes": 2 * block * kv_heads * model.head_dim * 4,
    }


@dataclass(frozen=True)
class DecodeSetting:
    """A decode layout: how many ranks hold the KV cache and how it is stored."""

    decode_ranks: int
    """D: devices of the decode host, each with a 1/D slice of the tokens."""
    kv_dtype: str
    """KV-cache storage, one of KV_DTYPES."""

    @property
    def flags(self) -> str:
        """The command-line options that select this setting."""
        return f"--decode-ranks {self.decode_ranks} --kv-dtype {self.kv_dtype}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DecodeMemory:
    """Memory of one decode device after the prefill: weights, its KV slice, one step's workspace."""

    decode_ranks: int
    """D: devices of the decode host that hold a slice of the KV cache (each with the weights / TP)."""
    max_decode_ranks: int
    """Most decode ranks one host holds: its devices // TP."""
    kv_dtype: str
    """How the cache is stored: "model" (the activation dtype), a float dtype, "fp8" or "int8"."""
    context_tokens: int
    """Tokens in the cache after the prefill: cached + new prompt tokens."""
    slice_tokens: int
    """Cache rows of one device: ceil((context_tokens + DECODE_ROOM_TOKENS) / D)."""
    weights_bytes: int
    """Model weights: n_params * e_w / TP (the full model when TP = 1)."""
    kv_slice_bytes: int
    """The device's KV slice: slice_tokens * kv_row_bytes (all layers, kv dtype with its scales)."""
    token_activation_bytes: int
    """One token's activations of one layer (see decode_workspace_bytes)."""
    scores_bytes: int
    """Float32 attention scores of one layer over the slice: NH_local * slice_tokens * 4."""
    logits_bytes: int
    """Float32 logits of one token: vocab * 4."""
    dequant_bytes: int
    """8-bit caches: one block of K and V widened to float32; 0 otherwise."""
    capacity_bytes: float
    """Memory of one decode device in the hardware profile."""
    usable_bytes: float
    """capacity * MEMORY_USABLE_FRACTION: what the decode may fill."""

    @property
    def workspace_bytes(self) -> int:
        """token activations + scores + logits + dequantized block."""
        return self.token_activation_bytes + self.scores_bytes + self.logits_bytes + self.dequant_bytes

    @property
    def total_bytes(self) -> int:
        """weights + KV slice + workspace."""
        return self.weights_bytes + self.kv_slice_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        """Whether total_bytes <= usable_bytes."""
        return self.total_bytes <= self.usable_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "workspace_bytes": self.workspace_bytes,
                "total_bytes": self.total_bytes, "fits": self.fits}


def plan_decode(model: "ModelConfig | str", hardware: "HardwareProfile | str", context_tokens: int,
                decode_ranks: int, kv_dtype: str = "model", tp_size: int = 1, dtype: str = "bfloat16",
                *, weight_dtype: str | None = None) -> DecodeMemory:
    """Memory of one of `decode_ranks` devices holding a cache of `context_tokens` tokens.

    Every input is checked first: decode_ranks must be 1 .. devices of one host // TP.
    """
    model, hw, dtype, weight_dtype = _validate_setting(model, hardware, tp_size, dtype, weight_dtype, kv_dtype)
    _check_integers((("context_tokens", context_tokens, 0),))
    _check_decode_ranks(decode_ranks, hw, tp_size)
    return _decode_memory(model, hw, context_tokens, DecodeSetting(decode_ranks, kv_dtype), tp_size, dtype,
                          weight_dtype)


def _decode_memory(model: ModelConfig, hw: HardwareProfile, context_tokens: int, setting: DecodeSetting,
                   tp_size: int, dtype: str, weight_dtype: str) -> DecodeMemory:
    """DecodeMemory of already validated inputs."""
    slice_tokens = decode_slice_tokens(context_tokens, setting.decode_ranks)
    capacity = rank_memory_bytes(hw, setting.decode_ranks)  # host RAM profiles share it among the ranks
    return DecodeMemory(
        decode_ranks=setting.decode_ranks, max_decode_ranks=max_decode_ranks(hw, tp_size),
        kv_dtype=setting.kv_dtype, context_tokens=context_tokens, slice_tokens=slice_tokens,
        weights_bytes=weight_bytes_per_rank(model, tp_size, weight_dtype),
        kv_slice_bytes=kv_cache_bytes_per_rank(model, slice_tokens, tp_size, dtype, setting.kv_dtype),
        **decode_workspace_bytes(model, tp_size, slice_tokens, dtype, setting.kv_dtype),
        capacity_bytes=capacity, usable_bytes=capacity * MEMORY_USABLE_FRACTION,
    )


def smallest_decode_setting(model: ModelConfig, hw: HardwareProfile, context_tokens: int, kv_dtype: str,
                            tp_size: int, dtype: str, weight_dtype: str) -> DecodeSetting | None:
    """The fewest decode ranks that fit with `kv_dtype`, else with fp8; None when nothing on one host fits.

    Fewest ranks first because each extra rank holds another copy of the weights; fp8 only after
    that because it rounds the cache. int8 is the same size as fp8, so it is never tried apart.
    """
    kv_dtypes = (kv_dtype,) if is_quantized(kv_dtype) else (kv_dtype, FALLBACK_KV_DTYPE)
    for kv in kv_dtypes:
        for ranks in range(1, max_decode_ranks(hw, tp_size) + 1):
            setting = DecodeSetting(ranks, kv)
            if _decode_memory(model, hw, context_tokens, setting, tp_size, dtype, weight_dtype).fits:
                return setting
    return None


def _check_decode_ranks(decode_ranks, hw: HardwareProfile, tp_size: int) -> None:
    """A ValueError unless 1 <= decode_ranks <= devices of one host // TP (the decode runs on one host)."""
    devices = hw.host_devices()
    if tp_size > devices:
        raise ValueError(f"tp_size={tp_size} is more than the {devices} devices of one {hw.name!r} host, where "
                         f"the decode runs; use tp_size <= {devices} (or set devices_per_host in the profile)")
    limit = max_decode_ranks(hw, tp_size)
    if isinstance(decode_ranks, bool) or not isinstance(decode_ranks, int) or not 1 <= decode_ranks <= limit:
        what = f"the {devices} devices of one {hw.name!r} host" + (f" / tp_size {tp_size}" if tp_size > 1 else "")
        raise ValueError(f"decode_ranks must be an integer from 1 to {limit} ({what}, where the decode runs), "
                         f"got {decode_ranks!r}; pass 1 to {limit}, or set devices_per_host in the hardware profile")


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of the prefill: its tokens, the chosen strategy and the predicted times."""

    index: int
    """Position of the chunk, 0 first."""
    new_tokens: int
    """T_k: tokens of this chunk."""
    cached_tokens: int
    """P_k: cached + the tokens of earlier chunks."""
    max_cached_per_rank: int
    """max_i P_i: cache rows of the fullest rank when the chunk starts (pads pass-KV messages)."""
    choice: StrategyChoice
    """What choose_strategy decided and why."""
    costs: dict[str, StrategyCost]
    """Cost-model prediction of both strategies for this chunk."""
    activation_bytes: int
    """One-layer working set of this chunk with the chosen strategy."""

    @property
    def strategy(self) -> str:
        """The chosen strategy, "pass-kv" or "pass-q"."""
        return self.choice.strategy

    @property
    def predicted_ms(self) -> dict[str, float]:
        """Predicted time of the whole chunk (all layers) with each strategy, in ms."""
        return {s: self.costs[s].total_s * 1e3 for s in STRATEGIES}

    @property
    def chosen_ms(self) -> float:
        """Predicted time of the chunk with the chosen strategy, in ms."""
        return self.predicted_ms[self.strategy]

    def to_dict(self) -> dict:
        return {
            "index": self.index, "new_tokens": self.new_tokens, "cached_tokens": self.cached_tokens,
            "max_cached_per_rank": self.max_cached_per_rank, "strategy": self.strategy,
            "reason": self.choice.reason, "predicted_ms": self.predicted_ms, "chosen_ms": self.chosen_ms,
            "exposed_comm_ms": {s: self.costs[s].exposed_comm_s * self.costs[s].n_layers * 1e3 for s in STRATEGIES},
            "activation_bytes": self.activation_bytes, "choice": self.choice.to_dict(),
            "costs": {s: self.costs[s].to_dict() for s in STRATEGIES},
        }


@dataclass(frozen=True)
class Plan:
    """The plan of one (chunked) prefill on a CP group."""

    model: ModelConfig
    """The model planned for."""
    hardware: HardwareProfile
    """The hardware profile the numbers come from."""
    cp_size: int
    """N: ranks of the CP ring."""
    tp_size: int
    """Tensor-parallel degree inside each CP rank (per-GPU numbers divide by it)."""
    dtype: str
    """Dtype of activations, attention and ring messages."""
    weight_dtype: str
    """Dtype of the weights (the paper runs FP8 FFN weights for 405B)."""
    kv_dtype: str
    """How the KV cache is stored, on the prefill ranks and the decode devices: "model" (= dtype), a
    float dtype, "fp8" or "int8" (one byte per element + a float32 scale per token and KV head)."""
    rule: str
    """Strategy rule: "alg1", "alg5", "empirical" or "cost"."""
    tokens: int
    """New tokens of the prompt."""
    cached: int
    """Tokens already in the KV cache before the prompt."""
    chunk_tokens: int
    """Tokens per chunk (the last may be shorter); equals tokens for an unchunked prefill."""
    entries: tuple[ChunkPlan, ...]
    """One entry per chunk, in order."""
    lm_head_ms: float
    """The LM head on the last token."""
    memory: MemoryEstimate
    """Peak memory per prefill rank."""
    decode: DecodeMemory
    """Memory of one decode device once the cache is split over the decode ranks."""
    decode_suggestion: DecodeSetting | None
    """When the decode does not fit: the smallest setting that does (smallest_decode_setting), or
    None when nothing on one host fits. None as well when the decode fits."""
    handoff_ms: float = 0.0
    """Moving KV between the ranks and the decode rank: scattering the `cached` tokens over the
    ranks first, gathering the new tokens' KV to the decode rank after the chunks (ringctx's
    engine does both; the paper's deployment keeps KV on the CP ranks). 0 with one rank."""

    @property
    def ttft_ms(self) -> float:
        """Predicted time to first token: the chunks' chosen times + the LM head + the KV hand-off."""
        return sum(e.chosen_ms for e in self.entries) + self.lm_head_ms + self.handoff_ms

    @property
    def best_ttft_ms(self) -> float:
        """TTFT if every chunk ran the strategy the cost model predicts faster (rule check)."""
        return sum(min(e.predicted_ms.values()) for e in self.entries) + self.lm_head_ms + self.handoff_ms

    @property
    def tp_allreduce_ms(self) -> float:
        """The part of the chunks' time spent in TP all-reduces (0 at TP 1), over all layers."""
        return sum(e.costs[e.strategy].tp_allreduce_s * e.costs[e.strategy].n_layers for e in self.entries) * 1e3

    @property
    def layer_overhead_ms(self) -> float:
        """The part of the chunks' time that is the profile's fixed cost per layer, over all layers."""
        return sum(e.costs[e.strategy].layer_overhead_s * e.costs[e.strategy].n_layers for e in self.entries) * 1e3

    @property
    def fits(self) -> bool:
        """Whether both sides fit the profile's usable memory: every prefill rank and every decode device."""
        return self.memory.fits and self.decode.fits

    def to_dict(self) -> dict:
        hw = self.hardware
        return {
            "model": self.model.name, "model_fingerprint": self.model.fingerprint(),
            "hardware": hw.name, "hardware_calibrated": hw.calibrated, "hardware_source": hw.source_path,
            "cp_size": self.cp_size, "tp_size": self.tp_size, "dtype": self.dtype,
            "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype, "rule": self.rule, "tokens": self.tokens,
            "cached": self.cached,
            "chunk_tokens": self.chunk_tokens, "entries": [e.to_dict() for e in self.entries],
            "lm_head_ms": self.lm_head_ms, "handoff_ms": self.handoff_ms, "ttft_ms": self.ttft_ms, "best_ttft_ms": self.best_ttft_ms,
            "tp_allreduce_ms": self.tp_allreduce_ms, "layer_overhead_ms": self.layer_overhead_ms,
            "memory": self.memory.to_dict(),
            "decode": {**self.decode.to_dict(),
                       "smallest_fitting": self.decode_suggestion.to_dict() if self.decode_suggestion else None},
            "fits": self.fits, "suggestion": decode_problem(self),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def rank_memory_bytes(hardware: HardwareProfile, cp_size: int) -> float:
    """Memory of one rank: the profile's memory_bytes, divided by N when the ranks share one host
    (profiles with `host_cores`, where memory_bytes is the host's RAM)."""
    return hardware.memory_bytes / (cp_size if hardware.host_cores else 1)


def resolve_model_config(model: "ModelConfig | str | os.PathLike") -> ModelConfig:
    """A ModelConfig from a preset name, a GGUF file, a Hugging Face directory / config.json, or a
    Hugging Face model name ORG/NAME in the local cache.

    Only the configuration is read, never the weights. A ValueError names the known presets when
    `model` is neither a preset nor an existing path.
    """
    if isinstance(model, ModelConfig):
        return model
    text = os.fspath(model)
    if text in PRESETS:
        return get_preset(text)
    text = local_model_path(text)  # ORG/NAME: the local Hugging Face cache's snapshot
    if not os.path.exists(text):
        raise ValueError(f"unknown model {text!r}: not a preset ({', '.join(sorted(PRESETS))}) and no such file; "
                         "name a preset, a .gguf file or a Hugging Face model directory")
    if os.path.isdir(text):
        if os.path.isfile(os.path.join(text, "config.json")):
            return ModelConfig.from_hf_config(text)
        ggufs = sorted(f for f in os.listdir(text) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelConfig.from_gguf(os.path.join(text, ggufs[0]))
        raise ValueError(f"{text}: a directory without config.json or a single .gguf file; not a model directory")
    if os.path.basename(text) == "config.json":
        return ModelConfig.from_hf_config(text)
    with open(text, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return ModelConfig.from_gguf(text)
    raise ValueError(f"{text}: neither a GGUF file nor a Hugging Face config.json; name a model preset, "
                     "a .gguf file or a model directory")


def split_chunks(tokens: int, chunk_tokens: int) -> list[int]:
    """Chunk lengths: full chunks of chunk_tokens, then the remainder (if any)."""
    full, rest = divmod(tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def plan_prefill(model: "ModelConfig | str", cp_size: int, hardware: "HardwareProfile | str", tokens: int,
                 cached: int = 0, chunk_tokens: int | None = None, tp_size: int = 1, dtype: str = "bfloat16",
                 rule: str = "alg5", *, weight_dtype: str | None = None, handoff: bool = True,
                 decode_ranks: int | None = None, kv_dtype: str = "model") -> Plan:
    """Plan the prefill of `tokens` new tokens after `cached` cached ones on `cp_size` ranks.

    `chunk_tokens` None (or >= tokens) plans a single (partial) prefill; otherwise the prompt runs
    in chunks of that size. `model` is a ModelConfig or preset name, `hardware` a profile, a
    built-in profile name or a JSON path. `weight_dtype` defaults to `dtype`. `handoff` counts the
    engine's KV scatter/gather to the decode rank in the time to first token. `decode_ranks`
    (default_decode_ranks when None) devices of one host hold the cache afterwards, stored, like
    the prefill shards, in `kv_dtype` (see plan_decode).
    """
    model, hw, dtype, weight_dtype = _validate(model, cp_size, hardware, tokens, cached, chunk_tokens,
                                               tp_size, dtype, rule, weight_dtype, kv_dtype)
    if decode_ranks is None:
        decode_ranks = default_decode_ranks(hw, cp_size, tp_size)
    _check_decode_ranks(decode_ranks, hw, tp_size)
    chunk = tokens if chunk_tokens is None else min(chunk_tokens, tokens)
    entries, rows, seen = [], cached_rows_per_rank(cached, cp_size), cached
    for index, new in enumerate(split_chunks(tokens, chunk)):
        choice = choose_strategy(new, seen, model, cp_size, hw, rule, dtype=dtype, tp_size=tp_size,
                                 max_cached_per_rank=rows)
        costs = predict_costs(new, seen, model, cp_size, hw, tp_size=tp_size, dtype=dtype,
                              weight_dtype=weight_dtype, max_cached_per_rank=rows)
        activation = activation_bytes_per_rank(model, cp_size, tp_size, new, rows, choice.strategy, dtype)
        entries.append(ChunkPlan(index, new, seen, rows, choice, costs, activation))
        seen, rows = seen + new, rows + tokens_per_rank(new, cp_size)
    memory = MemoryEstimate(
        weights_bytes=weight_bytes_per_rank(model, tp_size, weight_dtype),
        kv_cache_bytes=kv_cache_bytes_per_rank(model, rows, tp_size, dtype, kv_dtype),
        activation_bytes=max(e.activation_bytes for e in entries),
        capacity_bytes=rank_memory_bytes(hw, cp_size),
        usable_bytes=rank_memory_bytes(hw, cp_size) * MEMORY_USABLE_FRACTION,
    )
    cached_rows = cached_rows_per_rank(cached, cp_size)
    handoff = kv_handoff_seconds(model, hw, cp_size, tp_size, dtype, rows - cached_rows, cached_rows,
                                 decode_ranks=decode_ranks, kv_dtype=kv_dtype) if handoff else 0.0
    decode = _decode_memory(model, hw, cached + tokens, DecodeSetting(decode_ranks, kv_dtype), tp_size, dtype,
                            weight_dtype)
    suggestion = None if decode.fits else smallest_decode_setting(model, hw, cached + tokens, kv_dtype, tp_size,
                                                                  dtype, weight_dtype)
    return Plan(model=model, hardware=hw, cp_size=cp_size, tp_size=tp_size, dtype=dtype, weight_dtype=weight_dtype,
                kv_dtype=kv_dtype, rule=rule, tokens=tokens, cached=cached, chunk_tokens=chunk,
                entries=tuple(entries), lm_head_ms=lm_head_seconds(model, hw, tp_size, weight_dtype, cp_size) * 1e3,
                memory=memory, decode=decode, decode_suggestion=suggestion, handoff_ms=handoff * 1e3)


def decode_problem(plan: Plan) -> str | None:
    """One line saying what of the decode does not fit and the smallest setting that does; None if it fits."""
    d = plan.decode
    if d.fits:
        return None
    host = f"one {plan.hardware.name!r} host"
    line = (f"the decode does not fit: {d.context_tokens:,} tokens of {plan.model.name} (KV cache "
            f"{_kv_label(d.kv_dtype, plan.dtype)}) over {_ranks(d.decode_ranks)} of {host} need "
            f"{_gb(d.total_bytes)} per device (weights {_gb(d.weights_bytes)} + KV slice {_gb(d.kv_slice_bytes)} "
            f"+ workspace {_gb(d.workspace_bytes)}) of {_gb(d.usable_bytes)} usable; ")
    if plan.decode_suggestion is not None:
        return line + f"the smallest setting that fits is {plan.decode_suggestion.flags}"
    # nothing fits: say what the most spread-out, smallest cache would still need
    kv = d.kv_dtype if is_quantized(d.kv_dtype) else FALLBACK_KV_DTYPE
    best = _decode_memory(plan.model, plan.hardware, d.context_tokens, DecodeSetting(d.max_decode_ranks, kv),
                          plan.tp_size, plan.dtype, plan.weight_dtype)
    eight_bit = "8-bit weights (--weight-dtype float8), " if element_bytes(plan.weight_dtype) > 1 else ""
    return line + (f"no setting on {host} fits: even --decode-ranks {best.decode_ranks} --kv-dtype {kv} needs "
                   f"{_gb(best.total_bytes)} per device of {_gb(best.usable_bytes)} usable (devices of "
                   f"{_gb(best.total_bytes / MEMORY_USABLE_FRACTION)} would do); use {eight_bit}a larger TP size, "
                   f"a shorter context or a smaller model")


def _kv_label(kv_dtype: str, dtype: str) -> str:
    """"model" shown as the dtype it stands for."""
    return dtype if kv_dtype == "model" else kv_dtype


def _ranks(n: int) -> str:
    return f"{n} decode rank" + ("s" if n != 1 else "")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e9:.3g} GB"


def lm_head_seconds(model: ModelConfig, hardware: HardwareProfile, tp_size: int, weight_dtype: str,
                    cp_size: int = 1) -> float:
    """Logits of the last token: 2 * dim * vocab / TP FLOPs at the linear layers' FLOP/s (one rank
    of a ring of `cp_size`, which matters where ranks share a CPU host)."""
    scale = hardware.ring(cp_size).compute_scale
    return 2 * model.dim * model.vocab_size / tp_size / (hardware.linear_flops(weight_dtype) * scale)


def kv_handoff_seconds(model: ModelConfig, hardware: HardwareProfile, cp_size: int, tp_size: int, dtype: str,
                       new_rows_per_rank: int, cached_rows_per_rank: int = 0, *, decode_ranks: int = 1,
                       kv_dtype: str = "model") -> float:
    """KV moved to the decode ranks, as the engine does it, layer by layer, rows as stored (kv_dtype).

    One decode rank: scatter the whole cache (`cached_rows_per_rank` rows to each of N-1 ranks),
    then gather the new rows (`new_rows_per_rank`, the fullest rank's, from each of N-1 ranks).
    D > 1 decode ranks keep their shards; the N - D others send theirs, the D receiving at once, so
    a receiver takes ceil((N - D) / D) shards. Each layer costs latency + bytes / BW with the ring
    numbers of `hardware.ring(N)`."""
    if cp_size == 1 or decode_ranks >= cp_size:
        return 0.0
    ring = hardware.ring(cp_size)
    row = kv_row_bytes(model, tp_size, dtype, kv_dtype) // model.n_layers
    if decode_ranks > 1:
        shards = -(-(cp_size - decode_ranks) // decode_ranks)
        rows = cached_rows_per_rank + new_rows_per_rank
        return model.n_layers * (ring.latency_s + shards * rows * row / ring.bandwidth_bytes_per_s)
    total = 0.0
    for rows in [r for r in (cached_rows_per_rank, new_rows_per_rank) if r]:
        total += model.n_layers * (ring.latency_s + (cp_size - 1) * rows * row / ring.bandwidth_bytes_per_s)
    return total


def _validate(model, cp_size, hardware, tokens, cached, chunk_tokens, tp_size, dtype, rule, weight_dtype,
              kv_dtype="model"):
    """Check every planner input before any arithmetic; returns (model, profile, dtype, weight_dtype)."""
    model = _as_model(model)
    checks = (("tokens", tokens, 1), ("cached", cached, 0), ("cp_size", cp_size, 1))
    if chunk_tokens is not None:
        checks += (("chunk_tokens", chunk_tokens, 1),)
    _check_integers(checks)
    if rule not in RULES:
        raise ValueError(f"unknown strategy rule {rule!r}; use one of {', '.join(RULES)}")
    return _validate_setting(model, hardware, tp_size, dtype, weight_dtype, kv_dtype)


def _validate_setting(model, hardware, tp_size, dtype, weight_dtype, kv_dtype):
    """The inputs the prefill and the decode plans share; returns (model, profile, dtype, weight_dtype)."""
    model = _as_model(model)
    _check_integers((("tp_size", tp_size, 1),))
    local_heads(model, tp_size)  # raises when tp_size does not split the heads / MLP
    check_kv_dtype(kv_dtype)
    hw = load_profile(hardware)
    dtype, weight_dtype = canonical_dtype(dtype), canonical_dtype(weight_dtype or dtype)
    hw.peak(dtype), hw.peak(weight_dtype)  # raise when the profile lacks the dtype
    return model, hw, dtype, weight_dtype


def _as_model(model) -> ModelConfig:
    model = get_preset(model) if isinstance(model, str) else model
    if not isinstance(model, ModelConfig):
        raise ValueError(f"model must be a ModelConfig or a preset name, got {type(model).__name__}")
    return model


def _check_integers(checks) -> None:
    """A ValueError for the first (name, value, least) whose value is not an integer >= least."""
    for name, value, least in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


# ----------------------------------------------------------------------------- default chunk size


def default_chunk_tokens(model: "ModelConfig | str", cp_size: int, hardware: "HardwareProfile | str",
                         tokens: int, cached: int = 0, tp_size: int = 1, dtype: str = "bfloat16",
                         *, weight_dtype: str | None = None, kv_dtype: str = "model") -> int:
    """The chunk size to prefill `tokens` tokens with when the user gives none.

    Rule: chunks only save memory (every chunk after the first adds ring steps and, once the
    cached part dominates, pushes to pass-Q), so take the whole prompt when it fits, else the
    largest power of two that fits. "Fits" means weights + the KV cache of all cached + tokens
    + the one-layer working set of a chunk (the larger of pass-KV's and pass-Q's, with the ring
    buffers sized for the full cache, the cache stored in `kv_dtype`) <= MEMORY_USABLE_FRACTION of
    the profile's memory per rank. Only the prefill ranks are checked: the chunk size does not change
    the decode side.
    A ValueError when not even MIN_DEFAULT_CHUNK_TOKENS fits (more CP ranks or TP are needed).
    """
    model, hw, dtype, weight_dtype = _validate(model, cp_size, hardware, tokens, cached, None, tp_size, dtype,
                                               "alg5", weight_dtype, kv_dtype)
    rows = cached_rows_per_rank(cached, cp_size) + tokens_per_rank(tokens, cp_size)
    fixed = (weight_bytes_per_rank(model, tp_size, weight_dtype)
             + kv_cache_bytes_per_rank(model, rows, tp_size, dtype, kv_dtype))
    usable = rank_memory_bytes(hw, cp_size) * MEMORY_USABLE_FRACTION

    def fits(chunk: int) -> bool:
        working = max(activation_bytes_per_rank(model, cp_size, tp_size, chunk, rows, s, dtype) for s in STRATEGIES)
        return fixed + working <= usable

    if fits(tokens):
        return tokens
    chunk = 1 << (tokens.bit_length() - 1)  # largest power of two <= tokens
    while chunk >= MIN_DEFAULT_CHUNK_TOKENS:
        if fits(chunk):
            return chunk
        chunk //= 2
    raise ValueError(
        f"{model.name} with {cached + tokens} tokens does not fit {hw.name!r} at cp_size={cp_size}, "
        f"tp_size={tp_size}: weights + KV cache take {fixed / 1e9:.3g} GB of {usable / 1e9:.3g} GB usable per rank "
        f"even with {MIN_DEFAULT_CHUNK_TOKENS}-token chunks; use more CP ranks, a larger TP size or a smaller dtype"
    )


# ----------------------------------------------------------------------------- choosing the mesh


@dataclass(frozen=True)
class MeshOption:
    """One way to split the job's GPUs: CP ranks of TP GPUs each, and the plan on that mesh."""

    cp_size: int
    """N: CP ranks, hosts * gpus_per_host / tp_size; the ring runs across them (and the hosts)."""
    tp_size: int
    """TP GPUs of one CP rank, all inside one host: a divisor of gpus_per_host valid for the heads."""
    plan: Plan
    """plan_prefill of the prompt on this mesh."""

    @property
    def fits(self) -> bool:
        """Whether weights + KV cache + activations fit one prefill GPU (plan.memory.fits)."""
        return self.plan.memory.fits

    @property
    def memory_bytes(self) -> int:
        """Peak memory of one prefill GPU: weights + KV-cache shard + one layer's activations."""
        return self.plan.memory.total_bytes

    @property
    def ttft_ms(self) -> float:
        """Predicted time to first token on this mesh (plan.ttft_ms)."""
        return self.plan.ttft_ms

    def to_dict(self) -> dict:
        m = self.plan.memory
        return {"cp_size": self.cp_size, "tp_size": self.tp_size, "memory_bytes": self.memory_bytes,
                "usable_bytes": m.usable_bytes, "fits": self.fits, "ttft_ms": self.ttft_ms,
                "tp_allreduce_ms": self.plan.tp_allreduce_ms, "decode_fits": self.plan.decode.fits}


@dataclass(frozen=True)
class MeshProposal:
    """The (cp, tp) proposed for `hosts` hosts of `gpus_per_host` GPUs, next to every alternative.

    The paper's rule: TP inside a host, CP across hosts, and no more TP than memory needs: TP adds
    two all-reduces a layer on the critical path, while CP's ring transfers hide under attention.
    """

    hosts: int
    """H: hosts of the job."""
    gpus_per_host: int
    """G: GPUs of one host; every TP group lies inside one, so TP divides G."""
    options: tuple[MeshOption, ...]
    """Every valid (cp, tp) of H x G GPUs, TP ascending (cp = H*G/TP)."""
    excluded: dict[int, str]
    """Divisors of G that cannot split the model, with local_heads' reason (e.g. 3 of 128 heads)."""
    chosen: MeshOption | None
    """The proposal: the smallest TP whose prefill GPU fits (or the forced TP); None when none fits."""
    forced: bool
    """True when the caller fixed TP; `chosen` is then that option, fitting or not."""

    @property
    def reason(self) -> str:
        """One line saying why `chosen` was picked (or that nothing fits)."""
        if self.chosen is None:
            return self.problem() or ""
        c = self.chosen
        if self.forced:
            return (f"TP {c.tp_size} forced: CP {c.cp_size} = {self.hosts} hosts x {self.gpus_per_host} GPUs "
                    f"/ TP {c.tp_size}")
        smaller = [o.tp_size for o in self.options if o.tp_size < c.tp_size]
        why = (f"TP {', '.join(map(str, smaller))} need{'s' if len(smaller) == 1 else ''} more memory than a GPU has; "
               if smaller else "")
        return (f"{why}TP {c.tp_size} is the smallest that fits "
                f"({_gb(c.memory_bytes)} of {_gb(c.plan.memory.usable_bytes)} usable per GPU), "
                f"so CP {c.cp_size} = {self.hosts} hosts x {self.gpus_per_host} GPUs / TP {c.tp_size}")

    def problem(self) -> str | None:
        """One line when no mesh fits: what the leanest needs and what to change; None otherwise."""
        if self.chosen is not None:
            return None
        lean = min(self.options, key=lambda o: o.memory_bytes)
        m, model = lean.plan.memory, lean.plan.model
        return (f"no mesh of {self.hosts} hosts x {self.gpus_per_host} GPUs fits {model.name} with "
                f"{lean.plan.cached + lean.plan.tokens:,} tokens: the leanest, CP {lean.cp_size} x TP {lean.tp_size}, "
                f"needs {_gb(m.total_bytes)} per GPU (weights {_gb(m.weights_bytes)} + KV {_gb(m.kv_cache_bytes)} "
                f"+ activations {_gb(m.activation_bytes)}) of {_gb(m.usable_bytes)} usable; use 8-bit weights "
                f"(--weight-dtype float8), --kv-dtype fp8, smaller --chunk-tokens or more hosts")

    def to_dict(self) -> dict:
        chosen = self.chosen
        return {"hosts": self.hosts, "gpus_per_host": self.gpus_per_host, "forced": self.forced,
                "chosen": None if chosen is None else {"cp_size": chosen.cp_size, "tp_size": chosen.tp_size},
                "reason": self.reason, "options": [o.to_dict() for o in self.options],
                "excluded": {str(t): why for t, why in self.excluded.items()}}


def mesh_tp_sizes(model: ModelConfig, gpus_per_host: int) -> tuple[list[int], dict[int, str]]:
    """(valid TP sizes, {excluded TP: why}) among the divisors of gpus_per_host, ascending.

    Valid means `local_heads` accepts it: it divides the query heads and ffn_dim, and divides or is
    a multiple of the KV heads.
    """
    valid, excluded = [], {}
    for tp in (t for t in range(1, gpus_per_host + 1) if gpus_per_host % t == 0):
        try:
            local_heads(model, tp)
        except ValueError as err:
            excluded[tp] = str(err)
            continue
        valid.append(tp)
    return valid, excluded


def propose_mesh(model: "ModelConfig | str", hosts: int, gpus_per_host: int, hardware: "HardwareProfile | str",
                 tokens: int, cached: int = 0, chunk_tokens: int | None = None, dtype: str = "bfloat16",
                 rule: str = "alg5", *, tp_size: int | None = None, weight_dtype: str | None = None,
                 kv_dtype: str = "model", handoff: bool = True, decode_ranks: int | None = None) -> MeshProposal:
    """Propose (cp, tp) for a prompt on `hosts` hosts of `gpus_per_host` GPUs, with the alternatives.

    Every TP that divides gpus_per_host and splits the model (`mesh_tp_sizes`) is planned with
    `plan_prefill` at cp = hosts * gpus_per_host / TP; the proposal is the smallest TP whose prefill
    GPU fits (weights + KV cache + activations, `MemoryEstimate`). `tp_size` forces a TP instead
    (it must divide gpus_per_host). The hardware profile's devices_per_host is taken to be
    gpus_per_host. `decode_ranks` is the decode ranks of every option, at most its host's GPUs / TP
    (None: all of them). The other arguments are plan_prefill's.
    """
    model = _as_model(model)
    _check_integers((("hosts", hosts, 1), ("gpus_per_host", gpus_per_host, 1)))
    hw = dataclasses.replace(load_profile(hardware), devices_per_host=gpus_per_host)
    if tp_size is not None:
        _check_integers((("tp_size", tp_size, 1),))
        if gpus_per_host % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the {gpus_per_host} GPUs of a host: a TP group "
                             f"lies inside one host; use a divisor of {gpus_per_host}")
        local_heads(model, tp_size)  # raises when it cannot split the model
    valid, excluded = mesh_tp_sizes(model, gpus_per_host)
    options = []
    for tp in valid:
        ranks = None if decode_ranks is None else min(decode_ranks, max_decode_ranks(hw, tp))
        plan = plan_prefill(model, hosts * gpus_per_host // tp, hw, tokens, cached=cached, chunk_tokens=chunk_tokens,
                            tp_size=tp, dtype=dtype, rule=rule, weight_dtype=weight_dtype, handoff=handoff,
                            decode_ranks=ranks, kv_dtype=kv_dtype)
        options.append(MeshOption(cp_size=plan.cp_size, tp_size=tp, plan=plan))
    if tp_size is not None:
        chosen = next(o for o in options if o.tp_size == tp_size)
    else:
        chosen = next((o for o in options if o.fits), None)
    return MeshProposal(hosts=hosts, gpus_per_host=gpus_per_host, options=tuple(options), excluded=excluded,
                        chosen=chosen, forced=tp_size is not None)
