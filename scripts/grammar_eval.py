#!/usr/bin/env python
"""Compare grammar libraries for constrained decoding: compile time and per-step mask cost at batch 8.

    python scripts/grammar_eval.py [TOKENIZER_DIR]     # default: the SmolLM2 checkpoint scripts/fetch_smollm2.py wrote

For each installed library (llguidance, xgrammar, outlines-core) it compiles one JSON schema (nested objects,
arrays, enums, required fields) against the tokenizer, then walks 8 matchers through the tokens of a valid
instance, timing the 8 token masks of every step (one [8, ceil(V/32)] int32 bitmask, as the engine fills it).
Prints one line per library: compile ms, mean / p50 / max per-step ms for the 8 masks. Single-threaded numbers;
a shared machine makes them noisy: compare the libraries within one run.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "12345"},
    "active": True,
}
BATCH = 8


def default_tokenizer_dir() -> str:
    root = os.environ.get("MINIBATCH_CACHE", os.path.expanduser("~/.cache/minibatch-llm"))
    found = sorted(glob.glob(os.path.join(root, "checkpoints", "SmolLM2*")))
    if not found:
        sys.exit("no SmolLM2 checkpoint: run python scripts/fetch_smollm2.py and start the server once, or pass a dir")
    return found[-1]


def walk(fill, advance, tokens: list[int], mask) -> list[float]:
    """Per step: ms to fill the 8 masks (``fill()``), a check that every mask allows the step's token, then
    every matcher takes it (the last token, EOS, is only checked)."""
    times = []
    for step, tok in enumerate(tokens):
        mask.fill_(0)
        t0 = time.perf_counter()
        fill()
        times.append((time.perf_counter() - t0) * 1e3)
        allowed = (mask[:, tok // 32] >> (tok % 32)) & 1
        assert bool(allowed.all()), f"step {step}: token {tok} is masked out"
        if step < len(tokens) - 1:
            advance(tok)
    return times


def bench_llguidance(tok, vocab: int, tokens: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    ms = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    ms[0].compute_bitmask()  # the first mask builds the lexer
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = lt.allocate_token_bitmask(BATCH, vocab)

    def fill():
        for i, m in enumerate(ms):
            lt.fill_next_token_bitmask(m, mask, i)

    def advance(t):
        for m in ms:
            assert m.consume_token(t), m.get_error()

    return compile_ms, walk(fill, advance, tokens, mask)


def bench_xgrammar(tok, vocab: int, tokens: list[int]):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    ms = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = xgr.allocate_token_bitmask(BATCH, vocab)

    def fill():
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(mask, i)

    def advance(t):
        for m in ms:
            assert m.accept_token(t)

    return compile_ms, walk(fill, advance, tokens, mask)


def bench_outlines(tok, vocab: int, tokens: list[int]):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    from models.gguf.tokenizer import byte_alphabet

    t0 = time.perf_counter()
    byte_of = {c: b for b, c in byte_alphabet().items()}
    eos = tok.eos_token_id
    table: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i == eos or i >= vocab or i in tok.all_special_ids:
            continue
        table.setdefault(bytes(byte_of.get(c, 0) for c in text), []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), Vocabulary(eos, table))
    ms = [Guide(index) for _ in range(BATCH)]
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = torch.zeros(BATCH, (vocab + 31) // 32, dtype=torch.int32)

    def fill():
        for i, g in enumerate(ms):
            g.write_mask_into(mask[i].data_ptr(), mask[i].numel(), mask.element_size())

    def advance(t):
        for g in ms:
            g.advance(t)

    return compile_ms, walk(fill, advance, tokens, mask)


def main() -> None:
    from transformers import AutoTokenizer

    path = sys.argv[1] if len(sys.argv) > 1 else default_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(path)
    vocab = len(tok)
    tokens = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False) + [tok.eos_token_id]
    print(f"tokenizer {os.path.basename(path)}: vocab {vocab}; instance of {len(tokens)} tokens; batch {BATCH}")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines)):
        try:
            compile_ms, steps = fn(tok, vocab, tokens)
        except ImportError as exc:
            print(f"{name:14s} not installed ({exc})")
            continue
        except Exception as exc:  # a library that rejects the schema or a token: say so, go on
            print(f"{name:14s} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        print(
            f"{name:14s} compile {compile_ms:8.1f} ms | 8 masks per step: mean {statistics.mean(steps):6.3f} ms, "
            f"p50 {statistics.median(steps):6.3f} ms, max {max(steps):7.3f} ms over {len(steps)} steps"
        )


if __name__ == "__main__":
    main()
