#!/usr/bin/env python
"""Write a local random-weight checkpoint of any family we serve (tokenizer included) that MODEL_ID=DIR serves.

    python scripts/make_test_model.py weights/tiny                 # 2 layers, 64 wide: tests, smoke
    python scripts/make_test_model.py weights/d2 --shape distilgpt2 # 6 layers, 768 wide, vocab 50257: benchmarks
    python scripts/make_test_model.py weights/tiny-llama --arch llama            # 2 layers, 64 wide, GQA 4:2, tied
    python scripts/make_test_model.py weights/tiny-llama-untied --arch llama --untied
    python scripts/make_test_model.py weights/s2 --arch llama --shape smollm2    # SmolLM2-135M's shape and cost
    python scripts/make_test_model.py weights/q3 --arch qwen3                    # any family in FAMILIES, tiny
    python scripts/make_test_model.py weights/q3-06 --arch qwen3 --shape qwen3-0.6b  # a released model's shape

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on a small
built-in corpus, so no hub access is needed. Weights use ``initializer_range`` 0.15 by
default: at GPT-2's 0.02 a random model's logits are near-tied and it repeats 2-3 tokens,
which makes a poor parity test. The other families' norm weights and biases (HF initializes them to 1, or 0, or 0
for Gemma's 1 + w) get noise too, so that a norm or bias read wrongly changes the tokens.
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
    "llama-1b": (16, 2048, 32, 8, 8192, 8192, 128256),  # Llama-3.2-1B's tensor shapes (scripts/gpu_check.sh)
}

# The families beyond GPT-2 and Llama at test size: (config class, model class, config fields). Every one is tiny
# (2 layers, 64 wide) with what makes it itself switched on: windows short enough that prompts cross them, an explicit
# head_dim that is not hidden / heads, partial rotary, multipliers, soft-caps that bite, 4 experts of which 2 run.
# Gemma's sqrt(C) embedding scale makes a tied random model repeat its input token (the scaled embedding dominates
# the final state, and the lm_head is that embedding): those test untied (a tied one: ``overrides``).
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"intermediate_size": 128, "sliding_window": 20}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"intermediate_size": 128, "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"intermediate_size": 128, "head_dim": 32}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 96,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "intermediate_size": 128,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 20,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "intermediate_size": 128,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 20,
            "tie_word_embeddings": False,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "intermediate_size": 128,
            "sliding_window": 20,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"intermediate_size": 128}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "intermediate_size": 128,
            "embedding_multiplier": 1.5,
            "attention_multiplier": 0.2,
            "residual_multiplier": 0.6,
            "logits_scaling": 2.5,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 20},
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "clip_qkv": 3.0},
    ),
}
# Released models' shapes (random weights): what the benchmark runs. (arch, config fields beyond TINY's keys)
RELEASED = {
    "qwen2.5-0.5b": (
        "qwen2",
        {
            "num_hidden_layers": 24,
            "hidden_size": 896,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "rms_norm_eps": 1e-6,
        },
    ),
    "qwen3-0.6b": (
        "qwen3",
        {
            "num_hidden_layers": 28,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-6,
        },
    ),
    "gemma-3-1b": (
        "gemma3_text",
        {
            "num_hidden_layers": 26,
            "hidden_size": 1152,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "intermediate_size": 6912,
            "vocab_size": 262144,
            "max_position_embeddings": 32768,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "layer_types": None,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "rms_norm_eps": 1e-6,
        },
    ),
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


# A SentencePiece model trained in a process of its own (``sentencepiece`` is never imported beside torch: its wheel
# carries its own libgomp), then read by transformers' tokenizer class of the family's style, all saved into argv[1].
_SENTENCEPIECE = """
import io, os, sys
import sentencepiece as spm
import transformers
from scripts.make_test_model import _CORPUS

out, style = sys.argv[1], sys.argv[2]
ids = {"gemma": dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3), "llama": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)}
model = io.BytesIO()
spm.SentencePieceTrainer.train(
    sentence_iterator=iter(_CORPUS.splitlines() * 4), model_writer=model, vocab_size=600, model_type="bpe",
    byte_fallback=True, hard_vocab_limit=False, character_coverage=1.0, split_digits=True, add_dummy_prefix=False,
    minloglevel=2, **ids[style])
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "tokenizer.model"), "wb") as f:
    f.write(model.getvalue())
tokenizer = {"gemma": transformers.GemmaTokenizer, "llama": transformers.LlamaTokenizer}[style].from_pretrained(out)
tokenizer.save_pretrained(out)
"""


def sentencepiece_tokenizer(out_dir: str, style: str):
    """A SentencePiece BPE tokenizer (byte fallback) trained on the built-in corpus: ``tokenizer.model`` (what
    llama.cpp's Gemma and Phi-3 converters read) and transformers' files of the ``style`` ("gemma": GemmaTokenizer's
    special ids, "llama": Llama's) in ``out_dir``; returns the transformers tokenizer."""
    import subprocess

    from transformers import AutoTokenizer

    from scripts.build_llamacpp import ensure_sentencepiece

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ensure_sentencepiece(), root])}
    proc = subprocess.run(
        [sys.executable, "-c", _SENTENCEPIECE, out_dir, style], cwd=root, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"training the SentencePiece tokenizer failed: {proc.stderr.strip()[-2000:]}")
    return AutoTokenizer.from_pretrained(out_dir)


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
    tokenizer: str = "bpe",
) -> str:
    """Build and save a random checkpoint; returns out_dir. Loads back with from_pretrained(out_dir).

    ``arch`` is "gpt2", "llama" or a key of ``FAMILIES``; ``shape`` "tiny" or, for those, a key of ``RELEASED``
    (the released model of that architecture's shape); ``tied`` (not GPT-2: it always ties) shares the embedding
    with the lm_head; ``overrides`` sets further config fields (e.g. ``rope_parameters``); ``tokenizer`` "bpe" (the
    byte-level BPE of ``train_tokenizer``) or "spm-gemma" / "spm-llama" (``sentencepiece_tokenizer``).
    """
    import torch

    threads = torch.get_num_threads()
    if shape == "tiny":  # too small to split over threads: a second one only spins
        torch.set_num_threads(1)
    try:
        _build(out_dir, shape, initializer_range, seed, with_pad, n_positions, arch, tied, overrides, tokenizer)
    finally:
        torch.set_num_threads(threads)
    return out_dir


def _build(out_dir, shape, initializer_range, seed, with_pad, n_positions, arch, tied, overrides, kind) -> None:
    if kind == "bpe":
        tokenizer = train_tokenizer(vocab_size=1000, with_pad=with_pad)
    elif kind in ("spm-gemma", "spm-llama") and not with_pad:
        tokenizer = sentencepiece_tokenizer(out_dir, kind.split("-")[1])
    else:
        raise ValueError(f"unknown tokenizer {kind!r} (bpe, spm-gemma or spm-llama; with_pad only for bpe)")
    if arch == "llama":
        model = _llama(tokenizer, shape, initializer_range, seed, n_positions, tied, overrides or {})
    elif arch == "gpt2":
        model = _gpt2(tokenizer, shape, initializer_range, seed, n_positions, overrides or {})
    elif arch in FAMILIES:
        model = _family(tokenizer, arch, shape, initializer_range, seed, n_positions, tied, overrides or {})
    else:
        raise ValueError(f"unknown arch {arch!r} (gpt2, llama or one of {', '.join(FAMILIES)})")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


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


def _family(
    tokenizer,
    arch: str,
    shape: str,
    initializer_range: float,
    seed: int,
    n_positions: int | None,
    tied: bool,
    overrides: dict,
):
    """A ``FAMILIES`` model at test size (or a ``RELEASED`` shape), its norms and biases perturbed (``perturb``)."""
    import torch
    import transformers

    config_class, model_class, fields = FAMILIES[arch]
    fields = {**TINY, **fields}
    if shape != "tiny":
        released_arch, released = RELEASED[shape]
        if released_arch != arch:
            raise ValueError(f"shape {shape} is a {released_arch} shape, not {arch}")
        fields = {k: v for k, v in {**fields, **released}.items() if v is not None or k != "layer_types"}
    config = getattr(transformers, config_class)(
        **{
            "vocab_size": len(tokenizer),
            "max_position_embeddings": n_positions or 1024,
            "initializer_range": initializer_range,
            "tie_word_embeddings": tied,
            "bos_token_id": tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **fields,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    perturb(model, seed)
    return model


def perturb(model, seed: int, std: float = 0.3) -> None:
    """Noise on every norm weight and bias (HF initializes them to constants), so each one changes the output."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith(".bias")):
                p.add_(torch.randn(p.shape, generator=gen) * std)


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
    p.add_argument("--arch", choices=["gpt2", "llama", *FAMILIES], default="gpt2")
    p.add_argument("--shape", choices=sorted(set(SHAPES) | set(LLAMA_SHAPES) | set(RELEASED)), default="tiny")
    p.add_argument("--untied", action="store_true", help="llama: a separate lm_head instead of the tied embedding")
    p.add_argument("--init-range", type=float, default=0.15, help="initializer_range of the random weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-pad", action="store_true", help="add a pad token distinct from EOS")
    args = p.parse_args(argv)
    shapes = LLAMA_SHAPES if args.arch == "llama" else SHAPES if args.arch == "gpt2" else ["tiny"]
    shapes = [*shapes, *(k for k, (a, _) in RELEASED.items() if a == args.arch)]
    if args.shape not in shapes:
        p.error(f"--shape {args.shape} is not a {args.arch} shape ({', '.join(shapes)})")
    if args.untied and args.arch == "gpt2":
        p.error("--untied does not apply to GPT-2 (it always ties its lm_head)")
    build_checkpoint(
        args.out_dir, args.shape, args.init_range, args.seed, args.with_pad, arch=args.arch, tied=not args.untied
    )
    print(f"wrote {args.arch} {args.shape} checkpoint to {args.out_dir}; serve it with MODEL_ID={args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
