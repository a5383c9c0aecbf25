"""8-bit KV caches: int8 and float8 (e4m3) rows with one float32 scale per token and KV head.

A quantized K (or V) tensor is a pair:
    data   [S, Hkv, D]  torch.int8 or torch.float8_e4m3fn
    scale  [S, Hkv]     float32; the value of data[s, h, d] is float(data[s, h, d]) * scale[s, h]

Why one scale per (token, KV head): K/V rows are written a chunk (or a decode token) at a time, so a
row's scale is known when it is written and never changes; a head's D = 64-128 values share one
range (RoPE mixes pairs within the head, not across heads), and 4 bytes per 64-128 bytes of data
cost 3-6% of the cache. Smaller blocks (32 values) would double that overhead.

    int8   scale = amax / 127, data = round(x / scale)         (uniform steps; fine for V and K)
    fp8    scale = amax / 448, data = float8_e4m3fn(x / scale)  (3 mantissa bits, wide range)

A row of zeros gets scale 0 and data 0 (dequantizes to exact zeros, never NaN). Inputs must be finite.

Attention over such a cache (`attention_block_quantized`) never makes a float copy of the whole
cache, which would take 2x (bf16) or 4x (float32) the memory of the 8-bit cache itself:

    decode (CPU)   a few query rows (at most MAX_QUERY_ROWS_PER_KV_HEAD per KV head: a GQA group
                   times B query tokens, B questions about one document): the one-pass C kernel
                   (csrc/cpu_kernels.c, `ringctx_decode_attention`) reads the 8-bit rows in place,
                   once for all the rows, and widens them in registers, so a step reads half the
                   bytes of a bf16 cache; as attention/kernels.py's `_decode_kernel_block`.
    otherwise      the keys in blocks of `block_rows` rows: each block is dequantized (to q's dtype,
                   or float32 where ringctx computes half-precision math in float32), attended with
                   `attention_block`, and the partials merged in float32 (`PartialAccumulator`).
                   The default 4096 bounds the copy at 4096 x Hkv x D values each for K and V (12 MB
                   in float32 for 3 KV heads of 128, 32 MB for 8), a few percent of a long cache,
                   while each block's attention (4096 keys per query row) dwarfs its merge (a few
                   passes over the [T, Hq, D] output).

The kernels apply each row's scale to its dot product (scores) or to its softmax weight (PV)
rather than to its values, so they agree with the blocked path on float32 blocks to float32
rounding; bf16 blocks round the dequantized values to bf16 first, as a bf16 cache would.
"""

from __future__ import annotations

import math

import torch

from ..kernels import cpu, selection
from ..kernels.cpu_features import computes_in_float32
from .kernels import attention_block, group_queries, resolve_backend, ungroup_rows
from .merge import PartialAccumulator

KV_DTYPES = ("model", "bfloat16", "float16", "float32", "fp8", "int8")
"""What `kv_dtype` accepts: "model" (the model's dtype), a float dtype, or an 8-bit format."""

QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""The 8-bit KV formats and the torch dtype their data is stored in."""

_LIMIT = {"int8": 127.0, "fp8": 448.0}  # largest magnitude each format holds


def check_kv_dtype(kv_dtype: str) -> str:
    """`kv_dtype` itself, or a ValueError naming the choices."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)} "
                         "(model = the model's dtype; fp8 = float8 e4m3 and int8, each with a float32 scale per "
                         "token and KV head)")
    return kv_dtype


def is_quantized(kv_dtype: str) -> bool:
    """True for the 8-bit formats."""
    return kv_dtype in QUANTIZED


def kv_element_bytes(kv_dtype: str, head_dim: int, model_dtype_bytes: int) -> float:
    """Bytes one cached K or V element takes, scales included (planning and memory checks)."""
    check_kv_dtype(kv_dtype)
    if is_quantized(kv_dtype):
        return 1.0 + 4.0 / head_dim
    if kv_dtype == "model":
        return float(model_dtype_bytes)
    return float(torch.finfo(getattr(torch, kv_dtype)).bits // 8)


def storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the cache's data is stored in."""
    check_kv_dtype(kv_dtype)
    if is_quantized(kv_dtype):
        return QUANTIZED[kv_dtype]
    return model_dtype if kv_dtype == "model" else getattr(torch, kv_dtype)


def quantize_rows(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [S, Hkv, D] int8 or float8_e4m3fn, scale [S, Hkv] float32) of x [S, Hkv, D] (finite,
    any float dtype) in the 8-bit format `kv_dtype` ("int8" or "fp8"), on x's device.

    Each (token, head) row (the last dim) is divided by its own scale = amax / limit, so that its
    largest magnitude maps to the format's limit (127 or 448). Division rather than a multiply by
    1/scale: the reciprocal of a tiny scale (below ~3e-39) is infinite in float32, and 0 * inf NaN.
    """
    if not is_quantized(kv_dtype):
        raise ValueError(f"quantize_rows: {kv_dtype!r} is not an 8-bit format ({', '.join(QUANTIZED)})")
    xf = x.float()
    limit = _LIMIT[kv_dtype]
    scale = xf.abs().amax(dim=-1) / limit  # [S, Hkv]
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)  # zero rows stay zero
    # The largest quotient can land a rounding past the limit; out of range, the int8 cast would
    # wrap and the fp8 one give NaN.
    y.clamp_(-limit, limit)
    data = y.round_().to(torch.int8) if kv_dtype == "int8" else y.to(torch.float8_e4m3fn)
    return data, scale


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [S, Hkv, D] * scale [S, Hkv] -> [S, Hkv, D] in `dtype` (each product rounded once to
    float32, then to `dtype`). A copy the size of `data` in `dtype`: use it on blocks, not on a
    whole cache."""
    if data.dtype == torch.float8_e4m3fn and data.device.type == "cpu":
        return (_fp8_over_256(data).float() * (scale.float() * 256.0).unsqueeze(-1)).to(dtype)
    return (data.float() * scale.float().unsqueeze(-1)).to(dtype)


def _fp8_over_256(data: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn data as float16 values 256 times smaller, exactly (the bit trick of load_q8 in
    csrc/cpu_kernels.h: s|eeee|mmm -> s|0eeee|mmm0000000). PyTorch's own fp8 -> float32 conversion
    on the CPU is scalar: dequantizing 4096 x 3 x 64 values with it took 2.4 ms, this way 0.56 ms
    (one thread)."""
    bits = data.view(torch.int8).to(torch.int16).bitwise_left_shift_(7)
    return bits.bitwise_and_(-16512).view(torch.float16)  # -16512 = 0xBF80: sign, then 7 bits


def attention_block_quantized(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    v_data: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    block_rows: int = 4096,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A full (non-causal) attention block over an 8-bit K/V: every query row sees every key row.

    Args:
        q: [T, Hq, D] float32, bf16 or fp16.
        k_data, v_data: [S, Hkv, D] int8 or float8_e4m3fn, Hq a multiple of Hkv; query head h reads
            KV head h // (Hq // Hkv).
        k_scale, v_scale: [S, Hkv] float32; key s of head h is k_data[s, h] * k_scale[s, h].
        softmax_scale: defaults to 1/sqrt(D).
        block_rows: keys dequantized at a time where the CPU kernels do not apply (see the module
            docstring); the float copy alive at once is [block_rows, Hkv, D] for K and for V.
        backend: the `attention_block` backend for the blocks ("auto" and "torch" also allow the
            CPU decode kernels).

    Returns:
        out [T, Hq, D] in q's dtype and lse [Hq, T] float32 (natural log), as `attention_block`
        computes them over the dequantized keys and values. S == 0 or T == 0: out zeros, lse -inf.

    Example:
        >>> k, v = torch.randn(50, 2, 16), torch.randn(50, 2, 16)
        >>> (kd, ks), (vd, vs) = quantize_rows(k, "int8"), quantize_rows(v, "int8")
        >>> out, lse = attention_block_quantized(torch.randn(1, 4, 16), kd, ks, vd, vs)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 16]), torch.Size([4, 1]))
    """
    _check(q, k_data, k_scale, v_data, v_scale, block_rows)
    T, Hq, D = q.shape
    S = k_data.shape[0]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if T == 0 or S == 0:
        return torch.zeros_like(q), torch.full((Hq, T), float("-inf"), dtype=torch.float32, device=q.device)
    resolve_backend(backend, q.device)  # unknown names and backends this machine lacks: a ValueError
    if backend in ("auto", "torch"):
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()  # a copy, if any, is 1/D of the data
        if selection.decode_q8_kernels_apply(q, k_data, k_scale, v_data, v_scale):
            done = _decode_in_place(q, k_data, k_scale, v_data, v_scale, scale)
            if done is not None:
                return done
    return _blocked(q, k_data, k_scale, v_data, v_scale, scale, block_rows, backend)


def _check(q, k_data, k_scale, v_data, v_scale, block_rows):
    if q.dim() != 3 or k_data.dim() != 3 or k_data.shape != v_data.shape:
        raise ValueError(f"attention_block_quantized: q [T, Hq, D] and k_data, v_data [S, Hkv, D] of one shape; "
                         f"got q {tuple(q.shape)}, k {tuple(k_data.shape)}, v {tuple(v_data.shape)}")
    S, Hkv, D = k_data.shape
    if q.shape[2] != D or Hkv == 0 or q.shape[1] % Hkv:
        raise ValueError(f"attention_block_quantized: q {tuple(q.shape)} does not fit k {tuple(k_data.shape)} "
                         "(same head_dim, Hq a multiple of Hkv)")
    if k_scale.shape != (S, Hkv) or v_scale.shape != (S, Hkv):
        raise ValueError(f"attention_block_quantized: scales must be [S, Hkv] = {(S, Hkv)}; "
                         f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    stored = tuple(QUANTIZED.values())
    if k_data.dtype not in stored or v_data.dtype not in stored:
        raise ValueError(f"attention_block_quantized: k_data and v_data must be {' or '.join(map(str, stored))}; "
                         f"got {k_data.dtype} and {v_data.dtype}")
    if not q.is_floating_point() or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
        raise ValueError(f"attention_block_quantized: q must be a float tensor and the scales float32; "
                         f"got {q.dtype}, {k_scale.dtype}, {v_scale.dtype}")
    if block_rows < 1:
        raise ValueError(f"attention_block_quantized: block_rows must be >= 1, got {block_rows}")


def _decode_in_place(q, k_data, k_scale, v_data, v_scale, scale):
    """A few query rows per KV head through the one-pass CPU q8 kernel (see `_decode_kernel_block` in
    attention/kernels.py, which this follows); None if the kernel refused."""
    done = cpu.decode_attention_q8(group_queries(q, k_data.shape[1]), k_data, k_scale, v_data, v_scale, scale)
    return None if done is None else ungroup_rows(*done, q.shape[0], q.dtype)


def _blocked(q, k_data, k_scale, v_data, v_scale, scale, block_rows, backend):
    """Blocks of `block_rows` keys, each dequantized, attended and merged in float32."""
    T, Hq, D = q.shape
    S = k_data.shape[0]
    # Where half-precision math runs in float32 anyway, dequantize straight to float32: rounding the
    # block to bf16 first would add an error and save nothing.
    dtype = torch.float32 if computes_in_float32(q) else q.dtype
    qc = q.to(dtype)
    if S <= block_rows:
        out, lse = attention_block(qc, dequantize_rows(k_data, k_scale, dtype), dequantize_rows(v_data, v_scale, dtype),
                                   softmax_scale=scale, backend=backend)
        return out.to(q.dtype), lse
    acc = PartialAccumulator(T, Hq, D, device=q.device)
    for start in range(0, S, block_rows):
        stop = min(start + block_rows, S)
        kb = dequantize_rows(k_data[start:stop], k_scale[start:stop], dtype)
        vb = dequantize_rows(v_data[start:stop], v_scale[start:stop], dtype)
        acc.add(*attention_block(qc, kb, vb, softmax_scale=scale, backend=backend), owned=True)
        del kb, vb  # one block's copy alive at a time
    return acc.result(q.dtype)
