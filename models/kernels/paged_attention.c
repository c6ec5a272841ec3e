/* Paged decode attention: one query token per row against K/V read in place from a block pool, the pool's
 * elements fp32, fp16, bf16 or int8 (KV_CACHE_DTYPE), converted to fp32 in registers as they are loaded.
 *
 * Why: with the KV cache managed as a pool of fixed-size blocks, a sequence's keys and values sit in
 * blocks scattered over the pool. Gathering them into a contiguous buffer each step costs a copy of the
 * whole context per layer (measured up to 4.6x slower attention); this kernel follows each row's block
 * table instead and streams every block once. A step at long contexts reads more KV bytes than weight
 * bytes, so a narrower element is also the speed: each dtype is read as it is stored, never dequantized
 * into a copy.
 *
 * Shapes (strides in elements of the pool's dtype, the head dimension D always unit stride):
 *   q            [B, H, D] fp32  row b at q + b * q_row_stride, head h at + h * D
 *   k/v pool     [num_blocks, block_size, KVH, D] logically; any strides (block_stride, token_stride,
 *                head_stride), so the engine picks the physical layout (KVPool)
 *   block_tables [B, table_stride] int32: row b's token t is in block block_tables[b][t / block_size]
 *   context_lens [B] int32: row b attends tokens [0, context_lens[b]), or only the last `window` of them
 *                (a sliding-window layer: keys in (q - window, q], HF's mask; window 0 = all)
 *   out          [B, H, D] fp32 contiguous
 * softcap > 0: every score s (q k^T * scale) becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
 * GQA without expanding heads: query head h reads KV head h / G (G = H / KVH), and the G query heads
 * of one KV head share each K row and V row loaded.
 *
 * Element types (KVPool.dtype): KV_FP32; KV_FP16 (IEEE half, F16C's vcvtph2ps); KV_BF16 (the top 16 bits of
 * an fp32: a shift); KV_INT8 (q8_0-like: each token's D values of one head are q * d, q in [-127, 127] and
 * one fp32 scale d = max |x| / 127 per (block, token, head), stored in k_scale / v_scale at the element
 * offset of the head's row divided by D). A new token is converted once, when written (store_row: round to
 * nearest even; kv_cache.py does the same in torch, bit for bit). int8 applies its scales outside the dot
 * products: score_j = d_j (q . k_j), and the weights p_j d_j multiply the quantized V rows.
 *
 * Work item = (row, partition): a long context is split into partitions of PART_TOKENS tokens (rounded
 * to whole blocks), combined at the end in partition order (split-K / flash-decoding: one row's long context
 * is several threads' work). Per block, every head's scores (one pass over the block's K), an online-softmax
 * update (rescale each head's running sum and accumulator once), then one pass over its V. Measured
 * (scripts/bench_paged_attention.py): reading a whole block for all heads, with the pool head-major
 * ([blocks, KVH, block_size, D] physically) so each block is one contiguous region per KV head, streams best;
 * one item per (row, KV head) was 1.3-1.5x slower. The partitioning depends only on the context length and
 * each item is one thread's work, so results do not depend on the thread count.
 *
 * Built by paged_attention.py with -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp; OpenMP resolves to the
 * libgomp that torch already loaded. Needs D % 8 == 0, D <= DMAX, block_size <= BSMAX (checked by the caller).
 * Returns 0, or -1 when the partition workspace cannot be allocated.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GMAX 4         /* query heads per pass over a KV head's blocks (accumulators in registers; more: passes of
                        * GMAX, each head's arithmetic the same whatever the pass holds) */
#define DMAX 256       /* largest head dimension */
#define BSMAX 256      /* largest block size */
#define SSTRIDE (BSMAX + 8)
#define PART_TOKENS 512 /* tokens per partition of a long context (rounded to whole blocks) */

#include "simd.h"

enum { KV_FP32 = 0, KV_FP16 = 1, KV_BF16 = 2, KV_INT8 = 3 };

/* One layer's K and V pools as the kernel reads them (paged_attention.py and decode_step.c build it). */
typedef struct {
    void *k, *v;                                  /* elements of dtype, [num_blocks, block_size, KVH, D] logically */
    float *k_scale, *v_scale;                     /* KV_INT8: a scale per (block, token, head); else NULL */
    long block_stride, token_stride, head_stride; /* elements; multiples of D (a row's scale is at its offset / D) */
    int dtype, block_size, kv_heads, head_dim;
} KVPool;

INLINE long kv_elem_bytes(int dt) { return dt == KV_FP32 ? 4 : dt == KV_INT8 ? 1 : 2; }

/* The AVX-512 path (where the CPU has AVX-512F and ``attention_isa`` allows it): the same arithmetic, lane for lane,
 * in 16-lane registers (below), so both paths give the same bits; the choice changes speed only. */
#define PA_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))
#define INLINE512 static inline __attribute__((always_inline)) PA_AVX512

static int pa_avx512; /* 1: the AVX-512 path runs; set when the library loads, read atomically */

__attribute__((constructor)) static void pa_pick_isa(void) {
    __builtin_cpu_init();
    __atomic_store_n(&pa_avx512, __builtin_cpu_supports("avx512f") != 0, __ATOMIC_RELAXED);
}

static inline int pa_use_avx512(void) { return __atomic_load_n(&pa_avx512, __ATOMIC_RELAXED); }

/* want < 0: report; 0: the AVX2 path; 1: the AVX-512 one where the CPU has it. Returns 1 when attention now runs
 * AVX-512 (build.with_isa registers it next to quant_gemm.c's kernel_isa). */
int attention_isa(int want) {
    if (want >= 0) __atomic_store_n(&pa_avx512, want && __builtin_cpu_supports("avx512f") != 0, __ATOMIC_RELAXED);
    return pa_use_avx512();
}

/* Elements [i, i + 8) of an array of dtype DT as fp32 (int8: the quantized values, unscaled). */
INLINE __m256 load8(const void *p, long i, const int DT) {
    if (DT == KV_FP32) return _mm256_loadu_ps((const float *)p + i);
    if (DT == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (DT == KV_FP16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bf16: the high half */
}

/* fp32 -> bf16, round to nearest even (torch's conversion; a NaN stays a quiet NaN). */
INLINE uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One head's row x [D] into the pool at element offset off (its scale, int8, at off / D). */
static void store_row(const float *x, void *base, float *scales, long off, int D, int dt) {
    if (dt == KV_FP32) {
        memcpy((float *)base + off, x, sizeof(float) * (size_t)D);
    } else if (dt == KV_FP16) {
        uint16_t *y = (uint16_t *)base + off;
        for (int d = 0; d < D; d += 8)
            _mm_storeu_si128((__m128i *)(y + d),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (dt == KV_BF16) {
        uint16_t *y = (uint16_t *)base + off;
        for (int d = 0; d < D; d++) y[d] = bf16_of(x[d]);
    } else { /* q8_0's rule: d = max |x| / 127, q = round(x / d) as x * (1 / d), half to even */
        int8_t *y = (int8_t *)base + off;
        float amax = 0.0f;
        for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        for (int d = 0; d < D; d++) {
            float r = nearbyintf(x[d] * inv);
            y[d] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        scales[off / D] = scale;
    }
}

/* The lane sums of four accumulators at once, each reduced by the same tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
 * (l6 + l7)) (hsum1 below gives one accumulator's by the same tree: a score does not depend on how many tokens
 * were reduced together). */
INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d)); /* [a0123 b0123 c0123 d0123 | a4567 ..] */
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

INLINE float hsum1(__m256 a) {
    __m256 x = _mm256_hadd_ps(a, a);
    x = _mm256_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
}

/* s[g * SSTRIDE + j] = qs_g . k_j (times k_j's scale, int8) for GC query heads and TP tokens j0.. j0 + TP - 1
 * (each sum over d in order, lanes reduced by one tree: a score does not depend on TP). qs: [GC, D] scaled queries;
 * k_j at kb + j * ts (elements), its scale at ks[j * sts]. */
INLINE void scores_tile(const float *qs, int D, const void *kb, long ts, const float *ks, long sts, int j0, float *s,
                        const int GC, const int TP, const int DT) {
    __m256 a[GMAX][4];
    for (int g = 0; g < GC; g++)
        for (int t = 0; t < TP; t++) a[g][t] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        for (int t = 0; t < TP; t++) {
            __m256 kv = load8(kb, (long)(j0 + t) * ts + d, DT);
            for (int g = 0; g < GC; g++) a[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + d), kv, a[g][t]);
        }
    }
    for (int g = 0; g < GC; g++) {
        float *sg = s + g * SSTRIDE + j0;
        if (TP == 4) {
            __m128 dots = hsum4(a[g][0], a[g][1], a[g][2], a[g][3]);
            if (DT == KV_INT8)
                dots = _mm_mul_ps(dots, _mm_setr_ps(ks[(long)j0 * sts], ks[(long)(j0 + 1) * sts],
                                                    ks[(long)(j0 + 2) * sts], ks[(long)(j0 + 3) * sts]));
            _mm_storeu_ps(sg, dots);
        } else {
            for (int t = 0; t < TP; t++) {
                float dot = hsum1(a[g][t]);
                sg[t] = DT == KV_INT8 ? dot * ks[(long)(j0 + t) * sts] : dot;
            }
        }
    }
}

/* acc[g, d0 .. d0 + 8 DC) = acc * corr[g] + sum_j p[g, j] v_j (j in order; int8: p already times v_j's scale). */
INLINE void values_tile(float *acc, const float *corr, const float *p, int n, const void *vb, long ts, int D, int d0,
                        const int GC, const int DC, const int DT) {
    __m256 o[GMAX][8];
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < DC; c++)
            o[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + d0 + 8 * c), _mm256_set1_ps(corr[g]));
    for (int j = 0; j < n; j++) {
        for (int c = 0; c < DC; c++) {
            __m256 vv = load8(vb, (long)j * ts + d0 + 8 * c, DT);
            for (int g = 0; g < GC; g++) o[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * SSTRIDE + j]), vv, o[g][c]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < DC; c++) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, o[g][c]);
}

/* Scores of one block (n tokens) for GC query heads sharing one KV head. */
INLINE void block_scores(const float *qs, int D, const void *kb, long ts, const float *ks, long sts, int n, float *s,
                         const int GC, const int DT) {
    const int TP = GC <= 3 ? 4 : 2; /* GC x TP accumulators fit the 16 AVX registers */
    int j = 0;
    for (; j + TP <= n; j += TP) scores_tile(qs, D, kb, ts, ks, sts, j, s, GC, TP, DT);
    for (; j < n; j++) scores_tile(qs, D, kb, ts, ks, sts, j, s, GC, 1, DT);
}

/* acc = acc * corr + p V over one block (n tokens) for GC query heads sharing one KV head. */
INLINE void block_values(float *acc, const float *corr, const float *p, int n, const void *vb, long ts, int D,
                         const int GC, const int DT) {
    const int DC = GC == 1 ? 8 : GC <= 3 ? 4 : 2; /* GC x DC accumulators in registers */
    int d = 0;
    for (; d + 8 * DC <= D; d += 8 * DC) values_tile(acc, corr, p, n, vb, ts, D, d, GC, DC, DT);
    for (; d < D; d += 8) values_tile(acc, corr, p, n, vb, ts, D, d, GC, 1, DT);
}

/* Instantiate call(GC) for the runtime gc (1..GMAX) and, around it, DT_ for the runtime dt: every (GC, dtype)
 * pair gets its own unrolled register tiles. */
#define DISPATCH_GC(call)                                                                                         \
    switch (gc) {                                                                                                \
    case 1: call(1); break;                                                                                      \
    case 2: call(2); break;                                                                                      \
    case 3: call(3); break;                                                                                      \
    default: call(4); break;                                                                                     \
    }

#define DISPATCH_DT(body)                                                                                         \
    switch (dt) {                                                                                                \
    case KV_FP16: { enum { DT_ = KV_FP16 }; body; } break;                                                       \
    case KV_BF16: { enum { DT_ = KV_BF16 }; body; } break;                                                       \
    case KV_INT8: { enum { DT_ = KV_INT8 }; body; } break;                                                       \
    default: { enum { DT_ = KV_FP32 }; body; } break;                                                            \
    }

static void scores_gc(const float *qs, int D, const void *kb, long ts, const float *ks, long sts, int n, float *s,
                      int gc, int dt) {
#define CALL(N) block_scores(qs, D, kb, ts, ks, sts, n, s, N, DT_)
    DISPATCH_DT(DISPATCH_GC(CALL))
#undef CALL
}

static void values_gc(float *acc, const float *corr, const float *p, int n, const void *vb, long ts, int D, int gc,
                      int dt) {
#define CALL(N) block_values(acc, corr, p, n, vb, ts, D, N, DT_)
    DISPATCH_DT(DISPATCH_GC(CALL))
#undef CALL
}

/* --- the AVX-512 path: each 16-lane register does what two 8-lane AVX2 registers do ---------------------------
 * values: 16 consecutive d of one V row per register (lane l does what lane l % 8 of the AVX2 chunk does: the same
 * products, in the same token order); scores: a register holds two tokens' 8-lane accumulators side by side
 * ([token j lanes | token j + 1 lanes], over d in order), reduced by hsum4's tree; softmax: exponentials in 16
 * lanes (exp512 is exp256's arithmetic), summed in 8-lane chunks in AVX2's order. */

/* Elements [i, i + 16) of an array of dtype DT as fp32 (the same values load8 gives). */
INLINE512 __m512 load16(const void *p, long i, const int DT) {
    if (DT == KV_FP32) return _mm512_loadu_ps((const float *)p + i);
    if (DT == KV_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (DT == KV_FP16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp256 (simd.h) in 16 lanes: the same operations on each lane. */
INLINE512 __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* scores_tile for GC heads and 2 NP tokens j0.. (NP 2 or 4): token pair p's accumulators share register a[g][p]. */
INLINE512 void scores_tile512(const float *qs, int D, const void *kb, long ts, const float *ks, long sts, int j0,
                              float *s, const int GC, const int NP, const int DT) {
    __m512 a[GMAX][4];
    for (int g = 0; g < GC; g++)
        for (int p = 0; p < NP; p++) a[g][p] = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) { /* two d-steps of 8: [k_j(d..d+7) | k_j+1(d..d+7)], then d + 8 */
        __m512 lo[4], hi[4];
        for (int p = 0; p < NP; p++) {
            __m512 x0 = load16(kb, (long)(j0 + 2 * p) * ts + d, DT), x1 = load16(kb, (long)(j0 + 2 * p + 1) * ts + d, DT);
            lo[p] = _mm512_shuffle_f32x4(x0, x1, 0x44);
            hi[p] = _mm512_shuffle_f32x4(x0, x1, 0xEE);
        }
        for (int g = 0; g < GC; g++) {
            const __m512 qlo = _mm512_broadcast_f32x8(_mm256_loadu_ps(qs + g * D + d));
            const __m512 qhi = _mm512_broadcast_f32x8(_mm256_loadu_ps(qs + g * D + d + 8));
            for (int p = 0; p < NP; p++) a[g][p] = _mm512_fmadd_ps(qhi, hi[p], _mm512_fmadd_ps(qlo, lo[p], a[g][p]));
        }
    }
    if (d < D) /* D % 16 == 8: the last d-step, two 8-lane loads per pair */
        for (int p = 0; p < NP; p++) {
            __m512 kz = _mm512_insertf32x8(_mm512_castps256_ps512(load8(kb, (long)(j0 + 2 * p) * ts + d, DT)),
                                           load8(kb, (long)(j0 + 2 * p + 1) * ts + d, DT), 1);
            for (int g = 0; g < GC; g++)
                a[g][p] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(qs + g * D + d)), kz, a[g][p]);
        }
    for (int g = 0; g < GC; g++)
        for (int p = 0; p < NP; p += 2) {
            __m128 dots = hsum4(_mm512_castps512_ps256(a[g][p]), _mm512_extractf32x8_ps(a[g][p], 1),
                                _mm512_castps512_ps256(a[g][p + 1]), _mm512_extractf32x8_ps(a[g][p + 1], 1));
            const int j = j0 + 2 * p;
            if (DT == KV_INT8)
                dots = _mm_mul_ps(dots, _mm_setr_ps(ks[(long)j * sts], ks[(long)(j + 1) * sts], ks[(long)(j + 2) * sts],
                                                    ks[(long)(j + 3) * sts]));
            _mm_storeu_ps(s + g * SSTRIDE + j, dots);
        }
}

INLINE512 void block_scores512(const float *qs, int D, const void *kb, long ts, const float *ks, long sts, int n,
                               float *s, const int GC, const int DT) {
    const int NP = 4; /* GC x NP accumulators, and the queries, in the 32 registers */
    int j = 0;
    for (; j + 2 * NP <= n; j += 2 * NP) scores_tile512(qs, D, kb, ts, ks, sts, j, s, GC, NP, DT);
    for (; j + 4 <= n; j += 4) scores_tile512(qs, D, kb, ts, ks, sts, j, s, GC, 2, DT);
    for (; j < n; j++) scores_tile(qs, D, kb, ts, ks, sts, j, s, GC, 1, DT);
}

/* values_tile over 16 DC consecutive d: acc[g, d0 ..) = acc * corr[g] + sum_j p[g, j] v_j. */
INLINE512 void values_tile512(float *acc, const float *corr, const float *p, int n, const void *vb, long ts, int D,
                              int d0, const int GC, const int DC, const int DT) {
    __m512 o[GMAX][8];
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < DC; c++)
            o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d0 + 16 * c), _mm512_set1_ps(corr[g]));
    for (int j = 0; j < n; j++) {
        for (int c = 0; c < DC; c++) {
            __m512 vv = load16(vb, (long)j * ts + d0 + 16 * c, DT);
            for (int g = 0; g < GC; g++) o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * SSTRIDE + j]), vv, o[g][c]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int c = 0; c < DC; c++) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, o[g][c]);
}

INLINE512 void block_values512(float *acc, const float *corr, const float *p, int n, const void *vb, long ts, int D,
                               const int GC, const int DT) {
    const int DC = GC <= 2 ? 8 : 4; /* GC x DC accumulators in the 32 registers */
    int d = 0;
    for (; d + 16 * DC <= D; d += 16 * DC) values_tile512(acc, corr, p, n, vb, ts, D, d, GC, DC, DT);
    for (; d + 16 <= D; d += 16) values_tile512(acc, corr, p, n, vb, ts, D, d, GC, 1, DT);
    if (d < D) values_tile(acc, corr, p, n, vb, ts, D, d, GC, 1, DT); /* D % 16 == 8 */
}

static PA_AVX512 void scores_gc512(const float *qs, int D, const void *kb, long ts, const float *ks, long sts, int n,
                                   float *s, int gc, int dt) {
#define CALL(N) block_scores512(qs, D, kb, ts, ks, sts, n, s, N, DT_)
    DISPATCH_DT(DISPATCH_GC(CALL))
#undef CALL
}

static PA_AVX512 void values_gc512(float *acc, const float *corr, const float *p, int n, const void *vb, long ts,
                                   int D, int gc, int dt) {
#define CALL(N) block_values512(acc, corr, p, n, vb, ts, D, N, DT_)
    DISPATCH_DT(DISPATCH_GC(CALL))
#undef CALL
}

/* The hardware prefetcher streams within a 4 KB page once a few lines miss in it; blocks are scattered,
 * so start each page of a block we are about to read (its first two lines) ourselves. */
INLINE void prefetch_pages(const void *start, long bytes) {
    const char *p = (const char *)start;
    for (long off = 0; off < bytes; off += 4096) {
        _mm_prefetch(p + off, _MM_HINT_T0);
        _mm_prefetch(p + off + 64, _MM_HINT_T0);
    }
}

/* Per-thread scratch for one row: scaled queries and accumulators [H, D], scores [H, SSTRIDE], m, l, corr [H]. */
typedef struct {
    float *qs, *acc, *s, *m, *l, *corr;
} Scratch;

/* Where one KV head's rows of one block start from the block's token j0 (elements of the pool's dtype), and their
 * scales (int8). */
typedef struct {
    const void *k, *v;
    const float *ks, *vs;
} BlockHead;

static BlockHead block_head(const KVPool *p, long block, int j0, int kvh) {
    const long off = block * p->block_stride + j0 * p->token_stride + kvh * p->head_stride;
    const long eb = kv_elem_bytes(p->dtype);
    BlockHead r = {(const char *)p->k + off * eb, (const char *)p->v + off * eb, 0, 0};
    if (p->dtype == KV_INT8) {
        r.ks = p->k_scale + off / p->head_dim;
        r.vs = p->v_scale + off / p->head_dim;
    }
    return r;
}

/* Head h's scores of one block (n tokens) -> their weights exp(s - m) in place, with the running max m, the
 * rescale corr of what came before and the running sum l updated (lanes of 8 for the max, the exponentials and
 * their sum; the max is exact in any order, the sum is the 8 lane sums reduced by hsum1's tree, then the tail). */
static void online_softmax(const Scratch *w, int h, int n) {
    float *sh = w->s + (long)h * SSTRIDE;
    __m256 vm = _mm256_set1_ps(w->m[h]);
    int j = 0;
    for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sh + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    for (; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
    w->corr[h] = expf(w->m[h] - mx); /* 0 on the first block (m = -inf) */
    w->m[h] = mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + j), vmx));
        _mm256_storeu_ps(sh + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum1(vsum);
    for (; j < n; j++) {
        sh[j] = expf(sh[j] - mx);
        sum += sh[j];
    }
    w->l[h] = w->l[h] * w->corr[h] + sum;
}

/* online_softmax in 16 lanes where it can: the same max, the same exponentials, summed in AVX2's 8-lane chunks. */
static PA_AVX512 void online_softmax512(const Scratch *w, int h, int n) {
    float *sh = w->s + (long)h * SSTRIDE;
    __m512 vm = _mm512_set1_ps(w->m[h]);
    int j = 0;
    for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sh + j));
    float mx = _mm512_reduce_max_ps(vm);
    for (; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
    w->corr[h] = expf(w->m[h] - mx);
    w->m[h] = mx;
    const __m512 vmx = _mm512_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sh + j), vmx));
        _mm512_storeu_ps(sh + j, e);
        vsum = _mm256_add_ps(_mm256_add_ps(vsum, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
    }
    if (j + 8 <= n) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + j), _mm512_castps512_ps256(vmx)));
        _mm256_storeu_ps(sh + j, e);
        vsum = _mm256_add_ps(vsum, e);
        j += 8;
    }
    float sum = hsum1(vsum);
    for (; j < n; j++) {
        sh[j] = expf(sh[j] - mx);
        sum += sh[j];
    }
    w->l[h] = w->l[h] * w->corr[h] + sum;
}

/* Tokens [max(t0, lo), t1) of one row (t0 on a block boundary; lo: the first token a sliding window keeps, tokens
 * before it are skipped, not masked), the G query heads of each KV head in [kvh0, kvh1) (the Scratch's heads
 * 0 .. (kvh1 - kvh0) G): acc unnormalized, m running max, l running sum of exp(s - m). Per block: the scores of all
 * heads (one pass over the block's K, one contiguous region per KV head when head-major), the soft-cap
 * (softcap > 0), the online-softmax update, then one pass over its V. */
static void attend_row(const Scratch *w, const KVPool *p, const int *table, int t0, int t1, int lo, float softcap,
                       int kvh0, int kvh1, int G) {
    const int D = p->head_dim, bs = p->block_size, nh = (kvh1 - kvh0) * G, dt = p->dtype, avx512 = pa_use_avx512();
    const long ts = p->token_stride, sts = ts / D, eb = kv_elem_bytes(dt);
    for (int h = 0; h < nh; h++) {
        w->m[h] = -INFINITY;
        w->l[h] = 0.0f;
    }
    for (long i = 0; i < (long)nh * D; i++) w->acc[i] = 0.0f;
    for (int t = t0; t < t1; t += bs) {
        const int j0 = lo > t ? lo - t : 0; /* the block's first token in the window */
        const int n = (t1 - t < bs ? t1 - t : bs) - j0;
        if (n <= 0) continue;
        const long block = table[t / bs];
        for (int kvh = kvh0; kvh < kvh1; kvh++) {
            prefetch_pages(block_head(p, block, j0, kvh).v, (long)n * D * eb);
            if (t + bs < t1) prefetch_pages(block_head(p, table[t / bs + 1], 0, kvh).k, (long)bs * D * eb);
        }
        for (int kvh = kvh0; kvh < kvh1; kvh++) {
            const BlockHead bh = block_head(p, block, j0, kvh);
            for (int g0 = 0; g0 < G; g0 += GMAX) {
                const int h0 = (kvh - kvh0) * G + g0, gc = G - g0 < GMAX ? G - g0 : GMAX;
                float *sh = w->s + (long)h0 * SSTRIDE;
                if (avx512) scores_gc512(w->qs + (long)h0 * D, D, bh.k, ts, bh.ks, sts, n, sh, gc, dt);
                else scores_gc(w->qs + (long)h0 * D, D, bh.k, ts, bh.ks, sts, n, sh, gc, dt);
            }
        }
        for (int h = 0; h < nh; h++) {
            if (softcap > 0.0f) {
                float *sh = w->s + (long)h * SSTRIDE;
                for (int j = 0; j < n; j++) sh[j] = tanhf(sh[j] / softcap) * softcap;
            }
            if (avx512) online_softmax512(w, h, n);
            else online_softmax(w, h, n);
        }
        if (dt == KV_INT8) /* V's scales fold into the weights (l keeps the unscaled sum) */
            for (int h = 0; h < nh; h++) {
                float *sh = w->s + (long)h * SSTRIDE;
                const float *vs = block_head(p, block, j0, kvh0 + h / G).vs;
                if (sts == 1) /* head-major: a block's scales of one head are contiguous */
                    for (int j = 0; j < n; j++) sh[j] *= vs[j];
                else
                    for (int j = 0; j < n; j++) sh[j] *= vs[(long)j * sts];
            }
        for (int kvh = kvh0; kvh < kvh1; kvh++) {
            const BlockHead bh = block_head(p, block, j0, kvh);
            for (int g0 = 0; g0 < G; g0 += GMAX) {
                const int h0 = (kvh - kvh0) * G + g0, gc = G - g0 < GMAX ? G - g0 : GMAX;
                float *acc = w->acc + (long)h0 * D, *corr = w->corr + h0, *ph = w->s + (long)h0 * SSTRIDE;
                if (avx512) values_gc512(acc, corr, ph, n, bh.v, ts, D, gc, dt);
                else values_gc(acc, corr, ph, n, bh.v, ts, D, gc, dt);
            }
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

/* Tokens per partition: ``want`` (<= 0: PART_TOKENS) rounded up to whole blocks. */
static int part_tokens_for(int block_size, int want) {
    if (want <= 0) want = PART_TOKENS;
    const int part_blocks = (want + block_size - 1) / block_size;
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

/* part_tokens: tokens per partition (0: PART_TOKENS; rounded up to whole blocks), so a test can compare a split
 * context with the same context in one partition. */
int paged_attention(const float *q, long q_row_stride, const KVPool *pool, const int *block_tables, int table_stride,
                    const int *context_lens, float *out, int B, int H, float scale, int window, float softcap,
                    int part_tokens, int nthreads) {
    const int D = pool->head_dim, KVH = pool->kv_heads, bs = pool->block_size;
    part_tokens = part_tokens_for(bs, part_tokens);
    const int max_parts = max_parts_of(context_lens, B, window, bs, part_tokens);
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
            int ctx = context_lens[b], t0 = parts_base(ctx, window, bs) + part * part_tokens;
            if (t0 >= ctx && part > 0) continue;
            int t1 = t0 + part_tokens < ctx ? t0 + part_tokens : ctx;
            const float *qrow = q + b * q_row_stride;
            for (long i = 0; i < (long)H * D; i++) w.qs[i] = qrow[i] * scale;
            attend_row(&w, pool, block_tables + (long)b * table_stride, t0, t1, window_first(ctx, window), softcap, 0, KVH,
                       H / KVH);
            if (max_parts == 1) finish_heads(&w, H, D, out + (long)b * H * D);
            else save_partial(&w, H, D, ws_acc + it * H * D, ws_m + it * H, ws_l + it * H);
        }
    }
    if (max_parts > 1) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (long bh = 0; bh < (long)B * H; bh++) {
            long b = bh / H, h = bh % H;
            int parts = parts_of(context_lens[b], window, bs, part_tokens);
            combine_head(ws_acc, ws_m, ws_l, b, h, H, D, parts, max_parts, out + bh * D);
        }
    }
    free(ws);
    return 0;
}

/* One decode step's attention for one layer in one call: RoPE on the new q and k, k and v written into
 * their KV slots (converted to the pool's dtype), then paged_attention over every row's blocks (the new token
 * included). Replaces the per-layer torch ops of the lean decode path (rotate, two index_put writes, slicing,
 * the attention call).
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
 * (element offset slot: block * block_stride + offset * token_stride) of the pools, in the pool's dtype. */
static void write_kv(const float *row, const float *c, const float *s, const KVPool *p, long slot, int H, int R,
                     int h0, int h1) {
    const int KVH = p->kv_heads, D = p->head_dim;
    float rotated[DMAX];
    for (int h = h0; h < h1; h++) {
        const float *k = row + (long)(H + h) * D, *v = row + (long)(H + KVH + h) * D;
        const long off = slot + h * p->head_stride;
        if (c) rope_row(k, rotated, c, s, R, D);
        store_row(c ? rotated : k, p->k, p->k_scale, off, D, p->dtype);
        store_row(v, p->v, p->v_scale, off, D, p->dtype);
    }
}

int rope_write_attend(const float *qkv, long ldqkv, const float *cos, const float *sin, int R, const long *pos,
                      const KVPool *pool, const long *slot_blocks, const long *slot_offsets, const int *block_tables,
                      int table_stride, const int *context_lens, float *q_buf, float *out, int B, int H, float scale,
                      int window, float softcap, int nthreads) {
    const int D = pool->head_dim;
    for (int b = 0; b < B; b++) {
        const float *row = qkv + b * ldqkv, *c = cos ? cos + pos[b] * R : 0, *s = sin ? sin + pos[b] * R : 0;
        long slot = slot_blocks[b] * pool->block_stride + slot_offsets[b] * pool->token_stride;
        rope_queries(row, c, s, q_buf + (long)b * H * D, R, D, 0, H);
        write_kv(row, c, s, pool, slot, H, R, 0, pool->kv_heads);
    }
    return paged_attention(q_buf, (long)H * D, pool, block_tables, table_stride, context_lens, out, B, H, scale, window,
                           softcap, 0, nthreads);
}
