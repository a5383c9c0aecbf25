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

int ringctx_decode_pv(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int v_bf16, int64_t D,
                      float *out, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R > MAX_R) return -1;
    if (threads < 1) threads = 1;
    const int64_t n_out = Hkv * R * D;
    /* One partial sum per thread, added in thread order afterwards: the same bits every run. */
    float *partial = (float *)calloc((size_t)(threads * n_out), sizeof(float));
    if (partial == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        pv_range(p, Hkv, R, S, v, v_bf16, D, partial + t * n_out, split(S, t, n), split(S, t + 1, n));
    }
    memcpy(out, partial, (size_t)n_out * sizeof(float));
    for (int t = 1; t < threads; ++t)
        for (int64_t i = 0; i < n_out; ++i) out[i] += partial[t * n_out + i];
    free(partial);
    return 0;
}
