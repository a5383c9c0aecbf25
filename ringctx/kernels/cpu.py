"""The CPU kernels' thin wrappers: each takes tensors, calls one entry point of the library
(csrc/cpu_*.c, built and loaded by kernels/build.py) and returns tensors, or None / False where the
kernel does not apply (kernels/selection.py's `*_applies` rules) and the caller uses PyTorch.

A decode step should take the time to read the weights and the KV cache once. Where PyTorch on a
CPU falls short of that (measured, docs/BENCHMARKS.md):

    small_linear           x [T <= 8, in] @ W^T (T <= 32 on CPUs without bf16 units, a question's
                           prefill). PyTorch's bf16 GEMV streamed the weights at half the memory's
                           speed, on CPUs with bf16 units (AMX) and without; its float32 one at
                           0.8-1x. The kernel widens bf16 weights to float32 in registers, once
                           for four rows (two on AVX-512), prefetches the next rows, accumulates
                           in float32 and rounds once (the contract of a native bf16 GEMM).
    decode_attention,      a few query rows per KV head (a GQA group times B query tokens: one
    decode_attention_q8    token each of B questions about one document) over a token-major
                           [S, Hkv, D] KV cache in the model dtype, or 8-bit (int8 or fp8 e4m3 data
                           with a float32 scale per token and KV head, attention/quant.py), in one
                           pass: each K and V row is read once, in place, for all the rows, the
                           softmax is online over tiles of keys, the keys are split over the
                           threads and merged by log-sum-exp; returns the output and the LSE.
                           PyTorch's bmm walked the cache strided and, in bf16, converted it to
                           float32 first; dequantizing an 8-bit cache in PyTorch would write and
                           read a float copy of it.
    decode_scores,         the two-pass form (QK^T written out, the softmax in PyTorch, then PV)
    decode_pv, *_q8        that decode_attention replaced: kept as the baseline that
                           scripts/bench_batch_attention.py measures it against, and as products
                           the tests check alone.
    small_linear_int8      the same over int8 weights with a power-of-two scale per 64 inputs (the
                           model's `--weights int8`): the same sums bit for bit as over the bf16
                           values the codes stand for, from half the bytes.
    decode_step_batch      a whole decode step of a Llama-family model for B sequences (a lone
                           answer is B = 1; csrc/cpu_decode.c, driven by
                           ringctx/model/decode_step.py): every layer in one call, so that the
                           ~40 small PyTorch ops per layer, whose dispatch cost as much as reading
                           the weights, are not paid.
    rms_norm, rope_,       RMSNorm, RoPE and the SwiGLU gate over many rows (csrc/cpu_token_ops.c):
    swiglu_                one pass per row in float32 with the PyTorch path's roundings, where
                           PyTorch makes several elementwise passes, each converting bf16 to
                           float32 and back (~1 s of a 7 s bf16 prefill of 8K tokens).
    sum_buffers            the TP all-reduce's sum of N ranks' buffers (parallel/allreduce.py): one
                           pass, float32 accumulation in rank order, bf16 rounded once; PyTorch
                           widened every bf16 buffer into a new float32 one (3-16x the time at 4 MiB).
    flash_attention        flash attention in float32 (csrc/cpu_flash.c): a prefill's attention
                           blocks on CPUs without bf16 units (a bf16 model computes them in
                           float32 there, widened as it reads them) and a float32 model's
                           everywhere; 0.77-0.99x the time of PyTorch's float32 op (causal blocks
                           0.77-0.91x), AVX2 and AVX-512.
    amx_attention          flash attention in bf16 on CPUs with AMX (csrc/cpu_attention_amx.c):
                           the "amx" attention backend, 1.2-1.9x PyTorch's fused CPU op there.
                           Both take a ring block's mask (causal at a q_offset, a sliding window:
                           a band whose outside key tiles are skipped) and logit soft-capping,
                           which PyTorch's fused CPU op has no argument for.
    gated_delta_           the gated delta rule (Gated DeltaNet layers, attention/gated_delta.py) token
                           by token for B sequences (csrc/cpu_gated_delta.c): each state read and
                           written once per call, in strips of columns that stay in L1 across the
                           tokens; PyTorch's token loop makes four passes over the state per token.
    amx_linear             x [9 <= T <= 48, in] @ W^T in bf16 on AMX (a question's prefill): the
                           weights read in place, once for all rows; 0.73-0.85x the time of
                           PyTorch's bf16 matmul at 9-16 rows.
"""

from __future__ import annotations

import ctypes

import torch

from . import build, selection
from .abi import Q8_KINDS


def encode_e4m3(x: torch.Tensor) -> torch.Tensor | None:
    """The fused decode step's float -> float8 e4m3 bytes (uint8, |x| <= 448), or None without the
    kernels: to check it against PyTorch's cast."""
    lib = build.library()
    if lib is None:
        return None
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.ringctx_encode_e4m3(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 max_rows: int = selection.MAX_ROWS) -> torch.Tensor | None:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out] in x's dtype, or None where the kernel does
    not apply (the caller then uses F.linear).

    Applies to inference on the CPU with 1 <= T <= max_rows rows, weight contiguous, no gradient
    wanted, and x and weight both bf16 or both float32. Float32 accumulation, one rounding at the end;
    a row's sums in the same order whatever T (the same bits alone or among other rows).
    """
    if not selection.small_linear_applies(x, weight, max_rows):
        return None
    lib = build.library()
    if lib is None:
        return None
    dtype = x.dtype
    rows, n_in = x.shape
    n_out = weight.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(rows, n_out, dtype=torch.float32)
    status = lib.ringctx_gemv(xf.data_ptr(), rows, n_in, weight.data_ptr(), int(dtype == torch.bfloat16), n_out,
                              y.data_ptr(), torch.get_num_threads())
    if status != 0:
        return None
    if bias is not None:
        y.add_(bias.float())
    return y.to(dtype)


def small_linear_int8(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, in] @ W^T (+ bias) -> [T, out] bf16 for W[o, i] = codes[o, i] * 2^exponents[o, i // 64]
    (ringctx/model/int8_weights.py), or None where the kernel does not apply (the caller then uses
    the bf16 weights holding the same values).

    Applies to bf16 x on the CPU with 1 <= T <= INT8_MAX_ROWS rows, codes int8 [out, in] and exponents
    int8 [out, in // 64] contiguous, in a multiple of 64, with a kernel variant that reads int8
    weights (`selection.reads_int8_weights`). The result equals `small_linear` over the bf16 weights
    codes * 2^exponents bit for bit (the same products summed in the same order).
    """
    if not selection.small_linear_int8_applies(x, codes, exponents):
        return None
    lib = build.library()
    rows, n_in = x.shape
    n_out = codes.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(rows, n_out, dtype=torch.float32)
    status = lib.ringctx_gemv_q8(xf.data_ptr(), rows, n_in, codes.data_ptr(), exponents.data_ptr(), n_out,
                                 y.data_ptr(), torch.get_num_threads())
    if status != 0:
        return None
    if bias is not None:
        y.add_(bias.float())
    return y.to(torch.bfloat16)


def decode_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """softmax(scale Q K^T) V per KV head and its log-sum-exp, in one pass over the token-major cache
    (see selection.decode_kernels_apply; S == 0 allowed).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read; k, v:
    [S, Hkv, D] float32 or bf16. Returns (out [Hkv, R, D] float32, lse [Hkv, R] float32, natural
    log; zeros and -inf when S == 0), or None if the kernel refused.
    """
    return _decode_attention(qg, k, v, None, None, -1, int(k.dtype == torch.bfloat16), scale)


def decode_attention_q8(qg: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                        v_scale: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`decode_attention` over an 8-bit cache read in place (see selection.decode_q8_kernels_apply; S == 0
    allowed): k_data, v_data [S, Hkv, D] int8 or float8_e4m3fn (one format for both), k_scale,
    v_scale [S, Hkv] float32 contiguous. Returns (out [Hkv, R, D], lse [Hkv, R]) float32, or None
    if the kernel refused (K and V in different formats)."""
    if k_data.dtype != v_data.dtype:
        return None
    return _decode_attention(qg, k_data, v_data, k_scale, v_scale, Q8_KINDS[k_data.dtype], 0, scale)


def _decode_attention(qg, k, v, k_scale, v_scale, q8_kind: int, bf16: int, scale: float):
    lib = build.library()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    out = torch.empty(Hkv, rows, D)
    lse = torch.empty(Hkv, rows)
    status = lib.ringctx_decode_attention(
        qg.data_ptr(), Hkv, rows, D, k.data_ptr(), v.data_ptr(), bf16,
        None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
        q8_kind, k.shape[0], scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    return (out, lse) if status == 0 else None


def decode_scores(qg: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor | None:
    """scale * Q K^T per KV head, reading the token-major cache in place (see selection.decode_kernels_apply).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read;
    k: [S, Hkv, D]. Returns float32 [Hkv, R, S], or None if the kernel refused.
    """
    lib = build.library()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    S = k.shape[0]
    scores = torch.empty(Hkv, rows, S)
    status = lib.ringctx_decode_scores(qg.data_ptr(), Hkv, rows, D, k.data_ptr(), int(k.dtype == torch.bfloat16),
                                       S, scale, scores.data_ptr(), torch.get_num_threads())
    return scores if status == 0 else None


def decode_pv(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """P V per KV head, reading the token-major cache in place (see selection.decode_kernels_apply).

    probs: [Hkv, R, S] float32 contiguous; v: [S, Hkv, D]. Returns float32 [Hkv, R, D], or None if
    the kernel refused (it allocates one partial sum per thread).
    """
    lib = build.library()
    if lib is None:
        return None
    Hkv, rows, S = probs.shape
    D = v.shape[2]
    out = torch.empty(Hkv, rows, D)
    status = lib.ringctx_decode_pv(probs.data_ptr(), Hkv, rows, S, v.data_ptr(), int(v.dtype == torch.bfloat16),
                                   D, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def decode_scores_q8(qg: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, scale: float) -> torch.Tensor | None:
    """scale * Q K^T per KV head over an 8-bit cache read in place (see selection.decode_q8_kernels_apply).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read; k_data:
    [S, Hkv, D] int8 or float8_e4m3fn; k_scale: [S, Hkv] float32 (key j of head h is
    k_data[j, h] * k_scale[j, h]). Returns float32 [Hkv, R, S], or None if the kernel refused.
    """
    lib = build.library()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    S = k_data.shape[0]
    scores = torch.empty(Hkv, rows, S)
    status = lib.ringctx_decode_scores_q8(qg.data_ptr(), Hkv, rows, D, k_data.data_ptr(), k_scale.data_ptr(),
                                          Q8_KINDS[k_data.dtype], S, scale, scores.data_ptr(), torch.get_num_threads())
    return scores if status == 0 else None


def decode_pv_q8(probs: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor | None:
    """P V per KV head over an 8-bit cache read in place (see selection.decode_q8_kernels_apply).

    probs: [Hkv, R, S] float32 contiguous; v_data: [S, Hkv, D] int8 or float8_e4m3fn; v_scale:
    [S, Hkv] float32. Returns float32 [Hkv, R, D], or None if the kernel refused (it allocates one
    partial sum per thread).
    """
    lib = build.library()
    if lib is None:
        return None
    Hkv, rows, S = probs.shape
    D = v_data.shape[2]
    out = torch.empty(Hkv, rows, D)
    status = lib.ringctx_decode_pv_q8(probs.data_ptr(), Hkv, rows, S, v_data.data_ptr(), v_scale.data_ptr(),
                                      Q8_KINDS[v_data.dtype], D, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """round(x * rsqrt(mean(x^2) + eps) * weight) for x [T, dim] -> new [T, dim] in x's dtype,
    float32 inside (what F.rms_norm computes); None where the kernel does not apply."""
    if not selection.rms_norm_applies(x, weight):
        return None
    lib = build.library()
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    status = lib.ringctx_rms_norm_rows(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                       int(x.dtype == torch.bfloat16), out.data_ptr(), out.stride(0),
                                       torch.get_num_threads())
    return out if status == 0 else None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE of x [T, H, D] in place: x = round(round(x cos) + roll(x, D/2) sin), with cos,
    sin [T, 1, D] contiguous (ringctx's RopeAngles). False (x untouched) where the kernel does not
    apply."""
    if not selection.rope_applies(x, cos, sin):
        return False
    lib = build.library()
    if lib is None:
        return False
    T, H, D = x.shape
    return lib.ringctx_rope_rows(x.data_ptr(), T, H, D, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                 int(x.dtype == torch.bfloat16), torch.get_num_threads()) == 0


def merge_rows(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Merge a partial attention result (out [n, H, D] float32 or bf16, lse [H, n]) into running
    float32 state acc_out [n, H, D] (rows contiguous) and acc_lse [H, n], in place, as
    attention/merge.py's PartialAccumulator.add does (empty-row markers, -inf weighs 0). False
    (nothing touched) where the kernel does not apply."""
    if not selection.merge_rows_applies(acc_out, acc_lse, out, lse):
        return False
    n, H, D = out.shape
    lib = build.library()
    if lib is None:
        return False
    lse = lse.float()
    if lse.stride(1) != 1:
        lse = lse.contiguous()
    return lib.ringctx_merge_rows(acc_out.data_ptr(), acc_out.stride(0), acc_lse.data_ptr(), acc_lse.stride(0),
                                  out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0), out.stride(1),
                                  lse.data_ptr(), lse.stride(0), n, H, D) == 0


def available() -> bool:
    """Whether ringctx's CPU kernels are built and loaded here (kernels/build.py says why not)."""
    return build.library() is not None


def gated_delta_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor) -> torch.Tensor | None:
    """The gated delta rule over T tokens of B sequences, float32 (csrc/cpu_gated_delta.c): q, k
    [B, T, H, Dk] (normalised and scaled as attention/gated_delta.py says), v [B, T, H, Dv], g, beta
    [B, T, H], or for one token (a decode step) the same without the T dim; state [B, H, Dk, Dv]
    contiguous, updated in place to the state after the last token. Returns o [B, T, H, Dv] ([B, H,
    Dv] for one token) float32, or None (state untouched) where the kernel does not apply
    (selection.gated_delta_applies)."""
    if not selection.gated_delta_applies(q, k, v, g, beta, state):
        return None
    lib = build.library()
    if lib is None:
        return None
    q, k, v, g, beta = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v, g, beta))
    B, H, Dk, Dv = state.shape
    out = torch.empty(q.shape[:-1] + (Dv,))
    status = lib.ringctx_gated_delta(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                     state.data_ptr(), out.data_ptr(), B, q.shape[1] if q.dim() == 4 else 1, H, Dk,
                                     Dv, torch.get_num_threads())
    return out if status == 0 else None


def sum_buffers(sources: list[torch.Tensor], out: torch.Tensor) -> bool:
    """out [n] = sources[0] + sources[1] + ... (each [n] bf16), added left to right in float32 and
    rounded once (the TP all-reduce's sum, parallel/allreduce.py). False (out untouched) where the
    kernel does not apply (float32 among them: selection.sum_buffers_applies)."""
    if not selection.sum_buffers_applies(sources, out):
        return False
    lib = build.library()
    if lib is None:
        return False
    pointers = (ctypes.c_void_p * len(sources))(*(s.data_ptr() for s in sources))
    threads = torch.get_num_threads() if out.numel() >= selection.SUM_BUFFERS_THREADS_FROM else 1
    return lib.ringctx_sum_buffers(pointers, len(sources), out.numel(), int(out.dtype == torch.bfloat16),
                                   out.data_ptr(), threads) == 0


def swiglu_(gate_up: torch.Tensor, ffn: int) -> bool:
    """gate = round(round(silu(gate)) * up) in place over the gate half of gate_up [T, 2 ffn] (gate
    columns first). False (untouched) where the kernel does not apply."""
    if not selection.swiglu_applies(gate_up, ffn):
        return False
    lib = build.library()
    if lib is None:
        return False
    return lib.ringctx_swiglu_rows(gate_up.data_ptr(), gate_up.shape[0], ffn, gate_up.stride(0),
                                   int(gate_up.dtype == torch.bfloat16), torch.get_num_threads()) == 0


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  q_offset: int = 0, window: int = 0, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention with AMX (see selection.amx_attention_applies for what it takes), over the
    mask of `flash_attention` (causal, q_offset, window, softcap: the same rules, checked alike).

    Returns out [T, Hq, D] bf16 (contiguous) and lse [Hq, T] float32, natural log, -inf and zeros
    for rows that see no key.
    """
    check_mask(causal, q_offset, window, softcap)  # before the library: a caller's error whatever runs
    return _flash_call(build.library().ringctx_amx_attention, q, k, v, causal, q_offset, window, scale, softcap,
                       torch.bfloat16)


def check_mask(causal: bool, q_offset: int, window: int, softcap: float) -> None:
    """Raise ValueError where the flash kernels' mask arguments make no sense: q_offset or window
    without causal (a full block has no band), a negative window or softcap, or a non-finite softcap."""
    if not causal and (q_offset or window):
        raise ValueError(f"q_offset={q_offset} and window={window} need causal=True (a full block sees every key)")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    if not (0.0 <= softcap < float("inf")):
        raise ValueError(f"softcap must be finite and >= 0 (0: none), got {softcap}")


def _flash_call(kernel, q, k, v, causal: bool, q_offset: int, window: int, scale: float, softcap: float,
                out_dtype: torch.dtype):
    """Call a flash kernel of the C signature ringctx_amx_attention and ringctx_flash_attention share
    (q, k, v and out by row and head strides; lse [Hq, T]) on all of torch's threads."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    out = torch.empty(T, Hq, D, dtype=out_dtype)
    lse = torch.empty(Hq, T, dtype=torch.float32)
    status = kernel(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                    v.stride(0), v.stride(1), T, S, Hq, Hkv, D, int(causal), int(q_offset), int(window), scale,
                    float(softcap), out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr(),
                    torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"{kernel.__name__} failed with status {status} (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"causal={causal}, q_offset={q_offset}, window={window}, softcap={softcap})")
    return out, lse


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                    q_offset: int = 0, window: int = 0, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention in float32 on the vector units (csrc/cpu_flash.c; see flash_attention_applies
    for what it takes). bf16 inputs are widened as the kernel reads them: the same bits as on their
    float32 copies, without making them.

    q [T, Hq, D], k and v [S, Hkv, D] (query head h reads KV head h // (Hq // Hkv)). The mask:
    causal=False, every query sees every key (q_offset and window must be 0: ValueError otherwise);
    causal=True, query row i sees key row j iff j <= i + q_offset and (window == 0 or
    j > i + q_offset - window), for any T and S and any integer q_offset (q_offset 0, window 0 and
    T == S: the square diagonal block). Key tiles no row of a query tile sees are skipped, so a
    window W costs about T W, not T S. softcap > 0: each score s = scale q.k becomes
    softcap tanh(s / softcap) before the softmax (Gemma 2), and the LSE is over the capped scores.

    Returns out [T, Hq, D] float32 (contiguous) and lse [Hq, T] float32, natural log; a row that
    sees no key gets out 0 and lse -inf. A row's result depends on its own query and the keys it
    sees alone, not on the threads or the other rows.
    """
    check_mask(causal, q_offset, window, softcap)  # before the library: a caller's error whatever runs
    lib = build.library()
    kernel = lib.ringctx_flash_attention_bf16 if q.dtype == torch.bfloat16 else lib.ringctx_flash_attention
    return _flash_call(kernel, q, k, v, causal, q_offset, window, scale, softcap, torch.float32)


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out] bf16 on AMX's tiles, or None where it does
    not apply (the caller then uses F.linear): bf16 x and weight on the CPU, AMX_LINEAR_ROWS rows,
    `in` a multiple of 32, `out` of 16, weight contiguous, no gradient wanted. Exact products,
    float32 sums, one rounding at the end (a native bf16 GEMM's contract); the weight is read in
    place, once for all rows (csrc/cpu_attention_amx.c)."""
    if not selection.amx_linear_applies(x, weight):
        return None
    lib = build.amx_library()
    if lib is None:
        return None
    x = x.contiguous()
    # float32 out only to add a bias before the one rounding
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32 if bias is not None else torch.bfloat16)
    status = lib.ringctx_amx_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                                    y.data_ptr(), int(bias is None), torch.get_num_threads())
    if status != 0:
        return None
    return y if bias is None else y.add_(bias.float()).to(torch.bfloat16)
