"""Planning a (chunked) context-parallel prefill: strategy per chunk, predicted times, memory.

`plan_prefill` splits a prompt of `tokens` new tokens (after `cached` tokens already in the KV
cache) into chunks of `chunk_tokens`; chunk k has T_k new tokens over P_k = cached + T_0 + ... +
T_(k-1) cached ones. For every chunk it asks `choose_strategy` for pass-KV or pass-Q and the cost
model for the predicted time of both; the time to first token is the sum of the chosen times plus
the LM head on the last token. Memory is estimated per rank (per GPU under TP, memory.py) and
compared with the hardware profile; the plan fits only when both the prefill ranks and the decode
devices (decode_plan.py) do. `default_chunk_tokens` is the chunk size used when none is given.

    >>> from ringctx.model.presets import get_preset
    >>> plan = plan_prefill(get_preset("llama3-8b"), 4, "h100-rdma", tokens=131072, chunk_tokens=32768)
    >>> [e.strategy for e in plan.entries]
    ['pass-kv', 'pass-kv', 'pass-kv', 'pass-kv']
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ringctx.attention.quant import is_quantized
from ringctx.hub import local_model_path
from ringctx.model.config import ModelConfig
from ringctx.model.config_gguf import read_gguf_config
from ringctx.model.config_hf import read_hf_config
from ringctx.model.presets import PRESETS, get_preset
from ringctx.planning.decode_plan import (
    FALLBACK_KV_DTYPE, DecodeMemory, DecodeSetting, check_decode_ranks, decode_memory, default_decode_ranks,
    smallest_decode_setting,
)
from ringctx.planning.hardware import DTYPE_BYTES, HardwareProfile, canonical_dtype, element_bytes
from ringctx.planning.linear_attention import linear_layer_shapes, state_bytes_per_rank, working_bytes
from ringctx.planning.memory import (
    MEMORY_USABLE_FRACTION, MemoryEstimate, activation_bytes_per_rank, as_model_config, check_integers,
    kv_row_bytes, prefill_kv_bytes_per_rank, rank_memory_bytes, validate_setting, weight_bytes_per_rank,
)
from ringctx.planning.strategy import (
    RULES, STRATEGIES, StrategyChoice, StrategyCost, cached_rows_per_rank, choose_strategy, predict_costs,
    tokens_per_rank,
)
from ringctx.units import fmt_gb


MIN_DEFAULT_CHUNK_TOKENS = 256
"""Smallest chunk `fitting_chunk_tokens` proposes: below it, per-message latency and kernel
launches dominate and pass-KV's transfer cannot hide under compute (Eq. 2)."""


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
    weights: str
    """"model" (the weights in weight_dtype) or "int8" (ringctx.model.int8_weights: on CPUs the codes
    are kept beside the bf16 weights, and counted in memory)."""
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
    ep_size: int = 1
    """Expert-parallel ranks: each prefill and decode rank holds 1/ep_size of the experts (weights)."""

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
        return sum(e.costs[e.strategy].tp_allreduce_s * e.costs[e.strategy].all_layers for e in self.entries) * 1e3

    @property
    def layer_overhead_ms(self) -> float:
        """The part of the chunks' time that is the profile's fixed cost per layer, over all layers."""
        return sum(e.costs[e.strategy].layer_overhead_s * e.costs[e.strategy].all_layers for e in self.entries) * 1e3

    @property
    def linear_attention_ms(self) -> float:
        """The part of the chunks' time in a hybrid's linear-attention layers (their rule, exchanges,
        matmuls and fixed costs), over all of them; 0 for other models."""
        return sum(e.costs[e.strategy].linear_attention_s for e in self.entries) * 1e3

    @property
    def state_exchange_ms(self) -> float:
        """The part of linear_attention_ms spent in the layers' two exchanges (conv tails and state
        summaries, the cheaper way), over all linear layers and chunks; 0 with one rank."""
        return sum(e.costs[e.strategy].state_exchange.seconds * e.costs[e.strategy].linear_attention_layers
                   for e in self.entries if e.costs[e.strategy].state_exchange is not None) * 1e3

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
            "weight_dtype": self.weight_dtype, "weights": self.weights, "kv_dtype": self.kv_dtype, "rule": self.rule, "tokens": self.tokens,
            "cached": self.cached,
            "chunk_tokens": self.chunk_tokens, "entries": [e.to_dict() for e in self.entries],
            "lm_head_ms": self.lm_head_ms, "handoff_ms": self.handoff_ms, "ttft_ms": self.ttft_ms, "best_ttft_ms": self.best_ttft_ms,
            "tp_allreduce_ms": self.tp_allreduce_ms, "layer_overhead_ms": self.layer_overhead_ms,
            "linear_attention_ms": self.linear_attention_ms, "state_exchange_ms": self.state_exchange_ms,
            "memory": self.memory.to_dict(),
            "decode": {**self.decode.to_dict(),
                       "smallest_fitting": self.decode_suggestion.to_dict() if self.decode_suggestion else None},
            "fits": self.fits, "suggestion": decode_problem(self),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


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
            return read_hf_config(text)
        ggufs = sorted(f for f in os.listdir(text) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return read_gguf_config(os.path.join(text, ggufs[0]))
        raise ValueError(f"{text}: a directory without config.json or a single .gguf file; not a model directory")
    if os.path.basename(text) == "config.json":
        return read_hf_config(text)
    with open(text, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return read_gguf_config(text)
    raise ValueError(f"{text}: neither a GGUF file nor a Hugging Face config.json; name a model preset, "
                     "a .gguf file or a model directory")


def split_chunks(tokens: int, chunk_tokens: int) -> list[int]:
    """Chunk lengths: full chunks of chunk_tokens, then the remainder (if any)."""
    full, rest = divmod(tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def plan_prefill(model: "ModelConfig | str", cp_size: int, hardware: "HardwareProfile | str", tokens: int,
                 cached: int = 0, chunk_tokens: int | None = None, tp_size: int = 1, dtype: str = "bfloat16",
                 rule: str = "alg5", *, weight_dtype: str | None = None, handoff: bool = True,
                 decode_ranks: int | None = None, kv_dtype: str = "model", weights: str = "model",
                 ep_size: int = 1) -> Plan:
    """Plan the prefill of `tokens` new tokens after `cached` cached ones on `cp_size` ranks.

    `chunk_tokens` None (or >= tokens) plans a single (partial) prefill; otherwise the prompt runs
    in chunks of that size. `model` is a ModelConfig or preset name, `hardware` a profile, a
    built-in profile name or a JSON path. `weight_dtype` defaults to `dtype`. `handoff` counts the
    engine's KV scatter/gather to the decode rank in the time to first token. `decode_ranks`
    (default_decode_ranks when None) devices of one host hold the cache afterwards, stored, like
    the prefill shards, in `kv_dtype` (see plan_decode). `weights` "int8": int8 weights (their codes
    counted in memory on CPU profiles, weight_bytes_per_rank). `ep_size`: the experts spread over that
    many CP ranks (and decode ranks), their weights divided among them (planning/expert_plan.py).
    """
    model, hw, dtype, weight_dtype = _validate(model, cp_size, hardware, tokens, cached, chunk_tokens,
                                               tp_size, dtype, rule, weight_dtype, kv_dtype, weights)
    if decode_ranks is None:
        decode_ranks = default_decode_ranks(hw, cp_size, tp_size)
    check_decode_ranks(decode_ranks, hw, tp_size)
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
        weights_bytes=weight_bytes_per_rank(model, tp_size, weight_dtype, weights, hw, ep_size),
        # a CPU rank's shard drops what later chunks no longer see (a GPU's keeps every row until the hand-off)
        kv_cache_bytes=prefill_kv_bytes_per_rank(model, cached, split_chunks(tokens, chunk), cp_size, tp_size, dtype,
                                                 kv_dtype, drop_unseen=hw.cpu_host),
        activation_bytes=max(e.activation_bytes for e in entries),
        capacity_bytes=rank_memory_bytes(hw, cp_size),
        usable_bytes=rank_memory_bytes(hw, cp_size) * MEMORY_USABLE_FRACTION,
        state_bytes=state_bytes_per_rank(model, tp_size, element_bytes(dtype)),
    )
    cached_rows = cached_rows_per_rank(cached, cp_size)
    handoff = kv_handoff_seconds(model, hw, cp_size, tp_size, dtype, rows - cached_rows, cached_rows,
                                 decode_ranks=decode_ranks, kv_dtype=kv_dtype) if handoff else 0.0
    decode = decode_memory(model, hw, cached + tokens, DecodeSetting(decode_ranks, kv_dtype), tp_size, dtype,
                            weight_dtype, weights, ep_size)
    suggestion = None if decode.fits else smallest_decode_setting(model, hw, cached + tokens, kv_dtype, tp_size,
                                                                  dtype, weight_dtype, weights, ep_size)
    return Plan(model=model, hardware=hw, cp_size=cp_size, tp_size=tp_size, dtype=dtype, weight_dtype=weight_dtype,
                weights=weights,
                kv_dtype=kv_dtype, rule=rule, tokens=tokens, cached=cached, chunk_tokens=chunk,
                entries=tuple(entries), lm_head_ms=lm_head_seconds(model, hw, tp_size, weight_dtype, cp_size) * 1e3,
                memory=memory, decode=decode, decode_suggestion=suggestion, handoff_ms=handoff * 1e3, ep_size=ep_size)


def decode_problem(plan: Plan) -> str | None:
    """One line saying what of the decode does not fit and the smallest setting that does; None if it fits."""
    d = plan.decode
    if d.fits:
        return None
    host = f"one {plan.hardware.name!r} host"
    line = (f"the decode does not fit: {d.context_tokens:,} tokens of {plan.model.name} (KV cache "
            f"{_kv_label(d.kv_dtype, plan.dtype)}) over {_ranks(d.decode_ranks)} of {host} need "
            f"{fmt_gb(d.total_bytes)} per device (weights {fmt_gb(d.weights_bytes)} + KV slice {fmt_gb(d.kv_slice_bytes)} "
            + (f"+ linear-attention states {fmt_gb(d.state_bytes)} " if d.state_bytes else "")
            + f"+ workspace {fmt_gb(d.workspace_bytes)}) of {fmt_gb(d.usable_bytes)} usable; ")
    if plan.decode_suggestion is not None:
        return line + f"the smallest setting that fits is {plan.decode_suggestion.flags}"
    # nothing fits: say what the most spread-out, smallest cache would still need
    kv = d.kv_dtype if is_quantized(d.kv_dtype) else FALLBACK_KV_DTYPE
    best = decode_memory(plan.model, plan.hardware, d.context_tokens, DecodeSetting(d.max_decode_ranks, kv),
                          plan.tp_size, plan.dtype, plan.weight_dtype, plan.weights, plan.ep_size)
    eight_bit = "8-bit weights (--weight-dtype float8), " if element_bytes(plan.weight_dtype) > 1 else ""
    return line + (f"no setting on {host} fits: even --decode-ranks {best.decode_ranks} --kv-dtype {kv} needs "
                   f"{fmt_gb(best.total_bytes)} per device of {fmt_gb(best.usable_bytes)} usable (devices of "
                   f"{fmt_gb(best.total_bytes / MEMORY_USABLE_FRACTION)} would do); use {eight_bit}a larger TP size, "
                   f"a shorter context or a smaller model")


def _kv_label(kv_dtype: str, dtype: str) -> str:
    """"model" shown as the dtype it stands for."""
    return dtype if kv_dtype == "model" else kv_dtype


def _ranks(n: int) -> str:
    return f"{n} decode rank" + ("s" if n != 1 else "")


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
    numbers of `hardware.ring(N)`. A hybrid's linear-attention layers move nothing: they keep no
    rows, and their end states are on every rank already (parallel/linear_state.py)."""
    if cp_size == 1 or decode_ranks >= cp_size:
        return 0.0
    ring = hardware.ring(cp_size)
    layers = len(model.attention_layers)
    row = kv_row_bytes(model, tp_size, dtype, kv_dtype) // layers
    if decode_ranks > 1:
        shards = -(-(cp_size - decode_ranks) // decode_ranks)
        rows = cached_rows_per_rank + new_rows_per_rank
        return layers * (ring.latency_s + shards * rows * row / ring.bandwidth_bytes_per_s)
    total = 0.0
    for rows in [r for r in (cached_rows_per_rank, new_rows_per_rank) if r]:
        total += layers * (ring.latency_s + (cp_size - 1) * rows * row / ring.bandwidth_bytes_per_s)
    return total


def _validate(model, cp_size, hardware, tokens, cached, chunk_tokens, tp_size, dtype, rule, weight_dtype,
              kv_dtype="model", weights="model"):
    """Check every planner input before any arithmetic; returns (model, profile, dtype, weight_dtype)."""
    model = as_model_config(model)
    checks = (("tokens", tokens, 1), ("cached", cached, 0), ("cp_size", cp_size, 1))
    if chunk_tokens is not None:
        checks += (("chunk_tokens", chunk_tokens, 1),)
    check_integers(checks)
    if rule not in RULES:
        raise ValueError(f"unknown strategy rule {rule!r}; use one of {', '.join(RULES)}")
    return validate_setting(model, hardware, tp_size, dtype, weight_dtype, kv_dtype, weights)


def fitting_chunk_tokens(model: "ModelConfig | str", cp_size: int, hardware: "HardwareProfile | str",
                         tokens: int, cached: int = 0, tp_size: int = 1, dtype: str = "bfloat16",
                         *, weight_dtype: str | None = None, kv_dtype: str = "model", weights: str = "model") -> int:
    """The largest chunk that lets a prefill of `tokens` tokens fit the profile's memory (what a plan
    would choose to fit; the engine's default chunk size is `default_chunk_tokens`).

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
                                               "alg5", weight_dtype, kv_dtype, weights)
    rows = cached_rows_per_rank(cached, cp_size) + tokens_per_rank(tokens, cp_size)
    weights_bytes = weight_bytes_per_rank(model, tp_size, weight_dtype, weights, hw) \
        + state_bytes_per_rank(model, tp_size, element_bytes(dtype))  # both whatever the chunk
    usable = rank_memory_bytes(hw, cp_size) * MEMORY_USABLE_FRACTION

    def fits(chunk: int) -> bool:
        working = max(activation_bytes_per_rank(model, cp_size, tp_size, chunk, rows, s, dtype) for s in STRATEGIES)
        kv = prefill_kv_bytes_per_rank(model, cached, split_chunks(tokens, chunk), cp_size, tp_size, dtype, kv_dtype,
                                       drop_unseen=hw.cpu_host)
        return weights_bytes + kv + working <= usable

    if fits(tokens):
        return tokens
    chunk = 1 << (tokens.bit_length() - 1)  # largest power of two <= tokens
    while chunk >= MIN_DEFAULT_CHUNK_TOKENS:
        if fits(chunk):
            return chunk
        chunk //= 2
    fixed = weights_bytes + prefill_kv_bytes_per_rank(model, cached, split_chunks(tokens, MIN_DEFAULT_CHUNK_TOKENS),
                                                      cp_size, tp_size, dtype, kv_dtype, drop_unseen=hw.cpu_host)
    raise ValueError(
        f"{model.name} with {cached + tokens} tokens does not fit {hw.name!r} at cp_size={cp_size}, "
        f"tp_size={tp_size}: weights + KV cache take {fixed / 1e9:.3g} GB of {usable / 1e9:.3g} GB usable per rank "
        f"even with {MIN_DEFAULT_CHUNK_TOKENS}-token chunks; use more CP ranks, a larger TP size or a smaller dtype"
    )


def default_chunk_tokens(model, world: int) -> int:
    """The engine's chunk size for a loaded `model` (a Transformer, its TP shard under TP) on `world`
    ranks, when the user gives none (see `chunk_tokens_for`)."""
    return chunk_tokens_for(model.config, world, model.dtype, on_gpu=model.device.type == "cuda")


def chunk_tokens_for(shard_config, world: int, dtype, *, on_gpu: bool) -> int:
    """The engine's default chunk for one rank's model shard (`shard_config`, a ModelConfig) in
    `dtype` (a torch dtype or its name) on `world` ranks: large enough to keep attention efficient,
    small enough that activations stay small next to the weights and KV shard (the per-rank
    activation peak is ~ chunk/N tokens of the MLP's 3*ffn_dim, or of a hybrid's linear-attention
    working set where that is larger (`linear_attention.working_bytes`: its float32 chunked form),
    plus the logits of one token). `ringctx plan` asks the same function, so it plans the chunks a
    run would take.

    On CPUs 4096 tokens already saturate the attention kernel (measured: a 16K prefill of SmolLM2 in
    chunks of 4K took 74 s, in one chunk 85 s) and give the progress bar something to count; GPUs
    get up to 64K tokens within a 1 GiB activation budget per rank.
    """
    bits = torch.finfo(dtype).bits if isinstance(dtype, torch.dtype) else 8 * DTYPE_BYTES[canonical_dtype(dtype)]
    e = bits // 8
    widest = max([3 * shard_config.ffn_dim * e]
                 + [working_bytes(shape, 1, e) for shape in linear_layer_shapes(shard_config)])
    per_token = widest + 4 * shard_config.dim * e
    budget = 1 << 30  # 1 GiB of chunk activations per rank
    by_memory = int(max(1024, min(65536, budget // max(per_token, 1) * world)))
    return by_memory if on_gpu else min(by_memory, 4096)


SERVING_CPU_CHUNK_TOKENS = 512
"""`ringctx serve`'s chunk on CPUs for a question's own long prompt (a plain client's prompt, the
rest of a cached one). Beside answers in flight its prefill runs at least one layer of its chunk
per step, and at 512 tokens a layer of SmolLM2 over an 8K-token prefix took about one decode step
(~15-18 ms, 2-core Xeon, bf16) against 48-88 ms at 4,096 (docs/BENCHMARKS.md). Documents ingest in
the engine's default chunk instead (serve/service.py: alone, an 8K ingest took 1.2-1.3x as long in
512-token chunks; the scheduler runs it in slices of whole layers, so no answer and no arriving
question waits for a whole chunk, but beside answers each slice is one such longer layer at least)."""


def serving_chunk_tokens(model, world: int) -> int:
    """The chunk `ringctx serve` prefills a question's own long prompt in when the user gives none:
    the engine's default on GPUs (a layer of a 64K chunk is milliseconds there), at most
    SERVING_CPU_CHUNK_TOKENS on CPUs."""
    chunk = default_chunk_tokens(model, world)
    return chunk if model.device.type == "cuda" else min(chunk, SERVING_CPU_CHUNK_TOKENS)
