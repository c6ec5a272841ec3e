/* The small per-layer ops of a decode step, one C call each: RMSNorm, LayerNorm, SiLU(gate) * up, GELU (tanh),
 * GELU(gate) * up, the logits' divisor and soft-cap.
 *
 * Why: at batch 1-16 these tensors are a few KB; torch spends more on dispatching them (F.rms_norm is
 * several ATen ops, each with its own allocation and a parallel-region check) than on the arithmetic.
 * One plain loop per row here costs microseconds, runs on the calling thread (no OpenMP region, so no
 * barrier and no worker wake-up), and keeps a step's dispatch count down (decode_ops.py).
 *
 * Shapes: x [M, C] with row stride ldx (unit stride along C); y [M, C] contiguous. Sums of squares and
 * means accumulate in double, so a row's result does not depend on how it was vectorized. Built with
 * -ffp-contract=off (decode_ops.py), like decode_step.c which includes this file: the same bits either way.
 */
#include <math.h>

#include "simd.h"

/* y = x * rsqrt(mean(x^2) + eps) * w (Llama's RMSNorm: normalize in fp32, then scale). */
void rms_norm(const float *x, long ldx, const float *w, float *y, int M, int C, float eps) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + (long)m * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
        float inv = 1.0f / sqrtf((float)(ss / C) + eps);
        for (int c = 0; c < C; c++) yr[c] = w[c] * (xr[c] * inv);
    }
}

/* y = (x - mean) / sqrt(var + eps) * w + b, biased variance (torch's layer_norm). */
void layer_norm(const float *x, long ldx, const float *w, const float *b, float *y, int M, int C, float eps) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + (long)m * C;
        double sum = 0.0, ss = 0.0;
        for (int c = 0; c < C; c++) sum += xr[c];
        double mean = sum / C;
        for (int c = 0; c < C; c++) ss += (xr[c] - mean) * (xr[c] - mean);
        float rstd = (float)(1.0 / sqrt(ss / C + eps)), mu = (float)mean;
        for (int c = 0; c < C; c++) yr[c] = (xr[c] - mu) * rstd * w[c] + b[c];
    }
}

/* gu [M, 2I] (gate then up, row stride ldg) -> y [M, I] = silu(gate) * up, silu(g) = g / (1 + exp(-g)). */
void silu_mul(const float *gu, long ldg, float *y, int M, int I) {
    for (int m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *yr = y + (long)m * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) { /* exp256's input capped at 88 (exp(88) < FLT_MAX): silu(g < -88) ~ 0 */
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.0f)));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* y = gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), computed as the same function
 * x / (1 + exp(-2u)) (no cancellation near 0). x [M, N] row stride ldx, y row stride ldy; y may be x (in place).
 * Every element goes through the 8-wide path (a row's tail through a padded copy), so an element's result does
 * not depend on its column or on how a caller splits the row. exp256's input is capped at 88: gelu(x << 0) ~ 0. */
INLINE __m256 gelu8(__m256 x) {
    /* 2 sqrt(2 / pi) and 2 sqrt(2 / pi) 0.044715 */
    const __m256 k1 = _mm256_set1_ps(1.5957691216057308f), k3 = _mm256_set1_ps(0.0713548162726009f);
    __m256 u2 = _mm256_mul_ps(x, _mm256_add_ps(k1, _mm256_mul_ps(k3, _mm256_mul_ps(x, x))));
    __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), u2), _mm256_set1_ps(88.0f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

void gelu_tanh(const float *x, long ldx, float *y, long ldy, int M, int N) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        int i = 0;
        for (; i + 8 <= N; i += 8) _mm256_storeu_ps(yr + i, gelu8(_mm256_loadu_ps(xr + i)));
        if (i < N) {
            float tmp[8] = {0};
            for (int j = i; j < N; j++) tmp[j - i] = xr[j];
            _mm256_storeu_ps(tmp, gelu8(_mm256_loadu_ps(tmp)));
            for (int j = i; j < N; j++) yr[j] = tmp[j - i];
        }
    }
}

/* gu [M, 2I] (gate then up, row stride ldg) -> y [M, I] = gelu_tanh(gate) * up (Gemma's GeGLU): gelu8 on every
 * element (a row's tail through a padded copy, as gelu_tanh), then the product. */
void gelu_mul(const float *gu, long ldg, float *y, int M, int I) {
    for (int m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *yr = y + (long)m * I;
        int i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(gelu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        if (i < I) {
            float tmp[8] = {0};
            for (int j = i; j < I; j++) tmp[j - i] = g[j];
            _mm256_storeu_ps(tmp, gelu8(_mm256_loadu_ps(tmp)));
            for (int j = i; j < I; j++) yr[j] = tmp[j - i] * u[j];
        }
    }
}

/* x [n] in place: x / divisor (Granite's logits_scaling; 1: none), then softcap * tanh(x / softcap) (Gemma 2's
 * final soft-cap; 0: none), the two roundings torch's ops make. */
void cap_logits(float *x, long n, float divisor, float softcap) {
    for (long i = 0; i < n; i++) {
        float v = x[i];
        if (divisor != 1.0f) v = v / divisor;
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        x[i] = v;
    }
}
