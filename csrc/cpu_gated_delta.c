/* The gated delta rule (Gated DeltaNet layers: ringctx/attention/gated_delta.py) token by token, in
 * float32: the decode step of B sequences at once, and the recurrence over a piece of T tokens.
 *
 * For each sequence b and head h a state S [Dk, Dv] runs over the tokens t:
 *
 *   S     = exp(g_t) S                        decay
 *   read  = S^T k_t                            [Dv]: what the state holds at key k_t
 *   S    += k_t (beta_t (v_t - read))^T        write back the correction
 *   o_t   = S^T q_t                            [Dv]
 *
 * Why a kernel: a decode step reads and writes every state once (Hv Dk Dv 4 bytes a layer and a
 * sequence: 3 MiB at Qwen3.5-27B's 48 x 128 x 128), so it should take the time the memory takes to
 * move those bytes; PyTorch's token loop makes four passes over S (scale, read, add, read again),
 * each a separate op over all heads, with its temporaries.
 *
 * Column v of S evolves alone: read[v], and so the correction at v, depend on column v only. So
 * the state is cut into strips of STRIP_VECS vectors of columns, and each strip runs every token by
 * itself: one sweep over the strip's Dk rows sums read, a second decays, writes and sums the output
 * from the rows just loaded, its sums in registers (the rows alternate between two sets, even and
 * odd, added at the end). The strip, Dk x STRIP floats (16-32 KiB at Dk 128), stays in L1 between
 * the sweeps and across the tokens of a piece, so each state element comes from memory once and
 * goes back once per call, whatever T. The work items, (sequence, head, strip), are independent
 * and shared among the threads.
 *
 * A decode step (T = 1) also asks, during each strip's second sweep, for the same columns of the
 * next head's rows into L2: the second sweep runs from L1 while they arrive, and the next item
 * starts with its rows at hand. Measured against an in-place pass over the same states (PyTorch's
 * mul_, each byte read and written once), Qwen3.5's 48 heads of 128 x 128 over 48 layers' states
 * (AMD EPYC, avx512 and avx2 builds): 1.2-1.5x its time with the prefetch, 1.6-2.3x without; a
 * variant streaming whole rows with its sums in L1 buffers (1.4-1.8x), and one reading the next
 * head while writing this one, were no faster, and slower when the state is in cache (its sums
 * go through memory).
 *
 * read is formed as exp(g) (S_old^T k) (the decay factored out of the sum), otherwise every
 * product is the reference's, in float32 with FMA where the variant has it: within a few float32
 * roundings of the float64 reference (tests/attention/test_gated_delta_kernel.py).
 */
#include <math.h>
#include <omp.h>

#include "cpu_kernels.h"

/* Vectors of columns in a strip: the strip's sums (read and the output, two sets each, and the
 * correction) stay in registers, its Dk x STRIP floats in L1 (16 KiB at Dk 128 on AVX2, 32 KiB on
 * AVX-512, 8 KiB portable). */
#define STRIP_VECS 4
#define STRIP (STRIP_VECS * VW)

/* min(n, VW) floats from p (lanes past n read as 0), and the first min(n, VW) lanes of x to p:
 * a strip's last, partial vector (Dv not a multiple of VW). */
SIMD_INLINE vfloat vload_n(const float *p, int64_t n) { return load_any_n(p, 0, 0, n); }
SIMD_INLINE void vstore_n(float *p, vfloat x, int64_t n) { store_any_n(p, 0, 0, x, n); }

/* Columns [c0, c0 + width) of one head's state S [Dk, Dv] over T tokens (width <= STRIP; `full`:
 * width == STRIP, a compile-time constant in each caller so that the full strips' loads have no
 * tail test). Token t's q, k at q + t qs, k + t qs [Dk]; its v and output at v + t vs, o + t vs
 * [Dv]; its g, beta at g[t gs], beta[t gs]. ahead: where the caller's next strip starts (the
 * same columns of the next head), asked into L2 during the second sweep; NULL: nothing. */
SIMD_INLINE void strip_tokens(float *S, int64_t Dk, int64_t Dv, int64_t c0, int64_t width, const float *q,
                              const float *k, int64_t qs, const float *v, float *o, int64_t vs, const float *g,
                              const float *beta, int64_t gs, int64_t T, const float *ahead, const int full) {
    for (int64_t t = 0; t < T; ++t) {
        const float *qt = q + t * qs, *kt = k + t * qs;
        /* read = S_old^T k: rows alternate between two sets of sums, so that 2 STRIP_VECS FMA
         * chains are in flight (T > 1 is compute-bound, the strip in L1) */
        vfloat r0[STRIP_VECS], r1[STRIP_VECS];
        for (int j = 0; j < STRIP_VECS; ++j) r0[j] = r1[j] = vzero();
        int64_t i = 0;
        for (; i + 1 < Dk; i += 2) {
            const float *row0 = S + i * Dv + c0, *row1 = row0 + Dv;
            const vfloat k0 = vset1(kt[i]), k1 = vset1(kt[i + 1]);
            for (int j = 0; j < STRIP_VECS; ++j) {
                if (full) {
                    r0[j] = vfma(k0, vload(row0 + j * VW), r0[j]);
                    r1[j] = vfma(k1, vload(row1 + j * VW), r1[j]);
                } else if (j * VW < width) {
                    r0[j] = vfma(k0, vload_n(row0 + j * VW, width - j * VW), r0[j]);
                    r1[j] = vfma(k1, vload_n(row1 + j * VW, width - j * VW), r1[j]);
                }
            }
        }
        if (i < Dk) { /* odd Dk: the last row */
            const float *row0 = S + i * Dv + c0;
            const vfloat k0 = vset1(kt[i]);
            for (int j = 0; j < STRIP_VECS; ++j)
                if (full || j * VW < width) r0[j] = vfma(k0, vload_n(row0 + j * VW, width - j * VW), r0[j]);
        }
        /* the correction: delta = beta (v - exp(g) read) */
        const float decay = expf(g[t * gs]), b = beta[t * gs];
        const vfloat vdecay = vset1(decay), vb = vset1(b);
        const float *vt = v + t * vs;
        vfloat delta[STRIP_VECS];
        for (int j = 0; j < STRIP_VECS; ++j) {
            const vfloat vv = full ? vload(vt + c0 + j * VW) : vload_n(vt + c0 + j * VW, width - j * VW);
            delta[j] = vb * (vv - vdecay * (r0[j] + r1[j]));
        }
        /* S = exp(g) S + k delta^T, and o = S^T q from the new rows (two sets of sums again) */
        vfloat o0[STRIP_VECS], o1[STRIP_VECS];
        for (int j = 0; j < STRIP_VECS; ++j) o0[j] = o1[j] = vzero();
        for (i = 0; i + 1 < Dk; i += 2) {
            float *row0 = S + i * Dv + c0, *row1 = row0 + Dv;
            if (ahead) prefetch_span_l2((const char *)(ahead + i * Dv), 4 * width),
                       prefetch_span_l2((const char *)(ahead + (i + 1) * Dv), 4 * width);
            const vfloat k0 = vset1(kt[i]), k1 = vset1(kt[i + 1]), q0 = vset1(qt[i]), q1 = vset1(qt[i + 1]);
            for (int j = 0; j < STRIP_VECS; ++j) {
                if (full) {
                    const vfloat s0 = vfma(k0, delta[j], vdecay * vload(row0 + j * VW));
                    const vfloat s1 = vfma(k1, delta[j], vdecay * vload(row1 + j * VW));
                    vstore(row0 + j * VW, s0);
                    vstore(row1 + j * VW, s1);
                    o0[j] = vfma(q0, s0, o0[j]);
                    o1[j] = vfma(q1, s1, o1[j]);
                } else if (j * VW < width) {
                    const int64_t n = width - j * VW;
                    const vfloat s0 = vfma(k0, delta[j], vdecay * vload_n(row0 + j * VW, n));
                    const vfloat s1 = vfma(k1, delta[j], vdecay * vload_n(row1 + j * VW, n));
                    vstore_n(row0 + j * VW, s0, n);
                    vstore_n(row1 + j * VW, s1, n);
                    o0[j] = vfma(q0, s0, o0[j]);
                    o1[j] = vfma(q1, s1, o1[j]);
                }
            }
        }
        if (i < Dk) {
            float *row0 = S + i * Dv + c0;
            const vfloat k0 = vset1(kt[i]), q0 = vset1(qt[i]);
            for (int j = 0; j < STRIP_VECS; ++j)
                if (full || j * VW < width) {
                    const int64_t n = width - j * VW;
                    const vfloat s0 = vfma(k0, delta[j], vdecay * vload_n(row0 + j * VW, n));
                    vstore_n(row0 + j * VW, s0, n);
                    o0[j] = vfma(q0, s0, o0[j]);
                }
        }
        float *ot = o + t * vs;
        for (int j = 0; j < STRIP_VECS; ++j) {
            if (full) vstore(ot + c0 + j * VW, o0[j] + o1[j]);
            else if (j * VW < width) vstore_n(ot + c0 + j * VW, o0[j] + o1[j], width - j * VW);
        }
    }
}

/* The gated delta rule over T tokens of B sequences (contiguous float32):
 *   q, k [B, T, H, Dk] (q L2-normalised and scaled, k L2-normalised, as the layer gives them),
 *   v [B, T, H, Dv], g, beta [B, T, H] (g <= 0 the log decay, 0 <= beta <= 1),
 *   state [B, H, Dk, Dv], updated in place to the state after token T - 1,
 *   out [B, T, H, Dv], o_t of every token.
 * A decode step is T = 1 (B sequences); a piece's recurrence B = 1. Return 0, or -1 (this CPU
 * lacks the variant's ISA; a size below 1). Declared in cpu_kernels.h (GATED_DELTA_ARGS). */
int ringctx_gated_delta(const float *q, const float *k, const float *v, const float *g, const float *beta,
                        float *state, float *out, int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv,
                        int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    if (B < 1 || T < 1 || H < 1 || Dk < 1 || Dv < 1) return -1;
    const int64_t qs = H * Dk, vs = H * Dv; /* a token's stride in q, k and in v, out */
    const int64_t strips = (Dv + STRIP - 1) / STRIP, items = B * H * strips;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t bh = item / strips, c0 = (item % strips) * STRIP, b = bh / H, h = bh % H;
        const int64_t first = b * T * H + h; /* token 0 of sequence b, head h, in [B, T, H] units */
        float *S = state + bh * Dk * Dv;
        const float *qh = q + first * Dk, *kh = k + first * Dk, *vh = v + first * Dv;
        float *oh = out + first * Dv;
        /* a decode step asks for the next head's rows of the same columns (see the top) */
        const float *ahead = T == 1 && bh + 1 < B * H ? S + Dk * Dv + c0 : NULL;
        if (Dv - c0 >= STRIP)
            strip_tokens(S, Dk, Dv, c0, STRIP, qh, kh, qs, vh, oh, vs, g + first, beta + first, H, T, ahead, 1);
        else
            strip_tokens(S, Dk, Dv, c0, Dv - c0, qh, kh, qs, vh, oh, vs, g + first, beta + first, H, T, ahead, 0);
    }
    return 0;
}
