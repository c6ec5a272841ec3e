"""Quantized weights in their GGUF blocks, and the GEMM over them (``quant_gemm.c``, ctypes).

A ``QuantWeight`` is the only copy of a quantized linear's weight: a [N, K] weight of GGUF type T is N rows of
``T.row_bytes(K)`` bytes, the file's own blocks (``models/gguf/blocks.py`` has every layout and its reference
dequantization; docs/quantization.md). The compiled kernel reads it for every batch size (dequantizing in registers
at decode sizes, into a per-thread L1/L2 buffer at prefill sizes), the torch fallback dequantizes it with the numpy
reference, and embedding lookups dequantize rows of it. A fused linear whose parts have different types (a
Q4_K_M file's Q6_K V beside Q4_K Q and K) is a ``QuantParts``: each part in its own type, outputs side by side.

``WEIGHTS=int8`` / ``int4`` quantize fp32 checkpoints into Q8_0 / Q4_1 (``models/quant.py``), the same kernels.

The kernel needs AVX2, FMA, F16C and a C compiler with OpenMP; without them ``load()`` returns None (reason logged
once) and ``matmul`` computes the same dequantized product with torch. ``build.py`` compiles it once per machine into
the cache's ``kernels/`` directory.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..gguf.blocks import TYPES
from .build import KernelLoader, require_avx2, with_isa
from .quant_lib import library_path

log = logging.getLogger("minibatch.quant_gemm")

WEIGHTS_TYPES = {"int8": "Q8_0", "int4": "Q4_1"}  # WEIGHTS setting -> the type an fp32 weight is quantized to
DIRECT_ROWS = 8  # at most this many rows take the direct path (registers), more the tile path (quant_gemm.c)


@dataclass
class QuantWeight:
    """One [out_features, in_features] weight of GGUF type ``fmt``: ``data`` uint8 [out_features, row bytes]."""

    fmt: str  # the GGUF type's name ("Q4_K")
    data: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        t = TYPES.get(self.fmt)
        if t is None:
            raise ValueError(f"no kernel serves GGUF type {self.fmt!r} (served: {', '.join(TYPES)})")
        if self.in_features % t.block:
            raise ValueError(f"{self.fmt} rows are whole blocks of {t.block}; got {self.in_features} inputs")
        if (
            tuple(self.data.shape) != (self.out_features, t.row_bytes(self.in_features))
            or self.data.dtype != torch.uint8
        ):
            raise ValueError(
                f"a [{self.out_features}, {self.in_features}] {self.fmt} weight is uint8 "
                f"[{self.out_features}, {t.row_bytes(self.in_features)}], got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def type_id(self) -> int:
        return TYPES[self.fmt].type_id

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight with its output rows reordered / selected by ``index`` (exact: a row keeps its blocks)."""
        return QuantWeight(self.fmt, self.data[index].contiguous(), len(index), self.in_features)


@dataclass
class QuantParts:
    """Several quantized weights with one input width, their outputs side by side: a fused linear of mixed types."""

    parts: list[QuantWeight]

    def __post_init__(self) -> None:
        if len({p.in_features for p in self.parts}) != 1:
            raise ValueError("fused parts need one input width")

    @property
    def fmt(self) -> str:
        return "+".join(p.fmt for p in self.parts)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            out[p.fmt] = out.get(p.fmt, 0) + p.nbytes
        return out


def parts_of(w: QuantWeight | QuantParts) -> list[QuantWeight]:
    return list(w.parts) if isinstance(w, QuantParts) else [w]


def bytes_by_type(w: QuantWeight | QuantParts) -> dict[str, int]:
    """Bytes held per GGUF type."""
    return w.bytes_by_type() if isinstance(w, QuantParts) else {w.fmt: w.nbytes}


# ---------------------------------------------------------------- build and load

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


def _load() -> ctypes.CDLL:
    require_avx2("AVX2, FMA and F16C")
    lib = ctypes.CDLL(library_path())
    lib.quant_gemm.restype = _I
    lib.quant_gemm.argtypes = [_I, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I]
    lib.quant_dequantize_rows.restype = _I
    lib.quant_dequantize_rows.argtypes = [_I, _P, _I, _P, _I, _P, _I]  # type, W, K, rows, n, out, ref
    lib.quant_row_bytes.restype = _L
    lib.quant_row_bytes.argtypes = [_I, _I]
    return with_isa(lib)


KERNEL = KernelLoader("quantized GEMM kernel", _load, "using the torch fallback", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


# ---------------------------------------------------------------- dequantizing


def from_blocks(fmt: str, raw: np.ndarray, in_features: int) -> QuantWeight:
    """A [N, row bytes] array of GGUF blocks (a view of a file is copied) -> a QuantWeight."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1)
    return QuantWeight(fmt, torch.from_numpy(raw.copy()), raw.shape[0], in_features)


def _reference(w: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    from ..gguf.blocks import dequantize as reference

    data = w.data if rows is None else w.data[rows]
    return torch.from_numpy(reference(data.numpy(), w.fmt))


def dequantize_rows(w: QuantWeight, rows: torch.Tensor, ref: bool = False) -> torch.Tensor:
    """Rows ``rows`` (int64 [R]) of the fp32 weight -> [R, K], the values every kernel multiplies by (an embedding
    lookup on a quantized table). ``ref``: the C scalar reference (tests) instead of the SIMD kernels."""
    rows = rows.to(torch.long).reshape(-1).contiguous()
    kernel = load()
    if kernel is None:
        return _reference(w, rows)
    out = torch.empty(len(rows), w.in_features)
    if len(rows) and kernel.quant_dequantize_rows(
        w.type_id, w.data.data_ptr(), w.in_features, rows.data_ptr(), len(rows), out.data_ptr(), int(ref)
    ):
        raise MemoryError("quant_dequantize_rows failed")
    return out


def dequantize(w: QuantWeight | QuantParts) -> torch.Tensor:
    """The fp32 [N, K] weight the kernel multiplies by (exactly gguf-py's values)."""
    if isinstance(w, QuantParts):
        return torch.cat([dequantize(p) for p in w.parts])
    return dequantize_rows(w, torch.arange(w.out_features))


# ---------------------------------------------------------------- matmul


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matmul_torch(
    x: torch.Tensor, w: QuantWeight | QuantParts, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The fallback: the same product with the weight dequantized (numpy reference) 256 output rows at a time."""
    out = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    n0 = 0
    for part in parts_of(w):
        for r0 in range(0, part.out_features, 256):
            rows = torch.arange(r0, min(r0 + 256, part.out_features))
            torch.mm(x, _reference(part, rows).t(), out=out[:, n0 + r0 : n0 + r0 + len(rows)])
        n0 += part.out_features
    if bias is not None:
        out += bias
    if residual is not None:
        out += residual
    return out


def matmul(
    x: torch.Tensor,
    w: QuantWeight | QuantParts,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    direct_rows: int = -1,
) -> torch.Tensor:
    """x: [M, K] fp32 -> x @ W^T (+ bias[N]) (+ residual[M, N]): [M, N].

    The compiled kernel when it loaded (results identical at any thread count, any M, either path, either ISA), else
    ``matmul_torch``. ``direct_rows`` moves the kernel's split between its paths (-1: its default; tests and
    benchmarks only: both give the same bits).
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
    n0 = 0
    for part in parts_of(w):
        rc = kernel.quant_gemm(
            *(part.type_id, x.data_ptr(), x.stride(0), part.data.data_ptr()),
            bias.data_ptr() + 4 * n0 if bias is not None else None,
            residual.data_ptr() + 4 * n0 if residual is not None else None,
            residual.stride(0) if residual is not None else 0,
            *(out.data_ptr() + 4 * n0, n, m, k, part.out_features, torch.get_num_threads(), direct_rows),
        )
        if rc != 0:
            raise MemoryError(f"quant_gemm could not allocate its tile buffer ({rc})")
        n0 += part.out_features
    return out
