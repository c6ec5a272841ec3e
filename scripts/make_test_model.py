#!/usr/bin/env python
"""Write a local random-weight GPT-2 or Llama checkpoint (tokenizer included) that MODEL_ID=DIR serves.

    python scripts/make_test_model.py weights/tiny                 # 2 layers, 64 wide: tests, smoke
    python scripts/make_test_model.py weights/d2 --shape distilgpt2 # 6 layers, 768 wide, vocab 50257: benchmarks
    python scripts/make_test_model.py weights/tiny-llama --arch llama            # 2 layers, 64 wide, GQA 4:2, tied
    python scripts/make_test_model.py weights/tiny-llama-untied --arch llama --untied
    python scripts/make_test_model.py weights/s2 --arch llama --shape smollm2    # SmolLM2-135M's shape and cost

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on a small
built-in corpus, so no hub access is needed. Weights use ``initializer_range`` 0.15 by
default: at GPT-2's 0.02 a random model's logits are near-tied and it repeats 2-3 tokens,
which makes a poor parity test.
"""

from __future__ import annotations

import argparse
import os
import sys

SHAPES = {
    # name: (n_layer, n_embd, n_head, n_positions, vocab_size or None = the tokenizer's)
    "tiny": (2, 64, 4, 1024, None),
    "distilgpt2": (6, 768, 12, 1024, 50257),
}

LLAMA_SHAPES = {
    # name: (layers, hidden, heads, kv heads, intermediate, max_position_embeddings, vocab_size or None)
    "tiny": (2, 64, 4, 2, 128, 1024, None),
    "smollm2": (30, 576, 9, 3, 1536, 8192, 49152),
}

EOS = "<|endoftext|>"
PAD = "<pad>"

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Continuous batching lets a server add new requests to a running batch as soon as a slot frees up.
Once upon a time, in a small village by the sea, there lived an old fisherman and his curious cat.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14159 2.71828
Prices rose by 12% in March, while the weather stayed cold and wet across the northern hills.
import torch; x = torch.randn(8, 768); y = x @ x.T  # a matrix product
Emoji and accents: café naïve résumé über 東京 😀 🚀 — “quotes” and ‘apostrophes’.
"""


def train_tokenizer(vocab_size: int, with_pad: bool):
    """A byte-level BPE tokenizer wrapped for transformers (EOS doubles as BOS, like GPT-2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS] + ([PAD] if with_pad else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=PAD if with_pad else None,
        model_input_names=["input_ids", "attention_mask"],
    )


def build_checkpoint(
    out_dir: str,
    shape: str = "tiny",
    initializer_range: float = 0.15,
    seed: int = 0,
    with_pad: bool = False,
    n_positions: int | None = None,
    arch: str = "gpt2",
    tied: bool = True,
    overrides: dict | None = None,
) -> str:
    """Build and save a random checkpoint; returns out_dir. Loads back with from_pretrained(out_dir).

    ``arch`` is "gpt2" or "llama"; ``tied`` (llama only: GPT-2 always ties) shares the embedding
    with the lm_head; ``overrides`` sets further config fields (e.g. ``rope_parameters``).
    """
    tokenizer = train_tokenizer(vocab_size=1000, with_pad=with_pad)
    if arch == "llama":
        model = _llama(tokenizer, shape, initializer_range, seed, n_positions, tied, overrides or {})
    elif arch == "gpt2":
        model = _gpt2(tokenizer, shape, initializer_range, seed, n_positions, overrides or {})
    else:
        raise ValueError(f"unknown arch {arch!r} (gpt2 or llama)")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _llama(
    tokenizer, shape: str, initializer_range: float, seed: int, n_positions: int | None, tied: bool, overrides: dict
):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    n_layer, hidden, n_head, n_kv_head, intermediate, default_positions, vocab = LLAMA_SHAPES[shape]
    config = LlamaConfig(
        **{
            "num_hidden_layers": n_layer,
            "hidden_size": hidden,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv_head,
            "intermediate_size": intermediate,
            "max_position_embeddings": n_positions or default_positions,
            "vocab_size": vocab or len(tokenizer),
            "initializer_range": initializer_range,
            "tie_word_embeddings": tied,
            "bos_token_id": tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **overrides,  # any of the above too (a wider tiny model)
        }
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _gpt2(tokenizer, shape: str, initializer_range: float, seed: int, n_positions: int | None, overrides: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head, default_positions, vocab = SHAPES[shape]
    config = GPT2Config(
        **{
            "n_layer": n_layer,
            "n_embd": n_embd,
            "n_head": n_head,
            "n_positions": n_positions or default_positions,
            "vocab_size": vocab or len(tokenizer),
            "initializer_range": initializer_range,
            "bos_token_id": tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **overrides,  # any of the above too (a wider tiny model)
        }
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--shape", choices=sorted(set(SHAPES) | set(LLAMA_SHAPES)), default="tiny")
    p.add_argument("--untied", action="store_true", help="llama: a separate lm_head instead of the tied embedding")
    p.add_argument("--init-range", type=float, default=0.15, help="initializer_range of the random weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-pad", action="store_true", help="add a pad token distinct from EOS")
    args = p.parse_args(argv)
    if args.shape not in (LLAMA_SHAPES if args.arch == "llama" else SHAPES):
        p.error(f"--shape {args.shape} is not a {args.arch} shape")
    if args.untied and args.arch != "llama":
        p.error("--untied applies to --arch llama only (GPT-2 always ties its lm_head)")
    build_checkpoint(
        args.out_dir, args.shape, args.init_range, args.seed, args.with_pad, arch=args.arch, tied=not args.untied
    )
    print(f"wrote {args.arch} {args.shape} checkpoint to {args.out_dir}; serve it with MODEL_ID={args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
