"""Weights packed at load for the integer path (``int_packed.c``), and when a model's linears are packed.

A Q4_K or Q6_K linear's rows are repacked into panels of 32 output columns whose bytes are already ``vpdpbusd``'s
operands (the same weights and factors, rearranged: no value changes, and the results are bit for bit the unpacked
weights'): a step then streams them linearly and multiplies without reshuffling, on a Xeon with AVX-512 VNNI level
with the row path at one row and 1.1-2x the row and panel paths at 4 and 8 (docs/integer-dot.md, "Packed Q4_K",
"Packed Q6_K"). A packed part always takes int8 activations, so a type is packed only where the integer path takes
it in every step anyway, on the ISA it was measured on:

    PACK_WEIGHTS=auto   pack where the integer path runs AVX-512 VNNI, each type ACTIVATIONS gives int8 from 1 row
    PACK_WEIGHTS=off    never (the file's own rows, read in place)

``pack_linears`` copies each packable part of a model image's spec into its own buffer and tells the kernel its
format is ``type | int_dot.PACKED`` (a tied lm_head's copy serves the token lookups too); the source's pages are
released as each chunk of a part is done (``madvise``), so resident bytes stay those of the file and a load's peak is
one chunk (``CHUNK_BYTES``) above them, even for a 200 MiB tied lm_head. Torch-free.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap

import numpy as np

from models.gguf.blocks import BY_ID

from . import int_dot, step_abi

CHOICES = ("auto", "off")
ALIGN = 64
PANEL = 32  # int_packed.c's PK_COLS: a packed tensor is whole panels of this many rows
CHUNK_BYTES = 16 * 2**20  # a part is packed this much at a time, its source released after each (the load's peak)

_choice = "auto"
_LIBC = ctypes.CDLL(None, use_errno=True)  # this process's C library: madvise


def set_packing(choice: str) -> None:
    """Apply ``PACK_WEIGHTS`` (``auto`` | ``off``) to the models loaded from now on."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"PACK_WEIGHTS must be one of {', '.join(CHOICES)} (got {choice!r})")
    _choice = choice


def wanted(lib) -> tuple[str, ...]:
    """The GGUF types whose linears models loaded now have packed: under ``auto``, where the integer path runs
    AVX-512 VNNI in ``lib`` (a loaded decode_step / int_dot kernel), each of ``int_dot.PACKABLE`` that
    ``ACTIVATIONS`` takes int8 from one row; none under ``off``."""
    if _choice == "off":
        return ()
    isa = int_dot.ISAS[lib.int_dot_isa(-1)]
    if isa != "avx512vnni":
        return ()
    return tuple(t for t in int_dot.PACKABLE if int_dot.rows_for(int_dot.activations(), t, isa) == 1)


def aligned_empty(nbytes: int) -> tuple[np.ndarray, int]:
    """An uninitialized uint8 buffer of ``nbytes`` starting on a cache line -> (its owner array, its address)."""
    owner = np.empty(nbytes + ALIGN, np.uint8)
    address = owner.ctypes.data
    return owner, address + (-address % ALIGN)


def release(address: int, nbytes: int) -> None:
    """Drop this process's pages of a read-only mapped range (whole pages inside it): its resident bytes go, the
    file's bytes stay (a later read faults them in again)."""
    page = mmap.PAGESIZE
    start = address + (-address % page)
    end = (address + nbytes) // page * page
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def pack_linears(spec: step_abi.ModelSpec, lib, threads: int = 1, types: tuple[str, ...] = int_dot.PACKABLE):
    """``spec`` (handles are addresses into read-only file mappings) with every packable linear part of GGUF type
    ``types`` packed into a new buffer, the source's pages released once packed -> (the new spec, the buffers it
    points at: hold them while it is used, the bytes packed). A tied lm_head's packed copy is the token table too
    (``embed`` and ``embed_fmt`` follow it: the lookup reads a row's blocks back from the panels)."""
    int_dot.declare(lib)
    ids = {int_dot.FORMATS[t] for t in types}
    buffers: list[np.ndarray] = []
    total = 0
    table: dict[str, int] = {}  # the tied lm_head's packed address and format, when packed

    def part(x: step_abi.LinSpec, p: step_abi.PartSpec) -> step_abi.PartSpec:
        nonlocal total
        if p.fmt not in ids or not lib.int_dot_packable(p.fmt, p.N, x.K):
            return p
        row_bytes = BY_ID[p.fmt].row_bytes(x.K)
        nbytes = p.N * row_bytes
        owner, address = aligned_empty(nbytes)
        step = max(1, CHUNK_BYTES // (PANEL * row_bytes)) * PANEL  # rows a chunk: whole panels
        for r0 in range(0, p.N, step):  # chunk by chunk, each chunk's source released once packed
            rows, at = min(step, p.N - r0), r0 * row_bytes
            if lib.int_dot_pack(p.fmt, p.w + at, address + at, rows, x.K, threads) != 0:
                raise RuntimeError(f"int_dot_pack refused a [{p.N}, {x.K}] part of GGUF type {p.fmt}")
            release(p.w + at, rows * row_bytes)
        release(p.w, nbytes)  # the pages that straddled two chunks
        buffers.append(owner)
        total += nbytes
        if p.w == spec.embed:
            table.update(embed=address, embed_fmt=p.fmt | int_dot.PACKED)
        return dataclasses.replace(p, w=address, fmt=p.fmt | int_dot.PACKED)

    def linear(x: step_abi.LinSpec) -> step_abi.LinSpec:
        if len(x.parts) > 1 and any(p.w == spec.embed for p in x.parts):
            return x  # a part of the token table is not the table: left as it is
        return dataclasses.replace(x, parts=[part(x, p) for p in x.parts])

    packed = step_abi.map_linears(spec, linear)
    return dataclasses.replace(packed, **table), buffers, total
