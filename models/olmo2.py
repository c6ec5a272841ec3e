"""OLMo 2: no pre-norm; RMSNorm on the attention and MLP outputs before each residual add, and q/k RMSNorm over the
whole q and k projections (not per head)."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, Names, base_spec

# no pre-norms; llama.cpp names the output norms post_attention_norm and post_ffw_norm
OLMO2_GGUF_LAYER = {
    **{k: v for k, v in LLAMA_GGUF_LAYER.items() if k not in ("attn_norm", "ffn_norm", "ffn_gate_inp")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
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
