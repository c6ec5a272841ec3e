"""``GET /v1/models``: the one model this server serves; ``check_model``, the check every /v1 request's ``model``
field gets. No torch."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends

from api.errors import APIError
from api.serving import Runtime, current_runtime

_CREATED = int(time.time())

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(runtime: Runtime = Depends(current_runtime)) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": runtime.config.model_name,
                "object": "model",
                "created": _CREATED,
                "owned_by": "minibatch-llm",
                "max_model_len": runtime.engine.max_context,
            }
        ],
    }


def check_model(runtime: Runtime, model: str | None) -> str:
    name = runtime.config.model_name
    if model is not None and model != name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{name}`", param="model")
    return name
