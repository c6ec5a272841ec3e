/* What decode_step.c calls in quant_gemm.c's library (it is linked against it, quant_lib.py). */
#ifndef MINIBATCH_QUANT_GEMM_H
#define MINIBATCH_QUANT_GEMM_H
#include <stdint.h>

#define Q_DIRECT_ROWS 8 /* at most this many rows take the direct path (quant_gemm.c) */

/* Bytes of a row of K weights of GGUF type t; -1 for an unknown type or K that is not whole blocks. */
long quant_row_bytes(int t, int K);
/* Output rows [n0, n1) of Y = X W^T (+ bias) (+ R) for W of GGUF type t; 0, or -1 when a tile buffer cannot be
 * allocated. Any thread may call it for its own rows. */
int quant_range(int t, const float *X, int ldx, const uint8_t *W, const float *bias, const float *R, int ldr,
                float *Y, int ldy, int M, int K, int n0, int n1, int direct_rows);
/* Row `row` of K weights -> out[0 .. ceil32(K)) fp32: the values every path multiplies by. */
void quant_row(int t, const uint8_t *row, int K, float *out);
#endif
