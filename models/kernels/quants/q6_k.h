/* Q6_K, 210 bytes / 256 weights: ql[128] | qh[64] | scales int8[16] | d fp16. Per 128-element half h and quarter c
 * (32 elements l): low 4 bits = ql[64 h + 32 (c % 2) + l] (low nibble for c < 2, high above), high 2 bits =
 * qh[32 h + l] >> 2 c & 3; sub-block of 16: 8 h + 2 c + l / 16;  w = (d sc) (q - 32)  (exact: 11 + 7 + 6 bits). */
#ifndef MINIBATCH_Q_Q6_K_H
#define MINIBATCH_Q_Q6_K_H
#include "common.h"

static void q6_k_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk + 208);
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, c = e % 128 / 32, l = e % 32;
        const uint8_t low = blk[64 * h + 32 * (c % 2) + l];
        const int q = (c < 2 ? low & 15 : low >> 4) | (blk[128 + 32 * h + l] >> 2 * c & 3) << 4;
        out[e] = d * (float)(int8_t)blk[192 + 8 * h + 2 * c + l / 16] * (float)(q - 32);
    }
}

/* chunk j (0-7): half j / 4, quarter j % 4 */
QINLINE void q6_k_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    const int h = j >> 2, c = j & 3;
    const float d = f16_at(blk + 208);
    const uint8_t *ql = blk + 64 * h + 32 * (c & 1), *qh = blk + 128 + 32 * h;
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256i v = u8x8(ql + 8 * i);
        const __m256i low = c < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(u8x8(qh + 8 * i), 2 * c), _mm256_set1_epi32(3));
        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
        const float a = d * (float)(int8_t)blk[192 + 8 * h + 2 * c + i / 2];
        w[i] = _mm256_mul_ps(_mm256_set1_ps(a), i2f(q));
    }
}

QINLINE512 void q6_k_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    const int h = j >> 2, c = j & 3;
    const float d = f16_at(blk + 208);
    const uint8_t *ql = blk + 64 * h + 32 * (c & 1), *qh = blk + 128 + 32 * h;
    _Pragma("GCC unroll 2") for (int g = 0; g < 2; g++) {
        const __m512i v = u8x16(ql + 16 * g);
        const __m512i low = c < 2 ? _mm512_and_si512(v, _mm512_set1_epi32(15)) : _mm512_srli_epi32(v, 4);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(u8x16(qh + 16 * g), 2 * c), _mm512_set1_epi32(3));
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
        const float a = d * (float)(int8_t)blk[192 + 8 * h + 2 * c + g];
        w[g] = _mm512_mul_ps(_mm512_set1_ps(a), i2f512(q));
    }
}
#endif
