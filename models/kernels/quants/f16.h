/* F16: 2 bytes a weight, an IEEE half; w = the half widened to fp32 (exact). Chunks of 32 as F32's. */
#ifndef MINIBATCH_Q_F16_H
#define MINIBATCH_Q_F16_H
#include "common.h"

static void f16_ref(const uint8_t *blk, float *out) { out[0] = f16_at(blk); }

QINLINE void f16_avx2(const uint8_t *p, int j, __m256 w[4]) {
    (void)j;
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
}

QINLINE512 void f16_avx512(const uint8_t *p, int j, __m512 w[2]) {
    (void)j;
    w[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    w[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
}
#endif
