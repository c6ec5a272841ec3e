/* Q4_1, 20 bytes / 32 weights: d fp16 | m fp16 | qs[16] (nibbles as Q4_0);  w = d * q + m (one rounding: d q is
 * exact). */
#ifndef MINIBATCH_Q_Q4_1_H
#define MINIBATCH_Q_Q4_1_H
#include "q4_0.h"

static void q4_1_ref(const uint8_t *blk, float *out) {
    const float d = f16_at(blk), m = f16_at(blk + 2);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(blk[4 + j] & 15) + m;
        out[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
    }
}

QINLINE void q4_1_avx2(const uint8_t *blk, int j, __m256 w[4]) {
    (void)j;
    const __m256 d = _mm256_set1_ps(f16_at(blk)), m = _mm256_set1_ps(f16_at(blk + 2));
    __m256i q[4];
    nibbles_avx2(blk + 4, q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(i2f(q[i]), d, m);
}

QINLINE512 void q4_1_avx512(const uint8_t *blk, int j, __m512 w[2]) {
    (void)j;
    const __m512 table = _mm512_fmadd_ps(ramp16(), _mm512_set1_ps(f16_at(blk)), _mm512_set1_ps(f16_at(blk + 2)));
    nibble_lut512(blk + 4, table, w);
}
#endif
