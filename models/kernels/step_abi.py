"""The whole-step kernel's ABI (``decode_step.c``), torch-free: its structs, its loader, one model's description.

Two callers describe a model to the kernel: ``decode_step.StepPlan`` (the torch model: every buffer a tensor it
holds) and ``models/native.py`` (a model image: every buffer a range of one read-only file mapping). Both go
through this module, so the kernel's struct layout is written down once:

- ``ModelSpec`` is the model as the kernel sees it: dims, flags and the buffers the kernel reads (packed linears,
  biases, norms, RoPE tables, token and position tables), each an opaque *handle* (a tensor, a name in an image,
  an address). ``map_buffers`` turns one kind of handle into another; ``spec_to_json`` / ``spec_from_json`` carry
  a spec whose handles are names through ``image.json``.
- ``Structs`` builds the ctypes ``Model`` and ``Layer`` array from a spec whose handles are addresses, plus the
  KV pools (capacity-dependent: never part of a spec).
- ``StepKernel`` sizes the workspace and makes the call.

Importing this module imports no torch; loading the kernel (``load``) builds it once per machine (``build.py``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .build import KernelLoader, build_and_load, require_cpu_flags, with_isa

log = logging.getLogger("minibatch.decode_step")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_step.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
FP32 = -1  # FMT_FP32 in decode_step.c: small_gemm panels (a linear), fp32 rows (a token table)
PANELS = -2  # FMT_PANELS: a token table that is a tied lm_head's small_gemm panels (3-D)
WS_ALIGN = 64  # bytes: the workspace starts on a cache line (decode_step.c carves per-thread buffers from it)

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class Lin(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("fmt", _I), ("K", _I), ("N", _I)]


class Layer(ctypes.Structure):
    _fields_ = [
        *(("norm1_w", _P), ("norm1_b", _P), ("norm2_w", _P), ("norm2_b", _P)),
        *(("qkv", Lin), ("o", Lin), ("up", Lin), ("down", Lin)),
        *(("k_pool", _P), ("v_pool", _P), ("k_scale", _P), ("v_scale", _P), ("scale", _F)),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *(("gelu", _I), ("n_layer", _I), ("C", _I), ("H", _I), ("KVH", _I), ("D", _I), ("block_size", _I)),
        *(("block_stride", _L), ("token_stride", _L), ("head_stride", _L), ("kv_dtype", _I), ("eps", _F)),
        *(("cos", _P), ("sin", _P), ("normf_w", _P), ("normf_b", _P), ("lm_head", Lin), ("layers", _P)),
        *(("embed", _P), ("embed_fmt", _I), ("pos_embed", _P)),
    ]


def _load() -> ctypes.CDLL:
    require_cpu_flags(("avx2", "fma", "f16c"), "AVX2, FMA and F16C")
    lib = build_and_load(SOURCE, FLAGS)
    lib.decode_step_workspace.restype = _L
    lib.decode_step_workspace.argtypes = [_P, _I, _I]  # model, B, nthreads
    lib.decode_step.restype = _I
    lib.decode_step.argtypes = [
        *(_P, _P, _P, _I, _P, _P, _P),  # model, ids, x, B, pos, slot_blocks, slot_offsets
        *(_P, _I, _P, _I),  # block_tables, table_stride, row_table, write_first
        *(_P, _I, _P, _P, _I),  # sample_rows, n_sample, logits, ws, nthreads
    ]
    return with_isa(with_isa(lib), "attention_isa")  # quant_gemm.c's switch, and paged_attention.c's


KERNEL = KernelLoader("decode step kernel", _load, "decode steps keep the per-layer lean calls", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


# --- one model as the kernel sees it ---------------------------------------------------------------------------


@dataclass
class LinSpec:
    """One linear: packed weight ``w`` (quant_gemm blocks for fmt 0 / 1, small_gemm panels for ``FP32``),
    ``bias`` or None; K inputs, N outputs."""

    w: Any
    bias: Any
    fmt: int
    K: int
    N: int


@dataclass
class LayerSpec:
    """One layer: norm weights (the ``*_b`` None: RMSNorm, else LayerNorm), its four linears, the attention scale."""

    norm1_w: Any
    norm1_b: Any
    norm2_w: Any
    norm2_b: Any
    qkv: LinSpec
    o: LinSpec
    up: LinSpec
    down: LinSpec
    scale: float


_LAYER_LINEARS = ("qkv", "o", "up", "down")


@dataclass
class ModelSpec:
    """The model without its KV pools: ``gelu`` (GELU tanh, else SiLU(gate) * up), dims (C width, H query heads,
    KVH K/V heads, D head_dim), the norms' eps, RoPE tables cos / sin [max_len, D] (None: no rotation), the final
    norm, the lm_head, the layers, the token table (``embed_fmt``: quant_gemm's 0 / 1, ``FP32`` rows [V, C],
    ``PANELS``) and learned positions [max_len, C] (None: none)."""

    gelu: bool
    C: int
    H: int
    KVH: int
    D: int
    eps: float
    cos: Any
    sin: Any
    normf_w: Any
    normf_b: Any
    lm_head: LinSpec
    layers: list[LayerSpec]
    embed: Any
    embed_fmt: int
    pos_embed: Any

    def linears(self) -> list[LinSpec]:
        """Every linear in forward order: each layer's four, then the lm_head."""
        return [getattr(layer, name) for layer in self.layers for name in _LAYER_LINEARS] + [self.lm_head]


def map_buffers(spec: ModelSpec, f: Callable[[str, Any], Any]) -> ModelSpec:
    """The spec with every buffer handle h (not None) replaced by ``f(name, h)``; names are stable paths
    ("cos", "layers.3.qkv.w", "lm_head.bias", "embed")."""

    def one(name: str, h: Any) -> Any:
        return None if h is None else f(name, h)

    def lin(name: str, x: LinSpec) -> LinSpec:
        return dataclasses.replace(x, w=one(f"{name}.w", x.w), bias=one(f"{name}.bias", x.bias))

    def layer(i: int, x: LayerSpec) -> LayerSpec:
        norms = {k: one(f"layers.{i}.{k}", getattr(x, k)) for k in ("norm1_w", "norm1_b", "norm2_w", "norm2_b")}
        lins = {k: lin(f"layers.{i}.{k}", getattr(x, k)) for k in _LAYER_LINEARS}
        return dataclasses.replace(x, **norms, **lins)

    tables = {k: one(k, getattr(spec, k)) for k in ("cos", "sin", "normf_w", "normf_b", "embed", "pos_embed")}
    layers = [layer(i, x) for i, x in enumerate(spec.layers)]
    return dataclasses.replace(spec, **tables, lm_head=lin("lm_head", spec.lm_head), layers=layers)


def buffers(spec: ModelSpec) -> Iterator[tuple[str, Any]]:
    """Every (name, handle) the kernel reads, in a stable order (a shared handle, e.g. a tied lm_head's table,
    appears under each of its names)."""
    seen: list[tuple[str, Any]] = []
    map_buffers(spec, lambda name, h: seen.append((name, h)))
    return iter(seen)


def spec_to_json(spec: ModelSpec) -> dict:
    """A spec whose handles are JSON values (names) -> a JSON object."""
    return dataclasses.asdict(spec)


def spec_from_json(d: dict) -> ModelSpec:
    """``spec_to_json``'s inverse. Raises KeyError / TypeError on a malformed object."""

    def layer(x: dict) -> LayerSpec:
        return LayerSpec(**{**x, **{k: LinSpec(**x[k]) for k in _LAYER_LINEARS}})

    return ModelSpec(**{**d, "lm_head": LinSpec(**d["lm_head"]), "layers": [layer(x) for x in d["layers"]]})


# --- the structs and the call ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolGeometry:
    """The KV pools' layout, every layer's the same: [num_blocks, block_size, KVH, D] with these strides (elements;
    D has unit stride) of elements ``dtype`` (``models/kv_dtype.CODES``: 0 fp32 .. 3 int8, whose scales
    [num_blocks, block_size, KVH] have the strides divided by D). ``PagedKVCache.pools``: head-major blocks, so
    head_stride = block_size * D."""

    block_size: int
    block_stride: int
    token_stride: int
    head_stride: int
    dtype: int = 0


def _lin(x: LinSpec) -> Lin:
    return Lin(x.w, x.bias, x.fmt, x.K, x.N)


class Structs:
    """A spec whose handles are addresses (ints) and each layer's (k_pool, v_pool, k_scale, v_scale) addresses (the
    scales None but for an int8 pool) -> the kernel's ``Model`` (``ref`` for the call) and the ``Layer`` array it
    points at. The addressed memory must outlive this."""

    def __init__(self, spec: ModelSpec, pools: list[tuple], geometry: PoolGeometry) -> None:
        if len(pools) != len(spec.layers):
            raise ValueError(f"{len(pools)} KV pools for {len(spec.layers)} layers")
        layers = [
            Layer(
                *(x.norm1_w, x.norm1_b, x.norm2_w, x.norm2_b),
                *(_lin(getattr(x, k)) for k in _LAYER_LINEARS),
                *(k_pool, v_pool, k_scale, v_scale, x.scale),
            )
            for x, (k_pool, v_pool, k_scale, v_scale) in zip(spec.layers, pools)
        ]
        self.layers = (Layer * len(layers))(*layers)
        g = geometry
        self.model = Model(
            *(int(spec.gelu), len(layers), spec.C, spec.H, spec.KVH, spec.D, g.block_size),
            *(g.block_stride, g.token_stride, g.head_stride, g.dtype, spec.eps),
            *(spec.cos, spec.sin, spec.normf_w, spec.normf_b, _lin(spec.lm_head)),
            ctypes.cast(self.layers, _P),
            *(spec.embed, spec.embed_fmt, spec.pos_embed),
        )
        self.ref = ctypes.byref(self.model)


class StepKernel:
    """The loaded kernel and one model's structs: workspace sizing and the call, on addresses only.

    The workspace is x [rows, C] (the residual stream) in whole cache lines, then the kernel's own
    (``decode_step_workspace``); its start must be ``WS_ALIGN``-aligned.
    """

    def __init__(self, lib: ctypes.CDLL, structs: Structs, n_embd: int) -> None:
        self.lib, self.structs, self.n_embd = lib, structs, n_embd

    def _x_floats(self, rows: int) -> int:
        return -(-rows * self.n_embd // 16) * 16

    def workspace_floats(self, rows: int, threads: int) -> int:
        """Floats of workspace a call of ``rows`` rows at ``threads`` threads needs."""
        return self._x_floats(rows) + self.lib.decode_step_workspace(self.structs.ref, rows, threads)

    def __call__(
        self,
        rows: int,
        ids: int,
        pos: int,
        slot_blocks: int,
        slot_offsets: int,
        tables: int,
        table_stride: int,
        row_table: int | None,
        write_first: bool,
        sample_rows: int | None,
        n_sample: int,
        logits: int,
        ws: int,
        threads: int,
    ) -> None:
        """One step of ``rows`` rows; every pointer an address (int64 ids, pos, slots, sample rows; int32 tables
        [*, table_stride] and row_table; fp32 logits [n_sample, V]). See ``decode_step.c``'s ``decode_step``."""
        rc = self.lib.decode_step(
            *(self.structs.ref, ids, ws, rows, pos, slot_blocks, slot_offsets, tables, table_stride),
            *(row_table, int(write_first), sample_rows, n_sample, logits, ws + 4 * self._x_floats(rows), threads),
        )
        if rc != 0:
            raise MemoryError("decode step: cannot allocate the attention partition workspace")
