"""``POST /v1/embeddings``: one vector per input, the model's final hidden states (after the final norm) pooled
(``EMBEDDING_POOLING``: mean or last) and L2-normalized. Each input is a prompt-only sequence in the same batches as
generation (``core/pooling.py``): one copy of the model, the prefix cache shared. Only translation lives here.
No torch."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.errors import APIError
from api.openai.fields import ERRORS, log_unknown
from api.openai.models import check_model
from api.serving import (
    Runtime,
    check_sequence_count,
    check_token_ids,
    current_runtime,
    make_sequence,
    start_generations,
    tokenize,
)
from api.streaming import json_answer, run_all
from core.sequence import Sequence
from schemas import EmbeddingRequest, SamplingFields

router = APIRouter(prefix="/v1")

KNOWN_FIELDS = {"user"}  # OpenAI's other field: it cannot change the vectors
NO_SAMPLING = SamplingFields()


@router.post("/embeddings", responses=ERRORS)
async def embeddings(req: EmbeddingRequest, request: Request, runtime: Runtime = Depends(current_runtime)):
    name = check_model(runtime, req.model)
    log_unknown(sorted(set(req.model_extra or {}) - KNOWN_FIELDS))
    width = runtime.engine.hidden_size
    if width is None:
        raise APIError(400, f"model {name!r} does not serve embeddings", param="model")
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(
            400,
            f"`dimensions`: this model's embeddings have {width} dimensions and cannot be shortened "
            f"(got {req.dimensions})",
            param="dimensions",
        )
    prompts = await embedding_inputs(runtime, req.input)
    rid = f"embd-{uuid.uuid4().hex}"
    seqs = []
    for i, ids in enumerate(prompts):
        seq = make_sequence(runtime, ids, 0, NO_SAMPLING, rid if len(prompts) == 1 else f"{rid}-{i}", model=name)
        seq.pooling = runtime.config.embedding_pooling
        seqs.append(seq)
    gens = start_generations(runtime, seqs, None, request=request)
    done = await run_all(gens, request)
    return await runtime.off_loop(embedding_answer, name, done, req.encoding_format)


async def embedding_inputs(runtime: Runtime, value) -> list[list[int]]:
    """Each input's token ids: ``input`` is a text, a list of texts, a list of token ids or a list of such lists
    (what LangChain sends by default: its own tokenizer's ids, see docs/api.md). At most MAX_SEQUENCES_PER_REQUEST
    inputs; each within the context window (422 naming the input)."""
    several = not (isinstance(value, str) or isinstance(value[0], int))
    items = value if several else [value]
    check_sequence_count(runtime, len(items), "input")

    async def one(i: int, item: str | list[int]) -> list[int]:
        try:
            ids = await tokenize(runtime, item) if isinstance(item, str) else check_token_ids(runtime, item, room=0)
        except APIError as exc:
            exc.param, exc.message = "input", f"input {i}: {exc.message}" if several else exc.message
            raise
        return ids

    results = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def embedding_answer(model: str, seqs: list[Sequence], encoding_format: str) -> Response:
    """OpenAI's ``list`` of ``embedding`` objects: each vector as floats, or (``base64``) its float32 little-endian
    bytes in base64 (what the openai SDK asks for by default). Any thread."""
    data = []
    for i, seq in enumerate(seqs):
        vector = np.asarray(seq.embedding, dtype="<f4")
        encoded = base64.b64encode(vector.tobytes()).decode() if encoding_format == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = sum(seq.prompt_len for seq in seqs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_answer({"object": "list", "data": data, "model": model, "usage": usage})
