/* Quantized linears by integer dot products: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]) (+ R[M, N]) for W of GGUF
 * type Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS in the file's own blocks, with X
 * quantized per 32-block to int8 first, as llama.cpp quantizes its activations (Q8_0 / Q8_1 / Q8_K blocks) for its
 * vec_dot_<type>_q8_* kernels.
 *
 * Why: quant_gemm.c multiplies fp32 activations by weights dequantized to fp32, one FMA per weight and row (16
 * multiply-adds an instruction with AVX-512). Here a weight stays an integer: VNNI's vpdpbusd does 64 u8 x s8
 * multiply-adds an instruction (4 per 32-bit lane), so a batch's linears do ~4x fewer instructions per weight.
 * The cost is the activations' rounding to 8 bits (docs/integer-dot.md has the perplexity and speed figures): this
 * path is NOT bit-exact against HF; the fp32-activation path (quant_gemm.c) stays the exact one.
 *
 * Weights: W is N rows of GGUF blocks, as quant_gemm.c reads them (models/gguf/blocks.py), never copied:
 *   Q8_0 (34 bytes / 32): d fp16 | q[32] int8              w = d q
 *   Q4_0 (18 bytes / 32): d fp16 | qs[16]                  w = d (q - 8),  q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4
 *   Q4_1 (20 bytes / 32): d fp16 | m fp16 | qs[16]         w = d q + m
 *   Q5_0 (22 bytes / 32): d fp16 | qh u32 | qs[16]         w = d (q - 16), q = Q4_0's nibble | (qh bit k) << 4
 *   Q5_1 (24 bytes / 32): d fp16 | m fp16 | qh | qs[16]    w = d q + m, q as Q5_0's
 *   Q4_K (144 bytes / 256): 8 sub-blocks of 32, each w = (d sc) q - (dmin m), q a nibble (quants/q4_k.h)
 *   Q5_K (176 bytes / 256): as Q4_K with q 5 bits, the 5th of sub-block s bit s of qh[k] (quants/q5_k.h)
 *   Q6_K (210 bytes / 256): 16 sub-blocks of 16, each w = (d sc) (q - 32), q 6 bits (quants/q6_k.h)
 *   Q2_K (84 bytes / 256): 16 sub-blocks of 16, each w = (d sc) q - (dmin m), q 2 bits, sc and m 4 bits (q2_k.h)
 *   Q3_K (110 bytes / 256): 16 sub-blocks of 16, each w = (d sc) (q - 4), q 3 bits, sc 6 bits - 32 (q3_k.h)
 *   IQ4_NL (18 bytes / 32): d fp16 | qs[16]                w = d grid[q], q Q4_0's nibble, grid int8 (iq4_nl.h)
 *   IQ4_XS (136 bytes / 256): 8 sub-blocks of 32, each w = (d sc) grid[q], sc 6 bits - 32 (iq4_xs.h)
 * Every 32 weights of a row (a "group": a Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL block, a Q4_K / Q5_K / IQ4_XS
 * sub-block, two Q2_K / Q3_K / Q6_K sub-blocks) meet one 32-block of the activations.
 * A panel is 8 consecutive output rows (the last one's missing rows read its last row again; their outputs are
 * dropped). Each 32-block of a panel's 8 rows is turned in registers into the kernels' operand form: 8 k-quads,
 * each a register of 8 columns x 4 k (an 8 x 8 transpose of 32-bit words), once per block for all of a step's rows.
 *
 * Activations: row x, group g (32 k, the last zero-padded): a = max |x_k|, dx = a / 127, q_k = round(x_k 127 / a)
 * (nearest, ties to even: the vector rounding), all 0 when a = 0; s = sum q_k (int), s' the sum of its first 16.
 * Then per output n, the group's integers S exact in int32 and its factors d (and m) in fp32:
 *   Q8_0: y = sum_g dx_g d_gn S_gn                    S = sum_k q_k w_k (w the int8 q)
 *   Q4_0: the same with S = sum_k q_k (w_k - 8)       (sum q_k w_k - 8 s)
 *   Q4_1: y = sum_g dx_g d_gn S_gn + m_gn (s_g dx_g)  S = sum_k q_k w_k, w in 0..15
 *   Q5_0: as Q4_0 with S = sum_k q_k (w_k - 16), w in 0..31 (sum q_k w_k - 16 s)
 *   Q5_1: as Q4_1 with w in 0..31
 *   Q4_K, Q5_K: as Q4_1 / Q5_1 with d = d sc, m = -(dmin m) of the group's sub-block (each product exact in fp32)
 *   Q6_K: as Q8_0 with d the super-block's d, S = sc_a (S_a - 32 s') + sc_b (S_b - 32 (s - s')), S_a / S_b the
 *         sums of q_k w_k over the group's two sub-blocks of 16, sc_a / sc_b their int8 scales
 *   Q3_K: as Q6_K with an offset of 4: S = sc_a (S_a - 4 s') + sc_b (S_b - 4 (s - s')), w in 0..7
 *   Q2_K: as Q6_K without an offset (w in 0..3), and its sub-blocks' mins as one more integer per group,
 *         Mn = m_a s' + m_b (s - s'), with the factor -dmin
 *   IQ4_NL, IQ4_XS: as Q8_0 with w the grid's int8 value (a nibble's byte lookup) and d = d (IQ4_XS: d sc)
 * in fp32, group by group in increasing g: y = fma(float(S), d dx, y) (the types with a min: first
 * y = fma(m, s dx, y); Q2_K: first y = fma(float(Mn), -dmin dx, y)); then
 * y (+ bias) (+ r). S is exact and the order is fixed, so results do not depend on M, the thread count, the path
 * or the ISA (every ISA computes the same S and the same fp32 operations). tests/test_int_dot.py checks this
 * against a float64 evaluation of the same quantized math.
 *
 * Kernels (chosen when the library loads, ``int_dot_isa``; a call reads the choice once):
 *   avx512vnni (AVX-512 VNNI + BW + VL): a panel pair = 16 columns per 512-bit register, one vpdpbusd per k-quad
 *     and row, x's 4 bytes broadcast. Q8_0 is offset by 128 to u8 (S starts at -128 s).
 *   avxvnni (AVX-VNNI, 256-bit vpdpbusd): the same per panel, 8 columns a register.
 *   avx2 (vpmaddubsw): u8 x s8 pairs to int16, vpmaddwd to int32, as llama.cpp's AVX2 path; Q8_0 takes the sign
 *     trick (|w| as u8 times x with w's sign: no int16 overflow, as |w| <= 128, |q| <= 127), as do the IQ4 types.
 * Up to 8 rows each block's operands are made as the rows need them and used by every row at once (a 32-block's in
 * registers; a super-block's 8 groups at once into a small local array, its header read once: prep*_block); more
 * rows make a panel (pair)'s operands once into a per-thread buffer and run it in tiles of 8 rows.
 *
 * Q4_K and Q6_K weights packed at load into panels of 32 columns (int_packed.c, included below: int_dot_pack; the entries
 * take its format, the type | FMT_PACKED) run the same math on operands laid out for vpdpbusd, the same bits.
 *
 * Built by int_dot.py on its own (tests, and its entry int_dot_gemm) and included by decode_step.c, whose linears
 * call int_dot_linear for the types and row counts int_dot_set_rows enables (ACTIVATIONS, int_dot.py).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "quants/iq4_xs.h" /* IQ4_GRID */
#include "quants/q5_1.h" /* five_bit_bytes (q5_0.h) */
#include "quants/q5_k.h" /* k5_high_bytes */

#define ID_PANEL 8
#define ID_GROUP 32
#define ID_TILE 8 /* rows per register tile */
/* the types it takes */
enum {
    IDF_Q8_0, IDF_Q4_0, IDF_Q4_1, IDF_Q4_K, IDF_Q6_K, IDF_Q5_0, IDF_Q5_1, IDF_Q5_K, IDF_Q2_K, IDF_Q3_K, IDF_IQ4_NL,
    IDF_IQ4_XS, IDF_KINDS
};
/* X(kind, a) for every kind: the kernels' switches, one case (constant kind, inlined code) per type */
#define ID_EACH_KIND(X, a)                                                                                    \
    X(IDF_Q8_0, a) X(IDF_Q4_0, a) X(IDF_Q4_1, a) X(IDF_Q4_K, a) X(IDF_Q6_K, a) X(IDF_Q5_0, a) X(IDF_Q5_1, a)       \
        X(IDF_Q5_K, a) X(IDF_Q2_K, a) X(IDF_Q3_K, a) X(IDF_IQ4_NL, a) X(IDF_IQ4_XS, a)
enum { ISA_AVX2 = 0, ISA_AVXVNNI = 1, ISA_AVX512VNNI = 2 };

#define ID_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define ID_VNNI __attribute__((target("avxvnni,avx2,fma,f16c")))
#define ID_INLINE static inline __attribute__((always_inline))

/* GGUF type id (quants/common.h's T_*) -> this path's kind, or -1 */
static inline int id_kind(int type) {
    switch (type) {
    case T_Q8_0: return IDF_Q8_0;
    case T_Q4_0: return IDF_Q4_0;
    case T_Q4_1: return IDF_Q4_1;
    case T_Q4_K: return IDF_Q4_K;
    case T_Q6_K: return IDF_Q6_K;
    case T_Q5_0: return IDF_Q5_0;
    case T_Q5_1: return IDF_Q5_1;
    case T_Q5_K: return IDF_Q5_K;
    case T_Q2_K: return IDF_Q2_K;
    case T_Q3_K: return IDF_Q3_K;
    case T_IQ4_NL: return IDF_IQ4_NL;
    case T_IQ4_XS: return IDF_IQ4_XS;
    default: return -1;
    }
}

static inline int id_k4(int f) { return f == IDF_Q4_K || f == IDF_Q5_K; } /* Q4_K's scales and mins */
/* two sub-blocks of 16 a group, each with its scale (S = sc_a (S_a - o s') + sc_b (S_b - o (s - s')), o: id_offset16) */
static inline int id_sub16(int f) { return f == IDF_Q6_K || f == IDF_Q3_K || f == IDF_Q2_K; }
static inline int id_offset16(int f) { return f == IDF_Q6_K ? 32 : f == IDF_Q3_K ? 4 : 0; }
/* Q2_K, Q3_K: a sub-block's S_a - o s' fits int16 (|q| <= 127, |w - o| <= 4: <= 8128), so one vpmaddwd on the
 * (S_a, S_b) pairs applies both scales (Q6_K's 63 w do not fit: two vpmulld) */
static inline int id_pairs16(int f) { return f == IDF_Q3_K || f == IDF_Q2_K; }
static inline int id_super(int f) { return id_k4(f) || id_sub16(f) || f == IDF_IQ4_XS; } /* 256-blocks of 8 groups */
static inline int id_has_min(int f) { return f == IDF_Q4_1 || f == IDF_Q5_1 || id_k4(f); }
/* signed weight bytes (int8 values): VNNI offsets them to u8, AVX2 takes the sign trick */
static inline int id_signed(int f) { return f == IDF_Q8_0 || f == IDF_IQ4_NL || f == IDF_IQ4_XS; }
/* AVX2: how many k-quads' vpmaddubsw int16 sums (each w_1 q_1 + w_2 q_2, |q| <= 127) add in int16 before one
 * vpmaddwd widens them: n 2 w_max 127 <= 32767, so all 8 (k 0-31) for the nibble types whose S needs no halves apart
 * (Q4_0, Q4_1, Q4_K: w <= 15, 30480), 4 for the other unsigned types up to 5 bits (w <= 31; Q2_K's and Q3_K's
 * halves are their sub-blocks), 2 for Q6_K's 6, 1 for the signed ones (|w| up to 128 by the sign trick) */
static inline int id_i16_quads(int f) {
    if (id_signed(f)) return 1;
    if (f == IDF_Q4_0 || f == IDF_Q4_1 || f == IDF_Q4_K) return 8;
    return f == IDF_Q6_K ? 2 : 4;
}

/* Bytes of a block: a group's (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) or a super-block's (8 groups). */
static inline int id_block_bytes(int f) {
    switch (f) {
    case IDF_Q8_0: return 34;
    case IDF_Q4_0: return 18;
    case IDF_Q4_1: return 20;
    case IDF_Q5_0: return 22;
    case IDF_Q5_1: return 24;
    case IDF_Q4_K: return 144;
    case IDF_Q5_K: return 176;
    case IDF_Q2_K: return 84;
    case IDF_Q3_K: return 110;
    case IDF_IQ4_NL: return 18;
    case IDF_IQ4_XS: return 136;
    default: return 210;
    }
}

/* The block holding group g of a row, and the group's index in it. */
static inline const uint8_t *id_block(int f, const uint8_t *row, int g, int *sub) {
    *sub = id_super(f) ? g & 7 : 0;
    return row + (size_t)(id_super(f) ? g >> 3 : g) * id_block_bytes(f);
}

static inline size_t id_row_bytes(int f, int G) { return (size_t)(id_super(f) ? G / 8 : G) * id_block_bytes(f); }

/* ---------------- ISA choice and the per-type switch ---------------- */

static int id_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avxvnni")) return ISA_AVXVNNI;
    return ISA_AVX2;
}

static int id_isa = -1; /* set when the library loads; read atomically */
static int id_rows[IDF_KINDS]; /* per kind: calls of at least this many rows take this path; 0: never */

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

/* Calls on weights of GGUF type `type` with at least min_rows rows take this path (min_rows <= 0: none). Returns
 * the old value, or -1 for a type this path does not take. */
int int_dot_set_rows(int type, int min_rows) {
    const int f = id_kind(type);
    if (f < 0) return -1;
    return __atomic_exchange_n(&id_rows[f], min_rows > 0 ? min_rows : 0, __ATOMIC_RELAXED);
}

static inline int int_dot_wants(int type, int M) {
    const int f = id_kind(type);
    if (f < 0) return 0;
    const int rows = __atomic_load_n(&id_rows[f], __ATOMIC_RELAXED);
    return rows > 0 && M >= rows;
}

/* ---------------- activations ---------------- */

/* The quantized rows of X: q [M][G * 32] int8, d [M][G] (dx), sd [M][G] (s dx), s [M][G], s16 [M][G] (the sum
 * of a group's first 16 q: Q6_K's sub-blocks). */
typedef struct {
    int8_t *q;
    float *d, *sd;
    int32_t *s, *s16;
    int G;
} QRows;

/* One row's groups (scalar: the same bits as any vector form; the rounding is nearest-even, rintf). */
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *sd, int32_t *s, int32_t *s16) {
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
            if (k == 15) s16[g] = sum;
        }
        d[g] = dx;
        s[g] = sum;
        sd[g] = (float)sum * dx;
    }
}

/* Bytes of a QRows of M rows of K. */
static size_t qrows_bytes(int M, int K) {
    const size_t G = (size_t)(K + ID_GROUP - 1) / ID_GROUP;
    return (size_t)M * G * (ID_GROUP + 4 * sizeof(float)) + 64;
}

static QRows qrows_carve(void *mem, int M, int K) {
    QRows r;
    r.G = (K + ID_GROUP - 1) / ID_GROUP;
    const size_t n = (size_t)M * r.G;
    r.q = (int8_t *)mem;
    r.d = (float *)(r.q + n * ID_GROUP);
    r.sd = r.d + n;
    r.s = (int32_t *)(r.sd + n);
    r.s16 = r.s + n;
    return r;
}

static void quantize_rows(const float *X, int ldx, int M, int K, QRows *r) {
    for (int i = 0; i < M; i++)
        quantize_row(X + (size_t)i * ldx, K, r->q + (size_t)i * r->G * ID_GROUP, r->d + (size_t)i * r->G,
                     r->sd + (size_t)i * r->G, r->s + (size_t)i * r->G, r->s16 + (size_t)i * r->G);
}

/* For tests: X's quantized rows into q [M][G*32], d [M][G], s [M][G]. */
void int_dot_quantize(const float *X, int ldx, int M, int K, int8_t *q, float *d, int32_t *s) {
    const int G = (K + ID_GROUP - 1) / ID_GROUP;
    float *sd = malloc(sizeof(float) * (size_t)M * G + 1);
    int32_t *s16 = malloc(sizeof(int32_t) * (size_t)M * G + 1);
    for (int i = 0; i < M; i++)
        quantize_row(X + (size_t)i * ldx, K, q + (size_t)i * G * ID_GROUP, d + (size_t)i * G, sd + (size_t)i * G,
                     s + (size_t)i * G, s16 + (size_t)i * G);
    free(sd);
    free(s16);
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

/* ---------------- a panel's block in operand form ---------------- */

/* An IQ4 group's 16 bytes of nibbles (k 0-15 low, 16-31 high; in block blk, IQ4_XS's sub-block sub) -> the grid's
 * bytes, each XOR flip (0x80: offset by 128 to u8, the table flipped before the lookup). */
ID_INLINE __m256i id_iq4_values(int f, const uint8_t *blk, int sub, char flip) {
    const uint8_t *qs = blk + (f == IDF_IQ4_NL ? 2 : 8 + 16 * sub);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), l4 = _mm_set1_epi8(15);
    const __m128i grid = _mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_GRID), _mm_set1_epi8(flip));
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), l4), _mm_and_si128(v, l4));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(grid), q);
}

/* The 32 weights of group g of a row as k-ordered bytes: Q8_0 its int8 q, IQ4_NL / IQ4_XS their int8 grid values,
 * the others their unsigned q (Q4_0 / Q4_1 / Q4_K nibbles 0..15, Q5_0 / Q5_1 / Q5_K 0..31, Q6_K 0..63, Q2_K 0..3,
 * Q3_K 0..7). */
ID_INLINE __m256i id_values(int f, const uint8_t *row, int g) {
    int sub;
    const uint8_t *blk = id_block(f, row, g, &sub);
    const __m256i lo4 = _mm256_set1_epi8(15);
    if (f == IDF_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    if (f == IDF_IQ4_NL || f == IDF_IQ4_XS) return id_iq4_values(f, blk, sub, 0);
    if (f == IDF_Q2_K || f == IDF_Q3_K) { /* group sub = 4 h + j: bits 2 j of qs[32 h ..] (Q3_K: | hmask bit sub << 2) */
        const __m128i shift = _mm_cvtsi32_si128(2 * (sub & 3));
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (f == IDF_Q2_K ? 16 : 32) + 32 * (sub >> 2)));
        const __m256i low = _mm256_and_si256(_mm256_srl_epi16(v, shift), _mm256_set1_epi8(3));
        if (f == IDF_Q2_K) return low;
        /* hmask bit sub moved to bit 2 (one shift: an immediate where sub is a constant, as in the row path) */
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
        const __m256i at2 = sub >= 2 ? _mm256_srl_epi16(hm, _mm_cvtsi32_si128(sub - 2))
                                     : _mm256_sll_epi16(hm, _mm_cvtsi32_si128(2 - sub));
        return _mm256_or_si256(low, _mm256_and_si256(at2, _mm256_set1_epi8(4)));
    }
    if (id_k4(f)) { /* sub-block 2p + i: nibble i of qs[32 p ..] (Q5_K: | its 5th bits) */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (f == IDF_Q5_K ? 48 : 16) + 32 * (sub >> 1)));
        const __m256i q = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(v, 4) : v, lo4);
        return f == IDF_Q5_K ? _mm256_or_si256(q, k5_high_bytes(blk + 16, sub)) : q;
    }
    if (f == IDF_Q6_K) { /* half h = sub / 4, quarter c = sub % 4 (quants/q6_k.h) */
        const int h = sub >> 2, c = sub & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (c & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(c < 2 ? ql : _mm256_srli_epi16(ql, 4), lo4);
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), _mm256_set1_epi8(3));
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    /* a 32-block: its 16 bytes of nibbles after d (m) (qh): k 0-15 the low nibbles, 16-31 the high */
    const int qs = f == IDF_Q4_0 ? 2 : f == IDF_Q4_1 ? 4 : f == IDF_Q5_0 ? 6 : 8;
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + qs)), l4 = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), l4), _mm_and_si128(v, l4));
    return f == IDF_Q5_0 || f == IDF_Q5_1 ? _mm256_or_si256(q, five_bit_bytes(u32_at(blk + qs - 4))) : q;
}

/* id_values with the signed types' bytes offset by 128 to u8, vpdpbusd's weights (S then starts at -128 s): the IQ4
 * types look them up in a flipped grid (no extra operation), Q8_0 flips its sign bits. */
ID_INLINE __m256i id_values_u8(int f, const uint8_t *row, int g) {
    int sub;
    const uint8_t *blk = id_block(f, row, g, &sub);
    if (f == IDF_IQ4_NL || f == IDF_IQ4_XS) return id_iq4_values(f, blk, sub, (char)0x80);
    const __m256i v = id_values(f, row, g);
    return id_signed(f) ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
}

/* Group g of a panel's 8 rows -> the 8 k-quads w[j]: 32-bit word c of w[j] = row c's k 4j .. 4j + 3. */
ID_INLINE void id_operands(int f, const uint8_t *const *rows, int g, __m256i w[8]) {
    __m256i r[8], t[8], u[8];
    for (int c = 0; c < 8; c++) {
        int sub;
        _mm_prefetch((const char *)id_block(f, rows[c], g, &sub) + 768, _MM_HINT_T0);
        r[c] = id_values(f, rows[c], g);
    }
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* rows 4h .. 4h + 3: u[4h + e] holds their word e of each lane */
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int e = 0; e < 4; e++) {
        w[e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x20);
        w[4 + e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x31);
    }
}

/* Group g's factors in each of a panel's 8 rows: d, m (0 without a min; Q2_K: -dmin) and, for the types with
 * sub-blocks of 16, their two scales: Q6_K's as int32 (sca, scb), Q2_K's / Q3_K's as an int16 pair per 32-bit lane
 * (sc2: sc_a low, sc_b high; id_pairs16), and Q2_K's two mins likewise (mn2). */
typedef struct {
    __m256 d, m;
    __m256i sca, scb, sc2, mn2;
} Factors8;

/* (a, b) as an int16 pair: a in the low half of the 32-bit word, b in the high */
static inline int32_t id_pair16(int32_t a, int32_t b) { return (int32_t)((uint32_t)(uint16_t)a | (uint32_t)b << 16); }

/* fp32 of the fp16 in the low (hi = 0) or high (hi = 1) half of each 32-bit lane. */
ID_INLINE __m256 id_half_ps(__m256i words, int hi) {
    const __m256i h = hi ? _mm256_srli_epi32(words, 16) : _mm256_and_si256(words, _mm256_set1_epi32(0xffff));
    const __m256i p = _mm256_packus_epi32(h, _mm256_setzero_si256()); /* each lane's 4 halves in its low 8 bytes */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
}

/* The 16 bytes at offset `at` of a strip's 8 columns, transposed: v[j] lane c = column c's 32-bit word j (4 loads
 * of two columns each, then a 4 x 4 transpose of words in each 128-bit half). */
ID_INLINE void id_words16(const uint8_t *const *cols, size_t at, __m256i v[4]) {
    __m256i r[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) { /* columns c | c + 4 */
        const __m128i lo = _mm_loadu_si128((const __m128i *)(cols[c] + at));
        r[c] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128((const __m128i *)(cols[c + 4] + at)), 1);
    }
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* Byte b (a constant 0-3) of each 32-bit lane, zero- or sign-extended to int32. */
ID_INLINE __m256i id_byte_u(__m256i v, int b) {
    return b == 3 ? _mm256_srli_epi32(v, 24) : _mm256_and_si256(_mm256_srli_epi32(v, 8 * b), _mm256_set1_epi32(255));
}
ID_INLINE __m256i id_byte_s(__m256i v, int b) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24); }
/* Bytes 2 h and 2 h + 1 (h a constant 0-1) of each 32-bit lane, zero-extended to an int16 pair (id_pair16). */
ID_INLINE __m256i id_bytes_pair16(__m256i v, int h) {
    const __m256i two = h ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xffff)); /* low half */
    return _mm256_and_si256(_mm256_or_si256(two, _mm256_slli_epi32(two, 8)), _mm256_set1_epi32(0x00ff00ff));
}

/* The 32-bit word at byte `at` of each of a strip's 8 columns, column c in lane c. */
ID_INLINE __m256i id_words_at(const uint8_t *const *cols, size_t at) {
    return _mm256_setr_epi32((int)u32_at(cols[0] + at), (int)u32_at(cols[1] + at), (int)u32_at(cols[2] + at),
                             (int)u32_at(cols[3] + at), (int)u32_at(cols[4] + at), (int)u32_at(cols[5] + at),
                             (int)u32_at(cols[6] + at), (int)u32_at(cols[7] + at));
}

/* A super-block's factors for a strip's 8 columns, k[s] for its group s, in registers (no per-column scalar work:
 * a strip's header bytes are transposed once, then every scale is a lane-wise shift and mask).
 * Q4_K / Q5_K: header d | dmin | scales[12] = 16 bytes, words w1 = bytes 0-3, w2 = 4-7, w3 = 8-11; quants/q4_k.h's
 * k4_scale_min lane-wise: sc 0-3 = w1 & 63, m 0-3 = w2 & 63, sc 4-7 = (w3 & 15) | (w1 >> 6) << 4, m 4-7 = (w3 >> 4)
 * | (w2 >> 6) << 4 (per byte). d sc and -(dmin m): one fp32 product each ((-dmin) m is -(dmin m) exactly).
 * Q6_K: scales int8[16] at 192 (word j: scales 4j .. 4j + 3; group s: scales 2s, 2s + 1), d at 208.
 * Q2_K: scales[16] at 0 (word j: sub-blocks 4j .. 4j + 3, sc the low nibble, m the high), d | dmin at 80.
 * Q3_K: scales[12] at 96 as words a0 a1 a2 -> 16 6-bit scales as ggml unpacks them (quants/q3_k.h's q3_k_scale,
 * lane-wise: scales 0-3 = a0 & 15 | (a2 & 3) << 4, 4-7 = a1 & 15 | (a2 >> 2 & 3) << 4, 8-11 = a0 >> 4 | (a2 >> 4 &
 * 3) << 4, 12-15 = a1 >> 4 | (a2 >> 6 & 3) << 4, per byte), minus 32; d at 108.
 * IQ4_XS: d | scales_h at 0, scales_l[4] at 4: group s's scale = (scales_l >> 4 s & 15) | (scales_h >> 2 s & 3) << 4,
 * minus 32; d sc one fp32 product, as quants/iq4_xs.h's iq4_xs_scale. Every value is those scalar references' for
 * the same group (tests/test_int_dot.py's float64 evaluation reads the blocks with gguf-py). */
ID_INLINE void id_super_factors(int f, const uint8_t *const *cols, size_t at, Factors8 *k) {
    __m256i w[4];
    const __m256i zero = _mm256_setzero_si256();
    if (f == IDF_Q6_K) {
        id_words16(cols, at + 192, w);
        const __m256 d = id_half_ps(id_words_at(cols, at + 206), 1); /* bytes 206-209: scales 14, 15 | d */
        _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
            k[s].d = d, k[s].m = _mm256_setzero_ps();
            k[s].sca = id_byte_s(w[s >> 1], 2 * (s & 1)), k[s].scb = id_byte_s(w[s >> 1], 2 * (s & 1) + 1);
            k[s].sc2 = k[s].mn2 = zero;
        }
        return;
    }
    if (f == IDF_Q2_K) {
        id_words16(cols, at, w);
        const __m256i dw = id_words_at(cols, at + 80), m15 = _mm256_set1_epi32(0x000f000f);
        const __m256 d = id_half_ps(dw, 0), ndmin = _mm256_xor_ps(id_half_ps(dw, 1), _mm256_set1_ps(-0.0f));
        _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
            const __m256i ab = id_bytes_pair16(w[s >> 1], s & 1); /* (byte 2 s, byte 2 s + 1) of the scales */
            k[s].d = d, k[s].m = ndmin;
            k[s].sc2 = _mm256_and_si256(ab, m15), k[s].mn2 = _mm256_and_si256(_mm256_srli_epi32(ab, 4), m15);
            k[s].sca = k[s].scb = zero;
        }
        return;
    }
    if (f == IDF_Q3_K) {
        id_words16(cols, at + 92, w); /* bytes 92-107: w[1], w[2], w[3] = a0, a1, a2 */
        const __m256 d = id_half_ps(id_words_at(cols, at + 106), 1);
        const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x03030303);
        const __m256i a0 = w[1], a1 = w[2], a2 = w[3], o32 = _mm256_set1_epi16(32);
        const __m256i aux[4] = {
            _mm256_or_si256(_mm256_and_si256(a0, m4), _mm256_slli_epi32(_mm256_and_si256(a2, m2), 4)),
            _mm256_or_si256(_mm256_and_si256(a1, m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a2, 2), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a0, 4), m4),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a2, 4), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a1, 4), m4),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a2, 6), m2), 4))};
        _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
            k[s].d = d, k[s].m = _mm256_setzero_ps();
            k[s].sc2 = _mm256_sub_epi16(id_bytes_pair16(aux[s >> 1], s & 1), o32);
            k[s].sca = k[s].scb = k[s].mn2 = zero;
        }
        return;
    }
    if (f == IDF_IQ4_XS) {
        const __m256i h = id_words_at(cols, at), l = id_words_at(cols, at + 4);
        const __m256 d = id_half_ps(h, 0);
        _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
            const __m256i low = _mm256_and_si256(_mm256_srli_epi32(l, 4 * s), _mm256_set1_epi32(15));
            const __m256i high = _mm256_and_si256(_mm256_srli_epi32(h, 16 + 2 * s), _mm256_set1_epi32(3));
            const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
            k[s].d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)), k[s].m = _mm256_setzero_ps();
            k[s].sca = k[s].scb = k[s].sc2 = k[s].mn2 = zero;
        }
        return;
    }
    id_words16(cols, at, w);
    const __m256 d = id_half_ps(w[0], 0), ndmin = _mm256_xor_ps(id_half_ps(w[0], 1), _mm256_set1_ps(-0.0f));
    const __m256i m63 = _mm256_set1_epi32(0x3f3f3f3f), m15 = _mm256_set1_epi32(0x0f0f0f0f);
    const __m256i m48 = _mm256_set1_epi32(0x30303030);
    const __m256i sc[2] = {_mm256_and_si256(w[1], m63),
                           _mm256_or_si256(_mm256_and_si256(w[3], m15), _mm256_and_si256(_mm256_srli_epi32(w[1], 2), m48))};
    const __m256i mn[2] = {_mm256_and_si256(w[2], m63),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w[3], 4), m15),
                                           _mm256_and_si256(_mm256_srli_epi32(w[2], 2), m48))};
    _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
        k[s].d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(id_byte_u(sc[s >> 2], s & 3)));
        k[s].m = _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(id_byte_u(mn[s >> 2], s & 3)));
        k[s].sca = k[s].scb = k[s].sc2 = k[s].mn2 = zero;
    }
}

/* The factors (Factors8) of a panel's (a strip's) 8 columns for group g and, for the 256-blocks, every group of g's
 * super-block: k[j] for group g + j, j < id_span(f), in registers, for the panel and the row path alike: the
 * 32-blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) read the 8 blocks' first 4 bytes (d, Q4_1's / Q5_1's m) at once;
 * a super-block's header is read once for its 8 groups (id_super_factors), not once per group and column. */
static inline int id_span(int f) { return id_super(f) ? 8 : 1; }

ID_INLINE void id_strip_factors(int f, const uint8_t *const *cols, int g, Factors8 *k) {
    if (!id_super(f)) {
        const size_t at = (size_t)g * id_block_bytes(f);
        const __m256i words = id_words_at(cols, at);
        k->d = id_half_ps(words, 0);
        k->m = id_has_min(f) ? id_half_ps(words, 1) : _mm256_setzero_ps(); /* Q4_1, Q5_1 */
        k->sca = k->scb = k->sc2 = k->mn2 = _mm256_setzero_si256();
        return;
    }
    id_super_factors(f, cols, (size_t)(g >> 3) * id_block_bytes(f), k);
}

/* A group's contribution to one activation row's 8 outputs (row at: its dx, s dx, s, s'), from the integer sums lo
 * (k 0-15) and hi (k 16-31), id_start already in lo + hi: the header's math, the same fp32 operations in the same
 * order in every kernel (the 512-bit form: id_update512). */
ID_INLINE __m256 id_update256(int f, __m256i lo, __m256i hi, const Factors8 *k, const QRows *x, size_t at, __m256 y) {
    __m256i Si;
    if (id_pairs16(f)) { /* (S_a - o s', S_b - o (s - s')) as int16 pairs, times (sc_a, sc_b): one vpmaddwd */
        const int32_t sa = x->s16[at], sb = x->s[at] - sa, o = id_offset16(f);
        __m256i pairs = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xaa);
        if (o) pairs = _mm256_sub_epi16(pairs, _mm256_set1_epi32(id_pair16(o * sa, o * sb)));
        Si = _mm256_madd_epi16(pairs, k->sc2);
        if (f == IDF_Q2_K) { /* the mins: Mn = m_a s' + m_b (s - s') */
            const __m256i Mn = _mm256_madd_epi16(k->mn2, _mm256_set1_epi32(id_pair16(sa, sb)));
            y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Mn), _mm256_mul_ps(k->m, _mm256_set1_ps(x->d[at])), y);
        }
    } else if (id_sub16(f)) { /* Q6_K */
        const int32_t sa = x->s16[at], sb = x->s[at] - sa, o = id_offset16(f);
        Si = _mm256_add_epi32(_mm256_mullo_epi32(k->sca, _mm256_sub_epi32(lo, _mm256_set1_epi32(o * sa))),
                              _mm256_mullo_epi32(k->scb, _mm256_sub_epi32(hi, _mm256_set1_epi32(o * sb))));
    } else {
        Si = _mm256_add_epi32(lo, hi);
    }
    if (id_has_min(f)) y = _mm256_fmadd_ps(k->m, _mm256_set1_ps(x->sd[at]), y);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(Si), _mm256_mul_ps(k->d, _mm256_set1_ps(x->d[at])), y);
}

/* S's start per (row, group): -128 s for u8-offset signed weights (Q8_0, IQ4_*: VNNI), -8 s for Q4_0, -16 s for
 * Q5_0, else 0 (Q2_K's / Q3_K's / Q6_K's offsets come with their scales). */
ID_INLINE int32_t id_start(int f, int offset8, int32_t s) {
    if (f == IDF_Q4_0) return -8 * s;
    if (f == IDF_Q5_0) return -16 * s;
    return id_signed(f) && offset8 ? -128 * s : 0;
}

/* ================ AVX-512 VNNI: a panel pair per register ================ */

typedef struct {
    __m512i w[8];
    __m512 d, m;
    __m512i sca, scb, sc2, mn2;
} Prep512;

/* [a | b] as one 16-lane register */
ID_512 ID_INLINE __m512 join512(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

ID_512 ID_INLINE __m512i join512i(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

/* Group g of the pair's 16 rows (rows[0..7] panel a, rows[8..15] panel b) -> operands: signed ones offset to u8;
 * ka, kb: the group's factors in panel a and b (id_strip_factors). */
ID_512 ID_INLINE void prep512(int f, const uint8_t *const *rows, int g, const Factors8 *ka, const Factors8 *kb,
                              Prep512 *p) {
    __m256i a[8], b[8];
    id_operands(f, rows, g, a);
    id_operands(f, rows + 8, g, b);
    for (int j = 0; j < 8; j++) {
        p->w[j] = join512i(a[j], b[j]);
        if (id_signed(f)) p->w[j] = _mm512_xor_si512(p->w[j], _mm512_set1_epi8((char)0x80));
    }
    p->d = join512(ka->d, kb->d), p->m = join512(ka->m, kb->m);
    p->sca = join512i(ka->sca, kb->sca), p->scb = join512i(ka->scb, kb->scb);
    p->sc2 = join512i(ka->sc2, kb->sc2), p->mn2 = join512i(ka->mn2, kb->mn2);
}

/* R rows (constant after inlining) x group g: acc[i] += the group's contribution (see the header). */
ID_512 ID_INLINE void rows512(int f, const QRows *x, int m0, int g, const Prep512 *p, __m512 *acc, int R) {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
        const size_t at = (size_t)(m0 + i) * x->G + g;
        const int32_t *xq = (const int32_t *)(x->q + at * ID_GROUP);
        /* s0: k 0-15 (quads 0-3), s1: k 16-31, two chains each (integer sums: exact in any order) */
        __m512i s0 = _mm512_set1_epi32(id_start(f, 1, x->s[at])), s1 = _mm512_setzero_si512();
        __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
        s0 = _mm512_dpbusd_epi32(s0, p->w[0], _mm512_set1_epi32(xq[0]));
        t0 = _mm512_dpbusd_epi32(t0, p->w[1], _mm512_set1_epi32(xq[1]));
        s1 = _mm512_dpbusd_epi32(s1, p->w[4], _mm512_set1_epi32(xq[4]));
        t1 = _mm512_dpbusd_epi32(t1, p->w[5], _mm512_set1_epi32(xq[5]));
        s0 = _mm512_dpbusd_epi32(s0, p->w[2], _mm512_set1_epi32(xq[2]));
        t0 = _mm512_dpbusd_epi32(t0, p->w[3], _mm512_set1_epi32(xq[3]));
        s1 = _mm512_dpbusd_epi32(s1, p->w[6], _mm512_set1_epi32(xq[6]));
        t1 = _mm512_dpbusd_epi32(t1, p->w[7], _mm512_set1_epi32(xq[7]));
        s0 = _mm512_add_epi32(s0, t0), s1 = _mm512_add_epi32(s1, t1);
        __m512i Si;
        __m512 y = acc[i];
        if (id_pairs16(f)) { /* id_update256's math: int16 pairs (S_a - o s', S_b - o (s - s')) . (sc_a, sc_b) */
            const int32_t sa = x->s16[at], sb = x->s[at] - sa, o = id_offset16(f);
            __m512i pairs = _mm512_mask_blend_epi16(0xaaaaaaaa, s0, _mm512_slli_epi32(s1, 16));
            if (o) pairs = _mm512_sub_epi16(pairs, _mm512_set1_epi32(id_pair16(o * sa, o * sb)));
            Si = _mm512_madd_epi16(pairs, p->sc2);
            if (f == IDF_Q2_K) {
                const __m512i Mn = _mm512_madd_epi16(p->mn2, _mm512_set1_epi32(id_pair16(sa, sb)));
                y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mn), _mm512_mul_ps(p->m, _mm512_set1_ps(x->d[at])), y);
            }
        } else if (id_sub16(f)) { /* Q6_K: sc_a (S_a - 32 s') + sc_b (S_b - 32 (s - s')) */
            const int32_t sa = x->s16[at], sb = x->s[at] - sa, o = id_offset16(f);
            Si = _mm512_add_epi32(_mm512_mullo_epi32(p->sca, _mm512_sub_epi32(s0, _mm512_set1_epi32(o * sa))),
                                  _mm512_mullo_epi32(p->scb, _mm512_sub_epi32(s1, _mm512_set1_epi32(o * sb))));
        } else {
            Si = _mm512_add_epi32(s0, s1);
        }
        const __m512 S = _mm512_cvtepi32_ps(Si);
        if (id_has_min(f)) y = _mm512_fmadd_ps(p->m, _mm512_set1_ps(x->sd[at]), y);
        acc[i] = _mm512_fmadd_ps(S, _mm512_mul_ps(p->d, _mm512_set1_ps(x->d[at])), y);
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

/* The operands of the block holding group g (g a multiple of id_span(f)): out[j] for its group g + j, j <
 * id_span(f); the factors read once per block (id_strip_factors). One function per ISA, the kind a constant in each
 * case and a super-block's 8 groups unrolled (each group's shifts and selects constants), so the tiles of every row
 * count share it. */
ID_512 __attribute__((noinline)) static void prep512_block(int f, const uint8_t *const *rows, int g, Prep512 *out) {
#define PREP(F, _)                                                                                           \
    case F: {                                                                                                \
        Factors8 ka[8], kb[8];                                                                               \
        id_strip_factors(F, rows, g, ka);                                                                    \
        id_strip_factors(F, rows + 8, g, kb);                                                                \
        _Pragma("GCC unroll 8") for (int j = 0; j < id_span(F); j++) prep512(F, rows, g + j, &ka[j], &kb[j], &out[j]); \
        break;                                                                                               \
    }
    switch (f) { ID_EACH_KIND(PREP, 0) }
#undef PREP
}

/* R rows x every group, the operands read from prep (M > ID_TILE), or made here per block into a local array: a
 * 32-block's inline, a super-block's 8 groups at once (prep512_block). The 256-bit tile makes a 32-block's in a
 * register variable instead: each form measured faster in its own ISA (docs/integer-dot.md, "Panels: a super-block's
 * operands made at once"). */
ID_512 ID_INLINE void tile512(int f, const QRows *x, int m0, int R, const uint8_t *const *rows,
                              const Prep512 *prep, __m512 *acc) {
    if (prep) {
        for (int g = 0; g < x->G; g++) rows512(f, x, m0, g, &prep[g], acc, R);
        return;
    }
    for (int g = 0; g < x->G; g += id_span(f)) {
        Prep512 block[8];
        if (id_super(f)) {
            prep512_block(f, rows, g, block);
        } else { /* a 32-block: made here (a call costs more) */
            Factors8 ka, kb;
            id_strip_factors(f, rows, g, &ka);
            id_strip_factors(f, rows + 8, g, &kb);
            prep512(f, rows, g, &ka, &kb, block);
        }
        for (int j = 0; j < id_span(f); j++) rows512(f, x, m0, g + j, &block[j], acc, R);
    }
}

ID_512 static void pair512(int f, const QRows *x, int M, const uint8_t *const *rows, const float *bias,
                           const float *Rr, int ldr, float *Y, int ldy, int cols) {
    const int G = x->G;
    Prep512 *prep = NULL;
    if (M > ID_TILE) {
        prep = scratch_get(&id_w_scratch, sizeof(Prep512) * (size_t)G);
        if (!prep) return; /* cannot happen for any K a model has (G * 896 bytes); Y is left as it was */
        for (int g = 0; g < G; g += id_span(f)) prep512_block(f, rows, g, &prep[g]);
    }
    __m512 acc[ID_TILE];
    for (int m0 = 0; m0 < M; m0 += ID_TILE) {
        const int R = M - m0 < ID_TILE ? M - m0 : ID_TILE;
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
#define KIND(F, N)                                                                                           \
    case F: tile512(F, x, m0, N, rows, prep, acc); break;
#define TILE(N)                                                                                              \
    case N:                                                                                                  \
        switch (f) { ID_EACH_KIND(KIND, N) }                                                                    \
        break;
        switch (R) { TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) }
#undef TILE
#undef KIND
        store512(acc, R, bias, Rr, ldr, Y, ldy, m0, cols);
    }
}

/* The 8 row pointers of panel p (rows past N: its last row again). */
static inline void id_panel_rows(const uint8_t *W, size_t row_bytes, int N, int p, const uint8_t **rows) {
    for (int c = 0; c < ID_PANEL; c++) {
        const int n = p * ID_PANEL + c < N ? p * ID_PANEL + c : N - 1;
        rows[c] = W + (size_t)n * row_bytes;
    }
}

ID_512 static void range512(int f, const QRows *x, const uint8_t *W, const float *bias, const float *Rr, int ldr,
                            float *Y, int ldy, int M, int N, int p0, int p1) {
    const size_t row_bytes = id_row_bytes(f, x->G);
    for (int p = p0; p < p1; p += 2) {
        const int np = p + 1 < p1 ? 2 : 1, n0 = p * ID_PANEL; /* one panel: the next is another thread's, or none */
        const int cols = N - n0 < np * ID_PANEL ? N - n0 : np * ID_PANEL;
        const uint8_t *rows[2 * ID_PANEL];
        id_panel_rows(W, row_bytes, N, p, rows);
        id_panel_rows(W, row_bytes, N, np == 2 ? p + 1 : p, rows + ID_PANEL); /* a lone panel: its rows twice */
        pair512(f, x, M, rows, bias ? bias + n0 : NULL, Rr ? Rr + n0 : NULL, ldr, Y + n0, ldy, cols < 0 ? 0 : cols);
    }
}

/* ================ 256-bit: a panel per register (AVX-VNNI, or AVX2 maddubs) ================ */

typedef struct {
    __m256i w[8], sgn[8];
    Factors8 k;
} Prep256;

/* Block g's operands for the chosen step: VNNI offsets signed weights (Q8_0, IQ4_*) to u8; AVX2 keeps them for the
 * sign and multiplies their magnitudes. */
ID_INLINE void prep256(int f, int vnni, const uint8_t *const *rows, int g, const Factors8 *k, Prep256 *p) {
    id_operands(f, rows, g, p->w);
    if (id_signed(f))
        for (int j = 0; j < 8; j++) {
            if (vnni) {
                p->w[j] = _mm256_xor_si256(p->w[j], _mm256_set1_epi8((char)0x80));
            } else {
                p->sgn[j] = p->w[j];
                p->w[j] = _mm256_abs_epi8(p->w[j]);
            }
        }
    p->k = *k;
}

/* The operands of the block holding group g, out[j] for its group g + j (as prep512_block: one function, the kind
 * and vnni constants in each case, a super-block's groups unrolled). */
__attribute__((noinline)) static void prep256_block(int f, int vnni, const uint8_t *const *rows, int g, Prep256 *out) {
#define PREP(F, VNNI)                                                                                          \
    case F: {                                                                                                  \
        Factors8 k[8];                                                                                         \
        id_strip_factors(F, rows, g, k);                                                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < id_span(F); j++) prep256(F, VNNI, rows, g + j, &k[j], &out[j]); \
        break;                                                                                                 \
    }
    if (vnni) {
        switch (f) { ID_EACH_KIND(PREP, 1) }
    } else {
        switch (f) { ID_EACH_KIND(PREP, 0) }
    }
#undef PREP
}

/* One dot-product step: s += sum over each lane's 4 (u8 w, s8 x) pairs. */
ID_VNNI ID_INLINE __m256i dot_vnni(__m256i s, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(s, w, x); }

ID_INLINE __m256i dot_avx2(__m256i s, __m256i w, __m256i x) {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* R rows x one block; VNNI: the AVX-VNNI step, else maddubs (signed weights: w = |w|, the sign moved onto x). */
#define ROWS256(NAME, ATTR, DOT, VNNI)                                                                            \
    ATTR ID_INLINE void NAME(int f, const QRows *x, int m0, int g, const Prep256 *p, __m256 *acc, int R) {        \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                    \
            const size_t at = (size_t)(m0 + i) * x->G + g;                                                       \
            const int32_t *xq = (const int32_t *)(x->q + at * ID_GROUP);                                         \
            /* s0: k 0-15 (quads 0-3), s1: k 16-31 (4-7); integer sums: exact in any order */                    \
            __m256i s0 = _mm256_set1_epi32(id_start(f, VNNI, x->s[at])), s1 = _mm256_setzero_si256();            \
            if (VNNI || id_i16_quads(f) == 1) {                                                                  \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                            \
                    __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 4]);                    \
                    if (!VNNI && id_signed(f))                                                                   \
                        x0 = _mm256_sign_epi8(x0, p->sgn[j]), x1 = _mm256_sign_epi8(x1, p->sgn[j + 4]);          \
                    s0 = DOT(s0, p->w[j], x0);                                                                   \
                    s1 = DOT(s1, p->w[j + 4], x1);                                                               \
                }                                                                                                \
            } else { /* AVX2, unsigned weights: id_i16_quads(f) quads' pair sums added in int16, then widened */ \
                const int n = id_i16_quads(f), half = n < 4 ? n : 4; /* quads per half (k 0-15, 16-31) */        \
                const __m256i ones = _mm256_set1_epi16(1);                                                       \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j += half) {                                      \
                    __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();                            \
                    _Pragma("GCC unroll 4") for (int u = j; u < j + half; u++) {                                 \
                        h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(p->w[u], _mm256_set1_epi32(xq[u])));      \
                        h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(p->w[u + 4], _mm256_set1_epi32(xq[u + 4]))); \
                    }                                                                                            \
                    if (n == 8) { /* both halves in one int16 sum, widened once (s1 stays 0) */                  \
                        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_add_epi16(h0, h1), ones));            \
                    } else {                                                                                     \
                        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(h0, ones));                                  \
                        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(h1, ones));                                  \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
            acc[i] = id_update256(f, s0, s1, &p->k, x, at, acc[i]);                                              \
        }                                                                                                        \
    }

ROWS256(rows_vnni, ID_VNNI, dot_vnni, 1)
ROWS256(rows_avx2, , dot_avx2, 0)
#undef ROWS256

#define PANEL256(NAME, ATTR, ROWS, VNNI)                                                                          \
    ATTR ID_INLINE void NAME##_tile(int f, const QRows *x, int m0, int R, const uint8_t *const *rows,             \
                                    const Prep256 *prep, __m256 *acc) {                                          \
        if (prep || !id_super(f)) { /* operands from prep, or a 32-block's made here, in registers */            \
            for (int g = 0; g < x->G; g++) {                                                                     \
                Prep256 one;                                                                                     \
                if (!prep) {                                                                                     \
                    Factors8 k;                                                                                  \
                    id_strip_factors(f, rows, g, &k);                                                            \
                    prep256(f, VNNI, rows, g, &k, &one);                                                         \
                }                                                                                                \
                ROWS(f, x, m0, g, prep ? &prep[g] : &one, acc, R);                                               \
            }                                                                                                    \
            return;                                                                                              \
        }                                                                                                        \
        for (int g = 0; g < x->G; g += 8) { /* a super-block's 8 groups made at once (prep256_block) */          \
            Prep256 block[8];                                                                                    \
            prep256_block(f, VNNI, rows, g, block);                                                              \
            for (int j = 0; j < 8; j++) ROWS(f, x, m0, g + j, &block[j], acc, R);                                \
        }                                                                                                        \
    }                                                                                                            \
    ATTR static void NAME(int f, const QRows *x, int M, const uint8_t *const *rows, const float *bias,           \
                          const float *Rr, int ldr, float *Y, int ldy, int cols) {                               \
        const int G = x->G;                                                                                      \
        Prep256 *prep = NULL;                                                                                    \
        if (M > ID_TILE) {                                                                                       \
            prep = scratch_get(&id_w_scratch, sizeof(Prep256) * (size_t)G);                                      \
            if (!prep) return;                                                                                   \
            for (int g = 0; g < G; g += id_span(f)) prep256_block(f, VNNI, rows, g, &prep[g]);                     \
        }                                                                                                        \
        __m256 acc[ID_TILE];                                                                                     \
        float tmp[8];                                                                                            \
        for (int m0 = 0; m0 < M; m0 += ID_TILE) {                                                                \
            const int R = M - m0 < ID_TILE ? M - m0 : ID_TILE;                                                   \
            for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();                                            \
            switch (R) {                                                                                         \
            case 1: NAME##_TILES(1) break;                                                                       \
            case 2: NAME##_TILES(2) break;                                                                       \
            case 3: NAME##_TILES(3) break;                                                                       \
            case 4: NAME##_TILES(4) break;                                                                       \
            case 5: NAME##_TILES(5) break;                                                                       \
            case 6: NAME##_TILES(6) break;                                                                       \
            case 7: NAME##_TILES(7) break;                                                                       \
            default: NAME##_TILES(8)                                                                             \
            }                                                                                                    \
            for (int i = 0; i < R; i++) {                                                                        \
                _mm256_storeu_ps(tmp, acc[i]);                                                                   \
                const size_t mm = (size_t)(m0 + i);                                                              \
                id_store(tmp, bias, Rr ? Rr + mm * ldr : NULL, Y + mm * ldy, cols);                              \
            }                                                                                                    \
        }                                                                                                        \
    }

#define panel_vnni_KIND(F, N)                                                                                      \
    case F: panel_vnni_tile(F, x, m0, N, rows, prep, acc); break;
#define panel_avx2_KIND(F, N)                                                                                      \
    case F: panel_avx2_tile(F, x, m0, N, rows, prep, acc); break;
#define panel_vnni_TILES(N) switch (f) { ID_EACH_KIND(panel_vnni_KIND, N) }
#define panel_avx2_TILES(N) switch (f) { ID_EACH_KIND(panel_avx2_KIND, N) }

PANEL256(panel_vnni, ID_VNNI, rows_vnni, 1)
PANEL256(panel_avx2, , rows_avx2, 0)
#undef PANEL256
#undef panel_vnni_TILES
#undef panel_avx2_TILES
#undef panel_vnni_KIND
#undef panel_avx2_KIND

static void range256(int isa, int f, const QRows *x, const uint8_t *W, const float *bias, const float *Rr, int ldr,
                     float *Y, int ldy, int M, int N, int p0, int p1) {
    const size_t row_bytes = id_row_bytes(f, x->G);
    for (int p = p0; p < p1; p++) {
        const int n0 = p * ID_PANEL, cols = N - n0 < ID_PANEL ? N - n0 : ID_PANEL;
        const uint8_t *rows[ID_PANEL];
        id_panel_rows(W, row_bytes, N, p, rows);
        const float *b = bias ? bias + n0 : NULL, *r = Rr ? Rr + n0 : NULL;
        if (isa == ISA_AVXVNNI) panel_vnni(f, x, M, rows, b, r, ldr, Y + n0, ldy, cols);
        else panel_avx2(f, x, M, rows, b, r, ldr, Y + n0, ldy, cols);
    }
}

#include "int_rows.c" /* the row path: 1 to ID_ROWS_MAX rows */
#include "int_packed.c" /* packed Q4_K panels */

/* ---------------- entry points ---------------- */

static int id_row_max = ID_ROWS_MAX; /* steps of up to this many rows take the row path (int_dot_row_path) */

/* want < 0: report; else steps of up to min(want, ID_ROWS_MAX) rows take the row path (0: none; tests and
 * benchmarks compare it with the panel path this way). Returns the old value. */
int int_dot_row_path(int want) {
    if (want < 0) return __atomic_load_n(&id_row_max, __ATOMIC_RELAXED);
    return __atomic_exchange_n(&id_row_max, want < ID_ROWS_MAX ? want : ID_ROWS_MAX, __ATOMIC_RELAXED);
}

static void id_range(const QRows *x, int f, const uint8_t *W, const float *bias, const float *R, int ldr, float *Y,
                     int ldy, int M, int N, int p0, int p1) {
    const int isa = __atomic_load_n(&id_isa, __ATOMIC_RELAXED);
    if (M <= __atomic_load_n(&id_row_max, __ATOMIC_RELAXED))
        id_rows_range(isa, f, x, W, bias, R, ldr, Y, ldy, M, N, p0, p1); /* 1 to 4 rows: int_rows.c */
    else if (isa == ISA_AVX512VNNI) range512(f, x, W, bias, R, ldr, Y, ldy, M, N, p0, p1);
    else range256(isa, f, x, W, bias, R, ldr, Y, ldy, M, N, p0, p1);
}

/* Units [p0, p1) of Y = X W^T (+ bias) (+ R) for W of GGUF type `type` (K whole blocks) in the file's rows (units:
 * panels of 8 columns), or packed by int_dot_pack (`type` | FMT_PACKED, int_packed.c: panels of PK_COLS), X
 * quantized here into this thread's own buffer (every thread of a step quantizes the same rows the same way: no
 * barrier). decode_step.c's linears call this. Returns -1 when a buffer cannot be allocated or the type or shape is
 * not this path's (Y untouched), else 0. */
static int int_dot_linear(int type, const float *X, int ldx, const uint8_t *W, const float *bias, const float *R,
                          int ldr, float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    const int packed = id_packed(type), f = id_kind(packed ? type & ~FMT_PACKED : type);
    if (f < 0 || K % (id_super(f) ? 8 * ID_GROUP : ID_GROUP)) return -1;
    if (packed && !int_dot_packable(type & ~FMT_PACKED, N, K)) return -1;
    void *mem = scratch_get(&id_act_scratch, qrows_bytes(M, K));
    float(*out)[PK_COLS] = packed ? pk_out(M) : NULL;
    if (!mem || (packed && !out)) return -1;
    QRows x = qrows_carve(mem, M, K);
    quantize_rows(X, ldx, M, K, &x);
    if (packed) id_packed_range(f, &x, W, bias, R, ldr, Y, ldy, M, p0, p1, out);
    else id_range(&x, f, W, bias, R, ldr, Y, ldy, M, N, p0, p1);
    return 0;
}

/* Y = X W^T (+ bias) (+ R) by integer dot products, W as int_dot_linear takes it (a GGUF type's rows, or packed:
 * `type` | FMT_PACKED), on nthreads threads splitting the panels. Returns 0, or -1 when a buffer cannot be
 * allocated or the type or shape is not this path's. */
int int_dot_gemm(int type, const float *X, int ldx, const uint8_t *W, const float *bias, const float *R, int ldr,
                 float *Y, int ldy, int M, int K, int N, int nthreads) {
    const int packed = id_packed(type), f = id_kind(packed ? type & ~FMT_PACKED : type);
    if (f < 0 || K % (id_super(f) ? 8 * ID_GROUP : ID_GROUP)) return -1;
    if (packed && !int_dot_packable(type & ~FMT_PACKED, N, K)) return -1;
    if (M <= 0 || N <= 0) return 0;
    void *mem = malloc(qrows_bytes(M, K));
    if (!mem) return -1;
    QRows x = qrows_carve(mem, M, K);
    quantize_rows(X, ldx, M, K, &x);
    const int npanels = packed ? N / PK_COLS : (N + ID_PANEL - 1) / ID_PANEL;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > npanels) nthreads = npanels;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    { /* panels split as decode_step.c splits them (a range may start or end mid-pair) */
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int p0 = (int)((long)npanels * t / nt), p1 = (int)((long)npanels * (t + 1) / nt);
        float(*out)[PK_COLS] = packed ? pk_out(M) : NULL;
        if (packed && !out) failed = 1;
        else if (p0 < p1 && packed) id_packed_range(f, &x, W, bias, R, ldr, Y, ldy, M, p0, p1, out);
        else if (p0 < p1) id_range(&x, f, W, bias, R, ldr, Y, ldy, M, N, p0, p1);
    }
    free(mem);
    return failed ? -1 : 0;
}
