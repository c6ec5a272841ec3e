"""Admin routes: ``POST /admin/reset_prefix_cache``. Behind ``API_KEY`` when it is set, like every route but
the probes (api/ops.py). No torch."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.serving import Runtime, current_runtime
from schemas import ErrorResponse

router = APIRouter(prefix="/admin")


@router.post("/reset_prefix_cache", responses={code: {"model": ErrorResponse} for code in (401, 503)})
async def reset_prefix_cache(runtime: Runtime = Depends(current_runtime)) -> dict:
    """Drop every cached KV block no running sequence holds (after a weight or tokenizer change on disk, or to
    measure cold prefills). Blocks in use stay cached. Runs on the event loop, which keeps the KV books."""
    dropped = runtime.engine.reset_prefix_cache()
    cached = runtime.engine.stats().get("kv_cached_blocks", 0)
    return {"status": "ok", "dropped_blocks": dropped, "cached_blocks": cached}
