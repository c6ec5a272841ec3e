/* Q5_0, 22 bytes / 32 weights: d fp16 | qh u32 | qs[16]; q[j] = (qs[j] & 15) | (qh bit j) << 4,
 * q[j + 16] = (qs[j] >> 4) | (qh bit j + 16) << 4;  w = d * (q - 16). */
#ifndef MINIBATCH_Q_Q5_0_H
#define MINIBATCH_Q_Q5_0_H
#include "q4_0.h"

static void q5_0_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk);
    const uint32_t qh = u32_at(blk + 2);
    for (int j = 0; j < 16; j++) {
        const int lo = (blk[6 + j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (blk[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        out[j] = d * (float)(lo - 16);
        out[j + 16] = d * (float)(hi - 16);
    }
}

/* The 5-bit quants of a nibble block qs with its high bits qh, as q4_0.h's int32 quarters. */
QINLINE void five_bits_avx2(const uint8_t *qs, uint32_t qh, __m256i q[4]) {
    nibbles_avx2(qs, q);
    const __m256i bits = _mm256_set1_epi32((int)qh), one = _mm256_set1_epi32(1);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * i));
        const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(bits, at), one);
        q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(h, 4));
    }
}

QINLINE void q5_0_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(f16_at(blk));
    __m256i q[4];
    five_bits_avx2(blk + 6, u32_at(blk + 2), q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, i2f(_mm256_sub_epi32(q[i], _mm256_set1_epi32(16))));
}

/* The integer path's 5th bits (int_dot.c): bit k of qh as byte k of a register, 16 where it is set, else 0, so
 * (the k-ordered nibbles | these) are the block's 32 q, k-ordered. Each 8-byte run of the register takes one byte
 * of qh (a shuffle), and byte k tests its bit k % 8. */
QINLINE __m256i five_bit_bytes(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                     2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* A nibble block with its 32 high bits through two tables: t0 where the bit is clear, t1 where it is set. */
QINLINE512 void five_bit_lut512(const uint8_t *qs, uint32_t qh, __m512 t0, __m512 t1, __m512 w[2]) {
    const __m512i v = u8x16(qs), h = _mm512_srli_epi32(v, 4);
    w[0] = _mm512_mask_permutexvar_ps(lut16(v, t0), (__mmask16)(qh & 0xFFFF), v, t1);
    w[1] = _mm512_mask_permutexvar_ps(lut16(h, t0), (__mmask16)(qh >> 16), h, t1);
}

QINLINE512 void q5_0_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    (void)j;
    const __m512 d = _mm512_set1_ps(f16_at(blk));
    const __m512 t0 = _mm512_mul_ps(d, _mm512_sub_ps(ramp16(), _mm512_set1_ps(16))), t1 = _mm512_mul_ps(d, ramp16());
    five_bit_lut512(blk + 6, u32_at(blk + 2), t0, t1, w);
}
#endif
