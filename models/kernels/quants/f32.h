/* F32: 4 bytes a weight, the float itself. The kernels see 32-weight chunks (128 bytes); K need not be a multiple
 * of 32 (the last chunk is partial: float_tail). */
#ifndef MINIBATCH_Q_F32_H
#define MINIBATCH_Q_F32_H
#include "common.h"

static void f32_ref(const uint8_t *blk, float *out) { memcpy(out, blk, 4); }

QINLINE void f32_avx2(const uint8_t *p, int j, __m256 w[4]) {
    (void)j;
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps((const float *)p + 8 * i);
}

QINLINE512 void f32_avx512(const uint8_t *p, int j, __m512 w[2]) {
    (void)j;
    w[0] = _mm512_loadu_ps((const float *)p), w[1] = _mm512_loadu_ps((const float *)p + 16);
}
#endif
