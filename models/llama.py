"""Llama: the plain RoPE decoder (pre-RMSNorm blocks, grouped-query attention, SwiGLU MLP, tied or untied lm_head).

Its block math is ``decoder.Decoder``'s with nothing switched on: Q, K and V come from one fused linear (with the
biases of ``attention_bias`` / ``mlp_bias`` where the checkpoint has them), gate and up from another; RoPE is plain or
one of HF's fixed-frequency scalings (``rope.py``). The KV cache stores only the K/V heads;
``attention.mixed_attention`` reads query head ``h`` against K/V head ``h // G`` without expanding them. Greedy
tokens match HF's ``generate(do_sample=False)`` (the parity tests guard this).
"""

from __future__ import annotations

from .decoder import Decoder
from .decoder_spec import LLAMA_GGUF_LAYER, DecoderSpec, GGUFNames, base_spec


class Llama(Decoder):
    model_type = "llama"
    gguf = GGUFNames("llama", LLAMA_GGUF_LAYER, permuted_qk=True)

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        spec = base_spec(cfg)
        if spec.act != "silu":
            raise ValueError(f"Llama activation {cfg.hidden_act!r} is not supported by the fast engine (only silu)")
        return spec
