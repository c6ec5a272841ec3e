"""LoRA on the torch forward: each targeted ``layers.Linear`` adds, after its base output, every adapter's delta over
that adapter's rows of the step (``models/lora.py`` has the math and the format).

``TorchLora`` is a model's adapter state: the resident adapters by slot (their A^T / B^T as torch tensors) and the
row groups of the forward running now (``rows``: set by ``MixedForward.forward`` around a torch forward). Each
targeted linear holds a ``LinearLora`` hook: for each adapter present that targets it, one shrink GEMM over its rows,
x A^T [n, R], then per HF module one expand GEMM into that module's output columns, scaled as PEFT scales it. A step
with no adapter row costs one attribute test per linear.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .kernels.lora_step import KernelLora
from .lora import Adapter, Target, row_groups, target


def targets(blocks: list) -> list[Target]:
    """The linears adapters may target in these blocks (each block's ``lora_linears()``: kind -> (Linear, modules))."""
    return [
        target(i, kind, lin.in_features, modules)
        for i, block in enumerate(blocks)
        for kind, (lin, modules) in block.lora_linears().items()
    ]


class TorchLora:
    """Adapters resident in ``max_loras`` slots of one torch model (its ``blocks``: every targetable linear gets a
    ``LinearLora`` hook), the whole-step kernel's view of them (``kernel``), and the rows of each in the current
    forward."""

    def __init__(self, blocks: list, max_loras: int, device: torch.device) -> None:
        self.device = device
        self.kernel = KernelLora(len(blocks), max_loras)  # the same adapters' arrays, for decode_step.c's hook
        for i, block in enumerate(blocks):
            for kind, (lin, _) in block.lora_linears().items():
                lin.lora = LinearLora(self, i, kind)
        self.slots: list[dict | None] = [None] * max_loras  # slot -> {(layer, kind): (a_t, [(j0, r, n0, N, s, b_t)])}
        self.groups: list[tuple[int, torch.Tensor]] = []  # this forward's (slot, row indices), base rows left out

    def set(self, slot: int, adapter: Adapter | None) -> None:
        self.kernel.set(slot, adapter)
        if adapter is None:
            self.slots[slot] = None
            return
        dev = self.device
        self.slots[slot] = {
            key: (
                torch.from_numpy(x.a_t).to(dev),
                [(p.j0, p.rank, p.n0, p.N, p.scale, torch.from_numpy(p.b_t).to(dev)) for p in x.parts],
            )
            for key, x in adapter.linears.items()
        }

    @contextlib.contextmanager
    def rows(self, slots: np.ndarray):
        """Within it, the forward's token rows belong to these slots (one per row, ``StepLayout.row_slots``; -1: the
        base)."""
        self.groups = [(s, torch.from_numpy(r).to(self.device)) for s, r in row_groups(slots)]
        try:
            yield
        finally:
            self.groups = []


class LinearLora:
    """The hook of one targeted linear (``layer``, ``kind``): adds each present adapter's delta to its output."""

    def __init__(self, state: TorchLora, layer: int, kind: str) -> None:
        self.state, self.key = state, (layer, kind)

    @property
    def active(self) -> bool:
        return bool(self.state.groups)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [N, K] the linear's input, y [N, out] its output (updated in place) -> y."""
        for slot, rows in self.state.groups:
            weights = self.state.slots[slot].get(self.key)
            if weights is None:  # this adapter does not target this linear
                continue
            a_t, parts = weights
            t = x[rows] @ a_t  # [n, R]: every module's x A^T
            for j0, r, n0, n, scale, b_t in parts:
                y[:, n0 : n0 + n].index_add_(0, rows, (t[:, j0 : j0 + r] @ b_t) * scale)
        return y
