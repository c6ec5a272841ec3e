"""What every model family shares: pre-packed linears and the forward loop (the mixed-batch layout is
``mixed_batch.py``, the one attention ``attention.py``, taking over a checkpoint's weights ``state_dict.py``).

A forward runs one *mixed batch*: B decode tokens (one per active row ``[0, B)``, each at its own
position) and whole prompts packed after them, ``[B + T, C]`` with no padding. Every linear
runs once over all B + T tokens (a step that admits newcomers streams the weights once);
attention runs per part (``attention.mixed_attention``): decode rows over their KV blocks in place, each
prompt chunk causally over itself (and its earlier blocks), every token's K/V landing in its slot of
the block pool. Logits only for the decode rows and each chunk's last token.

One call per step: a step of at most ``StepPlan.max_rows`` rows (decode tokens plus prompt-chunk tokens: 16 with
fp32 linears, small_gemm's limit; 128 quantized) runs as ONE compiled call (``kernels/decode_step``: the embedding,
every layer, the final norm and the lm_head over the sample rows, in one OpenMP region, ``fused_step``) where every
linear has a compiled copy (quantized, or small_gemm's fp32 panels) and, for GPT-2, the GELU is the tanh one; there
each prompt token is a row with its own position and block table, attending over its sequence's blocks (its chunk's
earlier tokens included) like a decode row. Otherwise a decode-only step of at most ``LEAN_MAX_ROWS`` rows runs each
layer as a few compiled calls (``attention.lean_decode_supported``): the norm, the fused QKV linear, one
``rope_write_attend`` (RoPE + KV write + paged attention), the output linear with its residual add, the norm, the
MLP linears and their activation. A decode step is bound by weight bytes and a short chunk's step by its linears'
FMAs, so the torch path's per-op dispatch (~15 ms a step on SmolLM2) is pure overhead there; larger steps keep the
torch path (compute-bound, oneDNN / SDPA; ``decode_step.py`` measured).

Shapes: N = B + T tokens, C = model width, H = query heads, KVH = K/V heads, G = H / KVH,
D = head_dim, V = vocab, L = positions attended by a decode step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from model_runner import RowsForward

from .attention import LEAN_MAX_ROWS, lean_decode_supported
from .kernels import decode_ops, decode_step, quant_gemm, small_gemm
from .kernels.quant_gemm import WEIGHTS_TYPES, QuantParts, QuantWeight, bytes_by_type
from .kv_cache import PagedKVCache
from .mixed_batch import MixedBatch
from .quant import quantize
from .state_dict import release_file_pages
from .step_layout import StepLayout, StepLimits


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


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for fmt, n in more.items():
        total[fmt] = total.get(fmt, 0) + n


class MixedForward(RowsForward):
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
    def forward(self, layout: StepLayout, loras: list[int] | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """``model_runner.ModelRunner.forward`` over ``layout``'s rows (``loras``: each decode row's, then each chunk's
        adapter slot, -1 the base; ``enable_lora``) -> float32 numpy logits [n_sample, V] (and the hidden rows' final
        hidden states [len(layout.hidden), C] beside them, when the layout has any), as the native runner returns
        them. A step of at most ``fused_step.max_rows`` rows (no hidden rows) is one whole-step kernel call over the
        layout itself, the native runner's (``StepKernel.run``); any other runs ``_forward`` over its torch view."""
        if loras is not None and self.lora is None:
            raise ValueError("rows of LoRA adapters for a model without adapters (enable_lora)")
        slots = layout.row_slots(loras)
        if layout.hidden is None and self._takes_fused_step(layout.n):  # embeddings: the torch loop
            # the embedding, every layer, the final norm and the lm_head in one call (and each adapter's deltas)
            return self.fused_step(layout, slots, self.lora.kernel if slots is not None else None)
        batch = MixedBatch.from_layout(layout, self.device)
        with self.lora.rows(slots) if slots is not None else contextlib.nullcontext():
            out = self._forward(batch)
        # numpy on the CPU: a view of the step's output tensor, no copy
        return tuple(t.float().cpu().numpy() for t in out) if isinstance(out, tuple) else out.float().cpu().numpy()

    def _forward(self, batch: MixedBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The step through torch: per layer the lean compiled calls (``lean``: a small decode-only step) or the
        torch ops -> logits [n_sample, V] (and the hidden rows' final hidden states, when the batch has any)."""
        batch.lean = self.lean_decode and not batch.prompts and 0 < batch.n_decode <= LEAN_MAX_ROWS
        x, pos_state = self._embed(batch)  # [N, C]
        for layer, block in enumerate(self.blocks):
            x = self._block(layer, block, x, batch, pos_state)
        # Logits only where a token is sampled: the decode rows and each chunk's last position.
        if batch.sample_rows is not None and not len(batch.sample_rows):  # only embedded chunks
            logits = torch.empty(0, self.lm_head.out_features, device=x.device)
        else:
            logits = self._logits(x if batch.sample_rows is None else x[batch.sample_rows], batch.lean)
        return (logits, self._final_norm(x[batch.hidden_rows])) if batch.hidden_rows is not None else logits

    def _takes_fused_step(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows (decode tokens plus chunk tokens) runs as one whole-step call: the kernel
        plan exists (lean decode on), and the rows are within the plan's limit (``StepPlan.max_rows``)."""
        if self.fused_step is None or not self.lean_decode:
            return False
        return 0 < rows <= self.fused_step.max_rows

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` of the KV pool becomes a copy of block ``src``, every layer (``PagedKVCache.copy_block``)."""
        self.kv.copy_block(src, dst)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV block pool."""
        return self.kv.nbytes

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
        self.step_limits = StepLimits(block_size, num_blocks)  # the pool's bounds (ids, positions: unchecked)
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
