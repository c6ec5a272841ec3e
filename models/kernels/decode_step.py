"""A whole step as one compiled call (``decode_step.c``): every layer, the final norm and the lm_head.

``StepPlan`` describes a model to the kernel once (ctypes structs pointing at the packed weights, norm
weights, RoPE tables and KV pools, which all stay where they are); a step then costs one ctypes call and
the logits tensor. A step's rows are its decode tokens and the tokens of any prompt chunks riding with them
(at most ``StepPlan.max_rows``). A decode-only step's results are those of the per-layer lean calls
(quant_gemm / small_gemm, rope_write_attend, decode_ops), bit for bit; every step's do not depend on the
thread count.

Measured on SmolLM2-135M int4 at batch 1 (2-core AVX2 box, shared, README "Threads and single-stream
latency"): the per-layer lean step made 121 GEMM calls, 30 attention calls and 91 norm / activation calls
(each a ctypes call, a torch.empty and, for the GEMMs and attention, an OpenMP fork/join) plus ~345 ATen ops
of glue; the 121 GEMMs alone cost about as much through the raw kernel as through their wrapper (6.8 against
7.1 ms), so the gain is in the step's other calls, its regions and its glue: the step went from 9.2 to 6.8 ms
and from 345 ATen ops to 16.

Mixed steps (7 decode rows + a k-token prompt chunk, SmolLM2 Q4_1 as int4, 2 threads, the same process
alternating the two paths, min of 4, shared box): the torch path (per-op ATen, SDPA, quant_gemm calls) against
this call, ms: 7+64 127 / 103, 7+128 198 / 198, 7+256 444 / 437; 7+64 with the chunk at position 1800:
339 / 208 (per-row attention over the blocks beats the torch path's gather + masked SDPA there too). The
torch path's fixed cost (~15 ms of dispatch) stops mattering past ~128 rows, where the two meet:
``QUANT_MAX_ROWS``. Inside this call quant_gemm's direct path (L1 blocks, 48 rows a pass) was as fast as its
L2-tile path at 15-71 rows (min of 7: 23 rows 35.2 / 38.9 ms, 39 rows 54.2 / 55.5), so only the direct path
is used. fp32 panels keep small_gemm's limit (above it ``panel_gemm``'s blocked tiles, outside this call, win).

Built once per machine by ``build.py`` (AVX2, FMA, F16C, OpenMP); without them ``load()`` returns None,
logs why once, and the models keep the per-layer lean path.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from . import quant_gemm, small_gemm
from .build import KernelLoader, build_and_load, require_avx2

log = logging.getLogger("minibatch.decode_step")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_step.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
FP32 = -1  # FMT_FP32 in decode_step.c: small_gemm panels (a linear), fp32 rows (a token table)
PANELS = -2  # FMT_PANELS: a token table that is a tied lm_head's small_gemm panels (3-D)
QUANT_MAX_ROWS = 128  # rows (decode + prompt-chunk tokens) a step of quantized linears takes through the kernel

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class Lin(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("fmt", _I), ("K", _I), ("N", _I)]


class Layer(ctypes.Structure):
    _fields_ = [
        *(("norm1_w", _P), ("norm1_b", _P), ("norm2_w", _P), ("norm2_b", _P)),
        *(("qkv", Lin), ("o", Lin), ("up", Lin), ("down", Lin)),
        *(("k_pool", _P), ("v_pool", _P), ("scale", _F)),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *(("gelu", _I), ("n_layer", _I), ("C", _I), ("H", _I), ("KVH", _I), ("D", _I), ("block_size", _I)),
        *(("block_stride", _L), ("token_stride", _L), ("head_stride", _L), ("eps", _F)),
        *(("cos", _P), ("sin", _P), ("normf_w", _P), ("normf_b", _P), ("lm_head", Lin), ("layers", _P)),
        *(("embed", _P), ("embed_fmt", _I), ("pos_embed", _P)),
    ]


def _load() -> ctypes.CDLL:
    require_avx2("AVX2, FMA and F16C")
    lib = build_and_load(SOURCE, FLAGS)
    lib.decode_step_workspace.restype = _L
    lib.decode_step_workspace.argtypes = [_P, _I, _I]  # model, B, nthreads
    lib.decode_step.restype = _I
    lib.decode_step.argtypes = [
        *(_P, _P, _P, _I, _P, _P, _P),  # model, ids, x, B, pos, slot_blocks, slot_offsets
        *(_P, _I, _P, _I),  # block_tables, table_stride, row_table, write_first
        *(_P, _I, _P, _P, _I),  # sample_rows, n_sample, logits, ws, nthreads
    ]
    return lib


KERNEL = KernelLoader("decode step kernel", _load, "decode steps keep the per-layer lean calls", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def lin(linear) -> Lin | None:
    """A ``layers.Linear`` as the kernel's Lin: its quantized copy, or its small_gemm panels; None when it has
    neither (an fp32 linear on oneDNN only)."""
    if linear.quant is not None:
        q = linear.quant
        return Lin(q.data.data_ptr(), _ptr(linear.bias), quant_gemm.FORMATS[q.fmt], q.in_features, q.out_features)
    if linear.small is not None:
        return Lin(linear.small.data_ptr(), _ptr(linear.bias), FP32, linear.in_features, linear.out_features)
    return None


class StepPlan:
    """One model described to the kernel; ``plan(batch)`` runs a lean decode step -> logits [B, V].

    embed: (token table: fp32 [V, C], panels or a ``QuantWeight``, learned positions [P, C] or None); layers: per layer
    ``(norm1, norm2, qkv, o, up, down, (k_pool, v_pool), scale)``, a norm being ``(weight, bias or None)``
    (None: RMSNorm), the linears ``layers.Linear``s, the pools ``PagedKVCache.pools`` views. Every tensor it
    points at is held here (the model holds them too), so the pointers stay valid.
    """

    def __init__(self, *, gelu: bool, dims: dict, eps: float, embed, rope, layers: list, final_norm, lm_head) -> None:
        self.kernel = load()
        self._keep = [embed, rope, final_norm, layers]
        table, positions = embed
        quant = isinstance(table, quant_gemm.QuantWeight)
        if quant:
            table_ptr, table_fmt = table.data.data_ptr(), quant_gemm.FORMATS[table.fmt]
        else:
            table_ptr, table_fmt = _ptr(table), PANELS if table.dim() == 3 else FP32
        k_pool = layers[0][6][0]
        cos, sin = (rope[0], rope[1]) if rope is not None else (None, None)
        structs = []
        for norm1, norm2, qkv, o, up, down, (kp, vp), scale in layers:
            lins = [lin(x) for x in (qkv, o, up, down)]
            structs.append(
                Layer(
                    *(_ptr(norm1[0]), _ptr(norm1[1]), _ptr(norm2[0]), _ptr(norm2[1])),
                    *lins,
                    *(kp.data_ptr(), vp.data_ptr(), scale),
                )
            )
        self.layers = (Layer * len(structs))(*structs)
        self.model = Model(
            *(int(gelu), len(structs), dims["C"], dims["H"], dims["KVH"], dims["D"], k_pool.shape[1]),
            *(k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), eps),
            *(_ptr(cos), _ptr(sin), _ptr(final_norm[0]), _ptr(final_norm[1]), lin(lm_head)),
            ctypes.cast(self.layers, _P),
            *(table_ptr, table_fmt, _ptr(positions)),
        )
        lins = [y for layer in structs for y in (layer.qkv, layer.o, layer.up, layer.down)] + [self.model.lm_head]
        # fp32 panels stay within small_gemm's row limit (panel_gemm wins above it); quantized linears go further.
        self.max_rows = small_gemm.MAX_ROWS if any(x.fmt == FP32 for x in lins) else QUANT_MAX_ROWS
        self.n_embd = dims["C"]
        self.model_ref = ctypes.byref(self.model)
        self.n_vocab = lm_head.out_features
        self.ws = torch.empty(0)

    @staticmethod
    def supports(linears: list) -> bool:
        """Whether every linear has a copy the kernel reads, and the kernel loads here."""
        return all(lin(x) is not None for x in linears) and load() is not None

    def __call__(self, batch) -> torch.Tensor:
        """A ``layers.MixedBatch`` built ``for_step`` (N rows: decode tokens, prompt-chunk tokens) -> logits of its
        sample rows [n_sample, V] (every row when it has no prompts); every row's K/V written."""
        N, threads = batch.ids.shape[0], torch.get_num_threads()
        x_floats = -(-N * self.n_embd // 16) * 16  # x [N, C] first, in whole cache lines (torch aligns ws to one)
        need = self.kernel.decode_step_workspace(self.model_ref, N, threads) + x_floats
        if self.ws.numel() < need:
            self.ws = torch.empty(need)
        sample = batch.sample_rows
        logits = torch.empty(N if sample is None else sample.shape[0], self.n_vocab)
        tables, ws = batch.block_tables, self.ws.data_ptr()
        write_first = any(n > 1 for _, n, _, _ in batch.prompts)  # a chunk's rows attend each other's slots
        rc = self.kernel.decode_step(
            *(self.model_ref, batch.ids.data_ptr(), ws, N, batch.pos.data_ptr()),
            *(batch.slot_blocks.data_ptr(), batch.slot_offsets.data_ptr(), tables.data_ptr(), tables.stride(0)),
            *(_ptr(batch.row_tables), int(write_first), _ptr(sample), logits.shape[0]),
            *(logits.data_ptr(), ws + 4 * x_floats, threads),
        )
        if rc != 0:
            raise MemoryError("decode step: cannot allocate the attention partition workspace")
        return logits
