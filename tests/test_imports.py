"""The server stack imports and serves MODEL_ID=fake in a fresh interpreter without torch, transformers or the
grammar library (llguidance); the domain below the HTTP layer (engine, scheduler, core/, guided/, text/) imports no
fastapi or starlette: only api/ (and server.py) speak HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys

    import config, engine, schemas, scheduler, server, text.tokenizer

    app = server.create_app()
    assert server.app is not None

    async def main():
        import httpx

        async with app.router.lifespan_context(app):
            assert isinstance(app.state.server.engine, engine.FakeEngine)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                h = await c.get("/health")
                assert h.status_code == 200 and h.json()["model"] == "fake", h.text
                r = await c.post("/generate", json={"prompt": "hi", "max_new_tokens": 3})
                assert r.status_code == 200 and len(r.json()["token_ids"]) == 3, r.text

    asyncio.run(asyncio.wait_for(main(), 30))
    # the grammar library too: only a request that uses structured output imports it
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "llguidance"))
    print("HEAVY:" + ",".join(heavy))
    """
)


def run_fresh(script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAX_", "STOP_TOKEN", "DEVICE", "NUM_THREADS"))}
    env["MODEL_ID"] = "fake"
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_server_stack_imports_and_serves_without_torch():
    proc = run_fresh(SCRIPT)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY:")]
    assert lines == ["HEAVY:"], f"heavy modules imported: {lines}"


def test_probe_detects_torch():
    """The probe is not vacuous: importing engine's model path does pull torch in."""
    proc = run_fresh("import sys, models.gpt2; print('torch' in sys.modules)")
    if proc.returncode != 0:  # torch not installed here: nothing to prove
        assert "No module named" in proc.stderr, proc.stderr
        return
    assert proc.stdout.strip() == "True"


DOMAIN = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    import core, guided, text

    names = ["engine", "scheduler", "model_runner", "config"]
    for package in (core, guided, text):
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    for name in names:
        importlib.import_module(name)
    web = sorted(m for m in sys.modules if m.split(".")[0] in ("fastapi", "starlette", "uvicorn", "api"))
    print("MODULES:" + ",".join(sorted(names)))
    print("WEB:" + ",".join(web))
    """
)


def test_the_domain_never_imports_the_web_stack():
    proc = run_fresh(DOMAIN)
    assert proc.returncode == 0, proc.stderr
    found = dict(line.split(":", 1) for line in proc.stdout.splitlines() if line.startswith(("MODULES:", "WEB:")))
    assert {"core.sequence", "guided.tools", "text.tokenizer"} <= set(found["MODULES"].split(",")), found
    assert found["WEB"] == "", f"the domain imported the web stack: {found['WEB']}"
