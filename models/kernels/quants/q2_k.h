/* Q2_K, 84 bytes / 256 weights: scales[16] (sub-block s: sc = low 4 bits, m = high 4) | qs[64] | d | dmin (fp16).
 * 16 sub-blocks of 16; sub-block 8 h + 2 j + g holds q[l] = qs[32 h + 16 g + l] >> 2 j & 3 (half h, shift j,
 * group g);  w = (d sc) q - (dmin m)  (d sc and dmin m exact; one rounding). */
#ifndef MINIBATCH_Q_Q2_K_H
#define MINIBATCH_Q_Q2_K_H
#include "common.h"

static void q2_k_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
    for (int s = 0; s < 16; s++) {
        const int h = s / 8, j = s % 8 / 2, g = s % 2;
        const float a = d * (float)(blk[s] & 15), m = dmin * (float)(blk[s] >> 4);
        for (int l = 0; l < 16; l++) out[16 * s + l] = a * (float)(blk[16 + 32 * h + 16 * g + l] >> 2 * j & 3) - m;
    }
}

/* chunk c (0-7) = sub-blocks 2c, 2c + 1: half c / 4, shift c % 4 */
QINLINE void q2_k_avx2(const uint8_t *blk, int c, __m256 w[4]) {
    const int h = c >> 2, shift = 2 * (c & 3);
    const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const uint8_t sc = blk[2 * c + i / 2];
        const __m256 a = _mm256_set1_ps(d * (float)(sc & 15)), m = _mm256_set1_ps(dmin * (float)(sc >> 4));
        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(u8x8(blk + 16 + 32 * h + 8 * i), shift),
                                           _mm256_set1_epi32(3));
        w[i] = _mm256_fmsub_ps(i2f(q), a, m);
    }
}

QINLINE512 void q2_k_avx512(const uint8_t *blk, int c, __m512 w[2]) {
    const int h = c >> 2, shift = 2 * (c & 3);
    const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
    const __m512 ramp = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3); /* the table sees 4 bits */
    _Pragma("GCC unroll 2") for (int g = 0; g < 2; g++) {
        const uint8_t sc = blk[2 * c + g];
        const __m512 table = _mm512_fmsub_ps(ramp, _mm512_set1_ps(d * (float)(sc & 15)),
                                             _mm512_set1_ps(dmin * (float)(sc >> 4)));
        w[g] = lut16(_mm512_srli_epi32(u8x16(blk + 16 + 32 * h + 16 * g), shift), table);
    }
}
#endif
