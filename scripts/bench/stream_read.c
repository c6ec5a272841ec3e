/* The roofline's reference reader: n bytes streamed once by `threads` threads, doing nothing else with them.
 *
 * Why: a decode step's floor is its weight bytes over what the cores can read. Measured once at the start of a run
 * (a fp32 sum over 512 MiB) that figure swings 24-32 GB/s between minutes on a shared 2-core VM, and a kernel timed
 * a minute later is compared against a different machine. This reader runs on the kernels' own weight copies, in
 * the same rounds as the kernels (scripts/bench/roofline.py), so a type's share of it is a same-minute ratio on the
 * same bytes (any cache luck included alike).
 *
 * Each thread takes one contiguous slice (as OpenMP's static split, 128-byte aligned) and sums its bytes with
 * vpsadbw into 64-bit lanes, 4 independent 32-byte loads an iteration; the result is the sum of all n bytes (the
 * loads cannot be dropped, and tests/test_benchmark.py checks it against numpy).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static uint64_t sum_bytes(const uint8_t *p, size_t n) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i a0 = zero, a1 = zero, a2 = zero, a3 = zero;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i)), zero));
        a1 = _mm256_add_epi64(a1, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i + 32)), zero));
        a2 = _mm256_add_epi64(a2, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i + 64)), zero));
        a3 = _mm256_add_epi64(a3, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i + 96)), zero));
    }
    const __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t s = (uint64_t)_mm256_extract_epi64(a, 0) + (uint64_t)_mm256_extract_epi64(a, 1) +
                 (uint64_t)_mm256_extract_epi64(a, 2) + (uint64_t)_mm256_extract_epi64(a, 3);
    for (; i < n; i++) s += p[i];
    return s;
}

/* The sum of the n bytes at p, read by `threads` threads (< 1: 1). */
uint64_t stream_read(const uint8_t *p, size_t n, int threads) {
    uint64_t total = 0;
    if (threads < 1) threads = 1;
    const size_t slice = ((n + (size_t)threads - 1) / (size_t)threads + 127) & ~(size_t)127; /* covers n */
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        const size_t lo = (size_t)t * slice < n ? (size_t)t * slice : n;
        const size_t hi = lo + slice < n ? lo + slice : n;
        total += sum_bytes(p + lo, hi - lo);
    }
    return total;
}
