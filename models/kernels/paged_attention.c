/* Paged decode attention, fp32: one query token per row against K/V read in place from a block pool.
 *
 * Why: with the KV cache managed as a pool of fixed-size blocks, a sequence's keys and values sit in
 * blocks scattered over the pool. Gathering them into a contiguous buffer each step costs a copy of the
 * whole context per layer (measured up to 4.6x slower attention); this kernel follows each row's block
 * table instead and streams every block once.
 *
 * Shapes (floats; strides in floats, the head dimension D always unit stride):
 *   q            [B, H, D]       row b at q + b * q_row_stride, head h at + h * D
 *   k/v pool     [num_blocks, block_size, KVH, D] logically; any strides (block_stride,
 *                token_stride, head_stride), so the engine picks the physical layout
 *   block_tables [B, table_stride] int32: row b's token t is in block block_tables[b][t / block_size]
 *   context_lens [B] int32: row b attends tokens [0, context_lens[b]), or only the last `window` of them
 *                (a sliding-window layer: keys in (q - window, q], HF's mask; window 0 = all)
 *   out          [B, H, D] contiguous
 * softcap > 0: every score s (q k^T * scale) becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
 * GQA without expanding heads: query head h reads KV head h / G (G = H / KVH), and the G query heads
 * of one KV head share each K row and V row loaded.
 *
 * Work item = (row, partition): a long context is split into partitions of PART_TOKENS tokens (rounded
 * to whole blocks), combined at the end in partition order. Per block, every head's scores (one pass
 * over the block's K), an online-softmax update (rescale each head's running sum and accumulator
 * once), then one pass over its V. Measured (scripts/bench_paged_attention.py): reading a whole block
 * for all heads, with the pool head-major ([blocks, KVH, block_size, D] physically) so each block is
 * one contiguous region per KV head, streams best; one item per (row, KV head) was 1.3-1.5x slower.
 * The partitioning depends only on the context length and each item is one thread's work, so results
 * do not depend on the thread count.
 *
 * Built by paged_attention.py with -O3 -mavx2 -mfma -fopenmp; OpenMP resolves to the libgomp that
 * torch already loaded. Needs D % 8 == 0, D <= DMAX, block_size <= BSMAX (checked by the caller).
 * Returns 0, or -1 when the partition workspace cannot be allocated.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GMAX 8         /* query heads per pass over a KV head's blocks (accumulators in registers) */
#define DMAX 256       /* largest head dimension */
#define BSMAX 256      /* largest block size */
#define SSTRIDE (BSMAX + 8)
#define PART_TOKENS 512 /* tokens per partition of a long context (rounded to whole blocks) */

#include "simd.h"

/* s[g * SSTRIDE + j] = qs_g . k_j for GC query heads and TP tokens j0.. j0 + TP - 1 (each sum over d in
 * order, so a score does not depend on TP). qs: [GC, D] scaled queries; k_j at kb + j * ts. */
INLINE void scores_tile(const float *qs, int D, const float *kb, long ts, int j0, float *s, const int GC,
                        const int TP) {
    __m256 a[GMAX][4];
    for (int g = 0; g < GC; g++)
        for (int t = 0; t < TP; t++) a[g][t] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        for (int t = 0; t < TP; t++) {
            __m256 kv = _mm256_loadu_ps(kb + (long)(j0 + t) * ts + d);
            for (int g = 0; g < GC; g++) a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + d), kv, a[g][t]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int t = 0; t < TP; t++) s[g * SSTRIDE + j0 + t] = hsum256(a[g][t]);
}

/* acc[g, d0 .. d0 + 8 DC) = acc * corr[g] + sum_j p[g, j] v_j (j in order). */
INLINE void values_tile(float *acc, const float *corr, const float *p, int n, const float *vb, long ts, int D,
                        int d0, const int GC, const int DC) {
    __m256 o[GMAX][8];
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < DC; c++)
            o[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + d0 + 8 * c), _mm256_set1_ps(corr[g]));
    for (int j = 0; j < n; j++) {
        const float *vj = vb + (long)j * ts + d0;
        for (int c = 0; c < DC; c++) {
            __m256 vv = _mm256_loadu_ps(vj + 8 * c);
            for (int g = 0; g < GC; g++) o[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * SSTRIDE + j]), vv, o[g][c]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < DC; c++) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, o[g][c]);
}

/* Scores of one block (n tokens) for GC query heads sharing one KV head. */
INLINE void block_scores(const float *qs, int D, const float *kb, long ts, int n, float *s, const int GC) {
    const int TP = GC <= 3 ? 4 : GC == 4 ? 2 : 1; /* GC x TP accumulators fit the 16 AVX registers */
    int j = 0;
    for (; j + TP <= n; j += TP) scores_tile(qs, D, kb, ts, j, s, GC, TP);
    for (; j < n; j++) scores_tile(qs, D, kb, ts, j, s, GC, 1);
}

/* acc = acc * corr + p V over one block (n tokens) for GC query heads sharing one KV head. */
INLINE void block_values(float *acc, const float *corr, const float *p, int n, const float *vb, long ts, int D,
                         const int GC) {
    const int DC = GC == 1 ? 8 : GC <= 3 ? 4 : GC == 4 ? 2 : 1; /* GC x DC accumulators in registers */
    int d = 0;
    for (; d + 8 * DC <= D; d += 8 * DC) values_tile(acc, corr, p, n, vb, ts, D, d, GC, DC);
    for (; d < D; d += 8) values_tile(acc, corr, p, n, vb, ts, D, d, GC, 1);
}

#define DISPATCH_GC(call)                                                                                         \
    switch (gc) {                                                                                                \
    case 1: call(1); break;                                                                                      \
    case 2: call(2); break;                                                                                      \
    case 3: call(3); break;                                                                                      \
    case 4: call(4); break;                                                                                      \
    case 5: call(5); break;                                                                                      \
    case 6: call(6); break;                                                                                      \
    case 7: call(7); break;                                                                                      \
    default: call(8); break;                                                                                     \
    }

static void scores_gc(const float *qs, int D, const float *kb, long ts, int n, float *s, int gc) {
#define CALL(N) block_scores(qs, D, kb, ts, n, s, N)
    DISPATCH_GC(CALL)
#undef CALL
}

static void values_gc(float *acc, const float *corr, const float *p, int n, const float *vb, long ts, int D, int gc) {
#define CALL(N) block_values(acc, corr, p, n, vb, ts, D, N)
    DISPATCH_GC(CALL)
#undef CALL
}

/* The hardware prefetcher streams within a 4 KB page once a few lines miss in it; blocks are scattered,
 * so start each page of a block we are about to read (its first two lines) ourselves. */
INLINE void prefetch_pages(const float *start, long floats) {
    const char *p = (const char *)start;
    for (long off = 0; off < floats * 4; off += 4096) {
        _mm_prefetch(p + off, _MM_HINT_T0);
        _mm_prefetch(p + off + 64, _MM_HINT_T0);
    }
}

/* Per-thread scratch for one row: scaled queries and accumulators [H, D], scores [H, SSTRIDE], m, l, corr [H]. */
typedef struct {
    float *qs, *acc, *s, *m, *l, *corr;
} Scratch;

/* Tokens [max(t0, lo), t1) of one row (t0 on a block boundary; lo: the first token a sliding window keeps, tokens
 * before it are skipped, not masked), every head: acc [H, D] unnormalized, m [H] running max, l [H] running sum of
 * exp(s - m). Per block: the scores of all heads (one pass over the block's K, which is one contiguous region in the
 * pool), the soft-cap (softcap > 0), the online-softmax update, then one pass over its V. */
static void attend_row(const Scratch *w, const float *k_pool, const float *v_pool, long bstride, long ts, long hs,
                       const int *table, int block_size, int t0, int t1, int lo, float softcap, int H, int KVH,
                       int D) {
    const int G = H / KVH;
    for (int h = 0; h < H; h++) {
        w->m[h] = -INFINITY;
        w->l[h] = 0.0f;
    }
    for (long i = 0; i < (long)H * D; i++) w->acc[i] = 0.0f;
    for (int t = t0; t < t1; t += block_size) {
        const int j0 = lo > t ? lo - t : 0; /* the block's first token in the window */
        const int n = (t1 - t < block_size ? t1 - t : block_size) - j0;
        if (n <= 0) continue;
        const long block = table[t / block_size], at = block * bstride + j0 * ts;
        prefetch_pages(v_pool + at, (long)n * KVH * D);
        if (t + block_size < t1) prefetch_pages(k_pool + table[t / block_size + 1] * bstride, (long)block_size * KVH * D);
        for (int kvh = 0; kvh < KVH; kvh++)
            for (int g0 = 0; g0 < G; g0 += GMAX) {
                int h0 = kvh * G + g0, gc = G - g0 < GMAX ? G - g0 : GMAX;
                scores_gc(w->qs + (long)h0 * D, D, k_pool + at + kvh * hs, ts, n, w->s + (long)h0 * SSTRIDE, gc);
            }
        for (int h = 0; h < H; h++) {
            float *sh = w->s + (long)h * SSTRIDE, mx = w->m[h];
            int j;
            if (softcap > 0.0f)
                for (j = 0; j < n; j++) sh[j] = tanhf(sh[j] / softcap) * softcap;
            for (j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
            w->corr[h] = expf(w->m[h] - mx); /* 0 on the first block (m = -inf) */
            w->m[h] = mx;
            __m256 vmx = _mm256_set1_ps(mx);
            for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(sh + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + j), vmx)));
            for (; j < n; j++) sh[j] = expf(sh[j] - mx);
            float sum = 0.0f;
            for (j = 0; j < n; j++) sum += sh[j];
            w->l[h] = w->l[h] * w->corr[h] + sum;
        }
        for (int kvh = 0; kvh < KVH; kvh++)
            for (int g0 = 0; g0 < G; g0 += GMAX) {
                int h0 = kvh * G + g0, gc = G - g0 < GMAX ? G - g0 : GMAX;
                values_gc(w->acc + (long)h0 * D, w->corr + h0, w->s + (long)h0 * SSTRIDE, n, v_pool + at + kvh * hs,
                          ts, D, gc);
            }
    }
}

/* Per-row outputs of an item that covered its row's whole context: out[h] = acc[h] / l[h] for nh heads. */
static void finish_heads(const Scratch *w, int nh, int D, float *out) {
    for (int h = 0; h < nh; h++) {
        float inv = w->l[h] > 0.0f ? 1.0f / w->l[h] : 0.0f; /* an empty context gives zeros */
        for (int d = 0; d < D; d++) out[(long)h * D + d] = w->acc[(long)h * D + d] * inv;
    }
}

/* One partition's unnormalized result for nh heads: acc [nh, D], m, l [nh] (combined by combine_head). */
static void save_partial(const Scratch *w, int nh, int D, float *acc, float *m, float *l) {
    for (long i = 0; i < (long)nh * D; i++) acc[i] = w->acc[i];
    for (int h = 0; h < nh; h++) {
        m[h] = w->m[h];
        l[h] = w->l[h];
    }
}

/* Combine head h of row b over its partitions in order: o = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
 * ws_acc [B, max_parts, H, D], ws_m, ws_l [B, max_parts, H]. */
static void combine_head(const float *ws_acc, const float *ws_m, const float *ws_l, long b, long h, int H, int D,
                         int parts, int max_parts, float *o) {
    float mx = -INFINITY, sum = 0.0f;
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    for (int p = 0; p < parts; p++) {
        const float mp = ws_m[(b * max_parts + p) * H + h];
        mx = mp > mx ? mp : mx;
    }
    for (int p = 0; p < parts; p++) {
        long i = (b * max_parts + p) * H + h;
        float wgt = expf(ws_m[i] - mx);
        sum += wgt * ws_l[i];
        for (int d = 0; d < D; d++) o[d] += wgt * ws_acc[i * D + d];
    }
    if (parts > 0)
        for (int d = 0; d < D; d++) o[d] /= sum;
}

/* Partitions of PART_TOKENS tokens (whole blocks) per context, and the most any row of this batch needs. */
static int part_tokens_for(int block_size) {
    const int part_blocks = PART_TOKENS / block_size > 0 ? PART_TOKENS / block_size : 1;
    return part_blocks * block_size;
}

/* The first token a row of context ctx attends: ctx - window in a sliding-window layer (window > 0), else 0. */
static int window_first(int ctx, int window) { return window > 0 && ctx > window ? ctx - window : 0; }

/* Where a row's partitions start: the block holding its first attended token. */
static int parts_base(int ctx, int window, int block_size) { return window_first(ctx, window) / block_size * block_size; }

/* Partitions of a row: its attended tokens from parts_base on, part_tokens at a time (0 for an empty context). */
static int parts_of(int ctx, int window, int block_size, int part_tokens) {
    return (ctx - parts_base(ctx, window, block_size) + part_tokens - 1) / part_tokens;
}

static int max_parts_of(const int *context_lens, int B, int window, int block_size, int part_tokens) {
    int max_parts = 1;
    for (int b = 0; b < B; b++) {
        int parts = parts_of(context_lens[b], window, block_size, part_tokens);
        max_parts = parts > max_parts ? parts : max_parts;
    }
    return max_parts;
}

/* Floats of one thread's Scratch for H heads of size D. */
static long scratch_floats(int H, int D) { return 2L * H * D + (long)H * SSTRIDE + 3L * H; }

static Scratch scratch_at(float *base, int H, int D) {
    Scratch w = {base, base + (long)H * D, base + 2L * H * D, base + 2L * H * D + (long)H * SSTRIDE, 0, 0};
    w.l = w.m + H;
    w.corr = w.l + H;
    return w;
}

int paged_attention(const float *q, long q_row_stride, const float *k_pool, const float *v_pool, long block_stride,
                    long token_stride, long head_stride, const int *block_tables, int table_stride,
                    const int *context_lens, float *out, int B, int H, int KVH, int D, int block_size, float scale,
                    int window, float softcap, int nthreads) {
    const int part_tokens = part_tokens_for(block_size);
    const int max_parts = max_parts_of(context_lens, B, window, block_size, part_tokens);
    if (nthreads < 1) nthreads = 1;
    /* Partial results of every partition when a context spans several: acc [B, P, H, D], m, l [B, P, H];
     * and one Scratch per thread. */
    const long per_thread = scratch_floats(H, D);
    const long items = (long)B * max_parts, ws_size = max_parts > 1 ? items * H * (D + 2) : 0;
    float *ws = malloc(sizeof(float) * (size_t)(ws_size + nthreads * per_thread));
    if (!ws) return -1;
    float *ws_acc = ws, *ws_m = ws + items * H * D, *ws_l = ws_m + items * H, *scratch = ws + ws_size;
#pragma omp parallel num_threads(nthreads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        Scratch w = scratch_at(scratch + tid * per_thread, H, D);
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            int b = (int)(it / max_parts), part = (int)(it % max_parts);
            int ctx = context_lens[b], t0 = parts_base(ctx, window, block_size) + part * part_tokens;
            if (t0 >= ctx && part > 0) continue;
            int t1 = t0 + part_tokens < ctx ? t0 + part_tokens : ctx;
            const float *qrow = q + b * q_row_stride;
            for (long i = 0; i < (long)H * D; i++) w.qs[i] = qrow[i] * scale;
            attend_row(&w, k_pool, v_pool, block_stride, token_stride, head_stride,
                       block_tables + (long)b * table_stride, block_size, t0, t1, window_first(ctx, window), softcap,
                       H, KVH, D);
            if (max_parts == 1) finish_heads(&w, H, D, out + (long)b * H * D);
            else save_partial(&w, H, D, ws_acc + it * H * D, ws_m + it * H, ws_l + it * H);
        }
    }
    if (max_parts > 1) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (long bh = 0; bh < (long)B * H; bh++) {
            long b = bh / H, h = bh % H;
            int parts = parts_of(context_lens[b], window, block_size, part_tokens);
            combine_head(ws_acc, ws_m, ws_l, b, h, H, D, parts, max_parts, out + bh * D);
        }
    }
    free(ws);
    return 0;
}

/* One decode step's attention for one layer in one call: RoPE on the new q and k, k and v written into
 * their KV slots, then paged_attention over every row's blocks (the new token included). Replaces the
 * per-layer torch ops of the lean decode path (rotate, two index_put writes, slicing, the attention call).
 *
 *   qkv          [B, ldqkv] rows of the fused QKV linear: q [H, D] at 0, k [KVH, D] at H D, v at (H + KVH) D
 *   cos, sin     [max_len, R] RoPE tables (row p for position p) over each head's first R dims (R = D, or fewer:
 *                partial rotary, the rest passed through), or NULL for no rotation (GPT-2)
 *   pos          [B] int64 positions; slot_blocks, slot_offsets [B] int64 KV slot of each row's token
 *   q_buf        [B, H, D] scratch for the rotated queries; out [B, H, D]
 * RoPE is HF's: x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), two products then one add
 * (the file is built with -ffp-contract=off, so these are torch's bits exactly). */
static void rope_row(const float *x, float *y, const float *c, const float *s, int R, int D) {
    const int half = R / 2;
    for (int d = 0; d < half; d++) {
        float a = x[d] * c[d], b = -x[d + half] * s[d];
        y[d] = a + b;
    }
    for (int d = half; d < R; d++) {
        float a = x[d] * c[d], b = x[d - half] * s[d];
        y[d] = a + b;
    }
    for (int d = R; d < D; d++) y[d] = x[d];
}

/* Query heads [h0, h1) of one qkv row, rotated over their first R dims (c, s: the row's cos, sin) or copied when c
 * is NULL -> q [h1 - h0, D]. */
static void rope_queries(const float *row, const float *c, const float *s, float *q, int R, int D, int h0, int h1) {
    for (int h = h0; h < h1; h++) {
        float *qh = q + (long)(h - h0) * D;
        if (c) rope_row(row + (long)h * D, qh, c, s, R, D);
        else for (int d = 0; d < D; d++) qh[d] = row[(long)h * D + d];
    }
}

/* One qkv row's new k (rotated over its first R dims when c is not NULL) and v of KV heads [h0, h1) into their slot
 * of the pools. */
static void write_kv(const float *row, const float *c, const float *s, float *kslot, float *vslot, long head_stride,
                     int H, int KVH, int R, int D, int h0, int h1) {
    for (int h = h0; h < h1; h++) {
        const float *k = row + (long)(H + h) * D, *v = row + (long)(H + KVH + h) * D;
        if (c) rope_row(k, kslot + h * head_stride, c, s, R, D);
        else for (int d = 0; d < D; d++) kslot[h * head_stride + d] = k[d];
        for (int d = 0; d < D; d++) vslot[h * head_stride + d] = v[d];
    }
}

int rope_write_attend(const float *qkv, long ldqkv, const float *cos, const float *sin, int R, const long *pos,
                      float *k_pool, float *v_pool, long block_stride, long token_stride, long head_stride,
                      const long *slot_blocks, const long *slot_offsets, const int *block_tables, int table_stride,
                      const int *context_lens, float *q_buf, float *out, int B, int H, int KVH, int D,
                      int block_size, float scale, int window, float softcap, int nthreads) {
    for (int b = 0; b < B; b++) {
        const float *row = qkv + b * ldqkv, *c = cos ? cos + pos[b] * R : 0, *s = sin ? sin + pos[b] * R : 0;
        long slot = slot_blocks[b] * block_stride + slot_offsets[b] * token_stride;
        rope_queries(row, c, s, q_buf + (long)b * H * D, R, D, 0, H);
        write_kv(row, c, s, k_pool + slot, v_pool + slot, head_stride, H, KVH, R, D, 0, KVH);
    }
    return paged_attention(q_buf, (long)H * D, k_pool, v_pool, block_stride, token_stride, head_stride, block_tables,
                           table_stride, context_lens, out, B, H, KVH, D, block_size, scale, window, softcap,
                           nthreads);
}
