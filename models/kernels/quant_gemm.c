/* GEMM over GGUF-typed weights with fp32 activations: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]) (+ R[M, N]).
 *
 * Why: a decode step streams every weight once, so its cost is the weight bytes; the weights stay in their file's
 * own blocks (Q4_K 0.56 bytes a weight, Q8_0 1.06, F16 2) and are dequantized in registers (quants/<type>.h, one
 * header per type beside its scalar reference), never widened in memory.
 *
 * Layout (models/gguf/blocks.py, docs/quantization.md): W is N rows of row_bytes(type, K) bytes, row n the file's
 * blocks of output n in k order. For the quantized types K is a multiple of the block (32 or 256); F32, F16 and
 * BF16 take any K.
 *
 * The weights: every path multiplies by exactly the fp32 values gguf-py dequantizes (each is a*q, or the one
 * rounding of a*q + b with a*q exact), so the product's only freedom is its summation order, fixed here:
 *
 *   Summation order (every path, ISA, M and thread count): for output (m, n), 16 chains; chain c accumulates
 *   x[m][k] * w[n][k] for k = c, c + 16, c + 32, ... < K in increasing k by fused multiply-add, from 0. Then
 *   s8[c] = chain[c] + chain[c + 8], s4[c] = s8[c] + s8[c + 4], s2[c] = s4[c] + s4[c + 2], y = s2[0] + s2[1],
 *   then y += bias[n], then y += R[m][n].
 *
 * AVX-512 holds the 16 chains in one register, AVX2 in two (chains 0-7, 8-15): the same operations on the same
 * values, so the two ISAs give the same bits (tests compare them).
 *
 *   direct path (M <= direct_rows): up to 8 (AVX-512) / 4 (AVX2) rows per pass; each 32-weight chunk of a few
 *     output rows is dequantized in registers and multiplied into every row's chains (more rows: more passes).
 *   tile path: 4 (AVX-512) / 2 (AVX2) output rows dequantized into a per-thread fp32 buffer (L1 / L2) once, then
 *     register tiles of 6 x 4 (3 x 2) over all M rows: compute-bound prefill.
 * Threads split the output rows; an output is computed by one thread.
 *
 * Built by quant_lib.py with -O2 -mavx2 -mfma -mf16c -fopenmp (the AVX-512 functions carry their own target; the
 * fixed loops are unrolled by pragmas); decode_step.c is linked against the library (quant_gemm.h).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quant_gemm.h"
#include "quants/bf16.h"
#include "quants/f16.h"
#include "quants/f32.h"
#include "quants/iq4_nl.h"
#include "quants/iq4_xs.h"
#include "quants/q2_k.h"
#include "quants/q3_k.h"
#include "quants/q4_0.h"
#include "quants/q4_1.h"
#include "quants/q4_k.h"
#include "quants/q5_0.h"
#include "quants/q5_1.h"
#include "quants/q5_k.h"
#include "quants/q6_k.h"
#include "quants/q8_0.h"

#define Q_CHUNK 32          /* weights a dequantizing call yields */
#define Q_PREFETCH 1536     /* bytes ahead in each row's stream */
#define Q_ROWS2 4           /* rows per direct pass, AVX2 */
#define Q_ROWS512 8         /* rows per direct pass, AVX-512 */
#define Q_TILE_M2 3         /* tile path, AVX2: rows x output rows per register tile */
#define Q_TILE_N2 2
#define Q_TILE_M512 6       /* tile path, AVX-512 */
#define Q_TILE_N512 4

/* ---------------- types ---------------- */

/* Weights per block (the float types: a chunk of 32) and bytes per block; 0 for a type no kernel serves. */
static inline int q_block(int t) {
    switch (t) {
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 32;
    }
}

static inline int q_bytes(int t) {
    switch (t) {
    case T_F32: return 128;
    case T_F16: case T_BF16: return 64;
    case T_Q8_0: return 34;
    case T_Q4_0: case T_IQ4_NL: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_IQ4_XS: return 136;
    default: return 0;
    }
}

static inline int q_is_float(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }

/* Bytes of one row of K weights; -1 when the type is unknown or K is not whole blocks of it. */
long quant_row_bytes(int t, int K) {
    if (q_bytes(t) == 0 || K < 0) return -1;
    if (q_is_float(t)) return (long)K * q_bytes(t) / 32;
    return K % q_block(t) ? -1 : (long)K / q_block(t) * q_bytes(t);
}

/* ---------------- ISA ---------------- */

static int q_avx512; /* 1: the AVX-512 kernels run; set when the library loads, read atomically (kernel_isa) */

static int q_cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

__attribute__((constructor)) static void q_pick_isa(void) { __atomic_store_n(&q_avx512, q_cpu_avx512(), __ATOMIC_RELAXED); }

/* The ISA a call runs, read once per call: a call never mixes one ISA's tile sizes with the other's kernel. */
static inline int q_use_avx512(void) { return __atomic_load_n(&q_avx512, __ATOMIC_RELAXED); }

/* want < 0: report; 0: the AVX2 kernels; 1: the AVX-512 ones where the CPU has them (F, BW, VL). Returns 1 when the
 * kernels now run AVX-512, else 0. A call already running keeps its ISA (both give the same bits). */
int kernel_isa(int want) {
    if (want >= 0) __atomic_store_n(&q_avx512, want && q_cpu_avx512(), __ATOMIC_RELAXED);
    return q_use_avx512();
}

/* ---------------- one chunk of 32 weights ---------------- */

/* A partial last chunk of a float row (kn < 32 weights of esize bytes at p): zero-padded into tmp. */
static inline const uint8_t *q_float_tail(const uint8_t *p, int kn, int esize, uint8_t *tmp) {
    memset(tmp, 0, 32 * 4);
    memcpy(tmp, p, (size_t)kn * esize);
    return tmp;
}

/* Weights k .. k + 31 of a row (kn = min(32, K - k) of them exist; kn < 32 only for the float types, whose missing
 * weights are zero), 8 per register. */
QINLINE void q_chunk_avx2(int t, const uint8_t *row, int k, int kn, __m256 w[4]) {
    uint8_t tmp[128];
    const uint8_t *blk = row + (size_t)(k / q_block(t)) * q_bytes(t);
    const int j = k % q_block(t) / Q_CHUNK;
    switch (t) {
    case T_F32: f32_avx2(kn < 32 ? q_float_tail(blk, kn, 4, tmp) : blk, 0, w); break;
    case T_F16: f16_avx2(kn < 32 ? q_float_tail(blk, kn, 2, tmp) : blk, 0, w); break;
    case T_BF16: bf16_avx2(kn < 32 ? q_float_tail(blk, kn, 2, tmp) : blk, 0, w); break;
    case T_Q8_0: q8_0_avx2(blk, j, w); break;
    case T_Q4_0: q4_0_avx2(blk, j, w); break;
    case T_Q4_1: q4_1_avx2(blk, j, w); break;
    case T_Q5_0: q5_0_avx2(blk, j, w); break;
    case T_Q5_1: q5_1_avx2(blk, j, w); break;
    case T_IQ4_NL: iq4_nl_avx2(blk, j, w); break;
    case T_Q2_K: q2_k_avx2(blk, j, w); break;
    case T_Q3_K: q3_k_avx2(blk, j, w); break;
    case T_Q4_K: q4_k_avx2(blk, j, w); break;
    case T_Q5_K: q5_k_avx2(blk, j, w); break;
    case T_Q6_K: q6_k_avx2(blk, j, w); break;
    case T_IQ4_XS: iq4_xs_avx2(blk, j, w); break;
    }
}

QINLINE512 void q_chunk_avx512(int t, const uint8_t *row, int k, int kn, __m512 w[2]) {
    uint8_t tmp[128];
    const uint8_t *blk = row + (size_t)(k / q_block(t)) * q_bytes(t);
    const int j = k % q_block(t) / Q_CHUNK;
    switch (t) {
    case T_F32: f32_avx512(kn < 32 ? q_float_tail(blk, kn, 4, tmp) : blk, 0, w); break;
    case T_F16: f16_avx512(kn < 32 ? q_float_tail(blk, kn, 2, tmp) : blk, 0, w); break;
    case T_BF16: bf16_avx512(kn < 32 ? q_float_tail(blk, kn, 2, tmp) : blk, 0, w); break;
    case T_Q8_0: q8_0_avx512(blk, j, w); break;
    case T_Q4_0: q4_0_avx512(blk, j, w); break;
    case T_Q4_1: q4_1_avx512(blk, j, w); break;
    case T_Q5_0: q5_0_avx512(blk, j, w); break;
    case T_Q5_1: q5_1_avx512(blk, j, w); break;
    case T_IQ4_NL: iq4_nl_avx512(blk, j, w); break;
    case T_Q2_K: q2_k_avx512(blk, j, w); break;
    case T_Q3_K: q3_k_avx512(blk, j, w); break;
    case T_Q4_K: q4_k_avx512(blk, j, w); break;
    case T_Q5_K: q5_k_avx512(blk, j, w); break;
    case T_Q6_K: q6_k_avx512(blk, j, w); break;
    case T_IQ4_XS: iq4_xs_avx512(blk, j, w); break;
    }
}

/* Fetch a row's bytes ahead of the chunk at k, once per block (the float types: per chunk). */
QINLINE void q_prefetch(int t, const uint8_t *row, int k) {
    if (k % q_block(t)) return;
    const char *ahead = (const char *)row + (size_t)(k / q_block(t)) * q_bytes(t) + Q_PREFETCH;
    for (int off = 0; off < q_bytes(t); off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
}

/* The scalar reference of one block (the float types: one weight) -> out. */
static void q_block_ref(int t, const uint8_t *blk, float *out) {
    switch (t) {
    case T_F32: f32_ref(blk, out); break;
    case T_F16: f16_ref(blk, out); break;
    case T_BF16: bf16_ref(blk, out); break;
    case T_Q8_0: q8_0_ref(blk, out); break;
    case T_Q4_0: q4_0_ref(blk, out); break;
    case T_Q4_1: q4_1_ref(blk, out); break;
    case T_Q5_0: q5_0_ref(blk, out); break;
    case T_Q5_1: q5_1_ref(blk, out); break;
    case T_IQ4_NL: iq4_nl_ref(blk, out); break;
    case T_Q2_K: q2_k_ref(blk, out); break;
    case T_Q3_K: q3_k_ref(blk, out); break;
    case T_Q4_K: q4_k_ref(blk, out); break;
    case T_Q5_K: q5_k_ref(blk, out); break;
    case T_Q6_K: q6_k_ref(blk, out); break;
    case T_IQ4_XS: iq4_xs_ref(blk, out); break;
    }
}

/* ---------------- dequantizing whole rows ---------------- */

/* Row `row` (K weights) -> out[0 .. ceil32(K)) fp32, the missing weights of a partial float chunk zero. */
QINLINE void q_row_avx2(int t, const uint8_t *row, int K, float *out) {
    for (int k = 0; k < K; k += Q_CHUNK) {
        __m256 w[4];
        q_chunk_avx2(t, row, k, K - k < Q_CHUNK ? K - k : Q_CHUNK, w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + k + 8 * i, w[i]);
    }
}

QINLINE512 void q_row_avx512(int t, const uint8_t *row, int K, float *out) {
    for (int k = 0; k < K; k += Q_CHUNK) {
        __m512 w[2];
        q_chunk_avx512(t, row, k, K - k < Q_CHUNK ? K - k : Q_CHUNK, w);
        _mm512_storeu_ps(out + k, w[0]), _mm512_storeu_ps(out + k + 16, w[1]);
    }
}

#define Q_TYPE_CASES(CALL)                                                                                           \
    CALL(T_F32) CALL(T_F16) CALL(T_BF16) CALL(T_Q8_0) CALL(T_Q4_0) CALL(T_Q4_1) CALL(T_Q5_0) CALL(T_Q5_1)             \
    CALL(T_IQ4_NL) CALL(T_Q2_K) CALL(T_Q3_K) CALL(T_Q4_K) CALL(T_Q5_K) CALL(T_Q6_K) CALL(T_IQ4_XS)

static void q_row2(int t, const uint8_t *row, int K, float *out) {
#define CALL(T) case T: q_row_avx2(T, row, K, out); return;
    switch (t) { Q_TYPE_CASES(CALL) }
#undef CALL
}

AVX512 static void q_row512(int t, const uint8_t *row, int K, float *out) {
#define CALL(T) case T: q_row_avx512(T, row, K, out); return;
    switch (t) { Q_TYPE_CASES(CALL) }
#undef CALL
}

/* Row of W -> out[0 .. ceil32(K)) with the running ISA's kernels (what every path multiplies by). */
void quant_row(int t, const uint8_t *row, int K, float *out) {
    if (q_use_avx512()) q_row512(t, row, K, out);
    else q_row2(t, row, K, out);
}

/* out[i, 0 .. K) = row rows[i] of W (n rows; `ref`: the scalar references instead of the SIMD kernels). Returns 0,
 * or -1 for an unknown type or K that is not whole blocks. */
int quant_dequantize_rows(int t, const uint8_t *W, int K, const long *rows, int n, float *out, int ref) {
    const long rb = quant_row_bytes(t, K);
    if (rb < 0) return -1;
    const int block = q_is_float(t) ? 1 : q_block(t), bytes = q_is_float(t) ? q_bytes(t) / 32 : q_bytes(t);
    float *tmp = ref ? NULL : malloc(sizeof(float) * ((size_t)K + Q_CHUNK));
    if (!ref && !tmp) return -1;
    for (int i = 0; i < n; i++) {
        const uint8_t *row = W + rows[i] * rb;
        if (ref) {
            for (int b = 0; b < K / block; b++) q_block_ref(t, row + (size_t)b * bytes, out + (size_t)i * K + b * block);
        } else {
            quant_row(t, row, K, tmp);
            memcpy(out + (size_t)i * K, tmp, sizeof(float) * K);
        }
    }
    free(tmp);
    return 0;
}

/* ---------------- the epilogue ---------------- */

/* The fixed reduction of the 16 chains (lo: chains 0-7, hi: 8-15). */
QINLINE float q_sum16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

QINLINE512 float q_sum16_512(__m512 v) {
    return q_sum16(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

QINLINE float q_finish(float s, const float *bias, const float *r) {
    if (bias) s += *bias;
    if (r) s += *r;
    return s;
}

/* ---------------- direct path: dequantize in registers ---------------- */

/* Rows of a chunk's activations: x[i] + k, or (a partial float chunk) a zero-padded copy. */
QINLINE void q_chunk_x(const float *const *x, int R, int k, int kn, float (*tail)[Q_CHUNK], const float **xk) {
    for (int i = 0; i < R; i++) {
        if (kn == Q_CHUNK) {
            xk[i] = x[i] + k;
        } else {
            memset(tail[i], 0, sizeof(tail[i]));
            memcpy(tail[i], x[i] + k, sizeof(float) * kn);
            xk[i] = tail[i];
        }
    }
}

/* R activation rows x NR output rows (weight rows wr[r]; R and NR constants after inlining). y[i * NR + r]: output
 * (i, r), or NULL (not stored); res likewise: its residual, or NULL. */
QINLINE void q_direct_avx2(int t, const float *const *x, int R, const uint8_t *const *wr, int NR, int K,
                           const float *bias, const float *const *res, float *const *y) {
    __m256 lo[Q_ROWS2][4], hi[Q_ROWS2][4];
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
    float tail[Q_ROWS2][Q_CHUNK];
    for (int k = 0; k < K; k += Q_CHUNK) {
        const int kn = K - k < Q_CHUNK ? K - k : Q_CHUNK;
        const float *xk[Q_ROWS2];
        q_chunk_x(x, R, k, kn, tail, xk);
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) {
            __m256 wv[4];
            q_prefetch(t, wr[r], k);
            q_chunk_avx2(t, wr[r], k, kn, wv);
            _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                lo[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk[i]), wv[0], lo[i][r]);
                hi[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk[i] + 8), wv[1], hi[i][r]);
                lo[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk[i] + 16), wv[2], lo[i][r]);
                hi[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xk[i] + 24), wv[3], hi[i][r]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int r = 0; r < NR; r++)
            if (y[i * NR + r])
                *y[i * NR + r] = q_finish(q_sum16(lo[i][r], hi[i][r]), bias ? bias + r : NULL, res ? res[i * NR + r] : NULL);
}

QINLINE512 void q_direct_avx512(int t, const float *const *x, int R, const uint8_t *const *wr, int NR, int K,
                                const float *bias, const float *const *res, float *const *y) {
    __m512 acc[Q_ROWS512][4];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
    float tail[Q_ROWS512][Q_CHUNK];
    for (int k = 0; k < K; k += Q_CHUNK) {
        const int kn = K - k < Q_CHUNK ? K - k : Q_CHUNK;
        const float *xk[Q_ROWS512];
        q_chunk_x(x, R, k, kn, tail, xk);
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) {
            __m512 wv[2];
            q_prefetch(t, wr[r], k);
            q_chunk_avx512(t, wr[r], k, kn, wv);
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xk[i]), wv[0], acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xk[i] + 16), wv[1], acc[i][r]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int r = 0; r < NR; r++)
            if (y[i * NR + r])
                *y[i * NR + r] = q_finish(q_sum16_512(acc[i][r]), bias ? bias + r : NULL, res ? res[i * NR + r] : NULL);
}

/* Output rows per pass for R activation rows (the accumulators fit in registers). */
static inline int q_group2(int R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }
static inline int q_group512(int R) { return R <= 4 ? 4 : 2; }

static void q_direct2(int t, const float *const *x, int R, const uint8_t *const *wr, int K, const float *bias,
                      const float *const *res, float *const *y) {
#define CALL(T)                                                                                                     \
    case T:                                                                                                          \
        switch (R) {                                                                                                 \
        case 1: q_direct_avx2(T, x, 1, wr, 4, K, bias, res, y); return;                                              \
        case 2: q_direct_avx2(T, x, 2, wr, 2, K, bias, res, y); return;                                              \
        case 3: q_direct_avx2(T, x, 3, wr, 1, K, bias, res, y); return;                                              \
        default: q_direct_avx2(T, x, 4, wr, 1, K, bias, res, y); return;                                             \
        }
    switch (t) { Q_TYPE_CASES(CALL) }
#undef CALL
}

AVX512 static void q_direct512(int t, const float *const *x, int R, const uint8_t *const *wr, int K,
                               const float *bias, const float *const *res, float *const *y) {
#define CALL(T)                                                                                                     \
    case T:                                                                                                          \
        switch (R) {                                                                                                 \
        case 1: q_direct_avx512(T, x, 1, wr, 4, K, bias, res, y); return;                                            \
        case 2: q_direct_avx512(T, x, 2, wr, 4, K, bias, res, y); return;                                            \
        case 3: q_direct_avx512(T, x, 3, wr, 4, K, bias, res, y); return;                                            \
        case 4: q_direct_avx512(T, x, 4, wr, 4, K, bias, res, y); return;                                            \
        case 5: q_direct_avx512(T, x, 5, wr, 2, K, bias, res, y); return;                                            \
        case 6: q_direct_avx512(T, x, 6, wr, 2, K, bias, res, y); return;                                            \
        case 7: q_direct_avx512(T, x, 7, wr, 2, K, bias, res, y); return;                                            \
        default: q_direct_avx512(T, x, 8, wr, 2, K, bias, res, y); return;                                           \
        }
    switch (t) { Q_TYPE_CASES(CALL) }
#undef CALL
}

/* Output rows [n0, n1) of M activation rows: passes of up to Q_ROWS rows, groups of output rows; a last group
 * shorter than the kernel's reads its last row again for the missing ones and drops their outputs. */
static void q_direct_range(int t, const float *X, int ldx, const uint8_t *W, const float *bias, const float *Rs,
                           int ldr, float *Y, int ldy, int M, int K, int n0, int n1) {
    const size_t rb = (size_t)quant_row_bytes(t, K);
    const int avx512 = q_use_avx512(), rows = avx512 ? Q_ROWS512 : Q_ROWS2;
    for (int m0 = 0; m0 < M; m0 += rows) {
        const int R = M - m0 < rows ? M - m0 : rows, NR = avx512 ? q_group512(R) : q_group2(R);
        const float *x[Q_ROWS512];
        for (int i = 0; i < R; i++) x[i] = X + (size_t)(m0 + i) * ldx;
        for (int n = n0; n < n1; n += NR) {
            const int nr = n1 - n < NR ? n1 - n : NR;
            const uint8_t *wr[4];
            float *y[Q_ROWS512 * 4], bias_g[4];
            const float *res[Q_ROWS512 * 4];
            for (int r = 0; r < NR; r++) {
                wr[r] = W + (size_t)(n + (r < nr ? r : nr - 1)) * rb;
                bias_g[r] = bias && r < nr ? bias[n + r] : 0.0f;
                for (int i = 0; i < R; i++) {
                    y[i * NR + r] = r < nr ? Y + (size_t)(m0 + i) * ldy + n + r : NULL;
                    res[i * NR + r] = Rs && r < nr ? Rs + (size_t)(m0 + i) * ldr + n + r : NULL;
                }
            }
            if (avx512) q_direct512(t, x, R, wr, K, bias ? bias_g : NULL, Rs ? res : NULL, y);
            else q_direct2(t, x, R, wr, K, bias ? bias_g : NULL, Rs ? res : NULL, y);
        }
    }
}

/* ---------------- tile path: dequantized rows in a buffer, fp32 register tiles ---------------- */

/* TM x TN outputs over K from rows x[i] and dequantized weight rows wp[c] (each ceil32(K) floats); rows and columns
 * past `rows` / `cols` alias real ones and are not stored. */
QINLINE void q_tile_avx2(const float *const *x, int K, const float *const *wp, const float *bias,
                         const float *R, int ldr, float *Y, int ldy, int rows, int cols) {
    __m256 lo[Q_TILE_M2][Q_TILE_N2], hi[Q_TILE_M2][Q_TILE_N2];
    for (int i = 0; i < Q_TILE_M2; i++) for (int c = 0; c < Q_TILE_N2; c++) lo[i][c] = hi[i][c] = _mm256_setzero_ps();
    const int Kp = (K + Q_CHUNK - 1) / Q_CHUNK * Q_CHUNK;
    int k = 0;
    for (; k + 16 <= K; k += 16)
        for (int i = 0; i < Q_TILE_M2; i++) {
            const __m256 x0 = _mm256_loadu_ps(x[i] + k), x1 = _mm256_loadu_ps(x[i] + k + 8);
            for (int c = 0; c < Q_TILE_N2; c++) {
                lo[i][c] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(wp[c] + k), lo[i][c]);
                hi[i][c] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(wp[c] + k + 8), hi[i][c]);
            }
        }
    for (; k < Kp; k += 16) /* a partial float row: zero-padded activations, as the direct path */
        for (int i = 0; i < Q_TILE_M2; i++) {
            float xp[16] = {0};
            if (k < K) memcpy(xp, x[i] + k, sizeof(float) * (K - k < 16 ? K - k : 16));
            const __m256 x0 = _mm256_loadu_ps(xp), x1 = _mm256_loadu_ps(xp + 8);
            for (int c = 0; c < Q_TILE_N2; c++) {
                lo[i][c] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(wp[c] + k), lo[i][c]);
                hi[i][c] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(wp[c] + k + 8), hi[i][c]);
            }
        }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < cols; c++)
            Y[(size_t)i * ldy + c] = q_finish(q_sum16(lo[i][c], hi[i][c]), bias ? bias + c : NULL,
                                              R ? R + (size_t)i * ldr + c : NULL);
}

AVX512 static void q_tile512(const float *const *x, int K, const float *const *wp, const float *bias,
                             const float *R, int ldr, float *Y, int ldy, int rows, int cols) {
    __m512 acc[Q_TILE_M512][Q_TILE_N512];
    for (int i = 0; i < Q_TILE_M512; i++) for (int c = 0; c < Q_TILE_N512; c++) acc[i][c] = _mm512_setzero_ps();
    const int Kp = (K + Q_CHUNK - 1) / Q_CHUNK * Q_CHUNK;
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 w[Q_TILE_N512];
        for (int c = 0; c < Q_TILE_N512; c++) w[c] = _mm512_loadu_ps(wp[c] + k);
        for (int i = 0; i < Q_TILE_M512; i++) {
            const __m512 xv = _mm512_loadu_ps(x[i] + k);
            for (int c = 0; c < Q_TILE_N512; c++) acc[i][c] = _mm512_fmadd_ps(xv, w[c], acc[i][c]);
        }
    }
    for (; k < Kp; k += 16) {
        const __mmask16 valid = k < K ? (__mmask16)((1u << (K - k < 16 ? K - k : 16)) - 1) : 0;
        for (int i = 0; i < Q_TILE_M512; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(valid, x[i] + k);
            for (int c = 0; c < Q_TILE_N512; c++) acc[i][c] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wp[c] + k), acc[i][c]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < cols; c++)
            Y[(size_t)i * ldy + c] = q_finish(q_sum16_512(acc[i][c]), bias ? bias + c : NULL,
                                              R ? R + (size_t)i * ldr + c : NULL);
}

static void q_tile2(const float *const *x, int K, const float *const *wp, const float *bias, const float *R, int ldr,
                    float *Y, int ldy, int rows, int cols) {
    q_tile_avx2(x, K, wp, bias, R, ldr, Y, ldy, rows, cols);
}

/* This thread's buffer of at least `floats` floats (kept between calls; NULL when it cannot be allocated). */
static float *q_thread_buffer(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        free(buf);
        cap = (floats + 1023) / 1024 * 1024;
        buf = aligned_alloc(64, cap * sizeof(float));
        if (!buf) cap = 0;
    }
    return buf;
}

/* Output rows [n0, n1) of M rows through dequantized groups of rows; -1 when the buffer cannot be allocated. */
static int q_tile_range(int t, const float *X, int ldx, const uint8_t *W, const float *bias, const float *R, int ldr,
                        float *Y, int ldy, int M, int K, int n0, int n1) {
    const size_t rb = (size_t)quant_row_bytes(t, K), Kp = (size_t)(K + Q_CHUNK - 1) / Q_CHUNK * Q_CHUNK;
    const int avx512 = q_use_avx512(), TN = avx512 ? Q_TILE_N512 : Q_TILE_N2, TM = avx512 ? Q_TILE_M512 : Q_TILE_M2;
    float *buf = q_thread_buffer(Q_TILE_N512 * Kp);
    if (!buf) return -1;
    for (int n = n0; n < n1; n += TN) {
        const int cols = n1 - n < TN ? n1 - n : TN;
        const float *wp[Q_TILE_N512];
        for (int c = 0; c < TN; c++) {
            if (c < cols) quant_row(t, W + (size_t)(n + c) * rb, K, buf + c * Kp);
            wp[c] = buf + (c < cols ? c : 0) * Kp;
        }
        for (int m0 = 0; m0 < M; m0 += TM) {
            const int rows = M - m0 < TM ? M - m0 : TM;
            const float *x[Q_TILE_M512];
            for (int i = 0; i < TM; i++) x[i] = X + (size_t)(m0 + (i < rows ? i : rows - 1)) * ldx;
            float *y = Y + (size_t)m0 * ldy + n;
            const float *r = R ? R + (size_t)m0 * ldr + n : NULL;
            if (avx512) q_tile512(x, K, wp, bias ? bias + n : NULL, r, ldr, y, ldy, rows, cols);
            else q_tile2(x, K, wp, bias ? bias + n : NULL, r, ldr, y, ldy, rows, cols);
        }
    }
    return 0;
}

/* Output rows [n0, n1) of Y = X W^T (+ bias) (+ R): the direct path up to direct_rows rows, else the tile path (the
 * same bits). decode_step.c calls this for its linears. Returns 0, or -1 when a tile buffer cannot be allocated. */
int quant_range(int t, const float *X, int ldx, const uint8_t *W, const float *bias, const float *R, int ldr,
                       float *Y, int ldy, int M, int K, int n0, int n1, int direct_rows) {
    if (n0 >= n1 || M <= 0) return 0;
    if (M <= direct_rows) {
        q_direct_range(t, X, ldx, W, bias, R, ldr, Y, ldy, M, K, n0, n1);
        return 0;
    }
    return q_tile_range(t, X, ldx, W, bias, R, ldr, Y, ldy, M, K, n0, n1);
}

/* ---------------- entry point ---------------- */

/* Y = X @ W^T (+ bias) (+ R) for W of GGUF type t (row-major blocks, quant_row_bytes(t, K) bytes a row); bias and R
 * may be NULL. direct_rows < 0: the default split between the paths (identical results). Returns 0, -1 when a tile
 * buffer could not be allocated (Y is then incomplete), -2 for an unknown type or K that is not whole blocks. */
int quant_gemm(int t, const float *X, int ldx, const uint8_t *W, const float *bias, const float *R, int ldr, float *Y,
               int ldy, int M, int K, int N, int nthreads, int direct_rows) {
    if (quant_row_bytes(t, K) < 0) return -2;
    if (direct_rows < 0) direct_rows = Q_DIRECT_ROWS;
    const int units = (N + 7) / 8; /* threads split the output rows in eights */
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = units;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int th = 0, nt = 1;
#ifdef _OPENMP
        th = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int u0 = (int)((long)units * th / nt), u1 = (int)((long)units * (th + 1) / nt);
        const int n0 = 8 * u0, n1 = 8 * u1 < N ? 8 * u1 : N;
        if (quant_range(t, X, ldx, W, bias, R, ldr, Y, ldy, M, K, n0, n1, direct_rows) != 0) failed = 1;
    }
    return failed ? -1 : 0;
}
