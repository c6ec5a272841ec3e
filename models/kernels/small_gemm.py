"""The small-batch GEMM kernel (``small_gemm.c``): built once with the system C compiler, called via ctypes.

A decode step multiplies B rows (B = batch, a few to a few dozen) by every weight matrix, so
it is bound by streaming weights from memory. Measured on the 2-core AVX2 box this project is
benchmarked on (all 25 linears of distilgpt2 in turn, 324 MB, weights cold in cache, 2 threads,
GB/s of weights streamed; two runs a minute apart; ``scripts/benchmark.py`` reports the same
table for any model as ``linear_kernels``):

    rows M                 1          4          8          16         32
    oneDNN packed     13.7-13.9  6.5-10.6    8.0-8.3    6.1-7.0    4.5-5.1
    this kernel       15.5-16.8  13.1-16.1  12.3-15.0   7.9-9.6    4.6-4.9

so it is used for M <= ``MAX_ROWS`` and oneDNN (better at prefill sizes) above. The kernel
needs AVX2 + FMA and a C compiler with OpenMP; without them ``load()`` returns None, says why
once in the log, and the callers keep using oneDNN. ``build.py`` compiles it once per machine
into the cache's ``kernels/`` directory (``models/cache_dir.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from .build import KernelLoader, build_and_load, require_avx2

log = logging.getLogger("minibatch.small_gemm")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
PANEL = 8  # output columns per packed panel (small_gemm.c)
MAX_ROWS = 16  # use the kernel for at most this many rows; oneDNN wins above (table above)


def _load() -> ctypes.CDLL:
    require_avx2()
    lib = build_and_load(SOURCE, FLAGS)
    lib.small_gemm.restype = None
    lib.small_gemm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,  # X, ldx
        ctypes.c_void_p,
        ctypes.c_void_p,  # Wp, bias
        ctypes.c_void_p,
        ctypes.c_int,  # R, ldr
        ctypes.c_void_p,
        ctypes.c_int,  # Y, ldy
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,  # M, K, N, nthreads
    ]
    return lib


KERNEL = KernelLoader("small-batch GEMM kernel", _load, "using oneDNN for every linear", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [N, K] fp32 -> panels [ceil(N / 8), K, 8], column n of panel p is output row p*8 + n."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    n_out: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] -> x @ W^T (+ bias[N]) (+ residual[M, N]): [M, N], W given as ``pack(W)``.

    Every tensor is fp32 on the CPU; x and residual need unit stride along their last dimension.
    """
    kernel = load()
    if kernel is None:
        raise RuntimeError(f"small-batch GEMM kernel unavailable: {KERNEL.unavailable_reason}")
    m, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * PANEL < n_out:
        raise ValueError(f"x [{m}, {k}] does not match packed weights {tuple(packed.shape)} for {n_out} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty(m, n_out, dtype=torch.float32)
    kernel.small_gemm(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        _ptr(bias),
        _ptr(residual),
        residual.stride(0) if residual is not None else 0,
        out.data_ptr(),
        n_out,
        m,
        k,
        n_out,
        torch.get_num_threads(),
    )
    return out
