#!/usr/bin/env python
"""Write a random-weight LoRA adapter (PEFT's own ``save_pretrained``) for a checkpoint: what LORA_MODULES serves.

    python -m scripts.make_test_adapter weights/tiny-llama weights/tiny-llama-lora         # rank 8, every linear
    python -m scripts.make_test_adapter weights/tiny weights/tiny-lora --rank 16 --modules c_attn,c_proj

Every lora_A and lora_B weight is random (PEFT initializes B to zero, which would change nothing): normal with
``std``, so the adapter's delta is large enough to change a greedy output. Imports torch and peft.
"""

from __future__ import annotations

import argparse
import sys

# Every linear LoRA targets, per architecture (HF module names; GPT-2's c_proj is both attn.c_proj and mlp.c_proj).
DEFAULT_MODULES = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def build_adapter(
    model_dir: str,
    out_dir: str,
    rank: int = 8,
    alpha: float = 16,
    modules: list[str] | None = None,
    seed: int = 0,
    std: float = 0.1,
    **options,
) -> str:
    """A PEFT LoRA adapter of ``model_dir``'s checkpoint with random A and B written to ``out_dir``; -> out_dir.
    ``options``: further ``peft.LoraConfig`` fields (``use_rslora``, ``use_dora``, ``bias``...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    arch = "gpt2" if model.config.model_type == "gpt2" else "llama"
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=modules or DEFAULT_MODULES[arch],
        lora_dropout=0.0,
        fan_in_fan_out=arch == "gpt2",  # GPT-2's Conv1D stores W as [in, out]
        task_type="CAUSAL_LM",
        **options,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--modules", default="", help="comma-separated HF module names (default: every linear)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.1)
    args = parser.parse_args(argv)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()] or None
    build_adapter(args.model_dir, args.out_dir, args.rank, args.alpha, modules, args.seed, args.std)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
