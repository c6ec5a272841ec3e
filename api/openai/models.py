"""``GET /v1/models``: the base model this server serves and its LoRA adapters (``parent``: the base), as vLLM lists
them; ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's names and bodies). ``check_model`` is
the check every request's ``model`` field gets (``api.serving.check_model``). No torch."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from api.errors import APIError, lora_errors
from api.serving import Runtime, check_model, current_runtime
from schemas import ErrorResponse, LoadLoraAdapterRequest, UnloadLoraAdapterRequest

__all__ = ["check_model", "router"]

_CREATED = int(time.time())

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(runtime: Runtime = Depends(current_runtime)) -> dict:
    base = runtime.config.model_name
    card = {"object": "model", "created": _CREATED, "owned_by": "minibatch-llm"}
    cards = [{"id": base, **card, "root": runtime.config.model_id, "parent": None}]
    loras = runtime.engine.loras
    for adapter in loras.served.values() if loras is not None else ():
        cards.append({"id": adapter.name, **card, "root": adapter.path, "parent": base})
    for c in cards:
        c["max_model_len"] = runtime.engine.max_context
    return {"object": "list", "data": cards}


LORA_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 422, 503)}


@router.post("/load_lora_adapter", responses=LORA_ERRORS, response_class=PlainTextResponse)
async def load_lora_adapter(req: LoadLoraAdapterRequest, runtime: Runtime = Depends(current_runtime)) -> str:
    """Serve the PEFT adapter at ``lora_path`` as ``lora_name``: read and checked off the event loop, put in a free
    slot between two engine steps. 400 naming the adapter and why for one this server cannot serve, a taken name, or
    every MAX_LORAS slot taken."""
    loras = _loras(runtime)
    if req.load_inplace:
        raise APIError(400, "load_inplace is not supported: unload the adapter, then load it", param="load_inplace")
    name = req.lora_name
    if name == runtime.config.model_name:
        raise APIError(400, f"LoRA adapter {name!r} has the base model's name", param="lora_name")
    with lora_errors():
        loras.begin(name)
        try:
            adapter = await runtime.off_loop(loras.read, name, req.lora_path)
            lora_id = await runtime.scheduler.call_engine(loras.install, adapter)
        except BaseException:
            loras.abandon(name)
            raise
    loras.commit(adapter, lora_id)
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/unload_lora_adapter", responses=LORA_ERRORS, response_class=PlainTextResponse)
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, runtime: Runtime = Depends(current_runtime)) -> str:
    """Stop serving ``lora_name`` and free its slot. Refused (409) while requests that chose it are in flight (queued
    or running): they finish under it; unload again once they have."""
    loras = _loras(runtime)
    loaded = loras.served.get(req.lora_name)
    if loaded is None:
        raise APIError(404, f"LoRA adapter {req.lora_name!r} is not loaded", param="lora_name")
    busy = sum(1 for seq in runtime.scheduler.unfinished() if seq.lora_id == loaded.lora_id)
    if busy:
        raise APIError(
            409,
            f"LoRA adapter {loaded.name!r} has {busy} requests in flight; unload it once they have finished",
            "conflict",
            param="lora_name",
        )
    loras.forget(loaded.name)  # no request can choose it from here on
    await runtime.scheduler.call_engine(loras.remove, loaded.lora_id)
    return f"Success: LoRA adapter '{loaded.name}' removed successfully."


def _loras(runtime: Runtime):
    if runtime.engine.loras is None:
        raise APIError(400, "LoRA adapters are off on this server (MAX_LORAS=0, or an engine without adapters)")
    return runtime.engine.loras
