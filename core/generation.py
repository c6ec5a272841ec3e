"""The output side of one request: incremental text, stop strings, streamed chunks, disconnects.

A ``Generation`` submits its ``Sequence`` to the scheduler with a listener. After every step
that gives the sequence tokens, the listener (on the event loop) feeds them to an
``IncrementalDecoder``; a matched stop string ends the sequence at the next step boundary
(status FINISHED_STOPPED, slot freed), and the safe new text goes to the stream queue. The
HTTP layers (``api/streaming.py`` and the API modules) only format what comes out of here. No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from core.sequence import Sequence, SequenceStatus
from scheduler import Scheduler
from text.detokenizer import IncrementalDecoder


@dataclass
class Chunk:
    """New output since the last chunk: its text, the token ids behind it, their logprobs."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class Generation:
    def __init__(
        self,
        seq: Sequence,
        decode: Callable[[list[int]], str],
        scheduler: Scheduler,
        stop: list[str] | None = None,
    ) -> None:
        """``decode``: the engine's detokenizer (token ids -> text)."""
        self.seq = seq
        self.scheduler = scheduler
        self.decoder = IncrementalDecoder(decode, seq.prompt_token_ids, stop or [])
        self.chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()  # None: the sequence has finished
        self._fed = 0  # output tokens already given to the decoder
        self._sent = 0  # output tokens already carried by a chunk
        self.future: asyncio.Future[Sequence] | None = None

    def start(self) -> None:
        """Queue the sequence. Raises scheduler.QueueFullError."""
        self.future = self.scheduler.submit(self.seq, listener=self._on_tokens)
        self.future.add_done_callback(lambda _: self.chunks.put_nowait(None))

    def cancel(self) -> None:
        """The client left: end the sequence (dropped from the queue, or freed at the next step)."""
        if not self.seq.is_finished:
            self.scheduler.abort(self.seq.seq_id)

    def _on_tokens(self, seq: Sequence) -> None:
        new = seq.output_token_ids[self._fed :]
        if not new or self.decoder.finished:
            return
        self._fed = len(seq.output_token_ids)
        text_ids = new
        if seq.status is SequenceStatus.FINISHED_STOPPED and new[-1] in seq.stop_token_ids:
            text_ids = new[:-1]  # a stop token ends the answer; its text is not part of it
        delta = self.decoder.push(text_ids)
        if delta.stopped:
            self.scheduler.stop_string_matched(seq)
        text = delta.text
        if seq.is_finished and not self.decoder.finished:
            text += self.decoder.flush()  # no more tokens: release what was held back for them
        if text or self.decoder.finished:
            # Token ids (and logprobs) whose text was held back ride along with the next chunk, and
            # the last chunk carries whatever is left, so the chunks hold every generated token once.
            start, self._sent = self._sent, self._fed
            self.chunks.put_nowait(
                Chunk(text, seq.output_token_ids[start : self._fed], seq.output_logprobs[start : self._fed])
            )

    async def result(self, disconnected: asyncio.Future | None = None) -> Sequence | None:
        """Wait until finished; None (and the sequence cancelled) if ``disconnected`` fires first."""
        assert self.future is not None
        if disconnected is None:
            return await asyncio.shield(self.future)
        try:
            done, _ = await asyncio.wait({self.future, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            disconnected.cancel()
        if self.future not in done:
            self.cancel()
            return None
        return self.future.result()

    async def stream(self, disconnected: asyncio.Future | None = None) -> AsyncIterator[Chunk]:
        """Chunks as they come; ends when the sequence finishes (or cancels it if the client leaves)."""
        try:
            while True:
                getter = asyncio.ensure_future(self.chunks.get())
                waits = {getter} if disconnected is None else {getter, disconnected}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    self.cancel()
                    return
                chunk = getter.result()
                if chunk is None:
                    return
                yield chunk
        finally:
            self.cancel()  # a no-op once finished; frees the slot if the consumer went away

    def final_text(self) -> str:
        """Everything after the last chunk (text held back for a possible stop string or a split character)."""
        return self.decoder.flush()

    @property
    def text(self) -> str:
        return self.decoder.text


async def wait_for_disconnect(receive) -> None:
    """Return once the ASGI client has gone (``http.disconnect``); the body must be read already."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
