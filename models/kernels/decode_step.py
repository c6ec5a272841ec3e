"""A whole step as one compiled call (``decode_step.c``): every layer, the final norm and the lm_head.

``StepPlan`` describes a model to the kernel once (ctypes structs pointing at the packed weights, norm
weights, RoPE tables and KV pools, which all stay where they are); a step then costs one ctypes call and
the logits array, made from the step's ``StepLayout`` by ``step_abi.StepKernel.run`` as the native runner's are.
A step's rows are its decode tokens and the tokens of any prompt chunks riding with them (at most
``StepPlan.max_rows``). A decode-only step's results are those of the per-layer lean calls
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
logs why once, and the models keep the per-layer lean path. The kernel's ABI (structs, loader, the model
description ``ModelSpec``) is ``step_abi.py``'s, torch-free: the model image (``models/image.py``) writes the
buffers a plan's spec names, and ``models/native.py`` runs them without torch.
"""

from __future__ import annotations

import numpy as np
import torch

from . import paged_attention, quant_gemm, small_gemm, step_abi
from .step_abi import FP32, KERNEL, PANELS, load

__all__ = ["FP32", "KERNEL", "PANELS", "QUANT_MAX_ROWS", "StepPlan", "layer_spec", "lin", "load"]

QUANT_MAX_ROWS = 128  # rows (decode + prompt-chunk tokens) a step of quantized linears takes through the kernel


def _pool_addresses(k_pool: torch.Tensor, v_pool: torch.Tensor, scales) -> tuple:
    """One layer's (k, v, k_scale, v_scale) addresses for ``step_abi.Structs`` (the scales None but for int8)."""
    ks, vs = (scales[0].data_ptr(), scales[1].data_ptr()) if scales is not None else (None, None)
    return k_pool.data_ptr(), v_pool.data_ptr(), ks, vs


def lin(linear) -> step_abi.LinSpec | None:
    """A ``layers.Linear`` as the kernel's linear (its buffers tensors): its quantized copy (a part per GGUF type),
    or its small_gemm panels; None when it has neither (an fp32 linear on oneDNN only)."""
    if linear.quant is not None:
        parts = [step_abi.PartSpec(q.data, q.type_id, q.out_features) for q in quant_gemm.parts_of(linear.quant)]
        if len(parts) > step_abi.MAX_PARTS:
            return None
        return step_abi.LinSpec(parts, linear.bias, linear.in_features, linear.out_features)
    if linear.small is not None:
        part = step_abi.PartSpec(linear.small, FP32, linear.out_features)
        return step_abi.LinSpec([part], linear.bias, linear.in_features, linear.out_features)
    return None


def layer_spec(norm1, norm2, qkv, o, up, down, scale: float, moe=None, **deltas) -> step_abi.LayerSpec:
    """One layer as the kernel reads it, its buffers tensors: norms ``(weight, bias or None)`` (a None weight: no norm),
    ``layers.Linear``s (up / down None under ``moe``), the attention scale; ``moe``: (router [E, C] fp32, gate+up
    Linears, down Linears, top_k, norm_topk); ``deltas``: ``step_abi.LayerSpec``'s other fields (post-norms, q/k
    norms, RoPE tables [max_len, 1, R], window, softcap)."""
    if moe is not None:
        router, gate_up, downs, top_k, norm_topk = moe
        moe = step_abi.MoeSpec(router, [lin(x) for x in gate_up], [lin(x) for x in downs], top_k, norm_topk)
    return step_abi.LayerSpec(
        *norm1, *norm2, lin(qkv), lin(o), lin(up) if up else None, lin(down) if down else None, scale, moe=moe, **deltas
    )


class StepPlan:
    """One model described to the kernel; ``plan(layout)`` runs a step -> logits.

    embed: (token table: fp32 [V, C], panels or a ``QuantWeight``, learned positions [P, C] or None); layers: per layer
    a ``layer_spec``; pools: per layer the ``PagedKVCache.pools`` views (k_pool, v_pool, int8's scales or None);
    rope: the (cos, sin) tables [max_len, 1, R] (None: no rotation); ``model``: ``step_abi.ModelSpec``'s scalar fields
    beyond the dims (embed_scale, ...). ``spec`` is the model as the kernel reads it, its buffers the tensors
    themselves (what a model image writes); it and ``_pools`` hold every tensor the structs point at (the model holds
    them too), so the pointers stay valid.
    """

    def __init__(
        self, *, act: int, dims: dict, eps: float, embed, rope, layers: list, pools: list, final_norm, lm_head, **model
    ) -> None:
        self.kernel = load()
        table, positions = embed
        if isinstance(table, quant_gemm.QuantWeight):
            table, table_fmt = table.data, table.type_id
        else:
            table_fmt = PANELS if table.dim() == 3 else FP32
        cos, sin = (rope[0], rope[1]) if rope is not None else (None, None)
        self.spec = step_abi.ModelSpec(
            *(act, dims["C"], dims["H"], dims["KVH"], dims["D"], eps),
            *(cos, sin, final_norm[0], final_norm[1], lin(lm_head)),
            layers,
            *(table, table_fmt, positions),
            R=cos.shape[-1] if cos is not None else 0,
            **model,
        )
        self._pools = pools  # (k_pool, v_pool, int8 scales or None) per layer
        k_pool = self._pools[0][0]
        geometry = step_abi.PoolGeometry(
            k_pool.shape[1], *k_pool.stride()[:3], paged_attention.DTYPE_CODES[k_pool.dtype]
        )
        addresses = step_abi.map_buffers(self.spec, lambda _, t: t.data_ptr())
        self.structs = step_abi.Structs(addresses, [_pool_addresses(*p) for p in self._pools], geometry)
        # fp32 panels stay within small_gemm's row limit (panel_gemm wins above it); quantized linears go further.
        fp32 = any(p.fmt == FP32 for x in self.spec.linears() for p in x.parts)
        self.max_rows = small_gemm.MAX_ROWS if fp32 else QUANT_MAX_ROWS
        self.step = step_abi.StepKernel(self.kernel, self.structs, dims["C"], self.max_rows)
        self.n_vocab = lm_head.out_features

    @staticmethod
    def supports(linears: list) -> bool:
        """Whether every linear has a copy the kernel reads, and the kernel loads here."""
        return all(lin(x) is not None for x in linears) and load() is not None

    def __call__(self, layout, slots=None, lora=None) -> np.ndarray:
        """A ``models.step_layout.StepLayout`` of at most ``max_rows`` rows (decode tokens, prompt-chunk tokens) ->
        logits of its sample rows [n_sample, V] numpy (every row when it has no prompts); every row's K/V written,
        at torch's thread count. ``slots``: each row's adapter slot [N] (-1 the base) in ``lora`` (a
        ``lora_step.KernelLora``), or None. The call is the native runner's (``step_abi.StepKernel.run``)."""
        logits = np.empty((layout.n_sample, self.n_vocab), np.float32)
        self.step.run(layout, logits, torch.get_num_threads(), slots=slots, lora=lora)
        return logits
