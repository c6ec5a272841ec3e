"""Mixtral: Mistral's attention (a sliding window on every layer, when set) over a mixture of experts whose top
``num_experts_per_tok`` router weights are always renormalized. In a GGUF file it is llama.cpp's ``llama``
architecture with expert tensors."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, MOE_GGUF_EXPERTS, DecoderSpec, GGUFNames, base_spec, moe_spec


class Mixtral(Decoder):
    model_type = "mixtral"
    gguf = GGUFNames("llama", LLAMA_GGUF_LAYER, permuted_qk=True, experts=MOE_GGUF_EXPERTS)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(cfg, moe=moe_spec(cfg, cfg.num_local_experts, True, cfg.intermediate_size))
