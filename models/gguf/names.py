"""GGUF tensor names -> Hugging Face names, per architecture, and the row order llama.cpp's converter changes.

llama.cpp's ``convert_hf_to_gguf.py`` renames every tensor (``model.layers.3.self_attn.q_proj.weight`` ->
``blk.3.attn_q.weight``) and, for Llama, permutes the rows of Q and K (each head's rotary halves interleaved);
``hf_name`` and ``llama_qk_rows`` undo both. Torch-free.
"""

from __future__ import annotations

import numpy as np

LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GPT2_BLOCK = {
    "attn_norm": "ln_1",
    "ffn_norm": "ln_2",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
GPT2_TOP = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # HF stores these [in, out]

ARCHITECTURES = {  # model_type -> (per-block names, top-level names, HF prefix of the blocks)
    "llama": (LLAMA_BLOCK, LLAMA_TOP, "model.layers"),
    "gpt2": (GPT2_BLOCK, GPT2_TOP, "transformer.h"),
}


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: a tensor HF has no use for)."""
    block, top, prefix = ARCHITECTURES[model_type]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in block:
        return f"{prefix}.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in top:
        return f"{top[parts[0]]}.{parts[1]}"
    return None  # e.g. rope_freqs.weight: the HF config carries the RoPE settings


def llama_qk_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K permutation (rotary halves interleaved per head).

    GGUF row (h, a, b) (b in {0, 1} interleaved pairs) holds HF row (h, b, a); HF weight = gguf[rows].
    """
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).transpose(0, 2, 1).reshape(-1)
