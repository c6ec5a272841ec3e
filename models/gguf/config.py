"""A GGUF file's metadata -> the Hugging Face config of the model it holds (a plain dict), per llama.cpp
architecture; torch-free, transformers-free.

llama.cpp writes a model's shape under ``<arch>.<key>`` (``qwen3.block_count``, ``gemma3.attention.sliding_window``)
and leaves out what its own code hard-codes per architecture (Gemma's local/global pattern, Gemma's attention scale,
whether OLMoE renormalizes its top-k). Each function below reads the keys llama.cpp reads for that architecture and
fills in what llama.cpp assumes, so the config describes the math llama.cpp runs on the file: the file's model as
its users get it from llama.cpp.

    general.architecture   model_type          notes
    llama                  llama / mixtral     mixtral when the file has experts (expert_count); Mistral is llama
                                               (the converter writes no window for it, llama.cpp runs none; a
                                               window a file does state is honoured: mistral)
    qwen2                  qwen2               no sliding window (the converter writes none)
    qwen3                  qwen3
    qwen3moe               qwen3_moe           every layer a mixture of experts, top-k renormalized
    gemma2                 gemma2              soft-caps 50 / 30 unless stated; local/global every other layer
    gemma3                 gemma3_text         local:global 5:1 unless stated; the local layers' own RoPE base
    phi3                   phi3                partial rotary from rope.dimension_count; its window as stated
    olmo2                  olmo2
    olmoe                  olmoe               top-k not renormalized
    granite                granite             the four multipliers

Anything a file states that the served model would not honour (a RoPE scaling type, per-layer head counts, a value
length other than the key length) raises ValueError naming the key or tensor; ``ARCHITECTURES`` lists what is
served. Llama 3.1's RoPE scaling, which the converter writes as a tensor of frequency divisors
(``rope_freqs.weight``), is carried in the config (``rope_parameters["freq_factors"]``, ``rope.py`` divides by them
as llama.cpp does).
"""

from __future__ import annotations

from collections.abc import Callable

ROPE_FACTORS = "rope_freqs.weight:values"  # where file_config passes the frequency factors' values to hf_config
CONFIG_TENSORS = ("rope_freqs.weight",)  # tensors the config carries (no weight of the model)


class _Keys:
    """``<arch>.<name>`` lookups in a GGUF's metadata; a missing required key raises ValueError naming it."""

    def __init__(self, metadata: dict, arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def __call__(self, name: str):
        key = f"{self.arch}.{name}"
        if key not in self.metadata:
            raise ValueError(f"GGUF key {key} is missing (a {self.arch} file needs it)")
        return self.metadata[key]

    def get(self, name: str, default=None):
        return self.metadata.get(f"{self.arch}.{name}", default)

    def one(self, name: str, default=None) -> int | None:
        """A per-model count that llama.cpp allows per layer (an array): one value, or ValueError naming the key."""
        value = self.get(name, default) if default is not None else self(name)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"GGUF key {self.arch}.{name} differs per layer ({sorted(set(value))}): not supported")
            value = value[0]
        return value


def _rope(keys: _Keys, head_dim: int, factors: list[float] | None = None) -> dict:
    """RoPE settings: base, scaling (none or linear), partial rotary (rope.dimension_count < head_dim), and the
    file's frequency factors (``rope_freqs.weight``: Llama 3.1's scaling as llama.cpp's converter writes it, one
    divisor per frequency)."""
    params: dict = {"rope_type": "default", "rope_theta": float(keys.get("rope.freq_base", 10000.0))}
    kind = keys.get("rope.scaling.type", "none")
    if kind == "linear":
        params.update(rope_type="linear", factor=float(keys("rope.scaling.factor")))
    elif kind not in ("none", None):
        raise ValueError(f"GGUF key {keys.arch}.rope.scaling.type is {kind!r}: not supported (none, linear)")
    rotary = keys.get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    if factors is not None:
        if len(factors) != rotary // 2 or params["rope_type"] != "default":
            raise ValueError(f"tensor rope_freqs.weight has {len(factors)} factors for {rotary} rotary dims")
        params["freq_factors"] = [float(f) for f in factors]
    return params


def _common(keys: _Keys, tensors: dict[str, tuple[int, ...]], model_type: str) -> dict:
    """What every llama.cpp decoder states: dims, heads, norms' epsilon, RoPE, vocabulary, tied or not, the special
    token ids. ``tensors`` may carry the values of ``rope_freqs.weight`` under ``ROPE_FACTORS``."""
    heads = keys.one("attention.head_count")
    hidden = keys("embedding_length")
    head_dim = keys.get("attention.key_length", hidden // heads)
    value_dim = keys.get("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(f"GGUF key {keys.arch}.attention.value_length is {value_dim}, not the key length {head_dim}")
    if "token_embd.weight" not in tensors:
        raise ValueError("the file has no token_embd.weight tensor")
    meta = keys.metadata
    cfg = {
        "model_type": model_type,
        "num_hidden_layers": keys("block_count"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": keys.one("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": keys("context_length"),
        "rms_norm_eps": float(keys("attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope(keys, head_dim, tensors.get(ROPE_FACTORS)),
        "vocab_size": tensors["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in tensors,  # llama.cpp writes the lm_head only when untied
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if keys.get("feed_forward_length") is not None:  # an all-experts file may leave the dense width out
        cfg["intermediate_size"] = keys.one("feed_forward_length")
    if "rope_freqs.weight" in tensors and ROPE_FACTORS not in tensors:
        raise ValueError("tensor rope_freqs.weight (RoPE frequency factors) was not read")
    return cfg


def _bias(tensors: dict, name: str) -> bool:
    return f"blk.0.{name}.bias" in tensors


def _swa_layers(keys: _Keys, n_layer: int, period: int) -> list[bool]:
    """Which layers slide: the file's ``attention.sliding_window_pattern`` (an array of flags, or a period), else
    llama.cpp's period for the architecture (the last layer of each period is global)."""
    pattern = keys.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ValueError(f"GGUF key {keys.arch}.attention.sliding_window_pattern has {len(pattern)} entries")
        return [bool(p) for p in pattern]
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer)]


def _layer_types(swa: list[bool]) -> list[str]:
    return ["sliding_attention" if s else "full_attention" for s in swa]


def _no_window(keys: _Keys) -> None:
    if keys.get("attention.sliding_window"):
        raise ValueError(f"GGUF key {keys.arch}.attention.sliding_window: a {keys.arch} window is not supported")


def _experts(keys: _Keys, tensors: dict) -> tuple[int, int]:
    """(experts, experts per token); ValueError when an expert tensor does not hold ``expert_count`` experts."""
    count, used = keys("expert_count"), keys("expert_used_count")
    for name, shape in tensors.items():
        if name.endswith(("_exps.weight", "ffn_gate_inp.weight")) and shape[0] != count:
            raise ValueError(f"GGUF key {keys.arch}.expert_count is {count}, but tensor {name} holds {shape[0]}")
    if not 0 < used <= count:
        raise ValueError(f"GGUF key {keys.arch}.expert_used_count is {used} of {count} experts")
    return count, used


# --- one function per architecture ------------------------------------------------------------------------------


def _llama(keys: _Keys, tensors: dict) -> dict:
    """Llama, or Mixtral when the file has experts; Mistral where the file states a window (our converter's files
    do not: llama.cpp runs none), which is then honoured as HF's Mistral and Mixtral do."""
    window = keys.get("attention.sliding_window") or None
    if keys.get("expert_count", 0):
        cfg = _common(keys, tensors, "mixtral")
        experts, used = _experts(keys, tensors)
        return cfg | {"num_local_experts": experts, "num_experts_per_tok": used, "sliding_window": window}
    if window:
        return _common(keys, tensors, "mistral") | {"sliding_window": window}
    cfg = _common(keys, tensors, "llama")
    return cfg | {"attention_bias": _bias(tensors, "attn_q"), "mlp_bias": _bias(tensors, "ffn_up")}


def _qwen2(keys: _Keys, tensors: dict) -> dict:
    _no_window(keys)
    cfg = _common(keys, tensors, "qwen2")
    n = cfg["num_hidden_layers"]
    return cfg | {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * n}


def _qwen3(keys: _Keys, tensors: dict) -> dict:
    _no_window(keys)
    cfg = _common(keys, tensors, "qwen3")
    return cfg | {"sliding_window": None, "layer_types": ["full_attention"] * cfg["num_hidden_layers"]}


def _qwen3moe(keys: _Keys, tensors: dict) -> dict:
    experts, used = _experts(keys, tensors)
    cfg = _qwen3(keys, tensors) | {"model_type": "qwen3_moe"}
    cfg.setdefault("intermediate_size", keys.one("expert_feed_forward_length"))
    return cfg | {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": keys.one("expert_feed_forward_length"),
        "norm_topk_prob": True,  # llama.cpp's qwen3moe always renormalizes
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
    }


def _gemma_scale(keys: _Keys, cfg: dict, layers_27b: int) -> int:
    """query_pre_attn_scalar as llama.cpp fixes it: hidden / heads for the 27B model, else head_dim."""
    if cfg["num_hidden_layers"] == layers_27b:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["head_dim"]


def _gemma2(keys: _Keys, tensors: dict) -> dict:
    cfg = _common(keys, tensors, "gemma2")
    n = cfg["num_hidden_layers"]
    return cfg | {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scale(keys, cfg, 46),
        "attn_logit_softcapping": float(keys.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(keys.get("final_logit_softcapping", 30.0)),
        "sliding_window": keys.get("attention.sliding_window", 4096),
        "layer_types": _layer_types(_swa_layers(keys, n, 2)),
    }


def _gemma3(keys: _Keys, tensors: dict) -> dict:
    cfg = _common(keys, tensors, "gemma3_text")
    n, window = cfg["num_hidden_layers"], keys.get("attention.sliding_window", 0)
    swa = _swa_layers(keys, n, 6) if window else [False] * n
    local = {"rope_type": "default", "rope_theta": float(keys.get("rope.freq_base_swa", 10000.0))}
    return cfg | {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scale(keys, cfg, 62),
        "final_logit_softcapping": float(keys.get("final_logit_softcapping", 0.0)) or None,
        "attn_logit_softcapping": None,
        "sliding_window": window or None,
        "layer_types": _layer_types(swa),
        "rope_parameters": {"full_attention": cfg["rope_parameters"], "sliding_attention": local},
    }


def _phi3(keys: _Keys, tensors: dict) -> dict:
    cfg = _common(keys, tensors, "phi3")
    rope = dict(cfg["rope_parameters"])
    rope["original_max_position_embeddings"] = keys.get(
        "rope.scaling.original_context_length", cfg["max_position_embeddings"]
    )
    return cfg | {"sliding_window": keys.get("attention.sliding_window") or None, "rope_parameters": rope}


def _olmo2(keys: _Keys, tensors: dict) -> dict:
    _no_window(keys)
    return _common(keys, tensors, "olmo2")


def _olmoe(keys: _Keys, tensors: dict) -> dict:
    experts, used = _experts(keys, tensors)
    cfg = _common(keys, tensors, "olmoe")
    return cfg | {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": False, "clip_qkv": None}


def _granite(keys: _Keys, tensors: dict) -> dict:
    _no_window(keys)
    cfg = _common(keys, tensors, "granite")
    return cfg | {  # llama.cpp: 0 (absent) means no scaling; the attention scale then 1 / sqrt(head_dim)
        "embedding_multiplier": float(keys.get("embedding_scale", 0.0)) or 1.0,
        "attention_multiplier": float(keys.get("attention.scale", 0.0)) or cfg["head_dim"] ** -0.5,
        "residual_multiplier": float(keys.get("residual_scale", 0.0)) or 1.0,
        "logits_scaling": float(keys("logit_scale")),
        "attention_bias": _bias(tensors, "attn_q"),
        "mlp_bias": _bias(tensors, "ffn_up"),
    }


ARCHITECTURES: dict[str, Callable[[_Keys, dict], dict]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "olmoe": _olmoe,
    "granite": _granite,
}


def hf_config(metadata: dict, tensors: dict[str, tuple[int, ...]]) -> dict:
    """The HF config (a dict with ``model_type``) of a GGUF file with this metadata and these tensors (name ->
    shape in PyTorch order); ValueError, one line, naming the architecture, key or tensor we cannot serve."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted([*ARCHITECTURES, "gpt2"]))
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {supported}")
    return ARCHITECTURES[arch](_Keys(metadata, arch), tensors)


def file_config(path: str, read: tuple | None = None) -> dict | None:
    """``hf_config`` of the GGUF file ``path`` (None for a ``gpt2`` file: transformers converts its config); or
    ValueError naming what makes the file unreadable or unservable. ``read``: ``reader.read_metadata(path)`` when
    the caller has it (a 128k vocabulary takes a few tenths of a second to step over)."""
    from .reader import read_metadata

    metadata, tensors = read or read_metadata(path)
    if metadata.get("general.architecture") == "gpt2":
        return None
    found: dict = {t.name: t.torch_shape for t in tensors}
    for t in tensors:
        if t.name == "rope_freqs.weight" and t.type_name == "F32":
            found[ROPE_FACTORS] = t.data.reshape(-1).tolist()
    return hf_config(metadata, found)
