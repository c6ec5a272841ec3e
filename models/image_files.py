"""A model image's buffers that are byte ranges of its GGUF file: served from the file's own mapping, never copied.

Most of what the whole-step kernel reads of a GGUF is the file's tensors as they lie: every quantized matrix in its
own blocks (``docs/quantization.md`` "Layout"), the F32 norms, the token table. So the image build
(``models/image.py``) writes to weights.bin only what the load made anew (Llama's Q/K rows put back in HF's order,
Gemma's shifted norms, the RoPE tables, fp32 panels, requantized weights) and records every other buffer as an
offset into the model file, which ``models/native.py`` maps read-only beside weights.bin.

- ``FileTensors.locate(buffer)``: the file range holding exactly the buffer's bytes, or None. A candidate is looked
  up by its first ``PROBE`` bytes and then compared in full, so a range is only ever served where its bytes are the
  buffer's: exact by construction, whatever path the build took.
- ``split_parts(spec, files)``: a fused linear whose part is several file tensors' rows concatenated (gate+up, a
  Q+K+V of one type) becomes one part per tensor (the kernel takes up to ``MAX_PARTS``, each with its own pointer),
  so those point into the file too.

Torch-free but for ``flat_bytes`` (a build-side helper that takes torch tensors).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from models.gguf.reader import GGUFTensor, map_gguf
from models.kernels import step_abi

PROBE = 64  # bytes: a file tensor is found by its first PROBE bytes, then compared in full
MODEL_FILE = "model"  # an image.json buffer entry's "file" when its bytes lie in the model file


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` bytes of the model file from ``offset`` (a buffer handle in a spec being written)."""

    offset: int
    nbytes: int


class FileTensors:
    """The GGUF file ``path``'s tensors, found by content (its tensors of at least ``PROBE`` bytes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map, tensors = map_gguf(path)
        self._by_head: dict[bytes, list[GGUFTensor]] = defaultdict(list)
        for t in tensors:
            if t.n_bytes >= PROBE:
                self._by_head[bytes(self._bytes(t)[:PROBE])].append(t)

    def _bytes(self, t: GGUFTensor) -> np.ndarray:
        return np.frombuffer(self._map, np.uint8, t.n_bytes, t.data_offset)

    def _find(self, data: np.ndarray, at: int) -> GGUFTensor | None:
        """A file tensor whose bytes are ``data[at : at + its size]`` (data: flat uint8), or None."""
        for t in self._by_head.get(bytes(data[at : at + PROBE]), ()):
            if at + t.n_bytes <= data.size and np.array_equal(self._bytes(t), data[at : at + t.n_bytes]):
                return t
        return None

    def locate(self, data: np.ndarray) -> FileRange | None:
        """The file range whose bytes are exactly ``data`` (flat uint8), or None."""
        t = self._find(data, 0)
        return FileRange(t.data_offset, t.n_bytes) if t is not None and t.n_bytes == data.size else None

    def split(self, data: np.ndarray) -> list[GGUFTensor] | None:
        """File tensors whose bytes, one after another, are exactly ``data`` (flat uint8), or None."""
        out, at = [], 0
        while at < data.size:
            t = self._find(data, at)
            if t is None:
                return None
            out.append(t)
            at += t.n_bytes
        return out


def flat_bytes(t) -> np.ndarray:
    """A contiguous CPU torch tensor's bytes as flat uint8 (a view)."""
    return t.detach().numpy().reshape(-1).view(np.uint8)


def split_parts(spec: step_abi.ModelSpec, files: FileTensors) -> step_abi.ModelSpec:
    """The spec with each quantized part that is several whole file tensors in a row replaced by one part per
    tensor (handles ``FileRange``s), where the linear then has at most ``MAX_PARTS`` parts; handles are torch
    tensors."""

    def lin(x: step_abi.LinSpec) -> step_abi.LinSpec:
        parts = []
        for p in x.parts:
            pieces = files.split(flat_bytes(p.w)) if p.fmt >= 0 else None
            row_bytes = p.w.numel() * p.w.element_size() // p.N
            if not pieces or len(pieces) < 2 or any(t.n_bytes % row_bytes for t in pieces):
                parts.append(p)
                continue
            parts += [
                step_abi.PartSpec(FileRange(t.data_offset, t.n_bytes), p.fmt, t.n_bytes // row_bytes) for t in pieces
            ]
        return dataclasses.replace(x, parts=parts) if len(parts) <= step_abi.MAX_PARTS else x

    return step_abi.map_linears(spec, lin)
