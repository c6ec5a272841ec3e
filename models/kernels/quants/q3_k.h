/* Q3_K, 110 bytes / 256 weights: hmask[32] | qs[64] | scales[12] | d fp16. 16 sub-blocks of 16 as Q2_K's: 2 low
 * bits from qs, and q = low - 4 where hmask[16 g + l] bit 4 h + j is clear; scale s (6 bits, minus 32): low 4 bits
 * are scales[s] & 15 (s < 8) or scales[s - 8] >> 4, high 2 bits scales[8 + s % 4] >> 2 (s / 4);  w = (d sc) q. */
#ifndef MINIBATCH_Q_Q3_K_H
#define MINIBATCH_Q_Q3_K_H
#include "common.h"

static inline int q3_k_scale(const uint8_t *sc, int s) {
    const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = sc[8 + s % 4] >> 2 * (s / 4) & 3;
    return (low | high << 4) - 32;
}

static void q3_k_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk + 108);
    for (int s = 0; s < 16; s++) {
        const int h = s / 8, j = s % 8 / 2, g = s % 2;
        const float a = d * (float)q3_k_scale(blk + 96, s);
        for (int l = 0; l < 16; l++) {
            const int low = blk[32 + 32 * h + 16 * g + l] >> 2 * j & 3;
            const int high = blk[16 * g + l] >> (4 * h + j) & 1;
            out[16 * s + l] = a * (float)(low - (high ? 0 : 4));
        }
    }
}

QINLINE void q3_k_avx2(const uint8_t *blk, int c, __m256 w[4]) {
    const int h = c >> 2, shift = 2 * (c & 3), bit = 4 * h + (c & 3);
    const float d = f16_at(blk + 108);
    const __m256i three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256 a = _mm256_set1_ps(d * (float)q3_k_scale(blk + 96, 2 * c + i / 2));
        const __m256i low = _mm256_and_si256(_mm256_srli_epi32(u8x8(blk + 32 + 32 * h + 8 * i), shift), three);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(u8x8(blk + 8 * i), bit), one);
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 2)), _mm256_set1_epi32(4));
        w[i] = _mm256_mul_ps(a, i2f(q));
    }
}

QINLINE512 void q3_k_avx512(const uint8_t *blk, int c, __m512 w[2]) {
    const int h = c >> 2, shift = 2 * (c & 3), bit = 4 * h + (c & 3);
    const float d = f16_at(blk + 108);
    const __m512 ramp = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3); /* the table sees 4 bits */
    _Pragma("GCC unroll 2") for (int g = 0; g < 2; g++) {
        const __m512 a = _mm512_set1_ps(d * (float)q3_k_scale(blk + 96, 2 * c + g));
        const __m512 t0 = _mm512_mul_ps(a, _mm512_sub_ps(ramp, _mm512_set1_ps(4))), t1 = _mm512_mul_ps(a, ramp);
        const __m512i v = _mm512_srli_epi32(u8x16(blk + 32 + 32 * h + 16 * g), shift);
        const __mmask16 set = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(blk + 16 * g)),
                                                 _mm_set1_epi8((char)(1 << bit)));
        w[g] = _mm512_mask_permutexvar_ps(lut16(v, t0), set, v, t1);
    }
}
#endif
