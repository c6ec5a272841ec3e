"""A Hugging Face fast tokenizer without transformers (and so without torch): the server's tokenizer on the
torch-free serving path.

``TextTokenizer.from_dir(path)`` reads what an HF fast tokenizer's ``save_pretrained`` writes (tokenizer.json,
tokenizer_config.json, the legacy special_tokens_map.json / added_tokens.json, chat_template.jinja and
additional_chat_templates/, or a template inside the config) with the ``tokenizers`` package, json and jinja2 only.
It gives what ``transformers.AutoTokenizer.from_pretrained(path)`` gives (transformers 5's ``TokenizersBackend``;
tests/test_text_tokenizer.py holds it to that) for what the server uses: ``encode``, ``decode``, the special tokens,
the vocabulary sizes and ``apply_chat_template``, rendered as transformers renders it (a sandboxed Jinja
environment with the same globals and filters).

Exact only for a directory whose ``tokenizer_class`` is the generic one (``TokenizersBackend`` /
``PreTrainedTokenizerFast``: what our test checkpoints and GGUF conversions write; a config naming no class is
read the same way). A model-specific class
(``GPT2Tokenizer``, ``LlamaTokenizer``...) rebuilds its pipeline in Python when transformers loads it, so such a
directory is refused with a clear error; ``write_tokenizer_dir(hf_tokenizer, out)``, run once where transformers
is loaded, saves any fast tokenizer as the generic class: its pipeline as loaded, which reads back the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from text.chat_template import render_chat_template

# transformers' named special tokens, in the order its ``all_special_tokens`` lists them
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json's tokenizer_class values whose loading is tokenizer.json as written, plus the steps below
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class TextTokenizer:
    """Encode, decode, special tokens and chat templates of one saved HF fast tokenizer.

    Thread-safe the way HF's fast tokenizer is: the Rust tokenizer is shared read-only after loading.
    """

    def __init__(self, backend: Tokenizer, config: dict, chat_template: str | dict | None = None) -> None:
        """``backend``: the tokenizers pipeline (tokenizer.json); ``config``: tokenizer_config.json's entries
        (special tokens may be strings or AddedToken dicts); ``chat_template``: a template, or {name: template}."""
        config = dict(config)
        self.tokenizer_class = config.get("tokenizer_class")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers skips the clean-up on a BPE model (it would remove real spaces) unless told this
        force_bpe = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        self._clean_up = self.clean_up_tokenization_spaces and (force_bpe or type(backend.model).__name__ != "BPE")
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        if chat_template is None:
            chat_template = config.get("chat_template")
        if isinstance(chat_template, (list, tuple)):  # the config's form of several named templates
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template: str | dict | None = chat_template
        named, extra = _special_tokens(config)
        self._named: dict[str, str] = {name: _content(value) for name, value in named.items()}
        self._extra: list[str] = [_content(t) for t in extra]
        # Encoding with or without special tokens mutates no state afterwards: padding and truncation off, as
        # transformers sets them for every plain encode.
        backend.no_padding()
        backend.no_truncation()
        _add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, list(named.values()), extra)
        backend.encode_special_tokens = self.split_special_tokens
        if backend.post_processor is None:
            # transformers installs a template that adds nothing: with a tokenizer.json it ignores the config's
            # add_bos_token / add_eos_token
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        self.backend_tokenizer = backend

    # --- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str) -> TextTokenizer:
        """The tokenizer saved in directory ``path`` (see the module docstring for what it reads). ValueError
        when the directory has no tokenizer.json or names a tokenizer class this cannot reproduce."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"{path} has no tokenizer.json (a fast tokenizer's save_pretrained writes one)")
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        name = config.get("tokenizer_class")
        if name is not None and name not in GENERIC_CLASSES:
            raise ValueError(
                f"{path}: tokenizer_class {name!r} rebuilds its tokenizer in transformers, which this module does "
                "not reproduce; save it once with text.tokenizer.write_tokenizer_dir(hf_tokenizer, out_dir)"
            )
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")  # transformers 4's name
        if "added_tokens_decoder" not in config:
            _merge_legacy_files(path, config)
        templates = _read_chat_templates(path)
        template = templates.get("default") if list(templates) == ["default"] else templates or None
        return cls(Tokenizer.from_file(tokenizer_file), config, template)

    # --- special tokens and sizes ----------------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (also the variables a chat template sees)."""
        return dict(self._named)

    def __getattr__(self, name: str):
        """``bos_token`` ... ``mask_token`` and model-specific ``*_token`` names (None when unset), and their
        ``*_token_id`` (the token's id, else the unk token's id, as transformers resolves them)."""
        named = self.__dict__.get("_named")
        if named is None:
            raise AttributeError(name)
        key = name.removesuffix("_id")
        if key in SPECIAL_TOKEN_NAMES or key in named:
            token = named.get(key)
            if token is None or key == name:
                return token
            return self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens, then the extra ones, each once."""
        return list(dict.fromkeys([*self._named.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The token's id (added tokens included); the unk token's id (or None) for a token not in the vocabulary."""
        found = self.backend_tokenizer.token_to_id(token)
        if found is not None:
            return found
        unk = self._named.get("unk_token")
        return None if unk is None else self.backend_tokenizer.token_to_id(unk)

    @property
    def vocab_size(self) -> int:
        """The model's base vocabulary, without added tokens (transformers' ``vocab_size``)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """The whole vocabulary, added tokens included (transformers' ``len(tokenizer)``)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # --- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` -> token ids; the post-processor's special tokens (BOS/EOS) when ``add_special_tokens``.
        Added and special tokens written in the text are matched as tokens (unless ``split_special_tokens``)."""
        if not isinstance(text, str):
            raise ValueError(f"text input must be of type `str`, got {type(text).__name__}")
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
        """Token ids -> text (special tokens left out when ``skip_special_tokens``), with transformers'
        ``clean_up_tokenization_spaces`` when the config sets it (never on a BPE model)."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    # --- chat ------------------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: ``chat_template`` (a template, or the name of one of several), else the
        tokenizer's own (``tool_use`` when there are tools and such a template). ValueError when there is none."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(
                    "This model has multiple chat templates with no default specified! Please either pass a chat "
                    "template or the name of the template you wish to use to the `chat_template` argument. "
                    f"Available template names are {sorted(own)}."
                )
        elif chat_template is None:
            if own is None:
                raise ValueError("the tokenizer has no chat template and none was passed")
            return own
        return chat_template

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """``messages`` rendered through the chat template as transformers renders them: the special tokens
        (``bos_token``...) and ``template_kwargs`` as variables, ``tools`` and ``documents`` passed as given,
        message keys whose value is None dropped. The text, or its ids (no special tokens added) when
        ``tokenize``. Raises what transformers raises: ValueError, TypeError, jinja2's TemplateError (e.g. the
        template's ``raise_exception``)."""
        template = self.get_chat_template(chat_template, tools)
        if isinstance(messages, (list, tuple)) and len(messages) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        rendered = render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, len={len(self)}, special={self.all_special_tokens})"


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and English contractions removed."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


def write_tokenizer_dir(hf_tokenizer, directory: str) -> str:
    """Save a loaded HF fast tokenizer (any class) into ``directory`` as the generic class, so that
    ``TextTokenizer.from_dir`` and transformers both read back exactly this tokenizer: tokenizer.json holds the
    pipeline as the class built it (a model-specific class rebuilds it at load). Needs transformers loaded (it is
    the caller's object); imports nothing itself. Returns ``directory``."""
    if not hasattr(hf_tokenizer, "backend_tokenizer"):
        raise ValueError(f"{type(hf_tokenizer).__name__} is not a fast tokenizer (no tokenizers backend)")
    hf_tokenizer.save_pretrained(directory)
    config_file = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(config_file) or {}
    config["tokenizer_class"] = GENERIC_CLASSES[0]
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return directory


# --- reading a saved directory ---------------------------------------------------------------------------
def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_chat_templates(path: str) -> dict[str, str]:
    """{"default": chat_template.jinja, name: additional_chat_templates/name.jinja}: files transformers prefers
    to the config's ``chat_template``."""
    found = {}
    default = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(default):
        with open(default, encoding="utf-8") as f:
            found["default"] = f.read()
    extra_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    found[name.removesuffix(".jinja")] = f.read()
    return found


def _merge_legacy_files(path: str, config: dict) -> None:
    """transformers 4's special_tokens_map.json (its special tokens override the config's) and added_tokens.json
    (tokens missing from tokenizer.json), read as transformers 5 reads them when the config has no
    ``added_tokens_decoder``."""
    for key, value in (_read_json(os.path.join(path, "special_tokens_map.json")) or {}).items():
        if key == "extra_special_tokens" and isinstance(value, list):
            existing = list(config.get("extra_special_tokens") or [])
            value = existing + [t for t in value if t not in existing]
        config[key] = value
    added = _read_json(os.path.join(path, "added_tokens.json"))
    if added:
        named = {_content(config[k]) for k in SPECIAL_TOKEN_NAMES if config.get(k)}
        named |= {_content(t) for t in _as_list(config.get("extra_special_tokens"))}
        config["added_tokens_decoder"] = {
            str(index): {"content": token, "normalized": token not in named, "special": token in named}
            for token, index in added.items()
        }


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _content(token: Any) -> str:
    """A special token's text: a string, an AddedToken or a saved AddedToken dict ({"content": ...})."""
    if isinstance(token, dict):
        return token["content"]
    return token.content if isinstance(token, AddedToken) else str(token)


def _added_token(token: Any, special: bool | None = None) -> AddedToken:
    """A string or saved dict as transformers' AddedToken (a plain string is special and not normalized)."""
    if isinstance(token, AddedToken):
        return token
    if isinstance(token, dict):
        fields = {k: v for k, v in token.items() if k not in ("__type", "content")}
        if special is not None:
            fields["special"] = special
        return AddedToken(token["content"], **fields)
    return AddedToken(str(token), special=True)


def _special_tokens(config: dict) -> tuple[dict[str, Any], list[Any]]:
    """({name: token} for the named special tokens that are set, in transformers' order: the standard names,
    then the model-specific ``*_token`` keys and a dict ``extra_special_tokens``), [extra special tokens])."""
    named = {k: config[k] for k in SPECIAL_TOKEN_NAMES if config.get(k) is not None}
    extra = config.get("extra_special_tokens")
    if extra is None:
        extra = config.get("additional_special_tokens")
    specific = {
        k: v
        for k, v in config.items()
        if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES and isinstance(v, (str, dict)) and _is_token(v)
    }
    if isinstance(extra, dict):
        specific.update(extra)
        extra = []
    named.update(specific)
    return named, _as_list(extra)


def _is_token(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and value.get("__type") == "AddedToken")


def _add_missing_tokens(backend: Tokenizer, added_tokens_decoder: dict, named: list, extra: list) -> None:
    """What transformers adds to the backend at load: the config's added tokens that tokenizer.json lacks (or has
    with other flags), then every special token not yet an added token (a named one always as special; a string
    as special and unnormalized)."""
    present = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    to_add = [
        token
        for _, token in sorted((int(i), _added_token(t)) for i, t in added_tokens_decoder.items())
        if repr(token) not in present
    ]
    known = [t.content for t in backend.get_added_tokens_decoder().values()] + [t.content for t in to_add]
    for token, special in [(t, True) for t in named] + [(t, None) for t in extra]:
        if _content(token) not in known:
            to_add.append(_added_token(token, special=special))
            known.append(_content(token))
    if to_add:
        backend.add_tokens(to_add)
