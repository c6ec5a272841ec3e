"""Structured output, request side: a JSON schema, JSON mode, a regex or a choice list -> a grammar, compiled
against the model's tokenizer into one matcher per sequence. No torch.

The grammar library is llguidance (see docs/api.md's "Structured output" for the comparison with xgrammar and
outlines-core), imported only when a request uses a grammar. A grammar is llguidance's grammar text
(``grammar_from("json_schema" | "regex" | "lark", ...)``); compiling it against the tokenizer builds an
``LLMatcher``, which either holds the grammar or an error that names what is not supported (llguidance refuses
JSON-schema keywords it cannot enforce, e.g. ``not``, ``if``/``then``, ``uniqueItems``, instead of ignoring them):
that error becomes a 400.

``GrammarState`` is what a ``Sequence`` carries: the engine asks it for a token mask before sampling the row
(``fill_mask``; the tensor work is in ``sampling.apply_token_bitmask``) and ``Sequence.append_token`` feeds it
every accepted token, so it stays in step with ``output_token_ids`` through preemption (a preempted sequence
keeps its tokens and its matcher, and the recompute prefill samples the next token from where both stopped)
and chunked prefill (only the chunk that ends a prompt samples a token).
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from typing import Any

from guided.errors import GuidedError

MAX_GRAMMAR_CHARS = 100_000  # a schema, regex or choice list longer than this (as text) is refused (422)
MAX_CHOICES = 256


class GrammarError(GuidedError):
    """The grammar cannot be compiled: unsupported construct or malformed input (the message says which)."""


# --- request fields -> grammar text ---------------------------------------------------------------------
# JSON without optional whitespace: a model (a random test model above all) can otherwise pad an answer with
# whitespace until max_tokens. Keys and items are separated by ":" and "," exactly.
COMPACT_JSON = {"whitespace_flexible": False}


def grammar_from(kind: str, text: str) -> str:
    """llguidance's grammar text for a ``json_schema`` (compact JSON), ``regex`` or ``lark`` source."""
    import llguidance  # deferred: only requests that use a grammar load the library

    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} is {len(text)} characters as text; the limit is {MAX_GRAMMAR_CHARS}")
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=COMPACT_JSON)
        return llguidance.grammar_from(kind, text)
    except Exception as exc:  # llguidance raises ValueError / RuntimeError on text it cannot parse
        raise GrammarError(f"invalid {kind}: {_one_line(str(exc))}") from None
    except BaseException as exc:  # a Rust panic surfaces as pyo3's PanicException (a BaseException)
        if not _is_panic(exc):
            raise
        raise GrammarError(f"the {kind} could not be compiled: {_one_line(str(exc))}") from None


def schema_grammar(schema: Any) -> str:
    """A JSON schema (a dict, or ``True`` for any JSON value)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object")
    return grammar_from("json_schema", json.dumps(schema))


def regex_grammar(pattern: str) -> str:
    return grammar_from("regex", pattern)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of ``choices`` (literal strings)."""
    if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"a choice list holds 1 to {MAX_CHOICES} non-empty strings")
    return grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in choices))


def response_format_grammar(value: Any) -> str | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (None: unconstrained), ``{"type": "json_object"}``
    (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``.
    Raises GuidedError naming ``response_format`` for anything else or an unsupported schema."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    try:
        if kind == "json_object":
            return schema_grammar({"type": "object"})
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise GrammarError('json_schema needs {"name": ..., "schema": {...}}')
            return schema_grammar(spec["schema"])
    except GrammarError as exc:
        raise GuidedError(f"`response_format`: {exc}", param="response_format") from None
    raise GuidedError(
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", ...}',
        param="response_format",
    )


def generate_grammar(json_schema: Any, regex: str | None, choice: list[str] | None) -> tuple[str | None, str]:
    """/generate's ``json_schema`` / ``regex`` / ``choice`` (at most one; the schema validates that) as
    (grammar or None, the field it came from)."""
    for param, value, build in (
        ("json_schema", json_schema, schema_grammar),
        ("regex", regex, regex_grammar),
        ("choice", choice, choice_grammar),
    ):
        if value is not None:
            try:
                return build(value), param
            except GrammarError as exc:
                raise GuidedError(f"`{param}`: {exc}", param=param) from None
    return None, ""


# --- compiling against the tokenizer --------------------------------------------------------------------
class GrammarState:
    """One sequence's grammar: an llguidance matcher advanced by every token the sequence accepts."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_mask(self, address: int, nbytes: int) -> None:
        """Write the allowed next tokens into ``nbytes`` of memory at ``address``: one row of an int32 bitmask
        (bit t % 32 of word t // 32 set = token t allowed). Engine thread. (Not ``llguidance.torch``, whose
        import loads torch's compiler: seconds, in the engine thread, on first use.)"""
        self.matcher.unsafe_compute_mask_ptr(address, nbytes)

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (sampled under this grammar's mask)."""
        self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (then the sequence stops)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it (built once, ~1 s for a 49k vocabulary), and matchers.

    ``tokenizer``: anything with a ``tokenizers`` backend (``backend_tokenizer``) and an ``eos_token_id``: a
    ``text.tokenizer.TextTokenizer`` or an HF fast tokenizer; neither path imports transformers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids) -> None:
        import llguidance

        # EOS is what the grammar allows once it is complete: the engine's stop ids (they end the sequence).
        eos = sorted(stop_token_ids) or getattr(tokenizer, "eos_token_id", None)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=eos)

    def matcher(self, grammar: str) -> GrammarState:
        """A fresh matcher for ``grammar``; GrammarError naming the construct it does not support."""
        import llguidance

        try:
            m = llguidance.LLMatcher(self.tokenizer, grammar)
        except BaseException as exc:
            if not _is_panic(exc):
                raise
            raise GrammarError(f"the grammar could not be compiled: {_one_line(str(exc))}") from None
        if m.is_error():
            raise GrammarError(_one_line(m.get_error()))
        return GrammarState(m)


def tokenizer_json(tokenizer) -> str:
    """The tokenizer's Rust pipeline as JSON (its added tokens included), what ``llguidance.LLTokenizer`` reads:
    as ``llguidance.hf.from_tokenizer`` builds it, from a copy with padding and truncation off, without importing
    transformers (which ``llguidance.hf`` does, and transformers imports torch)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(f"structured output needs a fast tokenizer; {type(tokenizer).__name__} is not one")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _is_panic(exc: BaseException) -> bool:
    """pyo3's PanicException: a bug in the library on this input, not a reason to stop the server."""
    return type(exc).__name__ == "PanicException"


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " ".join(line.strip() for line in lines)[:500]


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(engine) -> GrammarCompiler:
    """The engine's compiler, built on first use (call off the event loop). GrammarError when the engine has
    no tokenizer a grammar can be compiled against."""
    with _compilers_lock:
        found = _compilers.get(engine)
        if found is None:
            vocabulary = engine.grammar_vocabulary()
            if vocabulary is None:
                raise GrammarError(f"structured output is not available with model {engine.model_name!r}")
            found = _compilers[engine] = GrammarCompiler(*vocabulary)
        return found
