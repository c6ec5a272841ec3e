"""What every model family shares: pre-packed linears, the mixed-batch layout, one attention, the forward loop.

A forward runs one *mixed batch*: B decode tokens (one per active row ``[0, B)``, each at its own
position) and whole prompts packed after them, ``[B + T, C]`` with no padding. Every linear
runs once over all B + T tokens (a step that admits newcomers streams the weights once);
attention runs per part (``mixed_attention``): decode rows over their KV blocks in place, each
prompt chunk causally over itself (and its earlier blocks), every token's K/V landing in its slot of
the block pool. Logits only for the decode rows and each chunk's last token.

One call per step: a step of at most ``StepPlan.max_rows`` rows (decode tokens plus prompt-chunk tokens: 16
with fp32 linears, small_gemm's limit; 128 quantized) runs as ONE compiled call (``kernels/decode_step``: the
embedding, every layer, the final norm and the lm_head over the sample rows, in one OpenMP region,
``fused_step``) where every linear has a compiled copy (quantized, or small_gemm's fp32 panels) and, for GPT-2,
the GELU is the tanh one; there each prompt token is a row with its own position and block table, attending
over its sequence's blocks (its chunk's earlier tokens included) like a decode row. Otherwise a decode-only step
of at most ``LEAN_MAX_ROWS`` rows runs each layer as a few compiled calls (``lean_decode_supported``): the norm,
the fused QKV linear, one ``rope_write_attend`` (RoPE + KV write + paged attention), the output linear with its
residual add, the norm, the MLP linears and their activation. A decode step is bound by weight bytes and a
short chunk's step by its linears' FMAs, so the torch path's per-op dispatch (~15 ms a step on SmolLM2) is pure
overhead there; larger steps keep the torch path (compute-bound, oneDNN / SDPA; ``decode_step.py`` measured).

Shapes: N = B + T tokens, C = model width, H = query heads, KVH = K/V heads, G = H / KVH,
D = head_dim, V = vocab, L = positions attended by a decode step.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import decode_ops, decode_step, quant_gemm, small_gemm
from .kernels import paged_attention as attention_kernel
from .kernels.paged_attention import attend, paged_attention
from .kernels.quant_gemm import WEIGHTS_TYPES, QuantParts, QuantWeight, bytes_by_type
from .kv_cache import PagedKVCache
from .quant import quantize


def use_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN pre-packed linears: CPU fp32 only (measured 2-3x F.linear at decode shapes)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    """y = x @ W^T + b on ONE resident copy of W, packed once for the CPU kernels; plain F.linear elsewhere.

    x: [N, in] -> y: [N, out]. ``gelu`` adds the activation (fused on oneDNN), ``add`` fuses a residual.
    fp32 on CPU with the compiled kernel (``small``): W lives only as small_gemm's panels [ceil(out / 8), in, 8],
    read by every call (``small_gemm.matmul``: the small-batch kernel up to ``small_gemm.MAX_ROWS`` rows,
    ``panel_gemm`` above, the same bits) and by the whole-step decode kernel. Without it: oneDNN's reordered
    copy (``onednn``), or the plain weight (off CPU, or ``table``: a tied lm_head whose rows the token
    embedding reads too, ``table()``).
    Quantized (``weight`` a ``QuantWeight`` in its GGUF blocks, a ``QuantParts`` of several types, or ``quant`` =
    "int8" / "int4" to quantize an fp32 weight here into Q8_0 / Q4_1): every call goes to ``quant_gemm`` on the one
    copy (``self.quant``).
    """

    def __init__(
        self,
        weight: torch.Tensor | QuantWeight | QuantParts,
        bias: torch.Tensor | None,
        onednn: bool,
        batch_hint: int,
        small: bool = False,
        quant: str | None = None,
        table: bool = False,
    ) -> None:
        self.bias = bias.contiguous() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        if quant is not None and not isinstance(weight, (QuantWeight, QuantParts)):
            weight = quantize(weight, quant)
        self.quant = weight if isinstance(weight, (QuantWeight, QuantParts)) else None
        if self.quant is not None:
            self.onednn, self.small, self.weight = False, None, None
            return
        # [ceil(out / 8), in, 8]; a large table's checkpoint pages leave RSS chunk by chunk as they are copied
        self.small = small_gemm.pack(weight, release=release_file_pages) if small else None
        self.onednn = onednn and not small and not table  # oneDNN's reordered copy has no rows to look up
        if self.small is not None:
            self.weight = None
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if self.onednn else weight

    @property
    def fmt(self) -> str:
        """The weight's format: "fp32", a GGUF type ("Q4_K"), or the types of a mixed fusion ("Q4_K+Q6_K")."""
        return self.quant.fmt if self.quant is not None else "fp32"

    def bytes_by_format(self) -> dict[str, int]:
        """Bytes of the one copy per format (a mixed fusion: per GGUF type)."""
        return bytes_by_type(self.quant) if self.quant is not None else {"fp32": self.nbytes}

    @property
    def nbytes(self) -> int:
        """Bytes resident for this weight: its one copy (quantized blocks, small_gemm panels, or [out, in] fp32)."""
        if self.quant is not None:
            return self.quant.nbytes
        if self.small is not None:
            return self.small.numel() * self.small.element_size()  # the last panel padded to 8 outputs
        return self.out_features * self.in_features * 4

    @property
    def n_params(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    @property
    def streamed_bytes(self) -> int:
        """Bytes of weight one call reads: the one copy, whichever kernel runs."""
        return self.nbytes

    @property
    def copy(self) -> torch.Tensor | QuantWeight | QuantParts:
        """The one resident copy of the weight: quantized blocks, small_gemm panels, or oneDNN's / the plain one."""
        return next(c for c in (self.quant, self.small, self.weight) if c is not None)

    def table(self) -> torch.Tensor | QuantWeight:
        """The weight as a token table ``embed_rows`` reads (a tied lm_head's copy, shared): the quantized
        copy, the panels, or the plain [out, in] weight (made with ``table=True``, never oneDNN's)."""
        if self.onednn:
            raise ValueError("a oneDNN-reordered weight has no rows to look up (make the Linear with table=True)")
        return self.copy

    lora = None  # a ``lora_torch.LinearLora`` where adapters may target this linear: adds their deltas to the output

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._base(x) if self.lora is None else self.lora(x, self._base(x))

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_gemm.matmul(x, self.quant, self.bias)
        if self.small is not None:
            return small_gemm.matmul(x, self.small, self.out_features, self.bias)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def gelu(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        if self.onednn and not (self.lora is not None and self.lora.active):  # an adapter's delta goes before GELU
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], approximate)
        if self.small is not None and approximate == "tanh" and decode_ops.load() is not None:
            # The compiled tanh GELU (the decode steps'): 3x F.gelu's speed at prefill sizes, where oneDNN fused it.
            return decode_ops.gelu_tanh(self(x))
        return F.gelu(self(x), approximate=approximate)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ b), and any adapter's delta after it."""
        return self._add(x, residual) if self.lora is None else self.lora(x, self._add(x, residual))

    def _add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_gemm.matmul(x, self.quant, self.bias, residual)
        if self.small is not None:
            return small_gemm.matmul(x, self.small, self.out_features, self.bias, residual)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight, self.bias) + residual


def linear_factory(
    device: torch.device, capacity: int, want_small: bool, weights: str = "fp32"
) -> tuple[Callable[..., Linear], bool, bool]:
    """-> (make_linear(weight, bias, table=False), oneDNN on?, small_gemm panels on?) for this device.

    The compiled kernels run only where oneDNN does (CPU fp32), when asked for, and when they built;
    then every fp32 weight is held once, as small_gemm panels, and oneDNN is off. ``weights`` "int8" /
    "int4" quantizes every fp32 weight it is given into Q8_0 / Q4_1 (CPU only); a ``QuantWeight`` is used as it is.
    """
    quant = weights if weights in WEIGHTS_TYPES else None
    if quant is not None and device.type != "cpu":
        raise ValueError(f"WEIGHTS={weights} runs on the CPU only (device is {device}); use WEIGHTS=fp32")
    cpu_fp32 = use_onednn(device, torch.float32)
    small = want_small and cpu_fp32 and small_gemm.load() is not None
    onednn = cpu_fp32 and not small
    make = functools.partial(Linear, onednn=onednn, batch_hint=capacity, small=small, quant=quant)
    return make, onednn, small


def embedding_table(table: torch.Tensor | QuantWeight, weights: str) -> torch.Tensor | QuantWeight:
    """A token embedding [V, C] in the ``weights`` format (quantized under int8 / int4, so a tied lm_head shares it)."""
    if weights in WEIGHTS_TYPES and not isinstance(table, QuantWeight):
        return quantize(table, weights)
    return table


def embed_rows(table: torch.Tensor | QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a token embedding: [len(ids), C] fp32 (a quantized table dequantizes just those rows; a 3-D
    table is a tied lm_head's small_gemm panels, ``Linear.table``)."""
    if isinstance(table, QuantWeight):
        return quant_gemm.dequantize_rows(table, ids)
    return small_gemm.rows(table, ids) if table.dim() == 3 else table[ids]


def check_cpu(sd: dict, device: torch.device) -> None:
    """Quantized weights (a GGUF served at its own precision) run on the CPU only."""
    quantized = [x for v in sd.values() for x in (v if isinstance(v, list) else [v])]  # a GGUF's experts: lists
    if device.type != "cpu" and any(isinstance(v, (QuantWeight, QuantParts)) for v in quantized):
        raise ValueError(f"quantized weights run on the CPU only (device is {device}); use WEIGHTS=fp32")


@dataclass
class MixedBatch:
    """Where each token of one mixed forward sits: B decode tokens first, then the prompt chunks back to back.

    Every token also has a KV slot (block id, offset in the block) from its sequence's block table.
    A prompt chunk covers positions [start, start + n) of its sequence; ``start`` > 0 when a prompt
    is prefilled over several steps (its earlier positions are already in its blocks).
    Built once per forward, used by every layer.
    """

    ids: torch.Tensor  # [B + T] token ids
    pos: torch.Tensor  # [B + T] positions
    slot_blocks: torch.Tensor  # [B + T] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [B + T] offset of each token's KV slot in its block
    n_decode: int  # B: the decode tokens are rows [0, B) of the activation
    # [B, max_blocks] int32 of the decode rows (padded with 0), None when B = 0; built ``for_step``: [B + P,
    # max_blocks], the P chunks' tables after the decode rows'.
    block_tables: torch.Tensor | None
    context_lens: torch.Tensor | None  # [B] int32: decode row b attends positions [0, pos[b]]
    prompts: list[tuple[int, int, int, torch.Tensor]]  # per chunk: (first activation row, length, start, table)
    sample_rows: torch.Tensor | None  # rows whose logits are needed; None = every row (no prompts)
    lean: bool = False  # decode rows only, few enough for the lean path (MixedForward.forward sets it)
    row_tables: torch.Tensor | None = None  # built ``for_step`` with prompts: [B + T] int32, each row's table
    hidden_rows: torch.Tensor | None = None  # rows whose final hidden states are wanted (chunks flagged ``hidden``)

    @classmethod
    def build(
        cls,
        token_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        prompts: list[list[int]],
        prompt_tables: list[list[int]],
        prompt_starts: list[int],
        block_size: int,
        device: torch.device,
        every_position: list[bool] = (),
        for_step: bool = False,
        hidden: list[bool] = (),
    ) -> MixedBatch:
        """``every_position[i]``: chunk i's logits are wanted at all its positions, not only the last
        (prompt logprobs); ``hidden[i]``: none of its logits, its final hidden states at every position instead
        (``hidden_rows``). ``for_step``: the batch goes to the whole-step kernel (``fused_step``), which
        reads every row's table through ``block_tables`` and ``row_tables``."""
        B = len(token_ids)
        lengths = [len(p) for p in prompts]
        starts = [B + sum(lengths[:i]) for i in range(len(lengths))]
        ids = torch.tensor(list(token_ids) + [t for p in prompts for t in p], dtype=torch.long)
        pos = list(positions) + [s + i for s, n in zip(prompt_starts, lengths) for i in range(n)]
        blocks = [table[p // block_size] for table, p in zip(tables, positions)]
        for table, start, n in zip(prompt_tables, prompt_starts, lengths):
            blocks += [table[p // block_size] for p in range(start, start + n)]
        block_tables = context_lens = row_tables = None
        all_tables = list(tables) + list(prompt_tables) if for_step else tables
        if all_tables:
            width = max(len(t) for t in all_tables)
            block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in all_tables], dtype=torch.int32)
        if B:
            context_lens = torch.tensor(positions, dtype=torch.int32) + 1
        if for_step and prompts:  # row -> table: decode row b reads table b, chunk i's rows table B + i
            counts = torch.tensor([1] * B + lengths)
            row_tables = torch.repeat_interleave(torch.arange(B + len(prompts), dtype=torch.int32), counts)
        full = list(every_position) or [False] * len(prompts)
        pooled = list(hidden) or [False] * len(prompts)
        spans = [
            [] if h else range(s, s + n) if f else [s + n - 1] for s, n, f, h in zip(starts, lengths, full, pooled)
        ]
        sample = [*range(B), *(r for span in spans for r in span)] if prompts else None
        states = [r for s, n, h in zip(starts, lengths, pooled) if h for r in range(s, s + n)]
        pos_t = torch.tensor(pos, dtype=torch.long)
        return cls(
            ids.to(device),
            pos_t.to(device),
            torch.tensor(blocks, dtype=torch.long, device=device),
            (pos_t % block_size).to(device),
            B,
            block_tables,
            context_lens,
            [
                (r, n, s, torch.tensor(t, dtype=torch.long, device=device))
                for r, n, s, t in zip(starts, lengths, prompt_starts, prompt_tables)
            ],
            torch.tensor(sample, device=device, dtype=torch.long) if sample is not None else None,
            row_tables=row_tables,
            hidden_rows=torch.tensor(states, device=device, dtype=torch.long) if states else None,
        )


def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKVCache,
    layer: int,
    batch: MixedBatch,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Grouped-query attention over a mixed batch; writes this layer's new K/V into their slots first.

    q: [N, H, D], k, v: [N, KVH, D] (H = KVH x G; G = 1 is plain multi-head attention, GPT-2)
    -> [N, H, D]. Decode rows attend over their blocks in place (``paged_attention``: the compiled
    kernel on the CPU, no gather; query head ``h = kvh * G + g`` reads K/V head ``kvh``). A prompt
    chunk attends causally over itself, plus its sequence's earlier positions (gathered once from its
    blocks) when it does not start at 0. ``window`` > 0 (a sliding-window layer): a token at position p
    sees keys in (p - window, p] only (HF's mask), and a chunk gathers only the blocks its window reaches;
    ``softcap`` > 0: scores are soft-capped (``attention_kernel.attend``).
    With an fp16 / bf16 / int8 pool a chunk attends over what the pool holds, its own tokens as stored included
    (``_stored_chunk_attention``), so a prompt gives the same K/V to every later token whether it was prefilled at
    once, in chunks or found in the prefix cache.
    """
    N, H, D = q.shape
    B = batch.n_decode
    kv.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
    out = torch.empty(N, H, D, device=q.device, dtype=q.dtype)
    k_pool, v_pool, scales = kv.pools(layer)
    if B:
        tables, lens = batch.block_tables[:B], batch.context_lens
        out[:B] = paged_attention(q[:B], k_pool, v_pool, tables, lens, scale, window, softcap, scales)
    for row, n, start, table in batch.prompts:
        span = slice(row, row + n)
        if kv.dtype != "fp32":
            out[span] = _stored_chunk_attention(q[span], kv, layer, table, start, scale, window, softcap)
            continue
        qp, kp, vp = q[span].transpose(0, 1), k[span].transpose(0, 1), v[span].transpose(0, 1)  # [H or KVH, n, D]
        first = max(0, start - window + 1) if window > 0 else 0  # the earliest key any of the chunk's queries sees
        if start == 0 and (window <= 0 or n <= window):
            att = attend(qp, kp, vp, None, scale, softcap)  # causal over the chunk: every key within its window
        else:
            keys, values = kp, vp
            if start > first:
                past_k, past_v = kv.gather(layer, table, start, first)  # [KVH, start - first, D]
                keys, values = torch.cat([past_k, keys], dim=1), torch.cat([past_v, values], dim=1)
            # Query i sits at position start + i and sees keys [first, start + i] (within its window).
            at, pos = torch.arange(first, start + n, device=q.device), start + torch.arange(n, device=q.device)[:, None]
            mask = at <= pos
            if window > 0:
                mask &= at > pos - window
            att = attend(qp, keys, values, mask, scale, softcap)
        out[span] = att.transpose(0, 1)  # [n, H, D]
    return out


def _stored_chunk_attention(
    q: torch.Tensor,
    kv: PagedKVCache,
    layer: int,
    table: torch.Tensor,
    start: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A prompt chunk's queries q [n, H, D] (positions start .. start + n - 1) over its sequence's stored K/V
    [0, start + n) (written already; within each query's ``window`` when set) -> [n, H, D]. On the CPU the paged
    kernel reads the pool in place, each row a query with its own context (what the whole-step kernel does with a
    chunk's rows); elsewhere the blocks the chunk's windows reach are gathered dequantized and masked."""
    n, H, D = q.shape
    k_pool, v_pool, scales = kv.pools(layer)
    if attention_kernel.kernel_supports(q, k_pool):
        tables = table.to(torch.int32).expand(n, -1)
        lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        return paged_attention(q, k_pool, v_pool, tables, lens, scale, window, softcap, scales)
    first = max(0, start - window + 1) if window > 0 else 0  # the earliest key any of the chunk's queries sees
    keys, values = kv.gather(layer, table, start + n, first, q.dtype)  # [KVH, start + n - first, D]
    at, pos = torch.arange(first, start + n, device=q.device), start + torch.arange(n, device=q.device)[:, None]
    mask = at <= pos
    if window > 0:
        mask &= at > pos - window
    return attend(q.transpose(0, 1), keys, values, mask, scale, softcap).transpose(0, 1)


LEAN_MAX_ROWS = small_gemm.MAX_ROWS  # decode steps up to this batch take the lean path (dispatch-bound there)


def lean_decode_supported(
    device: torch.device, head_dim: int, block_size: int, pool_dtype: torch.dtype = torch.float32
) -> bool:
    """Whether this model can run lean decode steps: CPU, and the compiled kernels it needs load here."""
    if device.type != "cpu" or decode_ops.load() is None:
        return False
    probe_q, probe_pool = torch.empty(1, 1, head_dim), torch.empty(1, block_size, 1, head_dim, dtype=pool_dtype)
    return attention_kernel.kernel_supports(probe_q, probe_pool)


def lean_attention(
    qkv: torch.Tensor,
    n_head: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    pools: tuple,
    batch: MixedBatch,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A lean decode step's attention: qkv [B, (H + 2 KVH) D] -> [B, H D]; RoPE (the full cos, sin tables, or
    None), the K/V write into this layer's ``pools`` (``PagedKVCache.pools``: K, V, int8's scales) and the paged
    attention (its ``window`` and ``softcap``) in one kernel call."""
    k_pool, v_pool, scales = pools
    out = attention_kernel.rope_write_attend(
        qkv,
        n_head,
        rope,
        batch.pos,
        k_pool,
        v_pool,
        batch.slot_blocks,
        batch.slot_offsets,
        batch.block_tables,
        batch.context_lens,
        scale,
        window,
        softcap,
        scales,
    )
    return out.view(qkv.shape[0], -1)


def fp32_state_dict(hf_model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor | QuantWeight]:
    """The HF module's weights as contiguous fp32 tensors on ``device`` (the HF module can then go).

    A GGUF served at its own precision (``models.gguf_model.GGUFModel``) also hands over ``QuantWeight``s, and a
    layer's quantized experts as a list of them, as they are.
    Small tensors (norms, biases, position tables: at most ``OWN_BELOW`` elements) are copied out of the
    checkpoint: safetensors maps the file, and one tensor the model keeps as it is would pin every page of the
    file read during the load (the whole checkpoint) in RSS; the large weights are packed into copies of their own.
    """
    sd = hf_model.state_dict()
    check_cpu(sd, device)
    out = {k: v if isinstance(v, (QuantWeight, list)) else _owned_fp32(v, device) for k, v in sd.items()}
    copied = [v for k, v in sd.items() if isinstance(v, torch.Tensor) and out[k].data_ptr() != v.data_ptr()]
    release_file_pages(copied)  # their pages of the checkpoint's mapping were read by the copy and are not needed
    return out


OWN_BELOW = 1 << 20  # elements: fp32_state_dict copies smaller tensors out of the checkpoint's file mapping


def packed_blocks(sd: dict, prefixes: list[str], build: Callable[[str], object]) -> list:
    """``build(prefix)`` for each block's state-dict prefix, in order; each block's checkpoint pages leave RSS as
    soon as it is packed (``release_file_pages``), so a load never holds the whole checkpoint beside the model."""
    blocks = []
    for prefix in prefixes:
        blocks.append(build(prefix))
        release_file_pages(v for k, v in sd.items() if k.startswith(prefix))
    return blocks


def release_file_pages(tensors) -> int:
    """Drop from RSS the pages of checkpoint tensors (an iterable, or one tensor) that are views of a file mapping
    (safetensors maps the checkpoint), once the model holds packed copies of them; -> bytes released.

    Without this every page read while packing stays resident until the HF model goes, so a load peaks at the
    whole checkpoint on top of the packed model. Only a mapping with no privately modified page is touched (smaps
    ``Anonymous`` 0: a page written through a private file mapping becomes an anonymous copy): each of its pages
    then reads back from the file, so a later read of such a tensor (an embedding used again) sees its values.
    Anonymous memory, partial pages at a tensor's ends, ``QuantWeight``s and anything off Linux are left alone.
    """
    if isinstance(tensors, torch.Tensor):  # one tensor (iterating it would give its rows)
        tensors = [tensors]
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() * t.element_size() >= mmap.PAGESIZE
    ]
    if not spans or not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/smaps"):
        return 0
    files = _file_mappings("/proc/self/maps", lambda _: True)  # cheap: smaps walks every page of every mapping
    spans = [(lo, hi) for lo, hi in spans if any(start <= lo and hi <= end for start, end in files)]
    if not spans:  # copies (a GGUF's tensors are): nothing of a file to release
        return 0
    clean = _file_mappings("/proc/self/smaps", lambda fields: fields.get("Anonymous:") == 0)
    released = 0
    for lo, hi in spans:
        if not any(start <= lo and hi <= end for start, end in clean):
            continue
        start, stop = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages only
        if stop > start and _libc().madvise(start, stop - start, mmap.MADV_DONTNEED) == 0:
            released += stop - start
    return released


_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")  # range perms offset dev inode path


def _file_mappings(listing: str, keep) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of regular files in ``listing`` (/proc/self/maps, or smaps with each
    mapping's fields) for which ``keep({field: kB})`` holds. Of smaps, the clean ones are those with no privately
    modified page (``Anonymous`` 0; not ``Private_Dirty``, which also counts clean file pages mapped as huge
    pages)."""
    out, current, fields = [], None, {}

    def close() -> None:
        if current is not None and keep(fields):
            out.append(current)

    with open(listing) as f:
        for line in f:
            header = _SMAPS_HEADER.match(line)
            if header:
                close()
                path = header.group(3).strip()
                file_backed = path.startswith("/") and not path.endswith("(deleted)")
                current = (int(header.group(1), 16), int(header.group(2), 16)) if file_backed else None
                fields = {}
            elif current is not None:
                name, *value = line.split()
                if name.endswith(":") and value and value[0].isdigit():
                    fields[name] = int(value[0])
    close()
    return out


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _owned_fp32(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = v.detach().to(device=device, dtype=torch.float32).contiguous()
    return out.clone() if out.numel() <= OWN_BELOW and out.data_ptr() == v.data_ptr() else out


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for fmt, n in more.items():
        total[fmt] = total.get(fmt, 0) + n


class MixedForward:
    """A model family's forward over a mixed batch: the loop every family shares.

    Subclasses set ``blocks``, ``lm_head``, ``n_layer``, ``n_head``, ``head_dim``, ``kv`` (a PagedKVCache,
    ``_init_cache``, which also sets ``lean_decode``), ``device``, ``onednn``/``small_gemm`` (which linear
    kernels are on) and supply the family's math: ``_embed`` (token ids -> [N, C] plus whatever positional
    state the blocks need), ``_block`` (one transformer layer) and ``_logits`` (final norm and lm_head).
    Shared here: the forward loop, and what the model costs (``linears``, ``flops_per_token``, ``weight_bytes``,
    ``resident_weights``), which the benchmark's roofline asks for.
    """

    model_type: str  # HF config.model_type this family serves
    blocks: list  # each has .linears()
    lm_head: Linear  # [C] -> [V]
    kv: PagedKVCache
    n_layer: int
    n_head: int  # query heads
    head_dim: int
    lean_decode: bool = False  # small decode-only steps through the compiled per-layer calls (set by families)
    fused_step: decode_step.StepPlan | None = None  # ... or through one whole-step call, where it runs
    lora = None  # a ``lora_torch.TorchLora`` once adapters are enabled (``enable_lora``)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        positions: list[int],
        tables: list[list[int]] = (),
        prompts: list[list[int]] = (),
        prompt_tables: list[list[int]] = (),
        prompt_starts: list[int] | None = None,
        every_position: list[bool] = (),
        hidden: list[bool] = (),
        loras: list[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode B tokens (token_ids[b] at positions[b] of the sequence with block table tables[b]) and
        prefill prompt chunks (prompts[i] at positions [prompt_starts[i], + len), default 0, block table
        prompt_tables[i]); every table must already cover its tokens' positions. ``loras``: each decode row's, then
        each chunk's adapter slot (-1: the base; None: every row the base's; ``enable_lora``).

        Returns logits [B + len(prompts), V]: the decode rows, then each chunk's last position; a chunk
        with ``every_position[i]`` set has all its positions there instead, in order (prompt logprobs). A chunk
        with ``hidden[i]`` set has no logits rows; its final hidden states (after the final norm) at every position
        come in a second tensor [their tokens, C], returned as (logits, hidden) when any chunk is so flagged.
        """
        args = (token_ids, positions, tables, prompts, prompt_tables, prompt_starts, every_position, hidden)
        if loras is None:
            return self._forward(*args)
        if self.lora is None:
            raise ValueError("rows of LoRA adapters for a model without adapters (enable_lora)")
        with self.lora.rows(loras, [1] * len(token_ids) + [len(p) for p in prompts]):
            return self._forward(*args)

    def _forward(self, token_ids, positions, tables, prompts, prompt_tables, prompt_starts, every_position, hidden):
        starts = list(prompt_starts) if prompt_starts is not None else [0] * len(prompts)
        pooled = any(hidden)  # embeddings: the torch loop (the whole-step kernel returns logits only here)
        whole_step = not pooled and self._takes_fused_step(len(token_ids), prompts)
        batch = MixedBatch.build(
            token_ids,
            positions,
            tables,
            prompts,
            prompt_tables,
            starts,
            self.kv.block_size,
            self.device,
            every_position,
            for_step=whole_step,
            hidden=hidden,
        )
        if whole_step:  # the embedding, every layer, the final norm and the lm_head in one call
            if self.lora is not None and self.lora.row_slots is not None:  # and each adapter's deltas, in the kernel
                return self.fused_step(batch, (self.lora.kernel, self.lora.row_slots))
            return self.fused_step(batch)
        batch.lean = self.lean_decode and not batch.prompts and 0 < batch.n_decode <= LEAN_MAX_ROWS
        x, pos_state = self._embed(batch)  # [N, C]
        for layer, block in enumerate(self.blocks):
            x = self._block(layer, block, x, batch, pos_state)
        # Logits only where a token is sampled: the decode rows and each chunk's last position.
        if batch.sample_rows is not None and not len(batch.sample_rows):  # only embedded chunks
            logits = torch.empty(0, self.lm_head.out_features, device=x.device)
        else:
            logits = self._logits(x if batch.sample_rows is None else x[batch.sample_rows], batch.lean)
        return (logits, self._final_norm(x[batch.hidden_rows])) if pooled else logits

    def _takes_fused_step(self, n_decode: int, prompts: list[list[int]]) -> bool:
        """Whether a step of ``n_decode`` decode rows and these prompt chunks runs as one whole-step call: the
        kernel plan exists (lean decode on), and its rows (decode tokens plus chunk tokens) are within the
        plan's limit (``StepPlan.max_rows``)."""
        if self.fused_step is None or not self.lean_decode:
            return False
        rows = n_decode + sum(len(p) for p in prompts)
        return 0 < rows <= self.fused_step.max_rows

    def prefill(self, prompts: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
        """Run whole prompts into their blocks; return each prompt's last-position logits [len(prompts), V]."""
        return self.forward([], [], [], prompts, tables)

    def decode(self, token_ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One token per sequence: token_ids[b] sits at positions[b], its blocks tables[b]. Returns logits [B, V]."""
        return self.forward(token_ids, positions, tables)

    # --- LoRA adapters (models/lora.py) ---

    def lora_targets(self) -> list:
        """The linears adapters may target (``lora.Target``s): each block's ``lora_linears()``."""
        from .lora_torch import targets

        return targets(self.blocks)

    def enable_lora(self, max_loras: int) -> None:
        """Room for ``max_loras`` adapters (``set_lora``): every targetable linear gets its hook."""
        from .lora_torch import TorchLora

        self.lora = TorchLora(self.blocks, max_loras, self.device)

    def set_lora(self, slot: int, adapter) -> None:
        """Slot ``slot`` holds ``adapter`` (a ``lora.Adapter``) from the next forward on; None empties it."""
        self.lora.set(slot, adapter)

    def linears(self) -> list[Linear]:
        """Every linear of the model in forward order: each block's, then the lm_head."""
        return [lin for block in self.blocks for lin in block.linears()] + [self.lm_head]

    def flops_per_token(self, context: int) -> int:
        """FLOPs to run one token that attends over ``context`` positions (nanoGPT's ``estimate_mfu`` count).

        Linears: 2 * out * in per token (a multiply and an add per weight). Attention, per layer:
        q @ K^T [H, D] x [D, L] and att @ V [H, L] x [L, D], 2 * L * H * D each. Norms, RoPE, softmax
        and the embedding lookup are left out (O(C) per token, noise beside the O(C^2) linears).
        """
        linear = sum(2 * lin.out_features * lin.in_features for lin in self.linears())
        return linear + self.n_layer * 4 * context * self.n_head * self.head_dim

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights one forward step streams, per format ("fp32", or a GGUF type: "Q8_0", "Q4_K", ...).

        Each linear's one copy that the step reads (``Linear.streamed_bytes``): a decode step at small
        batch is bound by these. Embedding lookups read a few rows only and are left out; a tied lm_head
        counts its table once, as the lm_head.
        """
        out: dict[str, int] = {}
        for lin in self.linears():
            _add(out, lin.bytes_by_format())
        return out

    def resident_weights(self) -> dict[str, int]:
        """Bytes of weights held, per format: every linear's one copy, then the embedding tables.

        A tied embedding is the lm_head's copy (``Linear.table``: quantized blocks, fp32 panels or the plain
        weight), counted once, as the lm_head.
        """
        out: dict[str, int] = {}
        held: set[int] = set()  # ids of the copies counted (``Linear.copy``)
        for lin in self.linears():
            if id(lin.copy) not in held:
                held.add(id(lin.copy))
                _add(out, lin.bytes_by_format())
        for table in self.embedding_tables():
            if id(table) in held:
                continue
            held.add(id(table))
            _add(out, bytes_by_type(table) if isinstance(table, QuantWeight) else {"fp32": table.nbytes})
        return out

    def embedding_tables(self) -> list:
        """The family's lookup tables (token, position embeddings): fp32 tensors or ``QuantWeight``s."""
        raise NotImplementedError

    @staticmethod
    def kv_window(hf_config) -> int:
        """A sliding window every layer has (keys a query reads at most), or 0: then blocks that left it go back to
        the pool as a sequence grows (``BlockManager.release_before``)."""
        return 0

    def _init_cache(
        self,
        n_layer: int,
        n_kv_head: int,
        head_dim: int,
        device,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: str = "fp32",
    ) -> None:
        """The KV block pool (K/V heads only, elements ``kv_cache_dtype``); lean decode steps where their kernels
        run."""
        self.kv = PagedKVCache(n_layer, num_blocks, block_size, n_kv_head, head_dim, device, kv_cache_dtype)
        self.lean_decode = lean_decode_supported(device, head_dim, block_size, self.kv.k.dtype)
        self.layer_pools = [self.kv.pools(layer) for layer in range(n_layer)]  # views, made once, not per step
        self.fused_step = self._fused_plan() if self.lean_decode else None

    def _fused_plan(self) -> decode_step.StepPlan | None:
        """The family's whole-step kernel plan (``decode_step.StepPlan``), or None where it cannot run."""
        return None

    def _embed(self, batch: MixedBatch) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    def _block(self, layer: int, block, x: torch.Tensor, batch: MixedBatch, pos_state) -> torch.Tensor:
        raise NotImplementedError

    def _final_norm(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """The final norm: [n, C] -> [n, C] (HF's last ``hidden_states``)."""
        raise NotImplementedError

    def _logits(self, x_last: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """Final norm (compiled on a lean step) and lm_head: [n, C] -> [n, V]."""
        raise NotImplementedError
