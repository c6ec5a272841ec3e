"""Weight-format quality: perplexity of a text through our own forward (the kernels the server runs).

``perplexity`` teacher-forces a token sequence through a ``layers.MixedForward``: a prefill of the
first token, then one decode step per token in the KV pool's first blocks, so every logit comes from
the same kernels a served decode step uses. ``PASSAGE_PATH`` is the passage scored per WEIGHTS format
for the README's quality table; the tests score a short text on the tiny model.
"""

from __future__ import annotations

import math
import os

import torch

PASSAGE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quality_passage.txt")


def passage() -> str:
    """The held-out English passage the benchmark scores (written for this project; no download)."""
    with open(PASSAGE_PATH, encoding="utf-8") as f:
        return f.read()


@torch.inference_mode()
def perplexity(model, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of ids[1:] given the tokens before each) under ``model``.

    ``model``'s KV pool must be free and hold ``len(ids)`` tokens (its first blocks are used).
    """
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    table = list(range(-(-len(ids) // model.kv.block_size)))  # blocks 0.. hold positions 0..len(ids)-1
    if len(table) > model.kv.num_blocks:
        raise ValueError(f"{len(ids)} tokens do not fit in the KV pool ({model.kv.num_blocks} blocks)")
    logits = model.prefill([ids[:1]], [table])  # [1, V]: the distribution of ids[1]
    nll = 0.0
    for pos in range(1, len(ids)):
        nll -= torch.log_softmax(logits[0].double(), dim=-1)[ids[pos]].item()
        if pos + 1 < len(ids):
            logits = model.decode([ids[pos]], [pos], [table])
    return math.exp(nll / (len(ids) - 1))
