"""LoRA adapters for the whole-step kernel: ``lora_step.c``'s structs, filled from ``models.lora.Adapter``s. Torch-free.

``KernelLora`` holds, for ``max_loras`` slots, one ``LoraLin`` per (layer, linear kind, slot) pointing at the
adapter's own numpy arrays (kept alive here); ``step(slots, r0, r1, threads)`` gives the ``Lora`` of one kernel call
over rows [r0, r1): its rows grouped by adapter, and per-thread scratch. Both runtimes pass it to ``decode_step.c``:
the native runner (``models/native.py``) and the torch runtime's whole-step plan (``decode_step.StepPlan``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..lora import KINDS, Adapter
from .step_abi import MAX_PARTS

_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long


class LoraPart(ctypes.Structure):
    _fields_ = [("b_t", _P), ("j0", _I), ("r", _I), ("n0", _I), ("N", _I), ("scale", _F)]


class LoraLin(ctypes.Structure):
    _fields_ = [("a_t", _P), ("R", _I), ("n_parts", _I), ("part", LoraPart * MAX_PARTS)]


class Lora(ctypes.Structure):
    _fields_ = [
        *(("n_groups", _I), ("n_slots", _I), ("slots", _P), ("starts", _P), ("rows", _P)),
        *(("lins", _P), ("scratch", _P), ("scratch_floats", _L)),
    ]


class KernelLora:
    """Adapters of one model as the kernel reads them: ``n_layer`` layers, ``max_loras`` slots."""

    def __init__(self, n_layer: int, max_loras: int) -> None:
        self.n_layer, self.n_slots = n_layer, max_loras
        self.lins = (LoraLin * (n_layer * len(KINDS) * max_loras))()  # zeroed: R 0, no adapter
        self._arrays: list[list[np.ndarray] | None] = [None] * max_loras  # what each slot's structs point at
        self._ranks = [0] * max_loras  # each slot's widest shrink
        self._scratch = np.empty(0, np.float32)

    def _index(self, layer: int, kind: str, slot: int) -> int:
        return (layer * len(KINDS) + KINDS.index(kind)) * self.n_slots + slot

    def set(self, slot: int, adapter: Adapter | None) -> None:
        """Slot ``slot`` holds ``adapter`` (None: nothing)."""
        for layer in range(self.n_layer):
            for kind in KINDS:
                self.lins[self._index(layer, kind, slot)] = LoraLin()
        self._arrays[slot], self._ranks[slot] = None, 0
        if adapter is None:
            return
        keep = []
        for (layer, kind), x in adapter.linears.items():
            parts = [LoraPart(p.b_t.ctypes.data, p.j0, p.rank, p.n0, p.N, p.scale) for p in x.parts]
            self.lins[self._index(layer, kind, slot)] = LoraLin(
                x.a_t.ctypes.data, x.rank, len(parts), (LoraPart * MAX_PARTS)(*parts)
            )
            keep += [x.a_t, *(p.b_t for p in x.parts)]
            self._ranks[slot] = max(self._ranks[slot], x.rank)
        self._arrays[slot] = keep

    def step(self, slots: np.ndarray, r0: int, r1: int, threads: int) -> tuple[Lora, list] | None:
        """The ``Lora`` of a call over rows [r0, r1) of a step whose token rows have ``slots`` (-1: the base), with
        what it points at (keep both until the call returns); None when none of these rows has an adapter."""
        mine = slots[r0:r1]
        rows = np.flatnonzero(mine >= 0)
        if not rows.size:
            return None
        order = rows[np.argsort(mine[rows], kind="stable")]  # grouped by slot, ascending rows within each
        present, counts = np.unique(mine[order], return_counts=True)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        group_slots = present.astype(np.int32)
        order = order.astype(np.int64)
        width = int(counts.max()) * max(self._ranks[s] for s in present)
        if self._scratch.size < threads * width:
            self._scratch = np.empty(threads * width, np.float32)
        lora = Lora(
            *(len(present), self.n_slots, group_slots.ctypes.data, starts.ctypes.data, order.ctypes.data),
            *(ctypes.addressof(self.lins), self._scratch.ctypes.data, width),
        )
        return lora, [group_slots, starts, order]
