"""A GGUF's model image built without transformers (``models/gguf/tokenizer.py``, ``convert.direct_config``): the
tokenizer directory our code writes is byte for byte transformers' conversion of the same file, the image built
that way equals the image built through transformers, and a file our code does not read alone falls back to
transformers saying why (docs/architecture.md "Loading a GGUF")."""

from __future__ import annotations

import filecmp
import json
import logging
import os
import subprocess
import sys

import pytest
from test_gguf_parity import ROOT, gguf_case

from models import image
from models.gguf.reader import read_metadata
from models.gguf.tokenizer import GPT2_DEFAULT_TOKEN, LLAMA3_PRE, PLAIN_PRE, write_tokenizer, written_by_us
from models.kernels import step_abi
from models.loading import convert

from conftest import need_kernel

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.model

TOKENIZER_FILES = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def llama() -> str:
    """A small Llama GGUF (byte-level BPE vocabulary, GPT-2's split) as llama.cpp's converter writes one."""
    return gguf_case("llama", 0)[0]


def transformers_dir(path: str, out: str) -> str:
    """The image's tokenizer directory as transformers' conversion writes it: ``write_gguf_metadata``'s tokenizer
    (``AutoTokenizer`` of the file), read back and saved as the generic class (``write_tokenizer_dir``)."""
    from text.tokenizer import write_tokenizer_dir

    directory, name = os.path.split(path)
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out + "-meta")
    return write_tokenizer_dir(convert.saved_tokenizer(out + "-meta"), out)


def same_files(a: str, b: str, names=TOKENIZER_FILES) -> list[str]:
    """The names among ``names`` whose file differs between the directories (or is in one only)."""
    differ = []
    for name in names:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if os.path.exists(pa) != os.path.exists(pb) or (os.path.exists(pa) and not filecmp.cmp(pa, pb, False)):
            differ.append(name)
    return differ


def tokenizer_gguf(path: str, base: dict, **changes) -> str:
    """A GGUF holding only tokenizer metadata: ``base``'s (``read_metadata`` in full) with ``changes``
    (tokenizer.ggml.<key> -> value; None removes the key; ``chat_template``: tokenizer.chat_template)."""
    template = changes.pop("chat_template", None)
    keys = {k.removeprefix("tokenizer.ggml."): v for k, v in base.items() if k.startswith("tokenizer.ggml.")}
    keys.update(changes)
    keys = {k: v for k, v in keys.items() if v is not None}
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(keys["model"])
    w.add_tokenizer_pre(keys["pre"])
    w.add_token_list(keys["tokens"])
    w.add_token_types(keys["token_type"])
    if "merges" in keys:
        w.add_token_merges(keys["merges"])
    if "scores" in keys:
        w.add_token_scores(keys["scores"])
    ids = {"bos_token_id": w.add_bos_token_id, "eos_token_id": w.add_eos_token_id}
    ids.update(unknown_token_id=w.add_unk_token_id, padding_token_id=w.add_pad_token_id)
    for key, add in ids.items():
        if key in keys:
            add(keys[key])
    if "add_bos_token" in keys:
        w.add_add_bos_token(keys["add_bos_token"])
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocabulary_variants(base: dict) -> dict[str, dict]:
    """Tokenizer metadata variants of ``base``: each kind of token and flag transformers' conversion treats on its
    own (control and user-defined tokens, a token spelled outside the byte alphabet, no ``<|endoftext|>``, BOS
    added, each split our code writes)."""
    tokens, types = list(base["tokenizer.ggml.tokens"]), list(base["tokenizer.ggml.token_type"])
    extra = ["<|begin_of_text|>", "<|eot_id|>", "<think>", "héllo wörld", "<|日本|>"]
    extra_types = [3, 3, 4, 1, 3]  # control, control, user-defined, normal (respelled), control outside the alphabet
    grown = dict(tokens=tokens + extra, token_type=types + extra_types)
    no_eot = [t if t != GPT2_DEFAULT_TOKEN else "<|end|>" for t in tokens]
    n = len(tokens)
    variants = {"as made": {}}
    for pre in PLAIN_PRE + LLAMA3_PRE:
        variants[f"{pre}, BOS added, special tokens"] = dict(
            grown,
            pre=pre,
            bos_token_id=n,
            eos_token_id=n + 1,
            unknown_token_id=0,
            padding_token_id=n + 1,
            add_bos_token=True,
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
        )
    variants["no <|endoftext|>, no BOS id"] = dict(tokens=no_eot, bos_token_id=None, add_bos_token=True)
    variants["no add_bos_token key"] = dict(add_bos_token=None)
    return variants


def sentencepiece_vocabulary() -> dict:
    """Tokenizer metadata of a small sentencepiece vocabulary as llama.cpp's converter writes one (no merges:
    scores; <unk>, <s>, </s>, the 256 byte tokens, then pieces, each piece's halves earlier in the vocabulary)."""
    words = "the quick brown fox jumps over lazy dog hello world it is in on".split()
    pieces = list(dict.fromkeys(c for w in words for c in "\u2581" + w))
    for w in words:
        for n in range(2, len(w) + 2):
            pieces.append(("\u2581" + w)[:n])
    pieces = list(dict.fromkeys(pieces))
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    ids = dict(bos_token_id=1, eos_token_id=2, unknown_token_id=0)
    ids.update(add_bos_token=None)  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say
    return dict(model="llama", pre="default", tokens=tokens, token_type=types, scores=scores, merges=None, **ids)


def test_our_tokenizer_files_are_transformers_conversion(llama, tmp_path):
    """For every variant of a byte-level BPE vocabulary and of a sentencepiece one, the three files our code writes
    are byte for byte those of transformers' conversion, and the tokenizers encode and decode text alike (specials
    included)."""
    from tokenizers import Tokenizer

    base = read_metadata(llama, 1 << 62)[0]
    text = "Hello wörld <|eot_id|> <think> it's 12345 héllo wörld\n\n  x the quick brown fox <s> jumps"
    spm = sentencepiece_vocabulary()
    variants = vocabulary_variants(base)
    variants["sentencepiece"] = spm
    variants["sentencepiece, no BOS added, a control token, a user-defined one"] = dict(
        spm,
        tokens=spm["tokens"] + ["<|im_end|>", "<think>"],
        token_type=spm["token_type"] + [3, 4],
        scores=spm["scores"] + [0.0, 0.0],
        add_bos_token=False,
        padding_token_id=len(spm["tokens"]),
    )
    for i, (name, changes) in enumerate(variants.items()):
        path = tokenizer_gguf(str(tmp_path / f"v{i}.gguf"), base, **changes)
        metadata = read_metadata(path, 1 << 62)[0]
        assert written_by_us(metadata) is None, name
        ours = str(tmp_path / f"ours{i}")
        write_tokenizer(metadata, ours)
        theirs = transformers_dir(path, str(tmp_path / f"theirs{i}"))
        assert same_files(ours, theirs) == [], name
        a, b = (Tokenizer.from_file(os.path.join(d, "tokenizer.json")) for d in (ours, theirs))
        ids = a.encode(text).ids
        assert ids == b.encode(text).ids and a.decode(ids, False) == b.decode(ids, False), name


def test_vocabularies_our_code_does_not_write_fall_back(llama, caplog):
    """A unigram vocabulary, a split regex our code does not write, a byte-level file without merges, an EOS added
    after every text: ``written_by_us`` says why, and ``direct_config`` leaves such a file (and a GPT-2 file, whose
    config is transformers') to transformers with a debug line."""
    base = read_metadata(llama, 1 << 62)[0]
    assert written_by_us(dict(base, **{"tokenizer.ggml.model": "t5"})) is not None
    assert written_by_us(dict(base, **{"tokenizer.ggml.add_eos_token": True})) is not None
    assert written_by_us(dict(base, **{"tokenizer.ggml.pre": "qwen2"})) is not None
    assert written_by_us({k: v for k, v in base.items() if k != "tokenizer.ggml.merges"}) is not None
    assert convert.direct_config(llama) is not None
    with caplog.at_level(logging.DEBUG, logger="minibatch.checkpoints"):
        assert convert.direct_config(gguf_case("gpt2", 0)[0]) is None
    assert "converted by transformers" in caplog.text


def test_the_image_built_without_transformers_equals_the_one_built_with_it(llama, tmp_path, monkeypatch):
    """The image of a Llama GGUF written by our code alone (in a fresh interpreter that never imports
    transformers) equals the one built through transformers' conversion: weights.bin byte for byte, image.json,
    the tokenizer directory."""
    need_kernel(step_abi, "decode step")
    direct, through = str(tmp_path / "direct"), str(tmp_path / "transformers")
    code = (
        "import sys; from models import image; image.write_image(sys.argv[1], 'auto', sys.argv[2]); "
        "print('transformers' in sys.modules, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code, llama, direct], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]  # torch builds the family; transformers was never imported
    monkeypatch.setattr(convert, "direct_config", lambda path: None)
    monkeypatch.setattr(convert, "gguf_cache_dir", lambda path: str(tmp_path / "checkpoint"))
    image.write_image(llama, "auto", through)
    assert filecmp.cmp(os.path.join(direct, image.WEIGHTS_FILE), os.path.join(through, image.WEIGHTS_FILE), False)
    with open(os.path.join(direct, image.META_FILE)) as a, open(os.path.join(through, image.META_FILE)) as b:
        assert json.load(a) == json.load(b)
    tokenizers = [os.path.join(d, image.TOKENIZER_DIR) for d in (direct, through)]
    assert sorted(os.listdir(tokenizers[0])) == sorted(os.listdir(tokenizers[1]))
    assert same_files(*tokenizers, names=os.listdir(tokenizers[0])) == []
