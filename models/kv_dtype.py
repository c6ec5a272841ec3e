"""KV cache element types (``KV_CACHE_DTYPE``): names, the kernels' codes, bytes per token, what a CPU needs.

Torch-free.

- ``fp32``: exact (what the parity gates run).
- ``fp16``: IEEE half, converted with F16C (every AVX2 CPU we build for has it); half the bytes.
- ``bf16``: the top half of an fp32 (8 mantissa bits: coarser than fp16, fp32's range); converted by a shift, so
  it runs wherever the kernels do.
- ``int8``: q8_0-like, one fp32 scale per token and head (``d = max |x| / 127``, ``q = round(x / d)``); a
  quarter of fp32's bytes plus 4 per token and head. docs/kv-cache.md has the measurements behind the choice
  of a per-token scale and behind the default.

A pool of dtype t holds ``bytes_per_token(t, ...)`` per token, so ``KV_CACHE_MB`` buys 2x (fp16, bf16) or ~3.8x
(int8, SmolLM2's head_dim 64) the tokens of fp32.
"""

from __future__ import annotations

import numpy as np

from models.kernels.build import cpu_flags

KV_DTYPES = ("fp32", "fp16", "bf16", "int8")
CODES = {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3}  # KV_FP32 .. KV_INT8 in paged_attention.c
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
SCALE_BYTES = 4  # int8: one fp32 scale per (block, token, head)
# numpy's storage type of each (bf16 has none in numpy: its raw 16 bits)
NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8}


def check(name: str) -> str:
    """``name`` if it is a KV dtype, else ValueError naming the choices."""
    if name not in KV_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {', '.join(KV_DTYPES)} (got {name!r})")
    return name


def has_scales(name: str) -> bool:
    return name == "int8"


def bytes_per_token(name: str, n_layer: int, n_kv_head: int, head_dim: int) -> int:
    """K and V of one token over every layer in a pool of this dtype (int8: its scales included)."""
    per_head = head_dim * ELEMENT_BYTES[check(name)] + (SCALE_BYTES if has_scales(name) else 0)
    return 2 * n_layer * n_kv_head * per_head


def unavailable_reason(name: str) -> str | None:
    """Why this CPU cannot run a pool of this dtype through the kernels, or None (fp32 and bf16 need nothing beyond
    the kernels' AVX2; fp16 needs F16C). Where /proc/cpuinfo cannot be read, None: the kernels' own checks decide."""
    flags = cpu_flags()
    if check(name) == "fp16" and flags is not None and "f16c" not in flags:
        return "KV_CACHE_DTYPE=fp16 needs a CPU with F16C (use fp32, bf16 or int8)"
    return None
