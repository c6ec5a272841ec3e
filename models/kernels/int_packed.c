/* Packed weights for the integer path: Q4_K and Q6_K rows repacked at load into panels of 32 output columns whose
 * bytes are already the operands of vpdpbusd, so a step streams them linearly and multiplies without reshuffling.
 *
 * Why: a step of one row streams every weight once, so its floor is the read bandwidth. The row path (int_rows.c)
 * reads each column's 32-weight group as it lies in the file and sums the 8 lanes of each column's products with a
 * tree. Here the columns' k-quads lie interleaved (the panel path's operand form, made once at load instead of
 * every step): one 64-byte load holds 4 k of 32 columns, each vpdpbusd lane is a column, and there is no tree.
 * Per 64 bytes (128 weights) that is one load, one mask and two vpdpbusd (S on the low nibbles, T on whole bytes:
 * T = S + 16 S', so the high nibbles' column needs no unpacking). On a Xeon: 2.2x the row path's rate from L2 on
 * one core; cold, 1.05-1.14x at one row and 1.3-1.6x at 8 (docs/integer-dot.md, "Packed Q4_K", "Packed Q6_K").
 *
 * Q4_K layout: a panel of 32 rows of W (output columns n0 .. n0 + 31), super-block b of each row (144 bytes: d |
 * dmin | scales[12] | qs[128], quants/q4_k.h), becomes 4608 bytes (32 x 144: the same 4-bit weights, scales and
 * factors, rearranged; no value changes):
 *     [0, 64)       d of the 32 columns (fp16)
 *     [64, 128)     dmin of the 32 columns (fp16)
 *     [128, 512)    scales: byte r of column c at 128 + 32 r + c (r < 12)
 *     [512, 4608)   quads: 64 bytes for each k-quad (k / 4 < 64), byte 4 c + k % 4 (c < 16) holding column c's
 *                   weight k in its low nibble and column c + 16's in its high one
 * Q6_K layout: super-block b's 32 blocks (210 bytes: ql[128] | qh[64] | scales[16] | d, quants/q6_k.h) become 6720
 * bytes, each group of 32 k one linear run:
 *     [0, 64)       d of the 32 columns (fp16)
 *     [64, 576)     scales: int8 scale s (s < 16, of k 16 s .. 16 s + 15) of column c at 64 + 32 s + c
 *     576 + 768 g   group g (k 32 g .. 32 g + 31): its 8 quads of low 4 bits as Q4_K's quads (512 bytes), then its
 *                   4 pairs of quads' high 2 bits (256): byte 4 c + k % 4 of pair j holds, from bit 0, column c's and
 *                   column c + 16's high bits of quad 2 j, then of quad 2 j + 1
 * Panels follow each other, super-blocks in order inside a panel: one panel is one contiguous run of 32 row_bytes.
 *
 * Math: int_dot.c's header, exactly: per row, column and group the same integer S (Q6_K: per sub-block of 16 the
 * exact sum of q x, then S = sc_a (S_a - 32 s') + sc_b (S_b - 32 (s - s'))) and the same fp32 operations in the
 * same order (y = fma(-(dmin m), s dx, y); y = fma(float(S), (d sc) dx, y), groups in increasing order; then
 * + bias, + R), so a packed tensor gives the bits the unpacked one gives on any path, ISA, row and thread count
 * (tests/test_int_packed.py). Forms: AVX-512 VNNI (16 lanes of two columns a register), AVX-VNNI and AVX2
 * (maddubs, on both nibbles unpacked; Q4_K: 8 int16 quad sums added before one widening, as int_dot.c's
 * id_i16_quads allows; Q6_K: the 6-bit weights made whole, two quads added) on each quad's two halves of 8 lanes.
 * Included by int_dot.c after the row path.
 */

#define PK_COLS 32
#define PK_TILE 4 /* rows per register tile (the 256-bit forms: 2, PK_TILE256) */
#define PK_TILE256 2
#define FMT_PACKED 0x100 /* decode_step.c's LinPart.fmt of a packed part: the GGUF type | FMT_PACKED */
#define PK_QUANTS 512    /* a packed super-block's header bytes: d, dmin (64 each), scales (12 x 32) */
#define PK6_HEAD 576     /* Q6_K: d (64), scales (16 x 32) */
#define PK6_GROUP 768    /* Q6_K: a group's 8 quads of low nibbles (512) and 4 pairs of high fields (256) */
#define PK6_HIGHS 512    /* Q6_K: the high fields' offset in a group */
#define PK6_TILE 2       /* Q6_K: steps of up to this many rows take pk6_tile512's 4-sums form, in tiles of it */

static inline size_t pk_super_bytes(int f) { return (size_t)PK_COLS * id_block_bytes(f); }

/* 1 for a packed format (a GGUF type | FMT_PACKED): its columns go in panels of PK_COLS */
static inline int id_packed(int fmt) { return fmt >= 0 && (fmt & FMT_PACKED); }

/* 1 when rows of GGUF type `type`, N outputs of K inputs, can be packed (int_dot_pack), else 0. */
int int_dot_packable(int type, int N, int K) {
    return (type == T_Q4_K || type == T_Q6_K) && N > 0 && N % PK_COLS == 0 && K > 0 && K % (8 * ID_GROUP) == 0;
}

/* Column c's 4-bit weight k (< 256) of a Q4_K block: sub-block k / 32, nibble of qs[32 (k / 64) + k % 32]. */
static inline uint8_t pk_nibble(const uint8_t *blk, int k) {
    const uint8_t byte = blk[16 + 32 * (k / 64) + k % 32];
    return (k / 32) % 2 ? byte >> 4 : byte & 15;
}

/* A Q6_K block's weight k (< 256): its low 4 bits and its high 2 (quants/q6_k.h: half h, quarter c, element l). */
static inline uint8_t pk6_low(const uint8_t *blk, int k) {
    const int h = k / 128, c = k % 128 / 32, l = k % 32;
    const uint8_t byte = blk[64 * h + 32 * (c % 2) + l];
    return c < 2 ? byte & 15 : byte >> 4;
}
static inline uint8_t pk6_high(const uint8_t *blk, int k) { return blk[128 + 32 * (k / 128) + k % 32] >> 2 * (k % 128 / 32) & 3; }

/* Super-block b of the 32 columns' blocks blk[] in the packed layout at o (the header comment's). */
static void pk_pack_q4k(const uint8_t *const blk[PK_COLS], uint8_t *o) {
    for (int c = 0; c < PK_COLS; c++) {
        memcpy(o + 2 * c, blk[c], 2);
        memcpy(o + 64 + 2 * c, blk[c] + 2, 2);
        for (int r = 0; r < 12; r++) o[128 + 32 * r + c] = blk[c][4 + r];
    }
    for (int k = 0; k < 256; k++) /* byte 4 c + k % 4 of quad k / 4: column c's k low, c + 16's high */
        for (int c = 0; c < PK_COLS / 2; c++)
            o[PK_QUANTS + 64 * (k / 4) + 4 * c + k % 4] = (uint8_t)(pk_nibble(blk[c], k) | pk_nibble(blk[c + 16], k) << 4);
}

static void pk_pack_q6k(const uint8_t *const blk[PK_COLS], uint8_t *o) {
    for (int c = 0; c < PK_COLS; c++) {
        memcpy(o + 2 * c, blk[c] + 208, 2);
        for (int s = 0; s < 16; s++) o[64 + 32 * s + c] = blk[c][192 + s];
    }
    for (int k = 0; k < 256; k++) {
        uint8_t *grp = o + PK6_HEAD + PK6_GROUP * (k / 32);
        const int q = k % 32 / 4, j = k % 4; /* quad q of the group, its k j */
        for (int c = 0; c < PK_COLS / 2; c++) {
            grp[64 * q + 4 * c + j] = (uint8_t)(pk6_low(blk[c], k) | pk6_low(blk[c + 16], k) << 4);
            const int two = (pk6_high(blk[c], k) | pk6_high(blk[c + 16], k) << 2) << 4 * (q % 2);
            grp[PK6_HIGHS + 64 * (q / 2) + 4 * c + j] |= (uint8_t)two;
        }
    }
}

/* W (N rows of K / 256 Q4_K or Q6_K blocks) -> P in the packed layout (same size); panels split over `threads`
 * threads. Returns 0, or -1 when the type or shape cannot be packed (P untouched). */
int int_dot_pack(int type, const uint8_t *W, uint8_t *P, int N, int K, int threads) {
    if (!int_dot_packable(type, N, K)) return -1;
    const int f = id_kind(type), SB = K / (8 * ID_GROUP), bb = id_block_bytes(f);
    const int panels = N / PK_COLS;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
    for (int p = 0; p < panels; p++)
        for (int b = 0; b < SB; b++) {
            uint8_t *o = P + ((size_t)p * SB + b) * pk_super_bytes(f);
            const uint8_t *blk[PK_COLS];
            for (int c = 0; c < PK_COLS; c++) blk[c] = W + ((size_t)(p * PK_COLS + c) * SB + b) * bb;
            if (f == IDF_Q6_K) {
                memset(o, 0, pk_super_bytes(f)); /* the high fields are or-ed in */
                pk_pack_q6k(blk, o);
            } else {
                pk_pack_q4k(blk, o);
            }
        }
    return 0;
}

/* Block b (of K / 256) of row n of a packed tensor P (type kind f, K inputs a row) in the file's layout: out gets
 * the bytes int_dot_pack read (a packed tied lm_head's token-table lookup reads its rows this way). */
static void pk_unpack_block(int f, const uint8_t *P, int K, int n, int b, uint8_t *out) {
    const int SB = K / (8 * ID_GROUP), c = n % PK_COLS, half = c / 16, cc = c % 16;
    const uint8_t *o = P + ((size_t)(n / PK_COLS) * SB + b) * pk_super_bytes(f);
    memset(out, 0, (size_t)id_block_bytes(f));
    if (f == IDF_Q4_K) {
        memcpy(out, o + 2 * c, 2);
        memcpy(out + 2, o + 64 + 2 * c, 2);
        for (int r = 0; r < 12; r++) out[4 + r] = o[128 + 32 * r + c];
        for (int k = 0; k < 256; k++) {
            const uint8_t byte = o[PK_QUANTS + 64 * (k / 4) + 4 * cc + k % 4], q = half ? byte >> 4 : byte & 15;
            out[16 + 32 * (k / 64) + k % 32] |= (uint8_t)((k / 32) % 2 ? q << 4 : q);
        }
        return;
    }
    memcpy(out + 208, o + 2 * c, 2);
    for (int s = 0; s < 16; s++) out[192 + s] = o[64 + 32 * s + c];
    for (int k = 0; k < 256; k++) {
        const uint8_t *grp = o + PK6_HEAD + PK6_GROUP * (k / 32);
        const int q = k % 32 / 4, h = k / 128, c4 = k % 128 / 32, l = k % 32;
        const uint8_t byte = grp[64 * q + 4 * cc + k % 4], low = half ? byte >> 4 : byte & 15;
        const uint8_t field = grp[PK6_HIGHS + 64 * (q / 2) + 4 * cc + k % 4] >> 4 * (q % 2) & 15;
        out[64 * h + 32 * (c4 % 2) + l] |= (uint8_t)(c4 < 2 ? low : low << 4);
        out[128 + 32 * h + l] |= (uint8_t)((half ? field >> 2 : field & 3) << 2 * c4);
    }
}

/* Row n of a packed tensor P (GGUF type `type`, K inputs a row) back in the file's blocks (row_bytes at out).
 * Returns 0, or -1 for a type or K that cannot have been packed. */
int int_dot_unpack_row(int type, const uint8_t *P, int K, int n, uint8_t *out) {
    if (!int_dot_packable(type, PK_COLS, K) || n < 0) return -1;
    const int f = id_kind(type);
    for (int b = 0; b < K / (8 * ID_GROUP); b++) pk_unpack_block(f, P, K, n, b, out + (size_t)b * id_block_bytes(f));
    return 0;
}

/* The 8 groups' 6-bit scales and mins of 32 columns from a packed super-block's header (k4_scale_min lane-wise: a
 * byte per column, column c in byte c). */
ID_INLINE void pk_scales(const uint8_t *o, __m256i sc[8], __m256i mn[8]) {
    __m256i r[12];
    for (int q = 0; q < 12; q++) r[q] = _mm256_loadu_si256((const __m256i *)(o + 128 + 32 * q));
    const __m256i m63 = _mm256_set1_epi8(63), m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48);
    _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {
        sc[s] = _mm256_and_si256(r[s], m63), mn[s] = _mm256_and_si256(r[s + 4], m63);
        sc[s + 4] = _mm256_or_si256(_mm256_and_si256(r[s + 8], m15), _mm256_and_si256(_mm256_srli_epi16(r[s], 2), m48));
        mn[s + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r[s + 8], 4), m15),
                                    _mm256_and_si256(_mm256_srli_epi16(r[s + 4], 2), m48));
    }
}

/* 8 bytes (lane c: byte c) of column bytes v from byte `at` (a constant multiple of 8), as int32 -> fp32. */
ID_INLINE __m256 pk_bytes_ps256(__m256i v, int at) {
    const __m128i half = at >= 16 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(at % 16 ? _mm_unpackhi_epi64(half, half) : half));
}

/* ---------------- AVX-512 VNNI: 16 lanes, each two columns (c and c + 16) ---------------- */

ID_512 ID_INLINE __m512 pk_neg512(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000)));
}

ID_512 ID_INLINE __m512 pk_bytes_ps512(__m256i v, int hi) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v)));
}

/* Rows r0 .. r0 + R - 1 (R <= PK_TILE, a constant after inlining) of one panel: acc[2 i] (columns 0-15) and
 * acc[2 i + 1] (16-31) over every super-block. Per group, 8 quads: S = sum of vpdpbusd(v & 15, x) is column c's
 * exact integer sum, T = sum of vpdpbusd(v, x) is S + 16 S', so column c + 16's is S' = (T - S) >> 4 (exact: no
 * unpacking of the high nibbles; T <= 4 255 127 per quad lane, no overflow). */
ID_512 ID_INLINE void pk_tile512(const QRows *x, int r0, int R, const uint8_t *panel, __m512 *acc) {
    const int SB = x->G / 8;
    const __m512i m15 = _mm512_set1_epi8(15);
    for (int b = 0; b < SB; b++) {
        const uint8_t *o = panel + (size_t)b * pk_super_bytes(IDF_Q4_K);
        __m512 d[2], ndmin[2];
        for (int h = 0; h < 2; h++) {
            d[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32 * h)));
            ndmin[h] = pk_neg512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 64 + 32 * h))));
        }
        __m256i sc[8], mn[8];
        pk_scales(o, sc, mn);
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
            __m512i S[PK_TILE], T[PK_TILE];
            for (int i = 0; i < R; i++) S[i] = T[i] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) {
                const __m512i v = _mm512_loadu_si512((const void *)(o + PK_QUANTS + 64 * (8 * g + q)));
                const __m512i lo = _mm512_and_si512(v, m15);
                for (int i = 0; i < R; i++) {
                    const uint8_t *xq = (const uint8_t *)x->q + ((size_t)(r0 + i) * x->G + 8 * b + g) * ID_GROUP + 4 * q;
                    const __m512i xb = _mm512_set1_epi32((int)u32_at(xq));
                    S[i] = _mm512_dpbusd_epi32(S[i], lo, xb);
                    T[i] = _mm512_dpbusd_epi32(T[i], v, xb);
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m512 kd = _mm512_mul_ps(d[h], pk_bytes_ps512(sc[g], h));
                const __m512 km = _mm512_mul_ps(ndmin[h], pk_bytes_ps512(mn[g], h));
                for (int i = 0; i < R; i++) {
                    const size_t at = (size_t)(r0 + i) * x->G + 8 * b + g;
                    const __m512i Si = h ? _mm512_srai_epi32(_mm512_sub_epi32(T[i], S[i]), 4) : S[i];
                    acc[2 * i + h] = _mm512_fmadd_ps(km, _mm512_set1_ps(x->sd[at]), acc[2 * i + h]);
                    acc[2 * i + h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Si), _mm512_mul_ps(kd, _mm512_set1_ps(x->d[at])),
                                                     acc[2 * i + h]);
                }
            }
        }
    }
}

/* Q6_K, rows r0 .. r0 + R - 1 (R <= PK_TILE) of one panel: acc[2 i] (columns 0-15), acc[2 i + 1] (16-31). Per
 * sub-block of 16 (4 quads, 2 pairs of high fields h), v a quad's low nibbles, each column's exact sum of q x by one
 * of two forms (`whole`, a constant after inlining):
 *   0 (1-2 rows): A = sum vpdpbusd(v & 15, x), B = sum vpdpbusd(v, x) (column c's low sum, and it + 16 c + 16's);
 *     C = sum over even quads vpdpbusd(h & 3, x), over odd ones (h & 0x30); D likewise on h & 0xc, h & 0xc0. Column
 *     c's sum is A + 16 C_even + C_odd, column c + 16's (B - A) / 16 + 4 D_even + D_odd / 4 (exact multiples): 3
 *     masks a quad for all rows, 4 vpdpbusd a row, no weight rebuilt.
 *   1 (3-4 rows): each quad's 6-bit weights made whole once (low nibble | high field << 4, both column halves), then
 *     one vpdpbusd a column half and row: fewer per row once several rows share the quad.
 * Then int_dot.c's S = sc_a (S_a - 32 s') + sc_b (S_b - 32 (s - s')) and y = fma(float(S), d dx, y). */
ID_512 ID_INLINE void pk6_tile512(const QRows *x, int r0, int R, int whole, const uint8_t *panel, __m512 *acc) {
    const int SB = x->G / 8;
    const __m512i m15 = _mm512_set1_epi8(15), m03 = _mm512_set1_epi8(3), m0c = _mm512_set1_epi8(12);
    const __m512i m30 = _mm512_set1_epi8(0x30), mc0 = _mm512_set1_epi8((char)0xc0);
    for (int b = 0; b < SB; b++) {
        const uint8_t *o = panel + (size_t)b * pk_super_bytes(IDF_Q6_K);
        __m512 d[2];
        for (int h = 0; h < 2; h++) d[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32 * h)));
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {
            const uint8_t *grp = o + PK6_HEAD + PK6_GROUP * g;
            __m512i Si[PK_TILE][2]; /* columns 0-15, 16-31 */
            for (int i = 0; i < R; i++) Si[i][0] = Si[i][1] = _mm512_setzero_si512();
            _Pragma("GCC unroll 2") for (int u = 0; u < 2; u++) { /* sub-block 2 g + u: quads 4 u .. 4 u + 3 */
                /* whole: A, B the two halves' sums; else A, B, C (even Ce, odd Co), D (De, Do) as above */
                __m512i A[PK_TILE], B[PK_TILE], Ce[PK_TILE], Co[PK_TILE], De[PK_TILE], Do[PK_TILE];
                for (int i = 0; i < R; i++) A[i] = B[i] = Ce[i] = Co[i] = De[i] = Do[i] = _mm512_setzero_si512();
                _Pragma("GCC unroll 4") for (int q = 4 * u; q < 4 * u + 4; q++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(grp + 64 * q));
                    const __m512i hv = _mm512_loadu_si512((const void *)(grp + PK6_HIGHS + 64 * (q / 2)));
                    __m512i w0, w1, hc = _mm512_setzero_si512(), hd = _mm512_setzero_si512();
                    if (whole) { /* column c's 6-bit weights, column c + 16's */
                        const __m512i c_hi = q % 2 ? hv : _mm512_slli_epi16(hv, 4);
                        const __m512i d_hi = q % 2 ? _mm512_srli_epi16(hv, 2) : _mm512_slli_epi16(hv, 2);
                        w0 = _mm512_or_si512(_mm512_and_si512(v, m15), _mm512_and_si512(c_hi, m30));
                        w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m15), _mm512_and_si512(d_hi, m30));
                    } else {
                        w0 = _mm512_and_si512(v, m15), w1 = v;
                        hc = _mm512_and_si512(hv, q % 2 ? m30 : m03), hd = _mm512_and_si512(hv, q % 2 ? mc0 : m0c);
                    }
                    for (int i = 0; i < R; i++) {
                        const uint8_t *xq = (const uint8_t *)x->q + ((size_t)(r0 + i) * x->G + 8 * b + g) * ID_GROUP + 4 * q;
                        const __m512i xb = _mm512_set1_epi32((int)u32_at(xq));
                        A[i] = _mm512_dpbusd_epi32(A[i], w0, xb);
                        B[i] = _mm512_dpbusd_epi32(B[i], w1, xb);
                        if (whole) continue;
                        if (q % 2) Co[i] = _mm512_dpbusd_epi32(Co[i], hc, xb), Do[i] = _mm512_dpbusd_epi32(Do[i], hd, xb);
                        else Ce[i] = _mm512_dpbusd_epi32(Ce[i], hc, xb), De[i] = _mm512_dpbusd_epi32(De[i], hd, xb);
                    }
                }
                for (int h = 0; h < 2; h++) {
                    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(o + 64 + 32 * (2 * g + u) + 16 * h)));
                    for (int i = 0; i < R; i++) {
                        const size_t at = (size_t)(r0 + i) * x->G + 8 * b + g;
                        const int32_t off = 32 * (u ? x->s[at] - x->s16[at] : x->s16[at]);
                        __m512i q6 = h ? B[i] : A[i];
                        if (!whole && h)
                            q6 = _mm512_add_epi32(_mm512_srai_epi32(_mm512_sub_epi32(B[i], A[i]), 4),
                                                  _mm512_add_epi32(_mm512_slli_epi32(De[i], 2), _mm512_srai_epi32(Do[i], 2)));
                        else if (!whole)
                            q6 = _mm512_add_epi32(_mm512_add_epi32(A[i], _mm512_slli_epi32(Ce[i], 4)), Co[i]);
                        Si[i][h] = _mm512_add_epi32(Si[i][h], _mm512_mullo_epi32(sc, _mm512_sub_epi32(q6, _mm512_set1_epi32(off))));
                    }
                }
            }
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < R; i++) {
                    const size_t at = (size_t)(r0 + i) * x->G + 8 * b + g;
                    acc[2 * i + h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Si[i][h]), _mm512_mul_ps(d[h], _mm512_set1_ps(x->d[at])),
                                                     acc[2 * i + h]);
                }
        }
    }
}

/* One panel of type kind f (Q4_K or Q6_K), all M rows, in register tiles: out[i][c] for row i, column c. */
ID_512 static void pk_panel512(int f, const QRows *x, int M, const uint8_t *panel, float acc_out[][PK_COLS]) {
    const int tile = f == IDF_Q6_K && M <= PK6_TILE ? PK6_TILE : PK_TILE;
    for (int r0 = 0; r0 < M; r0 += tile) {
        const int R = M - r0 < tile ? M - r0 : tile;
        __m512 acc[2 * PK_TILE];
        for (int i = 0; i < 2 * PK_TILE; i++) acc[i] = _mm512_setzero_ps();
        if (f == IDF_Q6_K) { /* 1-2 rows: four sums a row on the quads as stored; more: whole weights shared */
            switch (R) {
            case 1: pk6_tile512(x, r0, 1, 0, panel, acc); break;
            case 2: pk6_tile512(x, r0, 2, 0, panel, acc); break;
            case 3: pk6_tile512(x, r0, 3, 1, panel, acc); break;
            default: pk6_tile512(x, r0, PK_TILE, 1, panel, acc); break;
            }
        } else {
            switch (R) { /* the tile's rows a constant in each copy */
            case 1: pk_tile512(x, r0, 1, panel, acc); break;
            case 2: pk_tile512(x, r0, 2, panel, acc); break;
            case 3: pk_tile512(x, r0, 3, panel, acc); break;
            default: pk_tile512(x, r0, PK_TILE, panel, acc); break;
            }
        }
        for (int i = 0; i < 2 * R; i++) _mm512_storeu_ps(acc_out[r0 + i / 2] + 16 * (i % 2), acc[i]);
    }
}

/* ---------------- AVX-VNNI and AVX2: each 64-byte quad as two halves of 8 lanes ---------------- */

/* Q6_K, rows r0 .. r0 + R - 1 (R <= PK_TILE256) of one panel, acc as in the Q4_K form. Each quad half's 6-bit
 * weights are made whole (low nibble | high field << 4, both columns): VNNI takes them into vpdpbusd, AVX2 into
 * vpmaddubsw (pairs <= 2 63 127 = 16002: two quads added in int16, <= 32004, then widened). Per sub-block of 16
 * the column's exact sum of q x, then int_dot.c's S = sc_a (S_a - 32 s') + sc_b (S_b - 32 (s - s')) and y = fma(float(S),
 * d dx, y). */
#define PK6TILE256(NAME, ATTR, VNNI)                                                                             \
    ATTR ID_INLINE void NAME(const QRows *x, int r0, int R, const uint8_t *panel, __m256 *acc) {                 \
        const int SB = x->G / 8;                                                                                 \
        const __m256i m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);    \
        for (int b = 0; b < SB; b++) {                                                                           \
            const uint8_t *o = panel + (size_t)b * pk_super_bytes(IDF_Q6_K);                                      \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                                \
                const uint8_t *grp = o + PK6_HEAD + PK6_GROUP * g;                                               \
                __m256i Si[PK_TILE256][2][2]; /* [row][half e][h: column c 0, c + 16 1] */                       \
                for (int i = 0; i < R; i++) Si[i][0][0] = Si[i][0][1] = Si[i][1][0] = Si[i][1][1] = _mm256_setzero_si256(); \
                _Pragma("GCC unroll 2") for (int u = 0; u < 2; u++) {                                            \
                    __m256i S[PK_TILE256][2][2];                                                                 \
                    for (int i = 0; i < R; i++) S[i][0][0] = S[i][0][1] = S[i][1][0] = S[i][1][1] = _mm256_setzero_si256(); \
                    _Pragma("GCC unroll 2") for (int p = 2 * u; p < 2 * u + 2; p++) { /* quads 2 p, 2 p + 1 */   \
                        for (int e = 0; e < 2; e++) {                                                            \
                            const __m256i hv = _mm256_loadu_si256((const __m256i *)(grp + PK6_HIGHS + 64 * p + 32 * e)); \
                            __m256i P[PK_TILE256][2]; /* AVX2: the pair's int16 sums */                          \
                            for (int t = 0; t < 2; t++) {                                                        \
                                const int q = 2 * p + t;                                                         \
                                const __m256i v = _mm256_loadu_si256((const __m256i *)(grp + 64 * q + 32 * e));   \
                                const __m256i hc = t ? hv : _mm256_slli_epi16(hv, 4);                            \
                                const __m256i hd = t ? _mm256_srli_epi16(hv, 2) : _mm256_slli_epi16(hv, 2);     \
                                const __m256i wc = _mm256_or_si256(_mm256_and_si256(v, m15), _mm256_and_si256(hc, m30)); \
                                const __m256i wd = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15), \
                                                                   _mm256_and_si256(hd, m30));                   \
                                for (int i = 0; i < R; i++) {                                                    \
                                    const uint8_t *xq =                                                          \
                                        (const uint8_t *)x->q + ((size_t)(r0 + i) * x->G + 8 * b + g) * ID_GROUP + 4 * q; \
                                    const __m256i xb = _mm256_set1_epi32((int)u32_at(xq));                       \
                                    if (VNNI) {                                                                  \
                                        S[i][e][0] = dot_vnni(S[i][e][0], wc, xb);                               \
                                        S[i][e][1] = dot_vnni(S[i][e][1], wd, xb);                               \
                                    } else if (t == 0) {                                                         \
                                        P[i][0] = _mm256_maddubs_epi16(wc, xb), P[i][1] = _mm256_maddubs_epi16(wd, xb); \
                                    } else {                                                                     \
                                        P[i][0] = _mm256_add_epi16(P[i][0], _mm256_maddubs_epi16(wc, xb));       \
                                        P[i][1] = _mm256_add_epi16(P[i][1], _mm256_maddubs_epi16(wd, xb));       \
                                    }                                                                            \
                                }                                                                                \
                            }                                                                                    \
                            if (!VNNI)                                                                           \
                                for (int i = 0; i < R; i++)                                                      \
                                    for (int h = 0; h < 2; h++)                                                  \
                                        S[i][e][h] = _mm256_add_epi32(S[i][e][h], _mm256_madd_epi16(P[i][h], ones)); \
                        }                                                                                        \
                    }                                                                                            \
                    for (int e = 0; e < 2; e++)                                                                  \
                        for (int h = 0; h < 2; h++) {                                                            \
                            const int c0 = 8 * e + 16 * h; /* the 8 columns' first */                            \
                            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 64 + 32 * (2 * g + u) + c0))); \
                            for (int i = 0; i < R; i++) {                                                        \
                                const size_t at = (size_t)(r0 + i) * x->G + 8 * b + g;                           \
                                const int32_t off = 32 * (u ? x->s[at] - x->s16[at] : x->s16[at]);               \
                                Si[i][e][h] = _mm256_add_epi32(                                                  \
                                    Si[i][e][h], _mm256_mullo_epi32(sc, _mm256_sub_epi32(S[i][e][h], _mm256_set1_epi32(off)))); \
                            }                                                                                    \
                        }                                                                                        \
                }                                                                                                \
                for (int e = 0; e < 2; e++)                                                                      \
                    for (int h = 0; h < 2; h++) {                                                                \
                        const int c0 = 8 * e + 16 * h;                                                           \
                        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2 * c0)));        \
                        for (int i = 0; i < R; i++) {                                                            \
                            const size_t at = (size_t)(r0 + i) * x->G + 8 * b + g;                               \
                            __m256 *y = &acc[4 * i + 2 * e + h];                                                 \
                            *y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Si[i][e][h]), _mm256_mul_ps(d, _mm256_set1_ps(x->d[at])), *y); \
                        }                                                                                        \
                    }                                                                                            \
            }                                                                                                    \
        }                                                                                                        \
    }

/* Rows r0 .. r0 + R - 1 (R <= PK_TILE256) of one panel, both halves in one pass: acc[4 i + 2 e + h] holds columns
 * 8 e + 16 h .. + 7 (e: the quad's half, h: low nibbles 0, high 1). VNNI: pk_tile512's S and T; AVX2 (vpmaddubsw,
 * whose u8 x s8 pair sums would overflow int16 on whole bytes): both nibbles unpacked, the 8 quads' int16 pair
 * sums added (each <= 2 15 127: 8 of them 30480 <= 32767) and widened once. */
#define PKTILE256(NAME, ATTR, VNNI)                                                                              \
    ATTR ID_INLINE void NAME(const QRows *x, int r0, int R, const uint8_t *panel, __m256 *acc) {                 \
        const int SB = x->G / 8;                                                                                 \
        const __m256i m15 = _mm256_set1_epi8(15);                                                                \
        for (int b = 0; b < SB; b++) {                                                                           \
            const uint8_t *o = panel + (size_t)b * pk_super_bytes(IDF_Q4_K);                                      \
            __m256i sc[8], mn[8];                                                                                \
            pk_scales(o, sc, mn);                                                                                \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                                \
                __m256i A[PK_TILE256][2], B[PK_TILE256][2]; /* per half: S and T (VNNI), low and high sums */   \
                for (int i = 0; i < R; i++) A[i][0] = A[i][1] = B[i][0] = B[i][1] = _mm256_setzero_si256();     \
                _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) {                                            \
                    for (int e = 0; e < 2; e++) {                                                                \
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(o + PK_QUANTS + 64 * (8 * g + q) + 32 * e)); \
                        const __m256i lo = _mm256_and_si256(v, m15);                                             \
                        const __m256i hi = VNNI ? v : _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);            \
                        for (int i = 0; i < R; i++) {                                                            \
                            const uint8_t *xq =                                                                  \
                                (const uint8_t *)x->q + ((size_t)(r0 + i) * x->G + 8 * b + g) * ID_GROUP + 4 * q; \
                            const __m256i xb = _mm256_set1_epi32((int)u32_at(xq));                               \
                            if (VNNI) {                                                                          \
                                A[i][e] = dot_vnni(A[i][e], lo, xb), B[i][e] = dot_vnni(B[i][e], hi, xb);        \
                            } else {                                                                             \
                                A[i][e] = _mm256_add_epi16(A[i][e], _mm256_maddubs_epi16(lo, xb));               \
                                B[i][e] = _mm256_add_epi16(B[i][e], _mm256_maddubs_epi16(hi, xb));               \
                            }                                                                                    \
                        }                                                                                        \
                    }                                                                                            \
                }                                                                                                \
                for (int e = 0; e < 2; e++)                                                                      \
                    for (int h = 0; h < 2; h++) {                                                                \
                        const int c0 = 8 * e + 16 * h; /* the 8 columns' first */                                \
                        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2 * c0)));        \
                        const __m256 ndmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 64 + 2 * c0))), \
                                                           _mm256_set1_ps(-0.0f));                               \
                        const __m256 kd = _mm256_mul_ps(d, pk_bytes_ps256(sc[g], c0));                           \
                        const __m256 km = _mm256_mul_ps(ndmin, pk_bytes_ps256(mn[g], c0));                       \
                        for (int i = 0; i < R; i++) {                                                            \
                            const size_t at = (size_t)(r0 + i) * x->G + 8 * b + g;                               \
                            __m256i Si;                                                                          \
                            if (VNNI) Si = h ? _mm256_srai_epi32(_mm256_sub_epi32(B[i][e], A[i][e]), 4) : A[i][e]; \
                            else Si = _mm256_madd_epi16(h ? B[i][e] : A[i][e], _mm256_set1_epi16(1));            \
                            __m256 *y = &acc[4 * i + 2 * e + h];                                                 \
                            *y = _mm256_fmadd_ps(km, _mm256_set1_ps(x->sd[at]), *y);                             \
                            *y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Si), _mm256_mul_ps(kd, _mm256_set1_ps(x->d[at])), *y); \
                        }                                                                                        \
                    }                                                                                            \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
    PK6TILE256(NAME##6, ATTR, VNNI)                                                                            \
    ATTR static void NAME##_panel(int f, const QRows *x, int M, const uint8_t *panel, float acc_out[][PK_COLS]) { \
        for (int r0 = 0; r0 < M; r0 += PK_TILE256) {                                                             \
            const int R = M - r0 < PK_TILE256 ? M - r0 : PK_TILE256;                                             \
            __m256 acc[4 * PK_TILE256];                                                                          \
            for (int i = 0; i < 4 * PK_TILE256; i++) acc[i] = _mm256_setzero_ps();                               \
            if (f == IDF_Q6_K) {                                                                                 \
                if (R == 1) NAME##6(x, r0, 1, panel, acc);                                                       \
                else NAME##6(x, r0, PK_TILE256, panel, acc);                                                     \
            } else if (R == 1) NAME(x, r0, 1, panel, acc);                                                       \
            else NAME(x, r0, PK_TILE256, panel, acc);                                                            \
            for (int i = 0; i < 4 * R; i++) /* acc[4 i + 2 e + h]: columns 8 e + 16 h .. */                      \
                _mm256_storeu_ps(acc_out[r0 + i / 4] + 8 * ((i / 2) % 2) + 16 * (i % 2), acc[i]);                \
        }                                                                                                        \
    }

PKTILE256(pk_tile_vnni, ID_VNNI, 1)
PKTILE256(pk_tile_avx2, , 0)
#undef PKTILE256
#undef PK6TILE256

/* Panels [u0, u1) (PK_COLS columns each) of Y = X P^T (+ bias) (+ R) for packed weights P of type kind f (Q4_K or
 * Q6_K), M rows, on the ISA in use; out: a scratch of M x PK_COLS floats. */
static void id_packed_range(int f, const QRows *x, const uint8_t *P, const float *bias, const float *Rr, int ldr,
                            float *Y, int ldy, int M, int u0, int u1, float (*out)[PK_COLS]) {
    const int isa = __atomic_load_n(&id_isa, __ATOMIC_RELAXED);
    const size_t panel_bytes = (size_t)(x->G / 8) * pk_super_bytes(f);
    for (int u = u0; u < u1; u++) {
        const uint8_t *panel = P + (size_t)u * panel_bytes;
        if (isa == ISA_AVX512VNNI) pk_panel512(f, x, M, panel, out);
        else if (isa == ISA_AVXVNNI) pk_tile_vnni_panel(f, x, M, panel, out);
        else pk_tile_avx2_panel(f, x, M, panel, out);
        const int n0 = u * PK_COLS;
        for (int i = 0; i < M; i++)
            id_store(out[i], bias ? bias + n0 : NULL, Rr ? Rr + (size_t)i * ldr + n0 : NULL, Y + (size_t)i * ldy + n0,
                     PK_COLS);
    }
}

/* This thread's scratch for a packed panel's M rows of outputs (NULL when it cannot be allocated). */
static __thread Scratch_ id_pk_scratch;
static float (*pk_out(int M))[PK_COLS] { return scratch_get(&id_pk_scratch, sizeof(float) * PK_COLS * (size_t)M); }
