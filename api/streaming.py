"""How a running ``Generation`` becomes an HTTP answer, for both APIs. No torch.

* ``run_all`` / ``run_to_completion``: wait for the whole answer, or give up when the client
  disconnects (the sequences are then cancelled: dropped from the queue or freed at the next step).
* ``event_stream``: the one server-sent-event loop, over one generation or several (one per prompt
  of a batched /v1/completions request). Each API supplies its ``Frames`` (what the first event,
  each text event and the closing events look like); the loop is the same: events as text
  arrives, each generation's closing events when it ends (or the error body, which ends the
  stream), then the final events and ``data: [DONE]`` (OpenAI's rule, for every stream that was
  not abandoned by its client).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from api.errors import APIError, sequence_error
from core.generation import Chunk, Generation, wait_for_disconnect
from core.sequence import Sequence
from schemas import Usage


def disconnect_future(request: Request) -> asyncio.Future:
    """A task that completes when the client disconnects (cancelled by whoever stops caring)."""
    return asyncio.ensure_future(wait_for_disconnect(request.receive))


def usage(*seqs: Sequence, count_output: bool = True) -> Usage:
    """Token counts, summed over the sequences of one request (several prompts on /v1/completions).
    ``count_output`` False: the generated tokens are not part of the answer (a prompt scored, max_tokens 0)."""
    prompt = sum(seq.prompt_len for seq in seqs)
    completion = sum(len(seq.output_token_ids) for seq in seqs) if count_output else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def run_to_completion(gen: Generation, request: Request) -> Sequence:
    """``run_all`` for one generation."""
    return (await run_all([gen], request))[0]


async def run_all(gens: list[Generation], request: Request) -> list[Sequence]:
    """The finished sequences, in order, their texts complete in ``gen.text``. Raises the first failed
    sequence's error answer, or a 499 (not sent to anyone: the client is gone) when the client
    disconnects first; either way the others are cancelled."""
    disconnected = disconnect_future(request)
    pending = {gen.future for gen in gens}
    try:
        while pending:
            done, _ = await asyncio.wait(pending | {disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if disconnected in done:
                raise APIError(499, "client disconnected", "cancelled")
            for future in done:
                error = sequence_error(future.result())
                if error is not None:
                    raise error
            pending -= done
    except BaseException:  # an error answer, a disconnect, or this task cancelled: nobody wants the rest
        for gen in gens:
            gen.cancel()
        raise
    finally:
        disconnected.cancel()
    for gen in gens:
        gen.final_text()
    return [gen.seq for gen in gens]


class Frames:
    """One API's event payloads. Subclasses override what differs; ``None`` skips an event. ``i`` is the
    index of the generation (the prompt, on /v1/completions) an event belongs to; 0 when there is one."""

    done_marker: str | None = "[DONE]"  # the stream's last event (None: none, as /v1/responses streams end)

    def encode(self, event: dict | str) -> str:
        """One event as server-sent-event text."""
        return sse(event)

    def failure(self, error: APIError) -> list[dict]:
        """The events that end a stream whose answer failed: the error body."""
        return [error.body()]

    def opening(self) -> list[dict]:
        """Events before any text."""
        return []

    def text(self, i: int, chunk: Chunk) -> dict | list[dict] | None:
        """The event (or events) for newly generated text (and the tokens and logprobs behind it)."""
        raise NotImplementedError

    def closing(self, i: int, seq: Sequence, rest: str) -> list[dict]:
        """Events after generation ``i``'s last chunk: ``rest`` is the text held back until the end."""
        raise NotImplementedError

    def finale(self, seqs: list[Sequence]) -> list[dict]:
        """Events once every generation has closed (before ``[DONE]``)."""
        return []


async def merged_chunks(
    gens: list[Generation], disconnected: asyncio.Future
) -> AsyncIterator[tuple[int, Chunk | None]]:
    """``(i, chunk)`` from every generation as they come, and ``(i, None)`` when generation ``i`` ends.
    Several generations are pumped by one task each into a queue; closing this iterator cancels them
    (and so the generations still running)."""
    if len(gens) == 1:
        async for chunk in gens[0].stream(disconnected):
            yield 0, chunk
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Chunk | None]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for chunk in gen.stream(disconnected):
                queue.put_nowait((i, chunk))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        open_ = len(gens)
        while open_:
            item = await queue.get()
            open_ -= item[1] is None
            yield item
    finally:
        for task in tasks:
            task.cancel()


async def event_stream(gens: list[Generation], request: Request, frames: Frames) -> AsyncIterator[str]:
    disconnected = disconnect_future(request)
    chunks = merged_chunks(gens, disconnected)
    done = [frames.done_marker] if frames.done_marker else []
    try:
        for event in frames.opening():
            yield frames.encode(event)
        async for i, chunk in chunks:
            if chunk is not None:
                events = frames.text(i, chunk)
                for event in events if isinstance(events, list) else [events] if events is not None else []:
                    yield frames.encode(event)
                continue
            if disconnected.done():
                return  # nobody is listening
            error = sequence_error(gens[i].seq)
            if error is not None:  # the whole answer fails (the others are cancelled on the way out)
                for event in [*frames.failure(error), *done]:
                    yield frames.encode(event)
                return
            for event in frames.closing(i, gens[i].seq, gens[i].final_text()):
                yield frames.encode(event)
        for event in [*frames.finale([gen.seq for gen in gens]), *done]:
            yield frames.encode(event)
    finally:
        await chunks.aclose()
        disconnected.cancel()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def sse_response(gens: list[Generation], request: Request, frames: Frames) -> StreamingResponse:
    return StreamingResponse(
        event_stream(gens, request, frames), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def json_answer(body: dict) -> Response:
    """``body`` as a JSON response, encoded as FastAPI encodes it, but one choice per ``json.dumps`` call and in UTF-8
    pieces joined as bytes: a C call holds the GIL from start to end, so a 10 MB answer encoded (or joined as text) at
    once would stall the event loop for its whole length even from another thread. Build it with
    ``Runtime.off_loop`` (a handler that returns the Response skips FastAPI's own encoding, which runs on the loop)."""
    parts: list[bytes] = [b"{"]
    for i, (key, value) in enumerate(body.items()):
        parts.append(f"{',' if i else ''}{_dumps(key)}:".encode())
        if key == "choices" and isinstance(value, list):
            parts.append(b"[")
            for j, choice in enumerate(value):
                parts.append((b"," if j else b"") + _dumps(choice).encode())
                time.sleep(0)  # lets the event loop take the GIL between choices
            parts.append(b"]")
        else:
            parts.append(_dumps(value).encode())
    parts.append(b"}")
    return Response(b"".join(parts), media_type="application/json")


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
