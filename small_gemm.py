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
once in the log, and the callers keep using oneDNN. The shared object is cached under
``$XDG_CACHE_HOME/minibatch-llm`` keyed by the source and flags, so it compiles once per machine
(about a second).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger("minibatch.small_gemm")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
PANEL = 8  # output columns per packed panel (small_gemm.c)
MAX_ROWS = 16  # use the kernel for at most this many rows; oneDNN wins above (table above)

_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_tried = False
unavailable_reason: str | None = None


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minibatch-llm")


def _build(compiler: str, target: str) -> None:
    """Compile to a temporary file, then rename: concurrent builders never see a half-written .so."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, SOURCE, "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError(f"CPU capability is {torch.backends.cpu.get_cpu_capability()}, the kernel needs AVX2 and FMA")
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"small_gemm-{key}.so")
    if not os.path.exists(target):
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler found to build small_gemm.c (set CC, or install gcc)")
        _build(compiler, target)
    lib = ctypes.CDLL(target)  # ctypes releases the GIL during each call
    lib.small_gemm.restype = None
    lib.small_gemm.argtypes = [
        ctypes.c_void_p, ctypes.c_int,  # X, ldx
        ctypes.c_void_p, ctypes.c_void_p,  # Wp, bias
        ctypes.c_void_p, ctypes.c_int,  # R, ldr
        ctypes.c_void_p, ctypes.c_int,  # Y, ldy
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # M, K, N, nthreads
    ]
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (reason in ``unavailable_reason``, logged once)."""
    global _kernel, _tried, unavailable_reason
    with _lock:
        if not _tried:
            _tried = True
            try:
                _kernel = _load()
            except Exception as exc:  # no compiler, no AVX2, a failed build: oneDNN carries on
                unavailable_reason = str(exc)
                log.warning("small-batch GEMM kernel unavailable, using oneDNN for every linear: %s", exc)
        return _kernel


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
        raise RuntimeError(f"small-batch GEMM kernel unavailable: {unavailable_reason}")
    m, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * PANEL < n_out:
        raise ValueError(f"x [{m}, {k}] does not match packed weights {tuple(packed.shape)} for {n_out} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty(m, n_out, dtype=torch.float32)
    kernel.small_gemm(
        x.data_ptr(), x.stride(0), packed.data_ptr(), _ptr(bias),
        _ptr(residual), residual.stride(0) if residual is not None else 0,
        out.data_ptr(), n_out, m, k, n_out, torch.get_num_threads(),
    )
    return out
