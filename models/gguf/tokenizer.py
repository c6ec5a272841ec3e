"""A GGUF's tokenizer directory written by our code (torch-free, transformers-free): the files a model image's
``tokenizer/`` holds, built with the ``tokenizers`` library straight from the file's vocabulary and merges.

The image's tokenizer directory used to be transformers' conversion of the file (``AutoTokenizer.from_pretrained``
with ``gguf_file``, saved, read back and saved as the generic class by ``text.tokenizer.write_tokenizer_dir``):
seconds of importing transformers and converting a 128k vocabulary in Python on a first start. ``write_tokenizer``
writes the same three files for the vocabularies it knows how to (``written_by_us``), byte for byte what that
conversion writes (tests/test_gguf_tokenizer.py compares the two on files of each kind):

- a byte-level BPE vocabulary (``tokenizer.ggml.model`` ``gpt2``) whose pre-tokenizer (``tokenizer.ggml.pre``) is
  GPT-2's own byte-level split (``PLAIN_PRE``) or Llama 3's regex (``LLAMA3_PRE``).

Anything else (a sentencepiece vocabulary, another split regex) is left to transformers' conversion: the caller
falls back. The pipeline mirrors transformers' ``GPT2Tokenizer`` built by its GGUF integration
(``integrations/gguf/gguf_tokenizer_mapping.py``): the vocabulary respelled in GPT-2's byte alphabet, the merges
as stored, GPT-2's default special token, the file's control tokens as special tokens and its user-defined ones as
plain added tokens, then the file's BOS/EOS/UNK/PAD tokens, and a post-processor adding BOS (or EOS) when the file
asks for it.
"""

from __future__ import annotations

import functools
import json
import os

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
GENERIC_CLASS = "TokenizersBackend"  # the class the image's tokenizer_config.json names (write_tokenizer_dir's)
MODEL_MAX_LENGTH = int(1e30)  # transformers' VERY_LARGE_INTEGER: "no limit" in a saved tokenizer_config.json
GPT2_DEFAULT_TOKEN = "<|endoftext|>"  # GPT2Tokenizer's unk/bos/eos default, added before the file's tokens
# tokenizer.ggml.pre values whose split transformers leaves at GPT-2's byte-level regex (it has no entry for them)
PLAIN_PRE = ("gpt-2", "smollm")
# tokenizer.ggml.pre values transformers splits with Llama 3's regex, then a byte-level step without its own regex
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPM_PRE = (None, "default")  # a sentencepiece vocabulary's tokenizer.ggml.pre: no split regex
LLAMA_DEFAULT_TOKENS = ("<s>", "</s>", "<unk>")  # LlamaTokenizer's bos, eos, unk defaults, in the order it adds them
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
# (tokenizer_config.json key, tokenizer.ggml key of the token id)
SPECIAL_IDS = (
    ("bos_token", "bos_token_id"),
    ("eos_token", "eos_token_id"),
    ("unk_token", "unknown_token_id"),
    ("pad_token", "padding_token_id"),
)


def written_by_us(metadata: dict) -> str | None:
    """None when ``write_tokenizer`` writes this file's tokenizer, else why not (for the caller's debug log)."""
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    tokens, merges = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.merges")
    if kind not in BUILDERS:
        return f"tokenizer.ggml.model {kind!r} (our code writes {', '.join(BUILDERS)})"
    if kind == "gpt2" and pre not in PLAIN_PRE + LLAMA3_PRE:
        return f"tokenizer.ggml.pre {pre!r} (our code writes {', '.join(PLAIN_PRE + LLAMA3_PRE)})"
    if kind == "llama" and pre not in SPM_PRE:
        return f"tokenizer.ggml.pre {pre!r} of a sentencepiece vocabulary (our code writes {SPM_PRE})"
    if not isinstance(tokens, list) or not (isinstance(merges, list) or kind == "llama" and merges is None):
        return "the vocabulary or the merges are missing (or were not read in full)"
    if merges is None and not isinstance(metadata.get("tokenizer.ggml.scores"), list):
        return "a sentencepiece vocabulary with neither merges nor scores"
    if metadata.get("tokenizer.ggml.add_eos_token") is not None:
        return "tokenizer.ggml.add_eos_token is set"
    return None


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spelled(tokens: list[str]) -> dict[str, int]:
    """The vocabulary in the byte alphabet: a token already spelled in it as it is, else its UTF-8 bytes respelled
    (a later duplicate spelling keeps the later id, as a dict comprehension does)."""
    table = byte_alphabet()
    alphabet = set(table.values())
    return {t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}


def build_tokenizer(metadata: dict):
    """The ``tokenizers.Tokenizer`` of a GGUF that ``written_by_us`` accepts and its tokenizer_config.json's
    special tokens ({bos_token, eos_token, unk_token, pad_token}: a token or None)."""

    tokens, kind = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.model"]
    tok = BUILDERS[kind](metadata)
    _add_file_tokens(tok, tokens, metadata.get("tokenizer.ggml.token_type") or (), byte_level=kind == "gpt2")
    if metadata.get("tokenizer.ggml.pre") in LLAMA3_PRE:
        from tokenizers import Regex, pre_tokenizers

        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    special = {
        name: tokens[metadata[f"tokenizer.ggml.{key}"]] if f"tokenizer.ggml.{key}" in metadata else None
        for name, key in SPECIAL_IDS
    }
    _add_special(tok, special.values())
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp adds BOS to an SPM vocab
    tok.post_processor = _post_processor(tok, special["bos_token"], bool(add_bos))
    return tok, special


def _add_special(tok, values) -> None:
    """Add each token of ``values`` (None: none) that is not an added token yet as a special token, in order."""
    from tokenizers import AddedToken

    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    for value in dict.fromkeys(v for v in values if v is not None):  # each once, in this order
        if value not in added:
            tok.add_special_tokens([AddedToken(value, special=True)])


def _byte_level(metadata: dict):
    """transformers' ``GPT2Tokenizer`` of the file: its vocabulary respelled in the byte alphabet, its merges,
    GPT-2's byte-level split and decoder, and GPT-2's own special token."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    vocab = _spelled(metadata["tokenizer.ggml.tokens"])
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, [GPT2_DEFAULT_TOKEN])
    return tok


def _sentencepiece(metadata: dict):
    """transformers' ``LlamaTokenizer`` of the file: BPE over the vocabulary as spelled (byte fallback), the
    file's merges or the ones its scores imply (``spm_merges``), the ``▁`` prefix on the first word, and Llama's
    own special tokens."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    stored = metadata.get("tokenizer.ggml.merges")
    if stored is not None:
        merges = [tuple(m.split(" ")) for m in stored]
    else:
        merges = spm_merges(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"])))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    tok.decoder = decoders.Sequence(steps)
    _add_special(tok, LLAMA_DEFAULT_TOKENS)
    return tok


def spm_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies (transformers' ``generate_merges`` with scores): every split
    of every token into two tokens, a token's splits by the ids of their halves, all of them by score (best
    first), then by the halves' lengths (longest first)."""
    merges = []
    for merge, score in scores.items():
        local = [
            (merge[:i], merge[i:], score) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_file_tokens(tok, tokens: list[str], types, byte_level: bool) -> None:
    """The file's control tokens as special tokens (in a byte-level vocabulary only those spelled in the byte
    alphabet: llama.cpp mislabels others), then its user-defined ones (``<think>``) as plain added tokens, as
    transformers' GGUF integration adds them."""
    from tokenizers import AddedToken

    alphabet = set(byte_alphabet().values())
    control = [t for t, kind in zip(tokens, types) if kind == CONTROL and (not byte_level or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(tok, bos: str | None, add_bos: bool):
    """transformers' ``update_post_processor``: the sequence, with the BOS token before it when the file asks."""
    from tokenizers import processors

    add_bos = add_bos and bos is not None
    single = f"{bos}:0 $A:0" if add_bos else "$A:0"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1"
    special = [(bos, tok.token_to_id(bos))] if add_bos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}  # tokenizer.ggml.model -> the vocabulary's pipeline


def write_tokenizer(metadata: dict, directory: str) -> None:
    """Write the tokenizer directory of a GGUF with this metadata (``read_metadata`` with every array read in
    full) into ``directory`` (created): tokenizer.json, tokenizer_config.json, chat_template.jinja when the file
    has one. Only for a file ``written_by_us`` accepts (ValueError otherwise)."""
    why = written_by_us(metadata)
    if why is not None:
        raise ValueError(f"our code does not write this GGUF's tokenizer: {why}")
    tok, special = build_tokenizer(metadata)
    os.makedirs(directory, exist_ok=True)
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        with open(os.path.join(directory, CHAT_TEMPLATE), "w", encoding="utf-8") as f:
            f.write(template)
    config = {"backend": "tokenizers", **special, "is_local": True, "local_files_only": False}
    config.update(model_max_length=MODEL_MAX_LENGTH, tokenizer_class=GENERIC_CLASS)
    with open(os.path.join(directory, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(config.items())), f, indent=2, ensure_ascii=False)
    tok.save(os.path.join(directory, TOKENIZER_JSON))


class GGUFTokenizer:
    """What the model image's build needs of a GGUF's tokenizer when our code writes it (``load_gguf`` in the
    image's child): the directory written from the file's metadata."""

    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata

    def write_dir(self, directory: str) -> str:
        """``write_tokenizer`` into ``directory``; -> ``directory``."""
        write_tokenizer(self.metadata, directory)
        return directory
