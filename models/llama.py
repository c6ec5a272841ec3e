"""Llama family: block math and weight mapping; the forward loop and attention are ``layers.py``'s.

The weights come from a loaded Hugging Face ``LlamaForCausalLM``; the math is the same as HF's
(pre-RMSNorm blocks, rotary position embeddings, grouped-query attention, SwiGLU MLP, tied or
untied lm_head), so greedy tokens match ``generate(do_sample=False)`` (the parity tests guard
this). Q, K and V come from one fused linear, gate and up from another. The KV cache stores only
the K/V heads (``KVCache.n_head = KVH``); ``layers.mixed_attention`` reads query head ``h`` against
K/V head ``h // G`` without expanding them. The RoPE cos/sin tables are computed once for
``max_len`` positions; a forward gathers its tokens' rows once and every layer reuses them.

Shapes: N = tokens of the mixed batch, C = hidden_size, H = query heads, KVH = K/V heads,
G = H / KVH, D = head_dim, I = intermediate_size, V = vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import kv_dtype
from .kernels import decode_ops
from .kernels.decode_step import StepPlan
from .layers import (
    Linear,
    MixedBatch,
    MixedForward,
    embed_rows,
    embedding_table,
    fp32_state_dict,
    lean_attention,
    linear_factory,
    mixed_attention,
    packed_blocks,
    release_file_pages,
)
from .quant import cat_rows

log = logging.getLogger("minibatch.llama")

# RoPE types whose frequencies are fixed at load time (HF recomputes "dynamic" and "longrope"
# per forward from the sequence length, which a precomputed table cannot follow).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(cfg) -> dict:
    """The config's RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``rope_parameters``; older configs have ``rope_theta``
    plus an optional ``rope_scaling`` dict (whose type key was ``type`` or ``rope_type``).
    """
    params = getattr(cfg, "rope_parameters", None)
    if not params:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def rope_tables(cfg, head_dim: int, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for positions [0, max_len): each [max_len, 1, D], computed exactly as HF does."""
    params = rope_parameters(cfg)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported by the fast engine; supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("RoPE with partial_rotary_factor != 1 is not supported by the fast engine")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [D/2]
        scaling = 1.0
    else:  # the scaled types: HF's own init function, so the frequencies are HF's exactly
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    freqs = torch.arange(max_len).float()[:, None] * inv_freq.float()[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos[:, None, :].to(device), sin[:, None, :].to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, h, D] rotated by its positions' cos, sin: [N, 1, D] -> [N, h, D]."""
    x1, x2 = x.chunk(2, dim=-1)  # each [N, h, D/2]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block:
    """One decoder layer's weights: fused QKV and gate+up linears, RMSNorm weights."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str, make_linear: Callable[..., Linear]) -> None:
        def fused(names: list[str]) -> Linear:
            weights = [sd[f"{prefix}{n}.weight"] for n in names]  # each [out_i, C], fp32 or a QuantWeight
            biases = [sd.get(f"{prefix}{n}.bias") for n in names]
            bias = torch.cat(biases) if biases[0] is not None else None
            weight, note = cat_rows(weights)  # one [sum out_i, C] weight in one format
            if note:
                log.info("%s%s: %s", prefix, "+".join(names), note)
            return make_linear(weight, bias)

        self.ln_1 = sd[f"{prefix}input_layernorm.weight"]  # [C]
        self.ln_2 = sd[f"{prefix}post_attention_layernorm.weight"]  # [C]
        self.qkv = fused(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])  # [C] -> [(H + 2 KVH) D]
        self.o_proj = fused(["self_attn.o_proj"])  # [H D] -> [C]
        self.gate_up = fused(["mlp.gate_proj", "mlp.up_proj"])  # [C] -> [2I]
        self.down = fused(["mlp.down_proj"])  # [I] -> [C]

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o_proj, self.gate_up, self.down]


class Llama(MixedForward):
    """Llama weights plus the KV cache."""

    model_type = "llama"

    @staticmethod
    def context_window(hf_config) -> int:
        return hf_config.max_position_embeddings

    @staticmethod
    def kv_bytes_per_token(hf_config, kv_cache_dtype: str = "fp32") -> int:
        """K and V of one token over every layer in a pool of ``kv_cache_dtype`` (what one KV slot costs)."""
        n_head = hf_config.num_attention_heads
        n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_head
        return kv_dtype.bytes_per_token(kv_cache_dtype, hf_config.num_hidden_layers, n_kv_head, head_dim)

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
        if cfg.hidden_act != "silu":
            raise ValueError(f"Llama activation {cfg.hidden_act!r} is not supported by the fast engine (only silu)")
        self.n_layer, self.n_embd = cfg.num_hidden_layers, cfg.hidden_size
        self.n_head = cfg.num_attention_heads
        self.n_kv_head = getattr(cfg, "num_key_value_heads", None) or self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.n_head} attention heads do not group over {self.n_kv_head} key/value heads")
        self.head_dim = getattr(cfg, "head_dim", None) or self.n_embd // self.n_head
        self.scale = self.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.device = device
        self.cos, self.sin = rope_tables(cfg, self.head_dim, max_len, device)  # each [max_len, 1, D]

        sd = fp32_state_dict(hf_model, device)
        make_linear, self.onednn, self.small_gemm = linear_factory(device, capacity, use_small_gemm, weights)
        self.embed = embedding_table(sd["model.embed_tokens.weight"], weights)  # [V, C]
        prefixes = [f"model.layers.{i}." for i in range(self.n_layer)]
        self.blocks = packed_blocks(sd, prefixes, lambda prefix: Block(sd, prefix, make_linear))
        self.norm = sd["model.norm.weight"]  # [C]
        tied = getattr(cfg, "tie_word_embeddings", False) or "lm_head.weight" not in sd
        self.lm_head = make_linear(self.embed if tied else sd["lm_head.weight"], None, table=tied)  # [C] -> [V]
        self.embed = self.lm_head.table() if tied else self.embed  # tied: the lm_head's one copy serves the lookups
        release_file_pages(sd.values())  # the embedding and lm_head tables, packed now
        num_blocks = num_blocks or capacity * -(-max_len // block_size)
        self._init_cache(self.n_layer, self.n_kv_head, self.head_dim, device, num_blocks, block_size, kv_cache_dtype)

    def _fused_plan(self) -> StepPlan | None:
        """Every layer of a lean step in one call: RMSNorm (no bias), RoPE from the full tables, SiLU(gate) * up."""
        if not StepPlan.supports(self.linears()):
            return None
        layers = [
            ((b.ln_1, None), (b.ln_2, None), b.qkv, b.o_proj, b.gate_up, b.down, self.layer_pools[i], self.scale)
            for i, b in enumerate(self.blocks)
        ]
        dims = {"C": self.n_embd, "H": self.n_head, "KVH": self.n_kv_head, "D": self.head_dim}
        rope = (self.cos, self.sin)
        return StepPlan(
            gelu=False,
            dims=dims,
            eps=self.eps,
            embed=(self.embed, None),
            rope=rope,
            layers=layers,
            final_norm=(self.norm, None),
            lm_head=self.lm_head,
        )

    def _rms(self, x: torch.Tensor, weight: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """x: [N, C] -> weight * x / rms(x): [N, C] (one compiled call on a lean step)."""
        if lean:
            return decode_ops.rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (self.n_embd,), weight, self.eps)

    def _embed(self, batch: MixedBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Token embeddings [N, C], and the RoPE cos, sin of the tokens' positions (each [N, 1, D]); a lean
        step's kernel reads the whole tables at the positions itself."""
        rope = (self.cos, self.sin) if batch.lean else (self.cos[batch.pos], self.sin[batch.pos])
        return embed_rows(self.embed, batch.ids), rope

    def embedding_tables(self) -> list:
        return [self.embed]

    def _block(self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch, rope) -> torch.Tensor:
        """x: [N, C] -> x + attn(RMSNorm(x)), then + down(silu(gate) * up) of RMSNorm(.): [N, C]."""
        if batch.lean:
            return self._lean_block(layer, block, x, batch, rope)
        N, H, KVH, D = x.shape[0], self.n_head, self.n_kv_head, self.head_dim
        qkv = block.qkv(self._rms(x, block.ln_1))  # [N, (H + 2 KVH) D]
        qk = apply_rope(qkv[:, : (H + KVH) * D].view(N, H + KVH, D), *rope)  # [N, H + KVH, D]: q and k rotated at once
        v = qkv[:, (H + KVH) * D :].view(N, KVH, D)
        att = mixed_attention(qk[:, :H], qk[:, H:], v, self.kv, layer, batch, self.scale)  # [N, H, D]
        x = block.o_proj.add(att.view(N, H * D), x)
        gate, up = block.gate_up(self._rms(x, block.ln_2)).chunk(2, dim=-1)  # each [N, I]
        return block.down.add(F.silu(gate) * up, x)

    def _lean_block(self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch, rope) -> torch.Tensor:
        """``_block`` for a lean decode step (B rows, no prompts): eight compiled calls, the same math.

        rope: the full cos, sin tables [max_len, 1, D]; ``lean_attention`` rotates at each row's position.
        """
        qkv = block.qkv(self._rms(x, block.ln_1, lean=True))  # [B, (H + 2 KVH) D]
        att = lean_attention(qkv, self.n_head, rope, self.layer_pools[layer], batch, self.scale)  # [B, H D]
        x = block.o_proj.add(att, x)
        act = decode_ops.silu_mul(block.gate_up(self._rms(x, block.ln_2, lean=True)))  # [B, I]
        return block.down.add(act, x)

    def _logits(self, x_last: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """x_last: [n, C] final hidden states -> [n, V] logits."""
        return self.lm_head(self._rms(x_last, self.norm, lean))
