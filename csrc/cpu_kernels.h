/* Shared pieces of ringctx's CPU kernels (cpu_kernels.c, cpu_token_ops.c, cpu_decode.c): loads and
 * stores of bf16 or float32 data in vectors of VW floats (cpu_simd.h), bf16 rounding, and the
 * kernels' internal building blocks.
 *
 * Data is either float32 or bf16 stored as its raw 16 bits (uint16_t); a flag `bf16` says which.
 * A bf16 value is the top half of a float32, so widening it is a zero-extend and a shift, exact.
 */
#ifndef RINGCTX_CPU_KERNELS_H
#define RINGCTX_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define RINGCTX_INTERNAL __attribute__((visibility("hidden")))

#define MAX_D 256 /* widest head the attention kernels take */
#define MAX_R 64  /* most query rows per KV head the attention kernels take */
/* The arguments of ringctx_flash_attention(_bf16) and ringctx_amx_attention, reported to the loader
 * (kernels/abi.py) beside the limits: ctypes cannot see a C signature, so a library built from
 * sources of another signature (21 before q_offset, window and softcap) is refused, not called. */
#define FLASH_ARGS 24

/* 8-bit KV data (ringctx/attention/quant.py): int8, or float8 e4m3 ("fn"). A kernel takes the
 * kind as a compile-time constant (always_inline callers pass a literal), so the branch in
 * load_q8 costs nothing in its loops. */
#define Q8_INT8 0
#define Q8_FP8 1

/* One element of `base` as float32. */
static inline float load_one(const void *base, int bf16, int64_t i) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to the nearest bf16 (ties to even), returned as the float32 of that value; NaN stays
 * NaN. The same rule as PyTorch's float -> bfloat16 conversion. */
static inline float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to the activation dtype: bf16, or float32 (nothing to do). */
static inline float round_to(float f, int bf16) { return bf16 ? bf16_round(f) : f; }

/* Store f (already rounded when bf16) as element i of `base`. */
static inline void store_one(void *base, int bf16, int64_t i, float f) {
    if (!bf16) {
        ((float *)base)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    ((uint16_t *)base)[i] = (uint16_t)(u >> 16);
}

/* VW values starting at element i of `base` (bf16 bits or float32), as float32. */
SIMD_INLINE vfloat load_any(const void *base, int bf16, int64_t i) {
    return bf16 ? vload_bf16((const uint16_t *)base + i) : vload((const float *)base + i);
}

/* Rows [j0, j0 + n) of head h of a bf16 K or V cache (row stride rs, head stride hs, in elements;
 * D a multiple of VW) widened into dst [n, D] float32: what the attention kernels do to a block
 * whose rows several query rows or tiles read (cpu_flash.c, pv_range). */
static inline void widen_bf16_rows(const uint16_t *x, int64_t rs, int64_t hs, int64_t h, int64_t j0, int64_t n,
                                   int64_t D, float *dst) {
    for (int64_t i = 0; i < n; ++i) {
        const uint16_t *row = x + (j0 + i) * rs + h * hs;
        for (int64_t d = 0; d < D; d += VW) vstore(dst + i * D + d, vload_bf16(row + d));
    }
}

/* The first n of them (n < VW; the other lanes read as 0). */
static inline vfloat load_any_part(const void *base, int bf16, int64_t i, int64_t n) {
    float t[VW] = {0};
    for (int64_t j = 0; j < n; ++j) t[j] = load_one(base, bf16, i + j);
    return vload(t);
}

/* min(n, VW) values from element i (the rest 0). */
SIMD_INLINE vfloat load_any_n(const void *base, int bf16, int64_t i, int64_t n) {
    return n >= VW ? load_any(base, bf16, i) : load_any_part(base, bf16, i, n);
}

/* v rounded to the activation dtype: bf16, or float32 (nothing to do). */
SIMD_INLINE vfloat round_any(vfloat v, int bf16) { return bf16 ? vround_bf16(v) : v; }

/* Store the VW lanes of v (already rounded when bf16) at element i of `base`. */
SIMD_INLINE void store_any(void *base, int bf16, int64_t i, vfloat v) {
    if (bf16) vstore_bf16((uint16_t *)base + i, v);
    else vstore((float *)base + i, v);
}

/* Store the first min(n, VW) lanes. */
SIMD_INLINE void store_any_n(void *base, int bf16, int64_t i, vfloat v, int64_t n) {
    if (n >= VW) {
        store_any(base, bf16, i, v);
        return;
    }
    for (int64_t j = 0; j < n; ++j) store_one(base, bf16, i + j, v[j]);
}

/* VW 8-bit values from element i of `base`, as float32: int8 exactly, fp8 divided by FP8_FOLD. */
SIMD_INLINE vfloat load_q8(const int8_t *base, const int kind, int64_t i) {
    return kind == Q8_INT8 ? vload_i8(base + i) : vload_fp8(base + i);
}

/* 1 when this CPU runs the variant this library was built as (cpu_detect.c, compiled for the
 * baseline ISA so that it runs anywhere). */
int ringctx_cpu_kernels_supported(void);

/* The per-token operations of a decoder block on one token (cpu_token_ops.c), with the roundings
 * of ringctx/model/transformer.py. Data is bf16 bits or float32 (the *_bf16 flags); `bf16` is the
 * model's dtype: it says how the weights are stored and whether results round to bf16. */
RINGCTX_INTERNAL void token_rms_norm(const void *x, int x_bf16, const void *w, int bf16, int64_t n, float eps,
                                     void *out, int out_bf16);
RINGCTX_INTERNAL void token_rope(void *x, int x_bf16, const void *cos, const void *sin, int bf16, int64_t d);
RINGCTX_INTERNAL void token_swiglu(const void *gate, const void *up, int in_bf16, int bf16, int64_t n, void *out,
                                   int out_bf16);
/* One partial attention result merged into a running one (cpu_token_ops.c; PartialAccumulator.add). */
int ringctx_merge_rows(float *acc_out, int64_t a_rs, float *acc_lse, int64_t l_hs, const void *out, int out_bf16,
                       int64_t o_rs, int64_t o_hs, const float *lse, int64_t lse_hs, int64_t n, int64_t H, int64_t D);

/* bf16 rows widen in pairs (vload_bf16_pairs) where a row is a whole number of runs of 2 VW
 * elements; the other operand is then split alike and outputs joined back (below). */
static inline int widen_in_pairs(int bf16, int64_t row) { return bf16 && row % (2 * VW) == 0; }

/* rows of `row` floats, each run of 2 VW elements reordered as its even then its odd elements (the
 * order vload_bf16_pairs widens a bf16 row in), and back. */
static inline void split_pairs(const float *x, int64_t rows, int64_t row, float *out) {
    for (int64_t i = 0; i < rows * row; i += 2 * VW)
        for (int l = 0; l < VW; ++l) out[i + l] = x[i + 2 * l], out[i + VW + l] = x[i + 2 * l + 1];
}

static inline void join_pairs(float *x, int64_t rows, int64_t row) {
    float run[2 * VW];
    for (int64_t i = 0; i < rows * row; i += 2 * VW) {
        for (int l = 0; l < VW; ++l) run[2 * l] = x[i + l], run[2 * l + 1] = x[i + VW + l];
        memcpy(x + i, run, sizeof run);
    }
}

/* y[r, o .. o+n) = x[r] . w[o .. o+n) for every activation row r (n <= 4 output rows); see
 * ringctx_gemv in cpu_kernels.c. */
RINGCTX_INTERNAL void gemv_block(const float *x, int64_t rows, int64_t in, const void *w, int bf16, int64_t out,
                                 float *y, int64_t o, int64_t n);
#define GEMV_BLOCK 4 /* output rows per gemv_block call: four independent sums hide the FMA latency */

/* gemv_block over bf16 weights widened in pairs, xs split by split_pairs (widen_in_pairs(1, in)).
 * Activation rows go four (QUAD_ROWS: AVX2, portable) then two at a time, each widened weight
 * vector serving them all; a row's sums are in the same order either way (its bits do not depend
 * on the number of rows). */
RINGCTX_INTERNAL void gemv_block_pairs(const float *xs, int64_t rows, int64_t in, const uint16_t *w, int64_t out,
                                       float *y, int64_t o, int64_t n);

/* Int8 weights (ringctx/model/int8_weights.py): w[o, i] = codes[o, i] * 2^exps[o, i / W8_GROUP],
 * codes in [-127, 127]. Every such value is a bf16 value, so a bf16 model whose weights hold
 * exactly these values is the same model: gemv_block_pairs_q8 widens the codes, scales them in
 * registers (exactly: a power of two) and sums the products in gemv_block_pairs' order, giving
 * its results bit for bit while reading half the bytes. `in` must be a multiple of W8_GROUP
 * (itself a multiple of 2 VW in every variant). */
#define W8_GROUP 64
RINGCTX_INTERNAL void gemv_block_pairs_q8(const float *xs, int64_t rows, int64_t in, const int8_t *w,
                                          const int8_t *exps, int64_t out, float *y, int64_t o, int64_t n);

/* 2^e as a float32, for the exponents of normal floats (-126 <= e <= 127). */
static inline float pow2f(int e) {
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* scores[h, r, j] = scale * q[h, r] . k[j, h] for keys j in [j0, j1); see cpu_kernels.c. Rows of k
 * before ahead_end (>= j1: the caller's whole range) may be prefetched into L2 ahead of use. */
RINGCTX_INTERNAL void scores_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int bf16,
                                   int64_t S, float scale, float *scores, int64_t j0, int64_t j1, int64_t ahead_end);

/* acc[h, r] = sum_j p[h, r, j] v[j, h] over keys [j0, j1), overwriting acc; ahead_end as above. */
RINGCTX_INTERNAL void pv_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D,
                               float *acc, int64_t j0, int64_t j1, int64_t ahead_end);

/* The same two over an 8-bit cache (kind Q8_INT8 or Q8_FP8, scales [S, Hkv]); see cpu_kernels.c. */
RINGCTX_INTERNAL void scores_q8_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                                      const float *ks, int kind, int64_t S, float scale, float *scores, int64_t j0,
                                      int64_t j1);
RINGCTX_INTERNAL void pv_q8_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                                  int kind, int64_t D, float *acc, int64_t j0, int64_t j1);

/* One-pass decode attention (cpu_kernels.c): one thread's share, keys [j0, j1) of a token-major cache
 * k, v [S, Hkv, D] (bf16 bits or float32 with q8 = -1; 8-bit data of kind q8 with scales ks, vs
 * [S, Hkv] otherwise) against q [Hkv, R, D] float32, in tiles of attend_tile_keys(Hkv R) keys;
 * softcap > 0: each score s = scale q.k becomes softcap tanh(s / softcap) (0: none).
 * Leaves per row (Hkv R of them) the running max m, the sum l of e^(s - m) and the unnormalised
 * output acc [Hkv R, D] (m = -inf, l = 0, acc = 0 for an empty range); buf holds
 * attend_range_floats(Hkv, R, D) floats of scratch. */
#define ATTEND_MAX_TILE 256 /* most keys of a tile */
RINGCTX_INTERNAL int64_t attend_tile_keys(int64_t rows);
RINGCTX_INTERNAL int64_t attend_range_floats(int64_t Hkv, int64_t R, int64_t D);
RINGCTX_INTERNAL void attend_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, const void *v,
                                   int bf16, int q8, const float *ks, const float *vs, float scale, float softcap,
                                   int64_t j0, int64_t j1, float *m, float *l, float *acc, float *buf);

/* The whole attention of R query rows per KV head, keys split over the threads and merged by
 * log-sum-exp: out [Hkv, R, D] float32 normalised, lse [Hkv, R] natural log (S = 0: zeros and
 * -inf). Cache as attend_range. Return 0, or -1 (this CPU lacks the variant's ISA, or D / R out of
 * range), -2 (out of memory). */
int ringctx_decode_attention(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, const void *v,
                             int bf16, const float *k_scale, const float *v_scale, int q8, int64_t S, float scale,
                             float *out, float *lse, int threads);

/* Decode attention over an 8-bit cache (cpu_kernels.c): data [S, Hkv, D] int8 or fp8 e4m3 (kind
 * Q8_INT8 or Q8_FP8) with a float32 scale [S, Hkv] per token and KV head.
 *   scores[h, r, j] = scale * k_scale[j, h] * sum_d q[h, r, d] * k[j, h, d]
 *   out[h, r, d]    = sum_j p[h, r, j] * v_scale[j, h] * v[j, h, d]
 * Return 0, or -1 (this CPU lacks the variant's ISA, or D / R out of range), -2 (out of memory). */
int ringctx_decode_scores_q8(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                             const float *k_scale, int kind, int64_t S, float scale, float *scores, int threads);
int ringctx_decode_pv_q8(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *v_scale,
                         int kind, int64_t D, float *out, int threads);

/* Flash attention in float32 (cpu_flash.c): q [T, Hq, D], k and v [S, Hkv, D], out [T, Hq, D] with
 * the given row and head strides (in floats; D contiguous), lse [Hq, T] natural log. Not causal:
 * every query sees every key (q_offset and window 0). Causal: query t sees key j iff
 * j <= t + q_offset and (window == 0 or j > t + q_offset - window); a row that sees no key gets
 * out 0, lse -inf. softcap > 0: each score s = scale q.k becomes softcap tanh(s / softcap) first.
 * Return 0, or -1 (this CPU lacks the variant's ISA; D not a multiple of the variant's vector or
 * over MAX_D; T or S < 1 or over INT32_MAX; scale <= 0; softcap < 0; window < 0; |q_offset| or
 * window over INT32_MAX; q_offset or window without causal), -2 (out of memory). */
int ringctx_flash_attention(const float *q, int64_t q_rs, int64_t q_hs, const float *k, int64_t k_rs, int64_t k_hs,
                            const float *v, int64_t v_rs, int64_t v_hs, int64_t T, int64_t S, int64_t Hq, int64_t Hkv,
                            int64_t D, int causal, int64_t q_offset, int64_t window, float scale, float softcap,
                            float *out, int64_t o_rs, int64_t o_hs, float *lse, int threads);
/* The same from bf16 q, k, v (bit patterns; strides in elements), widened as they are read: the
 * bits of ringctx_flash_attention on their float32 values. */
int ringctx_flash_attention_bf16(const uint16_t *q, int64_t q_rs, int64_t q_hs, const uint16_t *k, int64_t k_rs,
                                 int64_t k_hs, const uint16_t *v, int64_t v_rs, int64_t v_hs, int64_t T, int64_t S,
                                 int64_t Hq, int64_t Hkv, int64_t D, int causal, int64_t q_offset, int64_t window,
                                 float scale, float softcap, float *out, int64_t o_rs, int64_t o_hs, float *lse,
                                 int threads);

/* The gated delta rule over T tokens of B sequences, float32 (cpu_gated_delta.c): q, k [B, T, H, Dk],
 * v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv] updated in place, out [B, T, H, Dv].
 * Its argument count is reported to the loader (kernels/abi.py) as FLASH_ARGS is. */
#define GATED_DELTA_ARGS 13
int ringctx_gated_delta(const float *q, const float *k, const float *v, const float *g, const float *beta,
                        float *state, float *out, int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv,
                        int threads);

#endif
