"""The /v1 streams' server-sent events: ``OpenAIFrames`` (what both share), ``CompletionFrames``
(``text_completion``, echo and prompt logprobs held until the prefill has run) and ``ChatFrames``
(``chat.completion.chunk``, tool calls held back until they cannot be one). No torch."""

from __future__ import annotations

import dataclasses
import time

from api.openai.fields import openai_usage
from api.openai.logprobs import chat_logprobs, completion_logprobs, join_logprobs, prompt_logprobs
from api.serving import Runtime
from api.streaming import Frames
from core.generation import Chunk
from core.sequence import Sequence
from guided.tools import ToolCalling


class OpenAIFrames(Frames):
    """What both /v1 streams share: every event carries id/object/created/model and one choice (its
    ``index``: the prompt's); each choice closes with a ``finish_reason`` event; once all have, a
    usage event (summed), if asked."""

    object = ""
    count_output = True  # usage counts the generated tokens (not for a prompt scored with max_tokens 0)

    def __init__(
        self, runtime: Runtime, request_id: str, model: str, wants_logprobs: bool, with_usage: bool, n: int = 1
    ) -> None:
        self.runtime = runtime
        self.wants_logprobs = wants_logprobs
        self.with_usage = with_usage
        self.n = n  # choices per prompt
        self.base = {
            "id": request_id,
            "object": self.object,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": runtime.fingerprint,
        }

    def choice(self, i: int, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        raise NotImplementedError

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if not (chunk.text or chunk.logprobs):  # tokens with no text of their own still carry their logprobs
            return None
        return {**self.base, "choices": [self.choice(i, chunk.text, chunk, None)]}

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        return [{**self.base, "choices": [self.choice(i, rest, None, seq.finish_reason)]}]

    def finale(self, seqs: list[Sequence]) -> list[dict]:
        if not self.with_usage:
            return []
        return [{**self.base, "choices": [], "usage": openai_usage(seqs, self.n, self.count_output)}]


class CompletionFrames(OpenAIFrames):
    object = "text_completion"

    def __init__(
        self,
        runtime: Runtime,
        request_id: str,
        model: str,
        echoes: list[str],
        seqs: list[Sequence],
        wants_logprobs: bool,
        with_usage: bool,
        score_only: bool = False,
        n: int = 1,
    ) -> None:
        super().__init__(runtime, request_id, model, wants_logprobs, with_usage, n)
        self.echoes, self.seqs = echoes, seqs
        self.score_only = score_only  # max_tokens 0: the one generated token is not part of the answer
        self.count_output = not score_only
        # text_offset counts from the start of each choice's whole text, as in the non-streamed answer
        self.offsets = [len(echo) for echo in echoes]
        # With logprobs, an echo carries the prompt's logprobs, known once the prompt's prefill has run: it
        # goes out with that choice's first event instead of before everything.
        self.pending = [bool(echo) and wants_logprobs for echo in echoes]

    def opening(self) -> list[dict]:
        return [
            {**self.base, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]}
            for i, echo in enumerate(self.echoes)
            if echo and not self.pending[i]
        ]

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if self.score_only:
            chunk = Chunk("")
        head, head_lp = self._held_echo(i)
        if not (head or chunk.text or chunk.logprobs):
            return None
        return {**self.base, "choices": [self.choice(i, chunk.text, chunk, None, head, head_lp)]}

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        head, head_lp = self._held_echo(i)
        text, finish = ("", "length") if self.score_only else (rest, seq.finish_reason)
        return [{**self.base, "choices": [self.choice(i, text, None, finish, head, head_lp)]}]

    def _held_echo(self, i: int) -> tuple[str, dict | None]:
        """Choice i's held-back echo and its prompt logprobs, the first time it is asked for."""
        if not self.pending[i]:
            return "", None
        self.pending[i] = False
        return self.echoes[i], prompt_logprobs(self.runtime, self.seqs[i])

    def choice(
        self, i: int, text: str, chunk: Chunk | None, finish: str | None, head: str = "", head_lp: dict | None = None
    ) -> dict:
        lp = None
        if self.wants_logprobs and chunk is not None:
            lp = completion_logprobs(self.runtime, chunk.logprobs, self.offsets[i])
            self.offsets[i] += sum(len(tok) for tok in lp["tokens"])
        if head_lp is not None:
            lp = join_logprobs(head_lp, lp or completion_logprobs(self.runtime, [], 0))
        return {"index": i, "text": head + text, "logprobs": lp, "finish_reason": finish}


class ChatFrames(OpenAIFrames):
    """With tools (``ToolCalling``), text that may be a tool call is held back: once it cannot be one it goes out as
    content; if the answer is one, its calls go out at the end as ``delta.tool_calls`` (per call OpenAI's two deltas:
    index, id, type, the name and ``"arguments": ""``, then the arguments), with finish_reason "tool_calls" ("length"
    for a forced call cut by the budget). Logprobs of held-back tokens go out with empty deltas as they come."""

    object = "chat.completion.chunk"

    def __init__(self, *args, tools: ToolCalling | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        # Per choice, the text held back while it may still be a tool call; a choice not in it streams content.
        self.held: dict[int, str] = {i: "" for i in range(self.n)} if tools else {}

    def text(self, i: int, chunk: Chunk) -> dict | None:
        if i not in self.held:
            return super().text(i, chunk)
        self.held[i] += chunk.text
        if self.tools.may_be_call(self.held[i]):
            lp = chat_logprobs(self.runtime, chunk.logprobs) if self.wants_logprobs and chunk.logprobs else None
            if lp is None:
                return None
            return {**self.base, "choices": [{"index": i, "delta": {}, "logprobs": lp, "finish_reason": None}]}
        return super().text(i, dataclasses.replace(chunk, text=self.held.pop(i)))

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        if i not in self.held:
            return super().closing(i, seq, rest)
        text = self.held.pop(i) + rest
        calls, finish = self.tools.answer(text, seq.finish_reason)
        if calls is None:
            return super().closing(i, seq, text)
        events = []
        for j, call in enumerate(calls):
            fn = call["function"]
            head = {"index": j, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
            args = {"index": j, "function": {"arguments": fn["arguments"]}}
            for delta in (head, args):
                choice = {"index": i, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None}
                events.append({**self.base, "choices": [choice]})
        end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}
        return [*events, {**self.base, "choices": [end]}]

    def opening(self) -> list[dict]:
        """The role frame of every choice."""
        role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.base, "choices": [{"index": i, **role}]} for i in range(self.n)]

    def choice(self, i: int, text: str, chunk: Chunk | None, finish: str | None) -> dict:
        lp = chat_logprobs(self.runtime, chunk.logprobs) if self.wants_logprobs and chunk is not None else None
        delta = {"content": text} if text or finish is None else {}
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
