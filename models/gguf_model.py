"""A GGUF file standing in for the Hugging Face module a family is built from: its tensors renamed to the family's
HF names (``gguf_state_dict``), served by ``quant.GGUFWeights`` at the precision WEIGHTS asks (``GGUFModel``).

The renaming is the family's own table (``decoder_spec.GGUFNames``: llama.cpp's ``blk.N.<name>`` for each HF weight),
plus what llama.cpp's converter changed on the way in, undone exactly:

- Llama-arch Q and K rows (Llama, Mistral, Mixtral, Granite: ``permuted_qk``) put back in HF's order (whole rows
  move, the blocks stay as they are);
- Gemma's norms, stored as 1 + w (``norm_shift``), become w again (HF's and our Gemma norm adds the 1 back);
- the 3-D expert tensors ``ffn_{gate,up,down}_exps`` [E, out, in] become one gate+up and one down weight per expert
  (each a view of its rows in the file's blocks; gate and up fused as any gate+up is);
- Phi-3's fused ``attn_qkv`` and gate+up ``ffn_up`` are the HF checkpoint's fused weights as they are.

A tensor the family has no place for, or a family without GGUF names, fails naming it. GPT-2 has its own table
(``gguf/names.py``: Conv1D weights back to [in, out]).
"""

from __future__ import annotations

import torch

from .gguf.config import CONFIG_TENSORS
from .gguf.names import GPT2_CONV1D, hf_name, llama_qk_rows
from .kernels.quant_gemm import QuantWeight
from .native_memory import HeapTrimmer
from .quant import GGUFWeights, cat_rows, share_storage

Weight = torch.Tensor | QuantWeight


def gguf_state_dict(src: GGUFWeights, config) -> dict[str, Weight | list[Weight]]:
    """The GGUF's tensors under the Hugging Face names of ``config.model_type``'s family, one tensor converted at a
    time. fp32 tensors come in HF's layout; a ``QuantWeight`` is always [out, in]; a layer's experts are under
    ``<experts>.gate_up_proj`` and ``<experts>.down_proj`` as HF's [E, out, in] tensors in fp32, else as lists of
    one weight per expert. ValueError names a tensor the
    family has no place for."""
    if config.model_type == "gpt2":
        return _gpt2_state_dict(src)
    from . import families

    family = families().get(config.model_type)
    if family is None or getattr(family, "gguf", None) is None:
        raise ValueError(f"serving a GGUF of model type {config.model_type!r} is not supported")
    names, gguf = family.names, family.gguf
    n_head = config.num_attention_heads
    heads = {"q_proj": n_head, "k_proj": getattr(config, "num_key_value_heads", None) or n_head}
    groups = fused_groups(config.model_type)
    out: dict = {}
    experts: dict[tuple[str, str], list[Weight]] = {}  # (layer prefix, gate / up / down) -> one weight per expert
    for name in src.names():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in gguf.experts:
            prefix = f"{names.layers}.{parts[1]}.{names.experts}"
            experts[prefix, gguf.experts[parts[2]]] = src.get_experts(name)
            _experts_when_complete(out, experts, prefix)
            continue
        if name in CONFIG_TENSORS:
            continue  # the config carries it (gguf/config.py)
        target = _target(parts, gguf, names.layers)
        if target is None:
            raise ValueError(f"tensor {name} of this {gguf.arch} GGUF has no place in a {config.model_type} model")
        rows = None
        proj = target.rsplit(".", 2)[-2]
        if gguf.permuted_qk and proj in heads:
            rows = llama_qk_rows(src.shape(name)[0], heads[proj])
        value = src.get(name, rows)
        if gguf.norm_shift and target.endswith("norm.weight"):
            value = value - gguf.norm_shift  # the converter stored 1 + w; the family's norm adds the 1 back
        out[target] = value
        _share_when_complete(out, target, groups)
    if experts:
        raise ValueError(f"expert tensors of {', '.join(sorted({p for p, _ in experts}))} are incomplete")
    return out


def _target(parts: list[str], gguf, layers: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``<layers>.3.self_attn.q_proj.weight`` by the family's table (None: no place)."""
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in gguf.layer:
        return f"{layers}.{parts[1]}.{gguf.layer[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in gguf.top:
        return f"{gguf.top[parts[0]]}.{parts[1]}"
    return None


def _experts_when_complete(out: dict, experts: dict, prefix: str) -> None:
    """Once a layer's gate, up and down expert tensors are all read: per expert one fused gate+up [2I, C] (gate
    rows, then up, as HF's ``gate_up_proj``) and one down [C, I], as lists under the HF experts' names."""
    if not all((prefix, role) in experts for role in ("gate", "up", "down")):
        return
    gate, up = experts.pop((prefix, "gate")), experts.pop((prefix, "up"))
    out[f"{prefix}.gate_up_proj"] = _stacked([cat_rows([g, u])[0] for g, u in zip(gate, up)])
    out[f"{prefix}.down_proj"] = _stacked(experts.pop((prefix, "down")))


def _stacked(weights: list[Weight]) -> torch.Tensor | list[Weight]:
    """fp32 experts as HF holds them, one [E, out, in] tensor; quantized ones stay a list (each in its blocks)."""
    return torch.stack(weights) if all(isinstance(w, torch.Tensor) for w in weights) else weights


def _share_when_complete(sd: dict, target: str, groups: tuple) -> None:
    """``share_storage`` the fused group of ``target`` (``<layers>.<i>.<name>.weight``) once all of it is in
    ``sd``: group by group, the unfused parts' memory is free again for the next tensors of the load."""
    prefix, _, rest = target.partition(".layers.")
    layer, _, local = rest.partition(".")
    for group in groups:
        if local.removesuffix(".weight") in group:
            names = [f"{prefix}.layers.{layer}.{n}.weight" for n in group]
            if all(n in sd for n in names):
                share_storage(sd, names)


def _gpt2_state_dict(src: GGUFWeights) -> dict[str, Weight]:
    """GPT-2's tensors under HF names; fp32 Conv1D weights back in HF's [in, out] layout."""
    out: dict[str, Weight] = {}
    for name in src.names():
        target = hf_name(name, "gpt2")
        if target is None:
            continue  # no use in HF's GPT-2
        value = src.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and target.rsplit(".", 1)[0].endswith(GPT2_CONV1D):
            value = value.t().contiguous()
        out[target] = value
    return out


def fused_groups(model_type: str) -> tuple[tuple[str, ...], ...]:
    """The weights ``model_type``'s family fuses into one linear (QKV, gate+up), by HF name inside a block."""
    from . import families

    names = families()[model_type].names
    return tuple(g for g in (names.qkv, names.gate_up) if len(g) > 1)


class GGUFModel:
    """A GGUF checkpoint standing in for the HF module a family is built from: ``config``,
    ``generation_config`` and ``state_dict()`` (``gguf_state_dict``: quantized weights stay in their blocks,
    nothing is dequantized unless ``weights`` asks for fp32). The configs are the GGUF's, as
    ``loading/convert.py`` converted and cached them.
    """

    def __init__(self, path: str, config, generation_config, weights: str) -> None:
        self.path = path
        self.config, self.generation_config = config, generation_config
        self.source = GGUFWeights(path, weights)

    def eval(self) -> GGUFModel:
        return self

    def state_dict(self) -> dict:
        """Every tensor, converted one at a time (call once: the memory map is dropped afterwards)."""
        sd = gguf_state_dict(self.source, self.config)
        self.source.close()
        HeapTrimmer().trim()  # the conversion's scratch goes back to the OS before the family allocates its KV pool
        return sd

    def describe(self) -> str:
        """What loading did, for the startup log: each conversion with its tensor count."""
        return ", ".join(f"{n} x {how}" for how, n in sorted(self.source.conversions.items()))
