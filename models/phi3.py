"""Phi-3: Llama with fused ``qkv_proj`` and ``gate_up_proj`` weights, partial rotary (``partial_rotary_factor``) and
an optional sliding window on every layer. Its ``longrope`` scaling (the 128k models) switches frequencies with the
sequence length, which a precomputed table cannot follow: it fails at startup naming it."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import DecoderSpec, GGUFNames, Names, base_spec

PHI3_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # llama.cpp keeps the fused gate+up under ffn_up
    "ffn_down": "mlp.down_proj",
}


class Phi3(Decoder):
    model_type = "phi3"
    names = Names(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))
    gguf = GGUFNames("phi3", PHI3_GGUF_LAYER)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(cfg)
