/* Q8_0, 34 bytes / 32 weights: d fp16 | q int8[32];  w[j] = d * q[j]  (exact in fp32: 11 x 8 bits). */
#ifndef MINIBATCH_Q_Q8_0_H
#define MINIBATCH_Q_Q8_0_H
#include "common.h"

static void q8_0_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk);
    for (int j = 0; j < 32; j++) out[j] = d * (float)(int8_t)blk[2 + j];
}

QINLINE void q8_0_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(f16_at(blk));
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, i2f(i8x8(blk + 2 + 8 * i)));
}

QINLINE512 void q8_0_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    (void)j;
    const __m512 d = _mm512_set1_ps(f16_at(blk));
    w[0] = _mm512_mul_ps(d, i2f512(i8x16(blk + 2)));
    w[1] = _mm512_mul_ps(d, i2f512(i8x16(blk + 18)));
}
#endif
