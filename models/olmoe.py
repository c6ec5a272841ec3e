"""OLMoE: pre-norm blocks with q/k RMSNorm over the whole q and k projections, an optional ``clip_qkv``, and a
mixture of experts (top ``num_experts_per_tok``, renormalized when ``norm_topk_prob``) on every layer."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, MOE_GGUF_EXPERTS, DecoderSpec, GGUFNames, base_spec, moe_spec


class Olmoe(Decoder):
    model_type = "olmoe"
    gguf = GGUFNames("olmoe", LLAMA_GGUF_LAYER, experts=MOE_GGUF_EXPERTS)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        moe = moe_spec(cfg, cfg.num_experts, cfg.norm_topk_prob, cfg.intermediate_size)
        return base_spec(cfg, qk_norm="full", clip_qkv=getattr(cfg, "clip_qkv", None), moe=moe)
