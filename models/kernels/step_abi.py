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
- ``StepKernel`` makes the call: a step's rows (``models.step_layout.StepLayout``) as calls of at most ``max_rows``
  rows, each with its workspace.

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

import numpy as np

from . import int_dot
from .build import KernelLoader, build_and_load, require_cpu_flags, with_isa
from .quant_lib import library_path

log = logging.getLogger("minibatch.decode_step")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_step.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
FP32 = -1  # FMT_FP32 in decode_step.c: small_gemm panels (a linear), fp32 rows (a token table)
PANELS = -2  # FMT_PANELS: a token table that is a tied lm_head's small_gemm panels (3-D)
# fmt >= 0: a GGUF type id (models/gguf/blocks.py): rows of the type's blocks (quant_gemm.c)
MAX_PARTS = 3  # parts of one linear (a fused QKV of three types), each its own weight and format
WS_ALIGN = 64  # bytes: the workspace starts on a cache line (decode_step.c carves per-thread buffers from it)

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class LinPart(ctypes.Structure):
    _fields_ = [("w", _P), ("fmt", _I), ("N", _I)]


class Lin(ctypes.Structure):
    _fields_ = [("bias", _P), ("K", _I), ("N", _I), ("n_parts", _I), ("part", LinPart * MAX_PARTS)]


class Moe(ctypes.Structure):
    _fields_ = [("router", _P), ("gate_up", _P), ("down", _P), ("E", _I), ("top_k", _I), ("norm_topk", _I)]


class Layer(ctypes.Structure):
    _fields_ = [
        *(("norm1_w", _P), ("norm1_b", _P), ("norm2_w", _P), ("norm2_b", _P)),
        *(("qkv", Lin), ("o", Lin), ("up", Lin), ("down", Lin)),
        *(("k_pool", _P), ("v_pool", _P), ("k_scale", _P), ("v_scale", _P), ("scale", _F)),
        *(("post1_w", _P), ("post2_w", _P), ("q_norm", _P), ("k_norm", _P), ("qk_full", _I)),
        *(("cos", _P), ("sin", _P), ("window", _I), ("softcap", _F), ("moe", _P)),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *(("act", _I), ("n_layer", _I), ("C", _I), ("H", _I), ("KVH", _I), ("D", _I), ("R", _I), ("block_size", _I)),
        *(("block_stride", _L), ("token_stride", _L), ("head_stride", _L), ("kv_dtype", _I), ("eps", _F)),
        *(("embed_scale", _F), ("residual_scale", _F), ("logits_divisor", _F), ("final_softcap", _F)),
        ("clip_qkv", _F),
        *(("normf_w", _P), ("normf_b", _P), ("lm_head", Lin), ("layers", _P)),
        *(("embed", _P), ("embed_fmt", _I), ("pos_embed", _P)),
    ]


def _load() -> ctypes.CDLL:
    require_cpu_flags(("avx2", "fma", "f16c"), "AVX2, FMA and F16C")
    lib = build_and_load(SOURCE, FLAGS, (library_path(),))  # linked against quant_gemm.c's library
    lib.decode_step_workspace.restype = _L
    lib.decode_step_workspace.argtypes = [_P, _I, _I]  # model, B, nthreads
    lib.decode_step.restype = _I
    lib.decode_step.argtypes = [
        *(_P, _P, _P, _I, _P, _P, _P),  # model, ids, x, B, pos, slot_blocks, slot_offsets
        *(_P, _I, _P, _I),  # block_tables, table_stride, row_table, write_first
        *(_P, _I, _P),  # sample_rows, n_sample, logits
        *(_P, _I, _P),  # hidden_rows, n_hidden, hidden
        *(_P, _I),  # ws, nthreads
        _P,  # lora: the rows' LoRA adapters (lora_step.Lora), or NULL
    ]
    lib.topk_rows.restype = None
    lib.topk_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P]  # values, rows, n, k, indices, picked, scratch
    return int_dot.register(with_isa(lib))  # its linears' integer path follows ACTIVATIONS (int_dot.py)


KERNEL = KernelLoader("decode step kernel", _load, "decode steps keep the per-layer lean calls", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


# --- one model as the kernel sees it ---------------------------------------------------------------------------


@dataclass
class PartSpec:
    """Outputs of a linear held in one format: weight ``w`` (rows of GGUF blocks for a type id ``fmt`` >= 0,
    small_gemm panels for ``FP32``), N outputs."""

    w: Any
    fmt: int
    N: int


@dataclass
class LinSpec:
    """One linear: its parts (outputs side by side, each in its own format: one part unless a fused linear mixes
    types), ``bias`` or None; K inputs, N outputs in all."""

    parts: list[PartSpec]
    bias: Any
    K: int
    N: int

    def __post_init__(self) -> None:
        if not 1 <= len(self.parts) <= MAX_PARTS or sum(p.N for p in self.parts) != self.N:
            raise ValueError(f"a linear has 1-{MAX_PARTS} parts whose outputs add up to N={self.N}")


@dataclass
class MoeSpec:
    """A mixture-of-experts MLP: ``router`` fp32 [E, C], per expert a fused gate+up [2I, C] and a down [C, I] linear;
    each token's top ``top_k`` experts by softmax weight (renormalized when ``norm_topk``)."""

    router: Any
    gate_up: list[LinSpec]
    down: list[LinSpec]
    top_k: int
    norm_topk: bool


ACT_SILU_GATED, ACT_GELU, ACT_GELU_GATED = 0, 1, 2  # Model.act: SiLU(gate) * up, GELU (GPT-2), GELU(gate) * up


@dataclass
class LayerSpec:
    """One layer: norm weights (the ``*_b`` None: RMSNorm, else LayerNorm; a ``*_w`` None: no norm), its four
    linears (up / down unused under ``moe``), the attention scale; and the families' deltas: RMSNorms of the attention
    and MLP outputs (``post1_w`` / ``post2_w``), q/k RMSNorms (per head, or over the projection when ``qk_full``), this
    layer's RoPE tables (None: the model's), a sliding ``window`` (0: none), an attention ``softcap`` (0: none), a
    mixture of experts."""

    norm1_w: Any
    norm1_b: Any
    norm2_w: Any
    norm2_b: Any
    qkv: LinSpec
    o: LinSpec
    up: LinSpec | None
    down: LinSpec | None
    scale: float
    post1_w: Any = None
    post2_w: Any = None
    q_norm: Any = None
    k_norm: Any = None
    qk_full: bool = False
    cos: Any = None
    sin: Any = None
    window: int = 0
    softcap: float = 0.0
    moe: MoeSpec | None = None

    def linears(self) -> list[LinSpec]:
        """Its linears in forward order (each expert's gate+up and down)."""
        mlp = (
            [self.up, self.down]
            if self.moe is None
            else [x for pair in zip(self.moe.gate_up, self.moe.down) for x in pair]
        )
        return [self.qkv, self.o, *mlp]


_LAYER_BUFFERS = ("norm1_w", "norm1_b", "norm2_w", "norm2_b", "post1_w", "post2_w", "q_norm", "k_norm", "cos", "sin")


@dataclass
class ModelSpec:
    """The model without its KV pools: ``act`` (``ACT_*``), dims (C width, H query heads, KVH K/V heads, D head_dim,
    R rotary dims), the norms' eps, the embedding scale, the residual scale, the logits' divisor and soft-cap (0:
    none), the q/k/v clip (0: none), RoPE tables cos / sin [max_len, R] (None: no rotation), the final norm, the
    lm_head, the layers, the token table (``embed_fmt``: a GGUF type id, ``FP32`` rows [V, C], ``PANELS``) and
    learned positions [max_len, C] (None: none)."""

    act: int
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
    R: int = 0  # 0: D
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    final_softcap: float = 0.0
    clip_qkv: float = 0.0

    def linears(self) -> list[LinSpec]:
        """Every linear in forward order: each layer's (every expert's), then the lm_head."""
        return [x for layer in self.layers for x in layer.linears()] + [self.lm_head]


def map_buffers(spec: ModelSpec, f: Callable[[str, Any], Any]) -> ModelSpec:
    """The spec with every buffer handle h (not None) replaced by ``f(name, h)``; names are stable paths
    ("cos", "layers.3.qkv.w", "layers.1.moe.gate_up.2.w", "lm_head.bias", "embed")."""

    def one(name: str, h: Any) -> Any:
        return None if h is None else f(name, h)

    def lin(name: str, x: LinSpec | None) -> LinSpec | None:
        if x is None:
            return None
        parts = [dataclasses.replace(p, w=one(f"{name}.w" + (f"{i}" if i else ""), p.w)) for i, p in enumerate(x.parts)]
        return dataclasses.replace(x, parts=parts, bias=one(f"{name}.bias", x.bias))

    def moe(name: str, x: MoeSpec | None) -> MoeSpec | None:
        if x is None:
            return None
        gate_up = [lin(f"{name}.gate_up.{e}", g) for e, g in enumerate(x.gate_up)]
        down = [lin(f"{name}.down.{e}", d) for e, d in enumerate(x.down)]
        return dataclasses.replace(x, router=one(f"{name}.router", x.router), gate_up=gate_up, down=down)

    def layer(i: int, x: LayerSpec) -> LayerSpec:
        buffers = {k: one(f"layers.{i}.{k}", getattr(x, k)) for k in _LAYER_BUFFERS}
        lins = {k: lin(f"layers.{i}.{k}", getattr(x, k)) for k in ("qkv", "o", "up", "down")}
        return dataclasses.replace(x, **buffers, **lins, moe=moe(f"layers.{i}.moe", x.moe))

    tables = {k: one(k, getattr(spec, k)) for k in ("cos", "sin", "normf_w", "normf_b", "embed", "pos_embed")}
    layers = [layer(i, x) for i, x in enumerate(spec.layers)]
    return dataclasses.replace(spec, **tables, lm_head=lin("lm_head", spec.lm_head), layers=layers)


def map_linears(spec: ModelSpec, f: Callable[[LinSpec], LinSpec]) -> ModelSpec:
    """The spec with every linear x (each layer's, each expert's, the lm_head) replaced by ``f(x)``."""

    def lin(x: LinSpec | None) -> LinSpec | None:
        return None if x is None else f(x)

    def moe(x: MoeSpec | None) -> MoeSpec | None:
        return (
            None
            if x is None
            else dataclasses.replace(x, gate_up=[f(g) for g in x.gate_up], down=[f(d) for d in x.down])
        )

    layers = [
        dataclasses.replace(x, **{k: lin(getattr(x, k)) for k in ("qkv", "o", "up", "down")}, moe=moe(x.moe))
        for x in spec.layers
    ]
    return dataclasses.replace(spec, lm_head=lin(spec.lm_head), layers=layers)


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

    def lin(x: dict | None) -> LinSpec | None:
        return None if x is None else LinSpec(**{**x, "parts": [PartSpec(**p) for p in x["parts"]]})

    def moe(x: dict | None) -> MoeSpec | None:
        if x is None:
            return None
        return MoeSpec(**{**x, "gate_up": [lin(g) for g in x["gate_up"]], "down": [lin(g) for g in x["down"]]})

    def layer(x: dict) -> LayerSpec:
        return LayerSpec(**{**x, **{k: lin(x[k]) for k in ("qkv", "o", "up", "down")}, "moe": moe(x.get("moe"))})

    return ModelSpec(**{**d, "lm_head": lin(d["lm_head"]), "layers": [layer(x) for x in d["layers"]]})


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


def _lin(x: LinSpec | None) -> Lin:
    if x is None:
        return Lin()
    parts = (LinPart * MAX_PARTS)(*(LinPart(p.w, p.fmt, p.N) for p in x.parts))
    return Lin(x.bias, x.K, x.N, len(x.parts), parts)


class Structs:
    """A spec whose handles are addresses (ints) and each layer's (k_pool, v_pool, k_scale, v_scale) addresses (the
    scales None but for an int8 pool) -> the kernel's ``Model`` (``ref`` for the call) and the ``Layer`` array it
    points at (and each MoE layer's ``Moe`` and expert ``Lin`` arrays). The addressed memory must outlive this."""

    def __init__(self, spec: ModelSpec, pools: list[tuple], geometry: PoolGeometry) -> None:
        if len(pools) != len(spec.layers):
            raise ValueError(f"{len(pools)} KV pools for {len(spec.layers)} layers")
        self._keep: list = []  # the MoE structs and expert arrays the layers point at
        layers = [
            Layer(
                *(x.norm1_w, x.norm1_b, x.norm2_w, x.norm2_b),
                *(_lin(getattr(x, k)) for k in ("qkv", "o", "up", "down")),
                *(k_pool, v_pool, k_scale, v_scale, x.scale),
                *(x.post1_w, x.post2_w, x.q_norm, x.k_norm, int(x.qk_full)),
                *(x.cos, x.sin, x.window, x.softcap, self._moe(x.moe)),
            )
            for x, (k_pool, v_pool, k_scale, v_scale) in zip(spec.layers, pools)
        ]
        self.layers = (Layer * len(layers))(*layers)
        g = geometry
        self.model = Model(
            *(spec.act, len(layers), spec.C, spec.H, spec.KVH, spec.D, spec.R or spec.D, g.block_size),
            *(g.block_stride, g.token_stride, g.head_stride, g.dtype, spec.eps),
            *(spec.embed_scale, spec.residual_scale, spec.logits_divisor, spec.final_softcap, spec.clip_qkv),
            *(spec.normf_w, spec.normf_b, _lin(spec.lm_head)),
            ctypes.cast(self.layers, _P),
            *(spec.embed, spec.embed_fmt, spec.pos_embed),
        )
        # RoPE: each layer's own tables, else the model's
        for layer in self.layers:
            if not layer.cos:
                layer.cos, layer.sin = spec.cos, spec.sin
        self.ref = ctypes.byref(self.model)

    def _moe(self, x: MoeSpec | None) -> int | None:
        if x is None:
            return None
        gate_up = (Lin * len(x.gate_up))(*(_lin(g) for g in x.gate_up))
        down = (Lin * len(x.down))(*(_lin(d) for d in x.down))
        moe = Moe(x.router, ctypes.cast(gate_up, _P), ctypes.cast(down, _P), len(x.gate_up), x.top_k, int(x.norm_topk))
        self._keep += [gate_up, down, moe]
        return ctypes.addressof(moe)


class StepKernel:
    """The loaded kernel and one model's structs: the one place a step's rows become kernel calls.

    ``run`` steps a ``models.step_layout.StepLayout`` (both runtimes' layout: the native runner's and the torch
    forward's whole-step path) as calls of at most ``max_rows`` rows; ``__call__`` is one call on addresses. The
    workspace is x [rows, C] (the residual stream) in whole cache lines, then the kernel's own
    (``decode_step_workspace``); its start is ``WS_ALIGN``-aligned. Held here, grown, never shrunk.
    """

    def __init__(self, lib: ctypes.CDLL, structs: Structs, n_embd: int, max_rows: int) -> None:
        self.lib, self.structs, self.n_embd, self.max_rows = lib, structs, n_embd, max_rows
        self._ws = np.empty(0, np.float32)

    def _x_floats(self, rows: int) -> int:
        return -(-rows * self.n_embd // 16) * 16

    def workspace_floats(self, rows: int, threads: int) -> int:
        """Floats of workspace a call of ``rows`` rows at ``threads`` threads needs."""
        return self._x_floats(rows) + self.lib.decode_step_workspace(self.structs.ref, rows, threads)

    def _workspace(self, rows: int, threads: int) -> int:
        """The address of a ``WS_ALIGN``-aligned workspace for a call of ``rows`` rows at ``threads`` threads."""
        need = self.workspace_floats(rows, threads) + WS_ALIGN // 4
        if self._ws.size < need:
            self._ws = np.empty(need, np.float32)
        return self._ws.ctypes.data + (-self._ws.ctypes.data % WS_ALIGN)

    def run(self, layout, logits: np.ndarray, threads: int, *, states=None, slots=None, lora=None) -> None:
        """One step over ``layout``'s rows (a ``StepLayout``) as consecutive calls of at most ``max_rows`` rows in row
        order. Exact: attention is causal, so a chunk's later rows need only the K/V of its earlier rows, which an
        earlier call has written (within a call, ``write_first`` writes every row's K/V before any row attends).

        Its sample rows' logits go into ``logits`` [n_sample, V] fp32, its hidden rows' final hidden states into
        ``states`` [len(layout.hidden), C] (None: no hidden rows); ``slots``: each row's adapter slot [N] int64
        (-1: the base) in ``lora`` (a ``lora_step.KernelLora``), or None."""
        for r0 in range(0, layout.n, self.max_rows):
            r1 = min(layout.n, r0 + self.max_rows)
            adapters = lora.step(slots, r0, r1, threads) if slots is not None else None  # kept until the call ends
            self._call(layout, r0, r1, logits, threads, states, adapters)

    def _call(self, layout, r0: int, r1: int, logits: np.ndarray, threads: int, states, adapters) -> None:
        """Rows [r0, r1) of ``layout`` as one call: their sample rows' logits into their rows of ``logits``, their
        hidden rows' states into theirs of ``states``; ``adapters``: ``KernelLora.step``'s (Lora, arrays) or None."""
        seq = layout.row_table[r0:r1]
        write_first = bool(np.any(seq[1:] == seq[:-1]))  # a sequence with several rows here attends its own slots
        if layout.sample is None:  # every row sampled: output rows are the rows
            s0, sample, n_sample = r0, None, r1 - r0
        else:
            s0, s1 = np.searchsorted(layout.sample, [r0, r1])
            local = layout.sample[s0:s1] - r0
            sample, n_sample = local.ctypes.data, int(s1 - s0)
        hidden = {}
        if states is not None:
            h0, h1 = np.searchsorted(layout.hidden, [r0, r1])
            mine = layout.hidden[h0:h1] - r0
            hidden = {"hidden_rows": mine.ctypes.data, "n_hidden": int(h1 - h0), "hidden": states[h0:].ctypes.data}
        at = 8 * r0  # bytes into the int64 row arrays
        self(
            *(r1 - r0, layout.ids.ctypes.data + at, layout.pos.ctypes.data + at, layout.slot_blocks.ctypes.data + at),
            *(layout.slot_offsets.ctypes.data + at, layout.tables.ctypes.data, layout.tables.shape[1]),
            *(seq.ctypes.data, write_first, sample, n_sample),
            *(logits.ctypes.data + int(s0) * logits.strides[0], self._workspace(r1 - r0, threads), threads),
            **hidden,
            lora=ctypes.addressof(adapters[0]) if adapters is not None else None,
        )

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
        *,
        hidden_rows: int | None = None,
        n_hidden: int = 0,
        hidden: int | None = None,
        lora=None,
    ) -> None:
        """One step of ``rows`` rows; every pointer an address (int64 ids, pos, slots, sample rows, hidden rows;
        int32 tables [*, table_stride] and row_table; fp32 logits [n_sample, V], hidden [n_hidden, C]: the final
        hidden states, after the final norm, of the hidden rows); ``lora`` the rows' adapters
        (``lora_step.KernelLora.step``) or None. See ``decode_step.c``'s ``decode_step``."""
        rc = self.lib.decode_step(
            *(self.structs.ref, ids, ws, rows, pos, slot_blocks, slot_offsets, tables, table_stride),
            *(row_table, int(write_first), sample_rows, n_sample, logits, hidden_rows, n_hidden, hidden),
            *(ws + 4 * self._x_floats(rows), threads, lora),
        )
        if rc != 0:
            raise MemoryError("decode step: cannot allocate its attention partitions or a linear's tile buffer")
