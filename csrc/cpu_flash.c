/* Flash attention in float32 on the vector units: the prefill's attention blocks on CPUs without
 * bf16 units (AVX2-only CPUs such as AMD Zen 1-3, where a bf16 model computes in float32) and for
 * float32 models everywhere. Inputs in float32 (ringctx_flash_attention) or bf16
 * (ringctx_flash_attention_bf16: widened as they are read, the same float32 math and bits as on
 * their float32 copies).
 *
 *   s[t, h, j] = scale q[t, h] . k[j, h / group], or softcap tanh(s / softcap) when softcap > 0
 *   out[t, h]  = sum_j softmax_j(s[t, h, j]) v[j, h / group]      over the keys j that t sees
 *   lse[h, t]  = log sum_j exp(s[t, h, j])                          (-inf, out 0: t sees no key)
 *
 * q [T, Hq, D], k and v [S, Hkv, D], out [T, Hq, D] (any row and head strides, D contiguous);
 * lse [Hq, T]. Not causal: every query sees every key. Causal: query t sees key j iff
 * j <= t + q_offset and (window == 0 or j > t + q_offset - window): the ring's block of queries
 * against a contiguous range of keys, a band for a sliding-window layer (T and S any, q_offset any
 * integer; q_offset 0, window 0, T == S is the square diagonal block). The keys a unit of queries
 * sees are a contiguous range (the band of its first token to that of its last): its work starts at
 * the block of the first and, inside a block, at the key tile of it, and ends at the last, so a
 * window W costs about T (W + UNIT_ROWS / group + BLOCK_KEYS) scores, not T S.
 *
 * Work comes in units: one KV head and up to UNIT_ROWS query rows, the rows of a run of tokens times
 * the GQA group that reads that head (row = token * group + g), so that each K and V row read
 * serves every query head of its group. A unit goes over the keys in blocks of BLOCK_KEYS:
 *
 *   scores  S^T [keys, rows] = K Q^T: the queries are packed once per unit transposed ([D, rows]),
 *           K's rows are read where they lie; a register tile is KEY_TILE keys (each k[j, d]
 *           broadcast) by ROW_VECS vectors of rows, so the rows lie along the vector lanes, and
 *   softmax the online softmax runs lane-wise down the keys (a row's max and sum are vector ops,
 *           no horizontal reduction), P^T over S^T in place;
 *   P V     acc [rows, D] += P V: a register tile is OUT_ROWS rows (each p broadcast) by ROW_VECS
 *           vectors of D, V's rows read where they lie; the rescale of acc by the new max is
 *           folded into the tile's load.
 *
 * A full (non-causal) block's keys go in spans of SPAN_KEYS, each from nothing, merged by
 * log-sum-exp in order; a causal block in one span. With few units (a question's tokens over a
 * document) the (unit, span) pairs are shared over the threads, else whole units, up to
 * GROUP_UNITS of a head at a time: each block of keys is read once for all of them.
 *
 * No transposes of K or V: the only packing is a unit's queries. bf16 K and V are widened a block at
 * a time into a thread's buffer (KEY_TILE-aligned, zeros after the block's keys), the float32
 * tiles reading that: a question's few rows over a document's cache read it in place, where a
 * float32 copy of the document's rows would cost a pass over memory more than the widening.
 * (Widened again in every unit, the blocks took ~8% of a prefill's 2K x 4K block; a float32 copy
 * of a head's K and V made once for all its units was slower from 32K keys, where it falls out of
 * the caches; the units of a group share each widened block instead.) A span is
 * computed by one thread from its own inputs alone and merged in a fixed order, so a row's bits
 * depend on its query and the keys only: not on the threads, the rows beside it, or how long the
 * block is. Units are handed out largest first (a causal block's later tokens see more keys).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#if VW == 16
#define KEY_TILE 12 /* 12 x 2 accumulators + 2 query vectors + a broadcast: 27 of 32 registers */
#define OUT_ROWS 12
#else
#define KEY_TILE 6 /* 6 x 2 + 2 + 1 = 15 of 16 registers */
#define OUT_ROWS 6
#endif
#define ROW_VECS 2
#define ROW_TILE (ROW_VECS * VW) /* query rows per scores tile; columns of D per P V tile */
#define BLOCK_KEYS 120          /* a multiple of KEY_TILE (6, 12): S^T [120, 96] is 45 KB */
#define UNIT_ROWS 96
#define SPAN_KEYS 1920 /* a full block's keys per span (16 blocks; see ringctx_flash_attention) */
#define GROUP_UNITS 4  /* units of one head that read each block of keys together */

typedef struct {
    const void *q, *k, *v; /* float32, or bf16 bit patterns (bf16 set) */
    int bf16;
    int64_t q_rs, q_hs, k_rs, k_hs, v_rs, v_hs; /* in elements */
    int64_t T, S, Hq, Hkv, D, group;
    int causal;
    int64_t q_offset, window; /* causal: token t sees keys (t + q_offset - window, t + q_offset] */
    float scale, softcap;     /* softcap 0: none */
    float *out;
    int64_t o_rs, o_hs;
    float *lse;
} flash_problem;

/* 2^x for x <= 0 (a score minus its row's max, in base 2), within about 1e-7 relative: x = n + r,
 * |r| <= 1/2, a degree-6 polynomial for 2^r, n added to its exponent. Half the instructions of
 * vexp (the softmax's exponentials are ~15% of the block's work): no upper clamp, one shift.
 * x below -126 (-inf: a masked score) gives at most 2^-126, nothing next to a row's sum >= 1. */
SIMD_INLINE vfloat vexp2_nonpositive(vfloat x) {
    x = vmax(x, vset1(-126.0f));
    const vfloat shifter = vset1(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vfloat t = x + shifter, r = x - (t - shifter);
    vfloat p = vset1(1.5337580407503992e-4f);
    p = vfma(p, r, vset1(1.339986571110785e-3f));
    p = vfma(p, r, vset1(9.618519805371761e-3f));
    p = vfma(p, r, vset1(5.550329014658928e-2f));
    p = vfma(p, r, vset1(2.4022646248340607e-1f));
    p = vfma(p, r, vset1(6.931471824645996e-1f));
    p = vfma(p, r, vset1(1.0f));
    return (vfloat)((vint)p + ((vint)t << 23)); /* t's low bits hold n */
}

/* A partial result over some keys: the running max m (times scale log2 e: base 2) and sum l
 * [rows_pad], the unnormalised output acc [rows_pad, D]. */
typedef struct {
    float *m, *l, *acc;
} flash_partial;

/* Per-thread buffers for units of up to rows_pad rows (a multiple of VW). */
typedef struct {
    float *st;    /* [BLOCK_KEYS, rows_pad]: a block's scores, then its probabilities */
    float *alpha; /* [rows_pad]: a block's rescale of the partial's acc */
    float *top;   /* [rows_pad]: the rows' max score in the block (scores_tile keeps it) */
    float *tail;  /* [KEY_TILE, D]: the keys of a block's last tile, zeros beyond the block */
    float *kw, *vw; /* bf16 inputs: [BLOCK_KEYS, D] a block's K and V widened, K zeros beyond it */
} flash_buffers;

/* A unit on its way over the keys: its rows, queries and where its partial goes. */
typedef struct {
    int64_t rows, rows_pad, t0; /* rows_pad: a multiple of VW; tokens from t0 */
    int64_t j_first, j_end;     /* the keys it attends: [j_first, j_end), j_first >= attend_keys' j_begin */
    float *qt;                  /* [D, rows_pad]: its queries, transposed, zero beyond its rows */
    flash_partial out;
} flash_unit;

/* Rows padded to whole vectors (VW: 8 on AVX2, 16 on AVX-512): scores take them ROW_TILE at a
 * time and the last VW alone where ROW_TILE does not divide that (a question's 14 tokens times a
 * group of 3: 42 rows, 48 on AVX2 and AVX-512 alike); P V takes the last rows in a smaller tile
 * where OUT_ROWS does not divide it. */
static int64_t pad_rows(int64_t rows) { return (rows + VW - 1) / VW * VW; }

/* The first and last key token t sees, before clipping to [0, S): a causal block's band (no window:
 * from key 0; far below 0 so that adding to it cannot wrap), every key otherwise. Both grow with t,
 * so tokens [t0, t1) see keys key_lo(t0)..key_hi(t1 - 1) together, and the tokens that see a key
 * are a contiguous run. */
static inline int64_t key_lo(const flash_problem *p, int64_t t) {
    return !p->causal ? 0 : p->window ? t + p->q_offset - p->window + 1 : INT32_MIN;
}
static inline int64_t key_hi(const flash_problem *p, int64_t t) { return p->causal ? t + p->q_offset : p->S - 1; }

/* v clipped to [lo, hi] */
static inline int64_t clip(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

/* S^T [KEY_TILE keys, rows r0..r0 + NV VW): sum over d of k[i, d] qt[d, r], key i's row at
 * k + i k_rs (NV: ROW_VECS, or 1 for a unit's last rows); top [NV VW] (the rows' max score in the
 * block so far) takes the max of the first `valid` keys' scores (the others are padding). Each
 * lane's sums are the same in either tile. */
SIMD_INLINE void scores_tile(const float *k, int64_t k_rs, const float *qt, int64_t rows_pad, int64_t D, float *st,
                             float *top, int valid, const int NV) {
    vfloat a[KEY_TILE][ROW_VECS];
#pragma GCC unroll 12
    for (int i = 0; i < KEY_TILE; ++i)
#pragma GCC unroll 2
        for (int c = 0; c < NV; ++c) a[i][c] = vzero();
    for (int64_t d = 0; d < D; ++d) {
        vfloat qv[ROW_VECS];
#pragma GCC unroll 2
        for (int c = 0; c < NV; ++c) qv[c] = vload(qt + d * rows_pad + c * VW);
#pragma GCC unroll 12
        for (int i = 0; i < KEY_TILE; ++i) {
            const vfloat kb = vset1(k[i * k_rs + d]);
#pragma GCC unroll 2
            for (int c = 0; c < NV; ++c) a[i][c] = vfma(kb, qv[c], a[i][c]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < KEY_TILE; ++i)
#pragma GCC unroll 2
        for (int c = 0; c < NV; ++c) vstore(st + i * rows_pad + c * VW, a[i][c]);
#pragma GCC unroll 2
    for (int c = 0; c < NV; ++c) {
        vfloat m = vload(top + c * VW);
#pragma GCC unroll 12
        for (int i = 0; i < KEY_TILE; ++i)
            if (i < valid) m = vmax(m, a[i][c]);
        vstore(top + c * VW, m);
    }
}

/* acc [r0..r0 + RT, c0..c0 + NC VW) = alpha acc + sum over keys j < n of p[j, r] v[j, c]
 * (RT: OUT_ROWS, or fewer for a unit's last rows; NC: ROW_VECS, or 1 for a head dim that is an odd
 * number of vectors). A row's sums are the same whichever tile it falls in. */
SIMD_INLINE void pv_tile(const float *pt, int64_t rows_pad, const float *v, int64_t v_rs, int64_t n,
                         const float *alpha, float *acc, int64_t D, const int RT, const int NC) {
    vfloat a[OUT_ROWS][ROW_VECS];
#pragma GCC unroll 12
    for (int r = 0; r < RT; ++r) {
        const vfloat w = vset1(alpha[r]);
#pragma GCC unroll 2
        for (int c = 0; c < NC; ++c) a[r][c] = vload(acc + r * D + c * VW) * w;
    }
    for (int64_t j = 0; j < n; ++j) {
        vfloat vv[ROW_VECS];
#pragma GCC unroll 2
        for (int c = 0; c < NC; ++c) vv[c] = vload(v + j * v_rs + c * VW);
#pragma GCC unroll 12
        for (int r = 0; r < RT; ++r) {
            const vfloat p = vset1(pt[j * rows_pad + r]);
#pragma GCC unroll 2
            for (int c = 0; c < NC; ++c) a[r][c] = vfma(p, vv[c], a[r][c]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < NC; ++c) vstore(acc + r * D + c * VW, a[r][c]);
}

/* P V for RT rows of a unit (OUT_ROWS, or the fewer left at its end), every column tile. */
SIMD_INLINE void pv_rows(const float *pt, int64_t rows_pad, const float *v, int64_t v_rs, int64_t n,
                         const float *alpha, float *acc, int64_t D, const int RT) {
    int64_t c0 = 0;
    for (; c0 + ROW_TILE <= D; c0 += ROW_TILE)
        pv_tile(pt, rows_pad, v + c0, v_rs, n, alpha, acc + c0, D, RT, ROW_VECS);
    if (c0 < D) /* D an odd number of vectors */
        pv_tile(pt, rows_pad, v + c0, v_rs, n, alpha, acc + c0, D, RT, 1);
}

/* The online softmax over keys [j0 + ja, j0 + n) of a block, whose scores are st [ja..n, rows_pad]
 * (rows of tokens t0..; ja a multiple of KEY_TILE, the keys before it hidden from all of them and
 * not computed): with softcap, every score s becomes softcap tanh(scale s / softcap); scores a row
 * does not see (masked: some of the block's keys are hidden from some rows) become -inf; every
 * score its probability 2^(scale log2(e) s - m_new) (capped: 2^(log2(e) c - m_new)), exactly 0
 * where hidden; m, l, alpha are updated lane-wise. A row that has seen no key yet keeps m = -inf,
 * l = 0 and its acc 0 (alpha 0). */
static void block_softmax(const flash_problem *p, const flash_buffers *b, const flash_partial *part,
                          int64_t rows_pad, int64_t rows, int64_t t0, int64_t j0, int64_t ja, int64_t n) {
    const float log2e = 1.44269504088896341f;
    /* capped scores carry the scale already */
    const vfloat scale = vset1(p->softcap > 0.0f ? log2e : p->scale * log2e), neg_inf = vset1(-INFINITY);
    const vfloat cap = vset1(p->softcap), pre_cap = vset1(p->softcap > 0.0f ? p->scale / p->softcap : 0.0f);
    /* causal: some key of [j0 + ja, j0 + n) lies past the band of the unit's first token or before
     * that of its last (both ends grow with the token), so some rows see only part of the block */
    const int64_t t_last = t0 + (rows - 1) / p->group;
    const int masked = p->causal && (j0 + n - 1 > key_hi(p, t0) || j0 + ja < key_lo(p, t_last));
    for (int64_t r0 = 0; r0 < rows_pad; r0 += VW) {
        vint lo, hi; /* each lane's band, clipped to int32 (rows past the unit's: every key) */
        for (int i = 0; i < VW; ++i) {
            const int64_t t = t0 + (r0 + i) / p->group;
            lo[i] = r0 + i < rows ? (int32_t)clip(key_lo(p, t), 0, p->S) : INT32_MIN;
            hi[i] = r0 + i < rows ? (int32_t)clip(key_hi(p, t), -1, p->S) : INT32_MAX;
        }
        vfloat top = vload(b->top + r0);
        if (masked || p->softcap > 0.0f) { /* the max over the (capped) scores each row sees */
            top = neg_inf;
            for (int64_t j = ja; j < n; ++j) {
                vfloat s = vload(b->st + j * rows_pad + r0);
                if (p->softcap > 0.0f) s = cap * vtanh(s * pre_cap);
                if (masked) {
                    const vint key = (vint){0} + (int32_t)(j0 + j), hidden = (key > hi) | (key < lo);
                    s = (vfloat)(((vint)s & ~hidden) | ((vint)neg_inf & hidden));
                }
                vstore(b->st + j * rows_pad + r0, s);
                top = vmax(top, s);
            }
        }
        const vfloat m_old = vload(part->m + r0), m_new = vmax(m_old, top * scale);
        /* a row that has seen no key (m_new -inf): alpha 0, not 2^(-inf - -inf) */
        const vint live = m_new > neg_inf;
        const vfloat alpha = (vfloat)((vint)vexp2_nonpositive(m_old - m_new) & live);
        vfloat sum = vzero();
        if (masked) /* hidden keys (-inf: no real score is) weigh exactly 0 */
            for (int64_t j = ja; j < n; ++j) {
                const vfloat s = vload(b->st + j * rows_pad + r0);
                const vfloat e = (vfloat)((vint)vexp2_nonpositive(vfma(s, scale, -m_new)) & (s > neg_inf));
                vstore(b->st + j * rows_pad + r0, e);
                sum += e;
            }
        else
            for (int64_t j = ja; j < n; ++j) {
                const vfloat e = vexp2_nonpositive(vfma(vload(b->st + j * rows_pad + r0), scale, -m_new));
                vstore(b->st + j * rows_pad + r0, e);
                sum += e;
            }
        vstore(part->l + r0, vfma(vload(part->l + r0), alpha, sum));
        vstore(part->m + r0, m_new);
        vstore(b->alpha + r0, alpha);
    }
}

/* The float32 value of a bf16 bit pattern (exact: its top half). */
static inline float bf16_value(uint16_t bits) {
    const uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Rows [j0, j0 + n) of head h of a bf16 K or V ([S, Hkv, D] by row and head strides) widened into
 * dst [n, D], then zero rows up to the next multiple of KEY_TILE when zero_tail. */
static void widen_rows(const uint16_t *x, int64_t rs, int64_t hs, int64_t h, int64_t j0, int64_t n, int64_t D,
                       float *dst, int zero_tail) {
    widen_bf16_rows(x, rs, hs, h, j0, n, D, dst);
    if (zero_tail)
        for (int64_t i = n; i % KEY_TILE; ++i) memset(dst + i * D, 0, (size_t)D * sizeof(float));
}

/* Rows [row0, row0 + n) of head h of K and V (those below S) asked for ahead of their block. A
 * document's cache comes from memory, not the caches: asked for a few rows at a time while the block
 * before is computed, they arrive in time (a question's block over 8K keys, the 30 layers' K and V
 * in turn: 0.80-0.92x the time); asked for all at once as a block is widened, they waited for line
 * fill buffers, no faster than not asking (and a key tile's rows at once still waited, see
 * attend_keys). */
SIMD_INLINE void prefetch_rows(const flash_problem *p, int64_t h, int64_t row0, int64_t n) {
    const int64_t size = p->bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float);
    for (int64_t r = row0; r < row0 + n && r < p->S; ++r) {
        prefetch_span((const char *)p->k + (r * p->k_rs + h * p->k_hs) * size, p->D * size);
        prefetch_span((const char *)p->v + (r * p->v_rs + h * p->v_hs) * size, p->D * size);
    }
}

/* Part `part` of `parts` of the rows of a key tile of the next block (from row `ahead`), asked for. */
SIMD_INLINE void prefetch_tile_part(const flash_problem *p, int64_t h, int64_t ahead, int64_t part, int64_t parts) {
    const int64_t first = KEY_TILE * part / parts;
    prefetch_rows(p, h, ahead + first, KEY_TILE * (part + 1) / parts - first);
}

/* A unit's queries (KV head h, tokens [t0, t1)) into qt; returns its padded row count. */
static int64_t pack_queries(const flash_problem *p, float *qt, int64_t h, int64_t t0, int64_t t1) {
    const int64_t D = p->D, group = p->group, rows = (t1 - t0) * group, rows_pad = pad_rows(rows);
    for (int64_t r = 0; r < rows_pad; ++r) {
        const int64_t at = (t0 + r / group) * p->q_rs + (h * group + r % group) * p->q_hs;
        if (r >= rows)
            for (int64_t d = 0; d < D; ++d) qt[d * rows_pad + r] = 0.0f;
        else if (p->bf16)
            for (int64_t d = 0; d < D; ++d) qt[d * rows_pad + r] = bf16_value(((const uint16_t *)p->q)[at + d]);
        else
            for (int64_t d = 0; d < D; ++d) qt[d * rows_pad + r] = ((const float *)p->q)[at + d];
    }
    return rows_pad;
}

/* Units of head h (n of them) over keys [unit j_first, unit j_end) each, from nothing: the online
 * softmax block by block into each unit's `out` (unnormalised acc, its m and l). A block's K and V
 * are read (and bf16 widened) once for every unit that reaches it, then each unit does what it
 * would do alone: a unit's bits do not depend on the others. j_begin (<= every unit's j_first) is
 * a multiple of BLOCK_KEYS, so a key's block is the same whatever the span or the band. A unit
 * starts at the key tile of its j_first inside its first block: the tiles before it are hidden
 * from all its rows, so their probabilities would be exactly 0, adding nothing to any sum (the
 * same bits as computing them). A unit with j_first >= j_end sees nothing (m -inf, l 0, acc 0). */
static void attend_keys(const flash_problem *p, const flash_buffers *b, int64_t h, const flash_unit *units, int n_units,
                        int64_t j_begin) {
    const int64_t D = p->D;
    int64_t j_last = j_begin;
    for (int u = 0; u < n_units; ++u) {
        const flash_unit *unit = &units[u];
        for (int64_t r = 0; r < unit->rows_pad; ++r) unit->out.m[r] = -INFINITY, unit->out.l[r] = 0.0f;
        memset(unit->out.acc, 0, (size_t)(unit->rows_pad * D) * sizeof(float));
        if (unit->j_end > j_last && unit->j_first < unit->j_end) j_last = unit->j_end;
    }
    int64_t j_start = j_last; /* the first block any unit reaches */
    for (int u = 0; u < n_units; ++u)
        if (units[u].j_first < units[u].j_end && units[u].j_first < j_start) j_start = units[u].j_first;
    j_begin += (j_start - j_begin) / BLOCK_KEYS * BLOCK_KEYS;
    for (int64_t j0 = j_begin; j0 < j_last; j0 += BLOCK_KEYS) {
        const int64_t block = j_last - j0 < BLOCK_KEYS ? j_last - j0 : BLOCK_KEYS;
        /* the block's K and V rows of head h: in place (float32) or widened (bf16) */
        const float *kb, *vb;
        int64_t k_rs, v_rs;
        if (p->bf16) {
            widen_rows((const uint16_t *)p->k, p->k_rs, p->k_hs, h, j0, block, D, b->kw, 1);
            widen_rows((const uint16_t *)p->v, p->v_rs, p->v_hs, h, j0, block, D, b->vw, 0);
            kb = b->kw, vb = b->vw, k_rs = v_rs = D;
        } else {
            kb = (const float *)p->k + h * p->k_hs + j0 * p->k_rs, k_rs = p->k_rs;
            vb = (const float *)p->v + h * p->v_hs + j0 * p->v_rs, v_rs = p->v_rs;
        }
        int asked = 0; /* the next block's rows: asked for over the first unit's tiles */
        for (int u = 0; u < n_units; ++u) {
            const flash_unit *unit = &units[u];
            if (unit->j_end <= j0 || unit->j_first >= j0 + BLOCK_KEYS || unit->j_first >= unit->j_end) continue;
            const int64_t n = unit->j_end - j0 < BLOCK_KEYS ? unit->j_end - j0 : BLOCK_KEYS, rows_pad = unit->rows_pad;
            /* the unit's first key tile in this block (0 but in the block of its j_first) */
            const int64_t ja = unit->j_first > j0 ? (unit->j_first - j0) / KEY_TILE * KEY_TILE : 0;
            for (int64_t r = 0; r < rows_pad; ++r) b->top[r] = -INFINITY;
            /* the next block's rows of a key tile asked for a part before each of the tile's
             * scores tiles: a tile's 6-12 rows of K and V at once (24-48 lines) waited for line
             * fill buffers, ~12% of a question's block */
            const int64_t parts = (rows_pad + ROW_TILE - 1) / ROW_TILE;
            for (int64_t j = ja; j < n; j += KEY_TILE) {
                const int64_t ahead = j0 + BLOCK_KEYS + j;
                const float *kt = kb + j * k_rs;
                int64_t tile_rs = k_rs;
                /* the unit's last, partial tile: float32 keys copied, zeros after (widened bf16 keys
                 * past n are the block's next keys or zeros: their scores are never read) */
                if (j + KEY_TILE > n && !p->bf16) {
                    memset(b->tail, 0, (size_t)(KEY_TILE * D) * sizeof(float));
                    for (int64_t i = 0; i < n - j; ++i) memcpy(b->tail + i * D, kt + i * k_rs, (size_t)D * sizeof(float));
                    kt = b->tail, tile_rs = D;
                }
                const int valid = (int)(n - j < KEY_TILE ? n - j : KEY_TILE);
                int64_t r0 = 0, part = 0;
                for (; r0 + ROW_TILE <= rows_pad; r0 += ROW_TILE, ++part) {
                    if (!asked) prefetch_tile_part(p, h, ahead, part, parts);
                    scores_tile(kt, tile_rs, unit->qt + r0, rows_pad, D, b->st + j * rows_pad + r0, b->top + r0,
                                valid, ROW_VECS);
                }
                if (r0 < rows_pad) { /* one vector of rows left */
                    if (!asked) prefetch_tile_part(p, h, ahead, part, parts); /* the last part */
                    scores_tile(kt, tile_rs, unit->qt + r0, rows_pad, D, b->st + j * rows_pad + r0, b->top + r0,
                                valid, 1);
                }
            }
            asked = 1;
            block_softmax(p, b, &unit->out, rows_pad, unit->rows, unit->t0, j0, ja, n);
            float *acc = unit->out.acc;
            const float *pt = b->st + ja * rows_pad, *vj = vb + ja * v_rs; /* keys ja..n of the block */
            const int64_t nj = n - ja;
            int64_t r0 = 0;
            for (; r0 + OUT_ROWS <= rows_pad; r0 += OUT_ROWS)
                pv_rows(pt + r0, rows_pad, vj, v_rs, nj, b->alpha + r0, acc + r0 * D, D, OUT_ROWS);
            /* rows_pad is whole vectors, so what is left is 2 or 4 rows (OUT_ROWS 6 over multiples of
             * 4 or 8 rows) or 4 or 8 (12 over multiples of 16) */
            const int64_t left = rows_pad - r0;
            if (left == 2) pv_rows(pt + r0, rows_pad, vj, v_rs, nj, b->alpha + r0, acc + r0 * D, D, 2);
            else if (left == 4) pv_rows(pt + r0, rows_pad, vj, v_rs, nj, b->alpha + r0, acc + r0 * D, D, 4);
#if OUT_ROWS > 8
            else if (left == 8) pv_rows(pt + r0, rows_pad, vj, v_rs, nj, b->alpha + r0, acc + r0 * D, D, 8);
#endif
        }
    }
}

/* into += part (both over the same rows, part's keys after into's): the log-sum-exp merge. */
static void merge_into(const flash_partial *into, const flash_partial *part, int64_t rows_pad, int64_t D) {
    for (int64_t r = 0; r < rows_pad; ++r) {
        const float m = into->m[r] > part->m[r] ? into->m[r] : part->m[r];
        const float w_into = vexp2_nonpositive(vset1(into->m[r] - m))[0];
        const float w_part = vexp2_nonpositive(vset1(part->m[r] - m))[0];
        into->l[r] = into->l[r] * w_into + part->l[r] * w_part;
        into->m[r] = m;
        float *a = into->acc + r * D;
        const float *b = part->acc + r * D;
        for (int64_t d = 0; d < D; d += VW) vstore(a + d, vfma(vload(a + d), vset1(w_into), vload(b + d) * vset1(w_part)));
    }
}

/* The unit's normalised output and LSE from its merged partial. */
static void write_unit(const flash_problem *p, const flash_partial *part, int64_t h, int64_t t0, int64_t t1) {
    const int64_t D = p->D, group = p->group, rows = (t1 - t0) * group;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        const float l = part->l[r], inv = l > 0.0f ? 1.0f / l : 0.0f;
        float *o = p->out + t * p->o_rs + head * p->o_hs;
        for (int64_t d = 0; d < D; d += VW) vstore(o + d, vload(part->acc + r * D + d) * vset1(inv));
        p->lse[head * p->T + t] = l > 0.0f ? part->m[r] * 0.693147180559945309f + logf(l) : -INFINITY;
    }
}

static int flash_attention(const void *q, int64_t q_rs, int64_t q_hs, const void *k, int64_t k_rs, int64_t k_hs,
                           const void *v, int64_t v_rs, int64_t v_hs, int bf16, int64_t T, int64_t S, int64_t Hq,
                           int64_t Hkv, int64_t D, int causal, int64_t q_offset, int64_t window, float scale,
                           float softcap, float *out, int64_t o_rs, int64_t o_hs, float *lse, int threads) {
    /* |q_offset| bounded so that a band's ends (t + q_offset - window) stay far inside int64 */
    if (!ringctx_cpu_kernels_supported() || T < 1 || S < 1 || Hkv < 1 || Hq % Hkv || D % VW || D > MAX_D ||
        !(scale > 0.0f) || !(softcap >= 0.0f) || softcap == INFINITY || T > INT32_MAX || S > INT32_MAX ||
        window < 0 || window > INT32_MAX || q_offset > INT32_MAX || q_offset < -(int64_t)INT32_MAX ||
        (!causal && (q_offset || window)))
        return -1;
    const int64_t group = Hq / Hkv;
    const flash_problem p = {q, k, v, bf16, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, T, S, Hq, Hkv, D, group, causal,
                             q_offset, window, scale, softcap, out, o_rs, o_hs, lse};
    const int64_t unit_tokens = UNIT_ROWS / group > 0 ? UNIT_ROWS / group : 1;
    const int64_t tiles = (T + unit_tokens - 1) / unit_tokens, units = tiles * Hkv;
    const int64_t rows_pad = pad_rows(unit_tokens * group), partial = rows_pad * (D + 2);
    /* A full block's keys go in spans of SPAN_KEYS, merged in order: always, so that a row's bits
     * do not depend on how the work was shared out. With few units (a question's tokens over a
     * document: 3 units of 32 tokens at SmolLM2's shape) the spans are shared out too. Else a thread
     * takes up to GROUP_UNITS consecutive tiles of one head at a time, each block of keys read and
     * widened once for all of them, as long as that leaves 4 items a thread. */
    const int64_t spans = causal ? 1 : (S + SPAN_KEYS - 1) / SPAN_KEYS;
    if (threads < 1) threads = 1;
    const int share_spans = spans > 1 && units < 4 * (int64_t)threads;
    int64_t per_group = share_spans ? 1 : units / (4 * (int64_t)threads);
    per_group = per_group < 1 ? 1 : per_group > GROUP_UNITS ? GROUP_UNITS : per_group;
    const int64_t groups_per_head = (tiles + per_group - 1) / per_group;
    const int64_t items = share_spans ? units * spans : groups_per_head * Hkv;
    if (threads > items) threads = (int)items;
    /* per thread: st [BLOCK_KEYS, rows_pad]; alpha, top; tail; bf16: a block's K and V widened; and
     * per unit of a group its queries qt [D, rows_pad] and two partials (a span's and the unit's so far) */
    const int64_t widened = bf16 ? 2 * BLOCK_KEYS * D : 0, unit_floats = D * rows_pad + 2 * partial;
    const int64_t floats = BLOCK_KEYS * rows_pad + 2 * rows_pad + KEY_TILE * D + widened + per_group * unit_floats;
    float *work = (float *)malloc((size_t)(threads * floats + (share_spans ? items * partial : 0)) * sizeof(float));
    if (work == NULL) return -2;
    float *shared = work + threads * floats; /* share_spans: every (unit, span)'s partial */
#pragma omp parallel num_threads(threads)
    {
        float *buf = work + omp_get_thread_num() * floats;
        flash_buffers b = {.st = buf, .alpha = buf + BLOCK_KEYS * rows_pad, .top = buf + (BLOCK_KEYS + 1) * rows_pad,
                           .tail = buf + (BLOCK_KEYS + 2) * rows_pad};
        float *next = b.tail + KEY_TILE * D;
        b.kw = bf16 ? next : NULL;
        b.vw = bf16 ? next + BLOCK_KEYS * D : NULL;
        float *slots = next + widened; /* per_group x (qt, the unit's partial, a span's partial) */
        flash_unit group_units[GROUP_UNITS], span_units[GROUP_UNITS];
        if (!share_spans) {
            /* largest first: a causal block's last tiles see the most keys */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; ++i) {
                const int64_t g = causal ? groups_per_head - 1 - i / Hkv : i / Hkv, h = i % Hkv;
                const int64_t tile0 = g * per_group, tile1 = tile0 + per_group < tiles ? tile0 + per_group : tiles;
                const int n = (int)(tile1 - tile0);
                for (int u = 0; u < n; ++u) {
                    const int64_t t0 = (tile0 + u) * unit_tokens, t1 = t0 + unit_tokens < T ? t0 + unit_tokens : T;
                    float *mine = slots + u * unit_floats, *unit_part = mine + D * rows_pad, *span_part = unit_part + partial;
                    const int64_t pad = pack_queries(&p, mine, h, t0, t1);
                    /* causal: one span, the keys the unit's tokens see together (its first token's
                     * band to its last's); not causal, the first span */
                    const int64_t j_first = causal ? clip(key_lo(&p, t0), 0, S) : 0;
                    const int64_t j_end = causal ? clip(key_hi(&p, t1 - 1) + 1, 0, S) : (S < SPAN_KEYS ? S : SPAN_KEYS);
                    group_units[u] = (flash_unit){(t1 - t0) * group, pad, t0, j_first, j_end,
                                                  mine, {unit_part, unit_part + pad, unit_part + 2 * pad}};
                    span_units[u] = group_units[u];
                    span_units[u].out = (flash_partial){span_part, span_part + pad, span_part + 2 * pad};
                }
                attend_keys(&p, &b, h, group_units, n, 0);
                for (int64_t j = SPAN_KEYS; !causal && j < S; j += SPAN_KEYS) {
                    for (int u = 0; u < n; ++u)
                        span_units[u].j_first = j, span_units[u].j_end = S - j < SPAN_KEYS ? S : j + SPAN_KEYS;
                    attend_keys(&p, &b, h, span_units, n, j);
                    for (int u = 0; u < n; ++u) merge_into(&group_units[u].out, &span_units[u].out, group_units[u].rows_pad, D);
                }
                for (int u = 0; u < n; ++u) {
                    const flash_unit *unit = &group_units[u];
                    write_unit(&p, &unit->out, h, unit->t0, unit->t0 + unit->rows / group);
                }
            }
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; ++i) {
                const int64_t u = i / spans, s = i % spans, tile = u / Hkv, h = u % Hkv;
                const int64_t t0 = tile * unit_tokens, t1 = t0 + unit_tokens < T ? t0 + unit_tokens : T;
                const int64_t pad = pack_queries(&p, slots, h, t0, t1), j = s * SPAN_KEYS;
                float *part = shared + i * partial;
                const flash_unit one = {(t1 - t0) * group, pad, t0, j, S - j < SPAN_KEYS ? S : j + SPAN_KEYS, slots,
                                        {part, part + rows_pad, part + 2 * rows_pad}};
                attend_keys(&p, &b, h, &one, 1, j);
            }
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; ++u) { /* the spans merged in order, as above */
                const int64_t tile = u / Hkv, h = u % Hkv;
                const int64_t t0 = tile * unit_tokens, t1 = t0 + unit_tokens < T ? t0 + unit_tokens : T;
                const int64_t pad = pad_rows((t1 - t0) * group);
                const flash_partial first = {shared + u * spans * partial, shared + u * spans * partial + rows_pad,
                                             shared + u * spans * partial + 2 * rows_pad};
                for (int64_t s = 1; s < spans; ++s) {
                    float *slot = shared + (u * spans + s) * partial;
                    const flash_partial next = {slot, slot + rows_pad, slot + 2 * rows_pad};
                    merge_into(&first, &next, pad, D);
                }
                write_unit(&p, &first, h, t0, t1);
            }
        }
    }
    free(work);
    return 0;
}

int ringctx_flash_attention(const float *q, int64_t q_rs, int64_t q_hs, const float *k, int64_t k_rs, int64_t k_hs,
                            const float *v, int64_t v_rs, int64_t v_hs, int64_t T, int64_t S, int64_t Hq, int64_t Hkv,
                            int64_t D, int causal, int64_t q_offset, int64_t window, float scale, float softcap,
                            float *out, int64_t o_rs, int64_t o_hs, float *lse, int threads) {
    return flash_attention(q, q_rs, q_hs, k, k_rs, k_hs, v, v_rs, v_hs, 0, T, S, Hq, Hkv, D, causal, q_offset, window,
                           scale, softcap, out, o_rs, o_hs, lse, threads);
}

int ringctx_flash_attention_bf16(const uint16_t *q, int64_t q_rs, int64_t q_hs, const uint16_t *k, int64_t k_rs,
                                 int64_t k_hs, const uint16_t *v, int64_t v_rs, int64_t v_hs, int64_t T, int64_t S,
                                 int64_t Hq, int64_t Hkv, int64_t D, int causal, int64_t q_offset, int64_t window,
                                 float scale, float softcap, float *out, int64_t o_rs, int64_t o_hs, float *lse,
                                 int threads) {
    return flash_attention(q, q_rs, q_hs, k, k_rs, k_hs, v, v_rs, v_hs, 1, T, S, Hq, Hkv, D, causal, q_offset, window,
                           scale, softcap, out, o_rs, o_hs, lse, threads);
}
