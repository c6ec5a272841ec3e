"""GPT-2: block math and weight mapping (nanoGPT-style); the forward loop and attention are ``layers.py``'s.

The weights come from a loaded Hugging Face ``GPT2LMHeadModel``; the math is the same as HF's
(pre-LayerNorm blocks, fused QKV, tanh-GELU MLP, tied lm_head), so greedy tokens match
``generate(do_sample=False)`` exactly (the parity tests guard this). Attention is the
group-size-1 case of ``attention.mixed_attention``.

Shapes: N = tokens of the mixed batch, C = n_embd, H = n_head, D = C / H, V = vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import kv_dtype
from .attention import lean_attention, mixed_attention
from .kernels import decode_ops, step_abi
from .kernels.decode_step import StepPlan, layer_spec
from .kernels.quant_gemm import QuantWeight, dequantize
from .layers import Linear, MixedForward, embed_rows, embedding_table, linear_factory
from .mixed_batch import MixedBatch
from .state_dict import fp32_state_dict, packed_blocks, release_file_pages

# HF activation_function name -> oneDNN post-op algorithm for GELU.
_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


class Block:
    """One transformer block's weights (Conv1D weights transposed to [out, in]; a QuantWeight is [out, in] already)."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str, make_linear: Callable[..., Linear]) -> None:
        self.modules: dict[str, tuple[str, int]] = {}  # HF module -> (path, outputs): LoRA

        def lin(name: str) -> Linear:
            w = sd[f"{prefix}{name}.weight"]
            self.modules[name] = (f"{prefix}{name}", w.shape[0] if isinstance(w, QuantWeight) else w.shape[1])
            return make_linear(w if isinstance(w, QuantWeight) else w.t().contiguous(), sd[f"{prefix}{name}.bias"])

        self.ln_1 = (sd[f"{prefix}ln_1.weight"], sd[f"{prefix}ln_1.bias"])
        self.ln_2 = (sd[f"{prefix}ln_2.weight"], sd[f"{prefix}ln_2.bias"])
        self.c_attn = lin("attn.c_attn")  # [C] -> [3C]
        self.attn_proj = lin("attn.c_proj")  # [C] -> [C]
        self.c_fc = lin("mlp.c_fc")  # [C] -> [4C]
        self.mlp_proj = lin("mlp.c_proj")  # [4C] -> [C]

    def linears(self) -> list[Linear]:
        return [self.c_attn, self.attn_proj, self.c_fc, self.mlp_proj]

    def lora_linears(self) -> dict[str, tuple[Linear, list[tuple[str, int]]]]:
        """The linears adapters may target by kind (``lora.KINDS``), each with its HF module (c_attn: q, k, v)."""
        names = {"qkv": "attn.c_attn", "o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}
        return {kind: (lin, [self.modules[names[kind]]]) for kind, lin in zip(names, self.linears())}


class GPT2(MixedForward):
    """GPT-2 weights plus the KV cache."""

    model_type = "gpt2"

    @staticmethod
    def context_window(hf_config) -> int:
        return hf_config.n_positions

    @staticmethod
    def kv_bytes_per_token(hf_config, kv_cache_dtype: str = "fp32") -> int:
        """K and V of one token over every layer in a pool of ``kv_cache_dtype`` (what one KV slot costs)."""
        head_dim = hf_config.n_embd // hf_config.n_head
        return kv_dtype.bytes_per_token(kv_cache_dtype, hf_config.n_layer, hf_config.n_head, head_dim)

    def __init__(
        self,
        hf_model: torch.nn.Module,
        capacity: int,
        max_len: int,
        device: torch.device,
        use_small_gemm: bool = True,
        num_blocks: int = 0,
        block_size: int = 32,
        weights: str = "fp32",
        kv_cache_dtype: str = "fp32",
    ) -> None:
        """``num_blocks`` KV blocks of ``block_size`` tokens (0: enough for ``capacity`` x ``max_len``) of
        ``kv_cache_dtype`` elements."""
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

        sd = fp32_state_dict(hf_model, device)
        base = "transformer."
        make_linear, self.onednn, self.small_gemm = linear_factory(device, capacity, use_small_gemm, weights)
        self.wte = embedding_table(sd[base + "wte.weight"], weights)  # [V, C]
        wpe = sd[base + "wpe.weight"]  # [P, C]; a GGUF's F16 position table is looked up in fp32
        self.wpe = dequantize(wpe) if isinstance(wpe, QuantWeight) else wpe
        prefixes = [f"{base}h.{i}." for i in range(self.n_layer)]
        self.blocks = packed_blocks(sd, prefixes, lambda prefix: Block(sd, prefix, make_linear))
        self.ln_f = (sd[base + "ln_f.weight"], sd[base + "ln_f.bias"])
        tied = getattr(cfg, "tie_word_embeddings", True) or "lm_head.weight" not in sd
        self.lm_head = make_linear(self.wte if tied else sd["lm_head.weight"], None, table=tied)  # [C] -> [V]
        self.wte = self.lm_head.table() if tied else self.wte  # tied: the lm_head's one copy serves the lookups
        release_file_pages(sd.values())  # the embedding and lm_head tables, packed now
        num_blocks = num_blocks or capacity * -(-max_len // block_size)
        self._init_cache(self.n_layer, self.n_head, self.head_dim, device, num_blocks, block_size, kv_cache_dtype)

    def _fused_plan(self) -> StepPlan | None:
        """Every layer of a lean step in one call: LayerNorm, no RoPE, GELU (tanh only: the kernel has no erf GELU)."""
        if self.gelu_approx != "tanh" or not StepPlan.supports(self.linears()):
            return None
        layers = [
            layer_spec(b.ln_1, b.ln_2, b.c_attn, b.attn_proj, b.c_fc, b.mlp_proj, self.attn_scales[i])
            for i, b in enumerate(self.blocks)
        ]
        dims = {"C": self.n_embd, "H": self.n_head, "KVH": self.n_head, "D": self.head_dim}
        return StepPlan(
            act=step_abi.ACT_GELU,
            dims=dims,
            eps=self.eps,
            embed=(self.wte, self.wpe),
            rope=None,
            layers=layers,
            pools=self.layer_pools,
            final_norm=self.ln_f,
            lm_head=self.lm_head,
        )

    def _ln(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor], lean: bool = False) -> torch.Tensor:
        """x: [N, C] -> LayerNorm(x): [N, C] (one compiled call on a lean step)."""
        if lean:
            return decode_ops.layer_norm(x, wb[0], wb[1], self.eps)
        return F.layer_norm(x, (self.n_embd,), wb[0], wb[1], self.eps)

    def _embed(self, batch: MixedBatch) -> tuple[torch.Tensor, None]:
        """Token plus learned position embeddings: [N, C]; the blocks need no positional state."""
        return embed_rows(self.wte, batch.ids) + self.wpe[batch.pos], None

    def embedding_tables(self) -> list:
        return [self.wte, self.wpe]

    def _block(self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch, pos_state: None) -> torch.Tensor:
        """x: [N, C] -> x + attn(LN(x)), then + MLP(LN(.)): [N, C]."""
        if batch.lean:
            return self._lean_block(layer, block, x, batch)
        N, H, D = x.shape[0], self.n_head, self.head_dim
        q, k, v = block.c_attn(self._ln(x, block.ln_1)).view(N, 3, H, D).unbind(1)  # each [N, H, D]
        att = mixed_attention(q, k, v, self.kv, layer, batch, self.attn_scales[layer])  # [N, H, D]
        x = block.attn_proj.add(att.view(N, self.n_embd), x)
        return block.mlp_proj.add(block.c_fc.gelu(self._ln(x, block.ln_2), self.gelu_approx), x)

    def _lean_block(self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch) -> torch.Tensor:
        """``_block`` for a lean decode step (B rows, no prompts): the same math in a few compiled calls."""
        qkv = block.c_attn(self._ln(x, block.ln_1, lean=True))  # [B, 3C]: q, k, v heads back to back
        pools, scale = self.layer_pools[layer], self.attn_scales[layer]
        att = lean_attention(qkv, self.n_head, None, pools, batch, scale)  # [B, C]
        x = block.attn_proj.add(att, x)
        h = self._ln(x, block.ln_2, lean=True)
        # The tanh GELU compiled too (the whole-step kernel's, so both lean paths give the same bits).
        h = decode_ops.gelu_tanh(block.c_fc(h)) if self.gelu_approx == "tanh" else block.c_fc.gelu(h, "none")
        return block.mlp_proj.add(h, x)

    def _final_norm(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        return self._ln(x, self.ln_f, lean)

    def _logits(self, x_last: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """x_last: [n, C] final hidden states -> [n, V] logits."""
        return self.lm_head(self._final_norm(x_last, lean))
