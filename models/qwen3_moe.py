"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) over a mixture-of-experts MLP: a softmax router, the top
``num_experts_per_tok`` of ``num_experts`` experts per token, renormalized when ``norm_topk_prob``. Layers in
``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, MOE_GGUF_EXPERTS, DecoderSpec, GGUFNames, base_spec, moe_spec


class Qwen3Moe(Decoder):
    model_type = "qwen3_moe"
    gguf = GGUFNames("qwen3moe", LLAMA_GGUF_LAYER, experts=MOE_GGUF_EXPERTS)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        moe = moe_spec(cfg, cfg.num_experts, cfg.norm_topk_prob, cfg.moe_intermediate_size)
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        layers = tuple(
            i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)
        )
        return base_spec(cfg, qk_norm="head", moe=moe if any(layers) else None, moe_layers=layers)
