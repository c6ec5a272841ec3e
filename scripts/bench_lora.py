#!/usr/bin/env python
"""The LoRA step's cost against the base step, side by side in one process (docs/api.md "LoRA adapters").

    python -m scripts.bench_lora                              # SmolLM2's shape, int8 (Q8_0), batch 8, 2 threads
    python -m scripts.bench_lora --shape distilgpt2 --weights fp32

A random checkpoint of the shape (``scripts/make_test_model.py``, cached) is built as the torch runtime builds it;
8 sequences of ``--context`` tokens are prefilled, then decode steps of the 8 rows run through the whole-step kernel
(``decode_step.c``, the native runtime's step too): the base step (no adapter), and every row under an adapter of
rank 8 or 16, one adapter for all 8 rows or four adapters of 2 rows each, every adapter on all seven linears of each
layer (GPT-2: c_attn, both c_proj, c_fc). The configurations alternate step by step (round robin), so the box's load
hits them alike; each is reported as its median step time and its ratio to the base's, with the CPU and the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from models.lora import Adapter, LoraLinear, LoraPart

SHAPES = {"smollm2": "llama", "distilgpt2": "gpt2"}


def random_adapter(name: str, targets: list, rank: int, seed: int) -> Adapter:
    """An adapter of ``rank`` on every target, A and B normal (std 0.02): what read_adapter gives for such a file."""
    rng = np.random.default_rng(seed)
    adapter = Adapter(name, f"<random {name}>", rank)
    for t in targets:
        a_t = rng.standard_normal((t.K, rank * len(t.parts)), np.float32) * 0.02
        parts = [
            LoraPart(i * rank, rank, n0, n, 2.0, rng.standard_normal((rank, n), np.float32) * 0.02)
            for i, (_, n0, n) in enumerate(t.parts)
        ]
        adapter.linears[(t.layer, t.kind)] = LoraLinear(np.ascontiguousarray(a_t), parts)
    return adapter


def build_model(shape: str, weights: str, context: int, batch: int):
    """The shape's random checkpoint (built once into the cache) as the torch runtime builds it: our model."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import families
    from models.cache_dir import cache_subdir
    from scripts.make_test_model import build_checkpoint

    path = os.path.join(cache_subdir("bench"), f"random-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_checkpoint(path, shape=shape, arch=SHAPES[shape], tied=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    blocks = batch * (-(-(context + 8) // 32))
    family = families()[hf.config.model_type]
    return family(hf, batch, context + 8, torch.device("cpu"), num_blocks=blocks, block_size=32, weights=weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--weights", choices=["fp32", "int8", "int4"], default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    from models.runtime_config import thread_environment

    thread_environment()
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args.shape, args.weights, args.context, args.batch)
    assert model.fused_step is not None, "the whole-step kernel does not run here"
    targets = model.lora_targets()
    model.enable_lora(8)
    for slot, (rank, seed) in enumerate((r, s) for r in (8, 16) for s in range(4)):
        model.set_lora(slot, random_adapter(f"r{rank}-{seed}", targets, rank, slot))
    B, per_seq = args.batch, -(-(args.context + 8) // 32)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
    rng = np.random.default_rng(0)
    for b in range(B):  # prefill each sequence's context
        model.forward_rows([], [], [], [rng.integers(0, 1000, args.context).tolist()], [tables[b]])
    ids, pos = [7] * B, [args.context] * B
    configs = {
        "base": None,
        "rank 8, 1 adapter": [0] * B,
        "rank 8, 4 adapters": [b % 4 for b in range(B)],
        "rank 16, 1 adapter": [4] * B,
        "rank 16, 4 adapters": [4 + b % 4 for b in range(B)],
    }
    times: dict[str, list[float]] = {k: [] for k in configs}
    load = os.getloadavg()
    for _ in range(3):  # warm-up
        for slots in configs.values():
            model.forward_rows(ids, pos, tables, loras=slots)
    for _ in range(args.rounds):
        for name, slots in configs.items():
            t0 = time.perf_counter()
            model.forward_rows(ids, pos, tables, loras=slots)
            times[name].append(time.perf_counter() - t0)
    after = os.getloadavg()
    base = statistics.median(times["base"])
    print(f"# {args.shape} random, WEIGHTS={args.weights}, batch {B}, context {args.context}, {args.threads} threads")
    print(f"# CPU: {cpu_name()}; load average {load[0]:.1f} before, {after[0]:.1f} after; {args.rounds} rounds")
    print("| step | median ms | vs base |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.2f}x |")
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
