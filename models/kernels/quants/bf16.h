/* BF16: 2 bytes a weight, the upper 16 bits of an fp32 (w = those bits << 16, exact). Chunks of 32 as F32's. */
#ifndef MINIBATCH_Q_BF16_H
#define MINIBATCH_Q_BF16_H
#include "common.h"

static void bf16_ref(const uint8_t *blk, float *out) {
    uint32_t bits = (uint32_t)(blk[0] | blk[1] << 8) << 16;
    memcpy(out, &bits, 4);
}

QINLINE void bf16_avx2(const uint8_t *p, int j, __m256 w[4]) {
    (void)j;
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
        w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
}

QINLINE512 void bf16_avx512(const uint8_t *p, int j, __m512 w[2]) {
    (void)j;
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32 * i)));
        w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
}
#endif
