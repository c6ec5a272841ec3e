"""The small per-layer ops of a lean decode step (``decode_ops.c``): RMSNorm, LayerNorm, SiLU(gate) * up, GELU,
GELU(gate) * up, the logits' divisor and soft-cap.

Each is one ctypes call on the calling thread (no OpenMP region) instead of several ATen ops: at batch
1-16 a step's norms and activations are a few KB, and torch's per-op dispatch, allocation and
parallel-region checks cost more than their arithmetic (``models/layers.py``, "lean decode"). Built
once per machine by ``build.py`` (AVX2 + FMA); without a compiler or AVX2, ``load()`` returns None,
logs why once, and the models keep their torch path.

Shapes: x [M, C] fp32 CPU, unit stride along C (any row stride); outputs contiguous.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from .build import KernelLoader, build_and_load, require_avx2

log = logging.getLogger("minibatch.decode_ops")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_ops.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC", "-lm"]  # decode_step.c: same bits

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def _load() -> ctypes.CDLL:
    require_avx2()
    lib = build_and_load(SOURCE, FLAGS)
    lib.rms_norm.argtypes = [_P, _L, _P, _P, _I, _I, _F]  # x, ldx, w, y, M, C, eps
    lib.layer_norm.argtypes = [_P, _L, _P, _P, _P, _I, _I, _F]  # x, ldx, w, b, y, M, C, eps
    lib.silu_mul.argtypes = [_P, _L, _P, _I, _I]  # gu, ldg, y, M, I
    lib.gelu_tanh.argtypes = [_P, _L, _P, _L, _I, _I]  # x, ldx, y, ldy, M, N
    lib.gelu_mul.argtypes = [_P, _L, _P, _I, _I]  # gu, ldg, y, M, I
    lib.cap_logits.argtypes = [_P, _L, _F, _F]  # x, n, divisor, softcap
    for fn in (lib.rms_norm, lib.layer_norm, lib.silu_mul, lib.gelu_tanh, lib.gelu_mul, lib.cap_logits):
        fn.restype = None
    return lib


KERNEL = KernelLoader("decode ops kernel", _load, "decode steps keep the torch ops", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"expected a 2-D fp32 CPU tensor, got {tuple(x.shape)} {x.dtype} on {x.device}")
    return x if x.stride(1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [M, C] -> x * rsqrt(mean(x^2) + eps) * weight: [M, C]."""
    x = _rows(x)
    M, C = x.shape
    y = torch.empty(M, C)
    load().rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), M, C, eps)
    return y


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [M, C] -> (x - mean) / sqrt(var + eps) * weight + bias: [M, C]."""
    x = _rows(x)
    M, C = x.shape
    y = torch.empty(M, C)
    load().layer_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), M, C, eps)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [M, 2I] (gate columns, then up) -> silu(gate) * up: [M, I]."""
    gate_up = _rows(gate_up)
    M, I2 = gate_up.shape
    y = torch.empty(M, I2 // 2)
    load().silu_mul(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), M, I2 // 2)
    return y


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """x: [M, N] -> GELU with the tanh approximation: [M, N] (the fused decode step's GPT-2 activation)."""
    x = _rows(x)
    M, N = x.shape
    y = torch.empty(M, N)
    load().gelu_tanh(x.data_ptr(), x.stride(0), y.data_ptr(), N, M, N)
    return y


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [M, 2I] (gate columns, then up) -> gelu_tanh(gate) * up: [M, I] (the whole-step kernel's GeGLU)."""
    gate_up = _rows(gate_up)
    M, I2 = gate_up.shape
    y = torch.empty(M, I2 // 2)
    load().gelu_mul(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), M, I2 // 2)
    return y


def cap_logits(logits: torch.Tensor, divisor: float, softcap: float) -> torch.Tensor:
    """logits [n, V] contiguous, in place: / divisor, then softcap * tanh(. / softcap) (each skipped at 1 / 0)."""
    if not logits.is_contiguous() or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError("expected contiguous fp32 CPU logits")
    load().cap_logits(logits.data_ptr(), logits.numel(), divisor, softcap)
    return logits
