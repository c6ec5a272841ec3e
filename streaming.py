"""How a running ``Generation`` becomes an HTTP answer, for both APIs. No torch.

* ``run_to_completion``: wait for the whole answer, or give up when the client disconnects
  (the sequence is then cancelled: dropped from the queue or freed at the next step).
* ``event_stream``: the one server-sent-event loop. Each API supplies its ``Frames`` (what the
  first event, each text event and the closing events look like); the loop is the same: events
  as text arrives, then the closing events or the error body, then ``data: [DONE]`` (OpenAI's
  rule, for every stream that was not abandoned by its client).
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from api_errors import APIError, sequence_error
from generation import Chunk, Generation, wait_for_disconnect
from schemas import Usage
from sequence import Sequence


def disconnect_future(request: Request) -> asyncio.Future:
    """A task that completes when the client disconnects (cancelled by whoever stops caring)."""
    return asyncio.ensure_future(wait_for_disconnect(request.receive))


def usage(seq: Sequence) -> Usage:
    n = len(seq.output_token_ids)
    return Usage(prompt_tokens=seq.prompt_len, completion_tokens=n, total_tokens=seq.prompt_len + n)


async def run_to_completion(gen: Generation, request: Request) -> Sequence:
    """The finished sequence, its text complete in ``gen.text``. Raises the sequence's error answer,
    or a 499 (not sent to anyone: the client is gone) when the client disconnects first."""
    done = await gen.result(disconnect_future(request))
    if done is None:
        raise APIError(499, "client disconnected", "cancelled")
    error = sequence_error(done)
    if error is not None:
        raise error
    gen.final_text()
    return done


class Frames:
    """One API's event payloads. Subclasses override what differs; ``None`` skips an event."""

    def opening(self) -> list[dict]:
        """Events before any text."""
        return []

    def text(self, chunk: Chunk) -> dict | None:
        """The event for newly generated text (and the tokens and logprobs behind it)."""
        raise NotImplementedError

    def closing(self, seq: Sequence, rest: str) -> list[dict]:
        """Events after the last chunk: ``rest`` is the text held back until the end."""
        raise NotImplementedError


async def event_stream(gen: Generation, request: Request, frames: Frames) -> AsyncIterator[str]:
    disconnected = disconnect_future(request)
    try:
        for event in frames.opening():
            yield sse(event)
        async for chunk in gen.stream(disconnected):
            event = frames.text(chunk)
            if event is not None:
                yield sse(event)
        if disconnected.done():
            return  # nobody is listening
        error = sequence_error(gen.seq)
        events = [error.body()] if error is not None else frames.closing(gen.seq, gen.final_text())
        for event in events:
            yield sse(event)
        yield sse("[DONE]")
    finally:
        disconnected.cancel()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(gen: Generation, request: Request, frames: Frames) -> StreamingResponse:
    return StreamingResponse(
        event_stream(gen, request, frames), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
