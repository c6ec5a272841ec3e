"""Static batching baseline: one left-padded batch through HF ``generate(do_sample=False)``.

The whole batch runs to its largest ``max_new_tokens``; each row is then trimmed to its
own budget and its first stop token. This is what continuous batching is measured
against (``scripts/benchmark.py``) and the reference of the parity tests.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.loading import eos_ids


class HFModelRunner:
    def __init__(self, model_id: str, device: str = "cpu", num_threads: int = 0, model=None, tokenizer=None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_id)
        self.model = model or AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
        self.model.to(self.device).eval()
        self.eos_ids: list[int] = sorted(eos_ids(self.model, self.tokenizer))
        # Left padding needs some pad id; the attention mask hides it, so EOS serves when none is set.
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @torch.inference_mode()
    def run_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        ignore_eos: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ) -> list[list[int]]:
        """Generate greedily for a batch of token-id prompts; returns each row's new tokens."""
        ids, mask = left_pad(prompts, self.pad_id)  # each [B, W]
        width = ids.shape[1]
        stops = set(stop_token_ids) | (set() if ignore_eos else set(self.eos_ids))
        # Passed as keywords: a GenerationConfig with eos_token_id=None would fall back to the
        # model's default EOS, silently breaking ignore_eos.
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=False,
            max_new_tokens=max(max_new_tokens),
            eos_token_id=sorted(stops) or None,
            pad_token_id=self.pad_id,
        )  # [B, W + new]
        return [trim(out[row, width:].tolist(), budget, stops) for row, budget in enumerate(max_new_tokens)]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts -> (ids, attention mask), each [B, W] long, W the longest prompt: every row
    right-aligned so that all rows' next token sits in column W (what ``generate`` expects)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def trim(tokens: list[int], budget: int, stops: set[int]) -> list[int]:
    """A row's tokens up to its own budget, ending at (and keeping) its first stop token."""
    tokens = tokens[:budget]
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens
