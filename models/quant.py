"""Quantized weights for the torch side: fp32 -> Q8_0 / Q4_1 (``WEIGHTS=int8`` / ``int4``), and a GGUF file's
tensors -> our weights under Hugging Face names.

``GGUFWeights`` reads a GGUF file tensor by tensor (memory-mapped by ``models/gguf/reader.py``, which parses the
header itself and skips the metadata: no vocabulary is built) and serves each tensor the way a ``WEIGHTS`` setting
asks:

    WEIGHTS   a matrix (2-D tensor)                                         a vector (norm, bias)
    auto      its own type, its own blocks (every type in TYPES: exact,     fp32 (exact)
              the file's bytes); an F32 matrix an fp32 tensor
    int8      Q8_0: the file's Q8_0 as it is, any other type requantized    fp32
    int4      Q4_1: the file's Q4_1 as it is, any other type requantized    fp32
    fp32      dequantized (exactly gguf-py's values)                        fp32

A tensor of a type no kernel serves (IQ2_XXS, TQ1_0, ...) fails when the file is opened, naming the tensor and its
type: never a silent requantization. Every conversion is counted per tensor type in ``GGUFWeights.conversions`` so
the startup log can say what loading did.

On top: ``cat_rows`` fuses weights (QKV, gate+up: one type concatenated, several types side by side as a
``QuantParts``), ``share_storage`` lets it fuse without a copy, and ``dequantize_hf_model_`` gives an HF model the
exact weights a quantized engine runs (the parity reference). ``gguf_model.py`` renames a GGUF's tensors to a
family's Hugging Face names on top of ``GGUFWeights``.
"""

from __future__ import annotations

import mmap
from collections import Counter

import numpy as np
import torch

from .gguf.blocks import TYPES
from .gguf.reader import GGUFTensor, check_servable, map_gguf
from .kernels.quant_gemm import WEIGHTS_TYPES, QuantParts, QuantWeight, dequantize, from_blocks, parts_of

WEIGHT_FORMATS = ("auto", "fp32", "int8", "int4")
GROUP = 32  # weights per Q8_0 / Q4_1 block


# ---------------------------------------------------------------- fp32 -> Q8_0 / Q4_1


def _groups(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [N, K] fp32 -> [N, K / 32, 32]; K must be whole blocks."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"{fmt} quantizes rows of whole 32-weight blocks; this weight has {k} inputs")
    return w.float().reshape(n, k // GROUP, GROUP)


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 [N, G] -> uint8 [N, G, 2] (little-endian, as GGUF stores it)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """q [N, G, 32] in 0..15 -> [N, G, 16]: byte j = q[j] | q[j + 16] << 4 (Q4_0's order)."""
    q = q.to(torch.uint8)
    return q[:, :, :16] | (q[:, :, 16:] << 4)


def quantize_q8_0(w: torch.Tensor) -> QuantWeight:
    """w [N, K] -> Q8_0: per 32 weights d = absmax / 127 (rounded to fp16), q = round(w / d)."""
    g = _groups(w, "Q8_0")
    d = (g.abs().amax(dim=2) / 127).to(torch.float16)  # [N, G]
    df = d.float()[:, :, None]
    q = torch.where(df > 0, torch.round(g / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=2)  # [N, G, 34]
    return QuantWeight("Q8_0", blocks.reshape(w.shape[0], -1).contiguous(), *w.shape)


def quantize_q4_1(w: torch.Tensor) -> QuantWeight:
    """w [N, K] -> Q4_1: per 32 weights m = min, d = (max - m) / 15 (both rounded to fp16), q = round((w - m) / d)."""
    g = _groups(w, "Q4_1")
    m = g.amin(dim=2).to(torch.float16)
    d = ((g.amax(dim=2) - m.float()) / 15).to(torch.float16)
    df, mf = d.float()[:, :, None], m.float()[:, :, None]
    q = torch.where(df > 0, torch.round((g - mf) / torch.where(df > 0, df, 1.0)), 0.0).clamp(0, 15)
    blocks = torch.cat([_half_bytes(d), _half_bytes(m), _nibble_bytes(q)], dim=2)  # [N, G, 20]
    return QuantWeight("Q4_1", blocks.reshape(w.shape[0], -1).contiguous(), *w.shape)


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """fp32 [N, K] -> a QuantWeight of ``fmt``: "int8" / "Q8_0" or "int4" / "Q4_1". A weight whose rows are not whole
    32-weight blocks (K % 32: a small MoE expert's down projection) becomes F16 instead, as llama-quantize falls back
    for such tensors: no 32-block type can hold it."""
    kind = WEIGHTS_TYPES.get(fmt, fmt)
    if kind in ("Q8_0", "Q4_1") and w.shape[1] % GROUP:
        half = w.detach().to(torch.float16).contiguous()
        return QuantWeight("F16", half.view(torch.uint8).reshape(w.shape[0], -1), *w.shape)
    if kind == "Q8_0":
        return quantize_q8_0(w)
    if kind == "Q4_1":
        return quantize_q4_1(w)
    raise ValueError(f"cannot quantize to {fmt!r} (expected int8 or int4)")


# ---------------------------------------------------------------- a GGUF file


class GGUFWeights:
    """A GGUF file's tensors, converted one at a time into what ``weights`` asks for (module docstring).

    ``get(name)`` -> an fp32 torch tensor (shape in PyTorch order: [N, K] for a matrix) or a ``QuantWeight``.
    ``conversions`` counts "<gguf type> -> <served> (<how>)" per tensor; ``resident`` sums the bytes served per type.
    """

    def __init__(self, path: str, weights: str = "auto") -> None:
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"WEIGHTS must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        self.path, self.weights = path, weights
        self._map, tensors = map_gguf(path)
        check_servable(path, tensors)
        self.tensors = {t.name: t for t in tensors}
        self.conversions: Counter[str] = Counter()
        self.resident: Counter[str] = Counter()

    def names(self) -> list[str]:
        return list(self.tensors)

    def type_of(self, name: str) -> str:
        return self.tensors[name].type_name

    def shape(self, name: str) -> tuple[int, ...]:
        """PyTorch order (GGUF stores ne0, the contiguous dimension, first)."""
        return self.tensors[name].torch_shape

    def fp32(self, name: str) -> torch.Tensor:
        """The tensor dequantized to fp32 (the values gguf-py dequantizes, bit for bit)."""
        t = self.tensors[name]
        return torch.from_numpy(_dequantized(t)).reshape(self.shape(name))

    def get(self, name: str, rows: np.ndarray | torch.Tensor | None = None) -> torch.Tensor | QuantWeight:
        """Tensor ``name`` as served under this WEIGHTS setting (table in the module docstring).

        ``rows``: a permutation of a matrix's output rows (Llama's Q/K, see ``gguf_model.gguf_state_dict``).
        """
        t = self.tensors[name]
        index = None if rows is None else torch.as_tensor(np.asarray(rows), dtype=torch.long)
        out = self._serve(t, self.shape(name), t.raw_rows, lambda: self.fp32(name), index)
        self._release(t)
        return out

    def get_experts(self, name: str) -> list[torch.Tensor | QuantWeight]:
        """A 3-D tensor [E, N, K] (llama.cpp's ``ffn_*_exps``: one matrix per expert) as E matrices [N, K], each
        served as ``get`` serves a matrix (its own blocks at WEIGHTS=auto: a view of expert e's rows)."""
        t = self.tensors[name]
        if len(self.shape(name)) != 3:
            raise ValueError(f"tensor {name} has shape {list(self.shape(name))}, not [experts, rows, inputs]")
        n_exp, n, k = self.shape(name)
        dense: list[torch.Tensor] = []  # the whole tensor in fp32, dequantized once if any expert needs it

        def expert_fp32(e: int) -> torch.Tensor:
            if not dense:
                dense.append(self.fp32(name))
            return dense[0][e]

        out = [
            self._serve(t, (n, k), lambda e=e: t.raw_rows()[e * n : (e + 1) * n], lambda e=e: expert_fp32(e), None)
            for e in range(n_exp)
        ]
        self._release(t)
        return out

    def _serve(self, t: GGUFTensor, shape, raw, dense, index) -> torch.Tensor | QuantWeight:
        """One tensor of ``shape`` (its blocks ``raw()``: uint8 [rows, row bytes]; its values ``dense()``: fp32) as
        this WEIGHTS setting serves it; ``index`` a permutation of its rows."""
        kind = t.type_name
        if len(shape) != 2 or self.weights == "fp32" or (self.weights == "auto" and kind == "F32"):
            out = dense()
            out, served, how = (out if index is None else out[index]), "fp32", "exact"
            if kind not in ("F32", "F16", "BF16"):
                how = "dequantized"
            elif kind != "F32" and len(shape) == 2:
                how = "widened"
        else:
            want = self.weights if self.weights == "auto" else WEIGHTS_TYPES[self.weights]
            if want in ("auto", kind):  # its own blocks: exact, the file's bytes
                out = from_blocks(kind, raw(), shape[1])
                out, served, how = (out if index is None else out.rows(index)), kind, "exact"
            else:
                full = dense()
                out = quantize(full if index is None else full[index], want)
                served, how = want, "quantized" if kind in ("F32", "F16", "BF16") else "requantized"
        self.conversions[f"{kind} -> {served} ({how})"] += 1
        self.resident[served] += out.nbytes if isinstance(out, QuantWeight) else out.numel() * out.element_size()
        return out

    def _release(self, t: GGUFTensor) -> None:
        """Drop the tensor's pages of the file map from our RSS once it is converted (the page cache keeps them; a
        later read faults them back in). Without this every page read stays in RSS until the map goes: the
        whole file on top of the converted copies at the end of a load."""
        if hasattr(mmap, "MADV_DONTNEED") and self._map is not None and t.n_bytes:
            start = t.data_offset - t.data_offset % mmap.PAGESIZE  # madvise wants a page-aligned start
            self._map.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)

    def close(self) -> None:
        """Drop the memory map (the served tensors are copies; the map goes with the last view of it)."""
        self.tensors.clear()
        self._map = None


def _dequantized(t: GGUFTensor) -> np.ndarray:
    """A tensor's values in fp32 (numpy), as gguf-py dequantizes them."""
    from .gguf.blocks import dequantize as reference

    if t.type_name in ("F32", "F16"):
        return np.asarray(t.data).astype(np.float32)
    return reference(t.raw_rows(), t.type_name)


# ---------------------------------------------------------------- fused linears


def cat_rows(
    parts: list[torch.Tensor | QuantWeight | QuantParts],
) -> tuple[torch.Tensor | QuantWeight | QuantParts, str | None]:
    """Stack weights [N_i, K] along output rows into one [sum N_i, K] weight (a fused linear), exactly.

    All fp32: one fp32 tensor. All quantized, one type: its rows concatenated (no copy when the parts are
    consecutive slices of one buffer, ``share_storage``). Several types (a Q4_K_M file's Q6_K V beside Q4_K Q and
    K): a ``QuantParts``, each part in its own blocks. fp32 beside quantized parts: the fp32 parts as F32 blocks
    (the same bytes). The second value describes a mixed fusion for the log, else None.
    """
    if len(parts) == 1:  # nothing to fuse: the weight as it is (a copy would only cost memory)
        return parts[0], None
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts).contiguous(), None
    pieces: list[QuantWeight] = []
    for p in parts:
        pieces += parts_of(p) if not isinstance(p, torch.Tensor) else [_f32_blocks(p)]
    runs: list[list[QuantWeight]] = []
    for piece in pieces:  # consecutive parts of one type merge into one
        if runs and runs[-1][0].fmt == piece.fmt:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    merged = [run[0] if len(run) == 1 else _concat(run) for run in runs]
    if len(merged) == 1:
        return merged[0], None
    return QuantParts(merged), f"fused {'+'.join(p.fmt for p in merged)} weights, each in its own blocks"


def _f32_blocks(w: torch.Tensor) -> QuantWeight:
    """An fp32 [N, K] tensor as F32 blocks (the same bytes)."""
    w = w.float().contiguous()
    return QuantWeight("F32", w.view(torch.uint8).reshape(w.shape[0], -1), *w.shape)


def _concat(parts: list[QuantWeight]) -> QuantWeight:
    """Rows of one type stacked: the buffer they are consecutive slices of, else a copy."""
    datas = [p.data for p in parts]
    data = _joined(datas)
    data = torch.cat(datas) if data is None else data  # [sum N_i, row bytes]
    return QuantWeight(parts[0].fmt, data, sum(p.out_features for p in parts), parts[0].in_features)


def _joined(datas: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor that ``datas`` are consecutive, contiguous row slices of, in order and covering all of it; else
    None."""
    base = datas[0]._base
    if base is None or not base.is_contiguous():
        return None
    at = base.data_ptr()
    for d in datas:
        if d._base is not base or not d.is_contiguous() or d.data_ptr() != at:
            return None
        at += d.nbytes
    return base if at == base.data_ptr() + base.nbytes else None


def share_storage(sd: dict[str, torch.Tensor | QuantWeight], names: list[str]) -> None:
    """Move the quantized weights ``names`` of ``sd`` (one fused group, in the family's order) into one buffer per
    run of one type, each becoming a slice of it, so that ``cat_rows`` fuses them without a copy: a load then never
    holds a fused weight twice. Exact (the same bytes)."""
    parts = [sd.get(n) for n in names]
    if not all(isinstance(p, QuantWeight) for p in parts) or len({p.in_features for p in parts}) != 1:
        return
    start = 0
    for end in range(1, len(parts) + 1):
        if end == len(parts) or parts[end].fmt != parts[start].fmt:
            if end - start > 1:
                base = torch.cat([p.data for p in parts[start:end]])  # [sum N_i, row bytes]
                at = 0
                for name, p in zip(names[start:end], parts[start:end]):
                    sd[name] = QuantWeight(p.fmt, base[at : at + p.out_features], p.out_features, p.in_features)
                    at += p.out_features
            start = end


def served_types() -> tuple[str, ...]:
    """The GGUF types a matrix can be served in at its own precision."""
    return tuple(TYPES)


def dequantize_hf_model_(hf_model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """Put into an HF model, in place, the weights our engine multiplies by under ``WEIGHTS=fmt`` (int8 / int4).

    Every linear weight (nn.Linear; GPT-2's Conv1D, stored [in, out]; each expert of a mixture of experts) and the
    token embedding (a tied lm_head follows it) becomes dequantize(quantize(w)); norms, biases, GPT-2's position
    embeddings and an MoE router stay as they are, as in the engine. ``generate`` on the result is the reference the
    quantized engine must match token for token; its perplexity is the format's quality.
    """
    from transformers.pytorch_utils import Conv1D

    def requant(w: torch.Tensor) -> torch.Tensor:  # [out, in]
        return dequantize(quantize(w.detach().float(), fmt))

    with torch.no_grad():
        done: set[int] = set()
        embed = hf_model.get_input_embeddings()
        for module in hf_model.modules():
            weight = getattr(module, "weight", None)
            if weight is None or id(weight) in done:
                continue
            if isinstance(module, torch.nn.Linear) or module is embed:
                weight.copy_(requant(weight))
            elif isinstance(module, Conv1D):
                weight.copy_(requant(weight.t()).t())
            else:
                continue
            done.add(id(weight))
        for module in hf_model.modules():  # a mixture of experts' 3-D [E, out, in] weights, one expert at a time
            for name in ("gate_up_proj", "down_proj"):
                experts = getattr(module, name, None)
                if isinstance(experts, torch.nn.Parameter) and experts.dim() == 3:
                    for e in range(experts.shape[0]):
                        experts[e].copy_(requant(experts[e]))
    return hf_model
