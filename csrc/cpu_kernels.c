/* ringctx's CPU kernels for decode steps, for CPUs with AVX-512 (built by ringctx/cpu_kernels.py).
 *
 * 1. Weights (bf16 bits or float32) times a few float32 activation rows.
 *
 * A decode step multiplies one activation row by every weight matrix once, so its time is the
 * time to stream the weights from memory. PyTorch's bf16 matmul on CPUs without bf16 units
 * emulates bf16 and streamed the weights at half the memory's speed here (no faster than the
 * float32 matmul, which reads twice the bytes). This kernel widens each bf16 weight to float32 in
 * registers (a bf16 value is the top half of a float32: zero-extend, shift left 16), accumulates
 * in float32 and prefetches the next rows, so it runs at the memory's speed.
 *
 *   y[r, o] = sum_i x[r, i] * w[o, i]      x: [rows, in] float32, w: [out, in] bf16 or float32,
 *                                           y: [rows, out] float32, all row-major, contiguous
 *
 * 2. Decode attention's two products over a token-major KV cache (below).
 *
 * cpu_decode.c builds a whole decode step of a Llama-family model from these pieces.
 *
 * Built by ringctx/cpu_kernels.py with the system C compiler (no PyTorch headers) and called
 * through ctypes; the caller checks shapes, dtypes and contiguity and rounds the results.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#define BLOCK GEMV_BLOCK /* output rows per step: four independent accumulators hide the FMA latency */

int ringctx_cpu_kernels_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

/* One block of up to BLOCK output rows [o, o + n) for every activation row. */
RINGCTX_AVX512 void gemv_block(const float *x, int64_t rows, int64_t in, const void *w, int bf16, int64_t out,
                               float *y, int64_t o, int64_t n) {
    const int64_t full = in - in % 16, esize = bf16 ? 2 : 4, row_bytes = in * esize;
    const __mmask16 tail = (__mmask16)((1u << (in % 16)) - 1u);
    /* Software prefetch of the next block's rows while this one is summed: the hardware
     * prefetchers alone kept this at ~60% of the memory bandwidth (measured: 1.6x faster with). */
    const int64_t ahead = (o + 2 * BLOCK <= out) ? BLOCK * row_bytes : 0;
    /* Rows past the end of the block re-read the last real row; their sums are dropped. */
    const char *w0 = (const char *)w + o * row_bytes;
    const char *w1 = w0 + (n > 1 ? 1 : 0) * row_bytes;
    const char *w2 = w0 + (n > 2 ? 2 : 0) * row_bytes;
    const char *w3 = w0 + (n > 3 ? 3 : 0) * row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t i = 0; i < full; i += 16) {
            const __m512 xv = _mm512_loadu_ps(xr + i);
            if (r == 0) {
                for (int64_t b = 0; b < 16 * esize; b += 64) {
                    _mm_prefetch(w0 + ahead + i * esize + b, _MM_HINT_T0);
                    _mm_prefetch(w1 + ahead + i * esize + b, _MM_HINT_T0);
                    _mm_prefetch(w2 + ahead + i * esize + b, _MM_HINT_T0);
                    _mm_prefetch(w3 + ahead + i * esize + b, _MM_HINT_T0);
                }
            }
            a0 = _mm512_fmadd_ps(load_any(w0, bf16, i), xv, a0);
            a1 = _mm512_fmadd_ps(load_any(w1, bf16, i), xv, a1);
            a2 = _mm512_fmadd_ps(load_any(w2, bf16, i), xv, a2);
            a3 = _mm512_fmadd_ps(load_any(w3, bf16, i), xv, a3);
        }
        if (tail) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, xr + full);
            a0 = _mm512_fmadd_ps(load_any_tail(w0, bf16, full, tail), xv, a0);
            a1 = _mm512_fmadd_ps(load_any_tail(w1, bf16, full, tail), xv, a1);
            a2 = _mm512_fmadd_ps(load_any_tail(w2, bf16, full, tail), xv, a2);
            a3 = _mm512_fmadd_ps(load_any_tail(w3, bf16, full, tail), xv, a3);
        }
        float *yr = y + r * out + o;
        yr[0] = _mm512_reduce_add_ps(a0);
        if (n > 1) yr[1] = _mm512_reduce_add_ps(a1);
        if (n > 2) yr[2] = _mm512_reduce_add_ps(a2);
        if (n > 3) yr[3] = _mm512_reduce_add_ps(a3);
    }
}

/* y = x w^T for w float32 (w_bf16 = 0) or bf16 bits (w_bf16 = 1). Returns 0 on success, -1 when
 * this CPU lacks AVX-512 (the caller then uses PyTorch). */
int ringctx_gemv(const float *x, int64_t rows, int64_t in, const void *w, int w_bf16, int64_t out,
                 float *y, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    const int64_t blocks = (out + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t o = b * BLOCK;
        gemv_block(x, rows, in, w, w_bf16, out, y, o, out - o < BLOCK ? out - o : BLOCK);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Decode attention: a few query rows against a long KV cache, in the cache's own layout.
 *
 * The cache is token-major, [S, Hkv, D] (float32 or bf16 bits). PyTorch's batched matmul wants
 * head-major operands, so the torch path converts (bf16) and walks strided rows, at about half
 * the memory's speed. These two kernels read each K and V row once, in place; the softmax between
 * them stays in PyTorch (a few small ops on [Hkv, R, S] scores).
 *
 *   scores[h, r, j] = scale * sum_d q[h, r, d] * k[j, h, d]    q: [Hkv, R, D] float32
 *   out[h, r, d]    = sum_j p[h, r, j] * v[j, h, d]            p: [Hkv, R, S] float32
 *
 * R is the number of query rows per KV head (GQA group size times query tokens). D must be a
 * multiple of 16 and at most MAX_D (checked by the caller).
 * ------------------------------------------------------------------------------------------ */
#define PREFETCH_BYTES 2048 /* how far ahead of the rows in use (one key at a time) */

/* Lane i of the result is the sum of the 16 lanes of a[i]: a tree of adds over shuffled pairs,
 * 46 instructions for 16 sums (one _mm512_reduce_add_ps each takes about 8). */
RINGCTX_AVX512 static inline __m512 sum_each_16(const __m512 *a) {
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
}

/* Scores of head h's R rows against 16 keys j0..j0+15, a vector store per row; NV = D / 16 is a
 * constant at each call, so the q row and the 16 dot products stay in registers. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void scores_16(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S,
                             float scale, float *scores, int64_t j0, int64_t h, const int NV) {
    const int64_t D = 16 * NV;
    for (int64_t r = 0; r < R; ++r) {
        __m512 qv[8], dots[16];
        for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + (h * R + r) * D + 16 * c);
        for (int kk = 0; kk < 16; ++kk) {
            const int64_t row = ((j0 + kk) * Hkv + h) * D;
            __m512 acc = _mm512_mul_ps(qv[0], load_any(k, bf16, row));
            for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(qv[c], load_any(k, bf16, row + 16 * c), acc);
            dots[kk] = acc;
        }
        _mm512_storeu_ps(scores + (h * R + r) * S + j0, _mm512_mul_ps(_mm512_set1_ps(scale), sum_each_16(dots)));
    }
}

/* Scores of every head and row against one key j (any D). */
RINGCTX_AVX512 static void scores_1(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int bf16,
                                    int64_t S, float scale, float *scores, int64_t j) {
    const int64_t nv = D / 16;
    __m512 kv[MAX_D / 16];
    for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = (j * Hkv + h) * D;
        for (int64_t c = 0; c < nv; ++c) kv[c] = load_any(k, bf16, row + 16 * c);
        const float *qh = q + h * R * D;
        for (int64_t r = 0; r < R; ++r) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh + r * D), kv[0]);
            for (int64_t c = 1; c < nv; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + r * D + 16 * c), kv[c], acc);
            scores[(h * R + r) * S + j] = scale * _mm512_reduce_add_ps(acc);
        }
    }
}

RINGCTX_AVX512 void scores_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int bf16,
                                 int64_t S, float scale, float *scores, int64_t j0, int64_t j1) {
    const int64_t nv = D / 16;
    const int64_t key_bytes = Hkv * D * (bf16 ? 2 : 4);
    int64_t j = j0;
    if (nv == 4 || nv == 8) {  /* the common head widths, 64 and 128: 16 keys at a time */
        for (; j + 16 <= j1; j += 16) {
            /* the cache lines of the block after this one */
            if (j + 32 <= j1) prefetch_span((const char *)k + (j + 16) * key_bytes, 16 * key_bytes);
            for (int64_t h = 0; h < Hkv; ++h) {
                if (nv == 4) scores_16(q, Hkv, R, k, bf16, S, scale, scores, j, h, 4);
                else scores_16(q, Hkv, R, k, bf16, S, scale, scores, j, h, 8);
            }
        }
    }
    const int64_t ahead = (PREFETCH_BYTES + key_bytes - 1) / key_bytes; /* in keys */
    for (; j < j1; ++j) {
        if (j + ahead < j1) prefetch_span((const char *)k + (j + ahead) * key_bytes, key_bytes);
        scores_1(q, Hkv, R, D, k, bf16, S, scale, scores, j);
    }
}

#define PV_BLOCK 32 /* keys whose V rows are read once for all heads before moving on */

/* acc rows [r0, r0 + RT) of head h += p . v over keys [j0, j1), the RT x NV accumulators in
 * registers (NV = D / 16; the caller passes constants, so the loops unroll). */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void pv_tile(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D,
                           float *acc, int64_t j0, int64_t j1, int64_t h, int64_t r0, const int RT, const int NV) {
    __m512 a[4][8];
    for (int r = 0; r < RT; ++r)
        for (int c = 0; c < NV; ++c) a[r][c] = _mm512_loadu_ps(acc + (h * R + r0 + r) * D + 16 * c);
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t row = (j * Hkv + h) * D;
        __m512 vv[8];
        for (int c = 0; c < NV; ++c) vv[c] = load_any(v, bf16, row + 16 * c);
        for (int r = 0; r < RT; ++r) {
            const __m512 w = _mm512_set1_ps(p[(h * R + r0 + r) * S + j]);
            for (int c = 0; c < NV; ++c) a[r][c] = _mm512_fmadd_ps(w, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < RT; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (h * R + r0 + r) * D + 16 * c, a[r][c]);
}

/* acc of every head's rows += p . v over keys [j0, j1). */
RINGCTX_AVX512 static void pv_heads(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16,
                                    int64_t D, float *acc, int64_t j0, int64_t j1) {
    const int64_t nv = D / 16;
    for (int64_t h = 0; h < Hkv; ++h) {
        int64_t r0 = 0;
        /* Register tiles for the common head widths (64 and 128); 4 query rows at a time. */
        if (nv == 4) {
            for (; r0 < R; r0 += 4) {
                switch (R - r0) {  /* constant tile heights, so each case compiles to registers */
                    case 1: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, 1, 4); break;
                    case 2: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, 2, 4); break;
                    case 3: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, 3, 4); break;
                    default: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, 4, 4);
                }
            }
        } else if (nv == 8) {
            for (; r0 < R; r0 += 2) {
                if (R - r0 == 1) pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, 1, 8);
                else pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, 2, 8);
            }
        }
        /* Any other width: accumulate through memory (L1), row by row. */
        for (; r0 < R; ++r0) {
            float *a = acc + (h * R + r0) * D;
            for (int64_t j = j0; j < j1; ++j) {
                const __m512 w = _mm512_set1_ps(p[(h * R + r0) * S + j]);
                const int64_t row = (j * Hkv + h) * D;
                for (int64_t c = 0; c < nv; ++c)
                    _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, load_any(v, bf16, row + 16 * c),
                                                                 _mm512_loadu_ps(a + 16 * c)));
            }
        }
    }
}

/* The cache holds a key's heads side by side, so V is walked in blocks of PV_BLOCK keys, every
 * head of a block before the next block: each cache line comes from memory once, in order (one
 * pass per head over the whole range ran at half the memory's speed). */
RINGCTX_AVX512 void pv_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D,
                             float *acc, int64_t j0, int64_t j1) {
    const int64_t key_bytes = Hkv * D * (bf16 ? 2 : 4);
    memset(acc, 0, (size_t)(Hkv * R * D) * sizeof(float));
    for (int64_t j = j0; j < j1; j += PV_BLOCK) {
        const int64_t end = j + PV_BLOCK < j1 ? j + PV_BLOCK : j1;
        if (end + PV_BLOCK <= j1) prefetch_span((const char *)v + end * key_bytes, PV_BLOCK * key_bytes);
        pv_heads(p, Hkv, R, S, v, bf16, D, acc, j, end);
    }
}

/* Split keys evenly over the threads: thread t of n takes [S*t/n, S*(t+1)/n). */
static inline int64_t split(int64_t S, int t, int n) { return S * t / n; }

int ringctx_decode_scores(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int k_bf16,
                          int64_t S, float scale, float *scores, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R > MAX_R) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        scores_range(q, Hkv, R, D, k, k_bf16, S, scale, scores, split(S, t, n), split(S, t + 1, n));
    }
    return 0;
}

/* P V over keys split across the threads, for a cache in the model dtype (q8_kind < 0) or 8-bit
 * rows with scales. One partial sum per thread, added in thread order afterwards: the same bits
 * every run. Returns 0, or -2 when out of memory. */
static int pv_over_threads(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int v_bf16,
                           const float *v_scale, int q8_kind, int64_t D, float *out, int threads) {
    if (threads < 1) threads = 1;
    const int64_t n_out = Hkv * R * D;
    float *partial = (float *)calloc((size_t)(threads * n_out), sizeof(float));
    if (partial == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        float *mine = partial + t * n_out;
        if (q8_kind < 0) pv_range(p, Hkv, R, S, v, v_bf16, D, mine, split(S, t, n), split(S, t + 1, n));
        else pv_q8_range(p, Hkv, R, S, (const int8_t *)v, v_scale, q8_kind, D, mine, split(S, t, n), split(S, t + 1, n));
    }
    memcpy(out, partial, (size_t)n_out * sizeof(float));
    for (int t = 1; t < threads; ++t)
        for (int64_t i = 0; i < n_out; ++i) out[i] += partial[t * n_out + i];
    free(partial);
    return 0;
}

int ringctx_decode_pv(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int v_bf16, int64_t D,
                      float *out, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R > MAX_R) return -1;
    return pv_over_threads(p, Hkv, R, S, v, v_bf16, NULL, -1, D, out, threads);
}

/* ------------------------------------------------------------------------------------------
 * Decode attention over an 8-bit KV cache (ringctx/attention/quant.py): the same two products,
 * with K and V stored as int8 or fp8 e4m3 data [S, Hkv, D] and a float32 scale [S, Hkv] per
 * token and KV head.
 *
 *   scores[h, r, j] = scale * k_scale[j, h] * sum_d q[h, r, d] * k[j, h, d]
 *   out[h, r, d]    = sum_j p[h, r, j] * v_scale[j, h] * v[j, h, d]
 *
 * Why kernels: a decode step's time is the time to read the cache, and an 8-bit cache is half
 * the bytes of a bf16 one only if it is read as it is stored; dequantizing it first (in PyTorch)
 * writes and reads a float copy on top of reading the 8-bit data. Here each byte is widened in
 * registers (load_q8) and the scales are applied once per key: to the 16 dot products of a
 * block of keys at once (scores), and to the weight p of each key (PV). fp8 data is widened to
 * its value / 256 (exact), so 256 is folded into those scales.
 *
 * Widening is not free: int8 -> float32 is a conversion on the floating-point ports (bf16 is an
 * integer shift), fp8 four instructions. Where the bf16 kernel re-reads each key for each query
 * row, the scores here take up to four rows of a KV head at a time against a few keys (16 dot
 * products, one reduction), so a key row is widened once per four rows, in registers. Widening 16
 * keys into a float32 tile in L1 for the rows to read instead took 1.4x (int8) and 1.15x (fp8)
 * the time at 3 rows per KV head (SmolLM2's GQA group), data in cache.
 * ------------------------------------------------------------------------------------------ */

/* The scales of keys j0..j0+15 for head h, times `mul`. */
RINGCTX_AVX512 static inline __m512 scales_16(const float *s, int64_t Hkv, int64_t j0, int64_t h, float mul) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)Hkv));
    return _mm512_mul_ps(_mm512_i32gather_ps(idx, s + j0 * Hkv + h, 4), _mm512_set1_ps(mul));
}

/* Scores of rows [r0, r0 + RT) of head h against the KB keys from jb + off, RT * KB <= 16 dot
 * products reduced together: lane r * KB + kk of the sum is row r0 + r against key jb + off + kk.
 * `sc` holds the scales of the block's 16 keys (lane i: key jb + i). RT, KB (a power of 2), NV and
 * KIND are constants, so the loops unroll and dots[] stays in registers. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void scores_q8_tile(const float *q, int64_t Hkv, int64_t R, const int8_t *k, int64_t S, __m512 sc,
                                  float *scores, int64_t jb, int off, int64_t h, int64_t r0, const int RT,
                                  const int KB, const int NV, const int KIND) {
    const int64_t D = 16 * NV;
    __m512 dots[16];
#pragma GCC unroll 16
    for (int i = RT * KB; i < 16; ++i) dots[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
        const int64_t row = ((jb + off + kk) * Hkv + h) * D;
        __m512 kv[8];
#pragma GCC unroll 8
        for (int c = 0; c < NV; c += 2) load_q8_pair(k, KIND, row + 16 * c, &kv[c], &kv[c + 1]);
#pragma GCC unroll 4
        for (int r = 0; r < RT; ++r) {
            const float *qr = q + (h * R + r0 + r) * D;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
#pragma GCC unroll 8
            for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[c], acc);
            dots[r * KB + kk] = acc;
        }
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i which = _mm512_add_epi32(_mm512_set1_epi32(off), _mm512_and_si512(lane, _mm512_set1_epi32(KB - 1)));
    const __m512 sums = _mm512_mul_ps(_mm512_permutexvar_ps(which, sc), sum_each_16(dots));
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r) {  /* lanes r * KB .. r * KB + KB - 1, moved down to lane 0 */
        const __m512 mine = _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(r * KB)), sums);
        _mm512_mask_storeu_ps(scores + (h * R + r0 + r) * S + jb + off, (__mmask16)((1u << KB) - 1u), mine);
    }
}

/* Scores of head h's R rows against the 16 keys j0..j0+15 (NV = D / 16 and KIND constants). */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void scores_q8_16(const float *q, int64_t Hkv, int64_t R, const int8_t *k, const float *ks, int64_t S,
                                float mul, float *scores, int64_t j0, int64_t h, const int NV, const int KIND) {
    const __m512 sc = scales_16(ks, Hkv, j0, h, mul);
    int64_t r0 = 0;
    /* Several rows: 4 keys at a time (2 rows against 8 keys, filling all 16 lanes, ran 2.5x slower
     * with the keys coming from memory, for no reason found). */
    for (; R - r0 >= 4; r0 += 4)
        for (int off = 0; off < 16; off += 4) scores_q8_tile(q, Hkv, R, k, S, sc, scores, j0, off, h, r0, 4, 4, NV, KIND);
    switch (R - r0) {
        case 3:
            for (int off = 0; off < 16; off += 4) scores_q8_tile(q, Hkv, R, k, S, sc, scores, j0, off, h, r0, 3, 4, NV, KIND);
            break;
        case 2:
            for (int off = 0; off < 16; off += 4) scores_q8_tile(q, Hkv, R, k, S, sc, scores, j0, off, h, r0, 2, 4, NV, KIND);
            break;
        case 1: scores_q8_tile(q, Hkv, R, k, S, sc, scores, j0, 0, h, r0, 1, 16, NV, KIND); break;
        default: break;
    }
}

/* Scores of every head and row against one key j (any D a multiple of 16). */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void scores_q8_1(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k, const float *ks,
                               int64_t S, float mul, float *scores, int64_t j, const int KIND) {
    const int64_t nv = D / 16;
    __m512 kv[MAX_D / 16];
    for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = (j * Hkv + h) * D;
        for (int64_t c = 0; c < nv; ++c) kv[c] = load_q8(k, KIND, row + 16 * c);
        const float *qh = q + h * R * D;
        const float s = mul * ks[j * Hkv + h];
        for (int64_t r = 0; r < R; ++r) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh + r * D), kv[0]);
            for (int64_t c = 1; c < nv; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + r * D + 16 * c), kv[c], acc);
            scores[(h * R + r) * S + j] = s * _mm512_reduce_add_ps(acc);
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void scores_q8_range_kind(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                                        const float *ks, int64_t S, float mul, float *scores, int64_t j0, int64_t j1,
                                        const int KIND) {
    const int64_t nv = D / 16, key_bytes = Hkv * D;
    int64_t j = j0;
    if (nv == 4 || nv == 8) {  /* head widths 64 and 128: 16 keys at a time */
        for (; j + 16 <= j1; j += 16) {
            if (j + 32 <= j1) {
                prefetch_span((const char *)(k + (j + 16) * key_bytes), 16 * key_bytes);
                prefetch_span((const char *)(ks + (j + 16) * Hkv), 16 * Hkv * (int64_t)sizeof(float));
            }
            for (int64_t h = 0; h < Hkv; ++h) {
                if (nv == 4) scores_q8_16(q, Hkv, R, k, ks, S, mul, scores, j, h, 4, KIND);
                else scores_q8_16(q, Hkv, R, k, ks, S, mul, scores, j, h, 8, KIND);
            }
        }
    }
    const int64_t ahead = (PREFETCH_BYTES + key_bytes - 1) / key_bytes;
    for (; j < j1; ++j) {
        if (j + ahead < j1) prefetch_span((const char *)(k + (j + ahead) * key_bytes), key_bytes);
        scores_q8_1(q, Hkv, R, D, k, ks, S, mul, scores, j, KIND);
    }
}

RINGCTX_AVX512 void scores_q8_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                                    const float *ks, int kind, int64_t S, float scale, float *scores, int64_t j0,
                                    int64_t j1) {
    if (kind == Q8_INT8) scores_q8_range_kind(q, Hkv, R, D, k, ks, S, scale, scores, j0, j1, Q8_INT8);
    else scores_q8_range_kind(q, Hkv, R, D, k, ks, S, scale * Q8_FP8_FOLD, scores, j0, j1, Q8_FP8);
}

/* acc rows [r0, r0 + RT) of head h += p * v_scale * v over keys [j0, j1), in registers (RT, NV and
 * KIND constants). */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void pv_q8_tile(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                              float mul, int64_t D, float *acc, int64_t j0, int64_t j1, int64_t h, int64_t r0,
                              const int RT, const int NV, const int KIND) {
    __m512 a[4][8];
    for (int r = 0; r < RT; ++r)
        for (int c = 0; c < NV; ++c) a[r][c] = _mm512_loadu_ps(acc + (h * R + r0 + r) * D + 16 * c);
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t row = (j * Hkv + h) * D;
        const float s = mul * vs[j * Hkv + h];
        __m512 vv[8];
        for (int c = 0; c < NV; c += 2) load_q8_pair(v, KIND, row + 16 * c, &vv[c], &vv[c + 1]);
        for (int r = 0; r < RT; ++r) {
            const __m512 w = _mm512_set1_ps(s * p[(h * R + r0 + r) * S + j]);
            for (int c = 0; c < NV; ++c) a[r][c] = _mm512_fmadd_ps(w, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < RT; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (h * R + r0 + r) * D + 16 * c, a[r][c]);
}

__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))
static inline void pv_q8_heads(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                               float mul, int64_t D, float *acc, int64_t j0, int64_t j1, const int KIND) {
    const int64_t nv = D / 16;
    /* Rows go in register tiles of 4 (D 64) or 2 (D 128), one at a time at other widths. With more
     * rows than one tile, widening each V row once per tile cost more than the products (int8's
     * conversion shares the floating-point ports with them), so the block is widened once into
     * float32 in L1, scales applied, and the float32 kernel reads that: 1.5x faster at 8 rows per
     * KV head, D 128 (32K keys, 8 KV heads). The block is PV_BLOCK x D floats, 16 KB at D 128. */
    const int one_tile = nv == 4 ? R <= 4 : nv == 8 ? R <= 2 : R == 1;
    if (!one_tile) {
        float tile[PV_BLOCK * MAX_D] __attribute__((aligned(64)));
        for (int64_t h = 0; h < Hkv; ++h) {
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t row = (j * Hkv + h) * D;
                const __m512 sv = _mm512_set1_ps(mul * vs[j * Hkv + h]);
                for (int64_t c = 0; c < nv; ++c)
                    _mm512_store_ps(tile + (j - j0) * D + 16 * c, _mm512_mul_ps(sv, load_q8(v, KIND, row + 16 * c)));
            }
            /* the float32 kernel on the tile: one head, keys 0 .. j1 - j0 */
            pv_heads(p + h * R * S + j0, 1, R, S, tile, 0, D, acc + h * R * D, 0, j1 - j0);
        }
        return;
    }
    for (int64_t h = 0; h < Hkv; ++h) {
        int64_t r0 = 0;
        if (nv == 4) {
            for (; r0 < R; r0 += 4) {
                switch (R - r0) {
                    case 1: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, r0, 1, 4, KIND); break;
                    case 2: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, r0, 2, 4, KIND); break;
                    case 3: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, r0, 3, 4, KIND); break;
                    default: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, r0, 4, 4, KIND);
                }
            }
        } else if (nv == 8) {
            for (; r0 < R; r0 += 2) {
                if (R - r0 == 1) pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, r0, 1, 8, KIND);
                else pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, r0, 2, 8, KIND);
            }
        }
        for (; r0 < R; ++r0) {  /* other widths: through memory (L1), row by row */
            float *a = acc + (h * R + r0) * D;
            for (int64_t j = j0; j < j1; ++j) {
                const __m512 w = _mm512_set1_ps(mul * vs[j * Hkv + h] * p[(h * R + r0) * S + j]);
                const int64_t row = (j * Hkv + h) * D;
                for (int64_t c = 0; c < nv; ++c)
                    _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, load_q8(v, KIND, row + 16 * c),
                                                                 _mm512_loadu_ps(a + 16 * c)));
            }
        }
    }
}

/* Blocks of PV_BLOCK keys, every head of a block before the next (as pv_range). */
RINGCTX_AVX512 void pv_q8_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                                int kind, int64_t D, float *acc, int64_t j0, int64_t j1) {
    const int64_t key_bytes = Hkv * D;
    memset(acc, 0, (size_t)(Hkv * R * D) * sizeof(float));
    for (int64_t j = j0; j < j1; j += PV_BLOCK) {
        const int64_t end = j + PV_BLOCK < j1 ? j + PV_BLOCK : j1;
        if (end + PV_BLOCK <= j1) {
            prefetch_span((const char *)(v + end * key_bytes), PV_BLOCK * key_bytes);
            prefetch_span((const char *)(vs + end * Hkv), PV_BLOCK * Hkv * (int64_t)sizeof(float));
        }
        if (kind == Q8_INT8) pv_q8_heads(p, Hkv, R, S, v, vs, 1.0f, D, acc, j, end, Q8_INT8);
        else pv_q8_heads(p, Hkv, R, S, v, vs, Q8_FP8_FOLD, D, acc, j, end, Q8_FP8);
    }
}

int ringctx_decode_scores_q8(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                             const float *k_scale, int kind, int64_t S, float scale, float *scores, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R > MAX_R || (kind != Q8_INT8 && kind != Q8_FP8))
        return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        scores_q8_range(q, Hkv, R, D, k, k_scale, kind, S, scale, scores, split(S, t, n), split(S, t + 1, n));
    }
    return 0;
}

int ringctx_decode_pv_q8(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *v_scale,
                         int kind, int64_t D, float *out, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R > MAX_R || (kind != Q8_INT8 && kind != Q8_FP8))
        return -1;
    return pv_over_threads(p, Hkv, R, S, v, 0, v_scale, kind, D, out, threads);
}
