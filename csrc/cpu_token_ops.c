/* The per-token operations of a Llama-family block: RMSNorm, rotate-half RoPE and
 * the SwiGLU gate, one token at a time (used by the fused decode step, cpu_decode.c) and over many
 * rows (exported for prefill, called by ringctx/model/transformer.py).
 *
 * Why for prefill: in PyTorch each is several elementwise ops, and in bf16 every op converts to
 * float32 and back: an 8K-token bf16 prefill of SmolLM2 spent ~1 s of ~7 s in them (profiled).
 * Here each is one pass per row, in float32 inside, with the roundings of the PyTorch path:
 *
 *   RMSNorm  out = round(x * rsqrt(mean(x^2) + eps) * w)          (F.rms_norm rounds once)
 *   RoPE     x'  = round(round(x * cos) + roll(x, D/2) * sin)      (x * cos, then addcmul)
 *   SwiGLU   g'  = round(round(g / (1 + exp(-g))) * u)             (F.silu, then mul_)
 *
 * round() is to bf16 for a bf16 model and nothing for float32. Sums and exp are not PyTorch's own,
 * so a float32 result may differ in the last bit and a bf16 one, rarely, by one step.
 */
#include <math.h>
#include <omp.h>

#include "cpu_kernels.h"

void token_rms_norm(const void *x, int x_bf16, const void *w, int bf16, int64_t n, float eps, void *out,
                    int out_bf16) {
    vfloat acc = vzero();
    for (int64_t i = 0; i < n; i += VW) {
        const vfloat v = load_any_n(x, x_bf16, i, n - i);
        acc = vfma(v, v, acc);
    }
    const float r = 1.0f / sqrtf(vsum(acc) / (float)n + eps);
    for (int64_t i = 0; i < n; i += VW) {
        const vfloat y = load_any_n(x, x_bf16, i, n - i) * r * load_any_n(w, bf16, i, n - i);
        store_any_n(out, out_bf16, i, round_any(y, bf16), n - i);
    }
}

void token_rope(void *x, int x_bf16, const void *cos, const void *sin, int bf16, int64_t d) {
    const int64_t half = d / 2;
    float v[MAX_D + VW], partner[MAX_D + VW], rotated[MAX_D + VW]; /* + VW: room for a partial last vector */
    for (int64_t i = 0; i < d; ++i) v[i] = load_one(x, x_bf16, i);
    for (int64_t i = 0; i < d; ++i) partner[i] = i < half ? v[i + half] : v[i - half];
    for (int64_t i = 0; i < d; i += VW) {
        const vfloat xc = round_any(vload(v + i) * load_any_n(cos, bf16, i, d - i), bf16);
        vstore(rotated + i, round_any(vfma(vload(partner + i), load_any_n(sin, bf16, i, d - i), xc), bf16));
    }
    for (int64_t i = 0; i < d; i += VW) store_any_n(x, x_bf16, i, vload(rotated + i), d - i);
}

void token_swiglu(const void *gate, const void *up, int in_bf16, int bf16, int64_t n, void *out, int out_bf16) {
    for (int64_t i = 0; i < n; i += VW) {
        const vfloat g = load_any_n(gate, in_bf16, i, n - i);
        /* silu(x) = x / (1 + exp(-x)), as PyTorch computes it */
        const vfloat silu = g / (vexp(-g) + 1.0f);
        const vfloat y = round_any(silu, bf16) * load_any_n(up, in_bf16, i, n - i);
        store_any_n(out, out_bf16, i, round_any(y, bf16), n - i);
    }
}

/* ---- over many rows (prefill): row r of x at x + r * x_stride elements ---------------------- */

/* out[r] = RMSNorm(x[r]) for rows r < rows; x and out in the model dtype. */
int ringctx_rms_norm_rows(const void *x, int64_t x_stride, const void *w, int64_t rows, int64_t dim, float eps,
                          int bf16, void *out, int64_t out_stride, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    const int64_t e = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        token_rms_norm((const char *)x + r * x_stride * e, bf16, w, bf16, dim, eps, (char *)out + r * out_stride * e,
                       bf16);
    return 0;
}

/* RoPE in place on `heads` heads of D elements of each row: head h of row r at
 * x + r * row_stride + h * head_stride; cos, sin: [rows, D] (RopeAngles' layout). */
int ringctx_rope_rows(void *x, int64_t rows, int64_t heads, int64_t d, int64_t row_stride, int64_t head_stride,
                      const void *cos, const void *sin, int bf16, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    if (d > MAX_D || d % 2) return -2;
    const int64_t e = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h)
            token_rope((char *)x + (r * row_stride + h * head_stride) * e, bf16, (const char *)cos + r * d * e,
                       (const char *)sin + r * d * e, bf16, d);
    return 0;
}

/* gate = SwiGLU(gate, up) in place over the gate half of each row of gate_up [rows, 2 * ffn]. */
int ringctx_swiglu_rows(void *gate_up, int64_t rows, int64_t ffn, int64_t row_stride, int bf16, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    const int64_t e = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        char *row = (char *)gate_up + r * row_stride * e;
        token_swiglu(row, row + ffn * e, bf16, bf16, ffn, row, bf16);
    }
    return 0;
}

/* The merge of one partial attention result into a running one (ringctx/attention/merge.py's
 * PartialAccumulator.add, whose ~25 small PyTorch ops cost ~0.13 ms a call at a question's few
 * rows, two calls a layer): for rows [0, n) and heads [0, H),
 *
 *   lse' = +inf or NaN -> -inf (empty-row markers)       new = logaddexp(acc_lse, lse')
 *   acc_out = acc_out * e^(acc_lse - new) + out * e^(lse' - new),  acc_lse = new
 *
 * where a side with LSE -inf weighs 0 (its out, garbage or not, is never read) and a row empty on
 * both sides stays as it is. acc_out [n, H, D] float32 (row stride a_rs), acc_lse [H, *] float32
 * (head stride l_hs), out [n, H, D] float32 or bf16 (strides o_rs, o_hs), lse [H, n] float32
 * (head stride lse_hs). */
int ringctx_merge_rows(float *acc_out, int64_t a_rs, float *acc_lse, int64_t l_hs, const void *out, int out_bf16,
                       int64_t o_rs, int64_t o_hs, const float *lse, int64_t lse_hs, int64_t n, int64_t H,
                       int64_t D) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t) {
            float add = lse[h * lse_hs + t];
            if (isnan(add) || add == INFINITY) add = -INFINITY;
            if (add == -INFINITY) continue; /* nothing new for this row */
            float *acc = acc_out + t * a_rs + h * D;
            const int64_t o = t * o_rs + h * o_hs;
            const float have = acc_lse[h * l_hs + t];
            if (have == -INFINITY) { /* the first part of this row: a copy */
                for (int64_t d = 0; d < D; ++d) acc[d] = load_one(out, out_bf16, o + d);
                acc_lse[h * l_hs + t] = add;
                continue;
            }
            const float top = have > add ? have : add;
            const float merged = top + log1pf(expf(-fabsf(have - add)));
            const float w_have = expf(have - merged), w_add = expf(add - merged);
            for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * w_have + load_one(out, out_bf16, o + d) * w_add;
            acc_lse[h * l_hs + t] = merged;
        }
    return 0;
}

/* ---- the TP all-reduce's sum (ringctx/parallel/allreduce.py) ------------------------------- */

/* out[i] = sources[0][i] + sources[1][i] + ... + sources[count - 1][i] for i < n, added left to
 * right in float32 (plain IEEE additions: the bits of PyTorch's float32 adds in that order); bf16
 * sources accumulate in float32 and the sum is rounded to bf16 once. One pass over the sources,
 * where PyTorch widens every bf16 buffer into a float32 one and adds in several passes (3-16x the
 * time at 4 MiB, docs/BENCHMARKS.md); the all-reduce calls it for bf16 only. */
int ringctx_sum_buffers(const void *const *sources, int count, int64_t n, int bf16, void *out, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    if (count < 1) return -2;
    const int64_t block = 4096; /* elements per task: each thread streams whole blocks */
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t stop = (b + 1) * block < n ? (b + 1) * block : n;
        for (int64_t i = b * block; i < stop; i += VW) {
            vfloat acc = load_any_n(sources[0], bf16, i, stop - i);
            for (int r = 1; r < count; ++r) acc = acc + load_any_n(sources[r], bf16, i, stop - i);
            store_any_n(out, bf16, i, round_any(acc, bf16), stop - i);
        }
    }
    return 0;
}
