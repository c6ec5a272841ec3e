#!/usr/bin/env python
"""llama.cpp's own HF -> GGUF converter (the vendored ``convert_hf_to_gguf.py``), run the way users run it, with one
change made here and not in the vendored file: a BPE pre-tokenizer whose hash the converter does not know gets
``--pre`` (default ``gpt-2``) instead of the converter's refusal.

    python scripts/convert_hf_to_gguf.py CHECKPOINT_DIR --outfile model-f16.gguf --outtype f16 [--pre smollm]

Why the change: the converter recognizes a tokenizer by hashing its tokens of a fixed test string and raises
``NotImplementedError`` for a hash it has no entry for, which every tokenizer trained here (or re-saved by another
transformers version) hits. The pre-tokenizer name only tells llama.cpp how to split text before BPE; the
benchmark sends token ids, so it changes no figure.

A checkpoint with a SentencePiece ``tokenizer.model`` (Gemma, Phi-3) is read with the ``sentencepiece`` package that
``build_llamacpp.ensure_sentencepiece`` installs beside the converter (on ``sys.path`` here only: its wheel carries
its own libgomp, which must never load beside torch's in a serving process).

The converter and its ``gguf-py`` come from ``scripts/build_llamacpp.py``'s ``converter/`` directory (``--converter``
extracts just them from the sdist, without building llama.cpp). The vendored ``gguf-py`` is imported, not the
installed ``gguf`` package: this script runs in a process of its own.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def patch_pre_tokenizer(fallback: str) -> None:
    """An unknown pre-tokenizer hash -> ``fallback`` (the vendored converter must be importable)."""
    import logging

    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("convert").warning("unknown BPE pre-tokenizer: writing tokenizer.ggml.pre=%r", fallback)
            return fallback

    TextModel.get_vocab_base_pre = get_vocab_base_pre

    # A checkpoint without a SentencePiece model (a BPE tokenizer.json, as every tokenizer made here) falls through to
    # the converter's BPE path, as it does with sentencepiece installed: without this, the converter imports
    # sentencepiece before it looks for tokenizer.model. (sentencepiece ships its own libgomp, which the kernels' tests
    # check is never loaded beside torch's.)
    sentencepiece_vocab = TextModel._create_vocab_sentencepiece

    def create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return sentencepiece_vocab(self)

    TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--pre", default="gpt-2", help="tokenizer.ggml.pre for a tokenizer the converter does not know")
    ap.add_argument("--converter", default="", help="directory of convert_hf_to_gguf.py (default: the built one)")
    ours, rest = ap.parse_known_args()
    from scripts.build_llamacpp import ensure_converter, ensure_sentencepiece

    directory = ours.converter or ensure_converter()
    sys.path[:0] = [directory, os.path.join(directory, "gguf-py")]
    model_dir = next((a for a in rest if not a.startswith("-") and os.path.isdir(a)), None)
    if model_dir and os.path.isfile(os.path.join(model_dir, "tokenizer.model")):
        sys.path.insert(0, ensure_sentencepiece())
    os.environ["NO_LOCAL_GGUF"] = "1"  # already first on sys.path
    patch_pre_tokenizer(ours.pre)
    sys.argv = [os.path.join(directory, "convert_hf_to_gguf.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
