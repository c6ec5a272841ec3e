"""Quantized weights (int8, int4) in one packed layout, and the GEMM over them (``quant_gemm.c``, ctypes).

A ``QuantWeight`` is the only copy of a quantized linear's weight: the compiled kernel reads it
for every batch size (dequantizing in registers at decode sizes, into a per-thread L2 tile at
prefill sizes), the torch fallback unpacks it, and embedding lookups dequantize rows of it.

Formats (group = 32 consecutive inputs of one output row; d, m fp16):

    int8   w = q * d        q int8        1.0625 bytes / weight   = GGUF Q8_0 exactly
    int4   w = q * d + m    q in 0..15    0.625 bytes / weight    = GGUF Q4_1 exactly (Q4_0: m = -8 d)

int8 is per 32-group, not per output channel: GGUF Q8_0 (the SmolLM2 GGUF's embedding and
lm_head) then loads without changing a weight, quantizing fp32 loses less, and the scale costs
one multiply per 8 weights in the kernel, amortized over the rows. The packed layout is
described in ``quant_gemm.c``.

Measured on the 2-core AVX2 box (shared with other jobs, so one thread and its CPU time:
SmolLM2-shaped linears, 30 layers x 7 = 106M weights, cold in cache; ms per pass, and GB/s of
the format's own bytes; fp32 from an earlier run):

    rows M                1            4            8            12           16
    fp32 small_gemm   22.0 (19.3)  25.4 (16.8)  34.4 (12.4)                55.2 (7.7)
    int8              13.8 (10.3)  18.1 (7.9)   33.1 (4.3)   44.1 (3.2)   56.4 (2.5)
    int4              11.3 (7.4)   16.6 (5.1)   32.0 (2.6)   47.6 (1.8)   55.1 (1.5)

Above 8 rows each weight is dequantized once per call into an L1 block (``quant_gemm.c``): at
12 and 16 rows 1.13-1.35x the former register path (int8 16 rows: 65.9 ms before, side by side;
distilgpt2 shape at two threads 1.26x), the same bits. At 8 rows and fewer it is no faster
(distilgpt2 shape: 0.66x at 3 rows, 0.95x at 8): there the register path is FMA- and
load-bound, not dequantize-bound (8 rows run ~4.2 G 8-wide FMAs/s on one core, near the
peak), so int8 at batch 8 does the same FMAs as fp32 and can only win by fp32's stalls.

One core cannot saturate memory with the dequantizing kernels, so int8/int4 are 1.6-2.0x at
M = 1 and close to fp32's FMA-bound speed by M = 16; with two threads fp32 stays bound by
bandwidth while these scale with cores. Above ``DIRECT_ROWS`` the L2-tile path is faster
(M = 24, 32: 5-10%) and reaches 80-95% of oneDNN's fp32 GFLOP/s at prefill sizes.

Where the CPU has AVX-512F the same kernels run a panel pair per 16-lane register (``quant_gemm.c``), bit for bit
the AVX2 results; on a 2-core AVX-512 Xeon, distilgpt2-shaped int8 linears at 8 rows took 5.4 ms against AVX2's
9.2, at 16-64 rows 1.3-1.4x less (``KERNEL_ISA``, ``build.set_kernel_isa``; README "Latest side-by-side run").

The kernel needs AVX2, FMA, F16C and a C compiler with OpenMP; without them ``load()`` returns
None (reason logged once) and ``matmul`` computes the same dequantized product with torch.
``build.py`` compiles it once per machine into the cache's ``kernels/`` directory.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch

from .build import KernelLoader, build_and_load, require_avx2, with_isa

log = logging.getLogger("minibatch.quant_gemm")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
PANEL = 8  # output columns per panel
GROUP = 32  # inputs per quantization group
FORMATS = {"int8": 0, "int4": 1}  # name -> the kernel's fmt argument
BLOCK_BYTES = {"int8": 16 + GROUP * PANEL, "int4": 32 + GROUP * PANEL // 2}  # one group of one panel
DIRECT_ROWS = 16  # at most this many rows take the direct path (registers; L1 blocks above 8), more the L2 tile


@dataclass
class QuantWeight:
    """One quantized [out_features, in_features] weight, packed: ``data`` uint8 [panels, groups, block bytes]."""

    fmt: str  # "int8" | "int4"
    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features


# ---------------------------------------------------------------- build and load


def _load() -> ctypes.CDLL:
    require_avx2("AVX2, FMA and F16C")
    lib = build_and_load(SOURCE, FLAGS)
    lib.quant_gemm.restype = ctypes.c_int
    lib.quant_gemm.argtypes = [
        ctypes.c_int,  # fmt
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
        ctypes.c_int,
        ctypes.c_int,  # M, K, N, nthreads, direct_rows
    ]
    return with_isa(lib)


KERNEL = KernelLoader("quantized GEMM kernel", _load, "using the torch fallback", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


# ---------------------------------------------------------------- packing


def _groups(k: int) -> int:
    return -(-k // GROUP)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [r, c] zero-padded to [rows, cols]."""
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _half_bytes(x: torch.Tensor, panels: int, groups: int) -> torch.Tensor:
    """fp16 [N, G] -> uint8 [P, G, 16]: each block's 8 columns' values."""
    x = _pad(x.to(torch.float16), panels * PANEL, groups)  # [P*8, G]
    return x.view(panels, PANEL, groups).transpose(1, 2).contiguous().view(torch.uint8)  # [P, G, 8 halves]


def pack(fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> QuantWeight:
    """Pack quantized values: q [N, K] (int8; int4: uint8 0..15), d (and int4's m) fp16 [N, ceil(K / 32)]."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (expected one of {sorted(FORMATS)})")
    n, k = q.shape
    panels, groups = -(-n // PANEL), _groups(k)
    if d.shape != (n, groups) or (fmt == "int4" and (m is None or m.shape != (n, groups))):
        raise ValueError(f"{fmt} scales must be [{n}, {groups}] for a [{n}, {k}] weight")
    qp = _pad(q.view(torch.uint8), panels * PANEL, groups * GROUP)  # [P*8, G*32], pads are q = 0
    qp = qp.view(panels, PANEL, groups, GROUP).permute(0, 2, 3, 1)  # [P, G, 32 k, 8 cols]
    if fmt == "int8":
        parts = [_half_bytes(d, panels, groups), qp.reshape(panels, groups, GROUP * PANEL)]
    else:
        pairs = qp.reshape(panels, groups, GROUP // 2, 2, PANEL)  # k = 2t + j
        nibbles = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)  # [P, G, 16, 8]
        parts = [_half_bytes(d, panels, groups), _half_bytes(m, panels, groups), nibbles.reshape(panels, groups, -1)]
    return QuantWeight(fmt, torch.cat(parts, dim=2).contiguous(), n, k)


def _unpack_panels(fmt: str, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """data uint8 [P, G, block] -> q [P*8, G*32] (int8 or uint8), d (and m) fp16 [P*8, G]; padding included."""
    panels, groups, _ = data.shape

    def halves(lo: int) -> torch.Tensor:  # [P, G, 8] fp16 -> [P*8, G]
        h = data[:, :, lo : lo + 16].contiguous().view(torch.float16)
        return h.transpose(1, 2).reshape(panels * PANEL, groups)

    if fmt == "int8":
        q = data[:, :, 16:].reshape(panels, groups, GROUP, PANEL).contiguous().view(torch.int8)
        m = None
    else:
        nib = data[:, :, 32:].reshape(panels, groups, GROUP // 2, 1, PANEL)
        q = torch.cat([nib & 15, nib >> 4], dim=3).reshape(panels, groups, GROUP, PANEL)
        m = halves(16)
    q = q.permute(0, 3, 1, 2).reshape(panels * PANEL, groups * GROUP)
    return q, halves(0), m


def unpack(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of ``pack``: q [N, K], d (and m for int4) fp16 [N, ceil(K/32)]."""
    q, d, m = _unpack_panels(w.fmt, w.data)
    n, k, g = w.out_features, w.in_features, _groups(w.in_features)
    return q[:n, :k], d[:n, :g], None if m is None else m[:n, :g]


def _dequant(fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """q [R, G*32], d/m [R, G] -> fp32 [R, G*32], the kernel's values: q * d is exact, + m rounds once."""
    rows, groups = d.shape
    qf = q.to(torch.float32).view(rows, groups, GROUP)
    w = qf * d.to(torch.float32)[:, :, None]
    if m is not None:
        w = w + m.to(torch.float32)[:, :, None]
    return w.view(rows, groups * GROUP)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The fp32 [N, K] weight the kernel multiplies by (exactly)."""
    q, d, m = _unpack_panels(w.fmt, w.data)
    return _dequant(w.fmt, q, d, m)[: w.out_features, : w.in_features].contiguous()


def dequantize_rows(w: QuantWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 [R]) of the fp32 weight -> [R, K]: embedding lookups on a tied, quantized table.

    Unpacks only the panels holding those rows.
    """
    rows = rows.to(torch.long).reshape(-1)
    panels, inverse = torch.unique(rows // PANEL, return_inverse=True)
    q, d, m = _unpack_panels(w.fmt, w.data[panels])  # [len(panels) * 8, G*32]
    sel = inverse * PANEL + rows % PANEL
    return _dequant(w.fmt, q[sel], d[sel], None if m is None else m[sel])[:, : w.in_features].contiguous()


# ---------------------------------------------------------------- matmul


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matmul_torch(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The fallback: the same product with the weight dequantized 256 output rows at a time (no full fp32 copy)."""
    out = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    step = 256 // PANEL  # panels per chunk
    for p0 in range(0, w.data.shape[0], step):
        q, d, m = _unpack_panels(w.fmt, w.data[p0 : p0 + step])
        n0, n1 = p0 * PANEL, min((p0 + step) * PANEL, w.out_features)
        wf = _dequant(w.fmt, q, d, m)[: n1 - n0, : w.in_features]
        torch.mm(x, wf.t(), out=out[:, n0:n1])
    if bias is not None:
        out += bias
    if residual is not None:
        out += residual
    return out


def matmul(
    x: torch.Tensor,
    w: QuantWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    direct_rows: int = DIRECT_ROWS,
) -> torch.Tensor:
    """x: [M, K] fp32 -> x @ W^T (+ bias[N]) (+ residual[M, N]): [M, N].

    The compiled kernel when it loaded (results identical at any thread count and any M), else
    ``matmul_torch``. ``direct_rows`` picks the kernel's path (benchmarks only; both give the same bits).
    """
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"x [{m}, {k}] does not match a [{w.out_features}, {w.in_features}] weight")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quantized linears take fp32 CPU activations, got {x.dtype} on {x.device}")
    kernel = load()
    if kernel is None:
        return matmul_torch(x, w, bias, residual)
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    n = w.out_features
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    rc = kernel.quant_gemm(
        FORMATS[w.fmt],
        x.data_ptr(),
        x.stride(0),
        w.data.data_ptr(),
        _ptr(bias),
        _ptr(residual),
        residual.stride(0) if residual is not None else 0,
        out.data_ptr(),
        n,
        m,
        k,
        n,
        torch.get_num_threads(),
        direct_rows,
    )
    if rc != 0:
        raise MemoryError(f"quant_gemm could not allocate its {k} x 16 fp32 tile buffer")
    return out
