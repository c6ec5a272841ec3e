"""A hand-written Llama-family forward over the preallocated KV cache (nanoGPT-style, one file).

The weights come from a loaded Hugging Face ``LlamaForCausalLM``; the math is the same as
HF's (pre-RMSNorm blocks, rotary position embeddings, grouped-query attention, SwiGLU MLP,
tied or untied lm_head), so greedy tokens match ``generate(do_sample=False)`` (the parity
tests in ``tests/test_llama.py`` guard this). Same interface and speed rules as ``gpt2.GPT2``:

- ``prefill``: several prompts packed into one ``[T, C]`` activation (no padding); the
  linears run once over all T tokens, attention runs per prompt, and each prompt's K/V
  lands in its own cache row. Logits only for each prompt's last token.
- ``decode``: one token for each of the rows ``[0, B)``; K/V written in place at each
  row's own position, attention over a view of the cache, masked per row length.

Grouped-query attention stores only the K/V heads in the cache (``KVCache.n_head = KVH``).
Decode attends without expanding them: query head ``h`` uses K/V head ``h // G``, so the
queries are viewed as ``[B, KVH, G, D]`` -- G queries against one K/V head -- which is the
same attention with no copy of the cache. Q, K and V come from one fused linear, gate and up
from another; on CPU every linear is pre-packed (``gpt2.Linear``: oneDNN, and the compiled
small-batch kernel for decode steps). The RoPE cos/sin
tables are computed once for ``max_len`` positions.

Shapes: C = hidden_size, H = query heads, KVH = K/V heads, G = H / KVH, D = head_dim,
I = intermediate_size, V = vocab, L = positions attended.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from gpt2 import Linear, MixedBatch, MixedForward, linear_factory
from kv_cache import KVCache

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
            weights = [sd[f"{prefix}{n}.weight"] for n in names]  # each [out_i, C]
            biases = [sd.get(f"{prefix}{n}.bias") for n in names]
            bias = torch.cat(biases) if biases[0] is not None else None
            return make_linear(torch.cat(weights).contiguous(), bias)

        self.ln_1 = sd[f"{prefix}input_layernorm.weight"]  # [C]
        self.ln_2 = sd[f"{prefix}post_attention_layernorm.weight"]  # [C]
        self.qkv = fused(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])  # [C] -> [(H + 2 KVH) D]
        self.o_proj = fused(["self_attn.o_proj"])  # [H D] -> [C]
        self.gate_up = fused(["mlp.gate_proj", "mlp.up_proj"])  # [C] -> [2I]
        self.down = fused(["mlp.down_proj"])  # [I] -> [C]


class Llama(MixedForward):
    """Llama weights plus the KV cache, with ``prefill`` and ``decode`` steps that return logits."""

    @staticmethod
    def context_window(hf_config) -> int:
        return hf_config.max_position_embeddings

    def __init__(
        self, hf_model: torch.nn.Module, capacity: int, max_len: int, device: torch.device, use_small_gemm: bool = True
    ) -> None:
        cfg = hf_model.config
        if cfg.hidden_act != "silu":
            raise ValueError(f"Llama activation {cfg.hidden_act!r} is not supported by the fast engine (only silu)")
        self.n_layer, self.n_embd = cfg.num_hidden_layers, cfg.hidden_size
        self.n_head = cfg.num_attention_heads
        self.n_kv_head = getattr(cfg, "num_key_value_heads", None) or self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.n_head} attention heads do not group over {self.n_kv_head} key/value heads")
        self.group = self.n_head // self.n_kv_head
        self.head_dim = getattr(cfg, "head_dim", None) or self.n_embd // self.n_head
        self.scale = self.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.device = device
        self.cos, self.sin = rope_tables(cfg, self.head_dim, max_len, device)  # each [max_len, 1, D]

        sd = {k: v.detach().to(device=device, dtype=torch.float32).contiguous() for k, v in hf_model.state_dict().items()}
        make_linear, self.onednn, self.small_gemm = linear_factory(device, capacity, use_small_gemm)
        self.embed = sd["model.embed_tokens.weight"]  # [V, C]
        self.blocks = [Block(sd, f"model.layers.{i}.", make_linear) for i in range(self.n_layer)]
        self.norm = sd["model.norm.weight"]  # [C]
        tied = getattr(cfg, "tie_word_embeddings", False) or "lm_head.weight" not in sd
        self.lm_head = make_linear(self.embed if tied else sd["lm_head.weight"], None)  # [C] -> [V]
        self.kv = KVCache(self.n_layer, capacity, self.n_kv_head, max_len, self.head_dim, device)
        self._arange = torch.arange(max(capacity, max_len), device=device)  # rows and positions

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [N, C] -> weight * x / rms(x): [N, C]."""
        return F.rms_norm(x, (self.n_embd,), weight, self.eps)

    def _qkv(self, block: Block, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """x: [N, C], rope: cos, sin [N, 1, D] of its positions -> rotated q: [N, H, D], rotated k, v: [N, KVH, D]."""
        N, H, KVH, D = x.shape[0], self.n_head, self.n_kv_head, self.head_dim
        qkv = block.qkv(self._rms(x, block.ln_1))  # [N, (H + 2 KVH) D]
        qk = apply_rope(qkv[:, : (H + KVH) * D].view(N, H + KVH, D), *rope)  # [N, H + KVH, D]: q and k rotated at once
        v = qkv[:, (H + KVH) * D :].view(N, KVH, D)
        return qk[:, :H], qk[:, H:], v

    def _mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        """x: [N, C] -> x + down(silu(gate(h)) * up(h)) with h = RMSNorm(x): [N, C]."""
        gate, up = block.gate_up(self._rms(x, block.ln_2)).chunk(2, dim=-1)  # each [N, I]
        return block.down.add(F.silu(gate) * up, x)

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """x_last: [N, C] final hidden states -> [N, V] logits."""
        return self.lm_head(self._rms(x_last, self.norm))

    @torch.inference_mode()
    def forward(
        self, token_ids: list[int], positions: list[int], prompts: list[list[int]] = (), rows: list[int] = ()
    ) -> torch.Tensor:
        """One forward over a mixed batch: decode rows [0, B) (token_ids[b] at positions[b]) and
        prefill whole prompts into cache rows ``rows``; the linears see all B + T tokens at once.

        Returns logits [B + len(prompts), V]: the decode rows, then each prompt's last position.
        """
        batch = MixedBatch.build(token_ids, positions, prompts, rows, self._arange)
        B, H, D = batch.n_decode, self.n_head, self.head_dim
        x = self.embed[batch.ids]  # [B + T, C]
        N = x.shape[0]
        rope = self.cos[batch.pos], self.sin[batch.pos]  # each [B + T, 1, D]
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, x, rope)  # [N, H, D], [N, KVH, D], [N, KVH, D]
            att = torch.empty(N, H, D, device=self.device)
            if B:
                att[:B] = self._decode_attention(layer, q[:B], k[:B], v[:B], batch)
            for start, n, row in batch.prompts:
                span = slice(start, start + n)
                qp, kp, vp = q[span].transpose(0, 1), k[span].transpose(0, 1), v[span].transpose(0, 1)  # [h, n, D]
                self.kv.write_prompt(layer, row, kp, vp)
                out = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=self.group > 1
                )  # [H, n, D]
                att[span] = out.transpose(0, 1)  # [n, H, D]
            x = block.o_proj.add(att.view(N, H * D), x)
            x = self._mlp(block, x)
        # Logits only where a token is sampled: the decode rows and each prompt's last position.
        return self._logits(x if batch.sample_rows is None else x[batch.sample_rows])

    def _decode_attention(self, layer: int, q, k, v, batch: MixedBatch) -> torch.Tensor:
        """q: [B, H, D], k, v: [B, KVH, D] of the decode tokens -> attention output [B, H, D].

        K/V are written in place first; query head h = kv * G + g reads K/V head kv, so the
        queries are viewed as [B, KVH, G, D] against the cache view [B, KVH, L, D]: no copy.
        """
        B, KVH, G, D = batch.n_decode, self.n_kv_head, self.group, self.head_dim
        self.kv.write_step(layer, batch.decode_rows, batch.pos[:B], k, v)
        keys, values = self.kv.view(layer, B, batch.decode_length)  # each [B, KVH, L, D]
        out = F.scaled_dot_product_attention(
            q.reshape(B, KVH, G, D), keys, values, attn_mask=batch.decode_mask, scale=self.scale
        )  # [B, KVH, G, D]
        return out.view(B, self.n_head, D)
