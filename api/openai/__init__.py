"""The OpenAI-compatible API, one file per endpoint: ``models.py`` (``GET /v1/models``, LoRA adapters' load and
unload), ``completions.py`` (``POST /v1/completions``), ``chat.py`` (``POST /v1/chat/completions``), ``responses.py``
(``POST /v1/responses``), ``embeddings.py`` (``POST /v1/embeddings``); what they share: ``fields.py`` (request
checks, choices, usage), ``logprobs.py`` (OpenAI's two logprob formats), ``frames.py`` (the stream events).
``router`` is all of them. Errors use OpenAI's body shape (``api/errors.py``). No torch."""

from __future__ import annotations

from fastapi import APIRouter

from api.openai import chat, completions, embeddings, models, responses

router = APIRouter()
for _endpoint in (models, completions, chat, responses, embeddings):
    router.include_router(_endpoint.router)
