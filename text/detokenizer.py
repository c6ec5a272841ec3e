"""Incremental detokenization with stop strings, for streaming responses.

``IncrementalDecoder`` turns a growing list of generated token ids into text deltas
that are safe to send to a client as soon as they are produced:

* **No broken characters.** Byte-level BPE tokenizers split multi-byte UTF-8
  characters across tokens, and decoding a partial character yields U+FFFD. Trailing
  U+FFFD characters are held back until later tokens complete them; ``flush()``
  releases whatever is still held when the sequence ends.
* **Stop strings.** Stop strings are matched on the decoded text, across token
  boundaries. On a match the output is cut right before the stop string, which is
  never emitted, and nothing after it ever is.
* **No retractions.** Text that a stop string may still claim (the longest suffix of
  the pending text that is a prefix of some stop string) is held back until the next
  tokens either complete the stop string or rule it out.
* **Linear time.** Each push decodes only a sliding window of tokens (vLLM's
  ``prefix_offset``/``read_offset`` technique), never the whole output.

Which stop string wins: the first one to *complete* in the text (the smallest end
position); among stop strings completing at the same character, the one starting
earliest (the longest). This is the only rule under which a streaming decoder can stop
the moment a stop string appears and still agree with the non-streaming result for any
tokenization; it picks the earliest-starting occurrence too, except when one stop string
sits strictly inside another (stops ``["BCD", "C"]`` on ``"ABCD"`` give ``"AB"``).
``truncate_at_stop`` applies the same rule to a whole text.

Contract with ``decode``: it must be *prefix-stable* — decoding ``ids + more`` starts with
the decoding of ``ids`` whenever ``ids`` ends on a character boundary. Byte-level BPE
(GPT-2, and the Llama-family checkpoints the engine serves such as SmolLM2) with
``clean_up_tokenization_spaces`` off satisfies it; for SentencePiece-style tokenizers, whose
first token decodes differently on its own, pass the prompt as context (below). Under it, the
concatenation of everything ``push`` and ``flush`` emit is exactly ``decode(output_ids)`` (or its
continuation after the prompt context, see below), truncated by ``truncate_at_stop``.

This module is pure Python and imports no torch: the server stack uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the output as context when prompt ids are given (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class Delta:
    """What one ``push`` produced."""

    text: str  # new text, safe to emit now (may be empty)
    stopped: bool = False  # a stop string matched; this delta and everything before is final
    stop_string: str | None = None  # the stop string that matched, when stopped


def _normalize_stops(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """Stop strings, deduplicated in order; empty strings are ignored (they cannot be matched)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    out: list[str] = []
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__}")
        if s and s not in out:
            out.append(s)
    return tuple(out)


def _find_first_stop(text: str, stops: Seq[str]) -> tuple[int, str] | None:
    """(start, stop string) of the first stop string to complete in ``text``, or None.

    Smallest end position wins; at equal ends the earliest start (the longest) wins.
    """
    best: tuple[int, int] | None = None
    best_stop: str | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i)
            if best is None or key < best:
                best, best_stop = key, s
    if best is None:
        return None
    return best[1], best_stop  # type: ignore[return-value]


def truncate_at_stop(text: str, stop: str | Iterable[str] | None) -> tuple[str, str | None]:
    """Non-streaming counterpart of ``IncrementalDecoder``: ``text`` cut right before the
    first stop string to complete, and that stop string (None if no stop string occurs)."""
    stops = _normalize_stops(stop)
    found = _find_first_stop(text, stops)
    if found is None:
        return text, None
    start, s = found
    return text[:start], s


class IncrementalDecoder:
    """Streams the text of one sequence's generated tokens, with stop strings.

    ``decode`` is the engine's ``decode`` (special tokens skipped). ``prompt_token_ids``
    is optional context: when given, the last ``PROMPT_CONTEXT_TOKENS`` prompt tokens are
    decoded ahead of the output and the emitted text is what the output adds to them, which
    matters for tokenizers whose first output token decodes differently on its own (e.g.
    SentencePiece's leading-space rule). When omitted, the emitted text is exactly
    ``decode(output_ids)``, i.e. what a non-streaming response built with ``engine.decode``
    returns — pass it only if that difference is wanted. For byte-level BPE (GPT-2) the two
    are the same. ``stop`` holds 0..N stop strings (empty strings are ignored).

    Not thread-safe: one decoder per sequence, driven by one thread.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        prompt_token_ids: Seq[int] | None = None,
        stop: str | Iterable[str] | None = None,
    ) -> None:
        self._decode = decode
        self.stop: tuple[str, ...] = _normalize_stops(stop)
        # Every proper prefix of every stop string, for the hold-back rule.
        self._stop_prefixes = frozenset(s[:k] for s in self.stop for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)

        # Sliding window over the token stream: _window[0] is token number prefix_offset.
        # _window[:_read] is context whose text is already accounted for; it decodes to
        # _read_chars characters. Tokens from _read on are new since the last slide.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        context_text = decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would merge with the output's.
            context, context_text = [], ""
        self._window: list[int] = context
        self._read = len(context)
        self._read_chars = len(context_text)

        self._held = ""  # decoded, stable text not emitted yet because a stop string may claim it
        self._text_parts: list[str] = []
        self._token_count = 0
        self._stopped = False
        self._stop_string: str | None = None
        self._flushed = False

    # --- public state --------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """Everything emitted so far (by ``push`` and ``flush``)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def token_count(self) -> int:
        """Output token ids accepted by ``push`` (those pushed after a stop are ignored)."""
        return self._token_count

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def finished(self) -> bool:
        """A stop string matched or ``flush`` was called: nothing more will be emitted."""
        return self._stopped or self._flushed

    # --- streaming -----------------------------------------------------------------------------
    def push(self, new_token_ids: Seq[int]) -> Delta:
        """Feed newly generated token ids; return the text that became safe to emit."""
        if self._stopped:
            return Delta("", True, self._stop_string)
        if self._flushed:
            raise RuntimeError("push() after flush(): the decoder is finished")
        if not new_token_ids:
            return Delta("")
        self._token_count += len(new_token_ids)
        self._window.extend(new_token_ids)
        return self._emit(self._decode_stable(final=False), final=False)

    def flush(self) -> str:
        """At the end of the sequence: release everything still held (incomplete characters
        as U+FFFD, a partial stop string as text). A stop string completed by the released
        text still cuts it. Returns "" if a stop string already matched."""
        if self._stopped or self._flushed:
            return ""
        tail = self._decode_stable(final=True)
        delta = self._emit(tail, final=True)
        self._flushed = True
        return delta.text

    # --- internals -----------------------------------------------------------------------------
    def _decode_stable(self, final: bool) -> str:
        """Decode the window; return its new text, minus trailing U+FFFD unless final.

        Slides the window forward when its text ends on a complete character, so each call
        decodes only the tokens since the previous clean point plus one step of context.
        """
        window_text = self._decode(self._window)
        end = len(window_text)
        if not final:
            while end > self._read_chars and window_text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
        new_text = window_text[self._read_chars : end]
        if end == len(window_text) and not final and self._read < len(self._window):
            # Clean: the newest tokens become the context (prefix) of the next decode.
            self._window = self._window[self._read :]
            self._read = len(self._window)
            self._read_chars = len(self._decode(self._window))
        else:
            # Still inside a character: keep the window, remember what was consumed.
            self._read_chars = max(self._read_chars, end)
        return new_text

    def _emit(self, new_text: str, final: bool) -> Delta:
        """Apply stop strings and the hold-back rule to held + new text; record what is emitted."""
        buf = self._held + new_text
        if self.stop:
            found = _find_first_stop(buf, self.stop)
            if found is not None:
                start, s = found
                self._held = ""
                self._stopped, self._stop_string = True, s
                return self._record(Delta(buf[:start], True, s))
        hold = 0 if final else self._hold_length(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return self._record(Delta(buf[: len(buf) - hold]))

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                return k
        return 0

    def _record(self, delta: Delta) -> Delta:
        if delta.text:
            self._text_parts.append(delta.text)
        return delta
