/* ringctx's CPU kernels for decode steps (built by ringctx/cpu_kernels.py once per variant: avx512,
 * avx2, portable; see cpu_simd.h).
 *
 * 1. Weights (bf16 bits or float32) times a few float32 activation rows.
 *
 * A decode step multiplies one activation row by every weight matrix once, so its time is the
 * time to stream the weights from memory. PyTorch's bf16 matmul on CPUs without bf16 units
 * emulates bf16 and streamed the weights at half the memory's speed (no faster than the float32
 * matmul, which reads twice the bytes). This kernel widens each bf16 weight to float32 in
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
 * Built with the system C compiler (no PyTorch headers) and called through ctypes; the caller
 * checks shapes, dtypes and contiguity and rounds the results.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#define BLOCK GEMV_BLOCK

/* The first n (<= 4) of a block's four sums into y: vsum4 of their accumulators. */
SIMD_INLINE void store_sums(float *y, int64_t n, vfloat a, vfloat b, vfloat c, vfloat d) {
    float sums[4];
    vsum4(a, b, c, d, sums, sums + 1, sums + 2, sums + 3);
    for (int64_t q = 0; q < n; ++q) y[q] = sums[q];
}

/* One block of up to BLOCK output rows [o, o + n) for every activation row. */
void gemv_block(const float *x, int64_t rows, int64_t in, const void *w, int bf16, int64_t out, float *y, int64_t o,
                int64_t n) {
    const int64_t full = in - in % VW, esize = bf16 ? 2 : 4, row_bytes = in * esize;
    /* Software prefetch of the next block's rows while this one is summed: the hardware
     * prefetchers alone kept this at ~60% of the memory bandwidth (AVX-512: 1.6x faster with). */
    const int64_t ahead = (o + 2 * BLOCK <= out) ? BLOCK * row_bytes : 0;
    /* Rows past the end of the block re-read the last real row; their sums are dropped. */
    const char *w0 = (const char *)w + o * row_bytes;
    const char *w1 = w0 + (n > 1 ? 1 : 0) * row_bytes;
    const char *w2 = w0 + (n > 2 ? 2 : 0) * row_bytes;
    const char *w3 = w0 + (n > 3 ? 3 : 0) * row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * in;
        vfloat a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int64_t i = 0; i < full; i += VW) {
            const vfloat xv = vload(xr + i);
            if (r == 0 && ((i * esize) & 63) < VW * esize) {  /* the first vector of a cache line */
                __builtin_prefetch(w0 + ahead + i * esize, 0, 3);
                __builtin_prefetch(w1 + ahead + i * esize, 0, 3);
                __builtin_prefetch(w2 + ahead + i * esize, 0, 3);
                __builtin_prefetch(w3 + ahead + i * esize, 0, 3);
            }
            a0 = vfma(load_any(w0, bf16, i), xv, a0);
            a1 = vfma(load_any(w1, bf16, i), xv, a1);
            a2 = vfma(load_any(w2, bf16, i), xv, a2);
            a3 = vfma(load_any(w3, bf16, i), xv, a3);
        }
        if (full < in) {
            const int64_t rest = in - full;
            const vfloat xv = load_any_part(xr, 0, full, rest);
            a0 = vfma(load_any_part(w0, bf16, full, rest), xv, a0);
            a1 = vfma(load_any_part(w1, bf16, full, rest), xv, a1);
            a2 = vfma(load_any_part(w2, bf16, full, rest), xv, a2);
            a3 = vfma(load_any_part(w3, bf16, full, rest), xv, a3);
        }
        store_sums(y + r * out + o, n, a0, a1, a2, a3);
    }
}

/* Weight rows a two-row tile of gemv_block_pairs takes at a time: 2 x PAIR_W x 2 accumulators (16
 * of AVX-512's 32 registers; 8 of AVX2's 16). */
#if VW == 16
#define PAIR_W 4
#else
#define PAIR_W 2
#endif

/* Two activation rows xa, xb against weight rows w[0 .. NW) (NW a constant; rows past n repeat the
 * last), sums into ya, yb [0 .. n): each weight pair widened once for both rows, and each row's
 * sums in the order of gemv_block_pairs' one-row loop (the same bits). */
SIMD_INLINE void gemv_two_rows(const float *xa, const float *xb, int64_t in, const uint16_t *w, int64_t n, float *ya,
                               float *yb, int64_t ahead, const int NW) {
    vfloat ea[PAIR_W], oa[PAIR_W], eb[PAIR_W], ob[PAIR_W];
    const uint16_t *wr[PAIR_W];
#pragma GCC unroll 4
    for (int q = 0; q < NW; ++q) {
        ea[q] = oa[q] = eb[q] = ob[q] = vzero();
        wr[q] = w + (q < n ? q : n - 1) * in;
    }
    for (int64_t i = 0; i < in; i += 2 * VW) {
        const vfloat xae = vload(xa + i), xao = vload(xa + i + VW), xbe = vload(xb + i), xbo = vload(xb + i + VW);
        if (ahead && ((i * 2) & 63) == 0) /* the first run of a cache line */
#pragma GCC unroll 4
            for (int q = 0; q < NW; ++q) __builtin_prefetch((const char *)(wr[q] + i) + ahead, 0, 3);
#pragma GCC unroll 4
        for (int q = 0; q < NW; ++q) {
            vfloat w_even, w_odd;
            vload_bf16_pairs(wr[q] + i, &w_even, &w_odd);
            ea[q] = vfma(w_even, xae, ea[q]), oa[q] = vfma(w_odd, xao, oa[q]);
            eb[q] = vfma(w_even, xbe, eb[q]), ob[q] = vfma(w_odd, xbo, ob[q]);
        }
    }
#if PAIR_W == 2 /* the four sums at once */
    float sums[4];
    vsum4(ea[0] + oa[0], ea[1] + oa[1], eb[0] + ob[0], eb[1] + ob[1], sums, sums + 1, sums + 2, sums + 3);
    for (int q = 0; q < NW && q < n; ++q) ya[q] = sums[q], yb[q] = sums[2 + q];
#else
#pragma GCC unroll 4
    for (int q = 0; q < NW; ++q)
        if (q < n) ya[q] = vsum(ea[q] + oa[q]), yb[q] = vsum(eb[q] + ob[q]);
#endif
}

/* Activation rows a tile of gemv_four_rows takes: on AVX2 and portable builds (16 registers: 8
 * accumulators, the rows' inputs read as the FMAs' memory operands). Not on AVX-512, whose two-row
 * tile over four weight rows was as fast or faster (a four-row tile over two weight rows took
 * 0.99-1.21x its time at 8-32 rows; AVX2 0.82-0.96x, portable 0.87-0.92x: SmolLM2's block matrices,
 * 2 threads, docs/BENCHMARKS.md). */
#define QUAD_ROWS (VW == 16 ? 0 : 4)

/* Four activation rows x, x + in, x + 2 in, x + 3 in against one weight row w, sums into y, y + out,
 * y + 2 out, y + 3 out: each widened weight pair serves four rows (8 FMAs a shift and a mask, which
 * share the FMAs' ports; the two-row tile's 4), each row's sums in the order of gemv_block_pairs'
 * one-row loop (the same bits). */
SIMD_INLINE void gemv_four_rows(const float *x, int64_t in, const uint16_t *w, float *y, int64_t out, int64_t ahead) {
    vfloat even[4], odd[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) even[r] = odd[r] = vzero();
    for (int64_t i = 0; i < in; i += 2 * VW) {
        if (ahead && ((i * 2) & 63) == 0) /* the first run of a cache line */
            __builtin_prefetch((const char *)(w + i) + ahead, 0, 3);
        vfloat w_even, w_odd;
        vload_bf16_pairs(w + i, &w_even, &w_odd);
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
            even[r] = vfma(w_even, vload(x + r * in + i), even[r]);
            odd[r] = vfma(w_odd, vload(x + r * in + i + VW), odd[r]);
        }
    }
    vsum4(even[0] + odd[0], even[1] + odd[1], even[2] + odd[2], even[3] + odd[3], y, y + out, y + 2 * out, y + 3 * out);
}

/* gemv_block for bf16 weights widened in pairs (vload_bf16_pairs: half the widening instructions;
 * bf16 decode steps took 0.90-0.95x the time with it): xs holds the activation rows with each run
 * of 2 VW elements split into its even then its odd elements (split_pairs); `in` is a multiple of
 * 2 VW.
 * Even and odd products go to accumulators of their own, so that no FMA waits on another. */
void gemv_block_pairs(const float *xs, int64_t rows, int64_t in, const uint16_t *w, int64_t out, float *y, int64_t o,
                      int64_t n) {
    const int64_t row_bytes = in * 2;
    const int64_t ahead = (o + 2 * BLOCK <= out) ? BLOCK * row_bytes : 0;
    const uint16_t *w0 = w + o * in;
    const uint16_t *w1 = w0 + (n > 1 ? 1 : 0) * in, *w2 = w0 + (n > 2 ? 2 : 0) * in, *w3 = w0 + (n > 3 ? 3 : 0) * in;
    int64_t r = 0;
    /* Rows four (QUAD_ROWS), then two at a time: a widened weight vector serves them all (a batch's
     * or a question's rows; PAIR_W divides BLOCK) */
    for (; QUAD_ROWS && r + QUAD_ROWS <= rows; r += QUAD_ROWS)
        for (int64_t q = 0; q < n; ++q)
            gemv_four_rows(xs + r * in, in, w0 + q * in, y + r * out + o + q, out, r == 0 ? ahead : 0);
    for (; r + 2 <= rows; r += 2)
        for (int64_t q = 0; q < n; q += PAIR_W)
            gemv_two_rows(xs + r * in, xs + (r + 1) * in, in, w0 + q * in, n - q < PAIR_W ? n - q : PAIR_W,
                          y + r * out + o + q, y + (r + 1) * out + o + q, r == 0 ? ahead : 0, PAIR_W);
    for (; r < rows; ++r) {
        const float *xr = xs + r * in;
        vfloat e0 = vzero(), e1 = vzero(), e2 = vzero(), e3 = vzero();
        vfloat o0 = vzero(), o1 = vzero(), o2 = vzero(), o3 = vzero();
        for (int64_t i = 0; i < in; i += 2 * VW) {
            const vfloat x_even = vload(xr + i), x_odd = vload(xr + i + VW);
            if (r == 0 && ((i * 2) & 63) == 0) {  /* the first run of a cache line */
                __builtin_prefetch((const char *)(w0 + i) + ahead, 0, 3);
                __builtin_prefetch((const char *)(w1 + i) + ahead, 0, 3);
                __builtin_prefetch((const char *)(w2 + i) + ahead, 0, 3);
                __builtin_prefetch((const char *)(w3 + i) + ahead, 0, 3);
            }
            vfloat w_even, w_odd;
            vload_bf16_pairs(w0 + i, &w_even, &w_odd);
            e0 = vfma(w_even, x_even, e0), o0 = vfma(w_odd, x_odd, o0);
            vload_bf16_pairs(w1 + i, &w_even, &w_odd);
            e1 = vfma(w_even, x_even, e1), o1 = vfma(w_odd, x_odd, o1);
            vload_bf16_pairs(w2 + i, &w_even, &w_odd);
            e2 = vfma(w_even, x_even, e2), o2 = vfma(w_odd, x_odd, o2);
            vload_bf16_pairs(w3 + i, &w_even, &w_odd);
            e3 = vfma(w_even, x_even, e3), o3 = vfma(w_odd, x_odd, o3);
        }
        store_sums(y + r * out + o, n, e0 + o0, e1 + o1, e2 + o2, e3 + o3);
    }
}

/* gemv_block_pairs over int8 weights with a power-of-two scale per W8_GROUP inputs (see
 * cpu_kernels.h): the same FMAs on the same float operands, so the same sums bit for bit as over
 * the bf16 weights those codes stand for. A cache line holds 64 codes (one group of a row). */
void gemv_block_pairs_q8(const float *xs, int64_t rows, int64_t in, const int8_t *w, const int8_t *exps,
                         int64_t out, float *y, int64_t o, int64_t n) {
    const int64_t groups = in / W8_GROUP;
    const int64_t ahead = (o + 2 * BLOCK <= out) ? BLOCK * in : 0;
    const int64_t r1 = n > 1 ? 1 : 0, r2 = n > 2 ? 2 : 0, r3 = n > 3 ? 3 : 0;
    const int8_t *w0 = w + o * in, *w1 = w0 + r1 * in, *w2 = w0 + r2 * in, *w3 = w0 + r3 * in;
    const int8_t *ex0 = exps + o * groups, *ex1 = ex0 + r1 * groups, *ex2 = ex0 + r2 * groups, *ex3 = ex0 + r3 * groups;
    const vfloat minus_offset = vset1(-I8_OFFSET), one_256th = vset1(1.0f / 256), minus_odd = vset1(-I8_OFFSET_ODD);
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = xs + r * in;
        vfloat e0 = vzero(), e1 = vzero(), e2 = vzero(), e3 = vzero();
        vfloat o0 = vzero(), o1 = vzero(), o2 = vzero(), o3 = vzero();
        for (int64_t g = 0; g < groups; ++g) {
            /* w = (I8_OFFSET + c) s + b, b = -I8_OFFSET s: exactly c s; the odd elements carry a
             * factor 256 more: (2^23 + 256 (128 + c)) s / 256 - (2^15 + 128) s = c s (see
             * vload_i8_pairs). One broadcast per row, the rest multiplies by constants. */
            const vfloat s0 = vset1(pow2f(ex0[g])), s1 = vset1(pow2f(ex1[g])), s2 = vset1(pow2f(ex2[g])),
                         s3 = vset1(pow2f(ex3[g]));
            const vfloat b0 = s0 * minus_offset, b1 = s1 * minus_offset, b2 = s2 * minus_offset, b3 = s3 * minus_offset;
            const vfloat t0 = s0 * one_256th, t1 = s1 * one_256th, t2 = s2 * one_256th, t3 = s3 * one_256th;
            const vfloat d0 = s0 * minus_odd, d1 = s1 * minus_odd, d2 = s2 * minus_odd, d3 = s3 * minus_odd;
            const int64_t i0 = g * W8_GROUP;
            if (r == 0) {
                __builtin_prefetch(w0 + ahead + i0, 0, 3);
                __builtin_prefetch(w1 + ahead + i0, 0, 3);
                __builtin_prefetch(w2 + ahead + i0, 0, 3);
                __builtin_prefetch(w3 + ahead + i0, 0, 3);
            }
            for (int64_t i = i0; i < i0 + W8_GROUP; i += 2 * VW) {
                const vfloat x_even = vload(xr + i), x_odd = vload(xr + i + VW);
                vfloat w_even, w_odd;
                vload_i8_pairs(w0 + i, &w_even, &w_odd);
                e0 = vfma(vfma(w_even, s0, b0), x_even, e0), o0 = vfma(vfma(w_odd, t0, d0), x_odd, o0);
                vload_i8_pairs(w1 + i, &w_even, &w_odd);
                e1 = vfma(vfma(w_even, s1, b1), x_even, e1), o1 = vfma(vfma(w_odd, t1, d1), x_odd, o1);
                vload_i8_pairs(w2 + i, &w_even, &w_odd);
                e2 = vfma(vfma(w_even, s2, b2), x_even, e2), o2 = vfma(vfma(w_odd, t2, d2), x_odd, o2);
                vload_i8_pairs(w3 + i, &w_even, &w_odd);
                e3 = vfma(vfma(w_even, s3, b3), x_even, e3), o3 = vfma(vfma(w_odd, t3, d3), x_odd, o3);
            }
        }
        store_sums(y + r * out + o, n, e0 + o0, e1 + o1, e2 + o2, e3 + o3);
    }
}

/* y = x w^T for int8 weights with their group exponents (see cpu_kernels.h); in a multiple of
 * W8_GROUP. Returns 0, -1 when this CPU cannot run this variant, -2 for a bad `in` (or no memory). */
int ringctx_gemv_q8(const float *x, int64_t rows, int64_t in, const int8_t *w, const int8_t *exps, int64_t out,
                    float *y, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    if (in % W8_GROUP != 0 || in < W8_GROUP) return -2;
    const int64_t blocks = (out + BLOCK - 1) / BLOCK;
    float *xs = (float *)malloc((size_t)(rows * in) * sizeof(float));
    if (xs == NULL) return -2;
    split_pairs(x, rows, in, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t o = b * BLOCK, n = out - o < BLOCK ? out - o : BLOCK;
        gemv_block_pairs_q8(xs, rows, in, w, exps, out, y, o, n);
    }
    free(xs);
    return 0;
}

/* y = x w^T for w float32 (w_bf16 = 0) or bf16 bits (w_bf16 = 1). Returns 0 on success, -1 when
 * this CPU cannot run this variant (the caller then uses PyTorch). */
int ringctx_gemv(const float *x, int64_t rows, int64_t in, const void *w, int w_bf16, int64_t out, float *y,
                 int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    const int64_t blocks = (out + BLOCK - 1) / BLOCK;
    float *xs = widen_in_pairs(w_bf16, in) ? (float *)malloc((size_t)(rows * in) * sizeof(float)) : NULL;
    if (xs != NULL) split_pairs(x, rows, in, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t o = b * BLOCK, n = out - o < BLOCK ? out - o : BLOCK;
        if (xs != NULL) gemv_block_pairs(xs, rows, in, (const uint16_t *)w, out, y, o, n);
        else gemv_block(x, rows, in, w, w_bf16, out, y, o, n);
    }
    free(xs);
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
/* Which variants score a KV head's query rows together (scores_group): avx2, where the whole
 * decode step took 0.96x the time with it (SmolLM2 bf16 at 8K keys: 8 floats per vector, the
 * attention bound by instructions); on avx512 it took 1.05x, bound by memory there, where the
 * per-row loop's block-at-a-time prefetch reads the cache faster (with both loops' prefetches
 * spread over the heads, the grouped one took 1.03-1.5x the time there: C harness, SmolLM2's 30
 * caches, 8K and 32K keys, 3 and 24 rows per KV head). */
#define GROUPED_SCORES (VW == 8)
/* Keys ahead of use that K and V are asked into L2 for (PREFETCHT2), up to ahead_end. The
 * hardware prefetchers alone left the attention at 1.36x the time (C harness over SmolLM2's 30
 * caches at 8K keys); 32-96 keys ahead measured alike, and 64 took 0.85-0.98x the time of 256
 * (bf16 and float32, 2K and 8K keys; the farther requests presumably hold line fill buffers
 * that the nearer ones need). */
#define L2_AHEAD 64
#define PREFETCH_BYTES 2048 /* how far ahead of the rows in use (one key at a time) */

/* Rows per KV head from which scores_block widens a block's bf16 keys once into float32 (in L1)
 * for all its rows, instead of once per row: the same values, so the same sums and bits. One row
 * reads them where they lie (a store and a load more per vector for nothing to share). */
#define WIDEN_ONCE_ROWS 2

/* Head h's keys j0 .. j0 + VW - 1 (bf16, D = VW NV) widened in pairs into kw [VW, NV, VW]: for key
 * kk and an even c, kw[kk, c] the even elements of D's run c, kw[kk, c + 1] the odd ones, as
 * vload_bf16_pairs gives them. */
SIMD_INLINE void widen_key_block(const uint16_t *k, int64_t Hkv, int64_t j0, int64_t h, float *kw, const int NV) {
    const int64_t D = VW * NV;
#pragma GCC unroll 16
    for (int kk = 0; kk < VW; ++kk)
#pragma GCC unroll 16
        for (int c = 0; c < NV; c += 2) {
            vfloat even, odd;
            vload_bf16_pairs(k + ((j0 + kk) * Hkv + h) * D + VW * c, &even, &odd);
            vstore(kw + (kk * NV + c) * VW, even);
            vstore(kw + (kk * NV + c + 1) * VW, odd);
        }
}

/* Scores of head h's R rows against the VW keys j0 .. j0 + VW - 1, a vector store per row. NV =
 * D / VW is a constant at each call, so the loops unroll and the VW dot products stay in
 * registers while the q row's vectors are read in turn. pairs (a constant too): the cache is bf16,
 * its rows widened in pairs (vload_bf16_pairs), and q is split alike (split_pairs); from
 * WIDEN_ONCE_ROWS rows the block is widened once into kw [VW D] (widen_key_block) and every row
 * reads that. */
SIMD_INLINE void scores_block(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S, float scale,
                              float *scores, int64_t j0, int64_t h, float *kw, const int NV, const int pairs) {
    const int64_t D = VW * NV;
    const int widened = pairs && R >= WIDEN_ONCE_ROWS;
    if (widened) widen_key_block((const uint16_t *)k, Hkv, j0, h, kw, NV);
    for (int64_t r = 0; r < R; ++r) {
        const float *qr = q + (h * R + r) * D;
        vfloat dots[VW];
#pragma GCC unroll 16
        for (int kk = 0; kk < VW; ++kk) dots[kk] = vzero();
#pragma GCC unroll 16
        for (int c = 0; c < NV; c += pairs ? 2 : 1) {
            const vfloat qc = vload(qr + VW * c), q_odd = pairs ? vload(qr + VW * (c + 1)) : vzero();
#pragma GCC unroll 16
            for (int kk = 0; kk < VW; ++kk) {
                const int64_t at = ((j0 + kk) * Hkv + h) * D + VW * c;
                if (pairs) {
                    vfloat k_even, k_odd;
                    if (widened) {
                        k_even = vload(kw + (kk * NV + c) * VW);
                        k_odd = vload(kw + (kk * NV + c + 1) * VW);
                    } else {
                        vload_bf16_pairs((const uint16_t *)k + at, &k_even, &k_odd);
                    }
                    dots[kk] = vfma(q_odd, k_odd, vfma(qc, k_even, dots[kk]));
                } else {
                    dots[kk] = vfma(qc, load_any(k, bf16, at), dots[kk]);
                }
            }
        }
        vstore(scores + (h * R + r) * S + j0, vsum_each(dots) * scale);
    }
}

/* Scores of head h's RT rows against KB keys from j0 (RT KB <= VW), every row reading each key
 * as it is widened: the key is loaded (and, bf16 in pairs, widened) once for all RT rows of its
 * group instead of once per row, and the RT KB dot products are reduced together at the end
 * (vsum_each), lane r KB + kk holding row r's score of key j0 + kk. NV = D / VW, RT, KB, pairs:
 * constants at each call, so the loops unroll into registers (q is read from L1 as it goes). */
SIMD_INLINE void scores_group(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S,
                              float scale, float *scores, int64_t j0, int64_t h, const int NV, const int RT,
                              const int KB, const int pairs) {
    const int64_t D = VW * NV;
    const float *qh = q + h * R * D;
    vfloat dots[VW];
#pragma GCC unroll 16
    for (int i = 0; i < VW; ++i) dots[i] = vzero();
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
        const int64_t row = ((j0 + kk) * Hkv + h) * D;
#pragma GCC unroll 16
        for (int c = 0; c < NV; c += pairs ? 2 : 1) {
            vfloat k_even, k_odd = vzero();
            if (pairs) vload_bf16_pairs((const uint16_t *)k + row + VW * c, &k_even, &k_odd);
            else k_even = load_any(k, bf16, row + VW * c);
#pragma GCC unroll 8
            for (int r = 0; r < RT; ++r) {
                vfloat dot = vfma(vload(qh + r * D + VW * c), k_even, dots[r * KB + kk]);
                if (pairs) dot = vfma(vload(qh + r * D + VW * (c + 1)), k_odd, dot);
                dots[r * KB + kk] = dot;
            }
        }
    }
    float sums[VW];
    vstore(sums, vsum_each(dots) * scale);
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r) memcpy(scores + (h * R + r) * S + j0, sums + r * KB, KB * sizeof(float));
}

/* scores_group over keys [j, j1) while KB of them remain: returns the first key left over. */
SIMD_INLINE int64_t scores_groups(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S,
                                  float scale, float *scores, int64_t j, int64_t j1, int64_t ahead_end,
                                  const int NV, const int RT, const int pairs) {
    const int KB = VW / RT;
    const int64_t key_bytes = Hkv * VW * NV * (bf16 ? 2 : 4);
    for (; j + KB <= j1; j += KB) {
        const int near = j + 3 * KB <= j1, far = j + L2_AHEAD + KB <= ahead_end;
        for (int64_t h = 0; h < Hkv; ++h) {  /* each head's work after a slice of the prefetches */
            if (near) prefetch_slice((const char *)k + (j + 2 * KB) * key_bytes, KB * key_bytes, h, Hkv, 0);
            if (far) prefetch_slice((const char *)k + (j + L2_AHEAD) * key_bytes, KB * key_bytes, h, Hkv, 1);
            scores_group(q, Hkv, R, k, bf16, S, scale, scores, j, h, NV, RT, KB, pairs);
        }
    }
    return j;
}

/* The group kernels for D = VW NV: one call per row count, each compiled with its constants. */
SIMD_INLINE int64_t scores_by_rows(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S,
                                   float scale, float *scores, int64_t j, int64_t j1, int64_t ahead_end, const int NV,
                                   const int pairs) {
    switch (R) {
        case 1: return scores_groups(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, NV, 1, pairs);
        case 2: return scores_groups(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, NV, 2, pairs);
        case 3: return scores_groups(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, NV, 3, pairs);
        case 4: return scores_groups(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, NV, 4, pairs);
        default: return j;
    }
}

/* Scores of every head and row against one key j (any D a multiple of VW). */
static void scores_1(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int bf16, int64_t S,
                     float scale, float *scores, int64_t j) {
    for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = (j * Hkv + h) * D;
        const float *qh = q + h * R * D;
        for (int64_t r = 0; r < R; ++r) {
            vfloat acc = vzero();
            for (int64_t c = 0; c < D; c += VW) acc = vfma(vload(qh + r * D + c), load_any(k, bf16, row + c), acc);
            scores[(h * R + r) * S + j] = scale * vsum(acc);
        }
    }
}

/* scores_block over the whole VW-key blocks of [j, j1): returns the first key left over. */
SIMD_INLINE int64_t scores_blocks(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S,
                                  float scale, float *scores, int64_t j, int64_t j1, int64_t ahead_end, const int NV,
                                  const int pairs) {
    const int64_t key_bytes = Hkv * VW * NV * (bf16 ? 2 : 4);
    float kw[VW * VW * NV] __attribute__((aligned(64))); /* a block's keys widened (scores_block) */
    for (; j + VW <= j1; j += VW) {
        /* the cache lines of the block after this one (into L1) and of L2_AHEAD keys on (into L2),
         * a slice before each head's work */
        const int near = j + 2 * VW <= j1, far = j + L2_AHEAD + VW <= ahead_end;
        for (int64_t h = 0; h < Hkv; ++h) {
            if (near) prefetch_slice((const char *)k + (j + VW) * key_bytes, VW * key_bytes, h, Hkv, 0);
            if (far) prefetch_slice((const char *)k + (j + L2_AHEAD) * key_bytes, VW * key_bytes, h, Hkv, 1);
            scores_block(q, Hkv, R, k, bf16, S, scale, scores, j, h, kw, NV, pairs);
        }
    }
    return j;
}

/* scores_blocks for D = 64 or 128, compiled apart from scores_range (not inlined): inlined there,
 * its widening buffer and loops made GCC 12 compile scores_range's grouped path (avx2, R <= 4)
 * to code that took 1.2-1.4x the time (C harness over SmolLM2's 30 caches at 32K keys). */
static __attribute__((noinline)) int64_t scores_blocks_d(const float *q, int64_t Hkv, int64_t R, int64_t D,
                                                         const void *k, int bf16, int64_t S, float scale, float *scores,
                                                         int64_t j, int64_t j1, int64_t ahead_end, int pairs) {
    if (pairs && D == 64) return scores_blocks(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 64 / VW, 1);
    if (pairs) return scores_blocks(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 128 / VW, 1);
    if (D == 64) return scores_blocks(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 64 / VW, 0);
    return scores_blocks(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 128 / VW, 0);
}

/* Scores of keys [j, j1) for D = VW NV, VW keys at a time: on avx2 the grouped kernel for up to 4
 * rows per KV head, then the per-row one for the rest. NV and pairs are constants at each call, so
 * each of scores_range's four calls compiles to its own unrolled loops. Returns the first key left
 * over (fewer than VW). */
SIMD_INLINE int64_t scores_wide(const float *q, int64_t Hkv, int64_t R, const void *k, int bf16, int64_t S,
                                float scale, float *scores, int64_t j, int64_t j1, int64_t ahead_end, const int NV,
                                const int pairs) {
    /* The grouped kernel stops where the per-row one would (a whole number of VW-key blocks), so
     * that the keys left for scores_1 are the same whatever R: a row's scores are the same bits
     * alone or in a batch (the two kernels sum each dot product in the same order). */
    if (GROUPED_SCORES && R <= 4)
        j = scores_by_rows(q, Hkv, R, k, bf16, S, scale, scores, j, j + (j1 - j) / VW * VW, ahead_end, NV, pairs);
    return scores_blocks_d(q, Hkv, R, VW * NV, k, bf16, S, scale, scores, j, j1, ahead_end, pairs);
}

/* The split q of scores_range's pair path lives on the stack up to Hkv R D = 8192 floats (8 KV
 * heads x 8 rows x 128), on the heap above: every number of rows takes the same path, so that a
 * row's scores do not depend on how many rows share the call. */
#define PAIRS_MAX_Q 8192

void scores_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int bf16, int64_t S, float scale,
                  float *scores, int64_t j0, int64_t j1, int64_t ahead_end) {
    int64_t j = j0;
    if (D == 64 || D == 128) {  /* the common head widths: VW keys at a time */
        float on_stack[PAIRS_MAX_Q], *on_heap = NULL, *qs = on_stack;
        if (widen_in_pairs(bf16, D) && Hkv * R * D > PAIRS_MAX_Q)
            qs = on_heap = (float *)malloc((size_t)(Hkv * R * D) * sizeof(float));
        const int pairs = widen_in_pairs(bf16, D) && qs != NULL; /* out of memory: in-order widening */
        if (pairs) split_pairs(q, Hkv * R, D, qs);
        if (pairs && D == 64) j = scores_wide(qs, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 64 / VW, 1);
        else if (pairs) j = scores_wide(qs, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 128 / VW, 1);
        else if (D == 64) j = scores_wide(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 64 / VW, 0);
        else j = scores_wide(q, Hkv, R, k, bf16, S, scale, scores, j, j1, ahead_end, 128 / VW, 0);
        free(on_heap);
    }
    const int64_t key_bytes = Hkv * D * (bf16 ? 2 : 4);
    const int64_t ahead = (PREFETCH_BYTES + key_bytes - 1) / key_bytes; /* in keys */
    for (; j < j1; ++j) {
        if (j + ahead < j1) prefetch_span((const char *)k + (j + ahead) * key_bytes, key_bytes);
        scores_1(q, Hkv, R, D, k, bf16, S, scale, scores, j);
    }
}

#define PV_BLOCK 32                   /* keys whose V rows are read once for all heads before moving on */
#define PV_ROWS 4                     /* query rows of a register tile */
#define PV_VECS (VREGS / 2 / PV_ROWS) /* vectors of D per tile row: the tile takes half the registers */

/* acc rows [r0, r0 + RT) of head h, elements [c0, c0 + NC VW) of D, += p . v over keys [j0, j1),
 * the RT x NC accumulators in registers (RT, NC constants: the loops unroll). */
SIMD_INLINE void pv_tile(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D,
                         float *acc, int64_t j0, int64_t j1, int64_t h, int64_t r0, int64_t c0, const int RT,
                         const int NC, const int pairs) {
    vfloat a[PV_ROWS][PV_VECS > 0 ? PV_VECS : 1];
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) a[r][c] = vload(acc + (h * R + r0 + r) * D + c0 + VW * c);
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t row = (j * Hkv + h) * D + c0;
        vfloat w[PV_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < RT; ++r) w[r] = vset1(p[(h * R + r0 + r) * S + j]);
        if (pairs) {  /* acc holds each run of 2 VW elements split: even, then odd (see split_pairs) */
#pragma GCC unroll 8
            for (int c = 0; c < NC; c += 2) {
                vfloat v_even, v_odd;
                vload_bf16_pairs((const uint16_t *)v + row + VW * c, &v_even, &v_odd);
#pragma GCC unroll 4
                for (int r = 0; r < RT; ++r) {
                    a[r][c] = vfma(w[r], v_even, a[r][c]);
                    a[r][c + 1] = vfma(w[r], v_odd, a[r][c + 1]);
                }
            }
            continue;
        }
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            const vfloat vv = load_any(v, bf16, row + VW * c);
#pragma GCC unroll 4
            for (int r = 0; r < RT; ++r) a[r][c] = vfma(w[r], vv, a[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) vstore(acc + (h * R + r0 + r) * D + c0 + VW * c, a[r][c]);
}

/* One tile of `rows` (1 .. PV_ROWS) rows over all of D, NC vectors at a time (pairs: NC even, bf16
 * rows widened in pairs). */
SIMD_INLINE void pv_rows(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D,
                         float *acc, int64_t j0, int64_t j1, int64_t h, int64_t r0, int64_t rows, const int NC,
                         const int pairs) {
    for (int64_t c0 = 0; c0 < D; c0 += VW * NC) {
        switch (rows) {  /* constant tile heights, so each case compiles to registers */
            case 1: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, c0, 1, NC, pairs); break;
            case 2: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, c0, 2, NC, pairs); break;
            case 3: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, c0, 3, NC, pairs); break;
            default: pv_tile(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, c0, PV_ROWS, NC, pairs);
        }
    }
}

/* acc of heads h0 .. h1 - 1's rows += p . v over keys [j0, j1): register tiles of PV_ROWS rows by
 * PV_VECS vectors (one vector wide where D / VW is not a multiple of PV_VECS; two, widened in
 * pairs, for bf16 rows: see widen_in_pairs). */
static void pv_heads(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D, float *acc,
                     int64_t j0, int64_t j1, int64_t h0, int64_t h1) {
    const int wide = (D / VW) % PV_VECS == 0, pairs = widen_in_pairs(bf16, D);
    for (int64_t h = h0; h < h1; ++h)
        for (int64_t r0 = 0; r0 < R; r0 += PV_ROWS) {
            const int64_t rows = R - r0 < PV_ROWS ? R - r0 : PV_ROWS;
            if (pairs && wide) pv_rows(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, rows, PV_VECS, 1);
            else if (pairs) pv_rows(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, rows, 2, 1);
            else if (wide) pv_rows(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, rows, PV_VECS, 0);
            else pv_rows(p, Hkv, R, S, v, bf16, D, acc, j0, j1, h, r0, rows, 1, 0);
        }
}

/* The cache holds a key's heads side by side, so V is walked in blocks of PV_BLOCK keys, every
 * head of a block before the next block: each cache line comes from memory once, in order (one
 * pass per head over the whole range ran at half the memory's speed). */
void pv_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const void *v, int bf16, int64_t D, float *acc,
              int64_t j0, int64_t j1, int64_t ahead_end) {
    const int64_t key_bytes = Hkv * D * (bf16 ? 2 : 4);
    /* More rows than one register tile: each tile would widen the bf16 block again, so it is
     * widened once per head into float32 (in L1) and the float32 tiles read that. Each output
     * element sums the same products in the same order either way: the same bits. */
    const int widen_once = bf16 && R > PV_ROWS;
    float tile[widen_once ? PV_BLOCK * MAX_D : 1] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)(Hkv * R * D) * sizeof(float));
    for (int64_t j = j0; j < j1; j += PV_BLOCK) {
        const int64_t end = j + PV_BLOCK < j1 ? j + PV_BLOCK : j1;
        const int near = end + PV_BLOCK <= j1, far = j + L2_AHEAD + PV_BLOCK <= ahead_end;
        for (int64_t h = 0; h < Hkv; ++h) {  /* each head's work after a slice of the prefetches */
            if (near) prefetch_slice((const char *)v + end * key_bytes, PV_BLOCK * key_bytes, h, Hkv, 0);
            if (far) prefetch_slice((const char *)v + (j + L2_AHEAD) * key_bytes, PV_BLOCK * key_bytes, h, Hkv, 1);
            if (widen_once) {
                widen_bf16_rows((const uint16_t *)v, Hkv * D, D, h, j, end - j, D, tile);
                pv_heads(p + h * R * S + j, 1, R, S, tile, 0, D, acc + h * R * D, 0, end - j, 0, 1);
            } else {
                pv_heads(p, Hkv, R, S, v, bf16, D, acc, j, end, h, h + 1);
            }
        }
    }
    if (widen_in_pairs(bf16, D) && !widen_once) join_pairs(acc, Hkv * R, D);
}

/* Split keys evenly over the threads: thread t of n takes [S*t/n, S*(t+1)/n). */
static inline int64_t split(int64_t S, int t, int n) { return S * t / n; }

int ringctx_decode_scores(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, int k_bf16, int64_t S,
                          float scale, float *scores, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R > MAX_R) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        scores_range(q, Hkv, R, D, k, k_bf16, S, scale, scores, split(S, t, n), split(S, t + 1, n), split(S, t + 1, n));
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
        if (q8_kind < 0) pv_range(p, Hkv, R, S, v, v_bf16, D, mine, split(S, t, n), split(S, t + 1, n), split(S, t + 1, n));
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
 * registers (load_q8) and the scales are applied once per key: to the dot products of a block
 * of keys at once (scores), and to the weight p of each key (PV). fp8 data is widened to its
 * value / FP8_FOLD (exact), so FP8_FOLD is folded into those scales.
 *
 * Widening is not free: int8 -> float32 is a conversion on the floating-point ports (bf16 is an
 * integer shift), fp8 four instructions. Where the bf16 kernel re-reads each key for each query
 * row, the scores here take up to four rows of a KV head at a time against a few keys (VW dot
 * products, one reduction), so a key row is widened once per four rows, in registers. Widening 16
 * keys into a float32 tile in L1 for the rows to read instead took 1.4x (int8) and 1.15x (fp8)
 * the time at 3 rows per KV head (SmolLM2's GQA group), data in cache (AVX-512).
 * ------------------------------------------------------------------------------------------ */


/* Scores of rows [r0, r0 + RT) of head h against the KB keys from jb, RT * KB <= VW dot products
 * reduced together: lane r * KB + kk of the sum is row r0 + r against key jb + kk; sc[kk] is that
 * key's scale. RT, KB, NV and KIND are constants, so the loops unroll and the dot products stay in
 * registers; each key vector is widened once for the RT rows. */
SIMD_INLINE void scores_q8_tile(const float *q, int64_t Hkv, int64_t R, const int8_t *k, const float *sc, int64_t S,
                                float *scores, int64_t jb, int64_t h, int64_t r0, const int RT, const int KB,
                                const int NV, const int KIND) {
    const int64_t D = VW * NV;
    vfloat dots[VW];
#pragma GCC unroll 16
    for (int i = 0; i < VW; ++i) dots[i] = vzero();
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
        vfloat qc[4];
#pragma GCC unroll 4
        for (int r = 0; r < RT; ++r) qc[r] = vload(q + (h * R + r0 + r) * D + VW * c);
#pragma GCC unroll 16
        for (int kk = 0; kk < KB; ++kk) {
            const vfloat kv = load_q8(k, KIND, ((jb + kk) * Hkv + h) * D + VW * c);
#pragma GCC unroll 4
            for (int r = 0; r < RT; ++r) dots[r * KB + kk] = vfma(qc[r], kv, dots[r * KB + kk]);
        }
    }
    vfloat scale_lanes;
#pragma GCC unroll 16
    for (int i = 0; i < VW; ++i) scale_lanes[i] = sc[i % KB];
    float sums[VW];
    vstore(sums, vsum_each(dots) * scale_lanes);
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r) memcpy(scores + (h * R + r0 + r) * S + jb, sums + r * KB, KB * sizeof(float));
}

/* Scores of head h's R rows against the VW keys j0 .. j0 + VW - 1 (NV = D / VW and KIND constants). */
SIMD_INLINE void scores_q8_block(const float *q, int64_t Hkv, int64_t R, const int8_t *k, const float *ks, int64_t S,
                                 float mul, float *scores, int64_t j0, int64_t h, const int NV, const int KIND) {
    float sc[VW];
    for (int i = 0; i < VW; ++i) sc[i] = mul * ks[(j0 + i) * Hkv + h];
    enum { KB = VW / 4 }; /* keys per tile of 3 or 4 rows */
    int64_t r0 = 0;
    /* Several rows: VW / 4 keys at a time (2 rows against 8 keys, filling all 16 lanes of an
     * AVX-512 vector, ran 2.5x slower with the keys coming from memory, for no reason found). */
    for (; R - r0 >= 4; r0 += 4)
        for (int off = 0; off < VW; off += KB) scores_q8_tile(q, Hkv, R, k, sc + off, S, scores, j0 + off, h, r0, 4, KB, NV, KIND);
    switch (R - r0) {
        case 3:
            for (int off = 0; off < VW; off += KB) scores_q8_tile(q, Hkv, R, k, sc + off, S, scores, j0 + off, h, r0, 3, KB, NV, KIND);
            break;
        case 2:
            for (int off = 0; off < VW; off += KB) scores_q8_tile(q, Hkv, R, k, sc + off, S, scores, j0 + off, h, r0, 2, KB, NV, KIND);
            break;
        case 1: scores_q8_tile(q, Hkv, R, k, sc, S, scores, j0, h, r0, 1, VW, NV, KIND); break;
        default: break;
    }
}

/* Scores of every head and row against one key j (any D a multiple of VW). */
SIMD_INLINE void scores_q8_1(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k, const float *ks,
                             int64_t S, float mul, float *scores, int64_t j, const int KIND) {
    for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row = (j * Hkv + h) * D;
        const float *qh = q + h * R * D;
        const float s = mul * ks[j * Hkv + h];
        for (int64_t r = 0; r < R; ++r) {
            vfloat acc = vzero();
            for (int64_t c = 0; c < D; c += VW) acc = vfma(vload(qh + r * D + c), load_q8(k, KIND, row + c), acc);
            scores[(h * R + r) * S + j] = s * vsum(acc);
        }
    }
}

SIMD_INLINE void scores_q8_range_kind(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k,
                                      const float *ks, int64_t S, float mul, float *scores, int64_t j0, int64_t j1,
                                      const int KIND) {
    const int64_t key_bytes = Hkv * D;
    int64_t j = j0;
    if (D == 64 || D == 128) {  /* the common head widths: VW keys at a time */
        for (; j + VW <= j1; j += VW) {
            const int near = j + 2 * VW <= j1;  /* the next block's codes and scales, a slice a head */
            for (int64_t h = 0; h < Hkv; ++h) {
                if (near) {
                    prefetch_slice((const char *)(k + (j + VW) * key_bytes), VW * key_bytes, h, Hkv, 0);
                    prefetch_slice((const char *)(ks + (j + VW) * Hkv), VW * Hkv * (int64_t)sizeof(float), h, Hkv, 0);
                }
                if (D == 64) scores_q8_block(q, Hkv, R, k, ks, S, mul, scores, j, h, 64 / VW, KIND);
                else scores_q8_block(q, Hkv, R, k, ks, S, mul, scores, j, h, 128 / VW, KIND);
            }
        }
    }
    const int64_t ahead = (PREFETCH_BYTES + key_bytes - 1) / key_bytes;
    for (; j < j1; ++j) {
        if (j + ahead < j1) prefetch_span((const char *)(k + (j + ahead) * key_bytes), key_bytes);
        scores_q8_1(q, Hkv, R, D, k, ks, S, mul, scores, j, KIND);
    }
}

void scores_q8_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k, const float *ks, int kind,
                     int64_t S, float scale, float *scores, int64_t j0, int64_t j1) {
    if (kind == Q8_INT8) scores_q8_range_kind(q, Hkv, R, D, k, ks, S, scale, scores, j0, j1, Q8_INT8);
    else scores_q8_range_kind(q, Hkv, R, D, k, ks, S, scale * FP8_FOLD, scores, j0, j1, Q8_FP8);
}

/* acc rows [r0, r0 + RT) of head h, elements [c0, c0 + NC VW), += p * v_scale * v over keys
 * [j0, j1), in registers (RT, NC and KIND constants). */
SIMD_INLINE void pv_q8_tile(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                            float mul, int64_t D, float *acc, int64_t j0, int64_t j1, int64_t h, int64_t r0,
                            int64_t c0, const int RT, const int NC, const int KIND) {
    vfloat a[PV_ROWS][PV_VECS > 0 ? PV_VECS : 1];
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) a[r][c] = vload(acc + (h * R + r0 + r) * D + c0 + VW * c);
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t row = (j * Hkv + h) * D + c0;
        /* the scale times V, then p times that: the rounding of pv_q8_heads' tile path, so that a
         * row's output is the same bits whichever path its number of rows takes */
        const vfloat s = vset1(mul * vs[j * Hkv + h]);
        vfloat w[PV_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < RT; ++r) w[r] = vset1(p[(h * R + r0 + r) * S + j]);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
            const vfloat vv = s * load_q8(v, KIND, row + VW * c);
#pragma GCC unroll 4
            for (int r = 0; r < RT; ++r) a[r][c] = vfma(w[r], vv, a[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) vstore(acc + (h * R + r0 + r) * D + c0 + VW * c, a[r][c]);
}

SIMD_INLINE void pv_q8_heads(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs,
                             float mul, int64_t D, float *acc, int64_t j0, int64_t j1, int64_t h0, int64_t h1,
                             const int KIND) {
    /* When the rows and D fit one register tile (SmolLM2's 3 rows at D 64 on AVX-512), each V
     * vector is widened once, in registers. Otherwise every tile would widen the block again
     * (int8's conversion shares the floating-point ports with the products), so the block is
     * widened once into float32 in L1, scales applied, and the float32 kernel reads that: 1.5x
     * faster at 8 rows per KV head, D 128 (32K keys, 8 KV heads; AVX-512). The block is PV_BLOCK
     * x D floats, 16 KB at D 128. */
    if (!(R <= PV_ROWS && D == VW * PV_VECS)) {
        float tile[PV_BLOCK * MAX_D] __attribute__((aligned(64)));
        for (int64_t h = h0; h < h1; ++h) {
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t row = (j * Hkv + h) * D;
                const vfloat sv = vset1(mul * vs[j * Hkv + h]);
                for (int64_t c = 0; c < D; c += VW) vstore(tile + (j - j0) * D + c, sv * load_q8(v, KIND, row + c));
            }
            /* the float32 kernel on the tile: one head, keys 0 .. j1 - j0 */
            pv_heads(p + h * R * S + j0, 1, R, S, tile, 0, D, acc + h * R * D, 0, j1 - j0, 0, 1);
        }
        return;
    }
    for (int64_t h = h0; h < h1; ++h) {
        switch (R) {
            case 1: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, 0, 0, 1, PV_VECS, KIND); break;
            case 2: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, 0, 0, 2, PV_VECS, KIND); break;
            case 3: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, 0, 0, 3, PV_VECS, KIND); break;
            default: pv_q8_tile(p, Hkv, R, S, v, vs, mul, D, acc, j0, j1, h, 0, 0, PV_ROWS, PV_VECS, KIND);
        }
    }
}

/* Blocks of PV_BLOCK keys, every head of a block before the next (as pv_range). */
void pv_q8_range(const float *p, int64_t Hkv, int64_t R, int64_t S, const int8_t *v, const float *vs, int kind,
                 int64_t D, float *acc, int64_t j0, int64_t j1) {
    const int64_t key_bytes = Hkv * D;
    memset(acc, 0, (size_t)(Hkv * R * D) * sizeof(float));
    for (int64_t j = j0; j < j1; j += PV_BLOCK) {
        const int64_t end = j + PV_BLOCK < j1 ? j + PV_BLOCK : j1;
        const int near = end + PV_BLOCK <= j1;  /* the next block's codes and scales, a slice a head */
        for (int64_t h = 0; h < Hkv; ++h) {
            if (near) {
                prefetch_slice((const char *)(v + end * key_bytes), PV_BLOCK * key_bytes, h, Hkv, 0);
                prefetch_slice((const char *)(vs + end * Hkv), PV_BLOCK * Hkv * (int64_t)sizeof(float), h, Hkv, 0);
            }
            if (kind == Q8_INT8) pv_q8_heads(p, Hkv, R, S, v, vs, 1.0f, D, acc, j, end, h, h + 1, Q8_INT8);
            else pv_q8_heads(p, Hkv, R, S, v, vs, FP8_FOLD, D, acc, j, end, h, h + 1, Q8_FP8);
        }
    }
}

int ringctx_decode_scores_q8(const float *q, int64_t Hkv, int64_t R, int64_t D, const int8_t *k, const float *k_scale,
                             int kind, int64_t S, float scale, float *scores, int threads) {
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

/* ------------------------------------------------------------------------------------------
 * Decode attention in one pass: R query rows per KV head (a GQA group times B query tokens: the
 * questions about one document decoded together) against a token-major cache, in the model dtype
 * (float32, bf16) or 8-bit with scales, returning the normalised output and the log-sum-exp.
 *
 *   out[h, r] = sum_j softmax_j(scale q[h, r] . k[j, h]) v[j, h]      out: [Hkv, R, D] float32
 *   lse[h, r] = log sum_j exp(scale q[h, r] . k[j, h])                 lse: [Hkv, R] float32
 *
 * Why one pass: the two-pass kernels above write R x S scores out and read them back, and the
 * softmax between them ran as PyTorch ops over [Hkv, R, S]; at 8 questions of SmolLM2 (R = 24) and
 * 32K keys those scores are 9 MB a layer, more than an fp8 cache's K and V together. Here the keys
 * go through in tiles small enough that a tile's scores stay in L1/L2: scores of every row of every
 * head against the tile (each K row read from memory once for all R rows), an online-softmax
 * update per row, then P V over the tile (each V row read once for all R rows). The keys are split
 * over the threads; each keeps its running (max, sum, output) per row, and the partials are
 * merged by log-sum-exp in thread order (the same bits every run).
 * ------------------------------------------------------------------------------------------ */

/* Keys per tile: ATTEND_MAX_TILE whatever the number of rows, so that a row's sums run over the
 * same tiles in the same order whether it is decoded alone or in a batch (its output is the same
 * bits: continuous batching never changes an answer). A tile's scores, rows x 256 floats, stay in
 * L2 (27 KB for SmolLM2's 9 heads, 150 KB at 16 questions). */
int64_t attend_tile_keys(int64_t rows) {
    (void)rows;
    return ATTEND_MAX_TILE;
}

int64_t attend_range_floats(int64_t Hkv, int64_t R, int64_t D) {
    const int64_t rows = Hkv * R;
    return rows + rows * D + rows * attend_tile_keys(rows); /* alpha, tile output, tile scores */
}

void attend_range(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, const void *v, int bf16, int q8,
                  const float *ks, const float *vs, float scale, float softcap, int64_t j0, int64_t j1, float *m,
                  float *l, float *acc, float *buf) {
    const int64_t rows = Hkv * R, tile = attend_tile_keys(rows);
    const int64_t row_bytes = Hkv * D * (q8 >= 0 ? 1 : bf16 ? 2 : 4);
    float *alpha = buf, *tile_out = alpha + rows, *scores = tile_out + rows * D;
    for (int64_t r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    memset(acc, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t t0 = j0; t0 < j1; t0 += tile) {
        const int64_t n = j1 - t0 < tile ? j1 - t0 : tile;
        const char *k_tile = (const char *)k + t0 * row_bytes, *v_tile = (const char *)v + t0 * row_bytes;
        if (q8 >= 0)
            scores_q8_range(q, Hkv, R, D, (const int8_t *)k_tile, ks + t0 * Hkv, q8, tile, scale, scores, 0, n);
        else
            scores_range(q, Hkv, R, D, k_tile, bf16, tile, scale, scores, 0, n, j1 - t0);
        if (softcap > 0.0f) {  /* soft-capped scores (Gemma 2 style): s = softcap tanh(s / softcap) */
            const vfloat cap = vset1(softcap), inv = vset1(1.0f / softcap);
            for (int64_t r = 0; r < rows; ++r) {
                float *sr = scores + r * tile;
                int64_t j = 0;
                for (; j + VW <= n; j += VW) vstore(sr + j, cap * vtanh(vload(sr + j) * inv));
                for (; j < n; ++j) sr[j] = (cap * vtanh(vset1(sr[j]) * inv))[0];
            }
        }
        for (int64_t r = 0; r < rows; ++r) {  /* online softmax: p = e^(s - m_new) in place */
            float *sr = scores + r * tile;
            vfloat vmaxes = vset1(-INFINITY);
            int64_t j = 0;
            for (; j + VW <= n; j += VW) vmaxes = vmax(vmaxes, vload(sr + j));
            float tile_max = vhmax(vmaxes);
            for (; j < n; ++j) tile_max = sr[j] > tile_max ? sr[j] : tile_max;
            const float m_new = m[r] > tile_max ? m[r] : tile_max;
            alpha[r] = m[r] == -INFINITY ? 0.0f : vexp(vset1(m[r] - m_new))[0];
            vfloat vsums = vzero();
            for (j = 0; j + VW <= n; j += VW) {
                const vfloat p = vexp(vload(sr + j) - m_new);
                vstore(sr + j, p);
                vsums += p;
            }
            float tail_sum = 0.0f;
            for (; j < n; ++j) {
                sr[j] = vexp(vset1(sr[j] - m_new))[0];
                tail_sum += sr[j];
            }
            l[r] = l[r] * alpha[r] + (vsum(vsums) + tail_sum);
            m[r] = m_new;
        }
        if (q8 >= 0)
            pv_q8_range(scores, Hkv, R, tile, (const int8_t *)v_tile, vs + t0 * Hkv, q8, D, tile_out, 0, n);
        else
            pv_range(scores, Hkv, R, tile, v_tile, bf16, D, tile_out, 0, n, j1 - t0);
        for (int64_t r = 0; r < rows; ++r) {
            const vfloat a = vset1(alpha[r]);
            for (int64_t c = 0; c < D; c += VW)
                vstore(acc + r * D + c, vfma(vload(acc + r * D + c), a, vload(tile_out + r * D + c)));
        }
    }
}

/* Keys per thread below which fewer threads take the range: a thread's share should outweigh
 * starting it and merging its partial. */
#define MIN_KEYS_PER_THREAD 128

int ringctx_decode_attention(const float *q, int64_t Hkv, int64_t R, int64_t D, const void *k, const void *v,
                             int bf16, const float *k_scale, const float *v_scale, int q8, int64_t S, float scale,
                             float *out, float *lse, int threads) {
    if (!ringctx_cpu_kernels_supported() || D % 16 || D > MAX_D || R < 1 || R > MAX_R || Hkv < 1 ||
        (q8 != -1 && q8 != Q8_INT8 && q8 != Q8_FP8) || (S > 0 && q8 >= 0 && (k_scale == NULL || v_scale == NULL)))
        return -1; /* (an empty tensor's data pointer may be NULL) */
    const int64_t rows = Hkv * R;
    if (S <= 0) {  /* no key: out 0, lse -inf */
        memset(out, 0, (size_t)(rows * D) * sizeof(float));
        for (int64_t r = 0; r < rows; ++r) lse[r] = -INFINITY;
        return 0;
    }
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    if (S / MIN_KEYS_PER_THREAD < threads) threads = S / MIN_KEYS_PER_THREAD > 1 ? (int)(S / MIN_KEYS_PER_THREAD) : 1;
    /* per thread: m [rows], l [rows], acc [rows D], then attend_range's buffer */
    const int64_t per_thread = 2 * rows + rows * D + attend_range_floats(Hkv, R, D);
    /* Kept from call to call (per calling thread): a fresh buffer of this size (~100 KB a thread
     * at SmolLM2's shape) comes from mmap, and faulting its pages in took a noticeable share of a
     * call that reads a few MB. */
    static __thread float *kept = NULL;
    static __thread int64_t kept_floats = 0;
    if (threads * per_thread > kept_floats) {
        free(kept);
        kept = (float *)malloc((size_t)(threads * per_thread) * sizeof(float));
        kept_floats = kept == NULL ? 0 : threads * per_thread;
        if (kept == NULL) return -2;
    }
    float *const work = kept; /* not the thread-local itself: the OpenMP threads each have their own */
    int used = threads;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
        used = nt;
        float *mine = work + t * per_thread;
        attend_range(q, Hkv, R, D, k, v, bf16, q8, k_scale, v_scale, scale, 0.0f, split(S, t, nt), split(S, t + 1, nt), mine,
                     mine + rows, mine + 2 * rows, mine + 2 * rows + rows * D);
    }
    /* merge the threads' partials by log-sum-exp, in thread order */
    for (int64_t r = 0; r < rows; ++r) {
        float top = -INFINITY;
        for (int t = 0; t < used; ++t) top = work[t * per_thread + r] > top ? work[t * per_thread + r] : top;
        float total = 0.0f, weight[256];
        for (int t = 0; t < used; ++t) {
            const float mt = work[t * per_thread + r];
            weight[t] = mt == -INFINITY ? 0.0f : vexp(vset1(mt - top))[0];
            total += work[t * per_thread + rows + r] * weight[t];
        }
        lse[r] = total > 0.0f ? top + logf(total) : -INFINITY;
        const vfloat divisor = vset1(total > 0.0f ? total : 1.0f); /* a row with no key keeps its zeros */
        for (int64_t c = 0; c < D; c += VW) {
            vfloat sum = vzero();
            for (int t = 0; t < used; ++t)
                sum = vfma(vload(work + t * per_thread + 2 * rows + r * D + c), vset1(weight[t]), sum);
            vstore(out + r * D + c, sum / divisor);
        }
    }
    return 0;
}
