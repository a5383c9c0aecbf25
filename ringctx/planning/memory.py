"""Memory of one rank (one GPU under TP) during a prefill: weights, its KV-cache shard and one
layer's working set, each as the formula its docstring states; and the input checks that every
plan (prefill, decode, mesh) runs before any arithmetic.

A layer's activations are alive one layer at a time (inference keeps no activations for a
backward pass), so the working set is one layer's; the KV shard is all layers'. A plan fits when
the sum is at most MEMORY_USABLE_FRACTION of the profile's memory per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringctx.attention.quant import check_kv_dtype, kv_element_bytes
from ringctx.model.config import ModelConfig
from ringctx.model.int8_weights import check_int8_model, check_weights, code_bytes
from ringctx.model.presets import get_preset
from ringctx.planning.hardware import HardwareProfile, canonical_dtype, element_bytes, load_profile
from ringctx.planning.linear_attention import exchange_buffer_bytes, linear_layer_shapes, working_bytes
from ringctx.planning.strategy import (
    LSE_BYTES, PASS_KV, PASS_Q, STRATEGIES, all2all_bytes_per_rank, cached_rows_per_rank, layer_widths, local_heads,
    tokens_per_rank, widest_kv_width,
)


MEMORY_USABLE_FRACTION = 0.9
"""Share of a rank's memory a plan may fill; the rest absorbs allocator fragmentation, the CUDA
context or Python runtime, and temporaries the estimate leaves out."""

HIDDEN_BUFFERS = 4
"""Residual-stream-sized buffers alive in one layer: residual, normed input, attention output, MLP
output."""


def weight_bytes_per_rank(model: ModelConfig, tp_size: int, weight_dtype: str, weights: str = "model",
                          hw: HardwareProfile | None = None, ep_size: int = 1) -> int:
    """Weights on one GPU: n_params * e_w / TP (every CP rank holds a full TP shard of the model;
    embeddings and LM head are taken as vocab-parallel, so they split too), less (EP-1)/EP of the
    experts' weights under expert parallelism (`expert_params`: each EP rank holds 1/EP of them).
    With int8 weights on a CPU profile (`cpu_host`) and bf16 weights, plus the codes the decode
    kernels read beside them (ringctx.model.int8_weights.code_bytes); on GPUs the int8 values are
    the weights alone."""
    params = model.n_params - expert_params(model) * (ep_size - 1) // ep_size
    total = -(-params * element_bytes(weight_dtype) // tp_size)
    if weights == "int8" and weight_dtype == "bfloat16" and hw is not None and hw.cpu_host:
        total += code_bytes(model, tp_size)
    return total


def expert_params(model: ModelConfig) -> int:
    """Parameters of every MoE layer's routed experts (3 * dim * F each: gate, up, down), what
    expert parallelism spreads over its ranks; the routers and shared experts stay on every rank."""
    return sum(3 * model.dim * e.expert_ffn_dim * e.n_experts for e in model.layer_experts if e is not None)


def kv_row_bytes(model: ModelConfig, tp_size: int, dtype: str, kv_dtype: str = "model") -> int:
    """Bytes one token adds to one GPU's KV cache over all layers: 2 * n_layers * NKV_local * DH * e_kv
    (the sum of `layer_kv_row_bytes` when layers differ in head shape)."""
    return sum(layer_kv_row_bytes(model, tp_size, dtype, kv_dtype))


def layer_kv_row_bytes(model: ModelConfig, tp_size: int, dtype: str, kv_dtype: str = "model") -> list[int]:
    """Per layer, the bytes one token adds to its KV cache on one GPU: 2 * NKV_local * DH * e_kv with
    the layer's own KV heads and head width (Gemma 4 31B's full layers differ from its sliding ones).

    e_kv = kv_element_bytes(kv_dtype, DH, e(dtype)): e(dtype) for "model", the float's own size, or
    1 + 4/DH for fp8/int8 (one byte per element and a float32 scale per token and KV head), so one
    head's row is DH * e or DH + 4 bytes, always a whole number. NKV_local: the layer's KV heads
    split over tp_size, one replicated head when tp_size exceeds them. A linear-attention layer
    keeps no rows: 0 (its state is `state_bytes_per_rank`, whatever the length).
    """
    local_heads(model, tp_size)  # a clear error for a TP size that cannot split the heads
    rows = []
    for kv_heads, head_dim in model.kv_shapes:
        head_row = round(head_dim * kv_element_bytes(kv_dtype, head_dim, element_bytes(dtype)))
        rows.append(2 * max(1, kv_heads // tp_size) * head_row if kv_heads else 0)
    return rows


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


def prefill_kv_bytes_per_rank(model: ModelConfig, cached: int, chunks: list[int], cp_size: int, tp_size: int,
                              dtype: str, kv_dtype: str = "model", drop_unseen: bool = False) -> int:
    """The fullest moment of one rank's KV shard during a prefill of `chunks` (token counts, in
    order) on `cached` tokens: `kv_cache_bytes_per_rank` of every row it ends with, or, with
    drop_unseen (a CPU rank's shard drops what the next chunk no longer sees after every chunk and
    gives those pages back: KVCache.drop_unseen in place), the most it holds while a chunk runs:
    a full layer every row so far, a windowed or chunked one at most the rows the chunk's first
    token still sees (`Span.kept_tokens`, all of them on this rank at worst) plus the chunk's own."""
    rows = cached_rows_per_rank(cached, cp_size)
    if not drop_unseen:
        return kv_cache_bytes_per_rank(model, rows + sum(tokens_per_rank(t, cp_size) for t in chunks), tp_size,
                                       dtype, kv_dtype)
    row_bytes = layer_kv_row_bytes(model, tp_size, dtype, kv_dtype)
    peak, seen = 0, cached
    for tokens in chunks:
        new = tokens_per_rank(tokens, cp_size)
        held = sum(row * (rows + new if span.sees_everything else min(rows, span.kept_tokens(seen)) + new)
                   for span, row in zip(model.layer_spans, row_bytes))
        peak, seen, rows = max(peak, held), seen + tokens, rows + new
    return peak


def document_kv_bytes(config, layer_row_bytes: list[int], tokens: int, state_bytes: int = 0) -> int:
    """KV bytes a document of `tokens` tokens keeps (`layer_row_bytes`: one row's bytes in each
    layer, `layer_kv_row_bytes` or a cache's `KVCache.layer_row_bytes`): every row of a full layer,
    what later tokens see of a windowed or chunked one (documents drop the rest:
    KVCache.drop_unseen), none of a linear-attention layer (its row bytes are 0); plus
    `state_bytes`, what a hybrid's linear layers keep whatever the length
    (`ModelConfig.linear_state_bytes`, 0 for other models)."""
    return state_bytes + sum(span.kept_tokens(tokens) * row for span, row in zip(config.layer_spans, layer_row_bytes))


def document_tokens_within(config, layer_row_bytes: list[int], budget_bytes: int, state_bytes: int = 0) -> int:
    """The most tokens a document may have for `document_kv_bytes` (its states included) to stay
    within `budget_bytes` (a windowed layer's rows stop growing past its window: the full layers
    set the limit)."""
    lo, hi = 0, 1 << 40  # document_kv_bytes only grows with the tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if document_kv_bytes(config, layer_row_bytes, mid, state_bytes) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def layer_activation_bytes(model: ModelConfig, tp_size: int, rows: int, dtype: str) -> int:
    """One layer's activations for `rows` tokens on one GPU, ring buffers and logits left out:
    the hidden, qkv, mlp and accumulator terms of `activation_bytes_per_rank` with t = rows."""
    heads, _ = local_heads(model, tp_size)
    e, DH = element_bytes(dtype), model.widest_head_dim
    hidden = HIDDEN_BUFFERS * rows * model.dim * e
    # the layer with the widest q, k and v sets the peak (layers may differ in head shape; the
    # output gate's rows beside q's), or a linear-attention layer's working set where it is larger
    gate = heads * DH if model.attn_output_gate else 0
    widths = (layer_widths(model, tp_size, i) for i in model.attention_layers)
    qkv = rows * max(q + 2 * kv + gate for q, kv in widths) * e
    qkv = max([qkv] + [working_bytes(shape, rows, e) for shape in linear_layer_shapes(model, tp_size)])
    # the widest feed-forward sets the peak: a dense MLP's ffn_dim or an expert's width (an expert
    # takes at most every row; a shared expert every row), plus a mixture of experts' float32 sum of its
    # rows (model/moe.py)
    widths = [model.ffn_dim if x is None else max(x.expert_ffn_dim, x.shared_ffn_dim)
              for x in map(model.experts, range(model.n_layers))]
    widths += [model.ffn_dim for x in model.layer_experts if x is not None and x.beside_dense][:1]  # Gemma 4's MLP
    mlp = 3 * rows * (max(widths) // tp_size) * e + (rows * model.dim * 4 if model.has_experts else 0)
    accumulator = rows * heads * (DH + 1) * LSE_BYTES
    return hidden + qkv + mlp + accumulator


def activation_bytes_per_rank(model: ModelConfig, cp_size: int, tp_size: int, chunk_tokens: int,
                              max_cached_per_rank: int, strategy: str, dtype: str) -> int:
    """Working set of one layer for one chunk on one GPU (layers run one after the other in
    inference, so only one layer's activations are alive). With t = tokens_per_rank(chunk, N)
    (about chunk/N) and e = bytes per element:

      hidden      4 * t * dim * e                      (HIDDEN_BUFFERS residual-sized buffers)
      qkv         t * (NH + 2*NKV)_local * DH * e      (+ t * NH_local * DH * e of an output gate; a
                                                        linear-attention layer's `working_bytes` where larger)
      mlp         3 * t * ffn/TP * e                   (gate, up, their product; ffn the widest layer's:
                                                        dense ffn_dim or an expert's width, + t * dim * 4
                                                        for a mixture of experts' float32 sum)
      accumulator t * NH_local * (DH + 1) * 4           (float32 output and LSE of the merge)
      ring        pass-KV: 2 * (max_i P_i + t) * 2 * NKV_local * DH * e   (send and receive buffer)
                  pass-Q : 2 * t * NH_local * DH * e  +  2 * All2All bytes  (Q in flight, partials
                           held for and received from the N-1 other ranks); 0 when N = 1; a
                           linear-attention layer's gathered conv tails and summaries
                           (`exchange_buffer_bytes`) where larger
      logits      vocab * 4                            (float32, last token only)
    """
    heads, _ = local_heads(model, tp_size)
    e, DH, t = element_bytes(dtype), model.widest_head_dim, tokens_per_rank(chunk_tokens, cp_size)
    kv_row = widest_kv_width(model, tp_size)
    if cp_size == 1:
        ring = 0
    elif strategy == PASS_KV:
        ring = 2 * (max_cached_per_rank + t) * 2 * kv_row * e
    elif strategy == PASS_Q:
        ring = 2 * t * heads * DH * e + 2 * all2all_bytes_per_rank(chunk_tokens, cp_size, heads, DH, e)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    ring = max([ring] + [exchange_buffer_bytes(shape, cp_size) for shape in linear_layer_shapes(model, tp_size)])
    return layer_activation_bytes(model, tp_size, t, dtype) + ring + model.vocab_size * 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one rank (one GPU under TP) during the prefill."""

    weights_bytes: int
    """Model weights: n_params * e_w / TP."""
    kv_cache_bytes: int
    """KV-cache shard at its fullest: (cached + tokens)/N rows of all layers, in the kv dtype; on a
    CPU profile a windowed or chunked layer's only what its chunk sees (`prefill_kv_bytes_per_rank`)."""
    activation_bytes: int
    """Largest one-layer working set over the chunks (chunk activations and ring buffers)."""
    capacity_bytes: float
    """Memory of one rank in the hardware profile."""
    usable_bytes: float
    """capacity * MEMORY_USABLE_FRACTION: what the plan may fill."""
    state_bytes: int = 0
    """A hybrid's linear-attention states on this rank (`state_bytes_per_rank`: every CP rank holds
    them whole, its TP share of the heads); 0 for other models."""

    @property
    def total_bytes(self) -> int:
        """weights + KV cache + linear states + activations."""
        return self.weights_bytes + self.kv_cache_bytes + self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        """Whether total_bytes <= usable_bytes."""
        return self.total_bytes <= self.usable_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}


def rank_memory_bytes(hardware: HardwareProfile, cp_size: int) -> float:
    """Memory of one rank: the profile's memory_bytes, divided by N when the ranks share one host
    (profiles with `host_cores`, where memory_bytes is the host's RAM)."""
    return hardware.memory_bytes / (cp_size if hardware.host_cores else 1)


def validate_setting(model, hardware, tp_size, dtype, weight_dtype, kv_dtype, weights="model"):
    """The inputs the prefill and the decode plans share; returns (model, profile, dtype, weight_dtype)."""
    model = as_model_config(model)
    check_integers((("tp_size", tp_size, 1),))
    local_heads(model, tp_size)  # raises when tp_size does not split the heads / MLP
    check_kv_dtype(kv_dtype)
    hw = load_profile(hardware)
    dtype, weight_dtype = canonical_dtype(dtype), canonical_dtype(weight_dtype or dtype)
    hw.peak(dtype), hw.peak(weight_dtype)  # raise when the profile lacks the dtype
    check_weights(weights, weight_dtype)
    problem = check_int8_model(model, tp_size) if weights == "int8" else None
    if problem:
        raise ValueError(problem)
    return model, hw, dtype, weight_dtype


def as_model_config(model) -> ModelConfig:
    model = get_preset(model) if isinstance(model, str) else model
    if not isinstance(model, ModelConfig):
        raise ValueError(f"model must be a ModelConfig or a preset name, got {type(model).__name__}")
    return model


def check_integers(checks) -> None:
    """A ValueError for the first (name, value, least) whose value is not an integer >= least."""
    for name, value, least in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
