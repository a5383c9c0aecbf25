/* Decode steps of a Llama-family decoder: B tokens, one per sequence, through every layer in one
 * call (built with cpu_kernels.c by ringctx/kernels/build.py, once per variant, see cpu_simd.h;
 * driven by ringctx/model/decode_step.py, where a lone answer is a batch of one).
 *
 * Why: a decode step should take the time to read the weights and the KV cache once. Run as
 * PyTorch ops, a layer of a small model is ~40 ops on vectors of a few hundred elements, and
 * their dispatch (5-60 us each on a laptop-class CPU) costs about as much as the reading itself.
 * Here the whole step runs in OpenMP parallel regions: the matrix products and the attention are
 * split over the threads, the small per-token operations run in between, and nothing returns to
 * Python until the last layer is done (or, over several ranks, until a layer's merge).
 *
 * The math is that of ringctx/model/transformer.py (which follows transformers), with the same
 * roundings; round() is to bf16 for a bf16 model and nothing for a float32 one:
 *
 *   xn   = round(x * rsqrt(mean(x^2) + eps) * w_norm)     RMSNorm, float32 inside
 *   qkv  = round(xn Wqkv^T + b)                           float32 accumulation (gemv_block)
 *   q, k = round(q * rsqrt(mean(q^2) + eps) * w_qnorm)    per head, Qwen3 only (likewise k)
 *   q, k = round(round(x cos) + roll(x, R/2) sin)         rotate-half RoPE over the layer's first R
 *                                                         dims (its own table; none: a NoPE layer)
 *   K, V cache row `position` = k, v        (8-bit caches: quantized per head, with its scale)
 *   s    = q K^T scale  (softcap > 0: softcap tanh(s / softcap))   the layer's scale and soft-cap
 *   o    = softmax(s) V                                   over the rows the layer's span lets the
 *                                                         query see (window, aligned chunk)
 *   o    = round(o sigmoid(lse - sink[h]))                sinks: once, after every source's merge
 *   h    = round(x + round(o Wo^T + bo))
 *   g, u = round(round(norm(h)) W13^T)                    gate and up halves
 *   x'   = round(h + round(round(round(silu(g)) u) W2^T))
 *
 * A layer with a mixture of experts (Mixtral, Qwen3-MoE: ringctx/model/moe.py) replaces the last
 * two lines (layer_experts below): the router's logits round(norm(h) Wr^T), their float32 softmax,
 * each row's k most probable experts (ties: the lower index), renormalised and rounded as the
 * shape says; then each expert that some row chose, in expert order, reads its weights once for
 * all of its rows, and x' = round(h + round(sum over the row's experts of y_e w_e)), the sum in
 * float32 in expert order (index_add's).
 *
 * Sums run in another order than PyTorch's, so results agree to float32 rounding (a bf16 value
 * may land one step away), not bit for bit.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <omp.h>

#include "cpu_kernels.h"

typedef struct {
    int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim;
    float norm_eps, softmax_scale;
    int32_t bf16;  /* 1: weights and activations are bf16 (and caches in the model dtype); 0: float32 */
    /* The mixture of experts of the layers that have a router (one for every such layer): E experts
     * of hidden width F, k per row; 0 experts: every layer dense. */
    int64_t n_experts, experts_per_token, expert_ffn_dim;
    int32_t renormalize;             /* the k weights are divided by their sum (float32) */
    int32_t weights_in_model_dtype;  /* the weights are rounded to the model dtype before they multiply */
} ringctx_decoder_shape;

typedef struct {
    const void *attention_norm; /* [dim] */
    const void *wqkv, *bqkv;    /* [(Hq + 2 Hkv) D, dim], rows q heads, k heads, v heads; bias or NULL */
    const void *wo, *bo;        /* [dim, Hq D]; bias or NULL */
    const void *ffn_norm;       /* [dim] */
    const void *w13;            /* [2 ffn, dim]: the gate rows, then the up rows */
    const void *w2;             /* [dim, ffn] */
    const void *q_norm, *k_norm; /* [D] per-head RMSNorm weights of q and k before RoPE (Qwen3), else NULL */
    /* Int8 weights (bf16 models; see cpu_kernels.h): the codes [out, in] of wqkv, wo, w13, w2 and
     * their group exponents [out, in / W8_GROUP], or NULL. The w* above stay the bf16 values the
     * codes stand for; a product reads one or the other (INT8_MAX_ROWS), with the same result. */
    const int8_t *wqkv_codes, *wo_codes, *w13_codes, *w2_codes;
    const int8_t *wqkv_exps, *wo_exps, *w13_exps, *w2_exps;
    /* The layer's attention as data (ringctx/attention/spans.py's LayerSoftmax, the model's
     * LayerRopes): what its queries see, how scores are scaled and capped, and how q, k rotate. */
    const float *sinks;   /* [Hq] float32 sink logits (gpt-oss), or NULL */
    int64_t window;       /* sliding window W: a query at p sees keys p-W+1 .. p; 0: none */
    int64_t chunk;        /* aligned chunk C: a query at p sees keys from C (p / C) on; 0: none */
    int64_t rotary_dim;   /* dims of a head that rotate (pairs (i, i + rotary_dim / 2)); the rest pass */
    float scale;          /* multiplies q.k (the decode step's; the prefill takes the shape's) */
    float softcap;        /* > 0: scores become softcap tanh(s / softcap); 0: none */
    int32_t rope;         /* which cos/sin table rotates this layer's q and k; -1: none (NoPE) */
    /* A mixture of experts in place of the dense MLP: the router [E, dim], and then w13 is
     * [E, 2F, dim] and w2 [E, dim, F] (each expert's matrices one after the other); NULL: dense. */
    const void *router;
} ringctx_decoder_layer;

/* A step over several ranks: called once per layer (its index the argument), after this rank's
 * attention, to merge every rank's float32 partials and write the merged output, with the layer's
 * sinks applied and rounded to the model dtype, into the attn rows (see ringctx_decode_step_batch). */
typedef void (*ringctx_merge_fn)(int64_t layer);

/* The widest input of the step's matrix products: its rows are split there for the bf16 pair path
 * (see linear_rows). */
static int64_t widest_input(const ringctx_decoder_shape *s) {
    const int64_t attn = s->n_heads * s->head_dim, wide = s->dim > s->ffn_dim ? s->dim : s->ffn_dim;
    const int64_t widest = wide > attn ? wide : attn;
    return s->expert_ffn_dim > widest ? s->expert_ffn_dim : widest;
}

/* exp(x) by the kernels' vector exp, so that every exponential of a step is computed alike. */
static inline float exp1(float x) { return vexp(vset1(x))[0]; }

/* e4m3 ("fn") byte of y, |y| <= 448, rounded to nearest even: as PyTorch's float8_e4m3fn cast. */
static inline uint8_t to_e4m3(float y) {
    const uint8_t sign = signbit(y) ? 0x80 : 0x00;
    const float a = fabsf(y);
    if (a < 0.015625f)  /* below 2^-6: subnormals, steps of 2^-9 (a rounding up to 8 is the first normal) */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    uint32_t u;
    memcpy(&u, &a, sizeof u);
    u += 0x7FFFFu + ((u >> 20) & 1u); /* round the 23 mantissa bits to 3, ties to even */
    const uint32_t exponent = (u >> 23) - 127 + 7, mantissa = (u >> 20) & 7u;
    return sign | (uint8_t)(exponent << 3) | (uint8_t)mantissa;
}

/* out[i] = the e4m3 byte of x[i] (|x| <= 448): the fused step's encoder, for tests. */
void ringctx_encode_e4m3(const float *x, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = to_e4m3(x[i]);
}

/* One head's new row x [d] into an 8-bit cache: scale = amax / limit, data = x / scale rounded
 * (as ringctx.attention.quant.quantize_rows does it). */
static void store_q8(int kind, const float *x, int64_t d, int8_t *data, float *scale) {
    const float limit = kind == Q8_INT8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float s = amax / limit, divisor = s > 0.0f ? s : 1.0f;
    *scale = s;
    for (int64_t i = 0; i < d; ++i) {
        float y = x[i] / divisor;
        y = y > limit ? limit : y < -limit ? -limit : y;
        data[i] = kind == Q8_INT8 ? (int8_t)nearbyintf(y) : (int8_t)to_e4m3(y);
    }
}

/* Int8 weights need a bf16 model (their values are bf16 values) and inputs of whole groups. */
static int int8_weights_fit(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layers, int64_t n_layers) {
    const int64_t dim = s->dim % W8_GROUP, attn = (s->n_heads * s->head_dim) % W8_GROUP, ffn = s->ffn_dim % W8_GROUP;
    for (int64_t i = 0; i < n_layers; ++i) {
        const ringctx_decoder_layer *l = layers + i;
        if ((l->wqkv_codes || l->wo_codes || l->w13_codes || l->w2_codes) && !s->bf16) return 0;
        if ((l->wqkv_codes && (dim || !l->wqkv_exps)) || (l->wo_codes && (attn || !l->wo_exps)) ||
            (l->w13_codes && (dim || !l->w13_exps)) || (l->w2_codes && (ffn || !l->w2_exps)))
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------
 * A batch of B tokens, one per sequence, through every layer (ringctx_decode_step_batch).
 *
 * Why: B sequences decoded together should read each weight matrix once per step, not B times,
 * and each shared document's KV rows once for all the questions on it, with no per-op dispatch.
 * Each matrix product runs gemv_block over all B rows: a block of four weight rows is read from
 * memory once and then from L1 for the other rows, each row's sums in the same order whatever the
 * number of rows. Each row is rotated at its own position.
 *
 * The attention reads a list of sources, each a KV cache (any storage: the model dtype, int8,
 * fp8) with the batch rows whose queries attend it:
 *
 *   sources [0, n_shared)   documents: a document's rows (never written) once for every query on
 *                           it, the B_doc x Hq query rows as one block per KV head (attend_range
 *                           with R = B_doc x group), the keys split over the threads;
 *   sources [n_shared, n)   each one sequence's own rows (its question and answer so far): the
 *                           row's new k, v go to row write_row first (when this rank stores the
 *                           token), then its query attends rows 0 .. keys-1;
 *
 * and each row's partials are merged by log-sum-exp in source order (its document, then its own
 * rows) into a float32 (output, lse) per row and head. A layer with a span (window, aligned chunk)
 * reads of each source only the rows the row's query sees: a source's rows come in segments whose
 * positions increase (one for a cache in position order; a few for a slice a ring prefill wrote
 * piece by piece), so that is one range per row, layer and segment (visible_rows: a binary search
 * over the segment's positions), and a document is then read one row's ranges at a time. A layer's
 * sinks scale the merged output once (finish_attention; over several ranks the merge callback
 * applies them). One rank holding every row: that output,
 * rounded, is the attention. Several ranks: merge() is called once per layer (outside any parallel
 * region, so no kernel thread spins beside the caller's); it merges every rank's partials and
 * writes the rounded output into the attn rows (ringctx_decode_batch_offsets says where).
 *
 * A row's sums do not depend on the rest of the batch: a document's keys are split over the
 * threads by its length alone and attend_range tiles keys the same whatever the number of query
 * rows, so a sequence's logits are those of a batch of one; and a lone answer is a batch of one
 * whose document is the rows its cache held before it began (ringctx/model/decode_step.py).
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    void *const *k, *const *v;               /* [n_layers]: each layer's rows, [rows, Hkv, D] token-major */
    float *const *k_scale, *const *v_scale;  /* [n_layers]: the scales [rows, Hkv] of an 8-bit cache, else NULL */
    const int64_t *rows;                     /* [n_rows]: the batch rows whose queries attend this source */
    int64_t n_rows;
    int64_t keys;       /* rows attended: 0 .. keys-1 */
    int64_t write_row;  /* own rows only (n_rows == 1): the row that takes the token's k, v first; -1: none */
    int32_t kv_q8;      /* -1: the model dtype; Q8_INT8 / Q8_FP8 */
    /* Where the rows lie in their sequence, for layers with a span: row j at positions[j], or at
     * first_position + j when positions is NULL; segments [n_segments] the first row of each run of
     * rows whose positions increase (segments[0] = 0; NULL: one segment, every row). */
    const int64_t *positions;
    int64_t first_position;
    const int64_t *segments;
    int64_t n_segments;
    /* [n_layers]: the first row each layer still stores (rows before it were dropped: a span layer
     * keeps what later tokens see; its k[layer] then points where row 0 would be), or NULL: 0. */
    const int64_t *stored_from;
} ringctx_attention_source;

#define MAX_BATCH 64
/* Most rows a batch step's products read int8 weights' codes for (INT8_MAX_ROWS of
 * ringctx/kernels/abi.py, checked at load): widening a code costs more than widening a bf16 value, and each row
 * widens them again; SmolLM2 steps at 8K tokens took 0.94x the time of the bf16 values' with one
 * row, 1.00x with 2, 1.11x with 4, 1.20x with 8, so more rows read the values (the same sums). */
#define INT8_MAX_ROWS 1

/* Most experts a layer has, and most a row goes through (each thread routes every row of a batch
 * into arrays of these sizes on its stack; Qwen3-235B has 128 experts, top 8). */
#define MAX_EXPERTS 512
#define MAX_EXPERTS_PER_TOKEN 16

/* Layers with a router need the shape's experts within the limits; a model with none, no router. */
static int experts_fit(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layers, int64_t n_layers) {
    int routed = 0;
    for (int64_t i = 0; i < n_layers; ++i) routed |= layers[i].router != NULL;
    if (!routed) return 1;
    return s->n_experts >= 1 && s->n_experts <= MAX_EXPERTS && s->experts_per_token >= 1 &&
           s->experts_per_token <= s->n_experts && s->experts_per_token <= MAX_EXPERTS_PER_TOKEN &&
           s->expert_ffn_dim >= 1;
}

/* Own rows of at least this many keys are split over the threads like a document's; shorter ones
 * take one thread each (a split's barriers and merge would cost more than it saves). */
#define OWN_SPLIT_KEYS 1024

/* Sequences whose queries one pass over a document takes: R = that x group query rows per KV head
 * must stay within MAX_R. */
static int64_t rows_per_pass(const ringctx_decoder_shape *s, int64_t b) {
    const int64_t group = s->n_heads / s->n_kv_heads, most = MAX_R / group;
    return b < most ? b : most;
}

/* Batches of at most this many rows have each thread split the rows of a product's input for
 * itself (see linear_rows): a few thousand floats, less than the wait at a barrier for one thread
 * to split them for all (a lone answer is a batch of one). */
#define SPLIT_BY_EACH_THREAD_ROWS 2

/* Where each [B, .] array of the batch work buffer starts, in floats. */
typedef struct {
    int64_t resid, xn, qkv, attn, part_out, part_lse, gate_up, act, split, queries, logits, moe_sum, moe_x,
        moe_gate_up, moe_act, moe_y, moe_split, threads, per_thread, total;
} batch_layout;

static batch_layout layout_batch(const ringctx_decoder_shape *s, int64_t b, int threads) {
    batch_layout l;
    const int64_t qkv = (s->n_heads + 2 * s->n_kv_heads) * s->head_dim, hq = s->n_heads, d = s->head_dim;
    const int64_t r = rows_per_pass(s, b) * (hq / s->n_kv_heads), rows = s->n_kv_heads * r;
    l.resid = 0;
    l.xn = l.resid + b * s->dim;
    l.qkv = l.xn + b * s->dim;
    l.attn = l.qkv + b * qkv;
    l.part_out = l.attn + b * hq * d;
    l.part_lse = l.part_out + b * hq * d;
    l.gate_up = l.part_lse + hq * b;
    l.act = l.gate_up + b * 2 * s->ffn_dim;
    l.split = l.act + b * s->ffn_dim;
    l.queries = l.split + b * widest_input(s);
    /* a mixture of experts (none: empty): router logits [b, E], the float32 sum [b, dim], and for
     * its P = b k (row, expert) pairs, sorted by expert: their rows gathered [P, dim], gate/up
     * [P, 2F], activations [P, F], outputs [P, dim], and a product's input split [P, max(dim, F)] */
    const int64_t pairs = s->n_experts ? b * s->experts_per_token : 0, F = s->expert_ffn_dim;
    l.logits = l.queries + rows * d;
    l.moe_sum = l.logits + b * s->n_experts;
    l.moe_x = l.moe_sum + (s->n_experts ? b * s->dim : 0);
    l.moe_gate_up = l.moe_x + pairs * s->dim;
    l.moe_act = l.moe_gate_up + pairs * 2 * F;
    l.moe_y = l.moe_act + pairs * F;
    l.moe_split = l.moe_y + pairs * s->dim;
    l.threads = l.moe_split + pairs * (s->dim > F ? s->dim : F);
    /* per thread: attention's m, l, acc and attend_range's buffer; at other times the rows it splits */
    const int64_t attend = 2 * rows + rows * d + attend_range_floats(s->n_kv_heads, r, d);
    const int64_t splits = b <= SPLIT_BY_EACH_THREAD_ROWS ? b * widest_input(s) : 0;
    l.per_thread = attend > splits ? attend : splits;
    l.total = l.threads + (threads < 1 ? 1 : threads > 256 ? 256 : threads) * l.per_thread;
    return l;
}

/* Floats of work buffer that ringctx_decode_step_batch needs for b rows and this thread count. */
int64_t ringctx_decode_batch_work_floats(const ringctx_decoder_shape *s, int64_t b, int threads) {
    return layout_batch(s, b, threads).total;
}

/* Where the work buffer's arrays start (floats): offsets[0] qkv [B, Hq + 2 Hkv, D], [1] attn
 * [B, Hq D], [2] the partial output [B, Hq, D], [3] its lse [Hq, B] (float32 all). */
void ringctx_decode_batch_offsets(const ringctx_decoder_shape *s, int64_t b, int64_t *offsets) {
    const batch_layout l = layout_batch(s, b, 1);
    offsets[0] = l.qkv, offsets[1] = l.attn, offsets[2] = l.part_out, offsets[3] = l.part_lse;
}

/* linear over b rows: y [b, out] = round(x [b, in] W^T + bias), or resid [b, out] = round(resid +
 * that). The split of x for the bf16 pair path: up to SPLIT_BY_EACH_THREAD_ROWS rows each thread
 * makes its own (into `mine`), else one shared copy (`split`, its rows split over the threads). */
static void linear_rows(const float *x, int64_t b, int64_t in, const void *w, const int8_t *codes,
                        const int8_t *exps, const void *bias, int64_t out, int bf16, float *y, float *resid,
                        float *split, float *mine) {
    const int64_t blocks = (out + GEMV_BLOCK - 1) / GEMV_BLOCK;
    if (b > INT8_MAX_ROWS) codes = NULL; /* the bf16 values: the same sums */
    const int pairs = widen_in_pairs(bf16, in) || codes != NULL;
    if (pairs && b <= SPLIT_BY_EACH_THREAD_ROWS) {
        split_pairs(x, b, in, mine);
        split = mine;
    } else if (pairs) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < b; ++r) split_pairs(x + r * in, 1, in, split + r * in);
    }
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t o = blk * GEMV_BLOCK, n = out - o < GEMV_BLOCK ? out - o : GEMV_BLOCK;
        if (codes) gemv_block_pairs_q8(split, b, in, codes, exps, out, y, o, n);
        else if (pairs) gemv_block_pairs(split, b, in, (const uint16_t *)w, out, y, o, n);
        else gemv_block(x, b, in, w, bf16, out, y, o, n);
        for (int64_t r = 0; r < b; ++r)
            for (int64_t i = o; i < o + n; ++i) {
                const float v = round_to(bias ? y[r * out + i] + load_one(bias, bf16, i) : y[r * out + i], bf16);
                if (resid) resid[r * out + i] = round_to(resid[r * out + i] + v, bf16);
                else y[r * out + i] = v;
            }
    }
}

/* The float32 state of one batch step's attention, shared by the functions below. */
typedef struct {
    const ringctx_decoder_shape *s;
    int64_t b, width;          /* rows; floats of one row of qkv */
    float *qkv, *out, *lse;    /* qkv [b, width]; the partial out [b, Hq, D], lse [Hq, b] */
    float *queries;            /* a document pass's gathered queries [Hkv, R, D] */
    float *threads;            /* per thread: m, l, acc of attend_range, then its buffer */
    int64_t per_thread;
    const int64_t *positions;  /* [b]: each row's global position (what a span layer's query sees) */
} batch_attention;

/* The global position of row j of a source. */
static inline int64_t row_position(const ringctx_attention_source *src, int64_t j) {
    return src->positions ? src->positions[j] : src->first_position + j;
}

/* The source's segments that a layer reads (a full layer: one, every row). */
static inline int64_t segments_of(const ringctx_decoder_layer *layer, const ringctx_attention_source *src) {
    return (layer->window == 0 && layer->chunk == 0) || src->segments == NULL ? 1 : src->n_segments;
}

/* Rows [*start, *end) of segment k of the source (clipped to its keys). */
static inline void segment_rows(const ringctx_attention_source *src, int64_t k, int64_t *start, int64_t *end) {
    *start = src->segments && k > 0 ? src->segments[k] : 0;
    *end = src->segments && k + 1 < src->n_segments ? src->segments[k + 1] : src->keys;
    if (*start > src->keys) *start = src->keys;
    if (*end > src->keys) *end = src->keys;
}

/* The first of rows start .. end-1 (positions increasing) at or past global position p (end if
 * none): a binary search. */
static int64_t first_row_from(const ringctx_attention_source *src, int64_t start, int64_t end, int64_t p) {
    int64_t lo = start, hi = end;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (row_position(src, mid) < p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The rows [*lo, *hi) of segment k of a source that a query at position p sees in this layer: all
 * of the source's rows in a full layer (the rows given are the sequence's rows before it, and its
 * own), else those at positions first_visible(p) .. p (ringctx/attention/spans.py's Span): a
 * window's last W, or the query's chunk; one contiguous range, the segment's positions increasing. */
static void visible_rows(const ringctx_decoder_layer *layer, const ringctx_attention_source *src, int64_t k,
                         int64_t p, int64_t *lo, int64_t *hi) {
    if (layer->window == 0 && layer->chunk == 0) {
        *lo = 0, *hi = src->keys;
        return;
    }
    int64_t first = 0, start, end;
    if (layer->window > 0 && p - layer->window + 1 > first) first = p - layer->window + 1;
    if (layer->chunk > 0 && p - p % layer->chunk > first) first = p - p % layer->chunk;
    segment_rows(src, k, &start, &end);
    *lo = first_row_from(src, start, end, first);
    *hi = first_row_from(src, *lo, end, p + 1);
}

/* How many of a source's rows a query at position p sees in this layer (over every segment). */
static int64_t visible_count(const ringctx_decoder_layer *layer, const ringctx_attention_source *src, int64_t p) {
    int64_t count = 0;
    for (int64_t k = 0; k < segments_of(layer, src); ++k) {
        int64_t lo, hi;
        visible_rows(layer, src, k, p, &lo, &hi);
        count += hi - lo;
    }
    return count;
}

/* Merge one partial (o [D] normalised, its lse) into row r, head h of the running state, as
 * PartialAccumulator.add does: the first partial is copied, later ones weighted by exp(lse - new). */
static void merge_partial(const batch_attention *a, int64_t r, int64_t h, const float *o, float lse) {
    const int64_t d = a->s->head_dim, hq = a->s->n_heads;
    float *acc = a->out + (r * hq + h) * d, *acc_lse = a->lse + h * a->b + r;
    if (lse == -INFINITY) return;
    if (*acc_lse == -INFINITY) {
        memcpy(acc, o, (size_t)d * sizeof(float));
        *acc_lse = lse;
        return;
    }
    const float top = *acc_lse > lse ? *acc_lse : lse;
    const float total = top + log1pf(exp1(-fabsf(*acc_lse - lse)));  /* logaddexp */
    const vfloat w_old = vset1(exp1(*acc_lse - total)), w_new = vset1(exp1(lse - total));
    for (int64_t c = 0; c < d; c += VW) vstore(acc + c, vfma(vload(acc + c), w_old, vload(o + c) * w_new));
    *acc_lse = total;
}

/* The threads' partials (m, l, acc over `rows` query rows, in their slots) merged in thread order
 * into o [D] and its lse for query row q: sum_t acc_t e^(m_t - M) / sum_t l_t e^(m_t - M). */
static float merge_thread_row(const batch_attention *a, int64_t rows, int n_threads, int64_t q, float *o) {
    const int64_t d = a->s->head_dim;
    float top = -INFINITY, total = 0.0f, weight[256];
    for (int t = 0; t < n_threads; ++t) {
        const float mt = a->threads[t * a->per_thread + q];
        top = mt > top ? mt : top;
    }
    for (int t = 0; t < n_threads; ++t) {
        const float *slot = a->threads + t * a->per_thread;
        weight[t] = slot[q] == -INFINITY ? 0.0f : exp1(slot[q] - top);
        total += slot[rows + q] * weight[t];
    }
    const vfloat divisor = vset1(total > 0.0f ? total : 1.0f);
    for (int64_t c = 0; c < d; c += VW) {
        vfloat sum = vzero();
        for (int t = 0; t < n_threads; ++t)
            sum = vfma(vload(a->threads + t * a->per_thread + 2 * rows + q * d + c), vset1(weight[t]), sum);
        vstore(o + c, sum / divisor);
    }
    return total > 0.0f ? top + logf(total) : -INFINITY;
}

/* A source's keys lo .. hi-1 split over the threads, for the query rows rows[0..n) (at most
 * rows_per_pass; all of them see those keys):
 * their queries gathered per KV head, each thread's share of the keys attended, the threads'
 * partials merged into the rows' running state. Called by every thread of the region. */
static void attend_split(const batch_attention *a, const ringctx_decoder_layer *l, const ringctx_attention_source *src,
                         int64_t layer, const int64_t *rows, int64_t n, int64_t lo, int64_t hi) {
    const ringctx_decoder_shape *s = a->s;
    const int64_t hq = s->n_heads, hkv = s->n_kv_heads, d = s->head_dim, group = hq / hkv, R = n * group;
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const float *q = a->qkv + rows[0] * a->width; /* one row: its heads are already [Hkv, group, D] */
    if (n > 1) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t h = 0; h < hkv; ++h)
                memcpy(a->queries + ((h * n + i) * group) * d, a->qkv + rows[i] * a->width + h * group * d,
                       (size_t)(group * d) * sizeof(float));
        q = a->queries;
    }
    float *mine = a->threads + t * a->per_thread;
    const int64_t qrows = hkv * R, keys = hi - lo, j0 = lo + keys * t / nt, j1 = lo + keys * (t + 1) / nt;
    const float *ks = src->k_scale ? src->k_scale[layer] : NULL, *vs = src->v_scale ? src->v_scale[layer] : NULL;
    attend_range(q, hkv, R, d, src->k[layer], src->v[layer], s->bf16, src->kv_q8, ks, vs, l->scale, l->softcap, j0,
                 j1, mine, mine + qrows, mine + 2 * qrows, mine + 2 * qrows + qrows * d);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t qr = 0; qr < qrows; ++qr) {  /* qr = (h, i, g): batch row rows[i], head h group + g */
        const int64_t h = qr / R, i = (qr % R) / group, g = qr % group;
        float o[MAX_D] __attribute__((aligned(64)));
        const float lse = merge_thread_row(a, qrows, nt, qr, o);
        merge_partial(a, rows[i], h * group + g, o, lse);
    }
}

/* One short own source on this thread alone: its query row over the keys it sees (each segment's
 * range merged in turn). */
static void attend_alone(const batch_attention *a, const ringctx_decoder_layer *layer_of, const ringctx_attention_source *src,
                         int64_t layer) {
    const ringctx_decoder_shape *s = a->s;
    const int64_t hq = s->n_heads, hkv = s->n_kv_heads, d = s->head_dim, r = src->rows[0];
    float *mine = a->threads + omp_get_thread_num() * a->per_thread, *m = mine, *l = m + hq, *acc = l + hq;
    for (int64_t k = 0; k < segments_of(layer_of, src); ++k) {
        int64_t lo, hi;
        visible_rows(layer_of, src, k, a->positions[r], &lo, &hi);
        if (hi <= lo) continue;
        attend_range(a->qkv + r * a->width, hkv, hq / hkv, d, src->k[layer], src->v[layer], s->bf16, src->kv_q8,
                     src->k_scale ? src->k_scale[layer] : NULL, src->v_scale ? src->v_scale[layer] : NULL,
                     layer_of->scale, layer_of->softcap, lo, hi, m, l, acc, acc + hq * d);
        for (int64_t h = 0; h < hq; ++h) {
            if (l[h] <= 0.0f) continue;
            const vfloat inv = vset1(1.0f / l[h]);
            for (int64_t c = 0; c < d; c += VW) vstore(acc + h * d + c, vload(acc + h * d + c) * inv);
            merge_partial(a, r, h, acc + h * d, m[h] + logf(l[h]));
        }
    }
}

/* One layer's attention of the batch into a->out / a->lse, which layer_qkv emptied after writing
 * the rows' new k, v (every thread of the region calls it). In a layer with a span each row sees
 * its own range of a source's rows, so a document is read one row at a time (every row's range is
 * computed by every thread alike: they all take the same passes). */
static void attend_sources(const batch_attention *a, const ringctx_decoder_layer *layer_of,
                           const ringctx_attention_source *sources, int64_t n_sources, int64_t n_shared, int64_t layer) {
    const ringctx_decoder_shape *s = a->s;
    /* documents, then long own rows: the keys over the threads, one pass per rows_per_pass rows */
    const int64_t pass = layer_of->window || layer_of->chunk ? 1 : rows_per_pass(s, a->b);
    for (int64_t i = 0; i < n_sources; ++i) {
        const ringctx_attention_source *src = sources + i;
        if (i >= n_shared && visible_count(layer_of, src, a->positions[src->rows[0]]) < OWN_SPLIT_KEYS) continue;
        for (int64_t first = 0; first < src->n_rows; first += pass)
            for (int64_t k = 0; k < segments_of(layer_of, src); ++k) {
                int64_t lo, hi;
                visible_rows(layer_of, src, k, a->positions[src->rows[first]], &lo, &hi);
                if (hi > lo)
                    attend_split(a, layer_of, src, layer, src->rows + first,
                                 src->n_rows - first < pass ? src->n_rows - first : pass, lo, hi);
            }
    }
    /* short own rows: one source per thread (each row has one own source: no two threads meet) */
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = n_shared; i < n_sources; ++i) {
        const int64_t seen = visible_count(layer_of, sources + i, a->positions[sources[i].rows[0]]);
        if (seen > 0 && seen < OWN_SPLIT_KEYS) attend_alone(a, layer_of, sources + i, layer);
    }
}

/* The merged attention rounded into attn [b, Hq, D]: o, or o sigmoid(lse - sink[h]) in a layer with
 * sinks (LayerSoftmax.finish: exp(sink) joins the softmax's denominator). */
static void finish_attention(const batch_attention *a, const ringctx_decoder_layer *layer, float *attn) {
    const int64_t hq = a->s->n_heads, d = a->s->head_dim, b = a->b;
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < b * hq; ++rh) {
        const int64_t r = rh / hq, h = rh % hq;
        const float weight = layer->sinks ? 1.0f / (1.0f + expf(layer->sinks[h] - a->lse[h * b + r])) : 1.0f;
        for (int64_t c = 0; c < d; ++c)
            attn[rh * d + c] = round_to(layer->sinks ? a->out[rh * d + c] * weight : a->out[rh * d + c], a->s->bf16);
    }
}

/* The batch's float32 work arrays (see layout_batch), and each thread's slot. */
typedef struct {
    float *resid, *xn, *qkv, *attn, *gate_up, *act, *split, *threads;
    int64_t per_thread;
    float *logits, *moe_sum, *moe_x, *moe_gate_up, *moe_act, *moe_y, *moe_split; /* a mixture of experts' (layout_batch) */
} batch_rows;

static float *thread_slot(const batch_rows *w) { return w->threads + omp_get_thread_num() * w->per_thread; }

/* One head's new k or v row x [d] into row `row` of a cache (8-bit: quantized with its scale). */
static void store_head(const ringctx_decoder_shape *s, const ringctx_attention_source *src, int64_t layer, int is_v,
                       int64_t kv_head, const float *x) {
    const int64_t hkv = s->n_kv_heads, d = s->head_dim, at = src->write_row * hkv + kv_head;
    void *cache = is_v ? src->v[layer] : src->k[layer];
    if (src->kv_q8 >= 0)
        store_q8(src->kv_q8, x, d, (int8_t *)cache + at * d, (is_v ? src->v_scale[layer] : src->k_scale[layer]) + at);
    else
        for (int64_t c = 0; c < d; ++c) store_one(cache, s->bf16, at * d + c, x[c]);
}

/* A layer up to its attention: norm, q/k/v projection, Qwen3's head norms, RoPE at each row's own
 * position (cos, sin: the layer's table [b, rotary_dim], NULL for a NoPE layer), each row's new
 * k, v into the cache of writer[row] (its own rows, when this rank stores the token), and the
 * attention's partials emptied (zeros, lse -inf: a row may see no key here). Every thread of the
 * region calls it. */
static void layer_qkv(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layer, int64_t li,
                      const batch_rows *w, const batch_attention *a, int64_t b, const void *cos, const void *sin,
                      const ringctx_attention_source *const *writer) {
    const int bf16 = s->bf16, esize = bf16 ? 2 : 4;
    const int64_t dim = s->dim, hq = s->n_heads, hkv = s->n_kv_heads, d = s->head_dim, heads = hq + 2 * hkv;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < b; ++r)
        token_rms_norm(w->resid + r * dim, 0, layer->attention_norm, bf16, dim, s->norm_eps, w->xn + r * dim, 0);
    linear_rows(w->xn, b, dim, layer->wqkv, layer->wqkv_codes, layer->wqkv_exps, layer->bqkv, heads * d, bf16, w->qkv,
                NULL, w->split, thread_slot(w));
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < b * heads; ++rh) {
        const int64_t r = rh / heads, h = rh % heads;
        float *xh = w->qkv + r * heads * d + h * d;
        if (h < hq + hkv) {  /* a q or k head: Qwen3's head norm, then RoPE */
            const void *head_norm = h < hq ? layer->q_norm : layer->k_norm;
            const int64_t rd = layer->rotary_dim; /* the first rd dims rotate, the rest pass through */
            if (head_norm) token_rms_norm(xh, 0, head_norm, bf16, d, s->norm_eps, xh, 0);
            if (cos) token_rope(xh, 0, (const char *)cos + r * rd * esize, (const char *)sin + r * rd * esize, bf16, rd);
        }
        if (h < hq) {
            memset(a->out + (r * hq + h) * d, 0, (size_t)d * sizeof(float));
            a->lse[h * b + r] = -INFINITY;
        } else if (writer[r] != NULL) {
            const int is_v = h >= hq + hkv;
            store_head(s, writer[r], li, is_v, h - hq - (is_v ? hkv : 0), xh);
        }
    }
}

/* Each of b rows' k experts from the router's logits [b, E] (ringctx/model/moe.py's `route`):
 * float32 softmax, the k largest (a tie goes to the lower index, as a stable sort), renormalised
 * and rounded as the shape says. Out: the b k (row, weight) pairs in expert order, rows ascending
 * within an expert (a counting sort), expert e's pairs at [start[e], start[e + 1]). */
static void route_rows(const ringctx_decoder_shape *s, const float *logits, int64_t b, int64_t *start,
                       int64_t *pair_row, float *pair_weight) {
    const int64_t E = s->n_experts, k = s->experts_per_token;
    int64_t chosen[MAX_BATCH * MAX_EXPERTS_PER_TOKEN];
    float weight[MAX_BATCH * MAX_EXPERTS_PER_TOKEN], probs[MAX_EXPERTS];
    for (int64_t e = 0; e <= E; ++e) start[e] = 0;
    for (int64_t r = 0; r < b; ++r) {
        const float *z = logits + r * E;
        float top = -INFINITY, total = 0.0f, kept = 0.0f;
        for (int64_t e = 0; e < E; ++e) top = z[e] > top ? z[e] : top;
        for (int64_t e = 0; e < E; ++e) total += probs[e] = expf(z[e] - top);
        for (int64_t e = 0; e < E; ++e) probs[e] /= total;
        unsigned char taken[MAX_EXPERTS] = {0};
        for (int64_t j = 0; j < k; ++j) {  /* the j-th largest: first index of the largest not yet taken */
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
            chosen[r * k + j] = best, weight[r * k + j] = probs[best], kept += probs[best];
            taken[best] = 1;
            ++start[best + 1];
        }
        for (int64_t j = 0; j < k; ++j) {
            float v = s->renormalize ? weight[r * k + j] / kept : weight[r * k + j];
            weight[r * k + j] = s->weights_in_model_dtype ? round_to(v, s->bf16) : v;
        }
    }
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    int64_t next[MAX_EXPERTS];
    memcpy(next, start, (size_t)E * sizeof(int64_t));
    for (int64_t r = 0; r < b; ++r)  /* rows ascending: each expert's pairs in row order */
        for (int64_t j = 0; j < k; ++j) {
            const int64_t at = next[chosen[r * k + j]]++;
            pair_row[at] = r, pair_weight[at] = weight[r * k + j];
        }
}

/* A mixture of experts' feed-forward over the b normalised rows in xn, added to resid (every
 * thread of the region calls it): the router's product, the routing (each thread routes every row
 * alike, on its own stack: a few hundred floats, no barrier), then the chosen experts, each one's
 * weights read once for the rows that chose it (a batch reads the union of its rows' experts, each
 * once), its outputs times their weights summed in float32 per row in expert order. The (row,
 * expert) pairs, sorted by expert, run together: one parallel loop per step (gather, gate/up,
 * SwiGLU, down, weighted sum) over every chosen expert, so a layer waits at the same few barriers
 * whatever k is (one loop per expert per step made ~20 for k = 4, ~5 ms of a 26 ms step of a
 * 30-layer model on 2 threads: docs/BENCHMARKS.md). */
static void layer_experts(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layer, const batch_rows *w,
                          int64_t b) {
    const int bf16 = s->bf16, esize = bf16 ? 2 : 4;
    const int64_t dim = s->dim, E = s->n_experts, F = s->expert_ffn_dim;
    linear_rows(w->xn, b, dim, layer->router, NULL, NULL, NULL, E, bf16, w->logits, NULL, w->split, thread_slot(w));
    int64_t start[MAX_EXPERTS + 1], pair_row[MAX_BATCH * MAX_EXPERTS_PER_TOKEN];
    float pair_weight[MAX_BATCH * MAX_EXPERTS_PER_TOKEN];
    route_rows(s, w->logits, b, start, pair_row, pair_weight);
    const int64_t P = start[E];
    int64_t active[MAX_EXPERTS], n_active = 0;  /* the experts some row chose, ascending */
    for (int64_t e = 0; e < E; ++e)
        if (start[e + 1] > start[e]) active[n_active++] = e;
    /* Each product runs over every chosen expert in one parallel loop (tasks: an expert's block of
     * outputs), so the layer waits at 6 barriers whatever k is, not ~5 per expert; each expert's
     * weights are still read once, for all the rows that chose it, and every value is computed as
     * linear_rows computes it (the same split of the input, blocks and rounding). */
    const int up_pairs = widen_in_pairs(bf16, dim), down_pairs = widen_in_pairs(bf16, F);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; ++p) {  /* each pair's row, gathered in expert order (and split) */
        memcpy(w->moe_x + p * dim, w->xn + pair_row[p] * dim, (size_t)dim * sizeof(float));
        if (up_pairs) split_pairs(w->moe_x + p * dim, 1, dim, w->moe_split + p * dim);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < b * dim; ++i) w->moe_sum[i] = 0.0f;
    const int64_t up_blocks = (2 * F + GEMV_BLOCK - 1) / GEMV_BLOCK, down_blocks = (dim + GEMV_BLOCK - 1) / GEMV_BLOCK;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_active * up_blocks; ++t) {  /* gate and up: y [P, 2F] */
        const int64_t e = active[t / up_blocks], first = start[e], n = start[e + 1] - first;
        const int64_t o = t % up_blocks * GEMV_BLOCK, m = 2 * F - o < GEMV_BLOCK ? 2 * F - o : GEMV_BLOCK;
        const void *we = (const char *)layer->w13 + e * 2 * F * dim * esize;
        float *y = w->moe_gate_up + first * 2 * F;
        if (up_pairs) gemv_block_pairs(w->moe_split + first * dim, n, dim, (const uint16_t *)we, 2 * F, y, o, m);
        else gemv_block(w->moe_x + first * dim, n, dim, we, bf16, 2 * F, y, o, m);
        for (int64_t r = 0; r < n; ++r)
            for (int64_t i = o; i < o + m; ++i) y[r * 2 * F + i] = round_to(y[r * 2 * F + i], bf16);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; ++p) {  /* SwiGLU of each pair (and the split of its activations) */
        token_swiglu(w->moe_gate_up + p * 2 * F, w->moe_gate_up + p * 2 * F + F, 0, bf16, F, w->moe_act + p * F, 0);
        if (down_pairs) split_pairs(w->moe_act + p * F, 1, F, w->moe_split + p * F);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_active * down_blocks; ++t) {  /* down: y [P, dim] */
        const int64_t e = active[t / down_blocks], first = start[e], n = start[e + 1] - first;
        const int64_t o = t % down_blocks * GEMV_BLOCK, m = dim - o < GEMV_BLOCK ? dim - o : GEMV_BLOCK;
        const void *we = (const char *)layer->w2 + e * dim * F * esize;
        float *y = w->moe_y + first * dim;
        if (down_pairs) gemv_block_pairs(w->moe_split + first * F, n, F, (const uint16_t *)we, dim, y, o, m);
        else gemv_block(w->moe_act + first * F, n, F, we, bf16, dim, y, o, m);
        for (int64_t r = 0; r < n; ++r)
            for (int64_t i = o; i < o + m; ++i) y[r * dim + i] = round_to(y[r * dim + i], bf16);
    }
#pragma omp for schedule(static)
    for (int64_t c = 0; c < dim; ++c)  /* columns over the threads: each row's pairs added in expert order */
        for (int64_t p = 0; p < P; ++p) {
            const float y = w->moe_y[p * dim + c], weight = pair_weight[p];
            w->moe_sum[pair_row[p] * dim + c] += s->weights_in_model_dtype ? round_to(y * weight, bf16) : y * weight;
        }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < b * dim; ++i) w->resid[i] = round_to(w->resid[i] + round_to(w->moe_sum[i], bf16), bf16);
}

/* The rest of a layer, from the rounded attention output in attn: output projection and residual,
 * norm, SwiGLU feed-forward and residual (every thread of the region calls it). */
static void layer_output(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layer, const batch_rows *w,
                         int64_t b) {
    const int bf16 = s->bf16;
    const int64_t dim = s->dim, ffn = s->ffn_dim;
    linear_rows(w->attn, b, s->n_heads * s->head_dim, layer->wo, layer->wo_codes, layer->wo_exps, layer->bo, dim, bf16, w->xn, w->resid, w->split,
                thread_slot(w));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < b; ++r)
        token_rms_norm(w->resid + r * dim, 0, layer->ffn_norm, bf16, dim, s->norm_eps, w->xn + r * dim, 0);
    if (layer->router) {
        layer_experts(s, layer, w, b);
        return;
    }
    linear_rows(w->xn, b, dim, layer->w13, layer->w13_codes, layer->w13_exps, NULL, 2 * ffn, bf16, w->gate_up, NULL, w->split,
                thread_slot(w));
    const int64_t pieces = (ffn + 63) / 64;  /* runs of 64 of every row over the threads (a lone row too) */
#pragma omp for schedule(static)
    for (int64_t rp = 0; rp < b * pieces; ++rp) {
        const int64_t r = rp / pieces, i0 = rp % pieces * 64;
        token_swiglu(w->gate_up + r * 2 * ffn + i0, w->gate_up + r * 2 * ffn + ffn + i0, 0, bf16,
                     ffn - i0 < 64 ? ffn - i0 : 64, w->act + r * ffn + i0, 0);
    }
    linear_rows(w->act, b, ffn, layer->w2, layer->w2_codes, layer->w2_exps, NULL, dim, bf16, w->xn, w->resid, w->split,
                thread_slot(w));
}

/* Run B tokens (one per sequence) through n_layers layers. x [b, dim] (model dtype): the tokens'
 * embeddings on entry, the last layer's outputs (before the final norm) on return. positions [b]:
 * each row's global position. cos, sin: n_ropes tables, table t [b, R_t] the rotary factors of each
 * row's own position (model dtype, as RopeAngles) for the layers whose `rope` is t (R_t their
 * rotary_dim). sources:
 * n_sources attention sources, the first n_shared of them documents, the rest own rows (at most
 * one per batch row), as described above. merge: NULL when this rank holds every row, else see above. work: at least
 * ringctx_decode_batch_work_floats(shape, b, threads) floats.
 * Returns 0, -1 when this CPU cannot run this variant, -2 for an unsupported shape or layer, b
 * outside 1..MAX_BATCH or a bad source, -3 when a row's query would see rows its layer no longer
 * stores (stored_from). */
int ringctx_decode_step_batch(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layers, int64_t n_layers,
                              void *x, int64_t b, const int64_t *positions, const void *const *cos,
                              const void *const *sin, int64_t n_ropes, const ringctx_attention_source *sources,
                              int64_t n_sources, int64_t n_shared, float *work, int threads, ringctx_merge_fn merge) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    if (b < 1 || b > MAX_BATCH || s->head_dim % 16 || s->head_dim > MAX_D || s->n_kv_heads < 1 ||
        s->n_heads % s->n_kv_heads || s->n_heads / s->n_kv_heads > MAX_R || n_shared < 0 || n_shared > n_sources ||
        !int8_weights_fit(s, layers, n_layers) || !experts_fit(s, layers, n_layers))
        return -2;
    for (int64_t i = 0; i < n_sources; ++i) {
        const ringctx_attention_source *src = sources + i;
        if (src->n_rows < 1 || src->keys < 0 || (src->kv_q8 != -1 && src->kv_q8 != Q8_INT8 && src->kv_q8 != Q8_FP8) ||
            (src->kv_q8 >= 0 && (src->k_scale == NULL || src->v_scale == NULL)) ||
            (i < n_shared ? src->write_row >= 0 : src->n_rows != 1) ||
            (src->segments && (src->n_segments < 1 || src->segments[0] != 0)))
            return -2;
        for (int64_t j = 0; j < src->n_rows; ++j)
            if (src->rows[j] < 0 || src->rows[j] >= b) return -2;
    }
    for (int64_t li = 0; li < n_layers; ++li) {
        const ringctx_decoder_layer *l = layers + li;
        if (l->window < 0 || l->chunk < 0 || !(l->scale > 0.0f) || !(l->softcap >= 0.0f) || l->rope < -1 ||
            l->rope >= n_ropes || (l->rope >= 0 && (l->rotary_dim < 2 || l->rotary_dim % 2 || l->rotary_dim > s->head_dim)))
            return -2;
        for (int64_t i = 0; i < n_sources && !l->window && !l->chunk; ++i)  /* a full layer reads every row */
            if (sources[i].stored_from && sources[i].keys > 0 && sources[i].stored_from[li] > 0) return -3;
        if (!l->window && !l->chunk) continue;
        for (int64_t i = 0; i < n_sources; ++i)  /* the rows each query sees must still be stored */
            for (int64_t j = 0; j < sources[i].n_rows; ++j)
                for (int64_t k = 0; k < segments_of(l, sources + i); ++k) {
                    int64_t lo, hi;
                    visible_rows(l, sources + i, k, positions[sources[i].rows[j]], &lo, &hi);
                    if (hi > lo && sources[i].stored_from && lo < sources[i].stored_from[li]) return -3;
                }
    }
    /* the own source each row writes its new k, v into (at most one: one own source per row) */
    const ringctx_attention_source *writer[MAX_BATCH] = {NULL};
    for (int64_t i = n_shared; i < n_sources; ++i) {
        if (sources[i].write_row < 0) continue;
        if (writer[sources[i].rows[0]] != NULL) return -2;
        writer[sources[i].rows[0]] = sources + i;
    }
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    const int bf16 = s->bf16;
    const int64_t hq = s->n_heads, d = s->head_dim;
    const batch_layout l = layout_batch(s, b, threads);
    const batch_rows w = {work + l.resid, work + l.xn, work + l.qkv, work + l.attn, work + l.gate_up, work + l.act,
                          work + l.split, work + l.threads, l.per_thread, work + l.logits, work + l.moe_sum,
                          work + l.moe_x, work + l.moe_gate_up, work + l.moe_act, work + l.moe_y,
                          work + l.moe_split};
    const batch_attention a = {s, b, (hq + 2 * s->n_kv_heads) * d, w.qkv, work + l.part_out, work + l.part_lse,
                               work + l.queries, work + l.threads, l.per_thread, positions};
    for (int64_t i = 0; i < b * s->dim; ++i) w.resid[i] = load_one(x, bf16, i);
#define LAYER_ROPE(li) (layers[li].rope < 0 ? NULL : cos[layers[li].rope]), (layers[li].rope < 0 ? NULL : sin[layers[li].rope])

    if (merge == NULL) {  /* nothing leaves C: one parallel region for the whole step */
#pragma omp parallel num_threads(threads)
        for (int64_t li = 0; li < n_layers; ++li) {
            layer_qkv(s, layers + li, li, &w, &a, b, LAYER_ROPE(li), writer);
            attend_sources(&a, layers + li, sources, n_sources, n_shared, li);
            finish_attention(&a, layers + li, w.attn);
            layer_output(s, layers + li, &w, b);
        }
    } else {  /* each layer's region ends before its merge (no kernel thread spins beside the caller's) */
        for (int64_t li = 0; li < n_layers; ++li) {
#pragma omp parallel num_threads(threads)
            {
                layer_qkv(s, layers + li, li, &w, &a, b, LAYER_ROPE(li), writer);
                attend_sources(&a, layers + li, sources, n_sources, n_shared, li);
            }
            merge(li); /* writes the rounded, merged attention (its sinks applied) into attn */
#pragma omp parallel num_threads(threads)
            layer_output(s, layers + li, &w, b);
        }
    }
    for (int64_t i = 0; i < b * s->dim; ++i) store_one(x, bf16, i, w.resid[i]);
    return 0;
#undef LAYER_ROPE
}

/* ------------------------------------------------------------------------------------------
 * A short prefill on one rank: T tokens of one sequence through every layer in one call
 * (ringctx_prefill_rows; ringctx/model/decode_step.py's FusedPrefill, run by the prefill engine
 * for a question's tokens over a document's cache).
 *
 * Why: run layer by layer from Python, such a prefill spends ~0.45 ms a layer between its kernels
 * (a 15-token question over an 8K-token document with SmolLM2 on 2 cores: 14 of its 100 ms). The
 * kernels are the ones that Python path calls, in the same order on the same values, so the bits
 * are its bits (FusedPrefill.takes says where that path takes them):
 *
 *   norms, products, RoPE, SwiGLU, residuals    layer_qkv and layer_output above, over T rows (the
 *                                               products are small_linear's loop: gemv_block_pairs)
 *   the rows' k, v                              into cache rows cached .. cached + T - 1
 *   attention                                   attention_block's two blocks of a question: the
 *                                               flash kernel over rows 0 .. cached - 1 (full),
 *                                               then over the new rows (causal); each output
 *                                               rounded to the model dtype and merged by
 *                                               log-sum-exp into float32 zeros in that order
 *                                               (ringctx_merge_rows: PartialAccumulator.add), the
 *                                               merged output rounded.
 * ------------------------------------------------------------------------------------------ */

/* Floats of work buffer that ringctx_prefill_rows needs for t rows and this thread count: the
 * batch step's arrays, then a block's output [t, Hq, D] and lse [Hq, t], then the queries in the
 * model dtype [t, Hq, D]. */
int64_t ringctx_prefill_work_floats(const ringctx_decoder_shape *s, int64_t t, int threads) {
    const int64_t rows = t * s->n_heads * s->head_dim;
    return layout_batch(s, t, threads).total + rows + s->n_heads * t + rows;
}

/* One flash block of the T queries (q: [T, Hq, D] in the model dtype, contiguous) against keys and
 * values [S, Hkv, D] (cache rows), its output rounded to the model dtype, merged into the running
 * output and lse. */
static int attend_block(const ringctx_decoder_shape *s, const void *q, const void *k, const void *v, int64_t t,
                        int64_t keys, int causal, float *out, float *lse, float *acc, float *acc_lse, int threads) {
    const int64_t hq = s->n_heads, hkv = s->n_kv_heads, d = s->head_dim;
    const int status = s->bf16
        ? ringctx_flash_attention_bf16((const uint16_t *)q, hq * d, d, (const uint16_t *)k, hkv * d, d,
                                       (const uint16_t *)v, hkv * d, d, t, keys, hq, hkv, d, causal, 0, 0,
                                       s->softmax_scale, 0.0f, out, hq * d, d, lse, threads)
        : ringctx_flash_attention((const float *)q, hq * d, d, (const float *)k, hkv * d, d, (const float *)v,
                                  hkv * d, d, t, keys, hq, hkv, d, causal, 0, 0, s->softmax_scale, 0.0f, out, hq * d,
                                  d, lse, threads);
    if (status != 0) return status;
    for (int64_t i = 0; i < t * hq * d; ++i) out[i] = round_to(out[i], s->bf16);
    return ringctx_merge_rows(acc, hq * d, acc_lse, t, out, 0, hq * d, d, lse, t, t, hq, d);
}

/* Run t tokens of one sequence through n_layers layers. x [t, dim] (model dtype): the tokens'
 * embeddings on entry, the last layer's outputs (before the final norm) on return. cos, sin:
 * [t, head_dim] rotary factors of the tokens' positions (model dtype). k, v: [n_layers] the
 * cache's rows [rows, Hkv, D] in the model dtype (token-major, contiguous): rows 0 .. cached - 1
 * are attended, the tokens' k, v are written to rows cached .. cached + t - 1. work: at least
 * ringctx_prefill_work_floats(shape, t, threads) floats.
 * Returns 0, -1 when this CPU cannot run this variant, -2 for an unsupported shape or t outside
 * 1..MAX_BATCH, or the flash kernel's error. */
int ringctx_prefill_rows(const ringctx_decoder_shape *s, const ringctx_decoder_layer *layers, int64_t n_layers,
                         void *x, int64_t t, const void *cos, const void *sin, void *const *k, void *const *v,
                         int64_t cached, float *work, int threads) {
    if (!ringctx_cpu_kernels_supported()) return -1;
    if (t < 1 || t > MAX_BATCH || cached < 0 || s->head_dim % 16 || s->head_dim > MAX_D || s->n_kv_heads < 1 ||
        s->n_heads % s->n_kv_heads || s->n_heads / s->n_kv_heads > MAX_R || !int8_weights_fit(s, layers, n_layers) ||
        !experts_fit(s, layers, n_layers))
        return -2;
    for (int64_t li = 0; li < n_layers; ++li)  /* plain causal layers with the model's RoPE only */
        if (layers[li].window || layers[li].chunk || layers[li].softcap != 0.0f || layers[li].sinks ||
            layers[li].rope != 0 || layers[li].rotary_dim != s->head_dim)
            return -2;
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    const int bf16 = s->bf16;
    const int64_t hq = s->n_heads, hkv = s->n_kv_heads, d = s->head_dim, width = (hq + 2 * hkv) * d;
    const batch_layout l = layout_batch(s, t, threads);
    const batch_rows w = {work + l.resid, work + l.xn, work + l.qkv, work + l.attn, work + l.gate_up, work + l.act,
                          work + l.split, work + l.threads, l.per_thread, work + l.logits, work + l.moe_sum,
                          work + l.moe_x, work + l.moe_gate_up, work + l.moe_act, work + l.moe_y,
                          work + l.moe_split};
    const batch_attention a = {s, t, width, w.qkv, work + l.part_out, work + l.part_lse,
                               work + l.queries, work + l.threads, l.per_thread, NULL}; /* attention: flash blocks */
    float *block_out = work + l.total, *block_lse = block_out + t * hq * d;
    void *queries = block_lse + hq * t; /* [t, Hq, D] in the model dtype */
    /* each row writes its k, v into its own cache row (layer_qkv's writers) */
    ringctx_attention_source rows[MAX_BATCH];
    const ringctx_attention_source *writer[MAX_BATCH];
    for (int64_t r = 0; r < t; ++r) {
        rows[r] = (ringctx_attention_source){k, v, NULL, NULL, NULL, 1, cached + t, cached + r, -1, NULL, 0, NULL, 0, NULL};
        writer[r] = rows + r;
    }
    for (int64_t i = 0; i < t * s->dim; ++i) w.resid[i] = load_one(x, bf16, i);
    for (int64_t li = 0; li < n_layers; ++li) {
#pragma omp parallel num_threads(threads)
        layer_qkv(s, layers + li, li, &w, &a, t, cos, sin, writer);  /* plain layers: one table [t, D] */
        for (int64_t r = 0; r < t; ++r) /* the q heads, exact in the model dtype (they were rounded to it) */
            for (int64_t i = 0; i < hq * d; ++i) store_one(queries, bf16, r * hq * d + i, w.qkv[r * width + i]);
        const int64_t row_bytes = hkv * d * (bf16 ? 2 : 4);
        int status = 0;
        if (cached > 0)
            status = attend_block(s, queries, k[li], v[li], t, cached, 0, block_out, block_lse, a.out, a.lse, threads);
        if (status == 0)
            status = attend_block(s, queries, (const char *)k[li] + cached * row_bytes,
                                  (const char *)v[li] + cached * row_bytes, t, t, 1, block_out, block_lse, a.out,
                                  a.lse, threads);
        if (status != 0) return status;
        for (int64_t i = 0; i < t * hq * d; ++i) w.attn[i] = round_to(a.out[i], bf16);
#pragma omp parallel num_threads(threads)
        layer_output(s, layers + li, &w, t);
    }
    for (int64_t i = 0; i < t * s->dim; ++i) store_one(x, bf16, i, w.resid[i]);
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * The layout of the structs above and the limits the Python side copies (ringctx/kernels/abi.py
 * declares them as ctypes Structures): reported so that the loader checks its copy against the
 * compiler's, field by field, before any kernel runs. A field added, moved or resized on one side
 * only then fails the load with its name, instead of a step reading the wrong bytes.
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    const char *name; /* "struct" (offset 0, size its sizeof) or "struct.field" */
    int64_t offset, size;
} ringctx_abi_field;

typedef struct {
    const char *name; /* the C macro's name */
    int64_t value;
} ringctx_abi_limit;

#define ABI_STRUCT(type) {#type, 0, (int64_t)sizeof(type)}
#define ABI_FIELD(type, field) {#type "." #field, (int64_t)offsetof(type, field), (int64_t)sizeof(((type *)0)->field)}

static const ringctx_abi_field abi_fields[] = {
    ABI_STRUCT(ringctx_decoder_shape),
    ABI_FIELD(ringctx_decoder_shape, dim),
    ABI_FIELD(ringctx_decoder_shape, n_heads),
    ABI_FIELD(ringctx_decoder_shape, n_kv_heads),
    ABI_FIELD(ringctx_decoder_shape, head_dim),
    ABI_FIELD(ringctx_decoder_shape, ffn_dim),
    ABI_FIELD(ringctx_decoder_shape, norm_eps),
    ABI_FIELD(ringctx_decoder_shape, softmax_scale),
    ABI_FIELD(ringctx_decoder_shape, bf16),
    ABI_FIELD(ringctx_decoder_shape, n_experts),
    ABI_FIELD(ringctx_decoder_shape, experts_per_token),
    ABI_FIELD(ringctx_decoder_shape, expert_ffn_dim),
    ABI_FIELD(ringctx_decoder_shape, renormalize),
    ABI_FIELD(ringctx_decoder_shape, weights_in_model_dtype),
    ABI_STRUCT(ringctx_decoder_layer),
    ABI_FIELD(ringctx_decoder_layer, attention_norm),
    ABI_FIELD(ringctx_decoder_layer, wqkv),
    ABI_FIELD(ringctx_decoder_layer, bqkv),
    ABI_FIELD(ringctx_decoder_layer, wo),
    ABI_FIELD(ringctx_decoder_layer, bo),
    ABI_FIELD(ringctx_decoder_layer, ffn_norm),
    ABI_FIELD(ringctx_decoder_layer, w13),
    ABI_FIELD(ringctx_decoder_layer, w2),
    ABI_FIELD(ringctx_decoder_layer, q_norm),
    ABI_FIELD(ringctx_decoder_layer, k_norm),
    ABI_FIELD(ringctx_decoder_layer, wqkv_codes),
    ABI_FIELD(ringctx_decoder_layer, wo_codes),
    ABI_FIELD(ringctx_decoder_layer, w13_codes),
    ABI_FIELD(ringctx_decoder_layer, w2_codes),
    ABI_FIELD(ringctx_decoder_layer, wqkv_exps),
    ABI_FIELD(ringctx_decoder_layer, wo_exps),
    ABI_FIELD(ringctx_decoder_layer, w13_exps),
    ABI_FIELD(ringctx_decoder_layer, w2_exps),
    ABI_FIELD(ringctx_decoder_layer, sinks),
    ABI_FIELD(ringctx_decoder_layer, window),
    ABI_FIELD(ringctx_decoder_layer, chunk),
    ABI_FIELD(ringctx_decoder_layer, rotary_dim),
    ABI_FIELD(ringctx_decoder_layer, scale),
    ABI_FIELD(ringctx_decoder_layer, softcap),
    ABI_FIELD(ringctx_decoder_layer, rope),
    ABI_FIELD(ringctx_decoder_layer, router),
    ABI_STRUCT(ringctx_attention_source),
    ABI_FIELD(ringctx_attention_source, k),
    ABI_FIELD(ringctx_attention_source, v),
    ABI_FIELD(ringctx_attention_source, k_scale),
    ABI_FIELD(ringctx_attention_source, v_scale),
    ABI_FIELD(ringctx_attention_source, rows),
    ABI_FIELD(ringctx_attention_source, n_rows),
    ABI_FIELD(ringctx_attention_source, keys),
    ABI_FIELD(ringctx_attention_source, write_row),
    ABI_FIELD(ringctx_attention_source, kv_q8),
    ABI_FIELD(ringctx_attention_source, positions),
    ABI_FIELD(ringctx_attention_source, first_position),
    ABI_FIELD(ringctx_attention_source, segments),
    ABI_FIELD(ringctx_attention_source, n_segments),
    ABI_FIELD(ringctx_attention_source, stored_from),
};

static const ringctx_abi_limit abi_limits[] = {
    {"MAX_BATCH", MAX_BATCH}, {"MAX_R", MAX_R}, {"MAX_D", MAX_D}, {"INT8_MAX_ROWS", INT8_MAX_ROWS},
    {"Q8_INT8", Q8_INT8}, {"Q8_FP8", Q8_FP8}, {"FLASH_ARGS", FLASH_ARGS},
    {"MAX_EXPERTS", MAX_EXPERTS}, {"MAX_EXPERTS_PER_TOKEN", MAX_EXPERTS_PER_TOKEN},
    {"GATED_DELTA_ARGS", GATED_DELTA_ARGS},
};

/* The struct and field table above; *count receives its length. Plain data: safe to call before
 * ringctx_cpu_kernels_supported, though the loader asks after it. */
const ringctx_abi_field *ringctx_abi_fields(int64_t *count) {
    *count = (int64_t)(sizeof abi_fields / sizeof abi_fields[0]);
    return abi_fields;
}

/* The limits above; *count receives their number. */
const ringctx_abi_limit *ringctx_abi_limits(int64_t *count) {
    *count = (int64_t)(sizeof abi_limits / sizeof abi_limits[0]);
    return abi_limits;
}
