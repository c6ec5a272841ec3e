/* Q5_1, 24 bytes / 32 weights: d fp16 | m fp16 | qh u32 | qs[16] (5-bit quants as Q5_0);  w = d * q + m. */
#ifndef MINIBATCH_Q_Q5_1_H
#define MINIBATCH_Q_Q5_1_H
#include "q5_0.h"

static void q5_1_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk), m = f16_at(blk + 2);
    const uint32_t qh = u32_at(blk + 4);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)((blk[8 + j] & 15) | ((qh >> j) & 1) << 4) + m;
        out[j + 16] = d * (float)((blk[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
}

QINLINE void q5_1_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(f16_at(blk)), m = _mm256_set1_ps(f16_at(blk + 2));
    __m256i q[4];
    five_bits_avx2(blk + 8, u32_at(blk + 4), q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(i2f(q[i]), d, m);
}

QINLINE512 void q5_1_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    (void)j;
    const __m512 d = _mm512_set1_ps(f16_at(blk)), m = _mm512_set1_ps(f16_at(blk + 2));
    const __m512 t0 = _mm512_fmadd_ps(ramp16(), d, m);
    const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(ramp16(), _mm512_set1_ps(16)), d, m);
    five_bit_lut512(blk + 8, u32_at(blk + 4), t0, t1, w);
}
#endif
