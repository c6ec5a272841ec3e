/* Quantized linears by integer dot products: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]) (+ R[M, N]), with X
 * quantized per 32-group to int8 first, as llama.cpp quantizes its activations (Q8_0 / Q8_1 blocks).
 *
 * Why: quant_gemm.c multiplies fp32 activations by weights dequantized to fp32, one FMA per weight and row (16
 * multiply-adds an instruction with AVX-512). Here a weight stays an integer: VNNI's vpdpbusd does 64 u8 x s8
 * multiply-adds an instruction (4 per 32-bit lane), so a batch's linears do ~4x fewer instructions per weight.
 * The cost is the activations' rounding to 8 bits (int_dot.py has the perplexity and speed figures): this path is
 * NOT bit-exact against HF; the fp32-activation path (quant_gemm.c) stays the exact one.
 *
 * Weights: quant_gemm.c's packed layouts, read as they are (int_dot.py says which GGUF types they hold):
 *   int8 block (272 bytes): d[8] fp16 | q[32 k][8 cols] int8           w = q d
 *   int4 block (160 bytes): d[8] fp16 | m[8] fp16 | byte[16 t][8 cols]  w = q d + m, q[2t] | q[2t+1] << 4
 * panels of 8 output columns, each a run of G = ceil(K / 32) blocks.
 *
 * Activations: row x, group g (32 k, the last zero-padded): a = max |x_k|, dx = a / 127, q_k = round(x_k 127 / a)
 * (nearest, ties to even: the vector rounding), all 0 when a = 0; s = sum q_k (int). Then per output n:
 *   int8: y = sum_g dx_g d_gn S_gn                    S = sum_k q_k w_k (exact, int32)
 *   int4: y = sum_g dx_g d_gn S_gn + m_gn (s_g dx_g)  S = sum_k q_k x_k, w in 0..15
 * in fp32, group by group in increasing g: y = fma(float(S), d dx, y) (int4: first y = fma(m, s dx, y)); then
 * y (+ bias) (+ r). S is exact and the order is fixed, so results do not depend on M, the thread count, the path
 * or the ISA (every ISA computes the same S and the same fp32 operations). tests/test_int_dot.py checks this
 * against a float64 evaluation of the same quantized math.
 *
 * Kernels (chosen when the library loads, ``int_dot_isa``; a call reads the choice once):
 *   avx512vnni (AVX-512 VNNI + VBMI + BW): a panel pair = 16 columns per 512-bit register. Per group, each of
 *     its 8 k-quads becomes a register of 16 columns x 4 k (vpermt2b reorders the block's [k][col] bytes; int8
 *     is offset by 128 to u8, and S starts at -128 s); one vpdpbusd per k-quad and row, x's 4 bytes broadcast.
 *   avxvnni (AVX-VNNI, 256-bit vpdpbusd): the same per panel, 8 columns a register (vpermd + vpshufb reorder).
 *   avx2 (vpmaddubsw): u8 x s8 pairs to int16, vpmaddwd to int32, as llama.cpp's AVX2 path; int8 weights take
 *     the sign trick (|w| as u8 times x with w's sign: no int16 overflow, as |w| <= 128, |q| <= 127).
 * Up to 8 rows the prepared weights stay in registers and every row's sums live in registers over all of K; more
 * rows prepare a panel (pair) once into a per-thread buffer and run it in tiles of 8 rows.
 *
 * Built by int_dot.py on its own (tests, and its entry int_dot_gemm) and included by decode_step.c, whose linears
 * call int_dot_linear for the formats and row counts int_dot_set_rows enables.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ID_PANEL 8
#define ID_GROUP 32
#define ID_TILE 8 /* rows per register tile */
enum { ID_INT8 = 0, ID_INT4 = 1 };
enum { ISA_AVX2 = 0, ISA_AVXVNNI = 1, ISA_AVX512VNNI = 2 };

#define ID_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))
#define ID_VNNI __attribute__((target("avxvnni,avx2,fma,f16c")))

static inline int id_block_bytes(int fmt) { return fmt == ID_INT8 ? 16 + ID_GROUP * ID_PANEL : 32 + ID_GROUP * ID_PANEL / 2; }

/* ---------------- ISA choice and the per-format switch ---------------- */

static int id_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avxvnni")) return ISA_AVXVNNI;
    return ISA_AVX2;
}

static int id_isa = -1; /* set when the library loads; read atomically */
static int id_rows[2] = {0, 0}; /* per format: calls of at least this many rows take this path; 0: never */

__attribute__((constructor)) static void id_pick_isa(void) { __atomic_store_n(&id_isa, id_best_isa(), __ATOMIC_RELAXED); }

/* want < 0: report; else use ISA `want` (0 avx2, 1 avxvnni, 2 avx512vnni), or the best one the CPU has below it.
 * Returns the ISA now in use. */
int int_dot_isa(int want) {
    if (want >= 0) {
        const int best = id_best_isa();
        int isa = want < best ? want : best;
        if (isa == ISA_AVXVNNI && !__builtin_cpu_supports("avxvnni")) isa = ISA_AVX2; /* AVX-512 VNNI, no AVX-VNNI */
        __atomic_store_n(&id_isa, isa, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&id_isa, __ATOMIC_RELAXED);
}

/* Calls of format fmt with at least min_rows rows take this path (min_rows <= 0: none). Returns the old value. */
int int_dot_set_rows(int fmt, int min_rows) {
    if (fmt < 0 || fmt > 1) return -1;
    return __atomic_exchange_n(&id_rows[fmt], min_rows > 0 ? min_rows : 0, __ATOMIC_RELAXED);
}

static inline int int_dot_wants(int fmt, int M) {
    if (fmt < 0 || fmt > 1) return 0;
    const int rows = __atomic_load_n(&id_rows[fmt], __ATOMIC_RELAXED);
    return rows > 0 && M >= rows;
}

/* ---------------- activations ---------------- */

/* The quantized rows of X: q [M][G * 32] int8, d [M][G] (dx), sd [M][G] (s dx), s [M][G]. */
typedef struct {
    int8_t *q;
    float *d, *sd;
    int32_t *s;
    int G;
} QRows;

/* One row's groups (scalar: the same bits as any vector form; the rounding is nearest-even, rintf). */
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *sd, int32_t *s) {
    const int G = (K + ID_GROUP - 1) / ID_GROUP;
    for (int g = 0; g < G; g++) {
        const int k0 = g * ID_GROUP, kn = K - k0 < ID_GROUP ? K - k0 : ID_GROUP;
        float a = 0.0f;
        for (int k = 0; k < kn; k++) {
            const float v = x[k0 + k] < 0 ? -x[k0 + k] : x[k0 + k];
            a = v > a ? v : a;
        }
        const float dx = a / 127.0f, inv = a != 0.0f ? 127.0f / a : 0.0f;
        int32_t sum = 0;
        for (int k = 0; k < ID_GROUP; k++) {
            int v = 0;
            if (k < kn) v = (int)__builtin_rintf(x[k0 + k] * inv);
            q[k0 + k] = (int8_t)v;
            sum += v;
        }
        d[g] = dx;
        s[g] = sum;
        sd[g] = (float)sum * dx;
    }
}

/* Bytes of a QRows of M rows of K. */
static size_t qrows_bytes(int M, int K) {
    const size_t G = (size_t)(K + ID_GROUP - 1) / ID_GROUP;
    return (size_t)M * G * (ID_GROUP + 3 * sizeof(float)) + 64;
}

static QRows qrows_carve(void *mem, int M, int K) {
    QRows r;
    r.G = (K + ID_GROUP - 1) / ID_GROUP;
    const size_t n = (size_t)M * r.G;
    r.q = (int8_t *)mem;
    r.d = (float *)(r.q + n * ID_GROUP);
    r.sd = r.d + n;
    r.s = (int32_t *)(r.sd + n);
    return r;
}

static void quantize_rows(const float *X, int ldx, int M, int K, QRows *r) {
    for (int i = 0; i < M; i++)
        quantize_row(X + (size_t)i * ldx, K, r->q + (size_t)i * r->G * ID_GROUP, r->d + (size_t)i * r->G,
                     r->sd + (size_t)i * r->G, r->s + (size_t)i * r->G);
}

/* For tests: X's quantized rows into q [M][G*32], d [M][G], s [M][G]. */
void int_dot_quantize(const float *X, int ldx, int M, int K, int8_t *q, float *d, int32_t *s) {
    const int G = (K + ID_GROUP - 1) / ID_GROUP;
    float *sd = malloc(sizeof(float) * (size_t)M * G + 1);
    for (int i = 0; i < M; i++)
        quantize_row(X + (size_t)i * ldx, K, q + (size_t)i * G * ID_GROUP, d + (size_t)i * G, sd + (size_t)i * G,
                     s + (size_t)i * G);
    free(sd);
}

/* A per-thread scratch buffer that grows (OpenMP's pool threads keep theirs between calls). */
typedef struct {
    void *p;
    size_t n;
} Scratch_;

static void *scratch_get(Scratch_ *s, size_t n) {
    if (n > s->n) {
        free(s->p);
        s->p = aligned_alloc(64, (n + 63) / 64 * 64);
        s->n = s->p ? n : 0;
    }
    return s->p;
}

static __thread Scratch_ id_act_scratch, id_w_scratch;

/* y[0..cols) = acc (+ bias) (+ r), in that order. */
static inline void id_store(const float *acc, const float *bias, const float *r, float *y, int cols) {
    for (int j = 0; j < cols; j++) {
        float v = acc[j];
        if (bias) v += bias[j];
        if (r) v += r[j];
        y[j] = v;
    }
}

/* ================ AVX-512 VNNI: a panel pair per register ================ */

/* vpermt2b indices: output byte 4j + k of a register is column j (0-7 panel a, 8-15 panel b) at k of a k-quad.
 * int8: source a / b = 64 bytes = 8 k-rows x 8 columns of each panel; quad h (0, 1) of them. */
ID_512 static inline __m512i idx_int8(int h) {
    uint8_t t[64];
    for (int j = 0; j < 16; j++)
        for (int k = 0; k < 4; k++) t[4 * j + k] = (uint8_t)((j < 8 ? 0 : 64) + (4 * h + k) * 8 + (j & 7));
    return _mm512_loadu_si512(t);
}

/* int4: source = [panel a's 4 t-rows x 8 | panel b's] as low nibbles (first operand) and high nibbles (second);
 * quad h covers t-rows 2h, 2h + 1: k = 0, 1 from t 2h (lo, hi), k = 2, 3 from t 2h + 1. */
ID_512 static inline __m512i idx_int4(int h) {
    uint8_t t[64];
    for (int j = 0; j < 16; j++)
        for (int k = 0; k < 4; k++)
            t[4 * j + k] = (uint8_t)((j < 8 ? 0 : 32) + (2 * h + (k >> 1)) * 8 + (j & 7) + (k & 1 ? 64 : 0));
    return _mm512_loadu_si512(t);
}

/* The 8 k-quad registers of group g of a panel pair (b NULL: no second panel, its columns zero), and its d (m). */
ID_512 static inline void prep512(int fmt, const uint8_t *a, const uint8_t *b, __m512i w[8], __m512 *d, __m512 *m,
                                  __m512i i0, __m512i i1) {
    if (fmt == ID_INT8) {
        const __m512i off = _mm512_set1_epi8((char)0x80);
        for (int i = 0; i < 4; i++) {
            const __m512i va = _mm512_loadu_si512(a + 16 + 64 * i);
            const __m512i vb = b ? _mm512_loadu_si512(b + 16 + 64 * i) : _mm512_setzero_si512();
            w[2 * i] = _mm512_xor_si512(_mm512_permutex2var_epi8(va, i0, vb), off);
            w[2 * i + 1] = _mm512_xor_si512(_mm512_permutex2var_epi8(va, i1, vb), off);
        }
        *m = _mm512_setzero_ps();
    } else {
        const __m512i lo4 = _mm512_set1_epi8(15);
        for (int i = 0; i < 4; i++) {
            const __m256i ha = _mm256_loadu_si256((const __m256i *)(a + 32 + 32 * i));
            const __m256i hb = b ? _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * i)) : _mm256_setzero_si256();
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(ha), hb, 1);
            const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            w[2 * i] = _mm512_permutex2var_epi8(lo, i0, hi);
            w[2 * i + 1] = _mm512_permutex2var_epi8(lo, i1, hi);
        }
        const __m128i mh = _mm_loadu_si128((const __m128i *)(a + 16));
        const __m128i mb = b ? _mm_loadu_si128((const __m128i *)(b + 16)) : _mm_setzero_si128();
        *m = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(mh), mb, 1));
    }
    const __m128i da = _mm_loadu_si128((const __m128i *)a);
    const __m128i db = b ? _mm_loadu_si128((const __m128i *)b) : _mm_setzero_si128();
    *d = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(da), db, 1));
}

/* R rows (constant after inlining) x group g: acc[i] += the group's contribution (see the header). */
ID_512 static inline __attribute__((always_inline)) void rows512(int fmt, const QRows *x, int m0, int g,
                                                                 const __m512i w[8], __m512 d, __m512 m,
                                                                 __m512 *acc, int R) {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
        const size_t at = (size_t)(m0 + i) * x->G + g;
        const int32_t *xq = (const int32_t *)(x->q + at * ID_GROUP);
        __m512i s0 = fmt == ID_INT8 ? _mm512_set1_epi32(-128 * x->s[at]) : _mm512_setzero_si512();
        __m512i s1 = _mm512_setzero_si512();
        s0 = _mm512_dpbusd_epi32(s0, w[0], _mm512_set1_epi32(xq[0]));
        s1 = _mm512_dpbusd_epi32(s1, w[1], _mm512_set1_epi32(xq[1]));
        s0 = _mm512_dpbusd_epi32(s0, w[2], _mm512_set1_epi32(xq[2]));
        s1 = _mm512_dpbusd_epi32(s1, w[3], _mm512_set1_epi32(xq[3]));
        s0 = _mm512_dpbusd_epi32(s0, w[4], _mm512_set1_epi32(xq[4]));
        s1 = _mm512_dpbusd_epi32(s1, w[5], _mm512_set1_epi32(xq[5]));
        s0 = _mm512_dpbusd_epi32(s0, w[6], _mm512_set1_epi32(xq[6]));
        s1 = _mm512_dpbusd_epi32(s1, w[7], _mm512_set1_epi32(xq[7]));
        const __m512 S = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        __m512 y = acc[i];
        if (fmt == ID_INT4) y = _mm512_fmadd_ps(m, _mm512_set1_ps(x->sd[at]), y);
        acc[i] = _mm512_fmadd_ps(S, _mm512_mul_ps(d, _mm512_set1_ps(x->d[at])), y);
    }
}

ID_512 static inline void store512(const __m512 *acc, int R, const float *bias, const float *Rr, int ldr, float *Y,
                                   int ldy, int m0, int cols) {
    float tmp[16];
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(tmp, acc[i]);
        const size_t m = (size_t)(m0 + i);
        id_store(tmp, bias, Rr ? Rr + m * ldr : NULL, Y + m * ldy, cols);
    }
}

/* Up to ID_TILE rows over one panel pair, weights prepared group by group in registers. */
ID_512 static inline __attribute__((always_inline)) void pair_rows512(int fmt, const QRows *x, int m0, int R,
                                                                      const uint8_t *a, const uint8_t *b, int G,
                                                                      int bb, __m512 *acc) {
    const __m512i i0 = fmt == ID_INT8 ? idx_int8(0) : idx_int4(0), i1 = fmt == ID_INT8 ? idx_int8(1) : idx_int4(1);
    for (int g = 0; g < G; g++) {
        __m512i w[8];
        __m512 d, m;
        const uint8_t *ba = a + (size_t)g * bb, *bq = b ? b + (size_t)g * bb : NULL;
        _mm_prefetch((const char *)ba + 2048, _MM_HINT_T0);
        prep512(fmt, ba, bq, w, &d, &m, i0, i1);
        rows512(fmt, x, m0, g, w, d, m, acc, R);
    }
}

/* Prepared weights of a whole panel pair (more than ID_TILE rows): per group 8 registers, then d and m. */
typedef struct {
    __m512i w[8];
    __m512 d, m;
} Prep512;

ID_512 static void pair512(int fmt, const QRows *x, int M, const uint8_t *a, const uint8_t *b, int G, int bb,
                           const float *bias, const float *Rr, int ldr, float *Y, int ldy, int cols) {
    __m512 acc[ID_TILE];
#define TILE(R)                                                                                              \
    case R:                                                                                                  \
        if (fmt == ID_INT8) pair_rows512(ID_INT8, x, m0, R, a, b, G, bb, acc);                               \
        else pair_rows512(ID_INT4, x, m0, R, a, b, G, bb, acc);                                              \
        break;
    if (M <= ID_TILE) {
        const int m0 = 0;
        for (int i = 0; i < M; i++) acc[i] = _mm512_setzero_ps();
        switch (M) { TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) }
        store512(acc, M, bias, Rr, ldr, Y, ldy, 0, cols);
        return;
    }
#undef TILE
    Prep512 *prep = scratch_get(&id_w_scratch, sizeof(Prep512) * (size_t)G);
    if (!prep) return; /* cannot happen for any K a model has (G * 640 bytes); Y is left as it was */
    const __m512i i0 = fmt == ID_INT8 ? idx_int8(0) : idx_int4(0), i1 = fmt == ID_INT8 ? idx_int8(1) : idx_int4(1);
    for (int g = 0; g < G; g++)
        prep512(fmt, a + (size_t)g * bb, b ? b + (size_t)g * bb : NULL, prep[g].w, &prep[g].d, &prep[g].m, i0, i1);
    for (int m0 = 0; m0 < M; m0 += ID_TILE) {
        const int R = M - m0 < ID_TILE ? M - m0 : ID_TILE;
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
#define TILE(R)                                                                                              \
    case R:                                                                                                  \
        for (int g = 0; g < G; g++) {                                                                        \
            if (fmt == ID_INT8) rows512(ID_INT8, x, m0, g, prep[g].w, prep[g].d, prep[g].m, acc, R);         \
            else rows512(ID_INT4, x, m0, g, prep[g].w, prep[g].d, prep[g].m, acc, R);                        \
        }                                                                                                    \
        break;
        switch (R) { TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) }
#undef TILE
        store512(acc, R, bias, Rr, ldr, Y, ldy, m0, cols);
    }
}

ID_512 static void range512(int fmt, const QRows *x, const uint8_t *Wp, const float *bias, const float *Rr, int ldr,
                            float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    const int bb = id_block_bytes(fmt), G = (K + ID_GROUP - 1) / ID_GROUP;
    const size_t panel_bytes = (size_t)G * bb;
    for (int p = p0; p < p1; p += 2) {
        const int np = p + 1 < p1 ? 2 : 1, n0 = p * ID_PANEL; /* one panel: the next is another thread's, or none */
        const int cols = N - n0 < np * ID_PANEL ? N - n0 : np * ID_PANEL;
        const uint8_t *a = Wp + (size_t)p * panel_bytes, *b = np == 2 ? a + panel_bytes : NULL;
        pair512(fmt, x, M, a, b, G, bb, bias ? bias + n0 : NULL, Rr ? Rr + n0 : NULL, ldr, Y + n0, ldy,
                cols < 0 ? 0 : cols);
    }
}

/* ================ 256-bit: a panel per register (AVX-VNNI, or AVX2 maddubs) ================ */

/* The 8 k-quads of one block as [col][4 k] bytes (32 per quad), and for AVX2 int8 also |w| (u8) per quad. */
static inline void prep256(int fmt, const uint8_t *blk, __m256i w[8]) {
    if (fmt == ID_INT8) {
        /* rows k of 8 bytes: [k0 | k1 | k2 | k3] -> dwords (k, half) reordered so each 128-bit lane holds the same
         * 4 columns of k0..k3, then a 4x4 byte transpose per lane. */
        const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        const __m256i tr = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5,
                                            9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        for (int j = 0; j < 8; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
            w[j] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v, perm), tr);
        }
    } else {
        const __m256i lo4 = _mm256_set1_epi8(15);
        for (int i = 0; i < 4; i++) { /* t-rows 4i..4i+3: lanes [t0 t1 | t2 t3] -> quads 2i, 2i + 1 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * i));
            const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            const __m256i a = _mm256_unpacklo_epi8(lo, hi); /* lane 0: t0's columns (lo, hi); lane 1: t2's */
            const __m256i b = _mm256_unpackhi_epi8(lo, hi); /* t1's; t3's */
            const __m256i c = _mm256_unpacklo_epi16(a, b);  /* cols 0-3 of quad 2i | of quad 2i + 1 */
            const __m256i e = _mm256_unpackhi_epi16(a, b);  /* cols 4-7 */
            w[2 * i] = _mm256_permute2x128_si256(c, e, 0x20);
            w[2 * i + 1] = _mm256_permute2x128_si256(c, e, 0x31);
        }
    }
}

static inline __m256 load_h8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One dot-product step: s += sum over each lane's 4 (u8 w, s8 x) pairs. */
ID_VNNI static inline __m256i dot_vnni(__m256i s, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(s, w, x); }

static inline __m256i dot_avx2(__m256i s, __m256i w, __m256i x) {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* R rows x one block; vnni: the AVX-VNNI step (weights offset by 128 for int8), else maddubs (int8: w = |w|, the
 * sign moved onto x). */
#define ROWS256(NAME, ATTR, DOT, VNNI)                                                                            \
    ATTR static inline __attribute__((always_inline)) void NAME(int fmt, const QRows *x, int m0, int g,          \
                                                                const __m256i w[8], const __m256i sgn[8],        \
                                                                __m256 d, __m256 m, __m256 *acc, int R) {        \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                    \
            const size_t at = (size_t)(m0 + i) * x->G + g;                                                       \
            const int32_t *xq = (const int32_t *)(x->q + at * ID_GROUP);                                         \
            __m256i s0 = VNNI && fmt == ID_INT8 ? _mm256_set1_epi32(-128 * x->s[at]) : _mm256_setzero_si256();   \
            __m256i s1 = _mm256_setzero_si256();                                                                 \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j += 2) {                                             \
                __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 1]);                        \
                if (!VNNI && fmt == ID_INT8) x0 = _mm256_sign_epi8(x0, sgn[j]), x1 = _mm256_sign_epi8(x1, sgn[j + 1]); \
                s0 = DOT(s0, w[j], x0);                                                                          \
                s1 = DOT(s1, w[j + 1], x1);                                                                      \
            }                                                                                                    \
            const __m256 S = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));                                       \
            __m256 y = acc[i];                                                                                   \
            if (fmt == ID_INT4) y = _mm256_fmadd_ps(m, _mm256_set1_ps(x->sd[at]), y);                            \
            acc[i] = _mm256_fmadd_ps(S, _mm256_mul_ps(d, _mm256_set1_ps(x->d[at])), y);                          \
        }                                                                                                        \
    }

ROWS256(rows_vnni, ID_VNNI, dot_vnni, 1)
ROWS256(rows_avx2, , dot_avx2, 0)
#undef ROWS256

/* The block's prepared registers for the chosen step: VNNI int8 offsets the weights to u8; AVX2 int8 keeps the
 * signed weights for the sign and multiplies their magnitudes. */
static inline void prep_step(int fmt, int vnni, const uint8_t *blk, __m256i w[8], __m256i sgn[8]) {
    prep256(fmt, blk, w);
    if (fmt != ID_INT8) return;
    for (int j = 0; j < 8; j++) {
        if (vnni) {
            w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8((char)0x80));
        } else {
            sgn[j] = w[j];
            w[j] = _mm256_abs_epi8(w[j]);
        }
    }
}

typedef struct {
    __m256i w[8], sgn[8];
    __m256 d, m;
} Prep256;

#define PANEL256(NAME, ATTR, ROWS, VNNI)                                                                          \
    ATTR static void NAME(int fmt, const QRows *x, int M, const uint8_t *a, int G, int bb, const float *bias,    \
                          const float *Rr, int ldr, float *Y, int ldy, int cols) {                               \
        __m256 acc[ID_TILE];                                                                                     \
        float tmp[8];                                                                                            \
        Prep256 *prep = NULL, one;                                                                               \
        if (M > ID_TILE) {                                                                                       \
            prep = scratch_get(&id_w_scratch, sizeof(Prep256) * (size_t)G);                                      \
            if (!prep) return;                                                                                   \
            for (int g = 0; g < G; g++) {                                                                        \
                const uint8_t *blk = a + (size_t)g * bb;                                                         \
                prep_step(fmt, VNNI, blk, prep[g].w, prep[g].sgn);                                               \
                prep[g].d = load_h8(blk);                                                                        \
                prep[g].m = fmt == ID_INT4 ? load_h8(blk + 16) : _mm256_setzero_ps();                            \
            }                                                                                                    \
        }                                                                                                        \
        for (int m0 = 0; m0 < M; m0 += ID_TILE) {                                                                \
            const int R = M - m0 < ID_TILE ? M - m0 : ID_TILE;                                                   \
            for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                                            \
            for (int g = 0; g < G; g++) {                                                                        \
                const Prep256 *p = prep ? &prep[g] : &one;                                                       \
                if (!prep) {                                                                                     \
                    const uint8_t *blk = a + (size_t)g * bb;                                                     \
                    _mm_prefetch((const char *)blk + 2048, _MM_HINT_T0);                                         \
                    prep_step(fmt, VNNI, blk, one.w, one.sgn);                                                   \
                    one.d = load_h8(blk);                                                                        \
                    one.m = fmt == ID_INT4 ? load_h8(blk + 16) : _mm256_setzero_ps();                            \
                }                                                                                                \
                switch (R) {                                                                                     \
                case 1: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 1); break;                            \
                case 2: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 2); break;                            \
                case 3: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 3); break;                            \
                case 4: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 4); break;                            \
                case 5: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 5); break;                            \
                case 6: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 6); break;                            \
                case 7: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 7); break;                            \
                default: ROWS(fmt, x, m0, g, p->w, p->sgn, p->d, p->m, acc, 8);                                  \
                }                                                                                                \
            }                                                                                                    \
            for (int i = 0; i < R; i++) {                                                                        \
                _mm256_storeu_ps(tmp, acc[i]);                                                                   \
                const size_t mm = (size_t)(m0 + i);                                                              \
                id_store(tmp, bias, Rr ? Rr + mm * ldr : NULL, Y + mm * ldy, cols);                              \
            }                                                                                                    \
        }                                                                                                        \
    }

PANEL256(panel_vnni, ID_VNNI, rows_vnni, 1)
PANEL256(panel_avx2, , rows_avx2, 0)
#undef PANEL256

static void range256(int isa, int fmt, const QRows *x, const uint8_t *Wp, const float *bias, const float *Rr,
                     int ldr, float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    const int bb = id_block_bytes(fmt), G = (K + ID_GROUP - 1) / ID_GROUP;
    const size_t panel_bytes = (size_t)G * bb;
    for (int p = p0; p < p1; p++) {
        const int n0 = p * ID_PANEL, cols = N - n0 < ID_PANEL ? N - n0 : ID_PANEL;
        const uint8_t *a = Wp + (size_t)p * panel_bytes;
        const float *b = bias ? bias + n0 : NULL, *r = Rr ? Rr + n0 : NULL;
        if (isa == ISA_AVXVNNI) panel_vnni(fmt, x, M, a, G, bb, b, r, ldr, Y + n0, ldy, cols);
        else panel_avx2(fmt, x, M, a, G, bb, b, r, ldr, Y + n0, ldy, cols);
    }
}

/* ---------------- entry points ---------------- */

static void id_range(const QRows *x, int fmt, const uint8_t *Wp, const float *bias, const float *R, int ldr,
                     float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    const int isa = __atomic_load_n(&id_isa, __ATOMIC_RELAXED);
    if (isa == ISA_AVX512VNNI) range512(fmt, x, Wp, bias, R, ldr, Y, ldy, M, K, N, p0, p1);
    else range256(isa, fmt, x, Wp, bias, R, ldr, Y, ldy, M, K, N, p0, p1);
}

/* Panels [p0, p1) of Y = X W^T (+ bias) (+ R), X quantized here into this thread's own buffer (every thread of a
 * step quantizes the same rows the same way: no barrier). decode_step.c's linears call this. Returns -1 when the
 * buffer cannot be allocated (Y untouched), else 0. */
static int int_dot_linear(int fmt, const float *X, int ldx, const uint8_t *Wp, const float *bias, const float *R,
                          int ldr, float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    void *mem = scratch_get(&id_act_scratch, qrows_bytes(M, K));
    if (!mem) return -1;
    QRows x = qrows_carve(mem, M, K);
    quantize_rows(X, ldx, M, K, &x);
    id_range(&x, fmt, Wp, bias, R, ldr, Y, ldy, M, K, N, p0, p1);
    return 0;
}

/* Y = X W^T (+ bias) (+ R) by integer dot products, on nthreads threads splitting the panels.
 * Returns 0, or -1 when a buffer cannot be allocated. */
int int_dot_gemm(int fmt, const float *X, int ldx, const uint8_t *Wp, const float *bias, const float *R, int ldr,
                 float *Y, int ldy, int M, int K, int N, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    void *mem = malloc(qrows_bytes(M, K));
    if (!mem) return -1;
    QRows x = qrows_carve(mem, M, K);
    quantize_rows(X, ldx, M, K, &x);
    const int npanels = (N + ID_PANEL - 1) / ID_PANEL;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > npanels) nthreads = npanels;
#pragma omp parallel num_threads(nthreads)
    { /* panels split as decode_step.c splits them (a range may start or end mid-pair) */
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int p0 = (int)((long)npanels * t / nt), p1 = (int)((long)npanels * (t + 1) / nt);
        if (p0 < p1) id_range(&x, fmt, Wp, bias, R, ldr, Y, ldy, M, K, N, p0, p1);
    }
    free(mem);
    return 0;
}
