/* fp32 GEMM over one packed copy of W: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias[N]) (+ R[M, N]).
 *
 * Layout: W is packed once into panels of 8 output columns, Wp[N/8][K][8] (the last panel
 * zero-padded), the only copy of the weight the model keeps. Two kernels read it:
 *
 * small_gemm (decode steps, M up to small_gemm.py's MAX_ROWS): at decode a step multiplies a handful of
 * rows by every weight matrix, so it is bound by streaming the weights from memory. Library GEMMs tile
 * for large M and reach about half of this CPU's read bandwidth at M = 8; this kernel streams each
 * panel once and reuses it from L1 for every row: the inner loop reads weights strictly sequentially,
 * one 8-wide load, then 8 rows x 1 fused multiply-add against broadcast inputs, 8 accumulators in
 * registers. Threads split the panels (columns); each row's sum runs over k in order, so the result
 * does not depend on the thread count.
 *
 * panel_gemm (larger M): below.
 *
 * Built by small_gemm.py with -O3 -mavx2 -mfma -fopenmp; OpenMP resolves to the libgomp that
 * torch already loaded (same soname), so the kernels share torch's thread team.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 8 /* output columns per packed panel = floats per AVX register */
#define ROWS 8  /* input rows per pass over a panel = accumulators in registers */
#define PREFETCH_FLOATS 1024

/* One panel (8 columns) for up to ROWS rows. x[i]: row i of X (rows past `rows` alias the last
 * real row; their results are dropped). Stores rows x cols results into y[i] (+ bias, + r[i]). */
static void panel_kernel(const float *const *x, int K, const float *w, const float *bias,
                         const float *const *r, float *const *y, int rows, int cols) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    const float *x4 = x[4], *x5 = x[5], *x6 = x[6], *x7 = x[7];
    for (int k = 0; k < K; k++) {
        /* 4 KB ahead of the stream: measured 10-25% faster than leaving it to the hardware
         * prefetcher (a prefetch past the end of the weights is harmless: it never faults). */
        _mm_prefetch((const char *)(w + (size_t)k * PANEL + PREFETCH_FLOATS), _MM_HINT_T0);
        __m256 wk = _mm256_loadu_ps(w + (size_t)k * PANEL); /* W[panel cols, k] */
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + k), wk, a0);
        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x1 + k), wk, a1);
        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x2 + k), wk, a2);
        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x3 + k), wk, a3);
        a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(x4 + k), wk, a4);
        a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(x5 + k), wk, a5);
        a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(x6 + k), wk, a6);
        a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(x7 + k), wk, a7);
    }
    __m256 acc[ROWS] = {a0, a1, a2, a3, a4, a5, a6, a7};
    float tmp[PANEL];
    for (int i = 0; i < rows; i++) {
        __m256 v = acc[i];
        if (cols == PANEL) {
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
            if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r[i]));
            _mm256_storeu_ps(y[i], v);
        } else { /* the last, partial panel: only `cols` columns exist in bias, r and y */
            _mm256_storeu_ps(tmp, v);
            for (int j = 0; j < cols; j++) y[i][j] = tmp[j] + (bias ? bias[j] : 0.0f) + (r ? r[i][j] : 0.0f);
        }
    }
}

/* Panels [p0, p1) for all M rows: each panel is read from memory once, then from L1 for the
 * remaining row groups. */
static void panels(const float *X, int ldx, const float *Wp, const float *bias, const float *R, int ldr,
                   float *Y, int ldy, int M, int K, int N, int p0, int p1) {
    for (int p = p0; p < p1; p++) {
        int n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        const float *w = Wp + (size_t)p * K * PANEL;
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int rows = M - m0 < ROWS ? M - m0 : ROWS;
            const float *x[ROWS], *r[ROWS];
            float *y[ROWS];
            for (int i = 0; i < ROWS; i++) {
                int m = m0 + (i < rows ? i : rows - 1);
                x[i] = X + (size_t)m * ldx;
                r[i] = R ? R + (size_t)m * ldr + n0 : NULL;
                y[i] = Y + (size_t)m * ldy + n0;
            }
            panel_kernel(x, K, w, bias ? bias + n0 : NULL, R ? r : NULL, y, rows, cols);
        }
    }
}

/* Y = X @ W^T (+ bias) (+ R), threads splitting the ceil(N / 8) panels. bias and R may be NULL. */
void small_gemm(const float *X, int ldx, const float *Wp, const float *bias, const float *R, int ldr,
                float *Y, int ldy, int M, int K, int N, int nthreads) {
    int npanels = (N + PANEL - 1) / PANEL;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        panels(X, ldx, Wp, bias, R, ldr, Y, ldy, M, K, N, (int)((long)npanels * t / nt),
               (int)((long)npanels * (t + 1) / nt));
    }
}

/* ---- Larger M (prefill): the same panels, read BLIS-style (Goto's algorithm) ----
 *
 * Why: the panels are the one fp32 copy of a weight, so prefill-sized calls must run on them as fast as
 * oneDNN runs on its own reordered copy (small_gemm.py has the measurements). Wp[p][k][8] already is
 * BLIS's packed-B layout for NR = 8, so only X is packed: a block of rows and K (AP_FLOATS, L2) as MR-row
 * micro-panels Ap[i][k][MR]. Each thread then walks ITS pairs of panels; per pair, K in slices of up to
 * KC, and per slice every micro-panel of rows: MR x 16 outputs accumulate in 12 registers (6 broadcasts
 * of X, 2 loads of W, 12 FMAs per k) while the pair's slice (kc x 16 floats: 48 KB at K = 768) is reread
 * from L1 / L2 for each micro-panel. On this CPU (Zen 4, L2 1 MB per core) that is faster than BLIS's usual KC of
 * 256, which keeps a slice in L1 but stores and reloads the partial sums once per slice.
 *
 * Results: an output's sum is one FMA chain over k in order from zero (partials of a K slice stored and
 * reloaded exactly), then + bias, then + R: the small kernel's order, so both paths give the same bits,
 * and each output is computed by one thread, so the thread count changes nothing.
 */
#define MR 6                   /* rows per micro-tile */
#define KC 3072                /* K slice per tile: slices of 256 to 1536 measured 3-9% slower at K = 3072 */
#define AP_FLOATS (128 * 1024) /* packed X at once: 512 KB (L2) */
#define MC_MIN 128             /* fewer rows of all of K than this in AP_FLOATS: pack KB_DEEP of K at a time */
#define KB_DEEP (2 * KC)

/* Rows [m0, m0 + mc) x columns [k0, k0 + kc) of X into micro-panels [i0, i1) of Ap: Ap[i][k][r] = X[m0 + i MR + r,
 * k0 + k], rows past mc zero. */
static void pack_x(const float *X, int ldx, int m0, int mc, int k0, int kc, float *Ap, int i0, int i1) {
    for (int i = i0; i < i1; i++) {
        float *dst = Ap + (size_t)i * kc * MR;
        for (int r = 0; r < MR; r++) {
            const int row = i * MR + r;
            if (row < mc) {
                const float *src = X + (size_t)(m0 + row) * ldx + k0;
                for (int k = 0; k < kc; k++) dst[(size_t)k * MR + r] = src[k];
            } else {
                for (int k = 0; k < kc; k++) dst[(size_t)k * MR + r] = 0.0f;
            }
        }
    }
}

/* The k loop and stores of a tile of R rows (1..MR; a constant once inlined, so the rows past R cost nothing: a
 * last micro-panel of 2 rows takes a third of the FMAs of a full one). yp[i], rp[i]: row i of the tile's outputs and
 * of R (rp used when add_r). */
static inline __attribute__((always_inline)) void tile_rows(const int R, int kc, const float *a, const float *b0,
                                                            const float *b1, float *const *yp, const float *const *rp,
                                                            int first, int last, const float *bias, int add_r,
                                                            const float *next, long skip) {
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) {
        c[i][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yp[i]);
        c[i][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yp[i] + 8);
    }
    for (int k = 0; k < kc; k++) {
        if (next && (k & 1) == 0) { /* one 64-byte line of each of the next tile's two panels per 2 k */
            _mm_prefetch((const char *)(next + (size_t)k * PANEL), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + skip + (size_t)k * PANEL), _MM_HINT_T1);
        }
        const __m256 w0 = _mm256_loadu_ps(b0 + (size_t)k * PANEL), w1 = _mm256_loadu_ps(b1 + (size_t)k * PANEL);
        const float *ak = a + (size_t)k * MR;
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            const __m256 x = _mm256_broadcast_ss(ak + i);
            c[i][0] = _mm256_fmadd_ps(x, w0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(x, w1, c[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
        for (int h = 0; h < 2; h++) {
            __m256 v = c[i][h];
            if (last && bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            if (last && add_r) v = _mm256_add_ps(v, _mm256_loadu_ps(rp[i] + 8 * h));
            _mm256_storeu_ps(yp[i] + 8 * h, v);
        }
}

/* tile_rows at R = MR, written out: gcc 12 keeps these 12 accumulators in registers with a tighter loop (measured
 * 3-5% faster at M = 512 than the generic loop at R = 6, the same bits: the same FMA chains). */
static inline __attribute__((always_inline)) void tile_full(int kc, const float *a, const float *b0, const float *b1,
                                                            float *const *yp, const float *const *rp, int first,
                                                            int last, const float *bias, int add_r, const float *next,
                                                            long skip) {
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    if (first) {
        c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    } else {
        c00 = _mm256_loadu_ps(yp[0]), c01 = _mm256_loadu_ps(yp[0] + 8);
        c10 = _mm256_loadu_ps(yp[1]), c11 = _mm256_loadu_ps(yp[1] + 8);
        c20 = _mm256_loadu_ps(yp[2]), c21 = _mm256_loadu_ps(yp[2] + 8);
        c30 = _mm256_loadu_ps(yp[3]), c31 = _mm256_loadu_ps(yp[3] + 8);
        c40 = _mm256_loadu_ps(yp[4]), c41 = _mm256_loadu_ps(yp[4] + 8);
        c50 = _mm256_loadu_ps(yp[5]), c51 = _mm256_loadu_ps(yp[5] + 8);
    }
    for (int k = 0; k < kc; k++) {
        if (next && (k & 1) == 0) { /* one 64-byte line of each of the next tile's two panels per 2 k */
            _mm_prefetch((const char *)(next + (size_t)k * PANEL), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + skip + (size_t)k * PANEL), _MM_HINT_T1);
        }
        const __m256 w0 = _mm256_loadu_ps(b0 + (size_t)k * PANEL), w1 = _mm256_loadu_ps(b1 + (size_t)k * PANEL);
        const float *ak = a + (size_t)k * MR;
        __m256 x = _mm256_broadcast_ss(ak);
        c00 = _mm256_fmadd_ps(x, w0, c00), c01 = _mm256_fmadd_ps(x, w1, c01);
        x = _mm256_broadcast_ss(ak + 1);
        c10 = _mm256_fmadd_ps(x, w0, c10), c11 = _mm256_fmadd_ps(x, w1, c11);
        x = _mm256_broadcast_ss(ak + 2);
        c20 = _mm256_fmadd_ps(x, w0, c20), c21 = _mm256_fmadd_ps(x, w1, c21);
        x = _mm256_broadcast_ss(ak + 3);
        c30 = _mm256_fmadd_ps(x, w0, c30), c31 = _mm256_fmadd_ps(x, w1, c31);
        x = _mm256_broadcast_ss(ak + 4);
        c40 = _mm256_fmadd_ps(x, w0, c40), c41 = _mm256_fmadd_ps(x, w1, c41);
        x = _mm256_broadcast_ss(ak + 5);
        c50 = _mm256_fmadd_ps(x, w0, c50), c51 = _mm256_fmadd_ps(x, w1, c51);
    }
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++) {
            __m256 v = acc[i][h];
            if (last && bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            if (last && add_r) v = _mm256_add_ps(v, _mm256_loadu_ps(rp[i] + 8 * h));
            _mm256_storeu_ps(yp[i] + 8 * h, v);
        }
}

/* One tile of up to MR rows x 16 columns over a K slice: acc (loaded from y unless first) += Ap micro-panel a
 * [kc][MR] x panels b0, b1 [kc][8] (b1 = b0 when the tile has one panel). rows x cols of the tile exist in y
 * (cols <= 16). On the last slice, bias (its 16 columns, or NULL) and r (rows of R at the tile's columns, or NULL)
 * are added as the small kernel adds them. next: the slice the following tile reads from memory (KC x 16 floats
 * at next and next + skip), prefetched into L2 while this one computes, or NULL. */
static void tile_6x16(int kc, const float *a, const float *b0, const float *b1, float *y, int ldy, int rows, int cols,
                      int first, int last, const float *bias, const float *r, int ldr, const float *next, long skip) {
    float tmp[MR * 16];
    float *yp[MR];
    const float *rp[MR];
    const int wide = cols == 16;
    for (int i = 0; i < rows; i++) {
        rp[i] = r ? r + (size_t)i * ldr : NULL;
        yp[i] = wide ? y + (size_t)i * ldy : tmp + i * 16;
        if (!wide) /* the last columns of N: through tmp, so every vector load and store stays in bounds */
            for (int j = 0; j < 16; j++) tmp[i * 16 + j] = !first && j < cols ? y[(size_t)i * ldy + j] : 0.0f;
    }
    const float *wb = wide ? bias : NULL; /* the narrow tile adds bias and r below, column by column */
    const int wr = wide && r;
    switch (rows) {
    case 6: tile_full(kc, a, b0, b1, yp, rp, first, last, wb, wr, next, skip); break;
    case 5: tile_rows(5, kc, a, b0, b1, yp, rp, first, last, wb, wr, next, skip); break;
    case 4: tile_rows(4, kc, a, b0, b1, yp, rp, first, last, wb, wr, next, skip); break;
    case 3: tile_rows(3, kc, a, b0, b1, yp, rp, first, last, wb, wr, next, skip); break;
    case 2: tile_rows(2, kc, a, b0, b1, yp, rp, first, last, wb, wr, next, skip); break;
    default: tile_rows(1, kc, a, b0, b1, yp, rp, first, last, wb, wr, next, skip); break;
    }
    if (wide) return;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float v = tmp[i * 16 + j];
            if (last) v = v + (bias ? bias[j] : 0.0f) + (r ? r[(size_t)i * ldr + j] : 0.0f);
            y[(size_t)i * ldy + j] = v;
        }
}

/* This thread's pairs of panels [q0, q1) over packed rows Ap (rows [m0, m0 + mc), K block [kb0, kb0 + kb)): per
 * pair, every K slice of the block, every micro-panel of rows; the pair's mc x 16 outputs stay in cache across its
 * slices. */
static void pair_range(const float *Ap, const float *Wp, const float *bias, const float *R, int ldr, float *Y, int ldy,
                       int m0, int mc, int K, int N, int kb0, int kb, int q0, int q1) {
    const int npanels = (N + PANEL - 1) / PANEL, nmp = (mc + MR - 1) / MR, kend = kb0 + kb;
    for (int q = q0; q < q1; q++) {
        const int p = 2 * q, n0 = p * PANEL, cols = N - n0 < 2 * PANEL ? N - n0 : 2 * PANEL;
        const long skip = p + 1 < npanels ? (long)K * PANEL : 0; /* b1 - b0; 0: a lone last panel, its columns twice */
        for (int k0 = kb0; k0 < kend; k0 += KC) {
            const int kc = kend - k0 < KC ? kend - k0 : KC, first = k0 == 0, last = k0 + kc == K;
            const float *b0 = Wp + ((size_t)p * K + k0) * PANEL;
            /* what the next tile reads from memory, prefetched into L2 while this one computes: the pair's next
             * slice, or the next pair's first of this block */
            const int more = k0 + kc < kend;
            const float *next = more ? b0 + (size_t)kc * PANEL
                                : q + 1 < q1 ? Wp + ((size_t)(p + 2) * K + kb0) * PANEL
                                             : NULL;
            const long next_skip = more ? skip : p + 3 < npanels ? (long)K * PANEL : 0;
            for (int i = 0; i < nmp; i++) {
                const int m = m0 + i * MR, rows = mc - i * MR < MR ? mc - i * MR : MR;
                tile_6x16(kc, Ap + ((size_t)i * kb + k0 - kb0) * MR, b0, b0 + skip, Y + (size_t)m * ldy + n0, ldy, rows,
                          cols, first, last, last && bias ? bias + n0 : NULL,
                          last && R ? R + (size_t)m * ldr + n0 : NULL, ldr, i == 0 ? next : NULL, next_skip);
            }
        }
    }
}

/* This thread's packing buffer of at least `bytes`, kept from call to call (a fresh one per call cost ~15% of a
 * 768 x 768 call at 32-128 rows: the pages are faulted in and zeroed anew), or NULL when it cannot grow. */
static float *thread_buffer(size_t bytes) {
    static __thread float *buf = NULL;
    static __thread size_t have = 0;
    if (bytes > have) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        have = buf ? bytes : 0;
    }
    return buf;
}

/* Y = X @ W^T (+ bias) (+ R) for any M (meant for M above the small kernel's rows), threads splitting the pairs of
 * panels. X is packed a block at a time, mc rows x kb of K in AP_FLOATS: all of K while that leaves MC_MIN rows or
 * more (the weights then stream once per mc rows), else KB_DEEP of K (partial sums then go through Y once per K
 * block: less traffic than streaming a wide-K weight once per few rows). Each thread packs X for itself (M x K
 * floats, small beside its share of the M x K x N FMAs): no barrier, so a thread the OS preempts delays only the end
 * of the call. R must not alias Y (partial sums live in Y until the last K slice). Returns 0, or -1 when the packing
 * buffers cannot be allocated. */
int panel_gemm(const float *X, int ldx, const float *Wp, const float *bias, const float *R, int ldr, float *Y,
               int ldy, int M, int K, int N, int nthreads) {
    const int npairs = ((N + PANEL - 1) / PANEL + 1) / 2;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > npairs) nthreads = npairs;
    const int kb = AP_FLOATS / K < MC_MIN && K > KB_DEEP ? KB_DEEP : K; /* K depth of a packed block */
    int cap = AP_FLOATS / kb / MR * MR;                                    /* rows of a packed block */
    cap = cap < MR ? MR : cap;
    const int blocks = (M + cap - 1) / cap, mc_max = ((M + blocks - 1) / blocks + MR - 1) / MR * MR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        float *Ap = thread_buffer((size_t)mc_max * kb * sizeof(float));
        const int q0 = (int)((long)npairs * t / nt), q1 = (int)((long)npairs * (t + 1) / nt);
        if (!Ap) {
#pragma omp atomic write
            failed = 1;
        }
        for (int m0 = 0; Ap && m0 < M && q0 < q1; m0 += mc_max) {
            const int mc = M - m0 < mc_max ? M - m0 : mc_max;
            for (int kb0 = 0; kb0 < K; kb0 += kb) {
                const int kbn = K - kb0 < kb ? K - kb0 : kb;
                pack_x(X, ldx, m0, mc, kb0, kbn, Ap, 0, (mc + MR - 1) / MR);
                pair_range(Ap, Wp, bias, R, ldr, Y, ldy, m0, mc, K, N, kb0, kbn, q0, q1);
            }
        }
    }
    return failed ? -1 : 0;
}
