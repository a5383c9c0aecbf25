/* Flash attention for bf16 on CPUs with AMX (Intel Sapphire Rapids and later), with the LSE:
 * ringctx's "amx" attention backend (built with the other CPU kernels by ringctx/cpu_kernels.py);
 * and, at the end of the file, the small matrix products of a question's prefill on the tiles.
 *
 *   out[t, h] = softmax(scale * q[t, h] . k[:, h / G]^T + mask) v[:, h / G]      G = Hq / Hkv
 *   lse[h, t] = log of that softmax's denominator (natural log, float32; -inf for a row that sees
 *               no key, whose output is 0)
 *
 * q [T, Hq, D], k and v [S, Hkv, D], out [T, Hq, D]: bf16 with any row and head strides (D
 * contiguous); D a multiple of 32 up to 256. causal = 0: every query sees every key. causal = 1:
 * query i sees key j iff j <= i + q_offset and (window == 0 or j > i + q_offset - window), any T
 * and S (q_offset 0, window 0, T == S: the square diagonal block). softcap > 0: every score
 * s = scale q.k becomes softcap tanh(s / softcap) before the softmax. The mask and the cap follow
 * cpu_flash.c's rules line for line (key_lo, key_hi, vtanh): a unit's work starts at the key block
 * of its first query's band and ends at its last query's, each step going to the tiles that see
 * its key block, so a window W costs about T (W + Q_BLOCK + K_BLOCK), not T S.
 *
 * Why not PyTorch's fused CPU op: with AMX doing the products, the time goes to the softmax.
 * Done row by row (a vector holds 16 keys of one query, as in that op), every row needs
 * horizontal max and sum reductions and a scalar rescale: a first version of this kernel built
 * that way, with its scores in L1, ran at 0.84-0.95x PyTorch's op. This one computes the scores
 * transposed, S^T = K Q^T, so that a vector holds one key's scores for 16 queries: the running
 * max, the exponentials and the sums of the online softmax are plain vertical vector
 * operations, and it measured 1.2-1.9x PyTorch's op (scripts/bench_cpu_attention.py,
 * docs/BENCHMARKS.md).
 *
 * Per query tile (one query head, 16 queries), over blocks of 64 keys:
 *   S^T [64 keys x 16 q]  = K [64 x D] . Q^T            tiles: A = 16 rows of K, B = Q^T (VNNI)
 *   P^T = exp2(S^T * scale * log2 e - m)                running max m, sum l per query (vectors)
 *   O^T [D x 16 q] = O^T * alpha + V^T [D x 64] . P^T   tiles: A = V^T, B = P^T (VNNI)
 * The tile unit multiplies A [16 x 32 bf16] by B [32 x 16 bf16] into C [16 x 16 float32], B stored
 * as 16 rows of 16 pairs ("VNNI": B[k][n] at row k / 2, element 2 n + k % 2). K's rows, 32 dims
 * wide, are A rows as they lie in the cache (or, for many queries, copied once per call into
 * contiguous rows); V is transposed once per call; Q^T and P^T are built in VNNI order per tile.
 * Tiles 0-3 hold C, tile 4 A, tile 5 B. A unit of work is four query tiles of one head that take each block of
 * K and V in turn while it is in L1 (or, for a call of few such units, a span of the keys: see
 * SPLIT_TO_UNITS).
 *
 * Each step (one query tile, one key block) is S^T on the tile unit, then the softmax on the
 * vector units, then P V on the tile unit. Written in that order the two units took turns: a
 * step's tile work waited for the last one's (tile registers are not renamed), and its softmax
 * for its S^T. So each step's softmax issues the *next* step's S^T product between its runs of
 * vector work (softmax_step), into a second S^T buffer. Measured (docs/BENCHMARKS.md): the same
 * results bit for bit; at W = 2 on the 2-core AMX VM, ring pass-KV 0.79x / 0.67x PyTorch's ring
 * at 8K / 32K tokens against 0.95x / 0.82x before; single calls 6-9% slower at D = 64 on an idle
 * core, 19% faster when the core's other hardware thread is busy (the common case on that shared
 * VM), at D = 128 as fast idle and 7-12% faster busy.
 *
 * Numerics are those of a flash-attention kernel in bf16: scores accumulated in float32 by the
 * tiles (TDPBF16PS), softmax in float32 (2^x to 1.5e-7), probabilities rounded to bf16 for the
 * P V product, output accumulated in float32 and rounded once.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#if defined(__has_include)
#if __has_include(<amxtileintrin.h>) && __has_include(<cpuid.h>) && defined(__linux__)
#define RINGCTX_HAVE_AMX 1
#endif
#endif

#ifdef RINGCTX_HAVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

#define Q_TILE 16  /* queries per tile: the columns of S^T and O^T */
/* Measured on 4K-16K blocks: 128 queries or 128-256 keys were faster on some shapes and slower on
 * others (their scratch no longer fits L1); these were the best overall. */
#define Q_BLOCK 64 /* queries per unit of work: four tiles that share each block of K and V */
#define K_BLOCK 64 /* keys per online-softmax step: four 16-key C tiles of scores (the code assumes 64) */
/* Query rows per KV head from which K is packed (copied into contiguous rows once per call) rather
 * than read in place with the cache's row stride. Measured (GQA 3, D 64, 8K keys, 2 threads), in
 * place over packed: 16 queries 0.78x the time, 64 queries 0.91x, 256 queries 1.01x, 512 1.04x
 * (strided rows cost the many query tiles that reread each block a little). The same bits. */
#define K_PACK_FROM_ROWS 768
/* A call of few query units (a question over a document) is split by key spans into about this
 * many units, spans of at least SPAN_MIN_KEYS keys. Measured, 16 queries (GQA 3, D 64, 8K keys,
 * 2 threads): 0.73x the time with K and V in cache, 0.84x from memory (30 layers' worth). */
#define SPLIT_TO_UNITS 12
#define SPAN_MIN_KEYS 1024
#define AMX_LINEAR_MAX_ROWS 64 /* rows of x ringctx_amx_linear takes: four C tiles */

/* AMX instructions fault until the process asks Linux for the tile state (once per process). */
static int amx_usable(void) {
    static int state = 0; /* 0: not checked yet, 1: usable, -1: not */
    if (state == 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24)) &&
                        ringctx_cpu_kernels_supported() && __builtin_cpu_supports("avx512bf16");
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18) */
        state = cpu && syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    }
    return state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

AMX_TARGET static void release_tiles(void) { _tile_release(); }

AMX_TARGET static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    /* GCC's _tile_loadconfig tells the compiler it reads only 8 bytes, so without this the stores
     * above count as dead and are dropped (then LDTILECFG faults on the garbage). */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* 2^y for 16 floats y (finite, or far below 0): 2^round(y) times a degree-5 polynomial for 2^f,
 * |f| <= 1/2 (fitted on Chebyshev nodes; relative error 1.5e-7). */
AMX_TARGET static inline __m512 exp2_512(__m512 y) {
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.3266970636e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754599362e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507425219e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192f));
    return _mm512_scalef_ps(p, n);
}

/* K of each KV head as [keys padded to K_BLOCK][D], rows contiguous (zero past the last key). */
static void pack_keys(const uint16_t *k, int64_t row_stride, int64_t head_stride, int64_t S, int64_t Hkv,
                      int64_t D, int64_t padded, uint16_t *kp) {
#pragma omp for schedule(static)
    for (int64_t hj = 0; hj < Hkv * padded; ++hj) {
        const int64_t h = hj / padded, j = hj % padded;
        uint16_t *dst = kp + (h * padded + j) * D;
        if (j < S) memcpy(dst, k + j * row_stride + h * head_stride, (size_t)D * 2);
        else memset(dst, 0, (size_t)D * 2);
    }
}

/* V^T of each KV head in blocks of 32 keys: Vt[h][chunk][d][32 keys], zero past the last key, so
 * that 16 dims x 32 keys, one A tile, are 1 KB in a row. Each 32 keys x 32 dims square is
 * transposed in registers (transpose_32x32). Element by element instead, a call of 16 queries (9
 * heads, GQA 3, D 64) over 8K keys took 1.22-1.25 ms against 1.04-1.05 now, 64 queries 2.04-2.18
 * against 1.86-1.91 ms, 256 queries 0.96x the time (2 threads, three alternating runs each):
 * a question's few queries pay the packing of the whole document's V in every layer. */
AMX_TARGET static void transpose_32x32(__m512i r[32]) {
    /* Five stages; stage b swaps the off-diagonal b x b blocks of every 2b x 2b block (rows r and
     * r + b exchange their halves), after which every element sits at its transposed place. */
    for (int b = 16; b >= 1; b /= 2) {
        uint16_t lo[32], hi[32];
        for (int c = 0; c < 32; ++c) {
            lo[c] = (uint16_t)((c & b) ? 32 + c - b : c);  /* row r: its own left, row r+b's left */
            hi[c] = (uint16_t)((c & b) ? 32 + c : c + b);  /* row r+b: row r's right, its own right */
        }
        const __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
        for (int i = 0; i < 32; ++i) {
            if (i & b) continue;
            const __m512i top = r[i], bottom = r[i + b];
            r[i] = _mm512_permutex2var_epi16(top, ilo, bottom);
            r[i + b] = _mm512_permutex2var_epi16(top, ihi, bottom);
        }
    }
}

AMX_TARGET static void pack_values(const uint16_t *v, int64_t row_stride, int64_t head_stride, int64_t S, int64_t Hkv,
                                   int64_t D, int64_t chunks, uint16_t *vt) {
#pragma omp for schedule(static)
    for (int64_t hc = 0; hc < Hkv * chunks; ++hc) {
        const int64_t h = hc / chunks, c = hc % chunks;
        uint16_t *dst = vt + hc * D * 32;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            __m512i rows[32];
            for (int64_t e = 0; e < 32; ++e) {
                const int64_t key = c * 32 + e;
                rows[e] = key < S ? _mm512_loadu_si512(v + key * row_stride + h * head_stride + d0)
                                  : _mm512_setzero_si512();
            }
            transpose_32x32(rows);
            for (int64_t d = 0; d < 32; ++d) _mm512_storeu_si512(dst + (d0 + d) * 32, rows[d]);
        }
    }
}

/* The state of one query tile (16 queries of one head) across the key blocks. */
typedef struct {
    uint32_t qt[MAX_D / 2 * Q_TILE] __attribute__((aligned(64))); /* Q^T, VNNI: [D/2][16 q] words */
    float acc[MAX_D * Q_TILE] __attribute__((aligned(64)));       /* O^T: [D][16 q] */
    __m512 m, l;                                                  /* running max (base 2), sum */
    int64_t r0, rows;
} query_tile;

/* Where a unit reads its KV head's keys: 16 rows of K (32 dims wide) are an A tile with any row
 * stride, so K is read in place, except the last, partial key block, copied into a zero-padded
 * buffer of K_BLOCK rows so that no tile reads past the last key (those keys are masked in the
 * softmax); or, for many queries, from K packed once per call (pack_keys): see K_PACK_FROM_ROWS. */
typedef struct {
    const uint16_t *k; /* key 0 of this KV head */
    int64_t k_rs;      /* K's row stride in elements */
    int64_t tail_k0;   /* the first key of the padded block (S when S % K_BLOCK == 0) */
    uint16_t tail[K_BLOCK * MAX_D] __attribute__((aligned(64)));
} key_rows;

/* Keys k0 .. k0 + 63: their first row and the row stride in bytes. */
static inline const uint16_t *block_keys(const key_rows *keys, int64_t k0, int64_t D, int64_t *stride) {
    if (k0 >= keys->tail_k0) {
        *stride = D * 2;
        return keys->tail + (k0 - keys->tail_k0) * D;
    }
    *stride = keys->k_rs * 2;
    return keys->k + k0 * keys->k_rs;
}

/* k: key 0 of the KV head, in place (k_rs its row stride) or packed (k_rs = D, padded: no tail). */
static void set_key_rows(key_rows *keys, const uint16_t *k, int64_t k_rs, int64_t S, int64_t D, int packed) {
    keys->k = k, keys->k_rs = k_rs;
    keys->tail_k0 = S % K_BLOCK && !packed ? S / K_BLOCK * K_BLOCK : S + K_BLOCK;
    for (int64_t j = 0; keys->tail_k0 < S && j < K_BLOCK; ++j) {
        const int64_t key = keys->tail_k0 + j;
        if (key < S) memcpy(keys->tail + j * D, k + key * k_rs, (size_t)D * 2);
        else memset(keys->tail + j * D, 0, (size_t)D * 2);
    }
}

/* Scratch of the steps, shared by the tiles in turn: S^T of the current step and of the next one
 * (written while the current one's softmax runs), and P^T of the current step. */
typedef struct {
    float st[2][K_BLOCK * Q_TILE] __attribute__((aligned(64))); /* S^T: [keys][16 q] */
    uint16_t pt[K_BLOCK / 2 * 32] __attribute__((aligned(64)));  /* P^T, VNNI: [key pairs][16 q x 2] */
} step_scratch;

/* S^T = K Q^T for the 64 keys at k_rows (row stride in bytes) and one query tile, in D / 32 + 1
 * pieces: piece 0 zeroes the four C tiles (16 keys each) and adds dims 0-31, piece p < D / 32 adds
 * dims 32p .. 32p + 31, the last piece stores S^T. The softmax of the step before issues them one
 * by one between runs of its own vector work (softmax_step), so that the tile unit works while the
 * vector units do. */
AMX_TARGET static inline void scores_piece(const query_tile *t, const uint16_t *k_rows, int64_t stride, int64_t D,
                                           int64_t piece, float *st) {
    if (piece == D / 32) {
        _tile_stored(0, st, 64);
        _tile_stored(1, st + 16 * Q_TILE, 64);
        _tile_stored(2, st + 32 * Q_TILE, 64);
        _tile_stored(3, st + 48 * Q_TILE, 64);
        return;
    }
    if (piece == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    _tile_loadd(5, t->qt + piece * 16 * Q_TILE, 64);
    const char *kr = (const char *)(k_rows + piece * 32);
    _tile_loadd(4, kr, stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(4, kr + 16 * stride, stride);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(4, kr + 32 * stride, stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(4, kr + 48 * stride, stride);
    _tile_dpbf16ps(3, 4, 5);
}

/* The S^T product a softmax step computes on the side for the step after it (NULL: none). */
typedef struct {
    const query_tile *tile;
    const uint16_t *k_rows;
    int64_t stride;
    float *st;
} next_scores;

/* Which keys a query sees, and how its scores are made (cpu_flash.c's flash_problem fields). */
typedef struct {
    int64_t S, q_offset, window; /* causal: query i sees keys (i + q_offset - window, i + q_offset] */
    int causal;
    float s2;      /* the exponent's factor: scale log2 e, or log2 e for capped scores (they carry the scale) */
    float softcap; /* 0: none; else s -> softcap tanh(pre_cap s) */
    float pre_cap; /* scale / softcap */
} score_rule;

/* The first and last key query i sees, before clipping to [0, S) (cpu_flash.c's key_lo, key_hi):
 * both grow with i, so queries [a, b] see keys key_lo(a)..key_hi(b) together and the queries (and
 * tiles) that see a key block are a contiguous run. */
static inline int64_t key_lo(const score_rule *rule, int64_t i) {
    return !rule->causal ? 0 : rule->window ? i + rule->q_offset - rule->window + 1 : INT32_MIN;
}
static inline int64_t key_hi(const score_rule *rule, int64_t i) { return rule->causal ? i + rule->q_offset : rule->S - 1; }

static inline int64_t clip(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

/* The online-softmax step of query tile t against keys k0 .. k0 + 63, whose S^T is in st: updates
 * t's running max and sum (and rescales its O^T where the max moved) and writes P^T for pv_step,
 * issuing `next`'s S^T product piece by piece on the way. */
AMX_TARGET static void softmax_step(query_tile *t, float *st, uint16_t *pt, int64_t k0, int64_t D,
                                    const score_rule *rule, const next_scores *next) {
    /* Which (key, query) pairs are visible: all of them, unless the block reaches past the last
     * key or (causal) past the band of the tile's first query or before that of its last (the
     * tile's columns past its rows see every key, as cpu_flash.c's padding rows do). With softcap
     * the scores are capped in place first; the max is taken over those scores (raw ones: scale > 0). */
    const int64_t S = rule->S, last = t->r0 + t->rows - 1;
    const int full = k0 + K_BLOCK <= S &&
                     (!rule->causal || (k0 + K_BLOCK - 1 <= key_hi(rule, t->r0) && k0 >= key_lo(rule, last)));
    __mmask16 visible[K_BLOCK];
    __m512 raw_top = _mm512_set1_ps(-INFINITY);
    const vfloat cap = vset1(rule->softcap), pre_cap = vset1(rule->pre_cap);
    if (full) {
        for (int j = 0; j < K_BLOCK; ++j) {
            __m512 s = _mm512_load_ps(st + j * Q_TILE);
            if (rule->softcap > 0.0f) _mm512_store_ps(st + j * Q_TILE, s = (__m512)(cap * vtanh((vfloat)s * pre_cap)));
            raw_top = _mm512_max_ps(raw_top, s);
        }
    } else {
        int32_t lo_lanes[Q_TILE], hi_lanes[Q_TILE]; /* each query's band, clipped (int32) */
        for (int64_t n = 0; n < Q_TILE; ++n) {
            lo_lanes[n] = n < t->rows ? (int32_t)clip(key_lo(rule, t->r0 + n), 0, S) : INT32_MIN;
            hi_lanes[n] = n < t->rows ? (int32_t)clip(key_hi(rule, t->r0 + n), -1, S) : INT32_MAX;
        }
        const __m512i lo = _mm512_loadu_si512(lo_lanes), hi = _mm512_loadu_si512(hi_lanes);
        for (int j = 0; j < K_BLOCK; ++j) {
            const int64_t key = k0 + j;
            const __m512i kv = _mm512_set1_epi32((int)key);
            visible[j] = key >= S ? 0
                                  : _mm512_cmp_epi32_mask(kv, hi, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(kv, lo, _MM_CMPINT_NLT);
            __m512 s = _mm512_load_ps(st + j * Q_TILE);
            if (rule->softcap > 0.0f) _mm512_store_ps(st + j * Q_TILE, s = (__m512)(cap * vtanh((vfloat)s * pre_cap)));
            raw_top = _mm512_mask_max_ps(raw_top, visible[j], raw_top, s);
        }
    }
    const float s2 = rule->s2;
    /* In base 2: y = s * scale * log2 e. The running max m moves only where a block's max exceeds
     * it, which soon becomes rare: most blocks leave O^T alone and their P V adds straight onto it
     * in the tiles. (Letting m lag a little behind the max would skip more rescales, but the
     * largest p would then no longer be exactly 1 in bf16: measured twice the error.) Where m
     * moves, alpha = 2^(m_old - m_new) rescales what came before (0 where nothing did); queries
     * that have seen no key yet keep m = -inf and subtract 0 instead (their p are masked). */
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), vs2 = _mm512_set1_ps(s2);
    const __m512 top = _mm512_mul_ps(raw_top, vs2); /* -inf * s2 stays -inf */
    const __mmask16 had = _mm512_cmp_ps_mask(t->m, minus_inf, _CMP_NEQ_OQ);
    const __mmask16 moved = _mm512_cmp_ps_mask(top, t->m, _CMP_GT_OQ);
    if (moved) {
        const __m512 m_new = _mm512_mask_mov_ps(t->m, moved, top);
        const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moved,
                                                _mm512_maskz_mov_ps(had, exp2_512(_mm512_maskz_sub_ps(had, t->m, m_new))));
        t->l = _mm512_mul_ps(t->l, alpha);
        for (int64_t d = 0; d < D; ++d)
            _mm512_store_ps(t->acc + d * Q_TILE, _mm512_mul_ps(_mm512_load_ps(t->acc + d * Q_TILE), alpha));
        t->m = m_new;
    }
    const __m512 shift = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t->m, minus_inf, _CMP_NEQ_OQ), t->m);
    const __m512i pair_order = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                                 0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                                 0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d, 0x001e000e,
                                                 0x001f000f);
    /* next's products spread over the loop, one before each of D / 32 equal runs of iterations;
     * its stores after the loop */
    const int64_t runs = next ? D / 32 : 1;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t run = 0; run < runs; ++run) {
        if (next) scores_piece(next->tile, next->k_rows, next->stride, D, run, next->st);
        const int64_t i_end = (run + 1) * (K_BLOCK / 2) / runs;
        for (int64_t i = run * (K_BLOCK / 2) / runs; i < i_end; ++i) {
            __m512 p0 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(st + 2 * i * Q_TILE), vs2, shift));
            __m512 p1 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(st + (2 * i + 1) * Q_TILE), vs2, shift));
            if (!full) {
                p0 = _mm512_maskz_mov_ps(visible[2 * i], p0);
                p1 = _mm512_maskz_mov_ps(visible[2 * i + 1], p1);
            }
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            /* VNNI row i of P^T: (key 2i, key 2i+1) for each query, as bf16 pairs */
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_store_si512((__m512i *)(pt + i * 32), _mm512_permutexvar_epi16(pair_order, both));
        }
    }
    if (next) scores_piece(next->tile, next->k_rows, next->stride, D, D / 32, next->st);
    t->l = _mm512_add_ps(t->l, sum);
}

/* O^T += V^T P^T for query tile t and keys k0 .. k0 + 63, four 16-dim C tiles at a time, loaded
 * from and stored back to O^T. */
AMX_TARGET static void pv_step(query_tile *t, const uint16_t *pt, const uint16_t *v_head, int64_t k0, int64_t D) {
    const int64_t dim_tiles = D / 16;
    for (int64_t dt0 = 0; dt0 < dim_tiles; dt0 += 4) {
        const int64_t n = dim_tiles - dt0 < 4 ? dim_tiles - dt0 : 4; /* D % 32 == 0: 2 or 4 */
        float *o = t->acc + dt0 * 16 * Q_TILE;
        _tile_loadd(0, o, 64);
        _tile_loadd(1, o + 16 * Q_TILE, 64);
        if (n == 4) {
            _tile_loadd(2, o + 32 * Q_TILE, 64);
            _tile_loadd(3, o + 48 * Q_TILE, 64);
        }
        for (int64_t c = 0; c < K_BLOCK / 32; ++c) {
            _tile_loadd(5, pt + c * 16 * 32, 64);
            const uint16_t *vc = v_head + (k0 / 32 + c) * D * 32 + dt0 * 16 * 32;
            _tile_loadd(4, vc, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(4, vc + 16 * 32, 64);
            _tile_dpbf16ps(1, 4, 5);
            if (n == 4) {
                _tile_loadd(4, vc + 32 * 32, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(4, vc + 48 * 32, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o, 64);
        _tile_stored(1, o + 16 * Q_TILE, 64);
        if (n == 4) {
            _tile_stored(2, o + 32 * Q_TILE, 64);
            _tile_stored(3, o + 48 * Q_TILE, 64);
        }
    }
}

/* A row's LSE (natural log) from its running max m (base 2, scaled scores) and sum l; -inf for a
 * row that saw no key. */
static inline float row_lse(float m, float l) {
    return l > 0.0f ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
}

/* Whether query tile t sees any key of block k0 (some query's band meets [k0, k0 + 63] below S):
 * its queries together see key_lo(first)..key_hi(last). */
static int tile_sees(const query_tile *t, int64_t k0, const score_rule *rule) {
    const int64_t lo = clip(key_lo(rule, t->r0), k0, rule->S), hi = clip(key_hi(rule, t->r0 + t->rows - 1), -1, rule->S - 1);
    return lo <= hi && lo <= k0 + K_BLOCK - 1;
}

/* The first tile of a unit from tile i on that sees key block k0, or n_tiles when none does (the
 * tiles that see a block are a contiguous run: both ends of the band grow with the query). */
static int64_t first_seeing(const query_tile *tiles, int64_t i, int64_t n_tiles, int64_t k0, const score_rule *rule) {
    while (i < n_tiles && !tile_sees(tiles + i, k0, rule)) ++i;
    return i;
}

/* The query head and token of a unit's row r: row r of head h, or, for a unit over a whole GQA
 * group (group > 0), row r of the group's rows taken head by head (r / T is the head in the group). */
static inline void unit_row(int64_t r, int64_t h, int64_t kv, int64_t group, int64_t T, int64_t *head,
                            int64_t *token) {
    *head = group ? kv * group + r / T : h;
    *token = group ? r % T : r;
}

/* One unit: query head h (KV head kv), queries r0 .. r0 + Q_BLOCK - 1, as Q_BLOCK / 16 tiles that
 * take each key block in turn while it is in L1 (per query tile, K and V came from memory once
 * per 16 queries, and the kernel was bound by it at 16K keys). The steps (key block, tile) run in
 * that order; each one's softmax computes the next one's scores on the side. keys: the unit's
 * KV head's (set_key_rows); v_head: its packed V^T. Not causal, a unit may take a span of the keys
 * only, [k_begin, k_end) in whole key blocks: it then leaves its rows' unnormalized output, max and
 * sum in `span` (span_rows, below) for merge_spans instead of writing out and lse. */
typedef struct {
    float *acc, *m, *l; /* [spans][Hq][T][D], [spans][Hq][T] x 2 */
    int64_t index, Hq;  /* this unit's span, the query heads */
} span_rows;

AMX_TARGET static void attend_unit(const uint16_t *q, int64_t q_rs, int64_t q_hs, const key_rows *keys,
                                   const uint16_t *v_head, int64_t T, int64_t D, const score_rule *rule,
                                   uint16_t *out, int64_t o_rs, int64_t o_hs, float *lse, int64_t h, int64_t kv,
                                   int64_t group, int64_t r0, int64_t k_begin, int64_t k_end, const span_rows *span,
                                   query_tile *tiles, step_scratch *scratch) {
    const int64_t rows = group ? group * T : T; /* the unit's rows: one head's, or its GQA group's */
    const int64_t n_tiles = (rows - r0 + Q_TILE - 1) / Q_TILE < Q_BLOCK / Q_TILE ? (rows - r0 + Q_TILE - 1) / Q_TILE
                                                                                   : Q_BLOCK / Q_TILE;
    for (int64_t i = 0; i < n_tiles; ++i) {
        query_tile *t = tiles + i;
        t->r0 = r0 + i * Q_TILE;
        t->rows = rows - t->r0 < Q_TILE ? rows - t->r0 : Q_TILE;
        /* Q^T in VNNI order: word (p, n) = dims 2p, 2p+1 of query n, q's rows as words, transposed */
        for (int64_t n = 0; n < Q_TILE; ++n) {
            if (n >= t->rows) { /* past the unit's last row: zero columns */
                for (int64_t p = 0; p < D / 2; ++p) t->qt[p * Q_TILE + n] = 0;
                continue;
            }
            int64_t head, token;
            unit_row(t->r0 + n, h, kv, group, T, &head, &token);
            const uint32_t *row = (const uint32_t *)(q + token * q_rs + head * q_hs);
            for (int64_t p = 0; p < D / 2; ++p) t->qt[p * Q_TILE + n] = row[p];
        }
        memset(t->acc, 0, sizeof(float) * (size_t)(D * Q_TILE));
        t->m = _mm512_set1_ps(-INFINITY);
        t->l = _mm512_setzero_ps();
    }
    const query_tile *last = tiles + n_tiles - 1;
    const int64_t S = rule->S;
    /* causal: the keys the unit's queries see together, its first query's band to its last's (a
     * span of whole blocks otherwise); the steps go block by block from the block of the first,
     * each to the run of tiles that see it (at least one: every key of the range is seen) */
    const int64_t key_first = rule->causal ? clip(key_lo(rule, tiles->r0), 0, S) : k_begin;
    const int64_t key_end = rule->causal ? clip(key_hi(rule, last->r0 + last->rows - 1) + 1, 0, S) : k_end;

    int64_t k0 = key_first / K_BLOCK * K_BLOCK, current = 0, stride;
    int64_t i = first_seeing(tiles, 0, n_tiles, k0, rule);
    if (key_first < key_end) { /* else no query sees a key: m -inf, l 0, out 0 below */
        const uint16_t *k_rows = block_keys(keys, k0, D, &stride);
        for (int64_t piece = 0; piece <= D / 32; ++piece) scores_piece(tiles + i, k_rows, stride, D, piece, scratch->st[0]);
    }
    for (; key_first < key_end;) {
        int64_t next_k0 = k0, next_i = i + 1;
        if (next_i == n_tiles || !tile_sees(tiles + next_i, k0, rule)) {
            next_k0 = k0 + K_BLOCK;
            next_i = first_seeing(tiles, 0, n_tiles, next_k0, rule);
        }
        const int more = next_k0 < key_end && next_i < n_tiles; /* (a block in the range: a tile sees it) */
        next_scores next = {NULL, NULL, 0, NULL};
        if (more) {
            next.tile = tiles + next_i, next.st = scratch->st[current ^ 1];
            next.k_rows = block_keys(keys, next_k0, D, &next.stride);
        }
        softmax_step(tiles + i, scratch->st[current], scratch->pt, k0, D, rule, more ? &next : NULL);
        pv_step(tiles + i, scratch->pt, v_head, k0, D);
        if (!more) break;
        k0 = next_k0, i = next_i, current ^= 1;
    }

    /* out = O / l, lse = (m + log2 l) ln 2; a query that saw no key gets 0 and -inf */
    for (int64_t i = 0; i < n_tiles; ++i) {
        const query_tile *t = tiles + i;
        float ls[Q_TILE], ms[Q_TILE], inv[Q_TILE];
        _mm512_storeu_ps(ls, t->l);
        _mm512_storeu_ps(ms, t->m);
        int64_t heads[Q_TILE], tokens[Q_TILE];
        if (span) { /* this span's part, merged by merge_spans */
            for (int64_t n = 0; n < t->rows; ++n) {
                unit_row(t->r0 + n, h, kv, group, T, heads + n, tokens + n);
                const int64_t row = (span->index * span->Hq + heads[n]) * T + tokens[n];
                span->m[row] = ms[n], span->l[row] = ls[n];
                for (int64_t d = 0; d < D; ++d) span->acc[row * D + d] = t->acc[d * Q_TILE + n];
            }
            continue;
        }
        for (int64_t n = 0; n < t->rows; ++n) {
            unit_row(t->r0 + n, h, kv, group, T, heads + n, tokens + n);
            inv[n] = ls[n] > 0.0f ? 1.0f / ls[n] : 0.0f;
            lse[heads[n] * T + tokens[n]] = row_lse(ms[n], ls[n]);
        }
        for (int64_t d = 0; d < D; ++d)
            for (int64_t n = 0; n < t->rows; ++n)
                store_one(out + tokens[n] * o_rs + heads[n] * o_hs, 1, d, bf16_round(t->acc[d * Q_TILE + n] * inv[n]));
    }
}

/* out and lse of query rows [r0, r1) (row = head * T + token) from their spans' parts: the
 * flash-decoding merge, in base 2 as the units keep their max, spans in order. */
static void merge_spans(const span_rows *span, int64_t spans, int64_t T, int64_t D, int64_t r0, int64_t r1,
                        uint16_t *out, int64_t o_rs, int64_t o_hs, float *lse) {
    float acc[MAX_D];
    for (int64_t row = r0; row < r1; ++row) {
        const int64_t stride = span->Hq * T;
        float m = -INFINITY, l = 0.0f;
        for (int64_t s = 0; s < spans; ++s) m = span->m[s * stride + row] > m ? span->m[s * stride + row] : m;
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
        if (m != -INFINITY)
            for (int64_t s = 0; s < spans; ++s) {
                const float ms = span->m[s * stride + row];
                if (ms == -INFINITY) continue;
                const float w = exp2f(ms - m);
                l += span->l[s * stride + row] * w;
                const float *part = span->acc + (s * stride + row) * D;
                for (int64_t d = 0; d < D; ++d) acc[d] += part[d] * w;
            }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int64_t head = row / T, token = row % T;
        lse[row] = row_lse(m, l);
        for (int64_t d = 0; d < D; ++d) store_one(out + token * o_rs + head * o_hs, 1, d, bf16_round(acc[d] * inv));
    }
}

int ringctx_amx_attention(const uint16_t *q, int64_t q_rs, int64_t q_hs, const uint16_t *k, int64_t k_rs,
                          int64_t k_hs, const uint16_t *v, int64_t v_rs, int64_t v_hs, int64_t T, int64_t S,
                          int64_t Hq, int64_t Hkv, int64_t D, int causal, int64_t q_offset, int64_t window,
                          float scale, float softcap, uint16_t *out, int64_t o_rs, int64_t o_hs, float *lse,
                          int threads) {
    if (!amx_usable()) return -1;
    /* the limits of cpu_flash.c's flash_attention */
    if (D % 32 || D > MAX_D || Hkv < 1 || Hq % Hkv || T < 1 || S < 1 || T > INT32_MAX || S > INT32_MAX ||
        !(scale > 0.0f) || !(softcap >= 0.0f) || softcap == INFINITY || window < 0 || window > INT32_MAX ||
        q_offset > INT32_MAX || q_offset < -(int64_t)INT32_MAX || (!causal && (q_offset || window)))
        return -2;
    const float log2e = 1.44269504088896341f; /* softmax in base 2: exp(x) = 2^(x log2 e) */
    const score_rule rule = {S, causal ? q_offset : 0, causal ? window : 0, causal, softcap > 0.0f ? log2e : scale * log2e,
                             softcap, softcap > 0.0f ? scale / softcap : 0.0f};
    const int64_t padded = (S + K_BLOCK - 1) / K_BLOCK * K_BLOCK, group = Hq / Hkv;
    /* Without a mask every query row of a KV head's group sees the same keys: its group's rows share
     * tiles (a question of T tokens fills group x T columns, not group tiles of T), where that
     * takes fewer tiles: 20 queries of GQA 3 over 8K keys took 0.72-0.75x the time, 5 queries
     * 0.6x (docs/BENCHMARKS.md). A causal block keeps one head per tile (the mask follows the rows). */
    const int64_t by_group = !causal && group > 1 &&
                             (group * T + Q_TILE - 1) / Q_TILE < group * ((T + Q_TILE - 1) / Q_TILE);
    const int64_t rows = by_group ? group * T : T;
    const int pack_k = group * T >= K_PACK_FROM_ROWS;
    uint16_t *vt = (uint16_t *)aligned_alloc(64, (size_t)(Hkv * padded * D) * 2);
    uint16_t *kp = pack_k ? (uint16_t *)aligned_alloc(64, (size_t)(Hkv * padded * D) * 2) : NULL;
    if (!vt || (pack_k && !kp)) {
        free(vt);
        free(kp);
        return -3;
    }
    const int64_t q_blocks = (rows + Q_BLOCK - 1) / Q_BLOCK, query_units = (by_group ? Hkv : Hq) * q_blocks;
    /* A question over a document makes one unit per KV head: with fewer units than threads, or a
     * number that does not divide among them, cores sit idle while others stream their heads'
     * K and V. Such calls (not causal) also split the keys into spans of whole key blocks, to
     * SPLIT_TO_UNITS units where the keys allow, each span's part merged by log-sum-exp at the
     * end. The split follows the shapes alone, never the threads: a call's bits do not depend on
     * how many threads run it. */
    int64_t spans = 1, span_keys = padded;
    if (!causal && query_units < SPLIT_TO_UNITS) {
        const int64_t most = S / SPAN_MIN_KEYS;
        spans = (SPLIT_TO_UNITS + query_units - 1) / query_units;
        spans = spans < most ? spans : most > 1 ? most : 1;
        span_keys = ((S + spans - 1) / spans + K_BLOCK - 1) / K_BLOCK * K_BLOCK;
        spans = (S + span_keys - 1) / span_keys;
    }
    const int64_t units = query_units * spans;
    span_rows span = {NULL, NULL, NULL, 0, Hq};
    if (spans > 1) {
        span.acc = (float *)malloc(sizeof(float) * (size_t)(spans * Hq * T * (D + 2)));
        if (!span.acc) {
            free(vt);
            free(kp);
            return -3;
        }
        span.m = span.acc + spans * Hq * T * D, span.l = span.m + spans * Hq * T;
    }
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        query_tile tiles[Q_BLOCK / Q_TILE];
        step_scratch scratch;
        key_rows *keys = (key_rows *)aligned_alloc(64, sizeof(key_rows));
        int64_t keys_of = -1; /* the KV head `keys` holds */
        if (!keys) {
#pragma omp atomic write
            failed = 1;
        }
        if (pack_k) pack_keys(k, k_rs, k_hs, S, Hkv, D, padded, kp);
        pack_values(v, v_rs, v_hs, S, Hkv, D, padded / 32, vt); /* the loop's end is a barrier */
        configure_tiles();
        /* Units ordered by KV head (its K and V stay in this core's cache), then largest first
         * (causal: later queries see more keys), handed out as threads free up. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t su = 0; su < units; ++su) {
            if (!keys) continue;
            const int64_t u = su / spans; /* the query unit, and its span su % spans */
            int64_t kv, h, qb;
            if (by_group) {
                kv = u / q_blocks, qb = q_blocks - 1 - u % q_blocks, h = -1;
            } else {
                const int64_t rest = u % (group * q_blocks);
                kv = u / (group * q_blocks), qb = q_blocks - 1 - rest / group, h = kv * group + rest % group;
            }
            span_rows mine = span;
            mine.index = su % spans;
            const int64_t k_begin = mine.index * span_keys, k_end = k_begin + span_keys < S ? k_begin + span_keys : S;
            if (kv != keys_of) {
                if (pack_k) set_key_rows(keys, kp + kv * padded * D, D, S, D, 1);
                else set_key_rows(keys, k + kv * k_hs, k_rs, S, D, 0);
                keys_of = kv;
            }
            attend_unit(q, q_rs, q_hs, keys, vt + kv * padded * D, T, D, &rule, out, o_rs, o_hs, lse, h,
                        kv, by_group ? group : 0, qb * Q_BLOCK, k_begin, k_end, spans > 1 ? &mine : NULL, tiles,
                        &scratch);
        }
        release_tiles();
        free(keys);
        if (spans > 1) { /* after the loop's barrier: every span's part is in */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < Hq * T; r += 16)
                merge_spans(&span, spans, T, D, r, r + 16 < Hq * T ? r + 16 : Hq * T, out, o_rs, o_hs, lse);
        }
    }
    free(vt);
    free(kp);
    free(span.acc);
    return failed ? -3 : 0;
}

/* ------------------------------------------------------------------------------------------
 * Small matrix products on the tiles: y [M, N] = x [M, K] . w [N, K]^T for bf16 x and w and a few
 * rows (a question's prefill, a short prompt); y float32, or bf16 rounded once.
 *
 * Computed transposed, y^T = W X^T, so that 16 rows of W (32 of K wide) are an A tile read in
 * place with W's row stride, and X^T, built once per call in VNNI order, is the B tiles. Each
 * thread takes a share of W's 16-row blocks and streams them once for all of x's rows (up to 4
 * tiles of 16). Measured (2 cores, SmolLM2's 1536 x 576 weights from memory, 60 of them): 0.73-0.85x
 * the time of PyTorch's bf16 matmul (oneDNN) at 9-16 rows, 0.9-1.0x at 20-48, 1.1x at 64.
 * ------------------------------------------------------------------------------------------ */

/* y's 16 x 16 block at rows m0.., columns n0.. from a C tile stored in buf (C^T: [16 n][16 m]),
 * as float32 or rounded once to bf16. */
static void store_transposed(const float *buf, void *y, int y_bf16, int64_t M, int64_t N, int64_t m0, int64_t n0) {
    for (int64_t m = 0; m < 16 && m0 + m < M; ++m)
        for (int64_t i = 0; i < 16; ++i)
            store_one(y, y_bf16, (m0 + m) * N + n0 + i, round_to(buf[i * 16 + m], y_bf16));
}

int ringctx_amx_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, void *y, int y_bf16,
                       int threads) {
    if (!amx_usable()) return -1;
    if (M < 1 || M > AMX_LINEAR_MAX_ROWS || K < 32 || K % 32 || N < 16 || N % 16) return -2;
    const int64_t m_tiles = (M + 15) / 16, k_steps = K / 32, n_blocks = N / 16;
    /* X^T in VNNI order per (m tile, 32 of K): word (p, n) = x[16 mt + n][32 ks + 2p .. 2p + 1] */
    uint32_t *xt = (uint32_t *)aligned_alloc(64, (size_t)(m_tiles * k_steps * 256) * 4);
    if (!xt) return -3;
    for (int64_t mt = 0; mt < m_tiles; ++mt)
        for (int64_t ks = 0; ks < k_steps; ++ks) {
            uint32_t *dst = xt + (mt * k_steps + ks) * 256;
            for (int64_t n = 0; n < 16; ++n) {
                const int64_t m = mt * 16 + n;
                const uint32_t *row = (const uint32_t *)(x + m * K + ks * 32);
                for (int64_t p = 0; p < 16; ++p) dst[p * 16 + n] = m < M ? row[p] : 0;
            }
        }
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float buf[256] __attribute__((aligned(64)));
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < n_blocks; ++nb) {
            const char *a = (const char *)(w + nb * 16 * K);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t ks = 0; ks < k_steps; ++ks) {
                _tile_loadd(4, a + ks * 64, K * 2);
                const uint32_t *b = xt + ks * 256;
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (m_tiles > 1) {
                    _tile_loadd(5, b + k_steps * 256, 64);
                    _tile_dpbf16ps(1, 4, 5);
                }
                if (m_tiles > 2) {
                    _tile_loadd(5, b + 2 * k_steps * 256, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (m_tiles > 3) {
                    _tile_loadd(5, b + 3 * k_steps * 256, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, buf, 64);
            store_transposed(buf, y, y_bf16, M, N, 0, nb * 16);
            if (m_tiles > 1) {
                _tile_stored(1, buf, 64);
                store_transposed(buf, y, y_bf16, M, N, 16, nb * 16);
            }
            if (m_tiles > 2) {
                _tile_stored(2, buf, 64);
                store_transposed(buf, y, y_bf16, M, N, 32, nb * 16);
            }
            if (m_tiles > 3) {
                _tile_stored(3, buf, 64);
                store_transposed(buf, y, y_bf16, M, N, 48, nb * 16);
            }
        }
        release_tiles();
    }
    free(xt);
    return 0;
}

int ringctx_amx_available(void) { return amx_usable(); }

#else /* a compiler without AMX intrinsics: the backend reports itself unavailable */

int ringctx_amx_attention(const uint16_t *q, int64_t q_rs, int64_t q_hs, const uint16_t *k, int64_t k_rs,
                          int64_t k_hs, const uint16_t *v, int64_t v_rs, int64_t v_hs, int64_t T, int64_t S,
                          int64_t Hq, int64_t Hkv, int64_t D, int causal, int64_t q_offset, int64_t window,
                          float scale, float softcap, uint16_t *out, int64_t o_rs, int64_t o_hs, float *lse,
                          int threads) {
    return -1;
}

int ringctx_amx_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, void *y, int y_bf16,
                       int threads) {
    return -1;
}

int ringctx_amx_available(void) { return 0; }

#endif
