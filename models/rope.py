"""Rotary position embeddings, the kinds the families use: plain, HF's fixed-frequency scalings, partial rotary, and
one table per layer kind (Gemma 3's local layers have their own base).

A table is computed once for ``max_len`` positions exactly as HF computes it (``rope_tables``); a forward gathers its
tokens' rows once and every layer of that kind reuses them. ``apply_rope`` is HF's ``x * cos + rotate_half(x) * sin``
over the first R dims of each head (R = D unless the config asks for partial rotary, Phi-3), the rest passed through.

Shapes: N tokens, h heads, D head_dim, R rotary dims (even, <= D), P = max_len positions.
"""

from __future__ import annotations

import torch

# RoPE types whose frequencies are fixed at load time (HF recomputes "dynamic" and "longrope"
# per forward from the sequence length, which a precomputed table cannot follow).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(cfg, layer_type: str | None = None) -> dict:
    """The config's RoPE settings (for one layer type, when they are per type) as one dict with ``rope_type``,
    ``rope_theta`` and ``partial_rotary_factor``.

    transformers >= 5 keeps them in ``rope_parameters`` (Gemma 3: one dict per layer type); older configs have
    ``rope_theta`` plus an optional ``rope_scaling`` dict (whose type key was ``type`` or ``rope_type``).
    """
    params = getattr(cfg, "rope_parameters", None)
    if params and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if not params:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    return params


def per_layer_type(cfg) -> bool:
    """Whether the config's RoPE settings are one dict per layer type (Gemma 3)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return any(isinstance(v, dict) for v in params.values())


def rotary_dims(cfg, head_dim: int, layer_type: str | None = None) -> int:
    """R: the leading dims of each head that rotate (``partial_rotary_factor`` x D, HF's int())."""
    return int(head_dim * rope_parameters(cfg, layer_type)["partial_rotary_factor"])


def check_rope(cfg, layer_type: str | None = None) -> None:
    """ValueError naming a RoPE type a precomputed table cannot follow."""
    rope_type = rope_parameters(cfg, layer_type)["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported by the fast engine; supported: {', '.join(ROPE_TYPES)}"
        )


def rope_tables(
    cfg, head_dim: int, max_len: int, device: torch.device, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for positions [0, max_len): each [max_len, 1, R], computed exactly as HF does (for ``layer_type``'s
    settings where they are per layer type)."""
    check_rope(cfg, layer_type)
    params = rope_parameters(cfg, layer_type)
    dim = rotary_dims(cfg, head_dim, layer_type)
    if dim % 2 or dim < 2:
        raise ValueError(f"RoPE over {dim} of {head_dim} head dims is not supported (it must be even)")
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [R/2]
        if params.get("freq_factors"):  # a GGUF's rope_freqs.weight (Llama 3.1): each frequency divided, as llama.cpp
            inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float)
        scaling = 1.0
    else:  # the scaled types: HF's own init function, so the frequencies are HF's exactly
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, torch.device("cpu"), **kwargs)
    freqs = torch.arange(max_len).float()[:, None] * inv_freq.float()[None, :]  # [P, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos[:, None, :].to(device), sin[:, None, :].to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, h, D] rotated by its positions' cos, sin: [N, 1, R] over its first R dims -> [N, h, D]."""
    R = cos.shape[-1]
    if R < x.shape[-1]:  # partial rotary: the last D - R dims pass through
        return torch.cat((apply_rope(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # each [N, h, D/2]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
