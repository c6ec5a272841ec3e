"""Weight-format quality: perplexity of a text through our own forward (the kernels the server runs).

``perplexity`` teacher-forces a token sequence through a ``layers.MixedForward`` in the KV pool's first
blocks, as prompt chunks that return logits at every position (the path a served prompt with
``prompt_logprobs`` takes), so every logit comes from the kernels the server runs at that WEIGHTS
setting; one forward per 64 tokens rather than a decode step per token keeps a 2,000-token score
cheap. ``PASSAGE_PATH`` is the passage scored per WEIGHTS format for the README's quality table; the
tests score a short text on the tiny model.
"""

from __future__ import annotations

import math
import os

import torch

CHUNK = 64  # tokens per forward
PASSAGE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quality_passage.txt")


def passage() -> str:
    """The held-out English passage the benchmark scores (written for this project; no download)."""
    with open(PASSAGE_PATH, encoding="utf-8") as f:
        return f.read()


@torch.inference_mode()
def perplexity(model, ids: list[int], chunk: int = CHUNK) -> float:
    """exp(mean negative log-likelihood of ids[1:] given the tokens before each) under ``model``.

    Teacher-forced as prompt chunks of ``chunk`` tokens, each continuing the KV cache of the ones
    before it and returning logits at every position. ``model``'s KV pool must be free and hold
    ``len(ids)`` tokens (its first blocks are used).
    """
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    table = list(range(-(-len(ids) // model.kv.block_size)))  # blocks 0.. hold positions 0..len(ids)-1
    if len(table) > model.kv.num_blocks:
        raise ValueError(f"{len(ids)} tokens do not fit in the KV pool ({model.kv.num_blocks} blocks)")
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]  # positions start.., each predicting the next
        logits = model.forward_rows([], [], [], [piece], [table], [start], [True])  # [len(piece), V]
        targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
        logp = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
        nll -= logp[torch.arange(len(piece)), targets].sum().item()
    return math.exp(nll / (len(ids) - 1))
