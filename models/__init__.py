"""The torch side of the server: model families, their shared layers, the KV cache, compiled kernels.

Importing this package imports no torch (torch-free modules live here too: ``cache_dir.py``,
``native_memory.py``, ``image.py``, ``native.py``, ``step_layout.py``, ``kv_pool.py``, ``kernels/step_abi.py``);
``families()`` imports the torch modules when a model loads.

    layers.py      what every family shares: Linear (one packed copy per weight), MixedForward (the forward loop)
    step_layout.py StepLayout: one step's rows (decode tokens, then prompt chunks) in numpy, both runtimes' layout
    mixed_batch.py MixedBatch: the torch forward's zero-copy view of a StepLayout
    attention.py   the one mixed-batch attention (GQA; GPT-2 is group size 1), the lean decode path's attention
    state_dict.py  a checkpoint's weights taken over (fp32 copies), its file pages dropped from RSS
    gpt2.py        GPT-2 block math and weight mapping
    decoder.py     the RoPE decoder every other family is: one block over shared pieces (norm kinds, q/k norms, RoPE
                   kinds, attention with window and soft-cap, gated MLP kinds, mixture of experts), configured per
                   family by a ``DecoderSpec``, its HF weight names and its GGUF names
    decoder_spec.py the family as data: ``DecoderSpec`` read from the HF config, ``Names``, ``GGUFNames``
    rope.py        RoPE tables (plain, HF's fixed scalings, partial rotary, per layer type) and their application
    llama.py, mistral.py, qwen2.py, qwen3.py, qwen3_moe.py, gemma.py, phi3.py, olmo2.py, granite.py, mixtral.py,
    olmoe.py       one family each: its spec from the HF config, its weight names (docs/families.md: adding one)
    kv_pool.py     KVPool: the preallocated KV block pool both runtimes use, numpy (``core/block_manager.py`` says who
                   holds what)
    kv_cache.py    PagedKVCache: the torch forward's view of the KV pool (zero-copy on the CPU)
    kernels/       compiled kernels (small_gemm.c, paged_attention.c with the fused RoPE + KV write + attention,
                   decode_ops.c; quant_gemm.c over GGUF blocks, one header per type in quants/) and the loader
    gguf/          torch-free: the GGUF reader, every type's block layout and reference dequantization, names,
                   the metadata -> HF config conversion per llama.cpp architecture
    quant.py       fp32 -> Q8_0/Q4_1, a GGUF file's tensors at a WEIGHTS format (GGUFWeights), fused weights
    gguf_model.py  a GGUF file standing in for an HF module (GGUFModel): its tensors under a family's HF names
    quality.py     perplexity through our own forward (the WEIGHTS formats' quality)
    image.py       the model image: a built model's packed weights in one file (written in a torch child process),
                   cached; ``ensure_image`` is torch-free
    native.py      the torch-free runner: a model image stepped by the whole-step kernel over a KVPool
    cache_dir.py   where checkpoints and built kernels are cached
    native_memory.py  caps oneDNN/ideep per-shape caches before torch loads; trims the heap after prefills
"""

from __future__ import annotations


def families() -> dict[str, type]:
    """HF ``config.model_type`` -> our forward for that family (a ``layers.MixedForward``).

    Each class is built as ``cls(hf_model, capacity, max_len, device, use_small_gemm=..., num_blocks=...,
    block_size=..., weights=...)`` and has ``context_window(hf_config)``. Imports torch.
    """
    from .gemma import Gemma2, Gemma3
    from .gpt2 import GPT2
    from .granite import Granite
    from .llama import Llama
    from .mistral import Mistral
    from .mixtral import Mixtral
    from .olmo2 import Olmo2
    from .olmoe import Olmoe
    from .phi3 import Phi3
    from .qwen2 import Qwen2
    from .qwen3 import Qwen3
    from .qwen3_moe import Qwen3Moe

    classes = (GPT2, Llama, Mistral, Qwen2, Qwen3, Qwen3Moe, Gemma2, Gemma3, Phi3, Olmo2, Granite, Mixtral, Olmoe)
    return {cls.model_type: cls for cls in classes}
