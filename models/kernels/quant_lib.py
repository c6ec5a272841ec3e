"""The quantized GEMM's shared library (``quant_gemm.c``), torch-free: its source, flags and build.

``quant_gemm.py`` loads it for the torch side; ``decode_step.c`` is linked against it (``step_abi.py``), so the
per-type kernels are compiled once and both share one copy, and one instruction-set choice (``kernel_isa``).
"""

from __future__ import annotations

import os

from .build import build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_gemm.c")
# -O2: the kernels' fixed loops are unrolled by pragmas, so -O3 measured no faster and took 2x to compile.
FLAGS = ["-O2", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def library_path() -> str:
    """The built library's path (compiled once per machine into the cache). Raises RuntimeError as ``build``."""
    return build(SOURCE, FLAGS)
