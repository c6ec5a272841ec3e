"""Granite: Llama with four multipliers: ``embedding_multiplier`` on the embeddings, ``attention_multiplier`` as the
attention scale, ``residual_multiplier`` on each block output before its residual add, and the logits divided by
``logits_scaling``."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, base_spec


class Granite(Decoder):
    model_type = "granite"
    gguf = GGUFNames("granite", LLAMA_GGUF_LAYER, permuted_qk=True)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(
            cfg,
            embed_scale=cfg.embedding_multiplier,
            attn_scale=cfg.attention_multiplier,
            residual_scale=cfg.residual_multiplier,
            logits_divisor=cfg.logits_scaling,
        )
