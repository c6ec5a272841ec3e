"""Weights packed at load for the integer path (``int_packed.c``), and when a model's linears are packed.

A Q4_K linear's rows are repacked into panels of 32 output columns whose bytes are already ``vpdpbusd``'s operands
(the same weights and factors, rearranged: no value changes, and the results are bit for bit the unpacked
weights'): a step then streams them linearly and multiplies without reshuffling, 1.05-1.6x the row and panel paths
on a Xeon with AVX-512 VNNI (docs/integer-dot.md, "Packed Q4_K"). A packed part always takes int8 activations, so
it is packed only where the integer path takes Q4_K in every step anyway, on the ISA it was measured on:

    PACK_WEIGHTS=auto   pack where the integer path runs AVX-512 VNNI and ACTIVATIONS gives Q4_K int8 from 1 row
    PACK_WEIGHTS=off    never (the file's own rows, read in place)

``pack_linears`` copies each packable part of a model image's spec (every linear but a tied lm_head, which is also
the token table) into its own buffer and tells the kernel its format is ``type | int_dot.PACKED``; the source's
pages are released as each part is done (``madvise``), so resident bytes stay those of the file and a load's peak
is one part above them. Torch-free.
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

_choice = "auto"
_LIBC = ctypes.CDLL(None, use_errno=True)  # this process's C library: madvise


def set_packing(choice: str) -> None:
    """Apply ``PACK_WEIGHTS`` (``auto`` | ``off``) to the models loaded from now on."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"PACK_WEIGHTS must be one of {', '.join(CHOICES)} (got {choice!r})")
    _choice = choice


def wanted(lib) -> bool:
    """Whether models loaded now have their packable linears packed: ``auto``, the integer path on AVX-512 VNNI in
    ``lib`` (a loaded decode_step / int_dot kernel), and ``ACTIVATIONS`` taking Q4_K int8 from one row."""
    if _choice == "off":
        return False
    isa = int_dot.ISAS[lib.int_dot_isa(-1)]
    return isa == "avx512vnni" and int_dot.rows_for(int_dot.activations(), "Q4_K", isa) == 1


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


def pack_linears(spec: step_abi.ModelSpec, lib, threads: int = 1):
    """``spec`` (handles are addresses into read-only file mappings) with every packable linear part packed into a
    new buffer, the source's pages released once packed -> (the new spec, the buffers it points at: hold them while
    it is used, the bytes packed). A tied lm_head (its weight the token table's) stays as it is."""
    int_dot.declare(lib)
    buffers: list[np.ndarray] = []
    total = 0

    def part(x: step_abi.LinSpec, p: step_abi.PartSpec) -> step_abi.PartSpec:
        nonlocal total
        if p.w == spec.embed or not lib.int_dot_packable(p.fmt, p.N, x.K):
            return p
        nbytes = p.N * BY_ID[p.fmt].row_bytes(x.K)
        owner, address = aligned_empty(nbytes)
        if lib.int_dot_pack(p.fmt, p.w, address, p.N, x.K, threads) != 0:
            raise RuntimeError(f"int_dot_pack refused a [{p.N}, {x.K}] part of GGUF type {p.fmt}")
        release(p.w, nbytes)
        buffers.append(owner)
        total += nbytes
        return dataclasses.replace(p, w=address, fmt=p.fmt | int_dot.PACKED)

    def linear(x: step_abi.LinSpec) -> step_abi.LinSpec:
        return dataclasses.replace(x, parts=[part(x, p) for p in x.parts])

    return step_abi.map_linears(spec, linear), buffers, total
