"""Structured output, request side: a JSON schema, JSON mode, a regex or a choice list -> a grammar, compiled
against the model's tokenizer into one matcher per sequence. No torch.

The grammar library is llguidance (see docs/api.md's "Structured output" for the comparison with xgrammar and
outlines-core), imported only when a request uses a grammar. A grammar is llguidance's grammar text
(``grammar_from("json_schema" | "regex" | "lark", ...)``); compiling it against the tokenizer builds an
``LLMatcher``, which either holds the grammar or an error that names what is not supported (llguidance refuses
JSON-schema keywords it cannot enforce, e.g. ``not``, ``if``/``then``, ``uniqueItems``, instead of ignoring them):
that error becomes a 400.

Compiling is once per distinct grammar (``GrammarCompiler.compile``: a bounded cache of ``CompiledGrammar``, each an
``LLMatcher`` never advanced); every sequence gets a ``GrammarState`` over it, whose own matcher is a copy of the
compiled one (``deep_copy``: ~0.4 ms and ~70 KB, where compiling a 60k-character enum again took 70 ms and 3 MB per
sequence). The copy exists only while the sequence holds a batch slot: made at its first mask, dropped when it
finishes or is preempted (and replayed from its tokens when readmitted), so the matchers alive are at most the batch,
and the compiled grammars alive at most ``MAX_LIVE_GRAMMARS`` (a new one beyond it is a 503).

``GrammarState`` is what a ``Sequence`` carries: the engine asks it for a token mask before sampling the row
(``fill_mask``; the tensor work is in ``sampling.apply_token_bitmask``) and ``Sequence.append_token`` feeds it
every accepted token, so it stays in step with ``output_token_ids`` through preemption and chunked prefill (only the
chunk that ends a prompt samples a token). A matcher that fails (llguidance's parser limits, a grammar with no way
on) puts its error in ``GrammarState.error``: the sequence ends with finish_reason "error" and a 422, never "stop".
A JSON schema with no finite instance (a required property or item that recurses through ``$ref`` with no way out) is
refused before anything runs (``schema_grammar``).
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections import OrderedDict
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
    """A JSON schema: a dict, or ``True`` for any JSON value (``False`` admits none: refused). A schema with no finite
    instance is refused here (``finite_instance_problem``): no answer to it could ever be complete."""
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError("the schema `false` admits no value")
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    text = json.dumps(schema)
    if len(text) <= MAX_GRAMMAR_CHARS:
        problem = finite_instance_problem(schema)
        if problem:
            raise GrammarError(f"the schema has no finite instance: {problem}")
    return grammar_from("json_schema", text)


# --- schemas no finite value satisfies -------------------------------------------------------------------------
_SCALARS = {"string", "number", "integer", "boolean", "null"}


def finite_instance_problem(schema: dict) -> str | None:
    """Why no finite JSON value satisfies ``schema``, or None when one may. llguidance refuses contradictions it sees
    in one place (minLength above maxLength, an empty enum), but a required property or item that leads back through
    ``$ref`` to where it started it compiles, and its matcher then grows without end and fails mid-answer. This finds
    those: the least fixpoint of "has a finite instance" over the ``$ref`` targets (each starts without one; a pass
    over the schema per round; a target that gains one never loses it), for type, required properties, minItems and
    prefix items, allOf/anyOf/oneOf and $ref. What it does not model (patterns, numeric ranges, not, if/then) counts
    as satisfiable and is left to llguidance."""
    targets: dict[str, Any] = {}
    _collect_refs(schema, schema, targets)
    targets["#"] = schema
    known = dict.fromkeys(targets, False)
    for _ in range(len(targets) + 1):
        changed = False
        for ref, node in targets.items():
            if not known[ref] and _inhabited(node, known, 0):
                known[ref] = changed = True
        if not changed:
            break
    if known["#"]:
        return None
    loops = sorted(ref for ref, ok in known.items() if not ok and ref != "#")
    where = f" ({', '.join(loops[:5])})" if loops else ""
    return f"every value needs a required property or item that leads back through $ref to itself{where}"


def _collect_refs(node: Any, root: dict, targets: dict[str, Any]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in targets:
            target = _resolve(root, ref)
            if target is not None:
                targets[ref] = target
        for value in node.values():
            _collect_refs(value, root, targets)
    elif isinstance(node, list):
        for value in node:
            _collect_refs(value, root, targets)


def _resolve(root: dict, ref: str) -> Any:
    """A local JSON pointer (``#``, ``#/$defs/a``); None for anything else (left to llguidance)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _inhabited(node: Any, known: dict[str, bool], depth: int) -> bool:
    """Whether some finite value satisfies ``node``, taking ``known`` for what each ``$ref`` target has."""
    if node is False:
        return False
    if not isinstance(node, dict) or depth > 200:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, True):
        return False
    if not all(_inhabited(sub, known, depth + 1) for sub in _list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        options = _list(node.get(key))
        if key in node and not any(_inhabited(sub, known, depth + 1) for sub in options):
            return False
    if "const" in node or "enum" in node:
        return True  # a listed value is finite (an empty enum is llguidance's to refuse)
    types = node.get("type")
    types = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else None
    if types is None or types & _SCALARS:
        return True
    if "object" in types and _object_inhabited(node, known, depth):
        return True
    return "array" in types and _array_inhabited(node, known, depth)


def _object_inhabited(node: dict, known: dict[str, bool], depth: int) -> bool:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    for name in _list(node.get("required")):
        sub = properties.get(name, extra) if isinstance(name, str) else True
        if not _inhabited(sub, known, depth + 1):
            return False
    return True


def _array_inhabited(node: dict, known: dict[str, bool], depth: int) -> bool:
    need = node.get("minItems", 0)
    need = need if isinstance(need, int) and not isinstance(need, bool) else 0
    prefix = _list(node.get("prefixItems"))
    items = node.get("items", True)
    if isinstance(items, list):  # draft 4-2019: a list of items is the prefix, additionalItems the rest
        prefix, items = items, node.get("additionalItems", True)
    for i in range(min(need, len(prefix) + 1)):
        if not _inhabited(prefix[i] if i < len(prefix) else items, known, depth + 1):
            return False
    return True


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


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
MAX_CACHED_GRAMMARS = 32  # compiled grammars kept for reuse after their last request (least recently used first out)
MAX_LIVE_GRAMMARS = 64  # compiled grammars alive at once (cached or in use); a new one beyond it: GrammarBusyError


class GrammarBusyError(GrammarError):
    """MAX_LIVE_GRAMMARS distinct grammars are in use by requests in flight: retry (a 503)."""


class CompiledGrammar:
    """One grammar compiled against the tokenizer: an ``LLMatcher`` that is only ever copied, never advanced."""

    def __init__(self, template, text: str) -> None:
        self.template = template
        self.text = text

    def __repr__(self) -> str:
        return f"CompiledGrammar({len(self.text)} characters)"


class GrammarState:
    """One sequence's grammar: a copy of the compiled matcher, advanced by every token the sequence accepts. The copy
    is made at the first use (the engine thread, at admission) and dropped by ``release`` (the sequence finished, or
    left its slot); a later use replays the accepted tokens onto a fresh copy."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.tokens: list[int] = []  # every token accepted so far
        self._matcher = None
        self._error: str | None = None

    @property
    def matcher(self):
        if self._matcher is None:
            m = self.compiled.template.deep_copy()
            if self.tokens:
                m.consume_tokens(self.tokens)
            self._matcher = m
        return self._matcher

    def release(self) -> None:
        """Drop the matcher copy (its memory); the state stays and is rebuilt on the next use."""
        self._matcher = None

    def fill_mask(self, address: int, nbytes: int) -> None:
        """Write the allowed next tokens into ``nbytes`` of memory at ``address``: one row of an int32 bitmask
        (bit t % 32 of word t // 32 set = token t allowed). Engine thread. (Not ``llguidance.torch``, whose
        import loads torch's compiler: seconds, in the engine thread, on first use.)"""
        self.matcher.unsafe_compute_mask_ptr(address, nbytes)

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (sampled under this grammar's mask)."""
        self.tokens.append(token_id)
        self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (then the sequence stops). A matcher in error is stopped
        too, but not finished: see ``error``."""
        m = self.matcher
        return m.is_stopped() and not m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (its parser's limit, a grammar with no way on), or None. Kept once seen."""
        if self._error is None and self._matcher is not None and self._matcher.is_error():
            self._error = _one_line(self._matcher.get_error())
        return self._error


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it (built once, ~1 s for a 49k vocabulary), and compiled grammars.

    ``tokenizer``: anything with a ``tokenizers`` backend (``backend_tokenizer``) and an ``eos_token_id``: a
    ``text.tokenizer.TextTokenizer`` or an HF fast tokenizer; neither path imports transformers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids) -> None:
        import llguidance

        # EOS is what the grammar allows once it is complete: the engine's stop ids (they end the sequence).
        eos = sorted(stop_token_ids) or getattr(tokenizer, "eos_token_id", None)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=eos)
        # A matcher's error names the construct or limit, not the parser's state (which can echo the schema).
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()  # grammar text -> compiled, most recent last
        self._live: weakref.WeakValueDictionary[str, CompiledGrammar] = weakref.WeakValueDictionary()
        self.compiles = 0  # grammars compiled (a cache miss each)

    def compile(self, grammar: str) -> CompiledGrammar:
        """``grammar`` compiled, from the cache when it was compiled before (or is in use now); GrammarError naming
        the construct it does not support; GrammarBusyError past MAX_LIVE_GRAMMARS. Call off the event loop."""
        with self._lock:
            found = self._live.get(grammar)
            if found is not None:
                self._cache[grammar] = found
                self._cache.move_to_end(grammar)
                return found
            while self._cache and len(self._live) >= MAX_LIVE_GRAMMARS:
                self._cache.popitem(last=False)  # unused ones leave _live with their last reference
            if len(self._live) >= MAX_LIVE_GRAMMARS:
                raise GrammarBusyError(
                    f"{MAX_LIVE_GRAMMARS} distinct grammars are in use by requests in flight; retry shortly"
                )
        compiled = CompiledGrammar(self._build(grammar), grammar)  # outside the lock: it can take a while
        with self._lock:
            self.compiles += 1
            compiled = self._live.setdefault(grammar, compiled)  # another thread may have compiled it meanwhile
            self._cache[grammar] = compiled
            self._cache.move_to_end(grammar)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: str) -> GrammarState:
        """A fresh state for ``grammar`` (compiled once: ``compile``)."""
        return GrammarState(self.compile(grammar))

    def _build(self, grammar: str):
        import llguidance

        try:
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        except BaseException as exc:
            if not _is_panic(exc):
                raise
            raise GrammarError(f"the grammar could not be compiled: {_one_line(str(exc))}") from None
        if m.is_error():
            raise GrammarError(_one_line(m.get_error()))
        return m


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
