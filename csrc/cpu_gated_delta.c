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
 * Column v of S evolves alone: read[v], and so the correction at v, depend on column v only. A
 * token is two sweeps over the rows of S: the first sums read; the second decays, writes and sums
 * the output from the rows just written. Two loop orders, each where it measured faster (AVX2 and
 * AVX-512, AMD EPYC, 48 heads of 128 x 128):
 *
 *   one token (decode)  `head_token`: a head's whole rows in turn, the sums in small L1 buffers.
 *                       The first sweep streams the head's state from memory in address order,
 *                       the second finds it in L2 and asks for the next head's rows meanwhile:
 *                       0.80-0.94x the time of the strips below, which read rows piecemeal.
 *   T tokens (a piece)  `strip_tokens`: the state cut into strips of STRIP_VECS vectors of
 *                       columns, each strip running every token by itself with its sums in
 *                       registers and its Dk x STRIP floats (16-32 KiB at Dk 128) in L1 across
 *                       the tokens: 0.54x the time of `head_token` token after token, whose 64 KiB
 *                       head spills to L2 between sweeps.
 *
 * Either way each state element comes from memory once and goes back once per call, whatever T,
 * and the work items ((sequence, head) or (sequence, head, strip)) are independent, shared among
 * the threads. Both orders do the same float operations on each column in the same order (the
 * rows' sums alternate between two accumulators, even and odd rows, added at the end), so a piece
 * of T tokens and T decode steps give the same bits.
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
 * [Dv]; its g, beta at g[t gs], beta[t gs]. */
SIMD_INLINE void strip_tokens(float *S, int64_t Dk, int64_t Dv, int64_t c0, int64_t width, const float *q,
                              const float *k, int64_t qs, const float *v, float *o, int64_t vs, const float *g,
                              const float *beta, int64_t gs, int64_t T, const int full) {
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

/* Columns of `head_token`'s sums at a time: 5 buffers of PANEL floats (5 KiB) on the stack. */
#define PANEL 256

/* One token of one head: S [Dk, Dv] updated in place, o_t [Dv] written; q, k [Dk], v [Dv]. The
 * arithmetic of `strip_tokens` on each column (the same bits), in row order over whole rows of up
 * to PANEL columns; `next`: the state the caller's next item reads (NULL: none), asked into L2
 * during the second sweep, which runs from the cache. */
static void head_token(float *S, int64_t Dk, int64_t Dv, const float *q, const float *k, const float *v, float *o,
                       float g, float beta, const float *next) {
    float r0[PANEL] __attribute__((aligned(64))), r1[PANEL] __attribute__((aligned(64)));
    float delta[PANEL] __attribute__((aligned(64)));
    float o0[PANEL] __attribute__((aligned(64))), o1[PANEL] __attribute__((aligned(64)));
    const vfloat vdecay = vset1(expf(g)), vb = vset1(beta);
    for (int64_t c0 = 0; c0 < Dv; c0 += PANEL) {
        const int64_t w = Dv - c0 < PANEL ? Dv - c0 : PANEL;  /* lanes past w: zeros, never stored */
        for (int64_t c = 0; c < w; c += VW) vstore(r0 + c, vzero()), vstore(r1 + c, vzero());
        int64_t i = 0;
        for (; i + 1 < Dk; i += 2) {
            const float *row0 = S + i * Dv + c0, *row1 = row0 + Dv;
            const vfloat k0 = vset1(k[i]), k1 = vset1(k[i + 1]);
            for (int64_t c = 0; c < w; c += VW) {
                vstore(r0 + c, vfma(k0, vload_n(row0 + c, w - c), vload(r0 + c)));
                vstore(r1 + c, vfma(k1, vload_n(row1 + c, w - c), vload(r1 + c)));
            }
        }
        if (i < Dk) { /* odd Dk: the last row */
            const vfloat k0 = vset1(k[i]);
            for (int64_t c = 0; c < w; c += VW) vstore(r0 + c, vfma(k0, vload_n(S + i * Dv + c0 + c, w - c), vload(r0 + c)));
        }
        for (int64_t c = 0; c < w; c += VW) {
            vstore(delta + c, vb * (vload_n(v + c0 + c, w - c) - vdecay * (vload(r0 + c) + vload(r1 + c))));
            vstore(o0 + c, vzero()), vstore(o1 + c, vzero());
        }
        for (i = 0; i + 1 < Dk; i += 2) {
            float *row0 = S + i * Dv + c0, *row1 = row0 + Dv;
            if (next) prefetch_span_l2((const char *)(next + i * Dv + c0), 4 * w),
                      prefetch_span_l2((const char *)(next + (i + 1) * Dv + c0), 4 * w);
            const vfloat k0 = vset1(k[i]), k1 = vset1(k[i + 1]), q0 = vset1(q[i]), q1 = vset1(q[i + 1]);
            for (int64_t c = 0; c < w; c += VW) {
                const vfloat s0 = vfma(k0, vload(delta + c), vdecay * vload_n(row0 + c, w - c));
                const vfloat s1 = vfma(k1, vload(delta + c), vdecay * vload_n(row1 + c, w - c));
                vstore_n(row0 + c, s0, w - c);
                vstore_n(row1 + c, s1, w - c);
                vstore(o0 + c, vfma(q0, s0, vload(o0 + c)));
                vstore(o1 + c, vfma(q1, s1, vload(o1 + c)));
            }
        }
        if (i < Dk) {
            float *row0 = S + i * Dv + c0;
            if (next) prefetch_span_l2((const char *)(next + i * Dv + c0), 4 * w);
            const vfloat k0 = vset1(k[i]), q0 = vset1(q[i]);
            for (int64_t c = 0; c < w; c += VW) {
                const vfloat s0 = vfma(k0, vload(delta + c), vdecay * vload_n(row0 + c, w - c));
                vstore_n(row0 + c, s0, w - c);
                vstore(o0 + c, vfma(q0, s0, vload(o0 + c)));
            }
        }
        for (int64_t c = 0; c < w; c += VW) vstore_n(o + c0 + c, vload(o0 + c) + vload(o1 + c), w - c);
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
    if (T == 1) { /* a decode step: one token a head, whole rows (see the top) */
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
        for (int64_t bh = 0; bh < B * H; ++bh)
            head_token(state + bh * Dk * Dv, Dk, Dv, q + bh * Dk, k + bh * Dk, v + bh * Dv, out + bh * Dv, g[bh],
                       beta[bh], bh + 1 < B * H ? state + (bh + 1) * Dk * Dv : NULL);
        return 0;
    }
    const int64_t strips = (Dv + STRIP - 1) / STRIP, items = B * H * strips;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t bh = item / strips, c0 = (item % strips) * STRIP, b = bh / H, h = bh % H;
        const int64_t first = b * T * H + h; /* token 0 of sequence b, head h, in [B, T, H] units */
        float *S = state + bh * Dk * Dv;
        const float *qh = q + first * Dk, *kh = k + first * Dk, *vh = v + first * Dv;
        float *oh = out + first * Dv;
        if (Dv - c0 >= STRIP)
            strip_tokens(S, Dk, Dv, c0, STRIP, qh, kh, qs, vh, oh, vs, g + first, beta + first, H, T, 1);
        else
            strip_tokens(S, Dk, Dv, c0, Dv - c0, qh, kh, qs, vh, oh, vs, g + first, beta + first, H, T, 0);
    }
    return 0;
}
