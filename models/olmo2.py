"""OLMo 2: no pre-norm; RMSNorm on the attention and MLP outputs before each residual add, and q/k RMSNorm over the
whole q and k projections (not per head)."""

from __future__ import annotations

from .decoder import Decoder, DecoderSpec, GGUFNames, Names, base_spec

OLMO2_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_post_norm": "post_attention_layernorm",
    "ffn_post_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class Olmo2(Decoder):
    model_type = "olmo2"
    names = Names(
        attn_norm=None,
        ff_norm=None,
        attn_out_norm="post_attention_layernorm",
        ff_out_norm="post_feedforward_layernorm",
    )
    gguf = GGUFNames("olmo2", OLMO2_GGUF_LAYER)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(cfg, qk_norm="full")
