#!/usr/bin/env python
"""Bare decode step against the served step, one tree at a time (issue 14's measurement).

    python scripts/latency_probe.py bare   --batch 1 8          # engine forward alone: ms per decode step
    python scripts/latency_probe.py served --batch 1 8          # python server.py, B streams: ms between tokens
    python scripts/latency_probe.py bare --dispatches           # + ATen ops per decode step at batch 1
    python scripts/latency_probe.py bare --per-layer            # lean steps as per-layer calls (before the fused step)
    python scripts/latency_probe.py alternate --batch 1 8      # one process, steps alternating: whole-step call
                                                                # and per-layer calls (same load on both: a shared box)

The model and its settings come from the environment like the server's (MODEL_ID, WEIGHTS, NUM_THREADS...);
``--root`` runs another checkout (e.g. a worktree of an older commit) for a before/after in one run. Prints
one JSON line per measurement. Every loop is bounded in count; the server listens on 127.0.0.1 and is
stopped by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

PROMPT_LEN = 64


def bare(
    batch_sizes: list[int], steps: int, dispatches: bool, torch_path: bool = False, per_layer: bool = False
) -> None:
    """HFEngine's model stepped directly: B sequences prefilled, then ``steps`` timed decode steps
    (``torch_path``: with the lean decode path off, where the tree has one; ``per_layer``: lean steps as
    per-layer kernel calls instead of the one whole-step call, where the tree has it)."""
    from config import Config
    from models.runtime import HFEngine

    engine = HFEngine(Config.from_env())
    import torch

    model = engine.model
    if torch_path:
        model.lean_decode = False
    if per_layer:
        model.fused_step = None
    per_seq = -(-(PROMPT_LEN + steps + 8) // model.kv.block_size)
    for B in batch_sizes:
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
        prompts = [[(7 * b + i) % 1000 + 10 for i in range(PROMPT_LEN)] for b in range(B)]
        logits = model.forward([], [], [], prompts, tables)
        tokens = logits.argmax(-1).tolist()
        times = []
        for s in range(steps):
            positions = [PROMPT_LEN + s] * B
            t0 = time.perf_counter()
            logits = model.decode(tokens, positions, tables)
            times.append(time.perf_counter() - t0)
            tokens = logits.argmax(-1).tolist()
        path = (
            "torch"
            if torch_path
            else "per-layer"
            if per_layer or getattr(model, "fused_step", None) is None
            else "step"
        )
        row = {"mode": "bare", "path": path, "batch": B, "threads": torch.get_num_threads(), "step_ms": _ms(times[2:])}
        if dispatches and B == batch_sizes[0]:
            row["aten_ops_per_step"] = count_dispatches(model, tokens, [PROMPT_LEN + steps] * B, tables)
        print(json.dumps(row), flush=True)


def count_dispatches(model, tokens, positions, tables) -> int:
    """ATen operator calls of one decode step (views and in-place ops included; the compiled kernels' ctypes
    calls are not ATen ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        model.decode(tokens, positions, tables)
    return Count.n


def served(batch_sizes: list[int], new_tokens: int, root: str, llamacpp: str = "") -> None:
    """``python server.py`` from ``root`` (or ``llamacpp``: that llama-server binary on MODEL_ID, a GGUF, with
    NUM_THREADS threads); B streamed /v1/completions at once, ignore_eos: the gaps between each stream's
    tokens (the first token's wait, the prefill, excluded)."""
    import asyncio

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PORT=str(port), HOST="127.0.0.1", LOG_LEVEL="warning")
    env.setdefault("MAX_BATCH_SIZE", str(max(batch_sizes)))
    if llamacpp:
        slots, threads = env["MAX_BATCH_SIZE"], env.get("NUM_THREADS", "2")
        cmd = [llamacpp, "-m", env["MODEL_ID"], "--host", "127.0.0.1", "--port", str(port), "-np", slots]
        cmd += ["-t", threads, "-c", str(int(slots) * 256), "--no-webui"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        proc = subprocess.Popen([sys.executable, "server.py"], cwd=root, env=env)
    try:
        _wait_ready(port, proc, "/health" if llamacpp else "/ready")

        async def one(client, b: int) -> list[float]:
            body = {
                "prompt": [(7 * b + i) % 1000 + 10 for i in range(PROMPT_LEN)],
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            stamps = []
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"text"' in line:
                        stamps.append(time.perf_counter())
            return [b - a for a, b in zip(stamps, stamps[1:])]

        async def run(B: int) -> list[list[float]]:
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(one(client, b) for b in range(B)))

        for B in batch_sizes:
            asyncio.run(run(B))  # warm-up: the shapes of this batch size
            gaps = [g for stream in asyncio.run(run(B)) for g in stream[2:]]
            q = statistics.quantiles(gaps, n=20)
            print(json.dumps({"mode": "served", "batch": B, "itl_ms": _ms(gaps), "p95_ms": round(q[18] * 1e3, 2)}))
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def alternate(batch_sizes: list[int], steps: int) -> None:
    """Whole-step call against per-layer calls in one process, the two paths alternating step by step (each
    step decodes the same tokens at the same positions), so both see the same machine load."""
    from config import Config
    from models.runtime import HFEngine

    engine = HFEngine(Config.from_env())
    import torch

    model = engine.model
    plan = model.fused_step
    if plan is None:
        raise SystemExit("this model has no whole-step call here")
    per_seq = -(-(PROMPT_LEN + steps + 8) // model.kv.block_size)
    for B in batch_sizes:
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
        prompts = [[(7 * b + i) % 1000 + 10 for i in range(PROMPT_LEN)] for b in range(B)]
        tokens = model.forward([], [], [], prompts, tables).argmax(-1).tolist()
        times = {"step": [], "per-layer": []}
        for s in range(steps):
            positions = [PROMPT_LEN + s] * B
            for path in ("step", "per-layer") if s % 2 else ("per-layer", "step"):
                model.fused_step = plan if path == "step" else None
                t0 = time.perf_counter()
                logits = model.decode(tokens, positions, tables)
                times[path].append(time.perf_counter() - t0)
            tokens = logits.argmax(-1).tolist()
        model.fused_step = plan
        row = {"mode": "alternate", "batch": B, "threads": torch.get_num_threads()}
        row.update({f"{path}_ms": _ms(t[2:]) for path, t in times.items()})
        print(json.dumps(row), flush=True)


def _wait_ready(port: int, proc: subprocess.Popen, path: str) -> None:
    import urllib.request

    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("server did not become ready in 300 s")


def _ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["bare", "served", "alternate"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps (bare) / new tokens (served)")
    ap.add_argument("--dispatches", action="store_true", help="count ATen ops of one decode step (bare)")
    ap.add_argument("--torch-path", action="store_true", help="bare: lean decode steps off (attribution)")
    ap.add_argument("--per-layer", action="store_true", help="bare: lean steps as per-layer calls, not one call")
    ap.add_argument("--llamacpp", default="", help="served: this llama-server binary instead of ours")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    if os.environ.get("PYTHONPATH") != root:  # measure that checkout's modules: run again with it first on the path
        env = {**os.environ, "PYTHONPATH": root}
        again = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        sys.exit(subprocess.run(again, cwd=root, env=env).returncode)
    os.chdir(root)
    if args.mode == "alternate":
        alternate(args.batch, args.steps)
    elif args.mode == "bare":
        bare(args.batch, args.steps, args.dispatches, args.torch_path, args.per_layer)
    else:
        served(args.batch, args.steps, root, args.llamacpp)


if __name__ == "__main__":
    main()
