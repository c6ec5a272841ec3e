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
 *   norm 1 -> QKV linear -> RoPE + K/V write -> paged attention -> O linear + residual -> norm 2
 *   -> gate_up (Llama) / fc (GPT-2) linear -> SiLU(gate) * up / GELU -> down linear + residual
 *
 * and after the last layer the final norm and the lm_head run over the sample rows only (the rows whose logits
 * the caller needs: decode rows, a chunk's last token or all of its tokens).
 *
 * Each phase reuses its kernel's inner loops, included from their sources (one copy of each kernel's
 * math): the linears split their 8-column output panels over threads exactly as quant_gemm.c's direct
 * path (int8 / int4, any number of rows) and small_gemm.c (fp32 panels) do; attention is paged_attention.c's
 * attend_row per (row, KV head, partition) item (a KV head's query heads are independent of the others', so the
 * split changes no result); the norms and activations are decode_ops.c's, a row per call. Every output keeps
 * its kernel's summation order and is computed by one thread, so results do not depend on the thread count,
 * and a decode-only step's are those of the per-layer lean calls, bit for bit.
 *
 * Shapes: B rows, C model width, H query heads, KVH K/V heads, G = H / KVH, D head_dim, NQKV = (H + 2 KVH) D,
 * NUP = the up linear's width (2I Llama: gate then up; 4C GPT-2), I = the down linear's input width, V vocab.
 * x [B, C] is the residual stream, updated in place.
 *
 * Built by decode_step.py with -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp (the union of the
 * included kernels' flags; contraction off as paged_attention.c and decode_ops.c are built).
 */
#include "quant_gemm.c"
#include "small_gemm.c"
#include "decode_ops.c"
#include "paged_attention.c"

#define FMT_FP32 (-1)   /* small_gemm.c panels (a linear), fp32 rows (a token table); 0 / 1: quant_gemm.c's formats */
#define FMT_PANELS (-2) /* a token table that is a tied lm_head's small_gemm.c panels */

/* One linear: packed weight w (quant_gemm.c layout for fmt 0 / 1, small_gemm.c panels for fmt -1), bias or NULL. */
typedef struct {
    const void *w;
    const float *bias;
    int fmt, K, N;
} Lin;

typedef struct {
    const float *norm1_w, *norm1_b, *norm2_w, *norm2_b; /* the *_b NULL: RMSNorm (Llama), else LayerNorm */
    Lin qkv, o, up, down;
    void *k_pool, *v_pool;    /* this layer's pools, [num_blocks, block_size, KVH, D] with the model's strides */
    float *k_scale, *v_scale; /* KV_INT8: their scales (paged_attention.c's KVPool), else NULL */
    float scale;              /* attention scale */
} Layer;

typedef struct {
    int gelu;                                        /* 0: SiLU(gate) * up (Llama); 1: GELU tanh (GPT-2) */
    int n_layer, C, H, KVH, D, block_size;
    long block_stride, token_stride, head_stride;    /* pool strides in elements (D unit stride) */
    int kv_dtype;                                    /* the pools' elements: KV_FP32 .. KV_INT8 (paged_attention.c) */
    float eps;
    const float *cos, *sin;                          /* RoPE tables [max_len, D], or NULL (no rotation) */
    const float *normf_w, *normf_b;
    Lin lm_head;
    const Layer *layers;
    const void *embed;       /* token table [V, C]: quant_gemm.c layout (0 / 1), fp32 rows (-1) or panels (-2) */
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
} Step;

static int context_of(const Step *s, int b) { return (int)s->pos[b] + 1; }

static const int *table_of(const Step *s, int b) {
    return s->block_tables + (long)(s->row_table ? s->row_table[b] : b) * s->table_stride;
}

/* Shared buffers (floats) and each thread's own, carved from one workspace. */
typedef struct {
    float *xn, *qkv, *att, *up, *act, *tile, *priv; /* priv: thread 0's; thread t's at priv + t * priv_floats */
    long priv_floats, act_at, scratch_at;           /* a thread's activation and Scratch in its priv */
} Buffers;

static int up_width(const Model *m) { return m->layers[0].up.N; }

static int act_width(const Model *m) { return m->layers[0].down.K; }

/* n floats rounded up to whole cache lines (the workspace is cache-line aligned: so is every buffer carved from
 * it, and threads' own buffers share no line). */
static long lines(long n) { return (n + 15) / 16 * 16; }

/* Floats of the shared buffers of a step of B rows. */
static long shared_floats(const Model *m, int B) {
    const long qkv = (long)(m->H + 2 * m->KVH) * m->D;
    const long embed_tile = (long)m->C * 2 * PANEL; /* dequant_panel's buffer: one panel's 8 rows */
    return lines((long)B * (m->C + qkv + (long)m->H * m->D + up_width(m) + act_width(m)) + embed_tile);
}

/* Rows a thread's own buffers hold: norm and activation compute up to 2 nt rows in every thread (fewer threads
 * may start than asked for: fewer rows then). */
static int own_rows(int B, int nt) { return B < 2 * nt ? B : 2 * nt; }

/* A thread's own: a normalized copy of x and the activation for own_rows rows, and the attention Scratch. */
static long own_floats(const Model *m, int B, int nt) {
    return lines((long)own_rows(B, nt) * (m->C + act_width(m)) + scratch_floats(m->H, m->D));
}

static Buffers carve(const Model *m, int B, int nt, float *ws) {
    Buffers b;
    b.xn = ws;
    b.qkv = b.xn + (long)B * m->C;
    b.att = b.qkv + (long)B * (m->H + 2 * m->KVH) * m->D;
    b.up = b.att + (long)B * m->H * m->D;
    b.act = b.up + (long)B * up_width(m);
    b.tile = b.act + (long)B * act_width(m);
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

/* This thread's share [p0, p1) of a linear's output panels: the split quant_gemm's direct path and small_gemm make.
 * Any number of rows: above 8, quant_gemm.c dequantizes each block once into L1 for up to 48 rows (measured in
 * this call at 15-71 rows on SmolLM2: as fast as its L2-tile path or faster, decode_step.py). */
static void linear_part(const Lin *L, const float *X, int ldx, const float *R, int ldr, float *Y, int ldy, int M,
                        int t, int nt) {
    const int npanels = (L->N + PANEL - 1) / PANEL;
    const int p0 = (int)((long)npanels * t / nt), p1 = (int)((long)npanels * (t + 1) / nt);
    if (p0 >= p1) return;
    if (L->fmt == FMT_FP32) panels(X, ldx, L->w, L->bias, R, ldr, Y, ldy, M, L->K, L->N, p0, p1);
    else direct_range(L->fmt, X, ldx, L->w, L->bias, R, ldr, Y, ldy, M, L->K, L->N, p0, p1);
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
 * only, so every thread takes the same branch. */
static const float *norm(const Model *m, const Buffers *buf, const float *w, const float *b, const float *x,
                         const long *rows, int n, int t, int nt) {
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
    const int H = m->H, D = m->D, G = H / m->KVH, h0 = kvh * G;
    const int ctx = context_of(s, b), t0 = part * s->part_tokens;
    if (t0 >= ctx && part > 0) return;
    const int t1 = t0 + s->part_tokens < ctx ? t0 + s->part_tokens : ctx;
    const float *row = buf->qkv + (long)b * (H + 2 * m->KVH) * D;
    const float *c = m->cos ? m->cos + s->pos[b] * D : 0, *sn = m->sin ? m->sin + s->pos[b] * D : 0;
    Scratch w = scratch_at(buf->priv + t * buf->priv_floats + buf->scratch_at, G, D);
    rope_queries(row, c, sn, w.acc, D, h0, h0 + G); /* acc as the rotated queries' buffer, zeroed by attend_row */
    for (long i = 0; i < (long)G * D; i++) w.qs[i] = w.acc[i] * L->scale;
    const KVPool pool = layer_pool(m, L);
    attend_row(&w, &pool, table_of(s, b), t0, t1, kvh, kvh + 1, G);
    if (s->max_parts == 1) {
        finish_heads(&w, G, D, buf->att + ((long)b * H + h0) * D);
    } else {
        const long it = (long)b * s->max_parts + part;
        save_partial(&w, G, D, s->ws_acc + (it * H + h0) * D, s->ws_m + it * H + h0, s->ws_l + it * H + h0);
    }
}

/* Row b's new k (rotated) and v of KV heads [h0, h1) into their slot, in the pools' dtype. */
static void write_row(const Model *m, const Layer *L, const Step *s, const Buffers *buf, int b, int h0, int h1) {
    const int H = m->H, KVH = m->KVH, D = m->D;
    const float *row = buf->qkv + (long)b * (H + 2 * KVH) * D;
    const float *c = m->cos ? m->cos + s->pos[b] * D : 0, *sn = m->sin ? m->sin + s->pos[b] * D : 0;
    const long slot = s->slot_blocks[b] * m->block_stride + s->slot_offsets[b] * m->token_stride;
    const KVPool pool = layer_pool(m, L);
    write_kv(row, c, sn, &pool, slot, H, h0, h1);
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
        int parts = (context_of(s, (int)b) + s->part_tokens - 1) / s->part_tokens;
        combine_head(s->ws_acc, s->ws_m, s->ws_l, b, h, H, D, parts, s->max_parts, buf->att + bh * D);
    }
}

static void activate_rows(const Model *m, const Buffers *buf, float *act, int r0, int r1) {
    const int nup = up_width(m), I = act_width(m);
    for (int b = r0; b < r1; b++) {
        const float *u = buf->up + (long)b * nup;
        if (m->gelu) gelu_tanh(u, nup, act + (long)b * I, I, 1, I);
        else silu_mul(u, nup, act + (long)b * I, 1, I);
    }
}

/* The MLP's activation of the up linear's output -> the down linear's input [B, I]. Like norm: few rows, each
 * thread computes them all into its own buffer (no barrier); more, rows split into the shared one, a barrier. */
static const float *activation(const Model *m, const Buffers *buf, int B, int t, int nt) {
    if (B <= 2 * nt) {
        float *own = buf->priv + t * buf->priv_floats + buf->act_at;
        activate_rows(m, buf, own, 0, B);
        return own;
    }
    activate_rows(m, buf, buf->act, (int)((long)B * t / nt), (int)((long)B * (t + 1) / nt));
#pragma omp barrier
    return buf->act;
}

static void layer(const Model *m, const Layer *L, const Step *s, const Buffers *buf, float *x, int t, int nt) {
    const int B = s->B, C = m->C, HD = m->H * m->D, nqkv = L->qkv.N, nup = L->up.N;
    const float *xn = norm(m, buf, L->norm1_w, L->norm1_b, x, NULL, B, t, nt);
    linear_part(&L->qkv, xn, C, NULL, 0, buf->qkv, nqkv, B, t, nt);
#pragma omp barrier
    attention(m, L, s, buf, t);
    linear_part(&L->o, buf->att, HD, x, C, x, C, B, t, nt); /* x += O att: an output's residual read, then written */
#pragma omp barrier
    xn = norm(m, buf, L->norm2_w, L->norm2_b, x, NULL, B, t, nt);
    linear_part(&L->up, xn, C, NULL, 0, buf->up, nup, B, t, nt);
#pragma omp barrier
    const float *act = activation(m, buf, B, t, nt);
    linear_part(&L->down, act, L->down.K, x, C, x, C, B, t, nt);
#pragma omp barrier
}

/* x[b] = row ids[b] of the token table (+ row pos[b] of the position table): a quantized row dequantized by
 * quant_gemm.c's dequant_panel (its panel's 8 rows into tile, the values quant_gemm.dequantize_rows gives). */
static void embed(const Model *m, const long *ids, const long *pos, float *x, int B, float *tile) {
    const int C = m->C;
    for (int b = 0; b < B; b++) {
        float *xb = x + (long)b * C;
        if (m->embed_fmt == FMT_FP32) {
            memcpy(xb, (const float *)m->embed + ids[b] * C, sizeof(float) * C);
        } else if (m->embed_fmt == FMT_PANELS) { /* column ids % 8 of panel ids / 8 */
            const float *panel = (const float *)m->embed + ids[b] / PANEL * C * PANEL + ids[b] % PANEL;
            for (int k = 0; k < C; k++) xb[k] = panel[(long)k * PANEL];
        } else {
            const long panel_bytes = (long)((C + GROUP - 1) / GROUP) * block_bytes(m->embed_fmt);
            dequant_panel(m->embed_fmt, (const uint8_t *)m->embed + ids[b] / PANEL * panel_bytes, C, tile, 0);
            for (int k = 0; k < C; k++) xb[k] = tile[(long)k * 2 * PANEL + ids[b] % PANEL];
        }
        if (m->pos_embed)
            for (int k = 0; k < C; k++) xb[k] += m->pos_embed[pos[b] * C + k];
    }
}

/* ids [B] token ids -> logits [n_sample, V] of the rows listed in sample_rows (NULL: every row, n_sample = B);
 * x [B, C] the residual stream (the embeddings, then each layer's output). block_tables [tables, table_stride]
 * and row_table [B] (NULL: row b reads table b): see Step. write_first: set when a sequence has several rows.
 * ws: decode_step_workspace(m, B, nthreads) floats. Returns 0, or -1 when the partition workspace of a long
 * context cannot be allocated. */
int decode_step(const Model *m, const long *ids, float *x, int B, const long *pos, const long *slot_blocks,
                const long *slot_offsets, const int *block_tables, int table_stride, const int *row_table,
                int write_first, const long *sample_rows, int n_sample, float *logits, float *ws, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    Step s = {B, pos, slot_blocks, slot_offsets, block_tables, row_table, table_stride, write_first, 1, 0, 0, 0, 0};
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
    const Buffers buf = carve(m, B, nthreads, ws);
    embed(m, ids, pos, x, B, buf.tile);
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        for (int l = 0; l < m->n_layer; l++) layer(m, &m->layers[l], &s, &buf, x, t, nt);
        const float *xn = norm(m, &buf, m->normf_w, m->normf_b, x, sample_rows, n_sample, t, nt);
        linear_part(&m->lm_head, xn, m->C, NULL, 0, logits, m->lm_head.N, n_sample, t, nt);
    }
    free(partials);
    return 0;
}
