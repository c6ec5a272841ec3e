"""A checkpoint's weights taken over by our forward: contiguous fp32 copies on the device (quantized weights as they
are, on the CPU only), and the checkpoint's file pages dropped from RSS as soon as the model holds its own packed
copies, so a load never holds the whole checkpoint beside the model."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
from collections.abc import Callable

import torch

from .kernels.quant_gemm import QuantParts, QuantWeight


def check_cpu(sd: dict, device: torch.device) -> None:
    """Quantized weights (a GGUF served at its own precision) run on the CPU only."""
    quantized = [x for v in sd.values() for x in (v if isinstance(v, list) else [v])]  # a GGUF's experts: lists
    if device.type != "cpu" and any(isinstance(v, (QuantWeight, QuantParts)) for v in quantized):
        raise ValueError(f"quantized weights run on the CPU only (device is {device}); use WEIGHTS=fp32")


def fp32_state_dict(hf_model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor | QuantWeight]:
    """The HF module's weights as contiguous fp32 tensors on ``device`` (the HF module can then go).

    A GGUF served at its own precision (``models.gguf_model.GGUFModel``) also hands over ``QuantWeight``s, and a
    layer's quantized experts as a list of them, as they are.
    Small tensors (norms, biases, position tables: at most ``OWN_BELOW`` elements) are copied out of the
    checkpoint: safetensors maps the file, and one tensor the model keeps as it is would pin every page of the
    file read during the load (the whole checkpoint) in RSS; the large weights are packed into copies of their own.
    """
    sd = hf_model.state_dict()
    check_cpu(sd, device)
    out = {k: v if isinstance(v, (QuantWeight, list)) else _owned_fp32(v, device) for k, v in sd.items()}
    copied = [v for k, v in sd.items() if isinstance(v, torch.Tensor) and out[k].data_ptr() != v.data_ptr()]
    release_file_pages(copied)  # their pages of the checkpoint's mapping were read by the copy and are not needed
    return out


OWN_BELOW = 1 << 20  # elements: fp32_state_dict copies smaller tensors out of the checkpoint's file mapping


def packed_blocks(sd: dict, prefixes: list[str], build: Callable[[str], object]) -> list:
    """``build(prefix)`` for each block's state-dict prefix, in order; each block's checkpoint pages leave RSS as
    soon as it is packed (``release_file_pages``), so a load never holds the whole checkpoint beside the model."""
    blocks = []
    for prefix in prefixes:
        blocks.append(build(prefix))
        release_file_pages(v for k, v in sd.items() if k.startswith(prefix))
    return blocks


def release_file_pages(tensors) -> int:
    """Drop from RSS the pages of checkpoint tensors (an iterable, or one tensor) that are views of a file mapping
    (safetensors maps the checkpoint), once the model holds packed copies of them; -> bytes released.

    Without this every page read while packing stays resident until the HF model goes, so a load peaks at the
    whole checkpoint on top of the packed model. Only a mapping with no privately modified page is touched (smaps
    ``Anonymous`` 0: a page written through a private file mapping becomes an anonymous copy): each of its pages
    then reads back from the file, so a later read of such a tensor (an embedding used again) sees its values.
    Anonymous memory, partial pages at a tensor's ends, ``QuantWeight``s and anything off Linux are left alone.
    """
    if isinstance(tensors, torch.Tensor):  # one tensor (iterating it would give its rows)
        tensors = [tensors]
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() * t.element_size() >= mmap.PAGESIZE
    ]
    if not spans or not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/smaps"):
        return 0
    files = _file_mappings("/proc/self/maps", lambda _: True)  # cheap: smaps walks every page of every mapping
    spans = [(lo, hi) for lo, hi in spans if any(start <= lo and hi <= end for start, end in files)]
    if not spans:  # copies (a GGUF's tensors are): nothing of a file to release
        return 0
    clean = _file_mappings("/proc/self/smaps", lambda fields: fields.get("Anonymous:") == 0)
    released = 0
    for lo, hi in spans:
        if not any(start <= lo and hi <= end for start, end in clean):
            continue
        start, stop = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages only
        if stop > start and _libc().madvise(start, stop - start, mmap.MADV_DONTNEED) == 0:
            released += stop - start
    return released


_SMAPS_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")  # range perms offset dev inode path


def _file_mappings(listing: str, keep) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of regular files in ``listing`` (/proc/self/maps, or smaps with each
    mapping's fields) for which ``keep({field: kB})`` holds. Of smaps, the clean ones are those with no privately
    modified page (``Anonymous`` 0; not ``Private_Dirty``, which also counts clean file pages mapped as huge
    pages)."""
    out, current, fields = [], None, {}

    def close() -> None:
        if current is not None and keep(fields):
            out.append(current)

    with open(listing) as f:
        for line in f:
            header = _SMAPS_HEADER.match(line)
            if header:
                close()
                path = header.group(3).strip()
                file_backed = path.startswith("/") and not path.endswith("(deleted)")
                current = (int(header.group(1), 16), int(header.group(2), 16)) if file_backed else None
                fields = {}
            elif current is not None:
                name, *value = line.split()
                if name.endswith(":") and value and value[0].isdigit():
                    fields[name] = int(value[0])
    close()
    return out


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _owned_fp32(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = v.detach().to(device=device, dtype=torch.float32).contiguous()
    return out.clone() if out.numel() <= OWN_BELOW and out.data_ptr() == v.data_ptr() else out
