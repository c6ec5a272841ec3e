"""The model runner seam: what the engine asks of a model, whichever runtime built it. No torch.

A ``ModelRunner`` holds a model's weights and its KV block pool and runs one step: a step's rows in (a
``models.step_layout.StepLayout``: decode rows and prompt chunks, which the engine lays out once against the
runner's ``step_limits``), logits rows out (and, for prompts being embedded, their final hidden states), every row's
K/V written into the blocks its table names. The planner decides which rows and which blocks (``core/planner.py``);
the engine (``models.model_engine.ModelEngine``) lays a plan's rows out, hands them to the runner and samples its
logits. Both runtimes read the one numpy layout and keep K/V in one ``models.kv_pool.KVPool`` (numpy); they differ
only in how the weights are built and which kernel steps them:

- ``models.native.NativeModel``: a memory-mapped model image, every step the compiled whole-step kernel
  (``models/kernels/decode_step.c``) in calls of at most ``max_rows`` rows (``step_abi.StepKernel.run``); torch-free.
- ``models.layers.MixedForward`` (a family of ``models/``): weights built through torch from the checkpoint; a
  step runs the same whole-step kernel call, the lean per-layer calls or the torch forward by its size
  (docs/architecture.md, "Which numeric path a step takes"), the latter two over torch views of the layout and the
  pool (``models.mixed_batch.MixedBatch``, ``models.kv_cache.PagedKVCache``), and returns numpy like the native
  runner.

``RowsForward`` gives both the same list-shaped entry points over ``forward`` (``forward_rows``, ``prefill``,
``decode``): the draft model's, the scripts' and the tests'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from models.step_layout import StepLayout, StepLimits


class ModelRunner(Protocol):
    """One model's step over its KV block pool, and what the server and the benchmark ask of it."""

    step_limits: StepLimits  # what a step's ids, positions and blocks must lie within (``StepLayout.build``)

    def forward(
        self, layout: StepLayout, loras: Sequence[int] | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """One step over ``layout``'s rows (built against ``step_limits``): B decode rows, then prompt chunks.

        Returns logits [n_sample, V] float32: the decode rows, then each chunk's last position; a chunk built with
        ``every_position`` has all its positions there instead, in order (prompt logprobs). A chunk built with
        ``hidden`` (a prompt embedded, ``/v1/embeddings``) has no logits rows: its final hidden states (after the
        final norm, before the lm_head: HF's last ``hidden_states``) at every position, in order, come in a second
        array [those chunks' tokens, C], and the result is (logits, hidden) when the layout has any
        (``layout.hidden``). ``loras``: each decode row's, then each chunk's adapter slot (-1: the base; None: every
        row the base's). Every row's K/V is written. ValueError for ``loras`` that do not fit the layout or the
        runner."""
        ...

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` of the KV pool becomes a copy of block ``src``, K and V, every layer (copy-on-write)."""
        ...

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV block pool."""
        ...

    def resident_weights(self) -> dict[str, int]:
        """Bytes of weights held, per format ("fp32", "int8", "int4", ...): every weight's one copy."""
        ...

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights one step streams, per format: a small decode step is bound by these (the roofline)."""
        ...

    def flops_per_token(self, context: int) -> int:
        """FLOPs of one token attending over ``context`` positions (the benchmark's cost model)."""
        ...


class RowsForward:
    """``forward``'s arguments as row lists, for both runners (a base class of each): the step laid out against the
    runner's own ``step_limits``."""

    step_limits: StepLimits

    def forward(self, layout: StepLayout, loras: Sequence[int] | None = None):
        raise NotImplementedError

    def forward_rows(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]] = (),
        prompts: Sequence[Sequence[int]] = (),
        prompt_tables: Sequence[Sequence[int]] = (),
        prompt_starts: Sequence[int] | None = None,
        every_position: Sequence[bool] = (),
        hidden: Sequence[bool] = (),
        loras: Sequence[int] | None = None,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """``forward`` over B decode tokens (``token_ids[b]`` at ``positions[b]``, block table ``tables[b]``) and
        prompt chunks (``prompts[i]`` at positions ``[prompt_starts[i], + len)``, default 0, block table
        ``prompt_tables[i]``; ``every_position[i]``: logits at all its positions; ``hidden[i]``: its final hidden
        states, no logits); every table covers its tokens' positions. ValueError for arguments that do not fit the
        pool, the tables or the context (``StepLayout.build``)."""
        chunks = (prompts, prompt_tables, prompt_starts, every_position, hidden)
        return self.forward(StepLayout.build(self.step_limits, token_ids, positions, tables, *chunks), loras)

    def prefill(self, prompts: Sequence[Sequence[int]], tables: Sequence[Sequence[int]]) -> np.ndarray:
        """Whole prompts into their blocks -> each prompt's last-position logits [len(prompts), V]."""
        return self.forward_rows([], [], [], prompts, tables)

    def decode(self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> np.ndarray:
        """One token per sequence -> logits [B, V]."""
        return self.forward_rows(token_ids, positions, tables)
