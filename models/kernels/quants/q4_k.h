/* Q4_K, 144 bytes / 256 weights: d | dmin (fp16) | scales[12] (8 x (6-bit sc, 6-bit m), k4_scale_min) | qs[128].
 * 8 sub-blocks of 32: sub-block 2 p + i is nibble i (0 low, 1 high) of qs[32 p + l];
 * w = (d sc) q - (dmin m)  (both products exact; one rounding). */
#ifndef MINIBATCH_Q_Q4_K_H
#define MINIBATCH_Q_Q4_K_H
#include "common.h"

/* Sub-block s's 6-bit scale and min (ggml's get_scale_min_k4). */
static inline void k4_scale_min(const uint8_t *sc, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = sc[s] & 63, *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 15) | (sc[s - 4] >> 6) << 4;
        *min = (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
    }
}

/* Sub-block s's a = d sc and b = dmin m: its weights are a q - b. */
static inline void k4_factors(const uint8_t *blk, int s, float *a, float *b) {
    int sc, m;
    k4_scale_min(blk + 4, s, &sc, &m);
    *a = f16_at(blk) * (float)sc, *b = f16_at(blk + 2) * (float)m;
}

static void q4_k_ref(const uint8_t *blk, float *out) {
    for (int s = 0; s < 8; s++) {
        float a, b;
        k4_factors(blk, s, &a, &b);
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = blk[16 + 32 * (s / 2) + l];
            out[32 * s + l] = a * (float)(s % 2 ? byte >> 4 : byte & 15) - b;
        }
    }
}

/* The 32 nibbles of sub-block s of a 128-byte nibble array, as int32 quarters. */
QINLINE void k4_nibbles_avx2(const uint8_t *qs, int s, __m256i q[4]) {
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256i v = u8x8(qs + 32 * (s >> 1) + 8 * i);
        q[i] = s & 1 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    }
}

QINLINE void q4_k_avx2(const uint8_t *blk, int s, __m256 w[4]) {
    float a, b;
    k4_factors(blk, s, &a, &b);
    __m256i q[4];
    k4_nibbles_avx2(blk + 16, s, q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) w[i] = _mm256_fmsub_ps(i2f(q[i]), _mm256_set1_ps(a), _mm256_set1_ps(b));
}

/* Sub-block s's nibbles as two 16-lane index vectors (only their low 4 bits count in a table lookup). */
QINLINE512 void k4_index512(const uint8_t *qs, int s, __m512i v[2]) {
    const int shift = 4 * (s & 1);
    v[0] = _mm512_srli_epi32(u8x16(qs + 32 * (s >> 1)), shift);
    v[1] = _mm512_srli_epi32(u8x16(qs + 32 * (s >> 1) + 16), shift);
}

QINLINE512 void q4_k_avx512(const uint8_t *blk, int s, __m512 w[2]) {
    float a, b;
    k4_factors(blk, s, &a, &b);
    const __m512 table = _mm512_fmsub_ps(ramp16(), _mm512_set1_ps(a), _mm512_set1_ps(b));
    __m512i v[2];
    k4_index512(blk + 16, s, v);
    w[0] = lut16(v[0], table), w[1] = lut16(v[1], table);
}
#endif
