/* Q4_0, 18 bytes / 32 weights: d fp16 | qs[16]; q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;  w = d * (q - 8). */
#ifndef MINIBATCH_Q_Q4_0_H
#define MINIBATCH_Q_Q4_0_H
#include "common.h"

static void q4_0_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((blk[2 + j] & 15) - 8);
        out[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
    }
}

/* The four 8-weight quarters of a 16-byte nibble block, as int32: q[0..7], q[8..15], q[16..23], q[24..31]. */
QINLINE void nibbles_avx2(const uint8_t *qs, __m256i q[4]) {
    const __m256i v0 = u8x8(qs), v1 = u8x8(qs + 8), lo = _mm256_set1_epi32(15);
    q[0] = _mm256_and_si256(v0, lo), q[1] = _mm256_and_si256(v1, lo);
    q[2] = _mm256_srli_epi32(v0, 4), q[3] = _mm256_srli_epi32(v1, 4);
}

QINLINE void q4_0_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(f16_at(blk));
    __m256i q[4];
    nibbles_avx2(blk + 2, q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, i2f(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8))));
}

/* A 16-byte nibble block through a 16-entry table: the low nibbles (elements 0-15), then the high (16-31). */
QINLINE512 void nibble_lut512(const uint8_t *qs, __m512 table, __m512 w[2]) {
    const __m512i v = u8x16(qs);
    w[0] = lut16(v, table), w[1] = lut16(_mm512_srli_epi32(v, 4), table);
}

QINLINE512 void q4_0_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    (void)j;
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), _mm512_sub_ps(ramp16(), _mm512_set1_ps(8)));
    nibble_lut512(blk + 2, table, w);
}
#endif
