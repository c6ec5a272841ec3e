/* The row path of int_dot.c: steps of 1 to ID_ROWS_MAX activation rows (a decode step of a few sequences).
 *
 * Why: such a step streams every weight once and does little arithmetic per byte, so its floor is the memory
 * bandwidth. The panel path (int_dot.c) first transposes each 32-weight group of 8 output columns into k-quads
 * (24 shuffles a group), which pays off when 8 or more rows share them but is much of the work at 1 row. Here each
 * column's group stays as it lies in the file: one register of 32 k-ordered bytes, multiplied with the activation
 * row's 32 bytes (AVX2: vpmaddubsw, VNNI: vpdpbusd), and the 8 columns' products are summed across k by a tree
 * (unpack and add: cheaper than vphadd on Zen 3) that leaves the 8 columns' integer sums in the 8 lanes of one
 * register, the panel path's layout.
 *
 * Math: exactly int_dot.c's (the header there): per row, column and group the same exact integer S (Q6_K: its two
 * sub-block sums S_a, S_b, which the tree gives apart before its last add) and the same fp32 operations in the same
 * order, so the results are bit for bit the panel path's at any row count, thread count and ISA (tests/test_int_dot.py
 * checks this and the float64 reference).
 *
 * Per strip of 8 columns (a panel: the last one's missing columns read its last column again, outputs dropped), per
 * group g: the 8 columns' values (int_dot.c's id_values) and factors (int_dot.c's id_strip_factors, read 8 blocks at
 * once or once per K-quant super-block), then per row i (R <= ID_ROWS_MAX, a constant
 * after inlining) 8 products of 32 bytes, the tree, and the panel path's fp32 update. Overflow bounds (|q| <= 127
 * for x): vpmaddubsw's pairs of u8 w x s8 q never saturate (Q8_0 takes |w| <= 128 with the sign moved onto x:
 * <= 32512, the IQ4 types' |w| <= 127 32258; the nibble types 3810; the 5-bit types 7874; Q6_K 16002; Q3_K 1778,
 * Q2_K 762); the unsigned types add two pairs in int16 before widening (<= 7620, 15748, Q6_K 32004 < 32767), the
 * signed ones (Q8_0, IQ4_NL, IQ4_XS) widen first.
 *
 * Kernels, one code path instantiated per ISA: AVX2 (vpmaddubsw, signed weights by the sign trick), AVX-VNNI and
 * AVX-512 VNNI (256-bit vpdpbusd, VEX and EVEX encodings; signed weights offset to u8, S starting at -128 s as in
 * the panel path).
 * Included by int_dot.c after its panel kernels; its id_range calls id_rows_range for M <= int_dot_row_path's rows.
 */

#define ID_ROWS_MAX 4 /* steps of up to this many rows take the row path */
#ifndef ID_ROWS_PREFETCH
#define ID_ROWS_PREFETCH 1 /* prefetch the next strip (id_rows_prefetch); 0: none (docs/integer-dot.md) */
#endif

/* Byte offset of group g in a row (a super-block's groups spread evenly over it: for prefetching only). */
static inline size_t id_group_at(int f, int g) {
    if (id_super(f)) return (size_t)(g >> 3) * id_block_bytes(f) + (size_t)(g & 7) * id_block_bytes(f) / 8;
    return (size_t)g * id_block_bytes(f);
}

/* Prefetch for a strip's group g: the next strip, linearly. A strip's 8 columns are 8 consecutive weight rows, one
 * contiguous run of `bytes` (8 row_bytes) that the next strip follows, but it reads them as 8 short interleaved
 * streams (a 2048-wide Q4_K row is 18 cache lines), which the hardware prefetchers pick up late and a prefetch a
 * fixed distance ahead of each column misses at every strip's start. At group g the strip has read 8
 * id_group_at(f, g) of its bytes; the lines that far into the next strip are fetched, as many a step as that point
 * advances (8 groups' bytes, + 16 for a super-block's uneven spread), so the whole next strip is in L2 before it
 * starts. Into L2 (T1), not L1: a 8192-wide strip is 37 KB, most of an L1, and fetched a strip ahead it evicted the
 * current strip's lines (docs/integer-dot.md, "Prefetching into L2"). strip = the first column's row (rows[0]:
 * W + 8 p row_bytes). */
ID_INLINE void id_rows_prefetch(int f, const uint8_t *strip, size_t bytes, int g) {
    if (!ID_ROWS_PREFETCH) return;
    const int lines = (8 * id_block_bytes(f) / (id_super(f) ? 8 : 1) + 16 + 63) / 64;
    const char *at = (const char *)strip + bytes + 8 * id_group_at(f, g);
    for (int l = 0; l < lines; l++) _mm_prefetch(at + 64 * l, _MM_HINT_T1);
}

/* One column-group's 8 int32 quad sums (4 k each, k-ordered) added to s: int_dot.c's dot_avx2 (vpmaddubsw to pairs
 * then vpmaddwd) and dot_vnni (VEX vpdpbusd), and the EVEX form for the AVX-512 VNNI kernel: */
ID_512 ID_INLINE __m256i dot_512(__m256i s, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(s, w, x); }

/* A column pair's products -> [a, b, a, b | a, b, a, b]: lane 2 e + 0 / 1 a part of column a's / b's sum, the low
 * 128 bits over k 0-15, the high over k 16-31. From int32 quad sums (VNNI, AVX2's Q8_0): */
ID_INLINE __m256i pair32(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* ... and from vpmaddubsw's int16 pair sums (the 4- and 6-bit types): pairs to quads in int16 (each 32-bit lane
 * two of one column's), then widened. */
ID_INLINE __m256i pair16(__m256i a, __m256i b) {
    const __m256i q = _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    return _mm256_madd_epi16(q, _mm256_set1_epi16(1));
}

/* The tree's last levels: four column pairs (t[j]: columns 2 j, 2 j + 1, as pair32 / pair16 leave them) -> lo = the
 * 8 columns' sums over k 0-15, hi = over k 16-31, column c in lane c. */
ID_INLINE void id_tree(const __m256i t[4], __m256i *lo, __m256i *hi) {
    const __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
    const __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
    *lo = _mm256_permute2x128_si256(u0, u1, 0x20); /* columns 0-3 | 4-7 */
    *hi = _mm256_permute2x128_si256(u0, u1, 0x31);
}

/* A strip's group g: R rows x 8 columns (cols[c]: column c's row of blocks; blocks[c]: the block holding g, which
 * is its group j: a super-block's g & 7, else blocks = cols and j = g), acc[i] += the group's contribution to row
 * i (int_dot.c's id_update256, as the panel path). DOT: dot_* (s + quad sums); VNNI: 1 for vpdpbusd (signed
 * weights offset to u8), 0 for vpmaddubsw (signed weights by the sign trick, the other types' pairs added in int16).
 * From 2 rows (where x is the same for all 8 columns: not AVX2's signed types) the tree's first level moves onto the
 * weights, made once for all rows: a column pair's products interleaved (pair32) are the products of the pair's
 * interleaved k-quads with x's quads each repeated, unpacklo_epi32(a, b) = dot(unpacklo_epi32(w_a, w_b),
 * unpacklo_epi32(x, x)) (likewise hi), so a row's pair is two dot steps, the second adding to the first. */
#define ROWSTRIP(NAME, ATTR, DOT, VNNI)                                                                          \
    ATTR ID_INLINE void NAME(int f, const QRows *x, int R, const uint8_t *const *cols, const uint8_t *const *blocks, \
                             int j, int g, const Factors8 *kp, __m256 *acc) {                                   \
        __m256i w[8], sgn[8], wl[4], wh[4];                                                                      \
        const __m256i zero = _mm256_setzero_si256();                                                             \
        const int woven = R >= 2 && (VNNI || !id_signed(f)); /* the pairs' first level made on the weights */   \
        id_rows_prefetch(f, cols[0], 8 * id_row_bytes(f, x->G), g);                                               \
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {                                                    \
            w[c] = VNNI ? id_values_u8(f, blocks[c], j) : id_values(f, blocks[c], j);                            \
            if (id_signed(f) && !VNNI) sgn[c] = w[c], w[c] = _mm256_abs_epi8(w[c]);                              \
        }                                                                                                        \
        if (woven)                                                                                               \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                                \
                wl[p] = _mm256_unpacklo_epi32(w[2 * p], w[2 * p + 1]);                                           \
                wh[p] = _mm256_unpackhi_epi32(w[2 * p], w[2 * p + 1]);                                           \
            }                                                                                                    \
        const Factors8 k = *kp;                                                                                  \
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                                                    \
            const size_t at = (size_t)i * x->G + g;                                                              \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + at * ID_GROUP));                      \
            const __m256i xl = _mm256_unpacklo_epi32(xv, xv), xh = _mm256_unpackhi_epi32(xv, xv);                \
            __m256i h[4], lo, hi;                                                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                                \
                const __m256i *wj = w + 2 * j;                                                                   \
                if (woven && VNNI) {                                                                             \
                    h[j] = DOT(DOT(zero, wl[j], xl), wh[j], xh);                                                 \
                } else if (woven) {                                                                              \
                    /* int16: 4 products of one column, as pair16 */                                             \
                    const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(wl[j], xl),                          \
                                                       _mm256_maddubs_epi16(wh[j], xh));                         \
                    h[j] = _mm256_madd_epi16(q, _mm256_set1_epi16(1));                                           \
                } else if (VNNI) {                                                                               \
                    h[j] = pair32(DOT(zero, wj[0], xv), DOT(zero, wj[1], xv));                                   \
                } else if (id_signed(f)) {                                                                       \
                    h[j] = pair32(DOT(zero, wj[0], _mm256_sign_epi8(xv, sgn[2 * j])),                            \
                                  DOT(zero, wj[1], _mm256_sign_epi8(xv, sgn[2 * j + 1])));                       \
                } else {                                                                                         \
                    h[j] = pair16(_mm256_maddubs_epi16(wj[0], xv), _mm256_maddubs_epi16(wj[1], xv));              \
                }                                                                                                \
            }                                                                                                    \
            id_tree(h, &lo, &hi);                                                                                \
            lo = _mm256_add_epi32(lo, _mm256_set1_epi32(id_start(f, VNNI, x->s[at])));                           \
            acc[i] = id_update256(f, lo, hi, &k, x, at, acc[i]);                                                 \
        }                                                                                                        \
    }

/* Strips [p0, p1) of Y = X W^T (+ bias) (+ R) for M <= ID_ROWS_MAX rows, per ISA. */
#define ROWRANGE(NAME, ATTR, STRIP)                                                                              \
    ATTR ID_INLINE void NAME##_strip(int f, const QRows *x, int R, const uint8_t *const *cols, __m256 *acc) {     \
        for (int g = 0; g < x->G; g += id_span(f)) {                                                             \
            Factors8 k[8];                                                                                       \
            id_strip_factors(f, cols, g, k);                                                                     \
            if (!id_super(f)) {                                                                                  \
                STRIP(f, x, R, cols, cols, g, g, k, acc);                                                        \
                continue;                                                                                        \
            }                                                                                                    \
            /* a super-block: its 8 groups (unrolled: each group's shifts are immediates) from its 8 columns' \
             * blocks, addressed once */                                                                         \
            const uint8_t *blocks[ID_PANEL];                                                                     \
            for (int c = 0; c < ID_PANEL; c++) blocks[c] = cols[c] + (size_t)(g >> 3) * id_block_bytes(f);       \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) STRIP(f, x, R, cols, blocks, j, g + j, &k[j], acc); \
        }                                                                                                        \
    }                                                                                                            \
    ATTR static void NAME(int f, const QRows *x, const uint8_t *W, const float *bias, const float *Rr, int ldr,  \
                          float *Y, int ldy, int M, int N, int p0, int p1) {                                     \
        const size_t row_bytes = id_row_bytes(f, x->G);                                                          \
        for (int p = p0; p < p1; p++) {                                                                          \
            const int n0 = p * ID_PANEL, cols = N - n0 < ID_PANEL ? N - n0 : ID_PANEL;                           \
            const uint8_t *rows[ID_PANEL];                                                                       \
            id_panel_rows(W, row_bytes, N, p, rows);                                                             \
            __m256 acc[ID_ROWS_MAX];                                                                             \
            for (int i = 0; i < ID_ROWS_MAX; i++) acc[i] = _mm256_setzero_ps();                                  \
            switch (f * ID_ROWS_MAX + M - 1) { /* the type and the row count, constants in each kernel */       \
                ID_EACH_KIND(ROWCASES, NAME)                                                                     \
            }                                                                                                    \
            float tmp[8];                                                                                        \
            for (int i = 0; i < M; i++) {                                                                        \
                _mm256_storeu_ps(tmp, acc[i]);                                                                   \
                const float *b = bias ? bias + n0 : NULL, *r = Rr ? Rr + (size_t)i * ldr + n0 : NULL;            \
                id_store(tmp, b, r, Y + (size_t)i * ldy + n0, cols);                                             \
            }                                                                                                    \
        }                                                                                                        \
    }
#define ROWCASE(NAME, F, R)                                                                                      \
    case F * ID_ROWS_MAX + R - 1: NAME##_strip(F, x, R, rows, acc); break;
#define ROWCASES(F, NAME) ROWCASE(NAME, F, 1) ROWCASE(NAME, F, 2) ROWCASE(NAME, F, 3) ROWCASE(NAME, F, 4)

ROWSTRIP(strip_avx2, , dot_avx2, 0)
ROWSTRIP(strip_vnni, ID_VNNI, dot_vnni, 1)
ROWSTRIP(strip_512, ID_512, dot_512, 1)
ROWRANGE(id_rows_avx2, , strip_avx2)
ROWRANGE(id_rows_vnni, ID_VNNI, strip_vnni)
ROWRANGE(id_rows_512, ID_512, strip_512)
#undef ROWSTRIP
#undef ROWRANGE
#undef ROWCASE
#undef ROWCASES

/* Panels [p0, p1) of M <= ID_ROWS_MAX rows on the ISA in use. */
static void id_rows_range(int isa, int f, const QRows *x, const uint8_t *W, const float *bias, const float *Rr,
                          int ldr, float *Y, int ldy, int M, int N, int p0, int p1) {
    if (isa == ISA_AVX512VNNI) id_rows_512(f, x, W, bias, Rr, ldr, Y, ldy, M, N, p0, p1);
    else if (isa == ISA_AVXVNNI) id_rows_vnni(f, x, W, bias, Rr, ldr, Y, ldy, M, N, p0, p1);
    else id_rows_avx2(f, x, W, bias, Rr, ldr, Y, ldy, M, N, p0, p1);
}
