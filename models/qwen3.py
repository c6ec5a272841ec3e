"""Qwen3: Llama with RMSNorm per head on q and k before RoPE, an explicit ``head_dim`` (not hidden / heads), no qkv
bias; sliding windows where ``layer_types`` marks them."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, base_spec


class Qwen3(Decoder):
    model_type = "qwen3"
    gguf = GGUFNames("qwen3", LLAMA_GGUF_LAYER)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(cfg, qk_norm="head")
