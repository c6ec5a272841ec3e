"""The fp32 GEMM kernels over one packed copy (``small_gemm.c``): built once with the system C compiler, via ctypes.

Every fp32 weight is held once, as panels of 8 output columns (``pack``), and both kernels read them:

* ``small_gemm`` (M <= ``MAX_ROWS``, decode steps): bound by streaming the weights, so each panel is read
  once and reused from L1 for every row. Measured on the 2-core AVX2 box this project is benchmarked on
  (all 25 linears of distilgpt2 in turn, 324 MB, weights cold in cache, 2 threads, GB/s of weights
  streamed; two runs a minute apart; ``scripts/benchmark.py`` reports the kernel's rates as ``linear_kernels``):

      rows M                 1          4          8          16         32
      oneDNN packed     13.7-13.9  6.5-10.6    8.0-8.3    6.1-7.0    4.5-5.1
      this kernel       15.5-16.8  13.1-16.1  12.3-15.0   7.9-9.6    4.6-4.9

* ``panel_gemm`` (more rows: prefill, big decode batches): BLIS-style over the same panels (X packed per
  call into 6-row micro-panels, 6 x 16 register tiles over pairs of panels), at the speed of oneDNN on its
  own reordered copy, which therefore is no longer kept. Time per call against oneDNN's prepacked
  ``_linear_pointwise``, side by side in one process, 1 thread, min of repeated calls (shared machine):

      rows M                 17     32     64     128    256    512
      768 x 768            0.97   1.05   1.00   1.00   1.01   1.01
      2304 x 768 (QKV)     0.92   0.98   0.94   0.98   1.02   1.02
      3072 x 768 (fc)      0.87   0.98   0.96   0.99   1.01   1.01
      768 x 3072 (proj)    0.91   0.99   0.99   1.05   1.06   1.07
      50257 x 768 (head)   0.81   0.98   1.01   1.06   1.04   1.02

  (a whole distilgpt2 prefill of 17-512 tokens: 0.85-1.01x; ``F.linear`` on a plain copy, which packs the
  weight per call, was 1.1-2.5x oneDNN's time at these sizes.)

Both give the same bits (each output one FMA chain over k in order, then + bias, + residual), at any
thread count. The kernels need AVX2 + FMA and a C compiler with OpenMP; without them ``load()`` returns
None, says why once in the log, and the linears keep one oneDNN copy instead. ``build.py`` compiles it
once per machine into the cache's ``kernels/`` directory (``models/cache_dir.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

import torch

from .build import KernelLoader, build_and_load, require_avx2

log = logging.getLogger("minibatch.small_gemm")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
PANEL = 8  # output columns per packed panel (small_gemm.c)
MAX_ROWS = 16  # small_gemm for at most this many rows, panel_gemm above


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
    lib.panel_gemm.restype = ctypes.c_int
    lib.panel_gemm.argtypes = lib.small_gemm.argtypes
    return lib


KERNEL = KernelLoader("fp32 GEMM kernels", _load, "fp32 linears keep one oneDNN copy instead", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


RELEASE_CHUNK_BYTES = 16 << 20  # pack: a weight at least twice this size is copied (and released) in such chunks


def pack(weight: torch.Tensor, release: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
    """weight: [N, K] fp32 -> panels [ceil(N / 8), K, 8], column n of panel p is output row p*8 + n.

    ``release(rows)``, if given, is called with each chunk of ``weight``'s rows once copied, then with the whole
    ``weight``, for a weight of at least two ``RELEASE_CHUNK_BYTES`` chunks: a checkpoint table's pages can leave
    RSS as its panels fill, rather than both being resident at once (``state_dict.release_file_pages``). The last call
    catches what reading a chunk mapped back of the one before (the kernel maps a fault's cached neighbours too,
    in windows that need not align with the chunks) and the rows of a partial last panel."""
    n, k = weight.shape
    full, rest = divmod(n, PANEL)
    out = torch.empty(full + (rest > 0), k, PANEL, dtype=torch.float32)
    chunked = release is not None and n * k * 4 >= 2 * RELEASE_CHUNK_BYTES
    step = max(1, RELEASE_CHUNK_BYTES // (PANEL * k * 4)) if chunked else max(full, 1)  # panels per copy
    # One copy straight into the panels (no padded [N, K] intermediate: a load's peak would hold one more weight).
    for p0 in range(0, full, step):
        rows = weight[p0 * PANEL : min(full, p0 + step) * PANEL]
        out[p0 : p0 + len(rows) // PANEL] = rows.unflatten(0, (len(rows) // PANEL, PANEL)).transpose(1, 2)
        if chunked:
            release(rows)
    if rest:  # the last panel's missing outputs are zero columns
        out[full].zero_()
        out[full, :, :rest] = weight[full * PANEL :].t()
    if chunked:
        release(weight)
    return out


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W read out of ``pack(W)`` (a tied lm_head's panels as the token table): [len(ids), K]."""
    return packed[ids // PANEL, :, ids % PANEL]


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
        raise RuntimeError(f"fp32 GEMM kernels unavailable: {KERNEL.unavailable_reason}")
    m, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * PANEL < n_out:
        raise ValueError(f"x [{m}, {k}] does not match packed weights {tuple(packed.shape)} for {n_out} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty(m, n_out, dtype=torch.float32)
    call = kernel.small_gemm if m <= MAX_ROWS else kernel.panel_gemm
    rc = call(
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
    if rc:  # panel_gemm only (small_gemm returns nothing: ctypes reads its void return as None)
        raise MemoryError("panel_gemm: cannot allocate the packing buffer")
    return out
