/* The vector layer ringctx's CPU kernels are written in: one source, built once per variant.
 *
 * The kernels (cpu_kernels.c, cpu_token_ops.c, cpu_decode.c) compute on `vfloat`, a GCC/Clang
 * vector of VW floats, with the ordinary operators (+, -, *, /, shifts, comparisons) and the
 * few functions below. ringctx/cpu_kernels.py compiles them once per variant, each with its own
 * -m flags and RINGCTX_VEC, into a library of its own, and loads the one this CPU runs:
 *
 *   variant   RINGCTX_VEC  flags                                       vector registers
 *   avx512    16           -mavx512f -mavx512bw -mavx512vl -mfma ...   32
 *   avx2       8           -mavx2 -mfma -mf16c                         16
 *   portable   4           none (SSE2 on x86-64, NEON on arm64)        16 (32 on arm64)
 *
 * The compiler writes the arithmetic for each ISA. Only where its generic vector code was found
 * wanting (GCC 12: widening bf16 and int8 lanes took two to eight times the instructions, the
 * fp16 conversion behind fp8 went lane by lane, horizontal sums through memory) does a function
 * below have an intrinsic body for avx512 and avx2, each beside the portable body that every
 * other target compiles; all three compute the same values.
 */
#ifndef RINGCTX_CPU_SIMD_H
#define RINGCTX_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#ifndef RINGCTX_VEC
#error "RINGCTX_VEC (floats per vector: 16, 8 or 4) is set by ringctx/cpu_kernels.py"
#endif
#define VW RINGCTX_VEC

#if VW == 16
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__))
#error "RINGCTX_VEC=16 is the avx512 variant: build with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c"
#endif
#define SIMD_AVX512 1
#define VREGS 32
#include <immintrin.h>
#elif VW == 8
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "RINGCTX_VEC=8 is the avx2 variant: build with -mavx2 -mfma -mf16c"
#endif
#define SIMD_AVX2 1
#define VREGS 16
#include <immintrin.h>
#elif VW == 4
#define SIMD_PORTABLE 1
#define VREGS 16
#else
#error "RINGCTX_VEC must be 16, 8 or 4"
#endif

typedef float vfloat __attribute__((vector_size(4 * VW)));
typedef int32_t vint __attribute__((vector_size(4 * VW)));
typedef uint32_t vuint __attribute__((vector_size(4 * VW)));
/* Views for loads and stores at any address (the vector types above want their own alignment). */
typedef float vfloat_u __attribute__((vector_size(4 * VW), aligned(4), may_alias));
typedef uint16_t vhalfbits_u __attribute__((vector_size(2 * VW), aligned(2), may_alias));
typedef int8_t vbytes_u __attribute__((vector_size(VW), aligned(1), may_alias));

#define SIMD_INLINE static inline __attribute__((always_inline))

SIMD_INLINE vfloat vload(const float *p) { return *(const vfloat_u *)p; }
SIMD_INLINE void vstore(float *p, vfloat v) { *(vfloat_u *)p = v; }
SIMD_INLINE vfloat vzero(void) { return (vfloat){0}; }
/* Every lane x. (Not vzero() + x: GCC must keep that add, as 0 + -0.0 is +0.0, one more instruction
 * per broadcast; bf16 PV took 0.85x the time without it.) */
SIMD_INLINE vfloat vset1(float x) {
#if defined(SIMD_AVX512)
    return _mm512_set1_ps(x);
#elif defined(SIMD_AVX2)
    return _mm256_set1_ps(x);
#else
    vfloat v;
    for (int i = 0; i < VW; ++i) v[i] = x;
    return v;
#endif
}

/* a * b + c, one rounding where the ISA has FMA (every variant but x86-64's portable one). */
SIMD_INLINE vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(SIMD_AVX512)
    return _mm512_fmadd_ps(a, b, c);
#elif defined(SIMD_AVX2)
    return _mm256_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}

/* Lane-wise a > b ? a : b, and a < b ? a : b. x86's MAXPS / MINPS compute exactly that (NaN and
 * signed zeros included): avx2 uses them, where GCC 12 writes a compare and a blend for the generic
 * form; for avx512 GCC already finds MAXPS in most of it, and the intrinsic measured no faster. */
SIMD_INLINE vfloat vmax(vfloat a, vfloat b) {
#if defined(SIMD_AVX2)
    return _mm256_max_ps(a, b);
#else
    const vint m = a > b;
    return (vfloat)(((vint)a & m) | ((vint)b & ~m));
#endif
}
SIMD_INLINE vfloat vmin(vfloat a, vfloat b) {
#if defined(SIMD_AVX2)
    return _mm256_min_ps(a, b);
#else
    const vint m = a < b;
    return (vfloat)(((vint)a & m) | ((vint)b & ~m));
#endif
}

/* The sum and the max of the lanes of v. */
SIMD_INLINE float vsum(vfloat v) {
#if defined(SIMD_AVX512)
    return _mm512_reduce_add_ps(v);
#elif defined(SIMD_AVX2)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0.0f;
    for (int i = 0; i < VW; ++i) s += v[i];
    return s;
#endif
}

/* vsum of four vectors at once, each sum's additions the ones vsum makes in the same order (the
 * same bits): on AVX2 11 instructions for the four (vsum: 6 each); elsewhere vsum four times. */
SIMD_INLINE void vsum4(vfloat a, vfloat b, vfloat c, vfloat d, float *sa, float *sb, float *sc, float *sd) {
#if defined(SIMD_AVX2)
    /* halves: lanes i of [a | b] are a_i + a_(i+4), b_i + b_(i+4) (vsum's first add) */
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    /* quarters: [a0 + a2, a1 + a3, c0 + c2, c1 + c3 | b.., d..] (its second) */
    const __m256 x = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 z = _mm256_add_ps(x, _mm256_movehdup_ps(x)); /* its third: lanes 0, 4, 2, 6 */
    *sa = z[0], *sb = z[4], *sc = z[2], *sd = z[6];
#else
    *sa = vsum(a), *sb = vsum(b), *sc = vsum(c), *sd = vsum(d);
#endif
}

SIMD_INLINE float vhmax(vfloat v) {
#if defined(SIMD_AVX512)
    return _mm512_reduce_max_ps(v);
#else
    float m = v[0];
    for (int i = 1; i < VW; ++i) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

/* Lane i of the result is the sum of the lanes of a[i], for i < VW: the dot products of VW
 * keys at once, each reduced, in one vector. */
SIMD_INLINE vfloat vsum_each(const vfloat *a) {
#if defined(SIMD_AVX512)
    /* a tree of adds over shuffled pairs: 46 instructions for 16 sums (one reduction takes ~8) */
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)  /* quarters of b[i]: a[2i] (2 partials), a[2i+1] (2 partials) */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)  /* quarter j of c[i]: 4 partial sums of a[4i + j] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* within each quarter j: 2 partials of a[j], a[4 + j] (e01) and of a[8 + j], a[12 + j] (e23) */
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_ps(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4j + m: the whole sum of a[4m + j]; permute it to lane 4m + j */
    const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, g);
#elif defined(SIMD_AVX2)
    /* horizontal adds within 128-bit halves, then the two halves of each sum added */
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* a0..a3 | a0..a3 halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    vfloat s;
    for (int i = 0; i < VW; ++i) s[i] = vsum(a[i]);
    return s;
#endif
}

/* VW bf16 values (raw bits) from p, as float32: a bf16 value is the top half of a float32, so
 * widening is a zero-extend and a shift, exact. */
SIMD_INLINE vfloat vload_bf16(const uint16_t *p) {
#if defined(SIMD_AVX512)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(SIMD_AVX2)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    return (vfloat)(__builtin_convertvector(*(const vhalfbits_u *)p, vuint) << 16);
#endif
}

/* 2 VW bf16 values (raw bits) from p, as float32 in two vectors: `even` holds elements 0, 2, 4,
 * ..., `odd` elements 1, 3, 5, ... A 32-bit lane of the row holds element 2i in its low half and
 * 2i + 1 in its high half, so one shift (even) or one mask (odd) widens VW values: half the
 * instructions of vload_bf16's in-order widening (bf16 decode attention's two products took
 * 0.82-0.87x the time with it, docs/BENCHMARKS.md). Callers
 * split their other operand alike (a dot product does not care about the order of its terms) or
 * put their output rows back in order at the end (split_pairs / join_pairs in cpu_kernels.h). */
typedef uint32_t vuint_u __attribute__((vector_size(4 * VW), aligned(4), may_alias));
SIMD_INLINE void vload_bf16_pairs(const uint16_t *p, vfloat *even, vfloat *odd) {
    const vuint u = *(const vuint_u *)p;
    *even = (vfloat)(u << 16);
    *odd = (vfloat)(u & 0xffff0000u);
}

/* 2 VW int8 codes c from p, in the order of vload_bf16_pairs (`even` holds elements 0, 2, 4, ...,
 * `odd` elements 1, 3, 5, ...), as exact float32 values with an offset: even I8_OFFSET + c, odd
 * 256 (I8_OFFSET + c). A 16-bit lane holds element 2i in its low byte and 2i + 1 in its high byte;
 * zero-extended to 32 bits, the low byte b, flipped to b ^ 0x80 = c + 128, goes under the
 * exponent bits of 2^23 (0x4B000000): the float 2^23 + 128 + c; the high byte likewise, where it
 * stands (bits 8-15): 2^23 + 256 (128 + c). One AND-XOR per vector (VPTERNLOGD), no shift and no
 * integer-to-float conversion, whose port a sign extension's shifts also need (an int8
 * matrix-vector product took 0.6x the time this way). The caller removes the offset with its
 * scale in one FMA: (I8_OFFSET + c) s - I8_OFFSET s = c s, exactly for a power-of-two s (odd:
 * 256 (I8_OFFSET_ODD + c) s / 256 - I8_OFFSET_ODD s). Int8 weights (gemv_block_pairs_q8) widen in the same order as bf16 ones, so that both sum
 * the same products in the same order. */
#define I8_OFFSET 8388736.0f   /* 2^23 + 128 */
#define I8_OFFSET_ODD 32896.0f /* (2^23 + 256 x 128) / 256 */
typedef uint16_t vushort_u __attribute__((vector_size(2 * VW), aligned(1), may_alias));
SIMD_INLINE void vload_i8_pairs(const int8_t *p, vfloat *even, vfloat *odd) {
#if defined(SIMD_AVX512) /* one VPMOVZXWD (GCC 12 splits the generic form into halves and joins them) */
    const vuint w = (vuint)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(SIMD_AVX2)
    const vuint w = (vuint)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    const vuint w = __builtin_convertvector(*(const vushort_u *)p, vuint);
#endif
    *even = (vfloat)((w & 0xffu) ^ 0x4b000080u);
    *odd = (vfloat)((w & 0xff00u) ^ 0x4b008000u);
}

/* v (already rounded to bf16 values, see vround_bf16) stored as VW bf16 bit patterns at p. */
SIMD_INLINE void vstore_bf16(uint16_t *p, vfloat v) {
#if defined(SIMD_AVX512)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
#elif defined(SIMD_AVX2)
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);  /* 8 values in the low halves */
    const __m256i packed = _mm256_packus_epi32(hi, hi);               /* 4 + 4 per 128-bit lane */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
#else
    typedef uint16_t vhalfbits __attribute__((vector_size(2 * VW)));
    *(vhalfbits_u *)p = __builtin_convertvector((vuint)v >> 16, vhalfbits);
#endif
}

/* VW int8 values from p, as float32 (exact). */
SIMD_INLINE vfloat vload_i8(const int8_t *p) {
#if defined(SIMD_AVX512)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(SIMD_AVX2)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const vbytes_u *)p, vint), vfloat);
#endif
}

/* VW float8 e4m3 values ("fn": no infinities; the quantizer never writes its NaN) from p, as
 * float32 divided by FP8_FOLD, exactly: a byte s|eeee|mmm moved to s|0eeee|mmm0000000 is the
 * fp16 of the same sign, exponent field and mantissa; fp16's exponent bias is 8 more than
 * e4m3's, so that fp16 is the value times 2^-8, subnormals included (both formats have
 * 2^(1 - bias) there). Sign-extending the byte puts its sign in bits 15 and 14 of (b << 7); the
 * mask clears bit 14. Callers fold FP8_FOLD into their scales. */
#define FP8_FOLD 256.0f
SIMD_INLINE vfloat vload_fp8(const int8_t *p) {
#if defined(SIMD_AVX512)
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                          _mm256_set1_epi16((short)0xBF80));
    return _mm512_cvtph_ps(half);
#elif defined(SIMD_AVX2)
    const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                       _mm_set1_epi16((short)0xBF80));
    return _mm256_cvtph_ps(half);
#else
    /* the same bits without an fp16 type: exponent field 0 (zero and subnormals, m * 2^-9) by
     * conversion, the others as float32 bits with the exponent rebased (127 - 7 - 8 = 112) */
    const vint b = __builtin_convertvector(*(const vbytes_u *)p, vint);
    const vint e = (b >> 3) & 15, m = b & 7, sign = b & (int32_t)0x80000000;
    const vfloat normal = (vfloat)(sign | ((e + 112) << 23) | (m << 20));
    const vfloat tiny = __builtin_convertvector(m, vfloat) * (1.0f / 131072.0f); /* m 2^-9 / 2^8 */
    const vint is_tiny = e == 0;
    return (vfloat)(((vint)normal & ~is_tiny) | ((vint)tiny & is_tiny) | (sign & is_tiny));
#endif
}

/* Each lane rounded to the nearest bf16 (ties to even), as the float32 of that value; NaN stays
 * NaN. The rule of PyTorch's float -> bfloat16 conversion. */
SIMD_INLINE vfloat vround_bf16(vfloat x) {
    const vuint u = (vuint)x;
    const vuint r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const vint nan = x != x;
    return (vfloat)(((vint)r & ~nan) | ((vint)u & nan));
}

/* exp(x) in each lane, within about 1 ulp of expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for exp(r) (Cephes' expf coefficients), times 2^n in two factors, so that results
 * down to the subnormals (x >= -104) are right. x = -inf gives 0; x >= 88.7 gives ~FLT_MAX. */
SIMD_INLINE vfloat vexp(vfloat x) {
    x = vmax(vmin(x, vset1(88.7f)), vset1(-104.0f));
    const vfloat shifter = vset1(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vfloat n = vfma(x, vset1(1.44269504088896341f), shifter) - shifter;
    vfloat r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vfloat p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, r * r, r + 1.0f);
    const vint ni = __builtin_convertvector(n, vint), half = ni >> 1; /* n in [-150, 128] */
    const vfloat f1 = (vfloat)((half + 127) << 23), f2 = (vfloat)((ni - half + 127) << 23);
    return p * f1 * f2;
}

/* tanh(x) in each lane, within a few ulp of tanhf (logit soft-capping: cpu_flash.c and the AMX
 * kernel call it alike): |x| < 0.625, Cephes' tanhf polynomial x + x^3 P(x^2) (no cancellation
 * near 0, where 1 - 2 / (e^2x + 1) would lose the low bits); else 1 - 2 / (e^2|x| + 1) with vexp
 * (e^2|x| saturates at ~FLT_MAX for |x| >= 44: 1), the sign of x put back. */
SIMD_INLINE vfloat vtanh(vfloat x) {
    const vint sign = (vint)x & (vint)vset1(-0.0f);
    const vfloat a = (vfloat)((vint)x ^ sign), z = a * a;
    vfloat p = vset1(-5.70498872745e-3f);
    p = vfma(p, z, vset1(2.06390887954e-2f));
    p = vfma(p, z, vset1(-5.37397155531e-2f));
    p = vfma(p, z, vset1(1.33314422036e-1f));
    p = vfma(p, z, vset1(-3.33332819422e-1f));
    const vfloat small = vfma(p * z, a, a);
    const vfloat large = vset1(1.0f) - vset1(2.0f) / (vexp(a + a) + vset1(1.0f));
    const vint near = a < vset1(0.625f);
    return (vfloat)((((vint)small & near) | ((vint)large & ~near)) | sign);
}

/* Ask for the cache lines of [p, p + bytes) ahead of use: streaming weights or K/V with the
 * hardware prefetchers alone ran at about half the memory's speed on AVX-512 machines. */
static inline void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* The same into the L2 cache (PREFETCHT2): for lines used some keys later (L2_AHEAD in
 * cpu_kernels.c), so that K and V stream in while the keys before them are computed. */
static inline void prefetch_span_l2(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

/* Slice `slice` of `slices` of [p, p + bytes), by whole lines: a block's prefetches issued a slice
 * at a time between pieces of work (l2: into L2 only). One burst of a hundred requests waits for
 * line fill buffers and stalls the work queued behind it; spread out, the reads overlap the work
 * (the decode attention over SmolLM2's 30 bf16 caches at 32K keys, C harness: 0.72-0.86x the
 * time on AVX-512). */
static inline void prefetch_slice(const char *p, int64_t bytes, int64_t slice, int64_t slices, int l2) {
    const int64_t lines = (bytes + 63) / 64, first = lines * slice / slices, end = lines * (slice + 1) / slices;
    if (l2) prefetch_span_l2(p + first * 64, (end - first) * 64);
    else prefetch_span(p + first * 64, (end - first) * 64);
}

#endif
