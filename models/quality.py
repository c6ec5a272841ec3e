"""Weight-format quality: perplexity of a text through our own forward (the kernels the server runs).

``perplexity`` teacher-forces a token sequence through a ``layers.MixedForward``: a prefill of the
first token, then one decode step per token in cache row 0, so every logit comes from the same
kernels a served decode step uses. ``scripts/benchmark.py --workload quality`` scores
``PASSAGE_PATH`` per WEIGHTS format; the tests score a short text on the tiny model.
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

    ``model`` needs one free cache row (row 0) and ``len(ids)`` positions of context.
    """
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    logits = model.prefill([ids[:1]], [0])  # [1, V]: the distribution of ids[1]
    nll = 0.0
    for pos in range(1, len(ids)):
        nll -= torch.log_softmax(logits[0].double(), dim=-1)[ids[pos]].item()
        if pos + 1 < len(ids):
            logits = model.decode([ids[pos]], [pos])
    return math.exp(nll / (len(ids) - 1))
