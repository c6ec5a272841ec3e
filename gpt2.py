"""A hand-written GPT-2 forward over the preallocated KV cache (nanoGPT-style, one file).

The weights come from a loaded Hugging Face ``GPT2LMHeadModel``; the math is the same
as HF's (pre-LayerNorm blocks, fused QKV, tanh-GELU MLP, tied lm_head), so greedy
tokens match ``generate(do_sample=False)`` exactly (the parity tests guard this).

One entry point, ``forward``, a pure function of (tokens, positions, cache) over a mixed batch
(``prefill`` and ``decode`` are its two halves alone):
- decode: one token for each of the rows ``[0, B)``; K/V written in place at each row's own
  position, attention over a view of the cache, masked per row length;
- prefill: whole prompts packed after them into one ``[B + T, C]`` activation (no padding);
  attention runs causally per prompt, and each prompt's K/V lands in its own cache row.
The linears run once over all B + T tokens: a step that admits newcomers streams the weights
once. Logits only for the decode rows and each prompt's last token.

Shapes: C = n_embd, H = n_head, D = C / H, V = vocab, L = positions attended.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import small_gemm
from kv_cache import KVCache

# HF activation_function name -> oneDNN post-op algorithm for GELU.
_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def use_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN pre-packed linears: CPU fp32 only (measured 2-3x F.linear at decode shapes)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    """y = x @ W^T + b with W pre-packed once for the CPU kernels; plain F.linear elsewhere.

    x: [N, in] -> y: [N, out]. ``gelu`` fuses the activation, ``add`` fuses a residual.
    On CPU, calls with at most ``small_gemm.MAX_ROWS`` rows (decode steps) go to the compiled
    small-batch kernel when it is available (``small``), larger ones to oneDNN.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool, batch_hint: int, small: bool = False) -> None:
        self.onednn = onednn
        self.bias = bias.contiguous() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        self.small = small_gemm.pack(weight) if small else None  # [ceil(out / 8), in, 8]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if onednn else weight

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
        return torch.addmm(residual, x, self.weight.t()) if self.bias is None else F.linear(x, self.weight, self.bias) + residual


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

    Shared by every model family's ``forward``; built once per forward, used by every layer.
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
        cls, token_ids: list[int], positions: list[int], prompts: list[list[int]], rows: list[int], arange: torch.Tensor
    ) -> "MixedBatch":
        """``arange``: a preallocated ``torch.arange`` at least as long as any position or row count."""
        B, dev = len(token_ids), arange.device
        lengths = [len(p) for p in prompts]
        starts = [B + sum(lengths[:i]) for i in range(len(lengths))]
        ids = torch.tensor(list(token_ids) + [t for p in prompts for t in p], device=dev)
        pos = torch.cat([torch.tensor(positions, device=dev, dtype=torch.long)] + [arange[:n] for n in lengths])
        length = max(positions) + 1 if B else 0
        mask = (arange[:length] <= pos[:B, None]).view(B, 1, 1, length) if B else None
        sample = [*range(B), *(s + n - 1 for s, n in zip(starts, lengths))] if prompts else None
        return cls(
            ids, pos, B, list(zip(starts, lengths, rows)), arange[:B], mask, length,
            torch.tensor(sample, device=dev) if sample is not None else None,
        )


class MixedForward:
    """What the engine calls on a model family: ``forward`` over a mixed batch (subclasses), and
    its two halves alone."""

    def forward(
        self, token_ids: list[int], positions: list[int], prompts: list[list[int]] = (), rows: list[int] = ()
    ) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Run whole prompts, fill their cache rows; return each prompt's last-position logits [len(prompts), V]."""
        return self.forward([], [], prompts, rows)

    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of rows [0, B): token_ids[b] sits at positions[b]. Returns logits [B, V]."""
        return self.forward(token_ids, positions)


class Block:
    """One transformer block's weights (Conv1D weights transposed to [out, in])."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str, make_linear: Callable[..., Linear]) -> None:
        def lin(name: str) -> Linear:
            return make_linear(sd[f"{prefix}{name}.weight"].t().contiguous(), sd[f"{prefix}{name}.bias"])

        self.ln_1 = (sd[f"{prefix}ln_1.weight"], sd[f"{prefix}ln_1.bias"])
        self.ln_2 = (sd[f"{prefix}ln_2.weight"], sd[f"{prefix}ln_2.bias"])
        self.c_attn = lin("attn.c_attn")  # [C] -> [3C]
        self.attn_proj = lin("attn.c_proj")  # [C] -> [C]
        self.c_fc = lin("mlp.c_fc")  # [C] -> [4C]
        self.mlp_proj = lin("mlp.c_proj")  # [4C] -> [C]


class GPT2(MixedForward):
    """GPT-2 weights plus the KV cache, with ``prefill`` and ``decode`` steps that return logits."""

    @staticmethod
    def context_window(hf_config) -> int:
        return hf_config.n_positions

    def __init__(
        self, hf_model: torch.nn.Module, capacity: int, max_len: int, device: torch.device, use_small_gemm: bool = True
    ) -> None:
        cfg = hf_model.config
        if getattr(cfg, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 option reorder_and_upcast_attn is not supported by the fast engine")
        if cfg.activation_function not in _ACTIVATIONS:
            raise ValueError(f"GPT-2 activation {cfg.activation_function!r} is not supported by the fast engine")
        self.n_layer, self.n_head, self.n_embd = cfg.n_layer, cfg.n_head, cfg.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.eps = cfg.layer_norm_epsilon
        self.gelu_approx = _ACTIVATIONS[cfg.activation_function]
        scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        inverse_layer = getattr(cfg, "scale_attn_by_inverse_layer_idx", False)
        self.attn_scales = [scale / (i + 1) if inverse_layer else scale for i in range(self.n_layer)]
        self.device = device

        sd = {k: v.detach().to(device=device, dtype=torch.float32).contiguous() for k, v in hf_model.state_dict().items()}
        base = "transformer."
        make_linear, self.onednn, self.small_gemm = linear_factory(device, capacity, use_small_gemm)
        self.wte = sd[base + "wte.weight"]  # [V, C]
        self.wpe = sd[base + "wpe.weight"]  # [P, C]
        self.blocks = [Block(sd, f"{base}h.{i}.", make_linear) for i in range(self.n_layer)]
        self.ln_f = (sd[base + "ln_f.weight"], sd[base + "ln_f.bias"])
        self.lm_head = make_linear(sd.get("lm_head.weight", self.wte), None)  # [C] -> [V]
        self.kv = KVCache(self.n_layer, capacity, self.n_head, max_len, self.head_dim, device)
        self._arange = torch.arange(max(capacity, max_len), device=device)  # rows and positions

    def _ln(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.n_embd,), wb[0], wb[1], self.eps)

    def _mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        """x: [N, C] -> x + MLP(LN(x)): [N, C]."""
        return block.mlp_proj.add(block.c_fc.gelu(self._ln(x, block.ln_2), self.gelu_approx), x)

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """x_last: [N, C] final hidden states -> [N, V] logits."""
        return self.lm_head(self._ln(x_last, self.ln_f))

    @torch.inference_mode()
    def forward(
        self, token_ids: list[int], positions: list[int], prompts: list[list[int]] = (), rows: list[int] = ()
    ) -> torch.Tensor:
        """One forward over a mixed batch: decode rows [0, B) (token_ids[b] at positions[b]) and
        prefill whole prompts into cache rows ``rows``. The B decode tokens and the T prompt tokens
        share every linear (one pass over the weights); attention runs per part.

        Returns logits [B + len(prompts), V]: the decode rows, then each prompt's last position.
        """
        batch = MixedBatch.build(token_ids, positions, prompts, rows, self._arange)
        B, H, D = batch.n_decode, self.n_head, self.head_dim
        x = self.wte[batch.ids] + self.wpe[batch.pos]  # [B + T, C]
        N = x.shape[0]
        for layer, block in enumerate(self.blocks):
            qkv = block.c_attn(self._ln(x, block.ln_1)).view(N, 3, H, D)
            att = torch.empty(N, H, D, device=self.device)
            if B:
                att[:B] = self._decode_attention(layer, qkv[:B], batch)
            for start, n, row in batch.prompts:
                q, k, v = qkv[start : start + n].permute(1, 2, 0, 3)  # each [H, n, D]
                self.kv.write_prompt(layer, row, k, v)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.attn_scales[layer])
                att[start : start + n] = out.transpose(0, 1)  # [n, H, D]
            x = block.attn_proj.add(att.view(N, self.n_embd), x)
            x = self._mlp(block, x)
        # Logits only where a token is sampled: the decode rows and each prompt's last position.
        return self._logits(x if batch.sample_rows is None else x[batch.sample_rows])

    def _decode_attention(self, layer: int, qkv: torch.Tensor, batch: MixedBatch) -> torch.Tensor:
        """qkv: [B, 3, H, D] of the decode tokens -> attention output [B, H, D]; K/V written in place first."""
        B = batch.n_decode
        q, k, v = qkv.unbind(1)  # each [B, H, D]
        self.kv.write_step(layer, batch.decode_rows, batch.pos[:B], k, v)
        keys, values = self.kv.view(layer, B, batch.decode_length)  # each [B, H, L, D]: a view, no copy
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=batch.decode_mask, scale=self.attn_scales[layer]
        )  # [B, H, 1, D]
        return out.squeeze(2)  # [B, H, D]
