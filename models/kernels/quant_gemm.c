/* Quantized-weight GEMM with fp32 activations: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]) (+ R[M, N]).
 *
 * Why: a decode step streams every weight once, so its cost is the weight bytes. int8 weights
 * are 1.06 bytes per weight and int4 0.625 against fp32's 4; each weight is read once per call
 * and dequantized in registers or into a small fp32 buffer (quant_gemm.py has the measurements).
 *
 * Formats (group = 32 consecutive k of one output column n; d and m are fp16):
 *   int8: w = q * d            q int8            (GGUF Q8_0 exactly)
 *   int4: w = q * d + m        q in 0..15        (GGUF Q4_1 exactly; Q4_0 is m = -8 d)
 * Both dequantize exactly to the fp32 value computed by fma(q, d, m) / q * d (q * d is exact
 * in fp32: at most 8 + 11 significant bits), so the torch reference agrees bit for bit.
 *
 * Layout: panels of 8 output columns (the last zero-padded), each panel a run of G = ceil(K / 32)
 * blocks, one block per group (the last group zero-padded):
 *   int8 block (272 bytes): d[8] fp16 | q[32 k][8 cols] int8
 *   int4 block (160 bytes): d[8] fp16 | m[8] fp16 | byte[16 k-pairs][8 cols] = q[2t] | q[2t+1] << 4
 * so a panel is one sequential stream and one 8-byte load yields one k (int8) or two (int4)
 * for all 8 columns.
 *
 * Summation order (the same in every path below, so results do not depend on M, on which path
 * ran, or on the thread count): for each output, even k accumulate into one fp32 sum and odd k
 * into another, each in increasing k by fused multiply-add; y = (even + odd) (+ bias) (+ r).
 * Two chains per output hide the FMA latency when few rows share a panel.
 *
 *   direct path (M <= direct_rows), up to REGISTER_ROWS (8) rows: weights dequantized in
 *     registers, one pass per 4 rows over a panel (passes after the first re-read it from L1 and
 *     dequantize it again); 1-2 rows take two panels at once so that enough independent FMA
 *     chains hide the FMA latency.
 *   direct path, more rows: per panel pair and group, the block (32 k x 16 columns) is dequantized
 *     once into a 2 KB fp32 buffer (L1); every row then runs over it in tiles of up to 6 rows x 16
 *     columns, one chain at a time (even k, then odd k: only one chain's accumulators are live, so
 *     6 rows fit in registers), the sums kept in L1 between blocks. At 8 rows and fewer this is no
 *     faster: the loop is FMA- and load-bound, not dequantize-bound (quant_gemm.py).
 *   tile path (M > direct_rows): per pair of panels, dequantize 16 columns x K into a per-thread
 *     fp32 buffer (L2) once, then 3-row x 16-column register tiles over all M rows: compute-bound.
 * Threads split panels (direct) or panel pairs (tile); an output is computed by one thread.
 *
 * AVX-512: where the CPU has AVX-512F (checked once, when the library loads), the register, L1 and tile kernels
 * run a panel pair per 16-lane register. Lane j of a pair's register does exactly what lane j % 8
 * of its panel's AVX2 register does (the same dequantizing multiply or fma, the same two FMA chains in
 * increasing k, the same epilogue), so the results are bit-identical to the AVX2 kernels; there are half as
 * many instructions per weight, and 32 registers hold all 8 rows' chains in one pass over the weights.
 * ``kernel_isa`` reports or forces the choice (tests compare the two).
 *
 * Built by quant_gemm.py with -O3 -mavx2 -mfma -mf16c -fopenmp (the AVX-512 functions carry their own target).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 8
#define GROUP 32
#define DIRECT_ROWS 4 /* rows per pass of the direct path */
#define TILE_ROWS 3   /* rows per register tile of the tile path */
#ifndef REGISTER_ROWS
#define REGISTER_ROWS 8 /* at most this many rows: the direct path dequantizes in registers (measured) */
#endif
#define PREFETCH_BYTES 2048

enum { FMT_INT8 = 0, FMT_INT4 = 1 };

#define AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

static int isa_avx512; /* 1: the AVX-512 kernels run; set when the library loads, read atomically (kernel_isa) */

__attribute__((constructor)) static void pick_isa(void) {
    __builtin_cpu_init();
    __atomic_store_n(&isa_avx512, __builtin_cpu_supports("avx512f") != 0, __ATOMIC_RELAXED);
}

/* The ISA a call runs, read once per call: a call never mixes a tile size of one ISA with the other's kernel. */
static inline int use_avx512(void) { return __atomic_load_n(&isa_avx512, __ATOMIC_RELAXED); }

/* want < 0: report; 0: the AVX2 kernels; 1: the AVX-512 ones where the CPU has them. Returns 1 when the kernels
 * now run AVX-512, else 0. A call already running keeps its ISA (both give the same bits). */
int kernel_isa(int want) {
    if (want >= 0) __atomic_store_n(&isa_avx512, want && __builtin_cpu_supports("avx512f") != 0, __ATOMIC_RELAXED);
    return use_avx512();
}

static inline int block_bytes(int fmt) { return fmt == FMT_INT8 ? 16 + GROUP * PANEL : 32 + GROUP * PANEL / 2; }

/* The 8 columns' d (and m) of one block. */
static inline __m256 load_half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* int8: k-row kk of a block -> 8 fp32 weights. */
static inline __m256 deq8(const uint8_t *q, int kk, __m256 d) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + (size_t)kk * PANEL)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
}

/* int4: k-pair t of a block -> weights of k = 2t (lo) and 2t + 1 (hi), 8 columns each. */
static inline void deq4(const uint8_t *q, int t, __m256 d, __m256 m, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + (size_t)t * PANEL)));
    __m256i l = _mm256_and_si256(v, _mm256_set1_epi32(15));
    __m256i h = _mm256_srli_epi32(v, 4);
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), d, m);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), d, m);
}

/* y[i][0..cols) = even[i] + odd[i] (+ bias) (+ r[i]) for one 8-column slice. */
static inline void store8(__m256 even, __m256 odd, const float *bias, const float *r, float *y, int cols) {
    __m256 v = _mm256_add_ps(even, odd);
    if (cols == PANEL) {
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
        if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r));
        _mm256_storeu_ps(y, v);
    } else { /* the last, partial panel: only `cols` columns exist in bias, r and y */
        float tmp[PANEL];
        _mm256_storeu_ps(tmp, v);
        for (int j = 0; j < cols; j++) {
            float s = tmp[j];
            if (bias) s += bias[j];
            if (r) s += r[j];
            y[j] = s;
        }
    }
}

/* ---------------- direct path: dequantize in registers ---------------- */

/* NP consecutive panels (w, w + panel_bytes, ...) x R rows, NP and R constant after inlining.
 * x[i]: row i of X; y[i], r[i]: its outputs at the first panel's first column. Only the last
 * panel may be partial (cols_last columns). */
static inline __attribute__((always_inline)) void direct_panels(int fmt, const float *const *x, int K,
                                                                const uint8_t *w, size_t panel_bytes, int NP,
                                                                const float *bias, const float *const *r,
                                                                float *const *y, int R, int cols_last) {
    __m256 ev[2][DIRECT_ROWS], od[2][DIRECT_ROWS];
    _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++)
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) ev[p][i] = od[p][i] = _mm256_setzero_ps();
    const int bb = block_bytes(fmt), G = (K + GROUP - 1) / GROUP;
    for (int g = 0; g < G; g++) {
        const int k0 = g * GROUP, kn = K - k0 < GROUP ? K - k0 : GROUP;
        const float *xk[DIRECT_ROWS];
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) xk[i] = x[i] + k0;
        _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
            const char *ahead = (const char *)(w + p * panel_bytes + (size_t)g * bb) + PREFETCH_BYTES;
            for (int off = 0; off < bb; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        if (fmt == FMT_INT8) {
            __m256 d[2];
            const uint8_t *q[2];
            _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
                const uint8_t *blk = w + p * panel_bytes + (size_t)g * bb;
                d[p] = load_half8(blk);
                q[p] = blk + 16;
            }
            int kk = 0;
            for (; kk + 1 < kn; kk += 2) {
                _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
                    __m256 w0 = deq8(q[p], kk, d[p]), w1 = deq8(q[p], kk + 1, d[p]);
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                        ev[p][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk[i] + kk), w0, ev[p][i]);
                        od[p][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk[i] + kk + 1), w1, od[p][i]);
                    }
                }
            }
            if (kk < kn) { /* odd group length: the last k is even */
                _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
                    __m256 w0 = deq8(q[p], kk, d[p]);
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
                        ev[p][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk[i] + kk), w0, ev[p][i]);
                }
            }
        } else {
            __m256 d[2], m[2];
            const uint8_t *q[2];
            _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
                const uint8_t *blk = w + p * panel_bytes + (size_t)g * bb;
                d[p] = load_half8(blk);
                m[p] = load_half8(blk + 16);
                q[p] = blk + 32;
            }
            int t = 0;
            for (; 2 * t + 1 < kn; t++) {
                _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
                    __m256 lo, hi;
                    deq4(q[p], t, d[p], m[p], &lo, &hi);
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {
                        ev[p][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk[i] + 2 * t), lo, ev[p][i]);
                        od[p][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk[i] + 2 * t + 1), hi, od[p][i]);
                    }
                }
            }
            if (2 * t < kn) {
                _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
                    __m256 lo, hi;
                    deq4(q[p], t, d[p], m[p], &lo, &hi);
                    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
                        ev[p][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk[i] + 2 * t), lo, ev[p][i]);
                }
            }
        }
    }
    _Pragma("GCC unroll 2") for (int p = 0; p < NP; p++) {
        const int cols = p == NP - 1 ? cols_last : PANEL;
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)
            store8(ev[p][i], od[p][i], bias ? bias + p * PANEL : NULL, r ? r[i] + p * PANEL : NULL,
                   y[i] + p * PANEL, cols);
    }
}

/* Specialized per format, panel count and row count so the accumulators live in registers:
 * 1-2 rows take two panels at once (4-8 independent FMA chains), 3-4 rows one panel. */
static void direct_dispatch(int fmt, const float *const *x, int K, const uint8_t *w, size_t panel_bytes, int NP,
                            const float *bias, const float *const *r, float *const *y, int R, int cols_last) {
#define CASE(np, n)                                                                                         \
    if (NP == np && R == n) {                                                                               \
        if (fmt == FMT_INT8) direct_panels(FMT_INT8, x, K, w, panel_bytes, np, bias, r, y, n, cols_last);   \
        else direct_panels(FMT_INT4, x, K, w, panel_bytes, np, bias, r, y, n, cols_last);                   \
        return;                                                                                             \
    }
    CASE(2, 1) CASE(2, 2) CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
#undef CASE
}

/* ---------------- direct path, AVX-512: a panel pair per register ---------------- */

#define MAX_PAIRS 2 /* panel pairs per pass (1-2 rows take two, for enough independent FMA chains) */

/* The d (or m) of one block of each panel of a pair: lanes 0-7 panel a's columns, 8-15 panel b's. */
AVX512 static inline __m512 load_half16(const uint8_t *a, const uint8_t *b) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)a), hi = _mm_loadu_si128((const __m128i *)b);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* k-row kk (int8) or k-pair kk (int4) of both panels' blocks: 16 bytes, panel a's 8 then panel b's 8. */
AVX512 static inline __m128i load_pair_bytes(const uint8_t *qa, const uint8_t *qb, int kk) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(qa + (size_t)kk * PANEL)),
                              _mm_loadl_epi64((const __m128i *)(qb + (size_t)kk * PANEL)));
}

AVX512 static inline __m512 deq8x2(const uint8_t *qa, const uint8_t *qb, int kk, __m512 d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_pair_bytes(qa, qb, kk))), d);
}

AVX512 static inline void deq4x2(const uint8_t *qa, const uint8_t *qb, int t, __m512 d, __m512 m, __m512 *lo,
                                 __m512 *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(load_pair_bytes(qa, qb, t));
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d, m);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
}

/* The 256-bit halves of a register: panel a's 8 lanes, panel b's 8. */
AVX512 static inline __m256 lo256(__m512 v) { return _mm512_castps512_ps256(v); }
AVX512 static inline __m256 hi256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

static void store16(__m256 ev[2], __m256 od[2], const float *bias, const float *r, float *y, int cols);

/* A panel pair's 16 (or `cols`) outputs of one row: store16 on the registers' halves. */
AVX512 static inline void store_pair(__m512 even, __m512 odd, const float *bias, const float *r, float *y, int cols) {
    __m256 e[2] = {lo256(even), hi256(even)}, o[2] = {lo256(odd), hi256(odd)};
    store16(e, o, bias, r, y, cols);
}

/* NQ panel pairs (2 NQ consecutive panels at w, all of them present) x R rows, as direct_panels; `cols` columns
 * exist from the first panel's first column (16 (NQ - 1) + 1 .. 16 NQ). */
AVX512 static inline __attribute__((always_inline)) void direct_pairs512(int fmt, const float *const *x, int K,
                                                                         const uint8_t *w, size_t panel_bytes,
                                                                         int NQ, const float *bias,
                                                                         const float *const *r, float *const *y,
                                                                         int R, int cols) {
    __m512 ev[MAX_PAIRS][REGISTER_ROWS], od[MAX_PAIRS][REGISTER_ROWS];
    _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++)
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) ev[p][i] = od[p][i] = _mm512_setzero_ps();
    const int bb = block_bytes(fmt), G = (K + GROUP - 1) / GROUP;
    for (int g = 0; g < G; g++) {
        const int k0 = g * GROUP, kn = K - k0 < GROUP ? K - k0 : GROUP;
        const float *xk[REGISTER_ROWS];
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) xk[i] = x[i] + k0;
        const uint8_t *blk[2 * MAX_PAIRS];
        _Pragma("GCC unroll 4") for (int p = 0; p < 2 * NQ; p++) {
            blk[p] = w + p * panel_bytes + (size_t)g * bb;
            const char *ahead = (const char *)blk[p] + PREFETCH_BYTES;
            for (int off = 0; off < bb; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        if (fmt == FMT_INT8) {
            __m512 d[MAX_PAIRS];
            _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) d[p] = load_half16(blk[2 * p], blk[2 * p + 1]);
            int kk = 0;
            for (; kk + 1 < kn; kk += 2) {
                _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) {
                    const uint8_t *qa = blk[2 * p] + 16, *qb = blk[2 * p + 1] + 16;
                    const __m512 w0 = deq8x2(qa, qb, kk, d[p]), w1 = deq8x2(qa, qb, kk + 1, d[p]);
                    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                        ev[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i][kk]), w0, ev[p][i]);
                        od[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i][kk + 1]), w1, od[p][i]);
                    }
                }
            }
            if (kk < kn) { /* odd group length: the last k is even */
                _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) {
                    const __m512 w0 = deq8x2(blk[2 * p] + 16, blk[2 * p + 1] + 16, kk, d[p]);
                    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
                        ev[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i][kk]), w0, ev[p][i]);
                }
            }
        } else {
            __m512 d[MAX_PAIRS], m[MAX_PAIRS];
            _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) {
                d[p] = load_half16(blk[2 * p], blk[2 * p + 1]);
                m[p] = load_half16(blk[2 * p] + 16, blk[2 * p + 1] + 16);
            }
            int t = 0;
            for (; 2 * t + 1 < kn; t++) {
                _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) {
                    __m512 lo, hi;
                    deq4x2(blk[2 * p] + 32, blk[2 * p + 1] + 32, t, d[p], m[p], &lo, &hi);
                    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                        ev[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i][2 * t]), lo, ev[p][i]);
                        od[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i][2 * t + 1]), hi, od[p][i]);
                    }
                }
            }
            if (2 * t < kn) {
                _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) {
                    __m512 lo, hi;
                    deq4x2(blk[2 * p] + 32, blk[2 * p + 1] + 32, t, d[p], m[p], &lo, &hi);
                    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
                        ev[p][i] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i][2 * t]), lo, ev[p][i]);
                }
            }
        }
    }
    _Pragma("GCC unroll 2") for (int p = 0; p < NQ; p++) { /* pair p: columns [c0, c0 + 16) of the pass */
        const int c0 = 2 * p * PANEL;
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
            store_pair(ev[p][i], od[p][i], bias ? bias + c0 : NULL, r ? r[i] + c0 : NULL, y[i] + c0, cols - c0);
    }
}

AVX512 static void direct_dispatch512(int fmt, const float *const *x, int K, const uint8_t *w, size_t panel_bytes,
                                      int NQ, const float *bias, const float *const *r, float *const *y, int R,
                                      int cols) {
#define CASE(nq, n)                                                                                         \
    if (NQ == nq && R == n) {                                                                               \
        if (fmt == FMT_INT8) direct_pairs512(FMT_INT8, x, K, w, panel_bytes, nq, bias, r, y, n, cols);      \
        else direct_pairs512(FMT_INT4, x, K, w, panel_bytes, nq, bias, r, y, n, cols);                      \
        return;                                                                                             \
    }
    CASE(2, 1) CASE(2, 2) CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(1, 5) CASE(1, 6) CASE(1, 7) CASE(1, 8)
#undef CASE
}

/* Panels [p0, p1) for M <= REGISTER_ROWS rows, every row in one pass over each panel pair, up to the range's odd
 * last panel (the pair's second panel belongs to another thread, or does not exist): returns the first panel not
 * run (p1, or p1 - 1 for direct_range's AVX2 kernel). */
static int direct_range512(int fmt, const float *X, int ldx, const uint8_t *Wp, const float *bias, const float *R,
                           int ldr, float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    const size_t panel_bytes = (size_t)((K + GROUP - 1) / GROUP) * block_bytes(fmt);
    const float *x[REGISTER_ROWS], *r[REGISTER_ROWS];
    float *y[REGISTER_ROWS];
    const int pairs = M <= 2 ? 2 : 1; /* panel pairs per pass */
    int p = p0;
    for (int nq; p1 - p >= 2; p += 2 * nq) {
        nq = (p1 - p) / 2 < pairs ? (p1 - p) / 2 : pairs;
        const int n0 = p * PANEL;
        const int cols = N - n0 < 2 * nq * PANEL ? N - n0 : 2 * nq * PANEL;
        for (int i = 0; i < M; i++) {
            x[i] = X + (size_t)i * ldx;
            r[i] = R ? R + (size_t)i * ldr + n0 : NULL;
            y[i] = Y + (size_t)i * ldy + n0;
        }
        direct_dispatch512(fmt, x, K, Wp + p * panel_bytes, panel_bytes, nq, bias ? bias + n0 : NULL, R ? r : NULL,
                           y, M, cols);
    }
    return p;
}

/* ---------------- fp32 blocks: dequantized weights for the L1 direct path and the tile path ---------------- */

/* One block (kn <= 32 k of one panel) -> out[kk * 16 + c], kk < kn: 8 columns of a 16-wide row of fp32. */
static inline void dequant_block(int fmt, const uint8_t *blk, int kn, float *out) {
    if (fmt == FMT_INT8) {
        const __m256 d = load_half8(blk);
        for (int kk = 0; kk < kn; kk++) _mm256_storeu_ps(out + kk * 16, deq8(blk + 16, kk, d));
    } else {
        const __m256 d = load_half8(blk), m = load_half8(blk + 16);
        for (int t = 0; 2 * t < kn; t++) {
            __m256 lo, hi;
            deq4(blk + 32, t, d, m, &lo, &hi);
            _mm256_storeu_ps(out + 2 * t * 16, lo);
            if (2 * t + 1 < kn) _mm256_storeu_ps(out + (2 * t + 1) * 16, hi);
        }
    }
}

/* Panel p -> buf[k * 16 + half * 8 + c] for k < K (the same values the direct path computes). */
static void dequant_panel(int fmt, const uint8_t *w, int K, float *buf, int half) {
    const int bb = block_bytes(fmt), G = (K + GROUP - 1) / GROUP;
    for (int g = 0; g < G; g++) {
        const int k0 = g * GROUP, kn = K - k0 < GROUP ? K - k0 : GROUP;
        dequant_block(fmt, w + (size_t)g * bb, kn, buf + (size_t)k0 * 16 + half * PANEL);
    }
}

/* Row i's 16 (or `cols`) outputs: even + odd (+ bias) (+ r[i]) -> y[i]. */
static void store16(__m256 ev[2], __m256 od[2], const float *bias, const float *r, float *y, int cols) {
    for (int h = 0; h < 2 && h * PANEL < cols; h++) {
        const int c = cols - h * PANEL < PANEL ? cols - h * PANEL : PANEL;
        store8(ev[h], od[h], bias ? bias + h * PANEL : NULL, r ? r + h * PANEL : NULL, y + h * PANEL, c);
    }
}

/* ---------------- direct path, more rows: each block dequantized once, into L1 ---------------- */

#define BLOCK_ROWS 6 /* rows per register tile over an L1 block */
#define ACC_ROWS 48 /* rows whose running sums one pass over a panel pair keeps in L1; more take more passes */

/* One row's running sums over 16 columns: even k of columns 0-7, 8-15, then odd k of columns 0-7, 8-15. */
typedef float RowSums[4 * PANEL];

/* R rows (constant after inlining, <= BLOCK_ROWS) continue their sums over one block of wbuf (fp32 [kn][16]):
 * the even-k chains first, then the odd-k ones (each chain still in increasing k; the two are independent), so
 * only one chain's 2R accumulators are live: 6 rows x 16 columns take 8 loads (2 weights, 6 broadcasts) per
 * 12 FMAs, where both chains at once allow 3 rows (10 loads per 12 FMAs). */
static inline __attribute__((always_inline)) void block_rows(const float *const *x, int kn, const float *wbuf,
                                                             RowSums *acc, int R) {
    for (int c = 0; c < 2; c++) { /* c = 0: even k, sums at acc[i][0..16); 1: odd k, at acc[i][16..32) */
        __m256 s[BLOCK_ROWS][2];
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) for (int h = 0; h < 2; h++)
            s[i][h] = _mm256_loadu_ps(acc[i] + (2 * c + h) * PANEL);
        for (int k = c; k < kn; k += 2) {
            const __m256 w0 = _mm256_loadu_ps(wbuf + k * 16), w1 = _mm256_loadu_ps(wbuf + k * 16 + 8);
            _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
                const __m256 b = _mm256_broadcast_ss(x[i] + k);
                s[i][0] = _mm256_fmadd_ps(b, w0, s[i][0]), s[i][1] = _mm256_fmadd_ps(b, w1, s[i][1]);
            }
        }
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(acc[i] + (2 * c + h) * PANEL, s[i][h]);
    }
}

static void block_dispatch(const float *const *x, int kn, const float *wbuf, RowSums *acc, int R) {
    switch (R) {
    case 6: block_rows(x, kn, wbuf, acc, 6); break;
    case 5: block_rows(x, kn, wbuf, acc, 5); break;
    case 4: block_rows(x, kn, wbuf, acc, 4); break;
    case 3: block_rows(x, kn, wbuf, acc, 3); break;
    case 2: block_rows(x, kn, wbuf, acc, 2); break;
    default: block_rows(x, kn, wbuf, acc, 1);
    }
}

#define BLOCK_ROWS512 12 /* rows per AVX-512 register tile over an L1 block */
_Static_assert(BLOCK_ROWS512 >= BLOCK_ROWS, "direct_pair sizes its row pointers for either ISA's tile");

/* block_rows with one 16-lane register per row and chain (lanes = the block's 16 columns): the same FMAs in the
 * same order, bit for bit; 12 rows x 16 columns take 13 loads per 12 FMAs. */
AVX512 static inline __attribute__((always_inline)) void block_rows512(const float *const *x, int kn,
                                                                       const float *wbuf, RowSums *acc, int R) {
    for (int c = 0; c < 2; c++) { /* c = 0: even k, sums at acc[i][0..16); 1: odd k, at acc[i][16..32) */
        __m512 s[BLOCK_ROWS512];
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) s[i] = _mm512_loadu_ps(acc[i] + 2 * c * PANEL);
        for (int k = c; k < kn; k += 2) {
            const __m512 w = _mm512_loadu_ps(wbuf + k * 16);
            _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)
                s[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i][k]), w, s[i]);
        }
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) _mm512_storeu_ps(acc[i] + 2 * c * PANEL, s[i]);
    }
}

AVX512 static void block_dispatch512(const float *const *x, int kn, const float *wbuf, RowSums *acc, int R) {
    switch (R) {
    case 12: block_rows512(x, kn, wbuf, acc, 12); break;
    case 11: block_rows512(x, kn, wbuf, acc, 11); break;
    case 10: block_rows512(x, kn, wbuf, acc, 10); break;
    case 9: block_rows512(x, kn, wbuf, acc, 9); break;
    case 8: block_rows512(x, kn, wbuf, acc, 8); break;
    case 7: block_rows512(x, kn, wbuf, acc, 7); break;
    case 6: block_rows512(x, kn, wbuf, acc, 6); break;
    case 5: block_rows512(x, kn, wbuf, acc, 5); break;
    case 4: block_rows512(x, kn, wbuf, acc, 4); break;
    case 3: block_rows512(x, kn, wbuf, acc, 3); break;
    case 2: block_rows512(x, kn, wbuf, acc, 2); break;
    default: block_rows512(x, kn, wbuf, acc, 1);
    }
}

/* Rows [0, M) x one panel pair (np = 1 or 2 panels at w; its first `cols` columns exist): per group, the pair's
 * block is dequantized into wbuf (2 KB) once, then every row runs over it in register tiles of up to BLOCK_ROWS
 * rows (block_rows), their sums kept between blocks in acc. bias, R, Y: at the pair's first column. */
static void direct_pair(int fmt, const float *X, int ldx, const uint8_t *w, size_t panel_bytes, int np,
                        const float *bias, const float *R, int ldr, float *Y, int ldy, int M, int K, int cols) {
    float wbuf[GROUP * 2 * PANEL] __attribute__((aligned(32)));
    RowSums acc[ACC_ROWS] __attribute__((aligned(32)));
    const int bb = block_bytes(fmt), G = (K + GROUP - 1) / GROUP;
    const int avx512 = use_avx512(), tile_rows = avx512 ? BLOCK_ROWS512 : BLOCK_ROWS;
    if (np == 1) /* no second panel: its 8 columns of wbuf stay zero (computed, never stored) */
        for (int kk = 0; kk < GROUP; kk++) memset(wbuf + kk * 2 * PANEL + PANEL, 0, PANEL * sizeof(float));
    for (int m0 = 0; m0 < M; m0 += ACC_ROWS) {
        const int rows = M - m0 < ACC_ROWS ? M - m0 : ACC_ROWS;
        memset(acc, 0, sizeof(RowSums) * rows);
        for (int g = 0; g < G; g++) {
            const int k0 = g * GROUP, kn = K - k0 < GROUP ? K - k0 : GROUP;
            for (int p = 0; p < np; p++) {
                const uint8_t *blk = w + p * panel_bytes + (size_t)g * bb;
                const char *ahead = (const char *)blk + PREFETCH_BYTES;
                for (int off = 0; off < bb; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
                dequant_block(fmt, blk, kn, wbuf + p * PANEL);
            }
            for (int i0 = 0, nr; i0 < rows; i0 += nr) {
                const int left = rows - i0, tiles = (left + tile_rows - 1) / tile_rows;
                nr = (left + tiles - 1) / tiles; /* balanced: (AVX2) 8 rows as 4 + 4, 16 as 6 + 5 + 5 */
                const float *x[BLOCK_ROWS512];
                for (int i = 0; i < nr; i++) x[i] = X + (size_t)(m0 + i0 + i) * ldx + k0;
                if (avx512) block_dispatch512(x, kn, wbuf, acc + i0, nr);
                else block_dispatch(x, kn, wbuf, acc + i0, nr);
            }
        }
        for (int i = 0; i < rows; i++) {
            __m256 ev[2] = {_mm256_loadu_ps(acc[i]), _mm256_loadu_ps(acc[i] + PANEL)};
            __m256 od[2] = {_mm256_loadu_ps(acc[i] + 2 * PANEL), _mm256_loadu_ps(acc[i] + 3 * PANEL)};
            const size_t m = (size_t)(m0 + i);
            store16(ev, od, bias, R ? R + m * ldr : NULL, Y + m * ldy, cols);
        }
    }
}

/* Panels [p0, p1) of Y = X W^T (+ bias) (+ R) for M rows: the register path up to REGISTER_ROWS rows, else the
 * L1 path over panel pairs (p0, p0 + 1), ... (identical results). decode_step.c calls this for its linears. */
static void direct_range(int fmt, const float *X, int ldx, const uint8_t *Wp, const float *bias, const float *R,
                         int ldr, float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    const size_t panel_bytes = (size_t)((K + GROUP - 1) / GROUP) * block_bytes(fmt);
    if (M <= REGISTER_ROWS && use_avx512()) /* panel pairs; a last odd panel continues below */
        p0 = direct_range512(fmt, X, ldx, Wp, bias, R, ldr, Y, ldy, M, K, N, p0, p1);
    if (M > REGISTER_ROWS) {
        for (int p = p0; p < p1; p += 2) {
            const int np = p1 - p < 2 ? p1 - p : 2, n0 = p * PANEL, cols = N - n0 < np * PANEL ? N - n0 : np * PANEL;
            direct_pair(fmt, X, ldx, Wp + p * panel_bytes, panel_bytes, np, bias ? bias + n0 : NULL,
                        R ? R + n0 : NULL, ldr, Y + n0, ldy, M, K, cols);
        }
        return;
    }
    const int step = M <= 2 ? 2 : 1; /* panels per pass */
    for (int p = p0; p < p1; p += step) {
        const int np = p1 - p < step ? p1 - p : step;
        const int n0 = p * PANEL, last0 = n0 + (np - 1) * PANEL;
        const int cols_last = N - last0 < PANEL ? N - last0 : PANEL;
        for (int m0 = 0; m0 < M; m0 += DIRECT_ROWS) {
            const int rows = M - m0 < DIRECT_ROWS ? M - m0 : DIRECT_ROWS;
            const float *x[DIRECT_ROWS], *r[DIRECT_ROWS];
            float *y[DIRECT_ROWS];
            for (int i = 0; i < rows; i++) {
                x[i] = X + (size_t)(m0 + i) * ldx;
                r[i] = R ? R + (size_t)(m0 + i) * ldr + n0 : NULL;
                y[i] = Y + (size_t)(m0 + i) * ldy + n0;
            }
            direct_dispatch(fmt, x, K, Wp + p * panel_bytes, panel_bytes, np, bias ? bias + n0 : NULL, R ? r : NULL,
                            y, rows, cols_last);
        }
    }
}

/* ---------------- tile path: dequantize a panel pair into L2, fp32 register tiles ---------------- */

/* TILE_ROWS rows x 16 columns over all K from buf; rows past `rows` alias the last real row. */
static void tile_kernel(const float *const *x, int K, const float *buf, const float *bias, const float *const *r,
                        float *const *y, int rows, int cols) {
    __m256 e00 = _mm256_setzero_ps(), e01 = e00, e10 = e00, e11 = e00, e20 = e00, e21 = e00;
    __m256 o00 = e00, o01 = e00, o10 = e00, o11 = e00, o20 = e00, o21 = e00;
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2];
    int k = 0;
    for (; k + 1 < K; k += 2) {
        const float *b = buf + (size_t)k * 16;
        __m256 w0 = _mm256_loadu_ps(b), w1 = _mm256_loadu_ps(b + 8);
        __m256 v0 = _mm256_loadu_ps(b + 16), v1 = _mm256_loadu_ps(b + 24);
        __m256 s;
        s = _mm256_broadcast_ss(x0 + k), e00 = _mm256_fmadd_ps(s, w0, e00), e01 = _mm256_fmadd_ps(s, w1, e01);
        s = _mm256_broadcast_ss(x1 + k), e10 = _mm256_fmadd_ps(s, w0, e10), e11 = _mm256_fmadd_ps(s, w1, e11);
        s = _mm256_broadcast_ss(x2 + k), e20 = _mm256_fmadd_ps(s, w0, e20), e21 = _mm256_fmadd_ps(s, w1, e21);
        s = _mm256_broadcast_ss(x0 + k + 1), o00 = _mm256_fmadd_ps(s, v0, o00), o01 = _mm256_fmadd_ps(s, v1, o01);
        s = _mm256_broadcast_ss(x1 + k + 1), o10 = _mm256_fmadd_ps(s, v0, o10), o11 = _mm256_fmadd_ps(s, v1, o11);
        s = _mm256_broadcast_ss(x2 + k + 1), o20 = _mm256_fmadd_ps(s, v0, o20), o21 = _mm256_fmadd_ps(s, v1, o21);
    }
    if (k < K) {
        const float *b = buf + (size_t)k * 16;
        __m256 w0 = _mm256_loadu_ps(b), w1 = _mm256_loadu_ps(b + 8), s;
        s = _mm256_broadcast_ss(x0 + k), e00 = _mm256_fmadd_ps(s, w0, e00), e01 = _mm256_fmadd_ps(s, w1, e01);
        s = _mm256_broadcast_ss(x1 + k), e10 = _mm256_fmadd_ps(s, w0, e10), e11 = _mm256_fmadd_ps(s, w1, e11);
        s = _mm256_broadcast_ss(x2 + k), e20 = _mm256_fmadd_ps(s, w0, e20), e21 = _mm256_fmadd_ps(s, w1, e21);
    }
    __m256 ev[TILE_ROWS][2] = {{e00, e01}, {e10, e11}, {e20, e21}};
    __m256 od[TILE_ROWS][2] = {{o00, o01}, {o10, o11}, {o20, o21}};
    for (int i = 0; i < rows; i++) store16(ev[i], od[i], bias, r ? r[i] : NULL, y[i], cols);
}

#define TILE_ROWS512 12 /* rows per AVX-512 register tile of the tile path */
_Static_assert(TILE_ROWS512 >= TILE_ROWS, "tile_range sizes its row pointers for either ISA's tile");

/* tile_kernel with one 16-lane register per row and chain: TILE_ROWS512 rows x 16 columns, the same FMAs in the
 * same order (bit for bit); rows past `rows` alias the last real row. */
AVX512 static void tile_kernel512(const float *const *x, int K, const float *buf, const float *bias,
                                  const float *const *r, float *const *y, int rows, int cols) {
    __m512 ev[TILE_ROWS512], od[TILE_ROWS512];
    _Pragma("GCC unroll 12") for (int i = 0; i < TILE_ROWS512; i++) ev[i] = od[i] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 1 < K; k += 2) {
        const __m512 w0 = _mm512_loadu_ps(buf + (size_t)k * 16), w1 = _mm512_loadu_ps(buf + (size_t)(k + 1) * 16);
        _Pragma("GCC unroll 12") for (int i = 0; i < TILE_ROWS512; i++) {
            ev[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i][k]), w0, ev[i]);
            od[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i][k + 1]), w1, od[i]);
        }
    }
    if (k < K) {
        const __m512 w0 = _mm512_loadu_ps(buf + (size_t)k * 16);
        _Pragma("GCC unroll 12") for (int i = 0; i < TILE_ROWS512; i++)
            ev[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i][k]), w0, ev[i]);
    }
    for (int i = 0; i < rows; i++) store_pair(ev[i], od[i], bias, r ? r[i] : NULL, y[i], cols);
}

static void tile_range(int fmt, const float *X, int ldx, const uint8_t *Wp, const float *bias, const float *R,
                       int ldr, float *Y, int ldy, int M, int K, int N, int q0, int q1, float *buf) {
    const int npanels = (N + PANEL - 1) / PANEL;
    const size_t panel_bytes = (size_t)((K + GROUP - 1) / GROUP) * block_bytes(fmt);
    const int avx512 = use_avx512(), tile_rows = avx512 ? TILE_ROWS512 : TILE_ROWS;
    for (int q = q0; q < q1; q++) { /* panel pair q: panels 2q and 2q + 1 */
        const int n0 = q * 2 * PANEL, cols = N - n0 < 2 * PANEL ? N - n0 : 2 * PANEL;
        dequant_panel(fmt, Wp + (size_t)(2 * q) * panel_bytes, K, buf, 0);
        if (2 * q + 1 < npanels) dequant_panel(fmt, Wp + (size_t)(2 * q + 1) * panel_bytes, K, buf, 1);
        else for (int k = 0; k < K; k++) memset(buf + (size_t)k * 16 + PANEL, 0, PANEL * sizeof(float));
        for (int m0 = 0; m0 < M; m0 += tile_rows) {
            const int rows = M - m0 < tile_rows ? M - m0 : tile_rows;
            const float *x[TILE_ROWS512], *r[TILE_ROWS512];
            float *y[TILE_ROWS512];
            for (int i = 0; i < tile_rows; i++) {
                int m = m0 + (i < rows ? i : rows - 1);
                x[i] = X + (size_t)m * ldx;
                r[i] = R ? R + (size_t)m * ldr + n0 : NULL;
                y[i] = Y + (size_t)m * ldy + n0;
            }
            if (avx512) tile_kernel512(x, K, buf, bias ? bias + n0 : NULL, R ? r : NULL, y, rows, cols);
            else tile_kernel(x, K, buf, bias ? bias + n0 : NULL, R ? r : NULL, y, rows, cols);
        }
    }
}

/* ---------------- entry point ---------------- */

/* Y = X @ W^T (+ bias) (+ R) for W packed in format fmt (0 int8, 1 int4); bias and R may be NULL.
 * M <= direct_rows takes the direct path, larger M the tile path (identical results).
 * Returns 0, or -1 when a tile buffer could not be allocated (Y is then incomplete). */
int quant_gemm(int fmt, const float *X, int ldx, const uint8_t *Wp, const float *bias, const float *R, int ldr,
               float *Y, int ldy, int M, int K, int N, int nthreads, int direct_rows) {
    const int npanels = (N + PANEL - 1) / PANEL;
    const int direct = M <= direct_rows;
    const int units = direct ? npanels : (npanels + 1) / 2;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = units;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int u0 = (int)((long)units * t / nt), u1 = (int)((long)units * (t + 1) / nt);
        if (direct) {
            direct_range(fmt, X, ldx, Wp, bias, R, ldr, Y, ldy, M, K, N, u0, u1);
        } else {
            float *buf = aligned_alloc(64, ((size_t)K * 16 * sizeof(float) + 63) / 64 * 64);
            if (buf == NULL) failed = 1;
            else tile_range(fmt, X, ldx, Wp, bias, R, ldr, Y, ldy, M, K, N, u0, u1, buf);
            free(buf);
        }
    }
    return failed ? -1 : 0;
}
