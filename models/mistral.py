"""Mistral: Llama with a sliding window on every layer (``sliding_window`` keys; None: full attention).

In a GGUF file it is llama.cpp's ``llama`` architecture (Q/K permuted like Llama's).
"""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, base_spec


class Mistral(Decoder):
    model_type = "mistral"
    gguf = GGUFNames("llama", LLAMA_GGUF_LAYER, permuted_qk=True)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        return base_spec(cfg)  # layer_windows: one sliding_window for every layer
