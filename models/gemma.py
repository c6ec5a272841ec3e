"""Gemma 2 and Gemma 3 (text): RMSNorm with (1 + weight) and four norms per layer (around attention and around the
MLP), a tanh-GELU gated MLP, embeddings scaled by sqrt(hidden), attention scaled by ``query_pre_attn_scalar``^-0.5,
sliding-window layers alternating with global ones (``layer_types``).

Gemma 2 soft-caps the attention scores and the final logits (tanh). Gemma 3 drops the soft-caps (unless its config
sets them), adds q/k RMSNorm per head, takes its 5:1 local/global pattern from the config, and gives the local layers
their own RoPE base (``rope_parameters`` per layer type). llama.cpp's converter stores every Gemma norm as (1 + w)
(``norm_shift``: the reader takes the 1 off again).
"""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, Names, activation, base_spec, sqrt_hidden

GEMMA_NAMES = Names(
    attn_norm="input_layernorm",
    attn_out_norm="post_attention_layernorm",
    ff_norm="pre_feedforward_layernorm",
    ff_out_norm="post_feedforward_layernorm",
)
# ffn_norm is the pre-feed-forward norm; llama.cpp names the output norms post_attention_norm and post_ffw_norm
GEMMA_GGUF_LAYER = {
    **{k: v for k, v in LLAMA_GGUF_LAYER.items() if k not in ("ffn_norm", "ffn_gate_inp")},
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma_spec(cfg, **overrides) -> DecoderSpec:
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("Gemma option use_bidirectional_attention is not supported by the fast engine")
    return base_spec(
        cfg,
        act=activation(cfg, "hidden_activation"),
        norm_offset=1.0,
        embed_scale=sqrt_hidden(cfg),
        attn_scale=cfg.query_pre_attn_scalar**-0.5,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or 0.0,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) or 0.0,
        tied=bool(getattr(cfg, "tie_word_embeddings", True)),
        **overrides,
    )


class Gemma2(Decoder):
    model_type = "gemma2"
    names = GEMMA_NAMES
    gguf = GGUFNames("gemma2", GEMMA_GGUF_LAYER, norm_shift=1.0)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return gemma_spec(cfg)


class Gemma3(Decoder):
    model_type = "gemma3_text"
    names = GEMMA_NAMES
    gguf = GGUFNames("gemma3", GEMMA_GGUF_LAYER, norm_shift=1.0)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return gemma_spec(cfg, qk_norm="head")
