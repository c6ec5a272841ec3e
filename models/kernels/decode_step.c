/* A whole step in one call: every layer, the final norm and the lm_head, in ONE OpenMP region.
 *
 * A step is B rows, each one token with its own id, position, KV slot and block table: the decode tokens, and
 * the tokens of any prompt chunks riding in the step (a chunk's tokens are consecutive rows of one sequence,
 * attending over its earlier positions: the blocks already computed and the chunk's earlier rows).
 *
 * Why: at decode sizes a step is bound by its weight bytes, and a step with a short prompt chunk by its linears'
 * FMAs, but the per-layer paths spend a step in ~150 kernel calls (lean decode) or ~30 ATen ops per layer (the
 * torch path of mixed steps: ~15 ms of dispatch on SmolLM2), each its own call, allocation and OpenMP fork/join
 * (decode_step.py has the measurements). Here the team is started once per step; phases of a layer are
 * separated by barriers only:
 *
 *   norm 1 -> QKV linear [-> q/k norms, clip] -> RoPE + K/V write -> paged attention (window, soft-cap)
 *   -> O linear + residual [or: -> post-norm, x + y * residual scale] -> norm 2
 *   -> gate_up (Llama) / fc (GPT-2) linear -> SiLU(gate) * up / GELU / GELU(gate) * up -> down linear + residual
 *      [or a mixture of experts: router, top-k, each chosen expert over its tokens; then post-norm, scale]
 *
 * After each of a layer's four linears the step's LoRA adapters, if any, add their deltas over their own rows
 * (lora_step.c, on the columns the thread just computed: no barrier added).
 *
 * The bracketed parts are the families' (models/decoder.py): q/k RMSNorms per head or over the projection
 * (Qwen3, Gemma 3, OLMo 2), OLMoE's clip, sliding windows and per-layer RoPE tables (Mistral, Gemma), partial
 * rotary (Phi-3), attention and final soft-caps (Gemma 2), post-norms (Gemma, OLMo 2; a NULL pre-norm is none),
 * Granite's multipliers, GeGLU, and mixtures of experts (Qwen3-MoE, Mixtral, OLMoE).
 *
 * and after the last layer the final norm and the lm_head run over the sample rows only (the rows whose logits
 * the caller needs: decode rows, a chunk's last token or all of its tokens); the final norm alone over the hidden
 * rows (a prompt embedded: its final hidden states are the output).
 *
 * Each phase reuses its kernel's inner loops, included from their sources (one copy of each kernel's
 * math): the linears split their outputs over threads in eights, as quant_gemm.c (rows of GGUF blocks, any
 * number of rows: its direct path, or its tile path above 8 rows) and small_gemm.c (fp32 panels) do; attention is paged_attention.c's
 * attend_row per (row, KV head, partition) item (a KV head's query heads are independent of the others', so the
 * split changes no result); the norms and activations are decode_ops.c's, a row per call. Every output keeps
 * its kernel's summation order and is computed by one thread, so results do not depend on the thread count,
 * and a decode-only step's are those of the per-layer lean calls, bit for bit.
 *
 * Shapes: B rows, C model width, H query heads, KVH K/V heads, G = H / KVH, D head_dim, NQKV = (H + 2 KVH) D,
 * NUP = the up linear's width (2I Llama: gate then up; 4C GPT-2), I = the down linear's input width, V vocab.
 * x [B, C] is the residual stream, updated in place.
 *
 * Built by step_abi.py with -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp (the union of the included kernels'
 * flags; contraction off as paged_attention.c and decode_ops.c are built), linked against quant_gemm.c's library;
 * int_dot.c (the integer path of ACTIVATIONS) is included.
 */
#include "quant_gemm.h"
#include "int_dot.c"
#include "small_gemm.c"
#include "decode_ops.c"
#include "paged_attention.c"

#define FMT_FP32 (-1)   /* small_gemm.c panels (a linear), fp32 rows (a token table); >= 0: a GGUF type id, | FMT_PACKED: packed */
#define FMT_PANELS (-2) /* a token table that is a tied lm_head's small_gemm.c panels */
#define MAX_PARTS 3     /* parts of one linear (step_abi.MAX_PARTS) */

/* N outputs of a linear in one format: rows of GGUF blocks (fmt a type id, quant_gemm.c) or small_gemm.c panels. */
typedef struct {
    const void *w;
    int fmt, N;
} LinPart;

/* One linear: its parts' outputs side by side (one part, unless a fused linear mixes types), bias or NULL. */
typedef struct {
    const float *bias;
    int K, N, n_parts;
    LinPart part[MAX_PARTS];
} Lin;

/* A mixture-of-experts MLP: router [E, C] fp32; per expert a fused gate+up [2I, C] and a down [C, I] linear. */
typedef struct {
    const float *router;
    const Lin *gate_up, *down; /* [E] each */
    int E, top_k, norm_topk;
} Moe;

typedef struct {
    const float *norm1_w, *norm1_b, *norm2_w, *norm2_b; /* the *_b NULL: RMSNorm, else LayerNorm; a *_w NULL: none */
    Lin qkv, o, up, down;                               /* up / down unused when moe is set */
    void *k_pool, *v_pool;    /* this layer's pools, [num_blocks, block_size, KVH, D] with the model's strides */
    float *k_scale, *v_scale; /* KV_INT8: their scales (paged_attention.c's KVPool), else NULL */
    float scale;              /* attention scale */
    const float *post1_w, *post2_w; /* RMSNorm of the attention / MLP output before its residual add, or NULL */
    const float *q_norm, *k_norm;   /* q/k RMSNorm weights: [D] per head, or over the projection (qk_full), or NULL */
    int qk_full;
    const float *cos, *sin; /* this layer's RoPE tables [max_len, R], or NULL (no rotation) */
    int window;             /* sliding window: a row attends its last `window` keys (0: all) */
    float softcap;          /* attention soft-cap (0: none) */
    const Moe *moe;         /* NULL: the dense MLP */
} Layer;

#include "lora_step.c"

#define ACT_SILU_GATED 0 /* SiLU(gate) * up (Llama) */
#define ACT_GELU 1       /* GELU tanh (GPT-2) */
#define ACT_GELU_GATED 2 /* GELU tanh(gate) * up (Gemma) */

typedef struct {
    int act;                                         /* ACT_* */
    int n_layer, C, H, KVH, D, R, block_size;        /* R: rotary dims of each head (the first R of D) */
    long block_stride, token_stride, head_stride;    /* pool strides in elements (D unit stride) */
    int kv_dtype;                                    /* the pools' elements: KV_FP32 .. KV_INT8 (paged_attention.c) */
    float eps;
    float embed_scale, residual_scale, logits_divisor, final_softcap, clip_qkv; /* 1, 1, 1, 0, 0: none */
    const float *normf_w, *normf_b;
    Lin lm_head;
    const Layer *layers;
    const void *embed;       /* token table [V, C]: rows of GGUF blocks (a type id), packed (a type id | FMT_PACKED: a
                              * tied lm_head's panels, int_packed.c), fp32 rows (-1) or panels (-2) */
    int embed_fmt;
    const float *pos_embed;  /* learned positions [max_len, C] (GPT-2), or NULL */
} Model;

/* Per-step pointers: what a step reads besides the model. Row b is one token: a decode token, or one token of a
 * prompt chunk (a chunk's tokens are consecutive rows, each at its own position); it attends positions
 * [0, pos[b]] of its sequence (context pos[b] + 1) through block table row row_table[b]. */
typedef struct {
    int B;                                        /* rows */
    const long *pos, *slot_blocks, *slot_offsets; /* [B] */
    const int *block_tables;                      /* [tables, table_stride] */
    const int *row_table;                         /* [B] row -> its table, or NULL: row b reads table b */
    int table_stride;
    int write_first; /* some sequence has several rows: every row's K/V is written before any row attends */
    int max_parts, part_tokens;
    float *ws_acc, *ws_m, *ws_l; /* partition partials [B, max_parts, H, (D)] when max_parts > 1 */
    const Lora *lora;            /* the LoRA adapters of this step's rows (lora_step.c), or NULL */
} Step;

static int context_of(const Step *s, int b) { return (int)s->pos[b] + 1; }

static const int *table_of(const Step *s, int b) {
    return s->block_tables + (long)(s->row_table ? s->row_table[b] : b) * s->table_stride;
}

/* Shared buffers (floats) and each thread's own, carved from one workspace. */
typedef struct {
    float *xn, *qkv, *att, *up, *act, *tile, *priv; /* priv: thread 0's; thread t's at priv + t * priv_floats */
    float *y;                                       /* a block's output before its post-norm and residual [B, C] */
    float *moe_x, *moe_y, *moe_out;                 /* an expert's gathered rows, its output, the MoE sum [B, C] */
    int *route_e, *order, *starts;                  /* each row's experts [B, k], rows by expert [B k], [E + 1] */
    float *route_w, *order_w;                       /* their weights */
    long priv_floats, act_at, scratch_at;           /* a thread's activation and Scratch in its priv */
    int *failed;                                    /* set when a linear's tile buffer cannot be allocated */
} Buffers;

/* The widest up linear (dense 2I or 4C, an expert's 2I) and down input over the layers. */
static int up_width(const Model *m) {
    int w = 0;
    for (int l = 0; l < m->n_layer; l++) {
        const Layer *L = &m->layers[l];
        int n = L->moe ? L->moe->gate_up[0].N : L->up.N;
        w = n > w ? n : w;
    }
    return w;
}

static int act_width(const Model *m) {
    int w = 0;
    for (int l = 0; l < m->n_layer; l++) {
        const Layer *L = &m->layers[l];
        int n = L->moe ? L->moe->down[0].K : L->down.K;
        w = n > w ? n : w;
    }
    return w;
}

/* The most experts and top-k of any MoE layer (0 without one). */
static int max_experts(const Model *m, int top_k) {
    int e = 0;
    for (int l = 0; l < m->n_layer; l++) {
        const Moe *x = m->layers[l].moe;
        int n = x ? (top_k ? x->top_k : x->E) : 0;
        e = n > e ? n : e;
    }
    return e;
}

/* n floats rounded up to whole cache lines (the workspace is cache-line aligned: so is every buffer carved from
 * it, and threads' own buffers share no line). */
static long lines(long n) { return (n + 15) / 16 * 16; }

/* Floats of the MoE buffers of a step of B rows (0 without experts). */
static long moe_floats(const Model *m, int B) {
    const long E = max_experts(m, 0), k = max_experts(m, 1);
    return E ? 3 * lines((long)B * m->C) + 4 * lines((long)B * k) + lines(2 * E + 1) : 0;
}

/* Floats of the shared buffers but the MoE ones: xn, qkv, att, up, act, y and a dequantized token row (quant_row). */
static long dense_floats(const Model *m, int B) {
    const long qkv = (long)(m->H + 2 * m->KVH) * m->D;
    const long embed_tile = lines((long)m->C + 32);
    return lines((long)B * (2 * m->C + qkv + (long)m->H * m->D + up_width(m) + act_width(m)) + embed_tile);
}

/* Floats of the shared buffers of a step of B rows. */
static long shared_floats(const Model *m, int B) {
    return dense_floats(m, B) + moe_floats(m, B);
}

/* Rows a thread's own buffers hold: norm and activation compute up to 2 nt rows in every thread (fewer threads
 * may start than asked for: fewer rows then). */
static int own_rows(int B, int nt) { return B < 2 * nt ? B : 2 * nt; }

/* A thread's own: a normalized copy of x and the activation for own_rows rows, and the attention Scratch (which
 * the MoE router's logits and picks, 3 E floats, reuse). */
static long own_floats(const Model *m, int B, int nt) {
    const long scratch = scratch_floats(m->H, m->D), route = 3L * max_experts(m, 0);
    return lines((long)own_rows(B, nt) * (m->C + act_width(m)) + (scratch > route ? scratch : route));
}

static Buffers carve(const Model *m, int B, int nt, float *ws, int *failed) {
    Buffers b;
    b.failed = failed;
    b.xn = ws;
    b.qkv = b.xn + (long)B * m->C;
    b.att = b.qkv + (long)B * (m->H + 2 * m->KVH) * m->D;
    b.up = b.att + (long)B * m->H * m->D;
    b.act = b.up + (long)B * up_width(m);
    b.y = b.act + (long)B * act_width(m);
    b.tile = b.y + (long)B * m->C;
    float *moe = ws + dense_floats(m, B);
    if (moe_floats(m, B)) {
        const long k = max_experts(m, 1), rows = lines((long)B * m->C), picks = lines((long)B * k);
        /* moe_x, moe_y, moe_out [B, C]; route_e, route_w, order, order_w [B k]; starts [2 E + 1] */
        b.moe_x = moe, b.moe_y = moe + rows, b.moe_out = moe + 2 * rows;
        b.route_e = (int *)(moe + 3 * rows), b.route_w = moe + 3 * rows + picks;
        b.order = (int *)(moe + 3 * rows + 2 * picks), b.order_w = moe + 3 * rows + 3 * picks;
        b.starts = (int *)(moe + 3 * rows + 4 * picks);
    } else {
        b.moe_x = b.moe_y = b.moe_out = b.route_w = b.order_w = 0;
        b.route_e = b.order = b.starts = 0;
    }
    b.priv = ws + shared_floats(m, B);
    b.priv_floats = own_floats(m, B, nt);
    b.act_at = (long)own_rows(B, nt) * m->C;
    b.scratch_at = (long)own_rows(B, nt) * (m->C + act_width(m));
    return b;
}

/* Floats of workspace a step of B rows at nthreads needs (decode_step.py allocates it once and grows it). */
long decode_step_workspace(const Model *m, int B, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    return shared_floats(m, B) + (long)nthreads * own_floats(m, B, nthreads);
}

/* This thread's share of each part of a linear: its outputs split in eights over the threads (small_gemm's panels,
 * quant_gemm's row groups); a part's outputs start at column n0 of Y (and of bias and R). A part of a type the
 * integer path takes (ACTIVATIONS, int_dot.c) multiplies int8 activations, as does a part packed at load (its type |
 * FMT_PACKED, int_packed.c: split in panels of 32); any other runs quant_gemm.c's exact fp32 path (its direct path
 * up to Q_DIRECT_ROWS rows, its tile path above). */
static void linear_part(const Buffers *buf, const Lin *L, const float *X, int ldx, const float *R, int ldr, float *Y,
                        int ldy, int M, int t, int nt) {
    for (int p = 0, n0 = 0; p < L->n_parts; n0 += L->part[p].N, p++) {
        const LinPart *P = &L->part[p];
        const int packed = id_packed(P->fmt), unit = packed ? PK_COLS : PANEL; /* packed: panels of 32 */
        const int units = (P->N + unit - 1) / unit;
        const int u0 = (int)((long)units * t / nt), u1 = (int)((long)units * (t + 1) / nt);
        if (u0 >= u1) continue;
        const float *bias = L->bias ? L->bias + n0 : NULL, *r = R ? R + n0 : NULL;
        if (packed) { /* packed at load (int_packed.c): int8 activations in every step */
            if (int_dot_linear(P->fmt, X, ldx, P->w, bias, r, ldr, Y + n0, ldy, M, L->K, P->N, u0, u1))
                __atomic_store_n(buf->failed, 1, __ATOMIC_RELAXED);
        } else if (P->fmt == FMT_FP32) {
            panels(X, ldx, P->w, bias, r, ldr, Y + n0, ldy, M, L->K, P->N, u0, u1);
        } else if (int_dot_wants(P->fmt, M) &&
                   int_dot_linear(P->fmt, X, ldx, P->w, bias, r, ldr, Y + n0, ldy, M, L->K, P->N, u0, u1) == 0) {
            ; /* int8 activations and integer dot products */
        } else {
            const int n1 = u1 * PANEL < P->N ? u1 * PANEL : P->N;
            if (quant_range(P->fmt, X, ldx, P->w, bias, r, ldr, Y + n0, ldy, M, L->K, u0 * PANEL, n1, Q_DIRECT_ROWS))
                __atomic_store_n(buf->failed, 1, __ATOMIC_RELAXED);
        }
    }
}

/* Rows [r0, r1) of the rows list (NULL: rows r0.. r1 - 1 of x) normalized into y's rows [r0, r1). */
static void norm_rows(const Model *m, const float *w, const float *b, const float *x, const long *rows, float *y,
                      int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const float *xr = x + (rows ? rows[r] : r) * (long)m->C;
        if (b) layer_norm(xr, m->C, w, b, y + (long)r * m->C, 1, m->C, m->eps);
        else rms_norm(xr, m->C, w, y + (long)r * m->C, 1, m->C, m->eps);
    }
}

/* n rows of x [B, C] (those listed in rows, or the first n when rows is NULL) normalized for the next linear.
 * Few rows: every thread normalizes all of them into its own buffer (no barrier; the same values in each);
 * more: the rows split over threads into the shared buffer, then a barrier. The choice depends on n and nt
 * only, so every thread takes the same branch. No norm (w NULL, OLMo 2's blocks): x itself. */
static const float *norm(const Model *m, const Buffers *buf, const float *w, const float *b, const float *x,
                         const long *rows, int n, int t, int nt) {
    if (!w && !rows) return x;
    if (n <= 2 * nt) {
        float *own = buf->priv + t * buf->priv_floats;
        norm_rows(m, w, b, x, rows, own, 0, n);
        return own;
    }
    norm_rows(m, w, b, x, rows, buf->xn, (int)((long)n * t / nt), (int)((long)n * (t + 1) / nt));
#pragma omp barrier
    return buf->xn;
}

/* This layer's pools as paged_attention.c reads them. */
static KVPool layer_pool(const Model *m, const Layer *L) {
    KVPool p = {L->k_pool, L->v_pool, L->k_scale, L->v_scale, m->block_stride, m->token_stride, m->head_stride,
                m->kv_dtype, m->block_size, m->KVH, m->D};
    return p;
}

/* One attention item: row b, KV head kvh (its G query heads), tokens [t0, t1) of partition part. */
static void attend_item(const Model *m, const Layer *L, const Step *s, const Buffers *buf, int t, int b, int kvh,
                        int part) {
    const int H = m->H, D = m->D, R = m->R, G = H / m->KVH, h0 = kvh * G;
    const int ctx = context_of(s, b), t0 = parts_base(ctx, L->window, m->block_size) + part * s->part_tokens;
    if (t0 >= ctx && part > 0) return;
    const int t1 = t0 + s->part_tokens < ctx ? t0 + s->part_tokens : ctx;
    const float *row = buf->qkv + (long)b * (H + 2 * m->KVH) * D;
    const float *c = L->cos ? L->cos + s->pos[b] * R : 0, *sn = L->sin ? L->sin + s->pos[b] * R : 0;
    Scratch w = scratch_at(buf->priv + t * buf->priv_floats + buf->scratch_at, G, D);
    rope_queries(row, c, sn, w.acc, R, D, h0, h0 + G); /* acc as the rotated queries' buffer, zeroed by attend_row */
    for (long i = 0; i < (long)G * D; i++) w.qs[i] = w.acc[i] * L->scale;
    const KVPool pool = layer_pool(m, L);
    attend_row(&w, &pool, table_of(s, b), t0, t1, window_first(ctx, L->window), L->softcap, kvh, kvh + 1, G);
    if (s->max_parts == 1) {
        finish_heads(&w, G, D, buf->att + ((long)b * H + h0) * D);
    } else {
        const long it = (long)b * s->max_parts + part;
        save_partial(&w, G, D, s->ws_acc + (it * H + h0) * D, s->ws_m + it * H + h0, s->ws_l + it * H + h0);
    }
}

/* Row b's new k (rotated) and v of KV heads [h0, h1) into their slot, in the pools' dtype. */
static void write_row(const Model *m, const Layer *L, const Step *s, const Buffers *buf, int b, int h0, int h1) {
    const int H = m->H, KVH = m->KVH, D = m->D, R = m->R;
    const float *row = buf->qkv + (long)b * (H + 2 * KVH) * D;
    const float *c = L->cos ? L->cos + s->pos[b] * R : 0, *sn = L->sin ? L->sin + s->pos[b] * R : 0;
    const long slot = s->slot_blocks[b] * m->block_stride + s->slot_offsets[b] * m->token_stride;
    const KVPool pool = layer_pool(m, L);
    write_kv(row, c, sn, &pool, slot, H, R, h0, h1);
}

/* RoPE + K/V write, then attention over every row's blocks -> buf->att [B, H D]. Ends after a barrier.
 * Decode rows only, contexts up to PART_TOKENS (one partition per row): item (b, kvh) writes its own K/V head,
 * then attends over it: no other item reads that slot (a row attends its own blocks, and the block a step
 * writes is never shared: block_manager.py). A step with a prompt chunk (a chunk's row attends the slots of
 * the chunk's earlier rows) or a longer context: every write first, then the partitions, then combined. */
static void attention(const Model *m, const Layer *L, const Step *s, const Buffers *buf, int t) {
    const int B = s->B, KVH = m->KVH, H = m->H, D = m->D;
    if (s->max_parts == 1 && !s->write_first) {
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < (long)B * KVH; it++) {
            const int b = (int)(it / KVH), kvh = (int)(it % KVH);
            write_row(m, L, s, buf, b, kvh, kvh + 1);
            attend_item(m, L, s, buf, t, b, kvh, 0);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int b = 0; b < B; b++) write_row(m, L, s, buf, b, 0, KVH);
    const long items = (long)B * KVH * s->max_parts;
#pragma omp for schedule(dynamic, 1)
    for (long it = 0; it < items; it++)
        attend_item(m, L, s, buf, t, (int)(it / ((long)KVH * s->max_parts)), (int)(it / s->max_parts % KVH),
                    (int)(it % s->max_parts));
    if (s->max_parts == 1) return;
#pragma omp for schedule(static)
    for (long bh = 0; bh < (long)B * H; bh++) {
        long b = bh / H, h = bh % H;
        int parts = parts_of(context_of(s, (int)b), L->window, m->block_size, s->part_tokens);
        combine_head(s->ws_acc, s->ws_m, s->ws_l, b, h, H, D, parts, s->max_parts, buf->att + bh * D);
    }
}

static void activate_rows(const Model *m, const float *up, int nup, int I, float *act, int r0, int r1) {
    for (int b = r0; b < r1; b++) {
        const float *u = up + (long)b * nup;
        if (m->act == ACT_GELU) gelu_tanh(u, nup, act + (long)b * I, I, 1, I);
        else if (m->act == ACT_GELU_GATED) gelu_mul(u, nup, act + (long)b * I, 1, I);
        else silu_mul(u, nup, act + (long)b * I, 1, I);
    }
}

/* The MLP's activation of the up linear's output [B, nup] -> the down linear's input [B, I]. Like norm: few rows,
 * each thread computes them all into its own buffer (no barrier); more, rows split into the shared one, a barrier. */
static const float *activation(const Model *m, const Buffers *buf, int nup, int I, int B, int t, int nt) {
    if (B <= 2 * nt) {
        float *own = buf->priv + t * buf->priv_floats + buf->act_at;
        activate_rows(m, buf->up, nup, I, own, 0, B);
        return own;
    }
    activate_rows(m, buf->up, nup, I, buf->act, (int)((long)B * t / nt), (int)((long)B * (t + 1) / nt));
#pragma omp barrier
    return buf->act;
}

/* Rows [r0, r1) of qkv: q and k RMS-normalized in place (per head over D, or over the whole projection), then q, k
 * and v clipped to [-clip_qkv, clip_qkv] (OLMoE), as models/decoder.py's lean path computes them. */
static void qk_rows(const Model *m, const Layer *L, const Buffers *buf, int r0, int r1) {
    const int H = m->H, KVH = m->KVH, D = m->D;
    const long nqkv = (long)(H + 2 * KVH) * D;
    for (int b = r0; b < r1; b++) {
        float *q = buf->qkv + b * nqkv, *k = q + (long)H * D;
        if (L->q_norm && L->qk_full) {
            rms_norm(q, H * D, L->q_norm, q, 1, H * D, m->eps);
            rms_norm(k, KVH * D, L->k_norm, k, 1, KVH * D, m->eps);
        } else if (L->q_norm) {
            rms_norm(q, D, L->q_norm, q, H, D, m->eps);
            rms_norm(k, D, L->k_norm, k, KVH, D, m->eps);
        }
        if (m->clip_qkv > 0.0f)
            for (long i = 0; i < nqkv; i++) q[i] = q[i] < -m->clip_qkv ? -m->clip_qkv : q[i] > m->clip_qkv ? m->clip_qkv : q[i];
    }
}

/* x += post(y) * residual_scale over rows split between threads (post NULL: no norm; scale 1: x + y), then a
 * barrier: a block's output added to the residual stream when a norm or a multiplier comes between. */
static void post_residual(const Model *m, const float *post, float *y, float *x, int B, int t, int nt) {
    const int C = m->C, r0 = (int)((long)B * t / nt), r1 = (int)((long)B * (t + 1) / nt);
    for (int b = r0; b < r1; b++) {
        float *yr = y + (long)b * C, *xr = x + (long)b * C;
        if (post) rms_norm(yr, C, post, yr, 1, C, m->eps);
        if (m->residual_scale != 1.0f)
            for (int c = 0; c < C; c++) xr[c] = xr[c] + yr[c] * m->residual_scale;
        else
            for (int c = 0; c < C; c++) xr[c] = xr[c] + yr[c];
    }
#pragma omp barrier
}

/* Whether a block's output goes straight into the residual stream (fused into its linear's epilogue). */
static int plain_residual(const Model *m, const float *post) { return !post && m->residual_scale == 1.0f; }

#include "moe_route.c"

/* A mixture of experts over the normalized rows xn [B, C] -> buf->moe_out [B, C]: each row's top-k experts
 * (moe_route.c: the router, its softmax and torch.topk's choice, ties included), the rows grouped by expert, then
 * each chosen expert, in ascending order, over all of its rows: gather, gate+up, activation, down, and each row's
 * weighted output added into its sum (HF's order of addition). An expert no row chose never runs. The down linear's
 * output panels are split over threads as in linear_part, and each thread adds the columns it computed: no barrier
 * between one expert's adds and the next expert's rows. */
static void moe_mlp(const Model *m, const Layer *L, const Buffers *buf, const float *xn, int B, int t, int nt) {
    const Moe *x = L->moe;
    const int C = m->C, k = x->top_k, nup = x->gate_up[0].N, I = x->down[0].K;
    const int r0 = (int)((long)B * t / nt), r1 = (int)((long)B * (t + 1) / nt);
    for (int b = r0; b < r1; b++) {
        route_row(x->router, xn + (long)b * C, C, x->E, k, x->norm_topk, buf->route_e + (long)b * k,
                  buf->route_w + (long)b * k, buf->priv + t * buf->priv_floats + buf->scratch_at);
        for (int c = 0; c < C; c++) buf->moe_out[(long)b * C + c] = 0.0f;
    }
#pragma omp barrier
#pragma omp single
    group_by_expert(buf->route_e, buf->route_w, B, k, x->E, buf->order, buf->order_w, buf->starts);
    const int npanels = (C + PANEL - 1) / PANEL;
    const int c0 = (int)((long)npanels * t / nt) * PANEL, c1 = (int)((long)npanels * (t + 1) / nt) * PANEL;
    for (int e = 0; e < x->E; e++) {
        const int first = buf->starts[e], n = buf->starts[e + 1] - first;
        if (!n) continue;
        for (int i = (int)((long)n * t / nt); i < (int)((long)n * (t + 1) / nt); i++)
            memcpy(buf->moe_x + (long)i * C, xn + (long)buf->order[first + i] * C, sizeof(float) * C);
#pragma omp barrier
        linear_part(buf, &x->gate_up[e], buf->moe_x, C, NULL, 0, buf->up, nup, n, t, nt);
#pragma omp barrier
        const float *act = activation(m, buf, nup, I, n, t, nt);
        linear_part(buf, &x->down[e], act, I, NULL, 0, buf->moe_y, C, n, t, nt);
        for (int i = 0; i < n; i++) {
            const float w = buf->order_w[first + i], *yr = buf->moe_y + (long)i * C;
            float *o = buf->moe_out + (long)buf->order[first + i] * C;
            for (int c = c0; c < c1 && c < C; c++) o[c] = o[c] + yr[c] * w;
        }
    }
#pragma omp barrier
}

static void layer(const Model *m, int l, const Step *s, const Buffers *buf, float *x, int t, int nt) {
    const Layer *L = &m->layers[l];
    const int B = s->B, C = m->C, HD = m->H * m->D, nqkv = L->qkv.N;
    const float *xn = norm(m, buf, L->norm1_w, L->norm1_b, x, NULL, B, t, nt);
    linear_part(buf, &L->qkv, xn, C, NULL, 0, buf->qkv, nqkv, B, t, nt);
    lora_linear(s->lora, l, 0, &L->qkv, xn, C, buf->qkv, nqkv, t, nt);
#pragma omp barrier
    if (L->q_norm || m->clip_qkv > 0.0f) {
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) qk_rows(m, L, buf, b, b + 1);
    }
    attention(m, L, s, buf, t);
    if (plain_residual(m, L->post1_w)) { /* x += O att: an output's residual read, then written */
        linear_part(buf, &L->o, buf->att, HD, x, C, x, C, B, t, nt);
        lora_linear(s->lora, l, 1, &L->o, buf->att, HD, x, C, t, nt);
#pragma omp barrier
    } else {
        linear_part(buf, &L->o, buf->att, HD, NULL, 0, buf->y, C, B, t, nt);
        lora_linear(s->lora, l, 1, &L->o, buf->att, HD, buf->y, C, t, nt);
#pragma omp barrier
        post_residual(m, L->post1_w, buf->y, x, B, t, nt);
    }
    xn = norm(m, buf, L->norm2_w, L->norm2_b, x, NULL, B, t, nt);
    if (L->moe) {
        moe_mlp(m, L, buf, xn, B, t, nt);
        post_residual(m, L->post2_w, buf->moe_out, x, B, t, nt);
        return;
    }
    const int nup = L->up.N, I = L->down.K;
    linear_part(buf, &L->up, xn, C, NULL, 0, buf->up, nup, B, t, nt);
    lora_linear(s->lora, l, 2, &L->up, xn, C, buf->up, nup, t, nt);
#pragma omp barrier
    const float *act = activation(m, buf, nup, I, B, t, nt);
    if (plain_residual(m, L->post2_w)) {
        linear_part(buf, &L->down, act, I, x, C, x, C, B, t, nt);
        lora_linear(s->lora, l, 3, &L->down, act, I, x, C, t, nt);
#pragma omp barrier
    } else {
        linear_part(buf, &L->down, act, I, NULL, 0, buf->y, C, B, t, nt);
        lora_linear(s->lora, l, 3, &L->down, act, I, buf->y, C, t, nt);
#pragma omp barrier
        post_residual(m, L->post2_w, buf->y, x, B, t, nt);
    }
}

/* x[b] = row ids[b] of the token table (+ row pos[b] of the position table): a quantized row dequantized by
 * quant_gemm.c's quant_row into tile (the values quant_gemm.dequantize_rows gives; a packed table's row block by
 * block, the same values). */
static void embed(const Model *m, const long *ids, const long *pos, float *x, int B, float *tile) {
    const int C = m->C;
    for (int b = 0; b < B; b++) {
        float *xb = x + (long)b * C;
        if (m->embed_fmt == FMT_FP32) {
            memcpy(xb, (const float *)m->embed + ids[b] * C, sizeof(float) * C);
        } else if (m->embed_fmt == FMT_PANELS) { /* column ids % 8 of panel ids / 8 */
            const float *panel = (const float *)m->embed + ids[b] / PANEL * C * PANEL + ids[b] % PANEL;
            for (int k = 0; k < C; k++) xb[k] = panel[(long)k * PANEL];
        } else if (id_packed(m->embed_fmt)) { /* a tied lm_head packed at load: its row's blocks one at a time */
            const int type = m->embed_fmt & ~FMT_PACKED, f = id_kind(type);
            uint8_t blk[256]; /* a Q4_K (144) or Q6_K (210) block */
            for (int sb = 0; sb < C / 256; sb++) {
                pk_unpack_block(f, (const uint8_t *)m->embed, C, (int)ids[b], sb, blk);
                quant_row(type, blk, 256, xb + 256 * sb);
            }
        } else {
            quant_row(m->embed_fmt, (const uint8_t *)m->embed + ids[b] * quant_row_bytes(m->embed_fmt, C), C, tile);
            memcpy(xb, tile, sizeof(float) * C);
        }
        if (m->pos_embed)
            for (int k = 0; k < C; k++) xb[k] += m->pos_embed[pos[b] * C + k];
        if (m->embed_scale != 1.0f)
            for (int k = 0; k < C; k++) xb[k] *= m->embed_scale;
    }
}

/* ids [B] token ids -> logits [n_sample, V] of the rows listed in sample_rows (NULL: every row, n_sample = B);
 * x [B, C] the residual stream (the embeddings, then each layer's output). block_tables [tables, table_stride]
 * and row_table [B] (NULL: row b reads table b): see Step. write_first: set when a sequence has several rows.
 * hidden [n_hidden, C]: the final hidden states (after the final norm, before the lm_head) of the rows listed in
 * hidden_rows (embeddings; n_hidden 0: none); a row may be in both lists, or in neither (n_sample may be 0).
 * ws: decode_step_workspace(m, B, nthreads) floats. lora: the rows' LoRA adapters (lora_step.c), or NULL. Returns
 * 0, or -1 when the partition workspace of a long context or a linear's tile buffer (quant_gemm.c) cannot be
 * allocated. */
int decode_step(const Model *m, const long *ids, float *x, int B, const long *pos, const long *slot_blocks,
                const long *slot_offsets, const int *block_tables, int table_stride, const int *row_table,
                int write_first, const long *sample_rows, int n_sample, float *logits, const long *hidden_rows,
                int n_hidden, float *hidden, float *ws, int nthreads, const Lora *lora) {
    if (nthreads < 1) nthreads = 1;
    Step s = {B, pos, slot_blocks, slot_offsets, block_tables, row_table, table_stride, write_first, 1, 0, 0, 0, 0,
              lora};
    s.part_tokens = part_tokens_for(m->block_size, 0);
    for (int b = 0; b < B; b++) {
        const int parts = (context_of(&s, b) + s.part_tokens - 1) / s.part_tokens;
        s.max_parts = parts > s.max_parts ? parts : s.max_parts;
    }
    float *partials = NULL;
    if (s.max_parts > 1) {
        const long items = (long)B * s.max_parts;
        partials = malloc(sizeof(float) * (size_t)(items * m->H * (m->D + 2)));
        if (!partials) return -1;
        s.ws_acc = partials;
        s.ws_m = partials + items * m->H * m->D;
        s.ws_l = s.ws_m + items * m->H;
    }
    int failed = 0;
    const Buffers buf = carve(m, B, nthreads, ws, &failed);
    embed(m, ids, pos, x, B, buf.tile);
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        for (int l = 0; l < m->n_layer; l++) layer(m, l, &s, &buf, x, t, nt);
        if (n_hidden > 0) /* x is complete (each layer ends on a barrier); the rows split over threads */
            norm_rows(m, m->normf_w, m->normf_b, x, hidden_rows, hidden, (int)((long)n_hidden * t / nt),
                      (int)((long)n_hidden * (t + 1) / nt));
        if (n_sample > 0) {
            const float *xn = norm(m, &buf, m->normf_w, m->normf_b, x, sample_rows, n_sample, t, nt);
            linear_part(&buf, &m->lm_head, xn, m->C, NULL, 0, logits, m->lm_head.N, n_sample, t, nt);
            if (m->logits_divisor != 1.0f || m->final_softcap > 0.0f) {
#pragma omp barrier
                const long V = m->lm_head.N;
#pragma omp for schedule(static)
                for (int r = 0; r < n_sample; r++)
                    cap_logits(logits + r * V, V, m->logits_divisor, m->final_softcap);
            }
        }
    }
    free(partials);
    return failed ? -1 : 0;
}
