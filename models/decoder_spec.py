"""A decoder family as data: its math (``DecoderSpec``, read from the HF config and checked: anything the config asks
that ``decoder.py`` does not do raises ValueError naming it), where its weights sit in the HF state dict (``Names``)
and how llama.cpp names them (``GGUFNames``). ``decoder.py``'s docstring shows the block these configure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .gguf.names import LLAMA_BLOCK, LLAMA_TOP
from .rope import per_layer_type

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: ``experts`` experts of width ``intermediate``, ``top_k`` per token; the router's
    top-k softmax weights renormalized to sum 1 when ``norm_topk``."""

    experts: int
    top_k: int
    norm_topk: bool
    intermediate: int


@dataclass(frozen=True)
class DecoderSpec:
    """A family's math (see ``decoder.py``'s docstring). Per-layer lists have one entry per layer."""

    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    head_dim: int
    eps: float
    act: str = "silu"  # "silu" | "gelu_tanh" | "gelu": the gated MLP's activation of the gate
    norm_offset: float = 0.0  # 1.0: RMSNorm weights are (1 + w) (Gemma)
    qk_norm: str | None = None  # "head": over each head's D (Qwen3, Gemma 3); "full": over the H D projection
    clip_qkv: float | None = None
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    windows: tuple[int, ...] = ()  # per layer: 0 full attention, W a sliding window of W keys
    layer_types: tuple[str | None, ...] = ()  # per layer: the RoPE table it reads (None: the one table)
    moe: MoESpec | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: an MoE MLP (else the dense one)
    tied: bool = False

    def __post_init__(self) -> None:
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.n_head} attention heads do not group over {self.n_kv_head} key/value heads")
        for name in ("windows", "layer_types", "moe_layers"):
            value = getattr(self, name)
            if value and len(value) != self.n_layer:
                raise ValueError(f"{name} has {len(value)} entries for {self.n_layer} layers")

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def layer_type(self, layer: int) -> str | None:
        return self.layer_types[layer] if self.layer_types else None

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and (self.moe_layers[layer] if self.moe_layers else True)


@dataclass(frozen=True)
class Names:
    """Where a family's weights sit in its HF state dict. Layer names are relative to ``layers.<i>.``; a fused
    linear lists its parts (concatenated along the outputs, in order); None: the family has no such weight."""

    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    layers: str = "model.layers"
    attn_norm: str | None = "input_layernorm"
    attn_out_norm: str | None = None
    ff_norm: str | None = "post_attention_layernorm"
    ff_out_norm: str | None = None
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    router: str = "mlp.gate"  # [E, C]
    experts: str = "mlp.experts"  # .gate_up_proj [E, 2I, C] (gate rows, then up), .down_proj [E, C, I]


@dataclass(frozen=True)
class GGUFNames:
    """A family as llama.cpp writes it: its ``general.architecture`` and tensor names -> the roles' HF names.

    ``layer``: blk.<i>.<gguf> -> <layers>.<i>.<hf>; ``top``: <gguf> -> <hf>; ``permuted_qk``: llama.cpp's converter
    interleaved Q and K's rotary halves (its Llama-family models), which the reader undoes; ``experts``: 3-D
    tensors [E, out, in] of one expert matrix each -> the HF experts' (gate, up -> gate_up_proj; down);
    ``norm_shift``: the converter stored every norm weight as shift + w (Gemma's 1 + w), which the reader undoes.
    ``gguf_model.gguf_state_dict`` reads a file with it; ``gguf/config.py`` converts the architecture's metadata."""

    arch: str
    layer: dict[str, str]
    top: dict[str, str] = field(default_factory=lambda: dict(LLAMA_TOP))
    permuted_qk: bool = False
    experts: dict[str, str] = field(default_factory=dict)
    norm_shift: float = 0.0


# llama.cpp's Llama-like tensor names (checked against files its converter wrote): gguf/names.py's Llama table plus the
# q/k norms (Qwen3, Gemma 3, OLMo) and the MoE router.
LLAMA_GGUF_LAYER = {
    **LLAMA_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
MOE_GGUF_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


# --- reading a config -------------------------------------------------------------------------------------------


def activation(cfg, attr: str = "hidden_act") -> str:
    """The config's MLP activation in our terms, or ValueError naming one we do not implement."""
    name = getattr(cfg, attr, None) or "silu"
    if name not in ACTIVATIONS:
        supported = ", ".join(ACTIVATIONS)
        raise ValueError(f"activation {name!r} is not supported by the fast engine; supported: {supported}")
    return ACTIVATIONS[name]


def kv_heads(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def head_dim_of(cfg) -> int:
    """An explicit ``head_dim`` (Qwen3, Gemma: not hidden / heads), else hidden / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_windows(cfg) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    """(window per layer, layer type per layer) from ``layer_types`` (Qwen2/3, Gemma 2/3: "sliding_attention" layers
    get ``sliding_window``), or one ``sliding_window`` for every layer (Mistral, Phi-3, Mixtral). Layer types are
    returned only where the RoPE settings are per layer type. ValueError names a layer type we do not implement."""
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (window,) * n, ()
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer type {unknown[0]!r} is not supported by the fast engine; supported: {LAYER_TYPES}")
    if "sliding_attention" in types and not window:
        raise ValueError("sliding_attention layers without a sliding_window")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows, tuple(types) if per_layer_type(cfg) else ()


def base_spec(cfg, **overrides) -> DecoderSpec:
    """The spec of a Llama-like config (pre-RMSNorm, SiLU unless overridden, windows from ``layer_windows``), with
    ``overrides``."""
    windows, types = layer_windows(cfg)
    act = overrides.pop("act", None) or activation(cfg)
    spec = DecoderSpec(
        n_layer=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        n_head=cfg.num_attention_heads,
        n_kv_head=kv_heads(cfg),
        head_dim=head_dim_of(cfg),
        eps=cfg.rms_norm_eps,
        act=act,
        windows=windows,
        layer_types=types,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    return replace(spec, **overrides)


def moe_spec(cfg, experts: int, norm_topk: bool, intermediate: int) -> MoESpec:
    return MoESpec(experts=experts, top_k=cfg.num_experts_per_tok, norm_topk=norm_topk, intermediate=intermediate)


def sqrt_hidden(cfg) -> float:
    """Gemma's embedding scale, sqrt(hidden_size)."""
    return math.sqrt(cfg.hidden_size)
