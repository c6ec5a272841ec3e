/* Q5_K, 176 bytes / 256 weights: d | dmin | scales[12] (as Q4_K) | qh[32] | qs[128] (nibbles as Q4_K);
 * sub-block s's 5th bit of element l is qh[l] bit s;  w = (d sc) q - (dmin m). */
#ifndef MINIBATCH_Q_Q5_K_H
#define MINIBATCH_Q_Q5_K_H
#include "q4_k.h"

static void q5_k_ref(const uint8_t *blk, float *out) {
    for (int s = 0; s < 8; s++) {
        float a, b;
        k4_factors(blk, s, &a, &b);
        for (int l = 0; l < 32; l++) {
            const uint8_t byte = blk[48 + 32 * (s / 2) + l];
            const int q = (s % 2 ? byte >> 4 : byte & 15) | (blk[16 + l] >> s & 1) << 4;
            out[32 * s + l] = a * (float)q - b;
        }
    }
}

/* The integer path's 5th bits (int_dot.c): sub-block s's bits (bit s of qh[0..31]) as 32 bytes, 16 where set, else
 * 0 (the byte's bit s moved to bit 4 by 16-bit shifts; the bits they carry across bytes are masked off). */
QINLINE __m256i k5_high_bytes(const uint8_t *qh, int s) {
    const __m256i v = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)qh), _mm_cvtsi32_si128(s));
    return _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi8(16));
}

QINLINE void q5_k_avx2(const uint8_t *blk, int s, __m256 w[4]) {
    float a, b;
    k4_factors(blk, s, &a, &b);
    __m256i q[4];
    k4_nibbles_avx2(blk + 48, s, q);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(u8x8(blk + 16 + 8 * i), s), _mm256_set1_epi32(1));
        q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(high, 4));
        w[i] = _mm256_fmsub_ps(i2f(q[i]), _mm256_set1_ps(a), _mm256_set1_ps(b));
    }
}

QINLINE512 void q5_k_avx512(const uint8_t *blk, int s, __m512 w[2]) {
    float a, b;
    k4_factors(blk, s, &a, &b);
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    const __m512 t0 = _mm512_fmsub_ps(ramp16(), va, vb);
    const __m512 t1 = _mm512_fmsub_ps(_mm512_add_ps(ramp16(), _mm512_set1_ps(16)), va, vb);
    __m512i v[2];
    k4_index512(blk + 48, s, v);
    const __m128i bit = _mm_set1_epi8((char)(1 << s));
    _Pragma("GCC unroll 2") for (int g = 0; g < 2; g++) {
        const __mmask16 set = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(blk + 16 + 16 * g)), bit);
        w[g] = _mm512_mask_permutexvar_ps(lut16(v[g], t0), set, v[g], t1);
    }
}
#endif
