#!/usr/bin/env python
"""Bare decode step against the served step, one tree at a time (issue 14's measurement).

    python scripts/latency_probe.py bare   --batch 1 8          # engine forward alone: ms per decode step
    python scripts/latency_probe.py served --batch 1 8          # python server.py, B streams: ms between tokens
    python scripts/latency_probe.py bare --dispatches           # + ATen ops per decode step at batch 1
    python scripts/latency_probe.py bare --per-layer            # lean steps as per-layer calls (before the fused step)
    python scripts/latency_probe.py alternate --batch 1 8      # one process, steps alternating: whole-step call
                                                                # and per-layer calls (same load on both: a shared box)
    python scripts/latency_probe.py overhead --steps 200       # one user, in process: where a token's time goes
                                                                # outside the forward (issue 28 item 6)

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
        logits = model.forward_rows([], [], [], prompts, tables)
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
        tokens = model.forward_rows([], [], [], prompts, tables).argmax(-1).tolist()
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


def overhead(steps: int, baseline: str = "", stub_kernel: bool = False) -> None:
    """One user, in process, through the server's own pieces: the Scheduler on the engine's thread, a Generation
    (detokenizing, stop strings) and the chat stream's frames (``ChatFrames`` + ``sse``), greedy, ``steps`` tokens.
    Per token, the median microseconds of: the kernel (the compiled step, native runtime), the forward around it
    (building the step's rows: ``forward`` minus ``kernel``), sampling and the rest of ``execute``, planning,
    applying the output, detokenizing, the SSE frame, and the loop (the gap between two tokens minus all those).
    Then the sampling of each kind of request alone, on the model's own logits (``sample_costs``; ``baseline``: a
    git revision whose ``core/sampling.py`` is timed beside this one, interleaved). ``stub_kernel``: the compiled
    step does nothing and each forward returns logits the model gave before (every part outside the kernel runs as
    it does, on real logits): the gap between tokens is then all a token costs outside the forward."""
    import asyncio
    from types import SimpleNamespace

    import numpy as np

    from api.openai.frames import ChatFrames
    from api.streaming import sse
    from config import Config
    from core.generation import Generation
    from core.sequence import Sequence
    from models.runtime import build_engine
    from scheduler import Scheduler, engine_thread

    config = Config.from_env()
    thread = engine_thread()
    engine = thread.submit(build_engine, config).result()
    times: dict[str, list[float]] = {k: [] for k in ("kernel", "forward", "execute", "plan", "apply", "detok", "sse")}

    class Timed:
        """``fn`` called through, its wall time appended to ``times[key]``; its other attributes passed through."""

        def __init__(self, fn, key: str) -> None:
            self.fn, self.key, self.stubbed = fn, key, False

        def __call__(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return None if self.stubbed else self.fn(*args, **kwargs)
            finally:
                times[self.key].append(time.perf_counter() - t0)

        def __getattr__(self, name):
            return getattr(self.fn, name)

    def timed(obj, name: str, key: str) -> None:
        setattr(obj, name, Timed(getattr(obj, name), key))

    model = engine.model
    if hasattr(model, "step"):  # the native runtime's compiled whole-step calls (``StepKernel.run``)
        timed(model.step, "run", "kernel")
    timed(model, "forward", "forward")
    timed(engine, "execute", "execute")
    timed(engine.planner, "schedule", "plan")
    timed(engine.planner, "update_from_output", "apply")
    logits: list = []  # the model's own logits (the sampling costs run on them)
    replay: list = []  # with stub_kernel: what each forward returns instead of what the stubbed kernel left
    forward = model.forward

    def keep_logits(*args, **kwargs):
        out = forward(*args, **kwargs)
        if replay:
            out[:] = replay[len(times["forward"]) % len(replay)]
        if len(logits) < 64:
            logits.append(np.array(out[-1:], dtype=np.float32))
        return out

    model.forward = keep_logits
    prompt = engine.encode("Write a long story about a fox who learns to read the books of an old library.")
    if stub_kernel:
        if not hasattr(model, "step"):
            raise SystemExit("--stub-kernel needs the native runtime (its compiled step is what is stubbed)")
        warm = Sequence(prompt, 48, ignore_eos=True)
        thread.submit(engine.run_step, [warm], False).result()
        while not warm.is_finished:
            thread.submit(engine.run_step).result()
        replay[:] = logits
        model.step.run.stubbed = True
        for spent in times.values():
            spent.clear()

    async def one_user() -> list[float]:
        sched = Scheduler(engine, max_queue_depth=4, executor=thread)
        sched.start()
        gen = Generation(Sequence(prompt, steps, ignore_eos=True), engine.decode, sched)
        timed(gen.decoder, "push", "detok")
        frames = ChatFrames(SimpleNamespace(fingerprint="probe"), "chatcmpl-probe", "probe", False, False)
        stamps = []
        gen.start()
        async for chunk in gen.stream():
            t0 = time.perf_counter()
            event = frames.text(0, chunk)
            if event is not None:
                sse(event)
            stamps.append(t0)
            times["sse"].append(time.perf_counter() - t0)
        await sched.stop()
        return [b - a for a, b in zip(stamps, stamps[1:])]

    gaps = asyncio.run(one_user())[4:]
    skip = 4  # the prompt's step and the first decode steps (new shapes)
    per = {k: v[skip:] for k, v in times.items()}
    us = {k: round(statistics.median(v) * 1e6, 1) for k, v in per.items() if v}
    if "kernel" in us:
        us["rows"] = round(statistics.median(f - k for f, k in zip(per["forward"], per["kernel"])) * 1e6, 1)
    us["sample+"] = round(statistics.median(e - f for e, f in zip(per["execute"], per["forward"])) * 1e6, 1)
    us["gap"] = round(statistics.median(gaps) * 1e6, 1)
    us["gap_p10"] = round(float(np.percentile(gaps, 10)) * 1e6, 1)
    inside = ("execute", "plan", "apply", "detok", "sse")
    us["loop"] = round(us["gap"] - sum(us[k] for k in inside), 1)
    line = {"mode": "overhead", "kernel": "stubbed" if stub_kernel else "real", "us_per_token": us}
    print(json.dumps({**line, "load": os.getloadavg()[0]}), flush=True)
    sample_costs(np.concatenate(logits[skip:]), baseline)


def sample_costs(logits, baseline: str = "", repeat: int = 15) -> None:
    """``core.sampling.sample`` alone on real logits [n, V], one row at a time, for each kind of request:
    microseconds per token (10th percentile and median over ``repeat`` passes of the rows), and beside it,
    interleaved call by call in alternating order, ``baseline``'s ``core/sampling.py`` (a git revision), with the
    tokens both chose compared."""
    import numpy as np

    from core.sampling import SamplingParams, sample

    samplers = {"now": sample}
    if baseline:
        samplers[baseline] = _module_at(baseline, "core/sampling.py").sample
    kinds = {
        "greedy": SamplingParams(),
        "temperature": SamplingParams(temperature=0.8, seed=1),
        "top_k+top_p": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1),
        "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        "min_p": SamplingParams(temperature=0.8, min_p=0.05, seed=1),
        "penalties": SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.3, seed=1),
    }
    prompt, output = [list(range(100, 400))], [list(range(500, 700))]
    spent = {(who, k): [] for who in samplers for k in kinds}
    chosen: dict = {}
    for rep in range(repeat):
        for name, params in kinds.items():
            for who, fn in list(samplers.items()) if rep % 2 else list(samplers.items())[::-1]:
                tokens = []
                for row in logits:
                    t0 = time.perf_counter_ns()
                    tokens.append(fn(row[None], [params], prompt, output)[0])
                    spent[who, name].append(time.perf_counter_ns() - t0)
                chosen[who, name] = tokens
    for who in samplers:
        row = {k: [round(float(np.percentile(spent[who, k], q)) / 1e3, 1) for q in (10, 50)] for k in kinds}
        same = all(chosen[who, k] == chosen["now", k] for k in kinds)
        line = {"mode": "sample", "tree": who, "us_p10_p50": row, "rows": len(logits), "same_tokens": same}
        print(json.dumps({**line, "load": os.getloadavg()[0]}))


def _module_at(revision: str, path: str):
    """``path`` (a module of this checkout) as it is at git ``revision``, imported under another name."""
    import importlib.util
    import tempfile

    source = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"at_{abs(hash(revision))}", f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module


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
    ap.add_argument("mode", choices=["bare", "served", "alternate", "overhead"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps (bare) / new tokens (served)")
    ap.add_argument("--dispatches", action="store_true", help="count ATen ops of one decode step (bare)")
    ap.add_argument("--torch-path", action="store_true", help="bare: lean decode steps off (attribution)")
    ap.add_argument("--per-layer", action="store_true", help="bare: lean steps as per-layer calls, not one call")
    ap.add_argument("--llamacpp", default="", help="served: this llama-server binary instead of ours")
    ap.add_argument("--baseline", default="", help="overhead: a git revision whose sampling is timed beside")
    ap.add_argument("--stub-kernel", action="store_true", help="overhead: the compiled step does nothing")
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
    elif args.mode == "overhead":
        overhead(args.steps, args.baseline, args.stub_kernel)
    elif args.mode == "bare":
        bare(args.batch, args.steps, args.dispatches, args.torch_path, args.per_layer)
    else:
        served(args.batch, args.steps, root, args.llamacpp)


if __name__ == "__main__":
    main()
