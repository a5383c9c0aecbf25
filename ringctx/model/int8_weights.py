"""Int8 weights: the matrices of the decoder blocks as int8 codes with a power-of-two scale per 64
inputs, so that a CPU decode step reads half the bytes of bf16 weights.

    model = load_model(name, dtype="bf16", weights="int8")   # or quantize_model(model) after loading

A decode step multiplies one activation row by every weight matrix, so its time is the time to
stream the weights (and the KV cache) from memory: for SmolLM2-135M in bf16, 269 MB of weights
against 189 MB of KV at 8K tokens. Int8 halves the first.

The scheme. For each row o of a weight matrix W [out, in] and each group g of GROUP inputs,

    e[o, g]    = the smallest integer with max |W[o, 64g : 64g + 64]| <= 127 * 2^e   (>= MIN_EXPONENT)
    codes[o, i] = round(W[o, i] / 2^e[o, i // 64])                                   in [-127, 127]

A power of two, not the usual float scale (llama.cpp's Q8_0), for exactness: codes * 2^e has at
most 7 significant bits, so it is a bf16 (and float32) value exactly. `quantize_model` writes those
values back into the model's weights, so the quantized model is an ordinary model with these
weights on every path: a prefill, a question's join, TP shards, GPUs, float32 references. The
CPU decode kernels read the codes instead (kernels/cpu.py's small_linear_int8, the fused decode step
of csrc/cpu_decode.c), widen and scale them in registers and sum the same products in the same
order as over the bf16 values: the same results bit for bit from half the bytes. The price of
the power of two: a group's step is up to 2x a float scale's, i.e. 6-7 significant bits (Q8_0
has 7-8; bf16 8).

Matrices quantized: every block's wqkv, wo, w13, w2 (79% of SmolLM2's decode weight bytes; the rest
is its 49,152 x 576 output head); a matrix whose input width is not a multiple of GROUP stays as it
is. The output head (and the embedding it is tied to) stays in the model dtype: read in int8 it
took no less time (2.0 against 2.1 ms a step for SmolLM2's head, bound by the widening's
arithmetic), and the decode steps after it took 1.2x as long with an fp8 KV cache at 8K tokens
(measured, not understood: docs/BENCHMARKS.md). Under tensor parallelism each rank quantizes its
own shard; row-parallel shards (wo and w2 split by inputs) then need widths that are whole groups,
so that every rank's groups are the whole model's (checked). The codes are kept beside the bf16
weights, which the prefill's matmuls read: they add half the blocks' bf16 bytes (SmolLM2: 108 MB
on 269 MB), which `ringctx plan --weights int8` counts (code_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GROUP = 64
"""Inputs per power-of-two scale: one 64-byte cache line of codes; a multiple of every kernel
variant's run of 2 vectors (csrc/cpu_kernels.h W8_GROUP)."""

MIN_EXPONENT = -118
"""Smallest scale exponent: the kernels scale by 2^e / 256, and 2^-126 is float32's (and bf16's)
smallest normal number (a group whose largest weight is below 127 * 2^-118, about 4e-34, rounds
to zeros and ones)."""

WEIGHT_CHOICES = ("model", "int8")
"""What `weights=` takes: the model's own values in its dtype, or int8 codes (this module)."""


@dataclass(frozen=True)
class Int8Weight:
    """One matrix's codes, kept on its weight Parameter (see `int8_of`)."""

    codes: torch.Tensor
    """int8 [out, in]: the weight is codes * 2^exponents[:, i // GROUP]."""
    exponents: torch.Tensor
    """int8 [out, in // GROUP]."""
    version: int
    """The weight's `_version` once quantized: an in-place write to it since (a reload; weights
    that are views of one storage share the counter) makes the codes stale, and `int8_of` then
    returns None (the kernels read the bf16 weight: slower, never wrong)."""


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of GROUP) -> (codes int8 [out, in], exponents int8
    [out, in // GROUP], values [out, in] in weight's dtype: codes * 2^exponents, exactly)."""
    out, n = weight.shape
    if n % GROUP:
        raise ValueError(f"int8 weights need an input width that is a multiple of {GROUP}, got {n}")
    w = weight.detach().to(torch.float64).view(out, n // GROUP, GROUP)
    amax = w.abs().amax(-1) / 127.0  # exact enough: a float64 quotient of a 24-bit value
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # the smallest e with amax <= 2^e: exponent - 1 when amax is a power of two (mantissa 0.5)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp_(MIN_EXPONENT, 127 - 8)
    e = torch.where(amax == 0, torch.full_like(e, MIN_EXPONENT), e)
    scale = torch.ldexp(torch.ones_like(w[..., :1]), e[..., None])
    codes = torch.round(w / scale).clamp_(-127, 127)
    values = (codes * scale).view(out, n).to(weight.dtype)
    return codes.view(out, n).to(torch.int8).contiguous(), e.to(torch.int8).contiguous(), values


def int8_of(weight: torch.Tensor) -> Int8Weight | None:
    """The int8 codes of a quantized weight, or None (not quantized, or written since)."""
    q = getattr(weight, "_ringctx_int8", None)
    return q if q is not None and q.version == weight._version else None


def quantized_matrices(model) -> list[nn.Linear]:
    """The linear layers `quantize_model` quantizes: the blocks' matrices whose input width is
    whole groups."""
    linears = []
    for block in model.layers:
        if block.attention is not None:
            linears += [block.attention.wqkv, block.attention.wo] + (
                [block.attention.wgate] if block.attention.wgate is not None else [])
        else:  # a linear-attention layer's big matrices (b and a are a few rows: left as they are)
            mixer = block.linear_attn
            linears += [mixer.in_proj_qkv, mixer.in_proj_z, mixer.out_proj]
        linears += [block.feed_forward.w13, block.feed_forward.w2]
    return [m for m in linears if m.weight.shape[1] % GROUP == 0]


def check_weights(weights: str, dtype=None) -> None:
    """A ValueError now for a `weights` choice that cannot load (dtype: the asked one, a name the
    loader or the planner knows, or None)."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHT_CHOICES)}")
    if weights == "int8" and dtype not in (None, "auto"):
        from .config import resolve_dtype

        try:
            resolved = resolve_dtype(dtype)
        except ValueError:  # a dtype no checkpoint loads in (the planner's float8 weights)
            resolved = None
        if resolved not in (torch.bfloat16, torch.float32):
            raise ValueError(f"int8 weights need a bfloat16 or float32 model (their values are exact in both), "
                             f"not {dtype}; use --dtype bf16")


def check_int8_model(config, tp_size: int = 1) -> str | None:
    """Why a model with this (whole-model) config cannot take int8 weights under tp_size, or None."""
    if config.has_experts:
        return ("int8 weights do not cover mixture-of-experts layers yet (their experts are 3-D parameters); "
                "use --weights model")
    if tp_size > 1:
        widths = [("attention heads x head_dim", config.n_heads * d) for d in sorted({d for _, d in config.kv_shapes})]
        for name, width in (*widths, ("ffn_dim", config.ffn_dim)):
            if width % (tp_size * GROUP):
                return (f"int8 weights under tp={tp_size} need each TP rank's share of {name} ({width} / "
                        f"{tp_size}) to be a multiple of {GROUP} inputs; use another --tp or --weights model")
    return None


def code_bytes(config, tp_size: int = 1) -> int:
    """Bytes of codes and exponents one TP rank keeps beside its bf16 weights (a CPU bf16 model,
    see quantize_model), from the whole model's config: every block matrix whose (per-rank) input
    width is whole groups, 1 + 1 / GROUP bytes per weight. What `ringctx plan --weights int8` adds."""
    total = 0
    for kv_heads, head_dim in config.kv_shapes:  # a layer may have its own head shape
        attn = config.n_heads * head_dim
        matrices = (((config.n_heads + 2 * kv_heads) * head_dim // tp_size, config.dim),  # wqkv: out split
                    (config.dim, attn // tp_size),                                        # wo: in split
                    (2 * config.ffn_dim // tp_size, config.dim),                          # w13
                    (config.dim, config.ffn_dim // tp_size))                              # w2
        total += sum(out * width + out * (width // GROUP) for out, width in matrices if width % GROUP == 0)
    return total


def quantize_model(model) -> int:
    """Quantize `model` in place (see the module docstring); returns the bytes of codes added.

    The weights' values become codes * 2^exponents in their own dtype (bf16 or float32; float16
    cannot hold every such value and is refused); on a CPU bf16 model the codes are kept for the
    decode kernels."""
    if model.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"int8 weights need a bfloat16 or float32 model (their values are exact in both), got "
                         f"{model.dtype}; load it with --dtype bf16")
    problem = check_int8_model(model.full_config, model.tp.size)
    if problem:
        raise ValueError(problem)
    keep_codes = model.dtype == torch.bfloat16 and model.device.type == "cpu"
    quantized = {}  # id(weight) -> (weight, codes, exponents)
    with torch.no_grad():
        for linear in quantized_matrices(model):
            weight = linear.weight
            if id(weight) not in quantized:
                codes, exponents, values = quantize(weight)
                weight.copy_(values)
                quantized[id(weight)] = (weight, codes, exponents)
    # Versions once every write is done: weights may be views of one storage, whose version
    # counter every write to any of them moves.
    for weight, codes, exponents in quantized.values():
        weight._ringctx_int8 = Int8Weight(codes, exponents, weight._version) if keep_codes else None
    model.weights_format = "int8"
    return sum(c.numel() + e.numel() for _, c, e in quantized.values()) if keep_codes else 0
