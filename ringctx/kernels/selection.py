"""Which kernel runs: every rule and row threshold that picks one of ringctx's CPU kernels, a
PyTorch op, or the float32 route, in one place.

The layer-by-layer path asks these questions (model/transformer.py's `linear`,
attention/kernels.py's `attention_block`, attention/quant.py), the wrappers of kernels/cpu.py
check their inputs with the `*_applies` rules here, and the fused steps (model/decode_step.py)
ask the same functions, so that a fused call runs exactly where the Python path would have run
the kernels it is made of. Limits the C code holds too (MAX_BATCH, MAX_QUERY_ROWS_PER_KV_HEAD,
MAX_HEAD_DIM, INT8_MAX_ROWS) are defined in kernels/abi.py, checked against the library when it
loads, and read here.

    rows of activations   1..MAX_ROWS        small_linear (decode-sized: `decode_sized_rows`)
    (`linear_kernel`)     ..UPCAST_MIN_ROWS-1 small_linear where bf16 computes in float32, else
                                             amx_linear up to AMX_LINEAR_ROWS[1]
                          more               PyTorch (in float32 where bf16 computes in float32)
    query rows per KV     ..MAX_QUERY_ROWS   the decode kernel, unless a sequence's block goes to
    head of a full block  _PER_KV_HEAD       AMX (`amx_before_decode`) or the float32 flash kernel
                                             (`flash_before_decode`) first
"""

from __future__ import annotations

import os

import torch

from . import build
# The limits the C code holds too, defined and checked in abi.py; the layers above read them here,
# beside the rules built on them.
from .abi import INT8_MAX_ROWS, MAX_BATCH, MAX_HEAD_DIM, MAX_QUERY_ROWS_PER_KV_HEAD, Q8_KINDS

# -- matrix products -------------------------------------------------------------------------

MAX_ROWS = 8
"""Most activation rows `small_linear` takes (decode steps and short inputs). Measured against
PyTorch's bf16 matmul on a CPU without bf16 units: 1.5-2x faster at 1, 3 and 8 rows."""

UPCAST_MIN_ROWS = 33
"""Fewest rows of activations for which a half-precision CPU matmul runs in float32 where the CPU
has no bf16 units (the weight converted, then the float32 GEMM); fewer rows, such as a question's
prefill, take the decode kernels' product (kernels/cpu.py's small_linear), which reads the bf16
weight in place and widens each weight vector once for four rows (AVX2) or two (AVX-512).
PyTorch's emulated bf16 matmul took 1.5-3.9x the time of the float32 route. SmolLM2's 120 block
matrices, 2 threads, 2026-12-05, the kernel's time (two-row tile) over the float32 route's: capped
at AVX2, 8 rows 0.46, 16 rows 0.68, 24 rows 0.98, 32 rows 0.97, 48 rows 1.27; AVX-512 without bf16
units, 16 rows 0.55, 32 rows 0.79, 48 rows 0.99; the four-row tile took 0.82-0.96x the two-row
one's time on AVX2 (docs/BENCHMARKS.md)."""

AMX_LINEAR_ROWS = (9, 48)
"""Rows of x that `amx_linear` takes: above small_linear's MAX_ROWS (decode steps keep their own
kernel, whose rows do not depend on the batch) up to 48, where PyTorch's matmul caught up
(measured: csrc/cpu_attention_amx.c; the kernel itself takes up to 64)."""

SMALL_LINEAR = "small_linear"
AMX_LINEAR = "amx_linear"
"""`linear_kernel`'s answers: the kernels of kernels/cpu.py of those names."""


def decode_sized_rows(rows: int) -> bool:
    """Whether `rows` activation rows are decode-sized: small_linear's own rows (MAX_ROWS), which it
    takes whatever the CPU computes bf16 in, and which the fused decode step covers."""
    return rows <= MAX_ROWS


def linear_kernel(rows: int, on_cpu: bool, half_in_float32: bool) -> str | None:
    """Which of ringctx's products `linear` tries for `rows` activation rows (before the kernel's
    own input checks): SMALL_LINEAR for decode-sized rows and, where half precision computes in
    float32 (`cpu_features.computes_in_float32`), below UPCAST_MIN_ROWS; AMX_LINEAR up to
    AMX_LINEAR_ROWS[1] where it does not; None (PyTorch) otherwise."""
    if on_cpu and (decode_sized_rows(rows) or (half_in_float32 and rows < UPCAST_MIN_ROWS)):
        return SMALL_LINEAR
    if on_cpu and rows <= AMX_LINEAR_ROWS[1] and not half_in_float32:
        return AMX_LINEAR
    return None


PADDED_GEMM_STEP_BITS = 3
"""A half-precision PyTorch GEMM on the CPU runs at a multiple of 2^-3 of the power of two below
its rows (`padded_gemm_rows`): 8 row counts an octave."""


def padded_gemm_rows(rows: int) -> int:
    """The rows a half-precision PyTorch GEMM on the CPU runs at (the extra rows zeros, dropped from
    its output): `rows` rounded up to a multiple of 2^(floor(log2 rows) - 3), so at most 1/8 more
    and about 8 sizes an octave.

    Why: PyTorch's bf16 matmul on the CPU (oneDNN) builds and caches a kernel for every row count
    it meets, about 8 ms and 0.6 MiB each (2 threads, AMD EPYC Zen 4, 2026-12-07: 1,500 products of
    17..1,516 rows by a [256, 128] weight grew a process from 223 to 1,038 MiB; 300 new row counts
    took 2.4 s). A dense model meets a few row counts (its chunk and the last one); a mixture of
    experts a new one for nearly every expert of every chunk, its rows being the tokens routed
    there. Padded, the sizes repeat: a 4,096-token chunk's experts meet at most ~100 of them."""
    step = 1 << max(0, rows.bit_length() - 1 - PADDED_GEMM_STEP_BITS)  # 2^(floor(log2 rows) - 3)
    return -(-rows // step) * step


def small_linear_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether `small_linear` takes these inputs (the library aside): inference on the CPU with
    1 <= T <= max_rows rows, weight contiguous, no gradient wanted, and x and weight both bf16 or
    both float32."""
    dtype = x.dtype
    if not (dtype == weight.dtype and dtype in (torch.float32, torch.bfloat16)
            and x.device.type == weight.device.type == "cpu" and x.dim() == 2 and weight.dim() == 2
            and 1 <= x.shape[0] <= max_rows and x.shape[1] == weight.shape[1] and weight.is_contiguous()):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def reads_int8_weights() -> bool:
    """Whether decode kernels here read int8 weights' codes (see Variant.reads_int8_weights)."""
    variant, _ = build.choose_variant()
    return variant is not None and variant.reads_int8_weights and build.library() is not None


def small_linear_int8_applies(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor) -> bool:
    """Whether `small_linear_int8` takes these inputs: bf16 x on the CPU with 1 <= T <=
    INT8_MAX_ROWS rows, codes int8 [out, in] and exponents int8 [out, in // 64] contiguous, in a
    multiple of 64, no gradient wanted, with a kernel variant that reads int8 weights
    (`reads_int8_weights`, which builds the library)."""
    if not (x.dtype == torch.bfloat16 and x.device.type == codes.device.type == "cpu" and x.dim() == 2
            and 1 <= x.shape[0] <= INT8_MAX_ROWS and codes.dtype == exponents.dtype == torch.int8
            and codes.dim() == 2 and x.shape[1] == codes.shape[1] and codes.shape[1] % 64 == 0
            and exponents.shape == (codes.shape[0], codes.shape[1] // 64)
            and codes.is_contiguous() and exponents.is_contiguous()):
        return False
    return not (torch.is_grad_enabled() and x.requires_grad) and reads_int8_weights()


def amx_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `amx_linear` takes these inputs (AMX's availability aside): bf16 x and weight on the
    CPU, AMX_LINEAR_ROWS rows, `in` a multiple of 32, `out` of 16, weight contiguous, no gradient
    wanted."""
    lo, hi = AMX_LINEAR_ROWS
    if not (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and x.dim() == 2 and weight.dim() == 2 and lo <= x.shape[0] <= hi and x.shape[1] == weight.shape[1]
            and x.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0 and weight.is_contiguous()):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


GROUPED_EXPERTS_MIN_ROWS = 16
"""Fewest (token, expert) pairs per expert, on average, for which a mixture of experts' products
run as two torch._grouped_mm calls over every pair (model/moe.py's `_grouped`) rather than a GEMM
pair per expert (its loop): on the CPU in bf16 only. Measured on a 2-core AMD EPYC (Zen 4,
avx512_bf16) shared with other jobs, 2026-12-07, grouped time over the loop's, best of 4-7
(docs/BENCHMARKS.md): bf16, 32 experts top 4 of 576 x 384, 64 / 512 / 2048 tokens: 0.92 / 0.89 /
0.97 at 1 thread, 1.14 / 0.84 / 0.61 at 2 (a loaded machine: every parallel op waits for a
preempted thread, and the loop makes ~6 per expert); 128 experts top 8 of 2048 x 768 at 64 / 256
tokens: 1.22 / 0.92 and 1.03 / 0.46. float32: 0.93-1.33 at 1 thread, so it keeps the loop. On
the CPU grouped_mm computes each group's product as the loop's PyTorch GEMM does (the same bits
where the loop's rows are past small_linear's); GPUs keep the loop until scripts/gpu_check.py's
"experts" section has measured grouped_mm there."""


def grouped_experts(device_type: str, dtype: torch.dtype, pairs: int, n_experts: int) -> bool:
    """Whether a mixture of experts runs its `pairs` (token, expert) pairs over `n_experts`
    experts as grouped GEMMs (see GROUPED_EXPERTS_MIN_ROWS): a bf16 CPU call with at least that
    many pairs per expert on average (a decode step's few rows never), where torch has the op."""
    return (device_type == "cpu" and dtype == torch.bfloat16 and pairs >= GROUPED_EXPERTS_MIN_ROWS * n_experts
            and hasattr(torch, "_grouped_mm"))


# -- attention -------------------------------------------------------------------------------

SMALL_QUERY_ROWS = 8
"""Without the CPU decode kernels, full blocks with at most this many query rows (decode steps)
skip the fused CPU op, whose per-call setup dominates at T = 1 (and which has no native bf16 path
without AMX). With them, every full block of at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV
head takes the decode kernel (B questions decoded together are one call that reads the shared K/V
once), below AMX_FROM_ROWS_PER_KV_HEAD where AMX applies."""

AMX_FROM_ROWS_PER_KV_HEAD = 16
"""Full blocks of one sequence (`one_sequence`) with at least this many query rows per KV head take
AMX before the decode kernel, whose vector FMAs are bound by arithmetic there (a question's tokens
against a document, 8K keys, GQA group 3, bf16, 2 threads, AMX tiles shared by a GQA group's rows:
decode kernel against AMX 0.46 / 0.70 ms at 6 rows, 0.73 / 0.71 at 12, 0.98 / 0.82 at 18, 1.81 /
1.19 at 36, 2.83 / 1.07 at 63; the decode kernel's time grows with the rows, AMX's by tiles of 16)."""

FLASH_FROM_ROWS_PER_KV_HEAD = 40
"""A bf16 sequence's block on a CPU without bf16 units (computing in float32) takes the float32
flash kernel from this many query rows per KV head, the decode kernel below: a question's tokens
over a document's cache, 8,192 keys, SmolLM2's heads, 2 threads, AVX2 and AVX-512 builds: the flash
kernel 0.94-1.16x the decode kernel's time at 24 rows, 0.99-1.06x at 36-42, 0.69-0.91x at 48-63
(docs/BENCHMARKS.md). A float32 model's blocks keep the decode kernel up to its 64 rows (flash took
1.07-1.08x its time at 63)."""

AMX_HEAD_DIMS = "a multiple of 32 up to 256"
"""The head dims `amx_attention_applies` takes, for error messages."""


def few_query_rows(rows: int) -> bool:
    """Whether a block of `rows` query tokens is decode-sized for attention_block (SMALL_QUERY_ROWS):
    a full one then skips PyTorch's fused op, and AMX takes only larger ones unasked."""
    return rows <= SMALL_QUERY_ROWS


def amx_before_decode(rows_per_kv_head: int) -> bool:
    """Whether a sequence's full block of this many query rows per KV head goes to AMX before the
    decode kernel (AMX_FROM_ROWS_PER_KV_HEAD)."""
    return rows_per_kv_head >= AMX_FROM_ROWS_PER_KV_HEAD


def flash_before_decode(rows_per_kv_head: int) -> bool:
    """Whether a sequence's full block of this many query rows per KV head, computing in float32,
    goes to the float32 flash kernel before the decode kernel (FLASH_FROM_ROWS_PER_KV_HEAD)."""
    return rows_per_kv_head >= FLASH_FROM_ROWS_PER_KV_HEAD


def amx_available() -> bool:
    """True when this CPU and OS run the AMX attention kernel (AMX-BF16 and AVX512-BF16, the tile
    state granted by Linux), RINGCTX_AMX allows it and the kernels are built."""
    return build.amx_library() is not None


def amx_unavailable_reason() -> str | None:
    """Why the AMX attention kernel is not in use here (None when it is)."""
    if amx_available():
        return None
    if os.environ.get("RINGCTX_AMX", "1") == "0":
        return "disabled by RINGCTX_AMX=0"
    if build.kernel_error():
        return build.kernel_error()
    variant = build.active_variant()
    if variant is not None and not variant.amx:
        return f"the {variant.name} variant has no AMX kernel"
    return "this CPU has no AMX-BF16, or Linux did not grant the tile state"


def decode_kernels_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `decode_attention` (and the two-pass `decode_scores`, `decode_pv`) take these inputs
    (and the kernels are built):
    q [T, Hq, D], k and v [S, Hkv, D] contiguous, all float32 or all bf16, on the CPU, S >= 1,
    D a multiple of 16 up to 256, at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV head."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)
            and q.device.type == k.device.type == v.device.type == "cpu" and k.shape == v.shape
            and k.shape[0] > 0 and Hq % Hkv == 0 and D % 16 == 0 and D <= MAX_HEAD_DIM
            and Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD and k.is_contiguous() and v.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return build.library() is not None


def decode_q8_kernels_apply(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                            v_scale: torch.Tensor) -> bool:
    """True when `decode_attention_q8` (K and V in one format; and the two-pass `decode_scores_q8`,
    `decode_pv_q8`) take these inputs (and the kernels are built):
    q [T, Hq, D] float32, bf16 or fp16; k_data and v_data [S, Hkv, D] int8 or float8_e4m3fn (each
    its own), contiguous; k_scale and v_scale [S, Hkv] float32 contiguous; all on the CPU, S >= 1, D
    a multiple of 16 up to 256, at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV head."""
    T, Hq, D = q.shape
    S, Hkv = k_data.shape[:2]
    tensors = (q, k_data, k_scale, v_data, v_scale)
    if not (q.dtype in (torch.float32, torch.bfloat16, torch.float16) and k_data.dtype in Q8_KINDS
            and v_data.dtype in Q8_KINDS and k_scale.dtype == v_scale.dtype == torch.float32
            and all(t.device.type == "cpu" for t in tensors) and k_data.dim() == 3 and k_data.shape == v_data.shape
            and k_scale.shape == v_scale.shape == (S, Hkv) and S > 0 and k_data.shape[2] == D
            and Hq % Hkv == 0 and D % 16 == 0 and D <= MAX_HEAD_DIM and Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD
            and all(t.is_contiguous() for t in tensors[1:])):
        return False
    if torch.is_grad_enabled() and q.requires_grad:
        return False
    return build.library() is not None


def amx_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `amx_attention` takes these inputs: q [T, Hq, D], k and v [S, Hkv, D], all bf16 on
    the CPU with unit stride along D, T and S >= 1, Hq a multiple of Hkv, D a multiple of 32 up to
    256, no gradient wanted, and AMX available."""
    return _flash_inputs_fit(q, k, v, torch.bfloat16) and q.shape[2] % 32 == 0 and amx_available()


def flash_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `flash_attention` takes these inputs: q [T, Hq, D], k and v [S, Hkv, D], all
    float32 or all bf16 on the CPU with unit stride along D, T and S >= 1, Hq a multiple of Hkv, D
    a multiple of the variant's vector (16 floats on avx512, 8 on avx2, 4 portable) up to 256, no
    gradient wanted, and the kernels built."""
    if not (_flash_inputs_fit(q, k, v, torch.float32) or _flash_inputs_fit(q, k, v, torch.bfloat16)):
        return False
    return flash_attention_built(q.shape[2])


def flash_attention_built(head_dim: int) -> bool:
    """True when the kernels are built and `flash_attention` takes this head dim (a multiple of the
    variant's vector, up to 256)."""
    variant = build.active_variant()
    return variant is not None and head_dim <= MAX_HEAD_DIM and head_dim % variant.vector_floats == 0


def _flash_inputs_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> bool:
    """What both flash kernels need of their inputs (the head dim's multiple aside): q [T, Hq, D], k
    and v [S, Hkv, D], all `dtype` on the CPU with unit stride along D, T and S >= 1, Hq a multiple
    of Hkv, D up to 256, no gradient wanted."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    if not (q.dtype == k.dtype == v.dtype == dtype and q.device.type == k.device.type == v.device.type == "cpu"
            and k.shape == v.shape and T >= 1 and S >= 1 and Hkv >= 1 and Hq % Hkv == 0 and D <= MAX_HEAD_DIM
            and q.stride(2) == k.stride(2) == v.stride(2) == 1):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


# -- per-row operations ----------------------------------------------------------------------


def _rows_apply(*tensors: torch.Tensor) -> bool:
    """The row kernels take CPU tensors of one dtype, float32 or bf16, unit stride along the last
    dim, when no gradient is wanted."""
    dtype = tensors[0].dtype
    if not all(t.dtype == dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors):
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these inputs (the library aside): x [T, dim] and weight [dim]
    contiguous, as `_rows_apply`."""
    return (x.dim() == 2 and weight.dim() == 1 and weight.shape[0] == x.shape[1] and weight.is_contiguous()
            and _rows_apply(x, weight))


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_` takes these inputs (the library aside): x [T, H, D], D even up to 256, cos
    and sin [T, 1, D] contiguous, as `_rows_apply`."""
    T, H, D = x.shape
    return (cos.shape == (T, 1, D) and sin.shape == cos.shape and cos.is_contiguous() and sin.is_contiguous()
            and not D % 2 and not D > MAX_HEAD_DIM and _rows_apply(x, cos, sin))


def swiglu_applies(gate_up: torch.Tensor, ffn: int) -> bool:
    """Whether `swiglu_` takes this input (the library aside): gate_up [T, 2 ffn], as `_rows_apply`."""
    return gate_up.dim() == 2 and gate_up.shape[1] == 2 * ffn and _rows_apply(gate_up)


def gated_delta_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor) -> bool:
    """Whether `gated_delta_` takes these inputs (the library aside): q, k [B, T, H, Dk] (or one
    token: [B, H, Dk]), v [B, T, H, Dv] ([B, H, Dv]), g, beta [B, T, H] ([B, H]), state [B, H, Dk, Dv]
    contiguous (it is updated in place), every one float32 on the CPU, no gradient wanted. Asked at
    every decode step of every linear layer: the cheap tests first."""
    tensors = (q, k, v, g, beta, state)
    if not all(t.dtype == torch.float32 and t.is_cpu for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    lead = q.shape[:-1]  # [B, T, H] or [B, H]
    return (q.dim() in (3, 4) and k.shape == q.shape and v.shape[:-1] == lead and g.shape == lead
            and beta.shape == lead and state.shape == (q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1])
            and state.is_contiguous() and state.numel() > 0 and q.numel() > 0)


def sum_buffers_applies(sources: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Whether `sum_buffers` takes these inputs (the library aside): 1 or more bf16 sources [n] and
    out [n], contiguous, on the CPU, no gradient wanted. Not float32 (the kernel computes it, but
    PyTorch's float32 adds are one pass each already and took 0.3-0.9x its time: measured)."""
    return (len(sources) >= 1 and out.dim() == 1 and out.dtype == torch.bfloat16
            and all(s.shape == out.shape for s in sources)
            and all(t.is_contiguous() for t in (*sources, out)) and _rows_apply(out, *sources))


SUM_BUFFERS_THREADS_FROM = 1 << 16
"""Elements from which `sum_buffers` splits over the threads (below, waking them costs more)."""


def merge_rows_applies(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Whether `merge_rows` takes these inputs (the library aside): float32 state acc_out [n, H, D]
    (rows contiguous) and acc_lse [H, n]; out [n, H, D] float32 or bf16 with unit stride along D,
    lse [H, n]; all on the CPU, no gradient wanted."""
    n, H, D = out.shape
    if not (acc_out.dtype == acc_lse.dtype == torch.float32 and out.dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" for t in (acc_out, acc_lse, out, lse))
            and acc_out.shape == out.shape and acc_lse.shape == lse.shape == (H, n)
            and acc_out.stride(1) == D and acc_out.stride(2) == 1 and out.stride(2) == 1 and acc_lse.stride(1) == 1):
        return False
    return not (torch.is_grad_enabled() and out.requires_grad)


# -- the fused steps (model/decode_step.py) --------------------------------------------------


def fused_step_shape_fits(head_dim: int, n_heads: int, n_kv_heads: int) -> bool:
    """Whether csrc/cpu_decode.c's layer code takes a model of these heads: head_dim a multiple of
    16 up to MAX_HEAD_DIM, at most MAX_QUERY_ROWS_PER_KV_HEAD query heads per KV head."""
    return not (head_dim % 16 or head_dim > MAX_HEAD_DIM or n_heads // n_kv_heads > MAX_QUERY_ROWS_PER_KV_HEAD)


def fused_prefill_applies(dtype: torch.dtype, computes_in_float32: bool, head_dim: int) -> bool:
    """Whether a model's short prefills may run in one call of the kernels (FusedPrefill): a bf16
    model computing in float32 (`linear` gives its question-sized rows to small_linear), no AMX
    (attention_block would give its bf16 blocks to AMX), and the float32 flash kernel built for
    its head dim."""
    return dtype == torch.bfloat16 and computes_in_float32 and not amx_available() \
        and flash_attention_built(head_dim)


def fused_prefill_takes(rows: int, group: int, cached: int, backend: str) -> bool:
    """Whether `rows` tokens of a model for which `fused_prefill_applies`, over `cached` rows, take
    on the layer-by-layer path exactly the kernels FusedPrefill's call is made of; asked of the
    rules that path asks: `linear_kernel` gives them small_linear, past the decode-sized rows
    (`decode_sized_rows`, `few_query_rows`: the fused decode step's), the full block over the
    cached rows goes to the flash kernel (`flash_before_decode`) and the causal one does anyway;
    at most MAX_BATCH rows (the C call's)."""
    if backend != "auto" or decode_sized_rows(rows) or few_query_rows(rows) or rows > MAX_BATCH:
        return False
    if linear_kernel(rows, on_cpu=True, half_in_float32=True) != SMALL_LINEAR:
        return False
    return not cached or flash_before_decode(rows * group)
