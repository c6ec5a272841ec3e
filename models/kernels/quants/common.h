/* What every per-type kernel header (quants/<type>.h) shares: the ISA attributes, fp16 scalars, constant tables.
 *
 * Each type's header defines, for one block of its GGUF layout (models/gguf/blocks.py documents every layout):
 *   <type>_ref(blk, out)          the scalar reference: the whole block -> fp32 (the values gguf-py dequantizes)
 *   <type>_avx2(blk, j, w[4])     32 weights k = 32 j .. 32 j + 31 of the block, 8 per register (AVX2)
 *   <type>_avx512(blk, j, w[2])   the same 32 weights, 16 per register (AVX-512 F/BW/VL)
 * Both SIMD functions compute every weight with the reference's fp32 operations on the same operands (each weight
 * is a*q or the single rounding of a*q + b, with a*q exact), so the three agree bit for bit.
 */
#ifndef MINIBATCH_QUANTS_COMMON_H
#define MINIBATCH_QUANTS_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QINLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define QINLINE512 AVX512 QINLINE

/* ggml's type ids (the kernels' fmt argument; models/gguf/blocks.py TYPES) */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30
};

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 8 bytes -> 8 int32 (zero- / sign-extended) */
QINLINE __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE __m256i i8x8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
/* 16 bytes -> 16 int32 */
QINLINE512 __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
QINLINE512 __m512i i8x16(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }

QINLINE __m256 i2f(__m256i v) { return _mm256_cvtepi32_ps(v); }
QINLINE512 __m512 i2f512(__m512i v) { return _mm512_cvtepi32_ps(v); }

/* 0, 1, ..., 15 as floats (the index of a 16-entry table) */
QINLINE512 __m512 ramp16(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* IQ4_NL / IQ4_XS's non-linear grid (KVALUES in models/gguf/blocks.py) */
static const int8_t IQ4_GRID[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* A 16-entry fp32 table indexed by the low 4 bits of each int32 lane (higher bits are ignored). */
QINLINE512 __m512 lut16(__m512i idx, __m512 table) { return _mm512_permutexvar_ps(idx, table); }

#endif
