"""A model image's buffers that are byte ranges of its GGUF file: served from the file's own mapping, never copied.

Most of what the whole-step kernel reads of a GGUF is the file's tensors as they lie: every quantized matrix in its
own blocks (``docs/quantization.md`` "Layout"), the F32 norms, the token table. So the image build
(``models/image.py``) writes to weights.bin only what the load made anew (Llama's Q/K rows put back in HF's order,
Gemma's shifted norms, the RoPE tables, fp32 panels, requantized weights) and records every other buffer as an
offset into the model file, which ``models/native.py`` maps read-only beside weights.bin.

- ``FileTensors.locate(buffer)``: the file range holding exactly the buffer's bytes, or None. A candidate is looked
  up by its first ``PROBE`` bytes and then compared in full, so a range is only ever served where its bytes are the
  buffer's: exact by construction, whatever path the build took.
- ``split_parts(spec, files)``: a fused linear whose part holds file tensors' rows among others (gate+up, a Q+K+V
  of one type) becomes one part per tensor and per run of other rows (the kernel takes up to ``MAX_PARTS``, each
  with its own pointer), so those point into the file too.

Torch-free but for ``flat_bytes`` (a build-side helper that takes torch tensors).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
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
        """A file tensor whose bytes are ``data[at : at + its size]`` (data: flat uint8, contiguous), or None."""
        for t in self._by_head.get(bytes(data[at : at + PROBE]), ()):
            if (
                at + t.n_bytes <= data.size
                and _memcmp(self._bytes(t).ctypes.data, data.ctypes.data + at, t.n_bytes) == 0
            ):
                return t
        return None

    def locate(self, data: np.ndarray) -> FileRange | None:
        """The file range whose bytes are exactly ``data`` (flat uint8), or None."""
        t = self._find(data, 0)
        return FileRange(t.data_offset, t.n_bytes) if t is not None and t.n_bytes == data.size else None

    def segments(self, data: np.ndarray, row_bytes: int) -> list[tuple[int, int, GGUFTensor | None]]:
        """``data`` (flat uint8, rows of ``row_bytes``) cut at row boundaries into [start row, end row) segments,
        each a whole file tensor (its ``GGUFTensor``) or rows that are none (None)."""
        out: list[tuple[int, int, GGUFTensor | None]] = []
        rows, r = data.size // row_bytes, 0
        while r < rows:
            t = self._find(data, r * row_bytes)
            if t is not None and t.n_bytes % row_bytes == 0:
                out.append((r, r + t.n_bytes // row_bytes, t))
                r += t.n_bytes // row_bytes
                continue
            if out and out[-1][2] is None:
                out[-1] = (out[-1][0], r + 1, None)
            else:
                out.append((r, r + 1, None))
            r += 1
        return out


@functools.cache
def _libc_memcmp():
    memcmp = ctypes.CDLL(None).memcmp
    memcmp.restype, memcmp.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


def _memcmp(a: int, b: int, n: int) -> int:
    """libc's memcmp of ``n`` bytes at addresses ``a`` and ``b``: 20x ``np.array_equal`` (which builds a bool array
    of every byte), so comparing a file's weights with the build's costs a fraction of a second."""
    return _libc_memcmp()(a, b, n)


def flat_bytes(t) -> np.ndarray:
    """A contiguous CPU torch tensor's bytes as flat uint8 (a view)."""
    return t.detach().numpy().reshape(-1).view(np.uint8)


def split_parts(spec: step_abi.ModelSpec, files: FileTensors) -> step_abi.ModelSpec:
    """The spec (handles: torch tensors) with each quantized part that holds whole file tensors among its rows cut
    into one part per file tensor (a ``FileRange`` handle) and one per run of other rows (a view of its rows),
    where the linear then has at most ``MAX_PARTS`` parts: a fused gate+up of one type becomes its two file tensors,
    a Q+K+V whose Q and K rows were reordered keeps Q+K and serves V from the file."""

    def cut(p: step_abi.PartSpec) -> list[step_abi.PartSpec]:
        if p.fmt < 0:  # fp32 panels: never the file's bytes
            return [p]
        rows = p.w.reshape(p.N, -1)  # [N, row bytes]
        found = files.segments(flat_bytes(rows), rows.shape[1])
        if len(found) < 2 or all(t is None for _, _, t in found):
            return [p]  # one file tensor as it is (``FileTensors.locate`` finds it when written), or none
        return [
            step_abi.PartSpec(rows[r0:r1] if t is None else FileRange(t.data_offset, t.n_bytes), p.fmt, r1 - r0)
            for r0, r1, t in found
        ]

    def lin(x: step_abi.LinSpec) -> step_abi.LinSpec:
        parts = [q for p in x.parts for q in cut(p)]
        return dataclasses.replace(x, parts=parts) if len(parts) <= step_abi.MAX_PARTS else x

    return step_abi.map_linears(spec, lin)
