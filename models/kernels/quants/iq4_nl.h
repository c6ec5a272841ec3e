/* IQ4_NL, 18 bytes / 32 weights: d fp16 | qs[16] (nibbles as Q4_0);  w = d * IQ4_GRID[q] (exact: 11 x 7 bits). */
#ifndef MINIBATCH_Q_IQ4_NL_H
#define MINIBATCH_Q_IQ4_NL_H
#include "q4_0.h"

static void iq4_nl_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)IQ4_GRID[blk[2 + j] & 15];
        out[j + 16] = d * (float)IQ4_GRID[blk[2 + j] >> 4];
    }
}

/* 16 nibble bytes -> the grid values of their 32 nibbles as int32 quarters (q4_0.h's order), by byte shuffles. */
QINLINE void iq4_grid_avx2(const uint8_t *qs, __m256i q[4]) {
    const __m128i grid = _mm_loadu_si128((const __m128i *)IQ4_GRID), v = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_shuffle_epi8(grid, _mm_and_si128(v, _mm_set1_epi8(15)));
    const __m128i hi = _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)));
    q[0] = _mm256_cvtepi8_epi32(lo), q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepi8_epi32(hi), q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
}

QINLINE void iq4_nl_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(f16_at(blk));
    __m256i q[4];
    iq4_grid_avx2(blk + 2, q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, i2f(q[i]));
}

QINLINE512 __m512 iq4_grid512(void) { return i2f512(i8x16((const uint8_t *)IQ4_GRID)); }

QINLINE512 void iq4_nl_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    (void)j;
    nibble_lut512(blk + 2, _mm512_mul_ps(_mm512_set1_ps(f16_at(blk)), iq4_grid512()), w);
}
#endif
