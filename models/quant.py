"""Weight quantization: fp32 -> int8 / int4 (``models/kernels/quant_gemm.py`` formats), and GGUF tensors -> ours.

``quantize`` turns an fp32 weight into a packed ``QuantWeight``. ``GGUFWeights`` reads a GGUF
file tensor by tensor (memory-mapped; ``open_gguf`` parses the header itself and skips the metadata,
so at most one tensor is ever held in fp32 and no vocabulary is built) and serves each tensor in
the format a ``WEIGHTS`` setting asks for:

    GGUF type   auto                     int8                  int4                  fp32
    F32, BF16   fp32 (exact)             quantized             quantized             exact
    F16         fp32 (exact)             quantized             quantized             exact
    Q8_0        int8 (exact)             exact                 requantized           dequantized
    Q4_0, Q4_1  int4 (exact)             requantized           exact                 dequantized
    Q4_K        int4 (scales to fp16)    requantized           scales to fp16        dequantized
    Q6_K        int8 (requantized)       requantized           requantized           dequantized

"exact": the weights our kernel multiplies by are bit for bit the values ggml dequantizes
(Q4_0 is Q4_1 with m = -8 d). Q4_K keeps every 4-bit q and rounds its sub-block scale d * sc
and min dmin * m (fp32) to our fp16 (relative change <= 2^-11 of the scale). Q6_K's 6-bit values
with 16-element sub-block scales become int8 per 32-group, the nearest of our formats (finer
grid than the source). Every conversion that changes a value is counted per tensor type in
``GGUFWeights.conversions`` so the startup log can say so. Any other type raises naming it.
1-D tensors (norms, biases) are always fp32.

On top: ``gguf_state_dict`` renames a Llama or GPT-2 GGUF's tensors to Hugging Face names (Llama's
Q/K rows back in HF order), ``GGUFModel`` hands that to a model family in place of an HF module,
``cat_rows`` fuses weights (QKV, gate+up) in one format, and ``dequantize_hf_model_`` gives an HF
model the exact weights a quantized engine runs (the parity reference).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from .kernels.quant_gemm import GROUP, PANEL, QuantWeight, dequantize, pack, unpack
from .native_memory import HeapTrimmer

WEIGHT_FORMATS = ("auto", "fp32", "int8", "int4")


# ---------------------------------------------------------------- fp32 -> int8 / int4


def _grouped(w: torch.Tensor, fill: float) -> torch.Tensor:
    """w [N, K] fp32 -> [N, G, 32], the last group padded with ``fill``."""
    n, k = w.shape
    g = -(-k // GROUP)
    out = torch.full((n, g * GROUP), fill, dtype=torch.float32)
    out[:, :k] = w
    return out.view(n, g, GROUP)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> q int8 [N, K], d fp16 [N, G]: symmetric per 32-group, d = absmax / 127 (rounded to fp16)."""
    n, k = w.shape
    wg = _grouped(w.float(), 0.0)  # [N, G, 32]
    d = (wg.abs().amax(dim=2) / 127).to(torch.float16)  # [N, G]
    df = d.float()[:, :, None]
    q = torch.where(df > 0, torch.round(wg / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127)
    return q.to(torch.int8).view(n, -1)[:, :k].contiguous(), d


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q uint8 0..15 [N, K], d, m fp16 [N, G]: per 32-group w ~ q * d + m, m = min, d = (max - m) / 15."""
    n, k = w.shape
    w = w.float()
    lo = _grouped(w, float("inf")).amin(dim=2)  # padding never sets the range
    hi = _grouped(w, float("-inf")).amax(dim=2)
    m = lo.to(torch.float16)
    d = ((hi - m.float()) / 15).to(torch.float16)
    df, mf = d.float()[:, :, None], m.float()[:, :, None]
    wg = _grouped(w, 0.0)
    q = torch.where(df > 0, torch.round((wg - mf) / torch.where(df > 0, df, 1.0)), 0.0).clamp(0, 15)
    return q.to(torch.uint8).view(n, -1)[:, :k].contiguous(), d, m


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """fp32 [N, K] -> the packed ``fmt`` ("int8" | "int4") weight."""
    if fmt == "int8":
        return pack("int8", *quantize_int8(w))
    if fmt == "int4":
        return pack("int4", *quantize_int4(w))
    raise ValueError(f"cannot quantize to {fmt!r} (expected int8 or int4)")


# ---------------------------------------------------------------- GGUF blocks -> (q, d, m)


def _blocks(raw: np.ndarray, n_rows: int, block: int) -> np.ndarray:
    """A quantized tensor's bytes -> uint8 [n_rows, blocks per row, block bytes]."""
    return np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, -1, block)


def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 -> fp16 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[..., 16] ggml nibble bytes -> [..., 32]: element j is byte j's low nibble, j + 16 its high one."""
    return torch.from_numpy(np.concatenate([qs & 15, qs >> 4], axis=-1).copy())


def q8_0_parts(raw: np.ndarray, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 (block: d fp16, q int8[32]) -> q int8 [N, K], d fp16 [N, G]."""
    b = _blocks(raw, n_rows, 34)
    q = torch.from_numpy(b[:, :, 2:].copy().view(np.int8))
    return q.reshape(n_rows, -1), _f16(b[:, :, 0:2])


def q4_parts(raw: np.ndarray, n_rows: int, has_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (d, m fp16, 16 nibble bytes: w = q d + m) or Q4_0 (d, 16 bytes: w = (q - 8) d) -> q, d, m."""
    b = _blocks(raw, n_rows, 20 if has_min else 18)
    d = _f16(b[:, :, 0:2])
    m = _f16(b[:, :, 2:4]) if has_min else -8 * d  # exact: a power-of-two multiple of an fp16
    if not torch.isfinite(m).all():
        raise ValueError("Q4_0 scale too large for an fp16 min (-8 d overflows)")
    q = _nibbles(b[:, :, 4:] if has_min else b[:, :, 2:])
    return q.reshape(n_rows, -1), d, m


def q4_k_parts(raw: np.ndarray, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K (256-superblock: d, dmin fp16, 12 bytes of 6-bit sub-scales/mins, 128 nibble bytes) -> q, d, m.

    Sub-block j (32 elements) is w = (d sc_j) q - dmin m_j: our int4 with its scale and min
    rounded to fp16.
    """
    b = _blocks(raw, n_rows, 144)  # [N, S, 144]
    d = torch.from_numpy(b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [N, S]
    dmin = torch.from_numpy(b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    sc6 = b[:, :, 4:16].reshape(n_rows, -1, 3, 4)  # the packing gguf.quants.Q4_K.get_scale_min documents
    lo, hi, mix = sc6[:, :, 0], sc6[:, :, 1], sc6[:, :, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [N, S, 8]
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scale = d[:, :, None] * torch.from_numpy(sc.astype(np.float32))  # [N, S, 8], exact in fp32
    minimum = -dmin[:, :, None] * torch.from_numpy(mn.astype(np.float32))
    qs = b[:, :, 16:].reshape(n_rows, -1, 4, 32)  # 4 chunks of 64 elements: low nibbles, then high
    q = torch.from_numpy(np.stack([qs & 15, qs >> 4], axis=3).copy())  # [N, S, 4, 2, 32]
    return q.reshape(n_rows, -1), scale.reshape(n_rows, -1).half(), minimum.reshape(n_rows, -1).half()


# ---------------------------------------------------------------- a GGUF file


PACK_ROWS = 4096  # a larger quantized matrix (an embedding) is repacked this many rows (whole panels) at a time
EXACT = {"F32": "fp32", "F16": "fp32", "BF16": "fp32", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
NEAREST = {"Q4_K": "int4", "Q6_K": "int8"}  # requantized under WEIGHTS=auto
SUPPORTED = (*EXACT, *NEAREST)


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` in GGUF order (ne0, the contiguous dimension, first); ``data`` a
    read-only view of the memory-mapped file (F32 / F16: [..., ne0] floats; other types: [..., row bytes] uint8)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray


# GGUF metadata value types -> their size in bytes (8: string, 9: array are variable-sized)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Cursor:
    """Little-endian reads from the start of a GGUF file (IndexError / struct.error past its end)."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        out = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return out

    def skip_value(self, vtype: int) -> None:
        """Step over one metadata value (a 49,152-string vocabulary array too) without building it."""
        if vtype in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[vtype]
        elif vtype == 8:
            self.pos += 8 + self.take("Q")
        elif vtype == 9:
            etype, count = self.take("I"), self.take("Q")
            if etype in _SCALAR_BYTES:
                self.pos += _SCALAR_BYTES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")
        if self.pos > len(self.buf):
            raise ValueError("metadata runs past the end of the file")


def _read_tensor_infos(path: str, buf) -> list[GGUFTensor]:
    """Parse a GGUF (v2/v3) header: skip the metadata (keeping only ``general.alignment``), read the tensor infos.

    Unlike ``gguf.GGUFReader`` nothing of the metadata is materialized: its reader builds numpy objects
    for every vocabulary entry (about 160 MB resident for SmolLM2 while it lives).
    """
    import gguf

    cur = _Cursor(buf)
    cur.pos = 4  # the magic, checked by open_gguf
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        if key == "general.alignment" and vtype == 4:
            alignment = cur.take("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("I")
        dims = tuple(int(cur.take("Q")) for _ in range(n_dims))
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    if len({info[0] for info in infos}) != len(infos):
        raise ValueError("two tensors have the same name")
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name} has an unknown GGUF type id {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_elems = int(np.prod(dims)) if dims else 1
        n_bytes = n_elems // block * type_size
        at = start + offset
        if at + n_bytes > len(buf):
            raise ValueError(f"truncated: tensor {name} needs bytes up to {at + n_bytes}, the file has {len(buf)}")
        rows = tuple(reversed(dims[1:]))
        if kind.name in ("F32", "F16"):
            data = np.frombuffer(buf, np.float32 if kind.name == "F32" else np.float16, n_elems, at)
            data = data.reshape(*rows, dims[0])
        else:
            data = np.frombuffer(buf, np.uint8, n_bytes, at).reshape(*rows, dims[0] // block * type_size)
        tensors.append(GGUFTensor(name, kind, dims, at, n_bytes, data))
    return tensors


def map_gguf(path: str) -> tuple[mmap.mmap, list[GGUFTensor]]:
    """The GGUF file ``path`` memory-mapped read-only, and its tensors (views of that map); or ValueError
    saying why the file is unreadable."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the file object
    try:
        return buf, _read_tensor_infos(path, buf)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {exc}") from exc


def open_gguf(path: str) -> list[GGUFTensor]:
    """The tensors of the GGUF file ``path`` (memory-mapped), or ValueError saying why the file is unreadable."""
    return map_gguf(path)[1]


class GGUFWeights:
    """A GGUF file's tensors, converted one at a time into the format ``weights`` asks for.

    ``get(name)`` -> fp32 torch tensor (shape in PyTorch order: [N, K] for a matrix) or a
    ``QuantWeight``. ``conversions`` counts "<gguf type> -> <served format> (<how>)" per tensor;
    ``resident`` sums the bytes served per format.
    """

    def __init__(self, path: str, weights: str = "auto") -> None:
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"WEIGHTS must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        self.path, self.weights = path, weights
        self._map, tensors = map_gguf(path)
        self.tensors = {t.name: t for t in tensors}
        self.conversions: Counter[str] = Counter()
        self.resident: Counter[str] = Counter()
        for t in self.tensors.values():
            if t.tensor_type.name not in SUPPORTED:
                raise ValueError(
                    f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which is not supported "
                    f"(supported: {', '.join(SUPPORTED)})"
                )

    def names(self) -> list[str]:
        return list(self.tensors)

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """PyTorch order (GGUF stores ne0, the contiguous dimension, first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def fp32(self, name: str) -> torch.Tensor:
        """The tensor dequantized to fp32 (values exactly as ggml dequantizes them)."""
        t = self.tensors[name]
        kind, shape = t.tensor_type.name, self.shape(name)
        n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        if kind in ("F32", "F16"):
            return torch.from_numpy(np.asarray(t.data).astype(np.float32)).reshape(shape)
        if kind in EXACT:  # Q8_0, Q4_0, Q4_1: our packing holds the exact values
            return dequantize(self._packed(t, n_rows)).reshape(shape)
        import gguf.quants

        out = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # BF16, Q4_K, Q6_K: ggml's fp32 values
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)

    def _parts(
        self, t, n_rows: int, start: int = 0, stop: int | None = None
    ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A Q8_0 / Q4_0 / Q4_1 / Q4_K tensor's (format, q, d, m) in our terms for its rows [start, stop), without
        dequantizing."""
        stop = n_rows if stop is None else stop
        kind, raw = t.tensor_type.name, np.asarray(t.data).reshape(n_rows, -1)[start:stop]  # [rows, row bytes]
        n_rows, k = stop - start, int(t.shape[0])
        if kind == "Q8_0":
            q, d = q8_0_parts(raw, n_rows)
            return "int8", q[:, :k], d, None
        q, d, m = q4_k_parts(raw, n_rows) if kind == "Q4_K" else q4_parts(raw, n_rows, has_min=kind == "Q4_1")
        return "int4", q[:, :k], d, m

    def _packed(self, t, n_rows: int, rows: torch.Tensor | None = None) -> QuantWeight:
        """The tensor repacked into our layout (output rows reordered by ``rows``: exact, a row keeps its blocks)."""
        if rows is None and n_rows > PACK_ROWS:
            return self._packed_in_slices(t, n_rows)
        fmt, q, d, m = self._parts(t, n_rows)
        if rows is not None:
            q, d, m = q[rows], d[rows], None if m is None else m[rows]
        return pack(fmt, q, d, m)

    def _packed_in_slices(self, t, n_rows: int) -> QuantWeight:
        """``_packed`` ``PACK_ROWS`` rows at a time into one buffer. Exact: ``PACK_ROWS`` is whole panels, so no panel
        straddles two slices. Only one slice's unpacked values exist at a time: for SmolLM2's 49152-row Q8_0
        embedding the load's peak is then ~60 MB lower than with all rows unpacked and repacked at once."""
        data = piece = None
        for start in range(0, n_rows, PACK_ROWS):
            piece = pack(*self._parts(t, n_rows, start, min(start + PACK_ROWS, n_rows)))
            if data is None:
                data = torch.empty((-(-n_rows // PANEL), *piece.data.shape[1:]), dtype=piece.data.dtype)
            data[start // PANEL : start // PANEL + piece.data.shape[0]] = piece.data  # [P_slice, G, block bytes]
        return QuantWeight(piece.fmt, data, n_rows, piece.in_features)

    def get(self, name: str, rows: torch.Tensor | None = None) -> torch.Tensor | QuantWeight:
        """Tensor ``name`` as served under this WEIGHTS setting (table in the module docstring).

        ``rows``: a permutation of a matrix's output rows (Llama's Q/K, see ``gguf_state_dict``).
        """
        t = self.tensors[name]
        kind, shape = t.tensor_type.name, self.shape(name)
        want = self.weights
        if len(shape) != 2 or want == "fp32":
            out, how = self.fp32(name), ("exact" if kind in ("F32", "F16", "BF16") else "dequantized")
            out, fmt = out if rows is None else out[rows], "fp32"
        else:
            fmt = (EXACT.get(kind) or NEAREST[kind]) if want == "auto" else want
            out, how = self._convert(t, kind, fmt, shape, rows)
        self.conversions[f"{kind} -> {fmt} ({how})"] += 1
        self.resident[fmt] += out.nbytes if isinstance(out, QuantWeight) else out.numel() * out.element_size()
        self._release(t)
        return out

    def _release(self, t: GGUFTensor) -> None:
        """Drop the tensor's pages of the file map from our RSS once it is converted (the page cache keeps them; a
        later read faults them back in). Without this every page read stays in RSS until the map goes: the
        whole file (94 MiB for SmolLM2) on top of the converted copies at the end of a load."""
        if hasattr(mmap, "MADV_DONTNEED") and self._map is not None and t.n_bytes:
            start = t.data_offset - t.data_offset % mmap.PAGESIZE  # madvise wants a page-aligned start
            self._map.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)

    def _convert(
        self, t, kind: str, fmt: str, shape: tuple[int, ...], rows: torch.Tensor | None
    ) -> tuple[torch.Tensor | QuantWeight, str]:
        if fmt == "fp32":
            out = self.fp32(t.name)
            return (out if rows is None else out[rows]), "exact"
        if EXACT.get(kind) == fmt:
            return self._packed(t, shape[0], rows), "exact"
        if kind == "Q4_K" and fmt == "int4":
            return self._packed(t, shape[0], rows), "requantized: scales rounded to fp16"
        how = "quantized" if kind in ("F32", "F16", "BF16") else "requantized"
        out = self.fp32(t.name)
        return quantize(out if rows is None else out[rows], fmt), how

    def close(self) -> None:
        """Drop the memory map (the served tensors are copies; the map goes with the last view of it)."""
        self.tensors.clear()
        self._map = None


# ---------------------------------------------------------------- fused linears


def _finest(formats: set[str]) -> str:
    """The format that loses nothing of the others' precision: fp32 > int8 > int4."""
    return next(f for f in ("fp32", "int8", "int4") if f in formats)


def cat_rows(parts: list[torch.Tensor | QuantWeight]) -> tuple[torch.Tensor | QuantWeight, str | None]:
    """Stack weights [N_i, K] along output rows into one [sum N_i, K] weight of one format (a fused linear).

    Same format: exact (packed blocks never straddle rows). Mixed formats (a Q4_K_M file's Q6_K V
    beside Q4_K Q and K) go to the finest of them; the second value then says so, for the log.
    """
    formats = {p.fmt if isinstance(p, QuantWeight) else "fp32" for p in parts}
    target = _finest(formats)
    note = None if len(formats) == 1 else f"fused {'+'.join(sorted(formats))} weights served as {target}"
    if len(parts) == 1 and note is None:  # nothing to fuse: the weight as it is (a copy would only cost memory)
        return parts[0], None
    if target == "fp32":
        return torch.cat([dequantize(p) if isinstance(p, QuantWeight) else p for p in parts]).contiguous(), note
    if len(formats) == 1 and all(p.out_features % PANEL == 0 for p in parts[:-1]):
        # Whole panels: the fused weight's panels are the parts' panels in order (no unpack / repack);
        # parts that are consecutive slices of one buffer already (``share_storage``) are that buffer.
        datas = [p.data for p in parts]
        data = _joined(datas)
        data = torch.cat(datas) if data is None else data  # [sum P_i, G, block bytes]
        return QuantWeight(target, data, sum(p.out_features for p in parts), parts[0].in_features), note
    qs, ds, ms = [], [], []
    for p in parts:
        if p.fmt != target:  # only ever int4 -> int8 here
            p = quantize(dequantize(p), target)
        q, d, m = unpack(p)
        qs.append(q)
        ds.append(d)
        ms.append(m)
    m = torch.cat(ms) if target == "int4" else None
    return pack(target, torch.cat(qs), torch.cat(ds), m), note


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


# The weights a family fuses into one linear (its ``cat_rows`` calls), by HF name inside a block.
FUSED = {
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")),
}


def share_storage(sd: dict[str, torch.Tensor | QuantWeight], names: list[str]) -> None:
    """Move the packed weights ``names`` of ``sd`` (one fused group, in the family's order) into one buffer, each
    becoming a slice of it, so that ``cat_rows`` fuses them without a copy: a load then never holds a fused
    weight twice. Exact (the same bytes); groups of mixed formats or of partial panels are left as they are."""
    parts = [sd.get(n) for n in names]
    if not all(isinstance(p, QuantWeight) for p in parts) or len({(p.fmt, p.in_features) for p in parts}) != 1:
        return
    if any(p.out_features % PANEL for p in parts[:-1]):
        return
    base = torch.cat([p.data for p in parts])  # [sum P_i, G, block bytes]
    at = 0
    for name, p in zip(names, parts):
        sd[name] = QuantWeight(p.fmt, base[at : at + p.data.shape[0]], p.out_features, p.in_features)
        at += p.data.shape[0]


# ---------------------------------------------------------------- GGUF names -> Hugging Face names


def llama_qk_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's Q/K permutation (rotary halves interleaved per head).

    GGUF row (h, a, b) (b in {0, 1} interleaved pairs) holds HF row (h, b, a); HF weight = gguf[rows].
    """
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(-1)


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


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: a tensor HF has no use for)."""
    block, top, prefix = {
        "llama": (LLAMA_BLOCK, LLAMA_TOP, "model.layers"),
        "gpt2": (GPT2_BLOCK, GPT2_TOP, "transformer.h"),
    }[model_type]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in block:
        return f"{prefix}.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in top:
        return f"{top[parts[0]]}.{parts[1]}"
    return None  # e.g. rope_freqs.weight: the HF config carries the RoPE settings


def gguf_state_dict(src: GGUFWeights, config) -> dict[str, torch.Tensor | QuantWeight]:
    """The GGUF's tensors under Hugging Face names, one tensor converted at a time.

    fp32 tensors come in HF's layout (GPT-2's Conv1D weights [in, out]); a ``QuantWeight`` is
    always [out, in]. Llama's Q and K rows are put back in HF's order (exact: whole rows move).
    """
    model_type = config.model_type
    if model_type not in ("llama", "gpt2"):
        raise ValueError(f"serving a GGUF of model type {model_type!r} at its own precision is not supported")
    n_head = config.num_attention_heads if model_type == "llama" else config.n_head
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name in src.names():
        target = hf_name(name, model_type)
        if target is None:
            continue
        rows = None
        if model_type == "llama" and target.endswith(("q_proj.weight", "k_proj.weight")):
            rows = llama_qk_rows(src.shape(name)[0], n_head if "q_proj" in target else n_kv_head)
        value = src.get(name, rows)
        if isinstance(value, torch.Tensor) and model_type == "gpt2" and value.dim() == 2:
            if target.rsplit(".", 1)[0].endswith(GPT2_CONV1D):
                value = value.t().contiguous()
        out[target] = value
        _share_when_complete(out, target, FUSED.get(model_type, ()))
    return out


def _share_when_complete(sd: dict, target: str, groups: tuple) -> None:
    """``share_storage`` the fused group of ``target`` (``model.layers.<i>.<name>.weight``) once all of it is in
    ``sd``: group by group, the unfused parts' memory is free again for the next tensors of the load."""
    prefix, _, rest = target.partition(".layers.")
    layer, _, local = rest.partition(".")
    for group in groups:
        if local.removesuffix(".weight") in group:
            names = [f"{prefix}.layers.{layer}.{n}.weight" for n in group]
            if all(n in sd for n in names):
                share_storage(sd, names)


class GGUFModel:
    """A GGUF checkpoint standing in for the HF module a family is built from: ``config``,
    ``generation_config`` and ``state_dict()`` (``gguf_state_dict``: quantized weights stay packed,
    nothing is dequantized unless ``weights`` asks for fp32). The configs are the GGUF's, as
    ``checkpoints.py`` converted and cached them.
    """

    def __init__(self, path: str, config, generation_config, weights: str) -> None:
        self.path = path
        self.config, self.generation_config = config, generation_config
        self.source = GGUFWeights(path, weights)

    def eval(self) -> GGUFModel:
        return self

    def state_dict(self) -> dict[str, torch.Tensor | QuantWeight]:
        """Every tensor, converted one at a time (call once: the memory map is dropped afterwards)."""
        sd = gguf_state_dict(self.source, self.config)
        self.source.close()
        HeapTrimmer().trim()  # the conversion's scratch goes back to the OS before the family allocates its KV pool
        return sd

    def describe(self) -> str:
        """What loading did, for the startup log: each conversion with its tensor count."""
        return ", ".join(f"{n} x {how}" for how, n in sorted(self.source.conversions.items()))


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
