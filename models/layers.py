"""What every model family shares: pre-packed linears, the mixed-batch layout, one attention, the forward loop.

A forward runs one *mixed batch*: B decode tokens (one per active row ``[0, B)``, each at its own
position) and whole prompts packed after them, ``[B + T, C]`` with no padding. Every linear
runs once over all B + T tokens (a step that admits newcomers streams the weights once);
attention runs per part (``mixed_attention``): decode rows over the cache, each prompt causally
over itself, its K/V landing in its own cache row. Logits only for the decode rows and each
prompt's last token.

Shapes: N = B + T tokens, C = model width, H = query heads, KVH = K/V heads, G = H / KVH,
D = head_dim, V = vocab, L = positions attended by a decode step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .kernels import small_gemm
from .kv_cache import KVCache


def use_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN pre-packed linears: CPU fp32 only (measured 2-3x F.linear at decode shapes)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    """y = x @ W^T + b with W pre-packed once for the CPU kernels; plain F.linear elsewhere.

    x: [N, in] -> y: [N, out]. ``gelu`` fuses the activation, ``add`` fuses a residual.
    On CPU, calls with at most ``small_gemm.MAX_ROWS`` rows (decode steps) go to the compiled
    small-batch kernel when it is available (``small``), larger ones to oneDNN.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool, batch_hint: int, small: bool = False
    ) -> None:
        self.onednn = onednn
        self.bias = bias.contiguous() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        self.small = small_gemm.pack(weight) if small else None  # [ceil(out / 8), in, 8]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if onednn else weight

    @property
    def n_params(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.bias is not None else 0)

    def _use_small(self, x: torch.Tensor) -> bool:
        return self.small is not None and x.shape[0] <= small_gemm.MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_small(x):
            return small_gemm.matmul(x, self.small, self.out_features, self.bias)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def gelu(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        if self._use_small(x):
            return F.gelu(small_gemm.matmul(x, self.small, self.out_features, self.bias), approximate=approximate)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], approximate)
        return F.gelu(F.linear(x, self.weight, self.bias), approximate=approximate)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._use_small(x):
            return small_gemm.matmul(x, self.small, self.out_features, self.bias, residual)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight, self.bias) + residual


def linear_factory(device: torch.device, capacity: int, want_small: bool) -> tuple[Callable[..., Linear], bool, bool]:
    """-> (make_linear(weight, bias), oneDNN on?, small-batch kernel on?) for this device.

    The small-batch kernel runs only where oneDNN does (CPU fp32), when asked for, and when it
    built; it costs a second packed copy of every weight.
    """
    onednn = use_onednn(device, torch.float32)
    small = want_small and onednn and small_gemm.load() is not None
    return functools.partial(Linear, onednn=onednn, batch_hint=capacity, small=small), onednn, small


@dataclass
class MixedBatch:
    """Where each token of one mixed forward sits: B decode tokens first, then the prompts back to back.

    Built once per forward, used by every layer.
    """

    ids: torch.Tensor  # [B + T] token ids
    pos: torch.Tensor  # [B + T] positions
    n_decode: int  # B: decode rows [0, B) of the activation and of the KV cache
    prompts: list[tuple[int, int, int]]  # per prompt: (first row in the activation, length, KV cache row)
    decode_rows: torch.Tensor  # [B]: cache rows of the decode tokens (0..B-1)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L]: row b attends positions <= pos[b]; None when B = 0
    decode_length: int  # L: the longest decode row's context
    sample_rows: torch.Tensor | None  # rows whose logits are needed; None = every row (no prompts)

    @classmethod
    def build(
        cls,
        token_ids: list[int],
        positions: list[int],
        prompts: list[list[int]],
        rows: list[int],
        arange: torch.Tensor,
        every_position: list[bool] = (),
    ) -> "MixedBatch":
        """``arange``: a preallocated ``torch.arange`` at least as long as any position or row count.
        ``every_position[i]``: prompt i's logits are wanted at all its positions, not only the last."""
        B, dev = len(token_ids), arange.device
        lengths = [len(p) for p in prompts]
        starts = [B + sum(lengths[:i]) for i in range(len(lengths))]
        ids = torch.tensor(list(token_ids) + [t for p in prompts for t in p], device=dev)
        pos = torch.cat([torch.tensor(positions, device=dev, dtype=torch.long)] + [arange[:n] for n in lengths])
        length = max(positions) + 1 if B else 0
        mask = (arange[:length] <= pos[:B, None]).view(B, 1, 1, length) if B else None
        full = list(every_position) or [False] * len(prompts)
        last = [range(s, s + n) if f else [s + n - 1] for s, n, f in zip(starts, lengths, full)]
        sample = [*range(B), *(r for span in last for r in span)] if prompts else None
        return cls(
            ids, pos, B, list(zip(starts, lengths, rows)), arange[:B], mask, length,
            torch.tensor(sample, device=dev) if sample is not None else None,
        )


def mixed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer: int, batch: MixedBatch, scale: float
) -> torch.Tensor:
    """Grouped-query attention over a mixed batch; writes this layer's new K/V into the cache first.

    q: [N, H, D], k, v: [N, KVH, D] (H = KVH x G; G = 1 is plain multi-head attention, GPT-2)
    -> [N, H, D]. Decode rows attend over their cache row, masked per row length; query head
    ``h = kvh * G + g`` reads K/V head ``kvh``, so the B queries are viewed as [B, KVH, G, D]
    against the cache view [B, KVH, L, D] (no copy of the cache). Each prompt attends causally
    over its own tokens.
    """
    N, H, D = q.shape
    B, KVH = batch.n_decode, k.shape[1]
    out = torch.empty(N, H, D, device=q.device, dtype=q.dtype)
    if B:
        kv.write_step(layer, batch.decode_rows, batch.pos[:B], k[:B], v[:B])
        keys, values = kv.view(layer, B, batch.decode_length)  # each [B, KVH, L, D]: a view, no copy
        att = F.scaled_dot_product_attention(
            q[:B].reshape(B, KVH, H // KVH, D), keys, values, attn_mask=batch.decode_mask, scale=scale
        )  # [B, KVH, G, D]
        out[:B] = att.view(B, H, D)
    for start, n, row in batch.prompts:
        span = slice(start, start + n)
        qp, kp, vp = q[span].transpose(0, 1), k[span].transpose(0, 1), v[span].transpose(0, 1)  # [H or KVH, n, D]
        kv.write_prompt(layer, row, kp, vp)
        att = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=KVH != H)  # [H, n, D]
        out[span] = att.transpose(0, 1)  # [n, H, D]
    return out


def fp32_state_dict(hf_model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The HF module's weights as contiguous fp32 tensors on ``device`` (the HF module can then go)."""
    return {k: v.detach().to(device=device, dtype=torch.float32).contiguous() for k, v in hf_model.state_dict().items()}


class MixedForward:
    """A model family's forward over a mixed batch: the loop every family shares.

    Subclasses set ``blocks``, ``kv`` (a KVCache), ``onednn``/``small_gemm`` (which linear kernels
    are on), ``_arange`` (``torch.arange`` over max(capacity, max_len)) and supply the family's math:
    ``_embed`` (token ids -> [N, C] plus whatever positional state the blocks need), ``_block``
    (one transformer layer) and ``_logits`` (final norm and lm_head).
    """

    model_type: str  # HF config.model_type this family serves
    blocks: list
    kv: KVCache

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        positions: list[int],
        prompts: list[list[int]] = (),
        rows: list[int] = (),
        every_position: list[bool] = (),
    ) -> torch.Tensor:
        """Decode rows [0, B) (token_ids[b] at positions[b]) and prefill whole prompts into cache rows ``rows``.

        Returns logits [B + len(prompts), V]: the decode rows, then each prompt's last position; a prompt
        with ``every_position[i]`` set has all its positions there instead, in order (prompt logprobs).
        """
        batch = MixedBatch.build(token_ids, positions, prompts, rows, self._arange, every_position)
        x, pos_state = self._embed(batch)  # [N, C]
        for layer, block in enumerate(self.blocks):
            x = self._block(layer, block, x, batch, pos_state)
        # Logits only where a token is sampled: the decode rows and each prompt's last position.
        return self._logits(x if batch.sample_rows is None else x[batch.sample_rows])

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Run whole prompts, fill their cache rows; return each prompt's last-position logits [len(prompts), V]."""
        return self.forward([], [], prompts, rows)

    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of rows [0, B): token_ids[b] sits at positions[b]. Returns logits [B, V]."""
        return self.forward(token_ids, positions)

    def _init_cache(self, n_layer: int, capacity: int, n_kv_head: int, max_len: int, head_dim: int, device) -> None:
        """The KV cache (K/V heads only) and the arange the batch layout indexes with."""
        self.kv = KVCache(n_layer, capacity, n_kv_head, max_len, head_dim, device)
        self._arange = torch.arange(max(capacity, max_len), device=device)  # rows and positions

    def _embed(self, batch: MixedBatch) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    def _block(self, layer: int, block, x: torch.Tensor, batch: MixedBatch, pos_state) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
