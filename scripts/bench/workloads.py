"""Workloads: (tokenizer, seed, quick) -> (requests, capacity); the same seeded requests for every system."""

from __future__ import annotations

import random
from dataclasses import dataclass

PROMPT_TEXTS = [
    "Hello!",
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Summarize the plot of a heist movie in two sentences, focusing on the twist at the end.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his curious cat. "
    "Every morning they rowed out past the lighthouse, and every evening they came back with a story. "
    "One day the cat found a bottle with a map inside it.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "# Explain what this function returns for n = 10 and why:\n",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Translate to French: I would like a cup of coffee and a croissant, please.",
]
SWEEP_CAPACITIES = (1, 2, 4, 8, 16, 32)


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int


def seed_workload(tok, seed: int, quick: bool) -> tuple[list[Request], int]:
    """32 requests at t0, capacity 8, prompts from a one-liner to a paragraph and code, budgets 8-48."""
    rng = random.Random(seed)
    reqs = [Request(tok.encode(rng.choice(PROMPT_TEXTS)), rng.choice([8, 16, 32, 48])) for _ in range(32)]
    return (reqs[:8] if quick else reqs), 8


def _window(tok, rng: random.Random, length: int) -> list[int]:
    """A prompt of exactly `length` tokens cut from the prompt texts."""
    ids = tok.encode(" ".join(PROMPT_TEXTS))
    while len(ids) < length + 1:
        ids = ids + ids
    start = rng.randrange(0, len(ids) - length)
    return ids[start : start + length]


def scale_workload(tok, seed: int, quick: bool) -> tuple[list[Request], int]:
    """128 requests at t0, capacity 32, prompts 16-256 tokens, budgets 16-128."""
    rng = random.Random(seed)
    n = 32 if quick else 128
    return [Request(_window(tok, rng, rng.randint(16, 256)), rng.randint(16, 128)) for _ in range(n)], 32


def sweep_workload(tok, seed: int, quick: bool, capacity: int) -> tuple[list[Request], int]:
    """The same 32 requests (prompts 32-64 tokens, 32 new tokens each) at a given capacity."""
    rng = random.Random(seed)
    n = 8 if quick else 32
    return [Request(_window(tok, rng, rng.randint(32, 64)), 16 if quick else 32) for _ in range(n)], capacity


def build_workload(name: str, tok, seed: int, quick: bool, capacity: int = 0):
    if name == "seed":
        return seed_workload(tok, seed, quick)
    if name == "scale":
        return scale_workload(tok, seed, quick)
    if name == "sweep":
        return sweep_workload(tok, seed, quick, capacity)
    raise ValueError(name)


def slot_context(requests: list[Request]) -> int:
    """Tokens of KV cache per slot that every request fits in (llama.cpp gets -c slots x this)."""
    return max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + 8
