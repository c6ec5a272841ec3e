/* IQ4_XS, 136 bytes / 256 weights: d fp16 | scales_h u16 | scales_l[4] | qs[128]. 8 sub-blocks of 32: sc = (4 bits
 * of scales_l[s / 2], low nibble for even s) | (scales_h >> 2 s & 3) << 4, minus 32; qs[16 s ..] are nibbles as
 * Q4_0's;  w = (d sc) IQ4_GRID[q]  (exact: 11 + 6 + 7 bits). */
#ifndef MINIBATCH_Q_IQ4_XS_H
#define MINIBATCH_Q_IQ4_XS_H
#include "iq4_nl.h"

static inline float iq4_xs_scale(const uint8_t *blk, int s) {
    const int high = (blk[2] | blk[3] << 8) >> 2 * s & 3, low = blk[4 + s / 2] >> 4 * (s % 2) & 15;
    return f16_at(blk) * (float)((low | high << 4) - 32);
}

static void iq4_xs_ref(const uint8_t *blk, float *out) {
    for (int s = 0; s < 8; s++) {
        const float a = iq4_xs_scale(blk, s);
        for (int l = 0; l < 16; l++) {
            out[32 * s + l] = a * (float)IQ4_GRID[blk[8 + 16 * s + l] & 15];
            out[32 * s + l + 16] = a * (float)IQ4_GRID[blk[8 + 16 * s + l] >> 4];
        }
    }
}

QINLINE void iq4_xs_avx2(const uint8_t *blk, int s, __m256 w[4]) {
    const __m256 a = _mm256_set1_ps(iq4_xs_scale(blk, s));
    __m256i q[4];
    iq4_grid_avx2(blk + 8 + 16 * s, q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(a, i2f(q[i]));
}

QINLINE512 void iq4_xs_avx512(const uint8_t *blk, int s, __m512 w[2]) {
    nibble_lut512(blk + 8 + 16 * s, _mm512_mul_ps(_mm512_set1_ps(iq4_xs_scale(blk, s)), iq4_grid512()), w);
}
#endif
