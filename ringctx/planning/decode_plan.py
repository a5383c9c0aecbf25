"""The decode side of a plan: after the prefill the KV cache stays split by token position over
`decode_ranks` devices of one host, each holding the weights (/ TP) and a balanced slice of every
layer's K/V. `plan_decode` estimates one such device; `smallest_decode_setting` finds the fewest
decode ranks (then fp8) that fit. `kv_dtype` ("model", a float, "fp8", "int8") is how the cache is
stored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringctx.attention.quant import is_quantized
from ringctx.model.config import ModelConfig
from ringctx.planning.hardware import HardwareProfile, element_bytes
from ringctx.planning.linear_attention import state_bytes_per_rank
from ringctx.planning.memory import (
    MEMORY_USABLE_FRACTION, check_integers, document_kv_bytes, kv_cache_bytes_per_rank, layer_activation_bytes,
    layer_kv_row_bytes, rank_memory_bytes, validate_setting, weight_bytes_per_rank,
)
from ringctx.planning.strategy import local_heads, widest_kv_width


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
    heads, _ = local_heads(model, tp_size)
    kv_row = widest_kv_width(model, tp_size)
    block = min(slice_tokens, DEQUANT_BLOCK_TOKENS) if is_quantized(kv_dtype) else 0
    return {
        "token_activation_bytes": layer_activation_bytes(model, tp_size, 1, dtype),
        "scores_bytes": heads * slice_tokens * 4,
        "logits_bytes": model.vocab_size * 4,
        "dequant_bytes": 2 * block * kv_row * 4,
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
    """Model weights: n_params * e_w / TP (the full model when TP = 1), int8 codes included where kept
    (weight_bytes_per_rank)."""
    kv_slice_bytes: int
    """The device's KV slice: slice_tokens * kv_row_bytes (all layers, kv dtype with its scales),
    less the rows a document's windowed and chunked layers drop (they keep the last W rows, the
    current chunk: ModelConfig.kv_rows_kept)."""
    kv_slice_all_rows_bytes: int
    """The same slice if every layer kept every row (= kv_slice_bytes for a model of full layers)."""
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
    state_bytes: int = 0
    """A hybrid's linear-attention states of the sequence, on every decode device (its TP share of
    the heads; `state_bytes_per_rank`): fixed, whatever the context. 0 for other models."""

    @property
    def workspace_bytes(self) -> int:
        """token activations + scores + logits + dequantized block."""
        return self.token_activation_bytes + self.scores_bytes + self.logits_bytes + self.dequant_bytes

    @property
    def total_bytes(self) -> int:
        """weights + KV slice + linear states + workspace."""
        return self.weights_bytes + self.kv_slice_bytes + self.state_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        """Whether total_bytes <= usable_bytes."""
        return self.total_bytes <= self.usable_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "workspace_bytes": self.workspace_bytes,
                "total_bytes": self.total_bytes, "fits": self.fits}


def plan_decode(model: "ModelConfig | str", hardware: "HardwareProfile | str", context_tokens: int,
                decode_ranks: int, kv_dtype: str = "model", tp_size: int = 1, dtype: str = "bfloat16",
                *, weight_dtype: str | None = None, weights: str = "model") -> DecodeMemory:
    """Memory of one of `decode_ranks` devices holding a cache of `context_tokens` tokens.

    Every input is checked first: decode_ranks must be 1 .. devices of one host // TP.
    """
    model, hw, dtype, weight_dtype = validate_setting(model, hardware, tp_size, dtype, weight_dtype, kv_dtype,
                                                      weights)
    check_integers((("context_tokens", context_tokens, 0),))
    check_decode_ranks(decode_ranks, hw, tp_size)
    return decode_memory(model, hw, context_tokens, DecodeSetting(decode_ranks, kv_dtype), tp_size, dtype,
                          weight_dtype, weights)


def decode_memory(model: ModelConfig, hw: HardwareProfile, context_tokens: int, setting: DecodeSetting,
                   tp_size: int, dtype: str, weight_dtype: str, weights: str = "model",
                   ep_size: int = 1) -> DecodeMemory:
    """DecodeMemory of already validated inputs (ep_size: the experts spread over that many decode ranks)."""
    slice_tokens = decode_slice_tokens(context_tokens, setting.decode_ranks)
    capacity = rank_memory_bytes(hw, setting.decode_ranks)  # host RAM profiles share it among the ranks
    all_rows = kv_cache_bytes_per_rank(model, slice_tokens, tp_size, dtype, setting.kv_dtype)
    tokens = context_tokens + DECODE_ROOM_TOKENS  # the slice's share of what the whole cache keeps
    kept = document_kv_bytes(model, layer_kv_row_bytes(model, tp_size, dtype, setting.kv_dtype), tokens) \
        * slice_tokens // tokens
    return DecodeMemory(
        decode_ranks=setting.decode_ranks, max_decode_ranks=max_decode_ranks(hw, tp_size),
        kv_dtype=setting.kv_dtype, context_tokens=context_tokens, slice_tokens=slice_tokens,
        weights_bytes=weight_bytes_per_rank(model, tp_size, weight_dtype, weights, hw, ep_size),
        kv_slice_bytes=kept, kv_slice_all_rows_bytes=all_rows,
        **decode_workspace_bytes(model, tp_size, slice_tokens, dtype, setting.kv_dtype),
        capacity_bytes=capacity, usable_bytes=capacity * MEMORY_USABLE_FRACTION,
        state_bytes=state_bytes_per_rank(model, tp_size, element_bytes(dtype)),
    )


def smallest_decode_setting(model: ModelConfig, hw: HardwareProfile, context_tokens: int, kv_dtype: str,
                            tp_size: int, dtype: str, weight_dtype: str,
                            weights: str = "model", ep_size: int = 1) -> DecodeSetting | None:
    """The fewest decode ranks that fit with `kv_dtype`, else with fp8; None when nothing on one host fits.

    Fewest ranks first because each extra rank holds another copy of the weights; fp8 only after
    that because it rounds the cache. int8 is the same size as fp8, so it is never tried apart.
    """
    kv_dtypes = (kv_dtype,) if is_quantized(kv_dtype) else (kv_dtype, FALLBACK_KV_DTYPE)
    for kv in kv_dtypes:
        for ranks in range(ep_size, max_decode_ranks(hw, tp_size) + 1, ep_size):  # whole EP groups
            setting = DecodeSetting(ranks, kv)
            if decode_memory(model, hw, context_tokens, setting, tp_size, dtype, weight_dtype, weights, ep_size).fits:
                return setting
    return None


def check_decode_ranks(decode_ranks, hw: HardwareProfile, tp_size: int) -> None:
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
