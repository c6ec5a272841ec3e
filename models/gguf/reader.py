"""Reading a GGUF file's tensor directory (torch-free): the header parsed by hand, the tensors as views of one
read-only memory map.

Unlike ``gguf.GGUFReader`` nothing of the metadata is materialized (its reader builds numpy objects for every
vocabulary entry: about 160 MB resident for SmolLM2 while it lives); only ``general.alignment`` is kept. Every way a
file can be unreadable (not a GGUF, an unsupported version, a truncated or corrupt header, a tensor past the end of
the file, an unknown type id, two tensors with one name) raises ``ValueError`` with a one-line message naming the
file; ``check_servable`` names the first tensor whose type we cannot serve.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .blocks import GGML_TYPES, TYPES


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` in GGUF order (ne0, the contiguous dimension, first); ``data`` a
    read-only view of the memory-mapped file (F32 / F16: [..., ne0] floats; other types: [..., row bytes] uint8)."""

    name: str
    type_name: str  # ggml's name of its type ("Q4_K"), also for types we do not serve ("IQ2_XXS")
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape in PyTorch order (rows first, ne0 last)."""
        return tuple(int(n) for n in reversed(self.shape))

    @property
    def rows(self) -> int:
        """Rows of ne0 elements (1 for a vector)."""
        return int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1

    def raw_rows(self) -> np.ndarray:
        """The bytes as uint8 [rows, row bytes] (a view of the map)."""
        return np.asarray(self.data).view(np.uint8).reshape(self.rows, -1)


_LENGTH = struct.Struct("<Q")  # a string's length
# GGUF metadata value types -> their size in bytes (8: string, 9: array are variable-sized)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_DTYPES = {k: np.dtype("<" + fmt) for k, fmt in _SCALAR_FORMATS.items()}  # the same, for whole arrays


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

    def strings(self, count: int, keep: bool = True) -> list[bytes]:
        """``count`` strings in a row as their UTF-8 bytes (``keep`` False: stepped over; a vocabulary: one tight
        loop, not a call per string)."""
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _LENGTH.unpack_from
        out = []
        for _ in range(count):
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise ValueError("a string runs past the end of the file")
            if keep:
                out.append(buf[pos : pos + n])
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, max_items: int):
        """Read one metadata value: a scalar, a string, or an array (a list; an array of more than ``max_items``
        entries is stepped over and read as its length: a vocabulary is never built)."""
        if vtype in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            start, etype, count = self.pos, self.take("I"), self.take("Q")
            if count > max_items:
                self.pos = start
                self.skip_value(9)
                return count
            if etype == 8:
                return [bytes(b).decode("utf-8") for b in self.strings(count)]
            if etype in _SCALAR_DTYPES:  # a vocabulary's token types or scores: one read, the same Python values
                values = np.frombuffer(self.buf, _SCALAR_DTYPES[etype], count, self.pos)
                self.pos += values.nbytes
                return values.tolist()
            return [self.value(etype, max_items) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

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
            elif etype == 8:
                self.strings(count, keep=False)
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")
        if self.pos > len(self.buf):
            raise ValueError("metadata runs past the end of the file")


def _type_of(name: str, type_id: int) -> tuple[str, int, int]:
    """(type name, block, bytes per block) of a tensor's type id; ValueError for an id ggml does not define."""
    if type_id not in GGML_TYPES:
        raise ValueError(f"tensor {name} has an unknown GGUF type id {type_id}")
    return GGML_TYPES[type_id]


def _read_metadata(cur: _Cursor, n_kv: int, max_items: int | None) -> dict:
    """The metadata key/value pairs (None: only ``general.alignment``, everything else stepped over)."""
    found = {}
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("I")
        if key == "general.alignment" and vtype == 4:
            found[key] = cur.take("I")
        elif max_items is not None:
            found[key] = cur.value(vtype, max_items)
        else:
            cur.skip_value(vtype)
    return found


def _read_tensor_infos(buf, metadata: dict | None = None, max_items: int = 0) -> list[GGUFTensor]:
    """Parse a GGUF (v2/v3) header: the metadata (into ``metadata`` when given, arrays of more than ``max_items``
    entries as their length; else only ``general.alignment`` is kept), then the tensor infos."""
    cur = _Cursor(buf)
    cur.pos = 4  # the magic, checked by map_gguf
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    found = _read_metadata(cur, n_kv, None if metadata is None else max_items)
    if metadata is not None:
        metadata.update(found)
    alignment = found.get("general.alignment", 32)
    if alignment < 1:
        raise ValueError(f"general.alignment is {alignment}")
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("I")
        if n_dims > 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (GGUF allows at most 4)")
        dims = tuple(int(cur.take("Q")) for _ in range(n_dims))
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    if len({info[0] for info in infos}) != len(infos):
        raise ValueError("two tensors have the same name")
    tensors = []
    for name, dims, type_id, offset in infos:
        kind, block, type_size = _type_of(name, type_id)
        n_elems = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name} has rows of {dims[0]} elements, not whole {kind} blocks of {block}")
        n_bytes = n_elems // block * type_size
        at = start + offset
        if at + n_bytes > len(buf):
            raise ValueError(f"truncated: tensor {name} needs bytes up to {at + n_bytes}, the file has {len(buf)}")
        rows = tuple(reversed(dims[1:]))
        if kind in ("F32", "F16"):
            data = np.frombuffer(buf, np.float32 if kind == "F32" else np.float16, n_elems, at)
            data = data.reshape(*rows, dims[0] if dims else 1)
        else:
            row_bytes = (dims[0] if dims else 1) // block * type_size
            data = np.frombuffer(buf, np.uint8, n_bytes, at).reshape(*rows, row_bytes)
        tensors.append(GGUFTensor(name, kind, dims, at, n_bytes, data))
    return tensors


def map_gguf(path: str, metadata: dict | None = None, max_items: int = 64) -> tuple[mmap.mmap, list[GGUFTensor]]:
    """The GGUF file ``path`` memory-mapped read-only, and its tensors (views of that map); or ValueError
    saying why the file is unreadable. ``metadata``: a dict to fill with the file's key/value pairs (an array of
    more than ``max_items`` entries, a vocabulary, as its length)."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the file object
    try:
        return buf, _read_tensor_infos(buf, metadata, max_items)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {exc}") from exc


def open_gguf(path: str) -> list[GGUFTensor]:
    """The tensors of the GGUF file ``path`` (memory-mapped), or ValueError saying why the file is unreadable."""
    return map_gguf(path)[1]


def read_metadata(path: str, max_items: int = 64) -> tuple[dict, list[GGUFTensor]]:
    """(the metadata of the GGUF file ``path``, its tensors): every key's value, an array of more than
    ``max_items`` entries (the vocabulary, its merges) as its length; ValueError when the file is unreadable."""
    metadata: dict = {}
    tensors = map_gguf(path, metadata, max_items)[1]
    return metadata, tensors


SERVED = tuple(TYPES)  # every type the kernels multiply by (models/gguf/blocks.py)


def check_servable(path: str, tensors: list[GGUFTensor]) -> None:
    """ValueError naming the first tensor whose type no kernel serves (one line: the tensor, its type, ours)."""
    for t in tensors:
        if t.type_name not in TYPES:
            raise ValueError(
                f"{path}: tensor {t.name} has GGUF type {t.type_name}, which is not supported "
                f"(supported: {', '.join(SERVED)})"
            )


# --- gguf-py's GGUFReader, as far as transformers' GGUF loader reads it -----------------------------------------


@dataclass
class ReaderField:
    """One metadata entry shaped as gguf-py's ``ReaderField`` for what transformers reads of it: ``types`` (the
    value type; an array's is [9, element type]), ``parts`` and ``data`` (the indices in ``parts`` of the values:
    a string as its UTF-8 bytes, a number as a one-element list)."""

    name: str
    types: list[int]
    parts: list
    data: list[int]


def _field(name: str, vtype: int, value, etype: int | None = None) -> ReaderField:
    """``value`` (a Python value; a list for an array of ``etype``) as a ``ReaderField``."""

    def part(v, t: int):
        return v.encode("utf-8") if t == 8 else [v]

    if vtype != 9:
        return ReaderField(name, [vtype], [part(value, vtype)], [0])
    return ReaderField(name, [9, etype], [part(v, etype) for v in value], list(range(len(value))))


class FieldsReader:
    """A drop-in for ``gguf.GGUFReader`` where transformers only reads metadata (``fields``, ``tensors``' names):
    the header parsed by ``_Cursor`` in about a second, where GGUFReader builds numpy objects for every vocabulary
    entry and merge (17 s for a 128k vocabulary on the 2-core machine). ``convert.write_gguf_metadata`` hands it to
    transformers' tokenizer and config conversion (``fields_reader_installed``); the conversion's output is the same
    (``tests/test_image.py``)."""

    def __init__(self, path: str, mode: str = "r") -> None:
        buf, self.tensors = map_gguf(path, max_items=0)  # the tensors' names (and a check of the whole header)
        cur = _Cursor(buf)
        cur.pos = 4
        version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
        self.fields: dict[str, ReaderField] = {
            "GGUF.version": _field("GGUF.version", 4, version),
            "GGUF.tensor_count": _field("GGUF.tensor_count", 10, n_tensors),
            "GGUF.kv_count": _field("GGUF.kv_count", 10, n_kv),
        }
        for _ in range(n_kv):
            key, vtype = cur.string(), cur.take("I")
            etype = struct.unpack_from("<I", buf, cur.pos)[0] if vtype == 9 else None  # value() reads it again
            if etype == 8:  # strings (a vocabulary, its merges): their bytes are the parts as they are
                cur.pos += 4
                count = cur.take("Q")
                self.fields[key] = ReaderField(key, [9, 8], cur.strings(count), list(range(count)))
            else:
                self.fields[key] = _field(key, vtype, cur.value(vtype, max_items=1 << 62), etype)


@contextlib.contextmanager
def fields_reader_installed() -> Iterator[None]:
    """Within it ``gguf.GGUFReader`` is ``FieldsReader`` (transformers imports it by name when it loads a GGUF's
    metadata)."""
    import gguf

    original = gguf.GGUFReader
    gguf.GGUFReader = FieldsReader
    try:
        yield
    finally:
        gguf.GGUFReader = original
