/* LoRA adapters inside the whole-step kernel (decode_step.c includes this file; models/lora.py has the math):
 * after a base linear Y = X W^T (+ b, + residual), the rows of each adapter present get
 *
 *     Y[rows, n0 + c] += scale * sum_j (X[rows] A^T)[j0 + j] * B^T[j, c]      for each HF module (part) it targets
 *
 * (PEFT's result + lora_B(lora_A(x)) * scaling), never merged into W: the rows are grouped by adapter (vLLM's punica
 * idea), and per adapter and linear one shrink over its rows (X[rows] a_t, a_t = every part's A^T side by side, [K, R])
 * and one expand per part, both in AVX2 FMA register tiles. A thread computes the shrink of a group in full (R x K x rows FMAs, ~1% of the base
 * linear at rank 16: cheaper than a barrier) and expands only into the output columns it computed of the base (the
 * base's split: linear_part's units of PANEL outputs per base part), right after them: no barrier, no other thread's
 * columns. Every output is one thread's, summed in one order: results do not depend on the thread count.
 *
 * Shapes: n rows of a group, K inputs, R the adapter's shrink width on this linear (its parts' ranks), r a part's. */

#define LORA_KINDS 4     /* qkv, o, up, down: models/lora.KINDS */

/* One HF module's adapter inside one linear: shrink columns [j0, j0 + r), outputs [n0, n0 + N), B^T [r, N]. */
typedef struct {
    const float *b_t;
    int j0, r, n0, N;
    float scale;
} LoraPart;

/* One adapter on one linear: a_t [K, R]; R 0: the adapter does not target it. */
typedef struct {
    const float *a_t;
    int R, n_parts;
    LoraPart part[MAX_PARTS];
} LoraLin;

/* A step's adapters (models/kernels/lora_step.py builds it per call): group g is rows[starts[g] .. starts[g + 1])
 * (ascending) under slot slots[g]; lins[(layer * LORA_KINDS + kind) * n_slots + slot]; scratch: per thread
 * scratch_floats floats (a group's shrink, [rows, R]). */
typedef struct {
    int n_groups, n_slots;
    const int *slots, *starts;
    const long *rows;
    const LoraLin *lins;
    float *scratch;
    long scratch_floats;
} Lora;

/* T [n, R] = X[rows] a_t: each element a chain of FMAs over k in order (fmaf in the tail: the same rounding), in
 * tiles of up to 32 shrink columns held in registers over the whole k loop. */
static void lora_shrink(const LoraLin *A, const float *X, int ldx, const long *rows, int n, int K, float *T) {
    const int R = A->R;
    for (int i = 0; i < n; i++) {
        const float *x = X + rows[i] * (long)ldx;
        float *t = T + (long)i * R;
        int j0 = 0;
        for (; j0 + 8 <= R; j0 += 32) {
            const int regs = (R - j0) / 8 < 4 ? (R - j0) / 8 : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int k = 0; k < K; k++) {
                const __m256 v = _mm256_set1_ps(x[k]);
                const float *a = A->a_t + (long)k * R + j0;
                for (int q = 0; q < regs; q++) acc[q] = _mm256_fmadd_ps(v, _mm256_loadu_ps(a + 8 * q), acc[q]);
            }
            for (int q = 0; q < regs; q++) _mm256_storeu_ps(t + j0 + 8 * q, acc[q]);
            if (regs < 4) {
                j0 += 8 * regs;
                break;
            }
        }
        for (int j = j0; j < R; j++) { /* R not a multiple of 8: the last columns one at a time */
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc = fmaf(x[k], A->a_t[(long)k * R + j], acc);
            t[j] = acc;
        }
    }
}

/* Y[rows, c] += scale * sum_j T[rows, j0 + j] B^T[j, c - n0] for the columns c of [c0, c1) inside the part: tiles of
 * 32 columns whose sums stay in registers over j (B^T's tile, r x 32 floats, stays in L1 over the rows), each sum a
 * chain of FMAs over j in order (fmaf in the tail), then y + sum * scale. */
static void lora_expand(const LoraPart *P, const float *T, int R, const long *rows, int n, float *Y, int ldy, int c0,
                        int c1) {
    const int lo = c0 > P->n0 ? c0 : P->n0, hi = c1 < P->n0 + P->N ? c1 : P->n0 + P->N;
    const __m256 scale = _mm256_set1_ps(P->scale);
    int c = lo;
    for (; c + 32 <= hi; c += 32) {
        const float *b = P->b_t + (c - P->n0);
        for (int i = 0; i < n; i++) {
            const float *t = T + (long)i * R + P->j0;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int j = 0; j < P->r; j++) {
                const __m256 v = _mm256_set1_ps(t[j]);
                const float *bj = b + (long)j * P->N;
                for (int q = 0; q < 4; q++) acc[q] = _mm256_fmadd_ps(v, _mm256_loadu_ps(bj + 8 * q), acc[q]);
            }
            float *y = Y + rows[i] * (long)ldy + c;
            for (int q = 0; q < 4; q++)
                _mm256_storeu_ps(y + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y + 8 * q), _mm256_mul_ps(acc[q], scale)));
        }
    }
    for (; c < hi; c++) { /* the range's last columns (fewer than 32) one at a time: the same sums */
        for (int i = 0; i < n; i++) {
            const float *t = T + (long)i * R + P->j0;
            float acc = 0.0f;
            for (int j = 0; j < P->r; j++) acc = fmaf(t[j], P->b_t[(long)j * P->N + (c - P->n0)], acc);
            float *y = Y + rows[i] * (long)ldy + c;
            *y = *y + acc * P->scale;
        }
    }
}

/* After linear_part(L, X -> Y) in thread t of nt: every adapter's delta over its rows, on this thread's columns. */
static void lora_linear(const Lora *lo, int layer, int kind, const Lin *L, const float *X, int ldx, float *Y, int ldy,
                        int t, int nt) {
    if (!lo) return;
    float *T = lo->scratch + (long)t * lo->scratch_floats;
    for (int g = 0; g < lo->n_groups; g++) {
        const LoraLin *A = &lo->lins[((long)layer * LORA_KINDS + kind) * lo->n_slots + lo->slots[g]];
        if (!A->R) continue;
        const long *rows = lo->rows + lo->starts[g];
        const int n = lo->starts[g + 1] - lo->starts[g];
        int shrunk = 0;
        for (int p = 0, n0 = 0; p < L->n_parts; n0 += L->part[p].N, p++) { /* this thread's columns: linear_part's */
            const int units = (L->part[p].N + PANEL - 1) / PANEL;
            const int u0 = (int)((long)units * t / nt), u1 = (int)((long)units * (t + 1) / nt);
            if (u0 >= u1) continue;
            const int c0 = n0 + u0 * PANEL, c1 = n0 + (u1 * PANEL < L->part[p].N ? u1 * PANEL : L->part[p].N);
            for (int q = 0; q < A->n_parts; q++) {
                const LoraPart *P = &A->part[q];
                if (P->n0 >= c1 || P->n0 + P->N <= c0) continue;
                if (!shrunk) lora_shrink(A, X, ldx, rows, n, L->K, T), shrunk = 1;
                lora_expand(P, T, A->R, rows, n, Y, ldy, c0, c1);
            }
        }
    }
}
