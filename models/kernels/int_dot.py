"""Quantized linears by integer dot products (``int_dot.c``): activations rounded to int8 per 32-block, as llama.cpp
rounds its activations (Q8_0 / Q8_1 blocks), multiplied with VNNI (AVX-512 or AVX-VNNI) or AVX2 ``maddubs``.

Which steps use it is the ``ACTIVATIONS`` setting (config.py), applied to every loaded kernel that has the path
(``decode_step.c`` includes ``int_dot.c``; this module's own build serves the tests and ``gemm``):

    fp32   every linear multiplies fp32 activations (quant_gemm.c): bit for bit HF's math on the weights
    int8   every linear of a type in ``FORMATS`` takes int8 activations and integer dot products, in every step
    auto   per type, steps of at least ``AUTO_ROWS[kind][type]`` rows take int8 activations (measured, below)

The weights are the GGUF file's own blocks of every quantized type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS) as quant_gemm reads them (``WEIGHTS=int8`` / ``int4`` make Q8_0 / Q4_1; a Q4_K_M file is
Q4_K and Q6_K, or mostly Q5_0 where its rows are not whole 256-blocks), so the path costs no memory. The float types
(F32, F16, BF16) always multiply fp32 activations (docs/integer-dot.md). It is not exact against HF:
the activations' rounding changes the logits slightly (perplexity figures in docs/integer-dot.md);
``ACTIVATIONS=fp32`` is the exact path. Results do not depend on the batch, the thread count or the ISA
(``int_dot.c``), and tests/test_int_dot.py checks each ISA against a float64 evaluation of the same quantized math.

Q4_K and Q6_K linears can also be packed at load (``int_packed.c``, ``kernels/packing.py``, ``PACK_WEIGHTS``): the same
bytes laid out as ``vpdpbusd``'s operands, the same results bit for bit (``pack``, ``gemm_packed``).

The ISA is chosen when a kernel loads (``int_dot_isa``: AVX-512 VNNI with BW and VL, else AVX-VNNI, else AVX2);
``KERNEL_ISA=avx2`` forces the AVX2 path here as it does quant_gemm's (``build.set_kernel_isa``).
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

from .build import KernelLoader, build_and_load, on_isa_change, require_cpu_flags, with_isa

log = logging.getLogger("minibatch.int_dot")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int_dot.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
FORMATS = {  # GGUF type -> id
    **{"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14},
    **{"Q2_K": 10, "Q3_K": 11, "IQ4_NL": 20, "IQ4_XS": 23},
}
ISAS = ("avx2", "avxvnni", "avx512vnni")  # int_dot_isa's 0, 1, 2
ACTIVATIONS = ("auto", "fp32", "int8")
GROUP = 32
ROW_PATH_ROWS = 4  # steps of 1 to this many rows take int_rows.c's row path (int_dot_row_path; the rest: panels)

# ACTIVATIONS=auto: steps of at least this many rows take int8 activations, per weight type and kind of ISA (None:
# never), chosen by measurement (docs/integer-dot.md, "The default"). AUTO_ROWS is what runs (the tests pin it to
# None: conftest._exact_activations). Every step, on both kinds: the row path is 1.3-3.3x quant_gemm at 1-4 rows on
# a Zen 3 (AVX2), 1.2-2.7x on a Xeon with AVX-512 VNNI and AVX-VNNI (every type, 1-8 rows, each VNNI form timed);
# Q2_K, Q3_K, IQ4_NL and IQ4_XS 1.2-3.8x at 1-8 rows on that Xeon in all three forms, +0.5% perplexity at most.
MEASURED_AUTO_ROWS: dict[str, dict[str, int | None]] = {
    "vnni": dict.fromkeys(FORMATS, 1),
    "avx2": dict.fromkeys(FORMATS, 1),
}
AUTO_ROWS = {kind: dict(rows) for kind, rows in MEASURED_AUTO_ROWS.items()}

_P, _I = ctypes.c_void_p, ctypes.c_int
_choice = "auto"
_libs: list[ctypes.CDLL] = []  # loaded kernels with the path (int_dot_set_rows in them)


def _load() -> ctypes.CDLL:
    require_cpu_flags(("avx2", "fma", "f16c"), "AVX2, FMA and F16C")
    return register(with_isa(declare(build_and_load(SOURCE, FLAGS))))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare a built int_dot.c's direct entry points (``gemm``'s, the packed weights' of int_packed.c; also a
    baseline build: scripts/bench/roofline; decode_step.c's, which includes it: kernels/packing.py)."""
    lib.int_dot_gemm.restype = _I
    lib.int_dot_gemm.argtypes = [_I, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I]
    lib.int_dot_quantize.restype = None
    lib.int_dot_quantize.argtypes = [_P, _I, _I, _I, _P, _P, _P]
    lib.int_dot_row_path.restype = _I
    lib.int_dot_row_path.argtypes = [_I]
    if not hasattr(lib, "int_dot_pack"):  # a baseline build from before int_packed.c
        return lib
    lib.int_dot_packable.restype = _I
    lib.int_dot_packable.argtypes = [_I, _I, _I]  # type, N, K
    lib.int_dot_pack.restype = _I
    lib.int_dot_pack.argtypes = [_I, _P, _P, _I, _I, _I]  # type, W, P, N, K, threads
    if hasattr(lib, "int_dot_unpack_row"):  # a baseline build from before packed token tables
        lib.int_dot_unpack_row.restype = _I
        lib.int_dot_unpack_row.argtypes = [_I, _P, _I, _I, _P]  # type, P, K, n, out
    return lib


KERNEL = KernelLoader("integer-dot kernel", _load, "quantized linears keep fp32 activations", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


# --- the setting ---------------------------------------------------------------------------------------------


def register(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare a loaded kernel's ``int_dot_set_rows`` / ``int_dot_isa`` and apply ``ACTIVATIONS`` to it."""
    lib.int_dot_set_rows.restype = _I
    lib.int_dot_set_rows.argtypes = [_I, _I]
    lib.int_dot_isa.restype = _I
    lib.int_dot_isa.argtypes = [_I]
    _apply(lib)
    _libs.append(lib)
    return lib


def rows_for(choice: str, fmt: str, isa_name: str = "avx512vnni") -> int | None:
    """The fewest rows of a step that take int8 activations for weights of GGUF type ``fmt`` (one of ``FORMATS``)
    under ``choice`` on ISA ``isa_name`` (None: none)."""
    if choice not in ACTIVATIONS:
        raise ValueError(f"ACTIVATIONS must be one of {', '.join(ACTIVATIONS)} (got {choice!r})")
    kind = "avx2" if isa_name == "avx2" else "vnni"
    return {"fp32": None, "int8": 1, "auto": AUTO_ROWS[kind][fmt]}[choice]


def _apply(lib: ctypes.CDLL) -> None:
    here = ISAS[lib.int_dot_isa(-1)]
    for fmt, code in FORMATS.items():
        lib.int_dot_set_rows(code, rows_for(_choice, fmt, here) or 0)


def _reapply() -> None:
    """After KERNEL_ISA changed a kernel's ISA: ``auto``'s step sizes follow it."""
    for lib in _libs:
        _apply(lib)


on_isa_change(_reapply)


def set_activations(choice: str) -> None:
    """Apply ``ACTIVATIONS`` (``auto`` | ``fp32`` | ``int8``) to the kernels loaded and to those loaded later."""
    global _choice
    rows_for(choice, "Q8_0")  # validates
    _choice = choice
    for lib in _libs:
        _apply(lib)


def activations() -> str:
    return _choice


def describe(choice: str | None = None) -> str:
    """What ``choice`` (default: the current one) does per format on the ISA in use, for the startup log."""
    choice = choice or _choice
    parts = []
    for fmt in FORMATS:
        rows = rows_for(choice, fmt, isa())
        parts.append(f"{fmt}: " + ("fp32 activations" if rows is None else f"int8 activations from {rows} row(s)"))
    return f"ACTIVATIONS={choice} ({'; '.join(parts)}; {isa()})"


def isa() -> str:
    """The ISA the integer path runs here (the last loaded kernel's), or "not loaded"."""
    return ISAS[_libs[-1].int_dot_isa(-1)] if _libs else "not loaded"


# --- direct calls (tests, benchmarks) ----------------------------------------------------------------------------


def force_isa(name: str) -> str:
    """Run the kernels' integer path on ISA ``name`` (or the best the CPU has below it) -> the ISA now used."""
    got = ""
    for lib in _libs or [load()]:
        got = ISAS[lib.int_dot_isa(ISAS.index(name))]
    return got


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's activation rounding of x [M, K] fp32 -> q int8 [M, G*32], d fp32 [M, G], s int32 [M, G]."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the integer-dot kernel is unavailable: {KERNEL.unavailable_reason}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    g = -(-k // GROUP)
    q, d, s = np.zeros((m, g * GROUP), np.int8), np.zeros((m, g), np.float32), np.zeros((m, g), np.int32)
    lib.int_dot_quantize(x.ctypes.data, k, m, k, q.ctypes.data, d.ctypes.data, s.ctypes.data)
    return q, d, s


def gemm(x, w, bias=None, residual=None, threads: int = 1, lib: ctypes.CDLL | None = None):
    """x [M, K] fp32 (torch) @ W^T (+ bias) (+ residual) for a ``quant_gemm.QuantWeight`` of one of ``FORMATS`` by
    integer dot products (``lib``: another build of int_dot.c, ``declare``d; default this checkout's)."""
    import torch

    lib = lib or load()
    if lib is None:
        raise RuntimeError(f"the integer-dot kernel is unavailable: {KERNEL.unavailable_reason}")
    if w.fmt not in FORMATS:
        raise ValueError(f"the integer path takes {', '.join(FORMATS)} weights, not {w.fmt}")
    x = x.contiguous()
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"x [{m}, {k}] does not match a [{w.out_features}, {w.in_features}] weight")
    n = w.out_features
    out = torch.empty(m, n, dtype=torch.float32)
    if residual is not None:
        residual = residual.contiguous()
    rc = lib.int_dot_gemm(
        FORMATS[w.fmt],
        x.data_ptr(),
        k,
        w.data.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        None if residual is None else residual.data_ptr(),
        n,
        out.data_ptr(),
        n,
        m,
        k,
        n,
        threads,
    )
    if rc != 0:
        raise MemoryError("int_dot_gemm could not allocate its activation buffer")
    return out


PACKABLE = ("Q4_K", "Q6_K")  # the GGUF types int_packed.c packs (int_dot_packable)
PACKED = 0x100  # FMT_PACKED in int_packed.c: a packed weight's format is its GGUF type id | PACKED


def pack(w, threads: int = 1, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """A ``quant_gemm.QuantWeight`` of a type in ``PACKABLE`` (N a multiple of 32, K of 256) packed into a new
    buffer (int_packed.c's panels of 32 columns: the same weights, rearranged) -> uint8 [its nbytes]."""
    lib = lib or load()
    src = np.ascontiguousarray(w.data.numpy()).reshape(-1)
    out = np.empty_like(src)
    if w.fmt not in PACKABLE or lib.int_dot_pack(
        FORMATS[w.fmt], src.ctypes.data, out.ctypes.data, w.out_features, w.in_features, threads
    ):
        raise ValueError(f"a [{w.out_features}, {w.in_features}] {w.fmt} weight cannot be packed")
    return out


def gemm_packed(x, packed: np.ndarray, fmt: str, n: int, bias=None, residual=None, threads: int = 1, lib=None):
    """``gemm`` on weights ``pack`` made (GGUF type ``fmt``, ``n`` outputs): the same bits as ``gemm`` on the
    unpacked weight."""
    import torch

    lib = lib or load()
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.int_dot_gemm(
        *(FORMATS[fmt] | PACKED, x.data_ptr(), k, packed.ctypes.data),
        *(None if bias is None else bias.contiguous().data_ptr(), None if residual is None else residual.data_ptr()),
        *(n, out.data_ptr(), n, m, k, n, threads),
    )
    if rc != 0:
        raise ValueError(f"int_dot_gemm refused [{m}, {k}] x a packed [{n}, {k}] {fmt} weight")
    return out
