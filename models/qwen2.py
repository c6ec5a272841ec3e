"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections; sliding windows on the layers ``layer_types``
marks (``use_sliding_window``, from ``max_window_layers`` on), off in the released checkpoints."""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, base_spec


class Qwen2(Decoder):
    model_type = "qwen2"
    gguf = GGUFNames("qwen2", LLAMA_GGUF_LAYER)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(cfg)  # the q/k/v biases are in the checkpoint: the fused QKV linear takes them
