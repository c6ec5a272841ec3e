"""The mixed batch: a step's rows (``models.step_layout.StepLayout``, numpy) as the torch forward reads them. B
decode tokens (one per active row ``[0, B)``, each at its own position) and the prompt chunks packed after them,
``[B + T]`` with no padding; each token's KV slot, the decode rows' block tables, and the rows whose logits (or
hidden states) are wanted. On the CPU every tensor is a view of the layout's arrays (``torch.from_numpy``: no copy);
elsewhere a copy on the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .step_layout import StepLayout


@dataclass
class MixedBatch:
    """Where each token of one mixed forward sits: B decode tokens first, then the prompt chunks back to back.

    Every token also has a KV slot (block id, offset in the block) from its sequence's block table.
    A prompt chunk covers positions [start, start + n) of its sequence; ``start`` > 0 when a prompt
    is prefilled over several steps (its earlier positions are already in its blocks).
    Built once per forward, used by every layer.
    """

    ids: torch.Tensor  # [B + T] token ids
    pos: torch.Tensor  # [B + T] positions
    slot_blocks: torch.Tensor  # [B + T] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [B + T] offset of each token's KV slot in its block
    n_decode: int  # B: the decode tokens are rows [0, B) of the activation
    block_tables: torch.Tensor | None  # [B, max_blocks] int32 of the decode rows (padded with 0), None when B = 0
    context_lens: torch.Tensor | None  # [B] int32: decode row b attends positions [0, pos[b]]
    prompts: list[tuple[int, int, int, torch.Tensor]]  # per chunk: (first activation row, length, start, table)
    sample_rows: torch.Tensor | None  # rows whose logits are needed; None = every row (no prompts)
    lean: bool = False  # decode rows only, few enough for the lean path (MixedForward.forward sets it)
    hidden_rows: torch.Tensor | None = None  # rows whose final hidden states are wanted (chunks flagged ``hidden``)

    @classmethod
    def from_layout(cls, layout: StepLayout, device: torch.device) -> MixedBatch:
        """The torch view of a step's rows (the whole-step kernel reads the layout itself: ``StepKernel.run``)."""

        def on(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)  # the CPU: the array itself

        B, P = layout.n_decode, len(layout.chunk_rows)
        block_tables = torch.from_numpy(layout.tables[:B]) if B else None
        context_lens = torch.from_numpy((layout.pos[:B] + 1).astype(np.int32)) if B else None
        ends = np.append(layout.chunk_rows[1:], layout.n)
        chunk_tables = [layout.tables[B + i, : layout.table_lens[B + i]].astype(np.int64) for i in range(P)]
        prompts = [
            (int(r), int(e - r), int(layout.pos[r]), on(t)) for r, e, t in zip(layout.chunk_rows, ends, chunk_tables)
        ]
        return cls(
            on(layout.ids),
            on(layout.pos),
            on(layout.slot_blocks),
            on(layout.slot_offsets),
            B,
            block_tables,
            context_lens,
            prompts,
            on(layout.sample) if layout.sample is not None else None,
            hidden_rows=on(layout.hidden) if layout.hidden is not None else None,
        )
