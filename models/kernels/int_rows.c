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
 * group g: the 8 columns' values (int_dot.c's id_values) and factors (id_strip_factors: the same values as
 * id_factors, read 8 blocks at once or once per K-quant super-block), then per row i (R <= ID_ROWS_MAX, a constant
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
 * Q4_K / Q5_K: header d | dmin | scales[12] = 16 bytes, words w1 = bytes 0-3, w2 = 4-7, w3 = 8-11; k4_scale_min
 * lane-wise: sc 0-3 = w1 & 63, m 0-3 = w2 & 63, sc 4-7 = (w3 & 15) | (w1 >> 6) << 4, m 4-7 = (w3 >> 4) | (w2 >> 6)
 * << 4 (per byte). d sc and -(dmin m) as id_factors: one fp32 product each ((-dmin) m is -(dmin m) exactly).
 * Q6_K: scales int8[16] at 192 (word j: scales 4j .. 4j + 3; group s: scales 2s, 2s + 1), d at 208.
 * Q2_K: scales[16] at 0 (word j: sub-blocks 4j .. 4j + 3, sc the low nibble, m the high), d | dmin at 80.
 * Q3_K: scales[12] at 96 as words a0 a1 a2 -> 16 6-bit scales as ggml unpacks them (q3_k_scale, lane-wise: scales
 * 0-3 = a0 & 15 | (a2 & 3) << 4, 4-7 = a1 & 15 | (a2 >> 2 & 3) << 4, 8-11 = a0 >> 4 | (a2 >> 4 & 3) << 4, 12-15 =
 * a1 >> 4 | (a2 >> 6 & 3) << 4, per byte), minus 32; d at 108.
 * IQ4_XS: d | scales_h at 0, scales_l[4] at 4: group s's scale = (scales_l >> 4 s & 15) | (scales_h >> 2 s & 3) << 4,
 * minus 32; d sc one fp32 product, as iq4_xs_scale. Every value is id_factors' for the same group. */
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

/* The factors (int_dot.c's Factors8) of a strip's 8 columns for group g and, for the 256-blocks, every group of g's
 * super-block: k[j] for group g + j, j < id_span(f). The same values as id_factors: the 32-blocks (Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, IQ4_NL) read the 8 blocks' first 4 bytes (d, Q4_1's / Q5_1's m) at once; a super-block's
 * header is read once for its 8 groups (id_super_factors). */
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
