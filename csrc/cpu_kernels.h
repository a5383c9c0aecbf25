/* Shared pieces of ringctx's CPU kernels (cpu_kernels.c, cpu_decode.c): AVX-512 loads of bf16 or
 * float32 data, bf16 rounding, a vector exp, and the kernels' internal building blocks.
 *
 * Data is either float32 or bf16 stored as its raw 16 bits (uint16_t); a flag `bf16` says which.
 * A bf16 value is the top half of a float32, so widening it is a zero-extend and a shift, exact.
 */
#ifndef RINGCTX_CPU_KERNELS_H
#define RINGCTX_CPU_KERNELS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define RINGCTX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define RINGCTX_INTERNAL __attribute__((visibility("hidden")))

#define MAX_D 256 /* widest head the attention kernels take (16 registers of 16 floats) */
#define MAX_R 64  /* most query rows per KV head the attention kernels take */

RINGCTX_AVX512 static inline __m512 widen(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* 16 values starting at element i of `base` (bf16 bits or float32), as float32. */
RINGCTX_AVX512 static inline __m512 load_any(const void *base, int bf16, int64_t i) {
    if (bf16) return widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

/* The first popcount(m) of them (the rest read as 0). */
RINGCTX_AVX512 static inline __m512 load_any_tail(const void *base, int bf16, int64_t i, __mmask16 m) {
    if (bf16) return widen(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i));
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

/* 8-bit KV data (ringctx/attention/quant.py): int8, or float8 e4m3 ("fn": no infinities, one NaN
 * pattern, which the quantizer never writes). A kernel takes the kind as a compile-time constant
 * (always_inline callers pass a literal), so the branch below costs nothing in its loops. */
#define Q8_INT8 0
#define Q8_FP8 1
#define Q8_FP8_FOLD 256.0f /* load_q8 returns an fp8 value divided by this; callers fold it into the scale */

/* 16 8-bit values starting at element i of `base`, as float32: int8 exactly; fp8 e4m3 divided by
 * Q8_FP8_FOLD, also exactly. An e4m3 byte s|eeee|mmm shifted to s|0eeee|mmm0000000 is the fp16 of
 * the same sign, exponent field and mantissa bits; fp16's exponent bias is 8 more than e4m3's, so
 * that fp16 is the value times 2^-8, for subnormals too (both formats have 2^(1 - bias) there).
 * Sign-extending the byte puts its sign in bits 15 and 14 of (b << 7); the mask clears bit 14.
 * The fp16 -> float32 conversion (vcvtph2ps) is part of AVX-512F: no table, no gather. */
RINGCTX_AVX512 static inline __m512 load_q8(const int8_t *base, const int kind, int64_t i) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(base + i));
    if (kind == Q8_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                          _mm256_set1_epi16((short)0xBF80));
    return _mm512_cvtph_ps(half);
}

/* 32 values from element i: load_q8 of i and of i + 16. For fp8 the bit operations run once on all
 * 32 (one 512-bit register of 16-bit lanes) instead of twice on 16. */
RINGCTX_AVX512 static inline void load_q8_pair(const int8_t *base, const int kind, int64_t i, __m512 *lo, __m512 *hi) {
    if (kind == Q8_INT8) {
        *lo = load_q8(base, kind, i);
        *hi = load_q8(base, kind, i + 16);
        return;
    }
    const __m512i half = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(base + i))), 7),
                                          _mm512_set1_epi16((short)0xBF80));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

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

/* 16 floats rounded to bf16 (ties to even; NaN stays NaN), or left alone for float32. */
RINGCTX_AVX512 static inline __m512 round512(__m512 x, int bf16) {
    if (!bf16) return x;
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                       _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(r), x);
}

/* Store the lanes of m (already rounded when bf16) at element i of `base` (bf16 bits or float32). */
RINGCTX_AVX512 static inline void store_any(void *base, int bf16, int64_t i, __m512 v, __mmask16 m) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)base + i, m,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    else
        _mm512_mask_storeu_ps((float *)base + i, m, v);
}

/* The first n lanes (n <= 16). */
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* exp(x) for 16 floats, within about 1 ulp of expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for exp(r) (Cephes' expf coefficients), times 2^n. x = -inf gives 0. */
RINGCTX_AVX512 static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Ask for the cache lines of [p, p + bytes) ahead of use: streaming weights or K/V with the
 * hardware prefetchers alone ran at about half the memory's speed here. */
static inline void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

int ringctx_cpu_kernels_supported(void);

/* The per-token operations of a decoder block on one token (cpu_token_ops.c), with the roundings
 * of ringctx/model/transformer.py. Data is bf16 bits or float32 (the *_bf16 flags); `bf16` is the
 * model's dtype: it says how the weights are stored and whether results round to bf16. */
RINGCTX_INTERNAL void token_rms_norm(const void *x, int x_bf16, const void *w, int bf16, int64_t n, float eps,
                                     void *out, int out_bf16);
RINGCTX_INTERNAL void token_rope(void *x, int x_bf16, const void *cos, const void *sin, int bf16, int64_t d);
RINGCTX_INTERNAL void token_swiglu(const void *gate, const void *up, int in_bf16, int bf16, int64_t n, void *out,
                                   int out_bf16);

/* y[r, o .. o+n) = x[r] . w[o .. o+n) for every activation row r (n <= 4 output rows); see
 * ringctx_gemv in cpu_kernels.c. */
RINGCTX_INTERNAL void gemv_block(const float *x, int64_t rows, int64_t in, const void *w, int bf16, int64_t out,
                                 float *y, int64_t o, int64_t n);
#define GEMV_BLOCK 4 /* output rows per gemv_block call */

/* scores[h, r, j] = scale * q[h, r] . k[j, h] for keys j in [j0, j1); see cpu_kernels.c. */
RINGCTX_INTERNAL void scores_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int bf16,
                                   int64_t S, float scale, float *scores, int64_t j0, int64_t j1);

/* acc[h, r] = sum_j p[h, r, j] v[j, h] over keys [j0, j1), overwriting acc; see cpu_kernels.c. */
RINGCTX_INTERNAL void pv_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D,
                               float *acc, int64_t j0, int64_t j1);

/* The same two over an 8-bit cache (kind Q8_INT8 or Q8_FP8, scales [S, Hkv]); see cpu_kernels.c. */
RINGCTX_INTERNAL void scores_q8_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                                      const float *ks, int kind, int64_t S, float scale, float *scores, int64_t j0,
                                      int64_t j1);
RINGCTX_INTERNAL void pv_q8_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                                  int kind, int64_t D, float *acc, int64_t j0, int64_t j1);

/* Decode attention over an 8-bit cache (cpu_kernels.c): data [S, Hkv, D] int8 or fp8 e4m3 (kind
 * Q8_INT8 or Q8_FP8) with a float32 scale [S, Hkv] per token and KV head.
 *   scores[h, r, j] = scale * k_scale[j, h] * sum_d q[h, r, d] * k[j, h, d]
 *   out[h, r, d]    = sum_j p[h, r, j] * v_scale[j, h] * v[j, h, d]
 * Return 0, or -1 (this CPU lacks AVX-512, or D / R out of range), -2 (out of memory). */
int ringctx_decode_scores_q8(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                             const float *k_scale, int kind, int64_t S, float scale, float *scores, int threads);
int ringctx_decode_pv_q8(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *v_scale,
                         int kind, int64_t D, float *out, int threads);

#endif
