"""Systems: (model_dir, requests, capacity) -> (once() -> per-request dicts, config dict).

Each ``once()`` runs every request, all queued at t0, and returns per request its delivered
``tokens``, ``ttft`` and ``e2e`` (seconds from t0). ``once.stop`` / ``once.peak_rss_mb``, when set,
stop a server and read its peak RSS. ``ours_ray`` is the exception: Ray Serve against our own HTTP
server, measured side by side by ``deploy/bench_ray.py`` (``run_ours_ray``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from . import ROOT
from .workloads import Request, slot_context


def system_static_hf(model_dir: str, requests: list[Request], capacity: int):
    """FCFS batches of `capacity` through HF generate; a request finishes when its batch does."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from model_runner import HFModelRunner, left_pad

    runner = HFModelRunner(model_dir)

    class FirstStep(LogitsProcessor):
        """Records when the batch's first token is chosen (that is every row's TTFT)."""

        def __init__(self):
            self.time = None

        def __call__(self, input_ids, scores):
            if self.time is None:
                self.time = time.perf_counter()
            return scores

    def once() -> list[dict]:
        out = []
        t0 = time.perf_counter()
        for start in range(0, len(requests), capacity):
            batch = requests[start : start + capacity]
            ids, mask = left_pad([r.prompt_ids for r in batch], runner.pad_id)  # each [B, W]
            width = ids.shape[1]
            first = FirstStep()
            with torch.inference_mode():
                gen = runner.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    eos_token_id=None,
                    max_new_tokens=max(r.max_new_tokens for r in batch),
                    pad_token_id=runner.pad_id,
                    logits_processor=LogitsProcessorList([first]),
                )
            end = time.perf_counter()
            for r in batch:
                out.append(
                    {"tokens": min(r.max_new_tokens, gen.shape[1] - width), "ttft": first.time - t0, "e2e": end - t0}
                )
        return out

    return once, {"batching": "static FCFS batches, left-padded, HF generate(do_sample=False)", "batch_size": capacity}


def system_hf_cb(model_dir: str, requests: list[Request], capacity: int):
    """transformers' continuous batching (ContinuousBatchingManager), same request cap, all queued at t0."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    page = 32
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    # eos_token_id=-1: no EOS (None would fall back to the model's EOS).
    gen = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.max_new_tokens for r in requests)
    )
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=capacity,  # the request cap, as for ours
        max_batch_tokens=max(256, 2 * capacity),  # explicit: left unset it sizes itself from system RAM
        page_size=page,
        num_blocks=capacity * (longest // page + 2),  # KV pages for `capacity` of the longest requests
        scheduler_type="fifo",
        allow_block_sharing=False,
        auto_switch_to_flash=False,
    )
    config = {
        "attn_implementation": "sdpa",
        "max_requests_per_batch": capacity,
        "max_batch_tokens": cb.max_batch_tokens,
        "page_size": page,
        "num_blocks": cb.num_blocks,
        "scheduler_type": "fifo",
    }

    def once() -> list[dict]:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        done: dict[str, object] = {}
        t0 = time.perf_counter()
        try:
            for i, r in enumerate(requests):
                manager.add_request(
                    r.prompt_ids,
                    request_id=f"r{i}",
                    max_new_tokens=r.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            deadline = time.monotonic() + 1800
            while len(done) < len(requests):
                if time.monotonic() > deadline or not manager.is_running():
                    raise RuntimeError(f"continuous batching stopped with {len(done)}/{len(requests)} requests done")
                out = manager.get_result(timeout=1.0)
                if out is not None and out.is_finished():
                    if out.error:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    done[out.request_id] = out
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
        return [
            {"tokens": len(o.generated_tokens), "ttft": o.timestamps[0] - t0, "e2e": o.lifespan[1] - t0}
            for o in done.values()
        ]

    return once, config


def system_ours(model_dir: str, requests: list[Request], capacity: int, weights: str = "auto", gguf: str = ""):
    """Our server's engine; ``weights`` is its WEIGHTS setting, ``gguf`` the file a .gguf model is served from
    (at its own precision under "auto")."""
    import asyncio

    from config import Config
    from engine import HFEngine
    from scheduler import Scheduler
    from sequence import Sequence

    # A GGUF's peer is llama.cpp, given the workload's longest request as its context per slot: ours gets
    # the same, so that peak RSS compares weights and runtime rather than KV caches of different sizes.
    context = slot_context(requests) if gguf else 0
    engine = HFEngine(
        Config(
            model_id=gguf or model_dir,
            max_batch_size=capacity,
            num_threads=0,
            weights=weights,
            max_model_len=context,
        )
    )

    def once() -> list[dict]:
        async def main():
            sched = Scheduler(engine, max_queue_depth=len(requests) + 1)
            sched.start()
            t0 = time.perf_counter()
            seqs = [
                Sequence(
                    prompt_token_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens, ignore_eos=True, arrival_time=t0
                )
                for r in requests
            ]
            done = await asyncio.gather(*(sched.submit(s) for s in seqs))
            await sched.stop()
            return t0, done

        t0, done = asyncio.run(main())
        return [
            {"tokens": len(s.output_token_ids), "ttft": s.first_token_time - t0, "e2e": s.finish_time - t0}
            for s in done
        ]

    once.engine = engine
    resident = engine.model.resident_weights()
    return once, {
        "engine": "HFEngine (hand-written forward, preallocated KV, oneDNN / quantized linears)",
        "capacity": capacity,
        "weights": weights,
        "resident_weight_mb": {fmt: round(n / 2**20, 1) for fmt, n in resident.items()},
    }


def system_llamacpp(model_dir: str, requests: list[Request], capacity: int, weights: str = "", gguf: str = ""):
    """llama.cpp's llama-server (scripts/build_llamacpp.py) on the same GGUF: -np CAPACITY slots, the
    same threads, every request's token ids to /v1/completions with ignore_eos, streamed (for TTFT)."""
    import asyncio
    import socket
    import urllib.request

    import httpx
    import torch
    from build_llamacpp import binary_path

    binary = binary_path()
    if binary is None:
        raise RuntimeError("llama-server is not built: run python scripts/build_llamacpp.py (10-30 min, once)")
    if not gguf:
        raise RuntimeError("llamacpp needs --model to be a .gguf file")
    context = slot_context(requests)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(capacity),
        "-t",
        str(torch.get_num_threads()),
        "-c",
        str(capacity * context),
        "--no-webui",
    ]
    log_file = open(os.path.join(ROOT, "weights", f"llamacpp-{port}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:  # bounded wait for the model to load
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"llama-server did not become healthy (see weights/llamacpp-{port}.log)")
        time.sleep(0.5)

    async def one(client, r: Request, t0: float) -> dict:
        body = {
            "prompt": r.prompt_ids,
            "max_tokens": r.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "cache_prompt": False,
        }
        first, tokens = None, 0
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    tokens += 1
                    first = first or time.perf_counter()
        end = time.perf_counter()
        return {"tokens": tokens, "ttft": (first or end) - t0, "e2e": end - t0}

    def once() -> list[dict]:
        async def main():
            limits = httpx.Limits(max_connections=len(requests) + 1)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                t0 = time.perf_counter()
                return await asyncio.gather(*(one(client, r, t0) for r in requests))

        return list(asyncio.run(main()))

    def peak_rss_mb() -> float:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()

    once.peak_rss_mb, once.stop = peak_rss_mb, stop
    return once, {"engine": f"llama-server ({binary}), -np {capacity}, -c {capacity * context}", "capacity": capacity}


SYSTEM_FNS = {"static_hf": system_static_hf, "hf_cb": system_hf_cb, "ours": system_ours, "llamacpp": system_llamacpp}
RAY_SYSTEM = "ours_ray"  # not a SYSTEM_FNS entry: three HTTP servers measured side by side (run_ours_ray)


def parse_system(name: str) -> tuple[str, dict]:
    """ "ours:int8" -> ("ours", {"weights": "int8"}); plain names -> (name, {})."""
    base, _, weights = name.partition(":")
    if (base not in SYSTEM_FNS and base != RAY_SYSTEM) or (weights and base != "ours"):
        known = ", ".join([*SYSTEM_FNS, RAY_SYSTEM])
        raise SystemExit(f"unknown system {name!r} (choose from {known}; ours:auto|fp32|int8|int4)")
    return base, ({"weights": weights} if weights else {})


def ray_missing() -> str | None:
    """Why ``ours_ray`` cannot run here, or None when Ray Serve is installed."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'ray[serve]==2.60.0', see requirements.txt): ours_ray skipped"
    return None


def run_ours_ray(model_id: str, tok, requests: list[Request], capacity: int, repeats: int, cpus: int) -> dict:
    """``python server.py`` (``ours``) against Ray Serve with 1 and 2 replicas (``ours_ray1``, ``ours_ray2``),
    all over HTTP on 127.0.0.1, by ``deploy/bench_ray.py``: ``repeats`` interleaved rounds of the workload
    (its prompts as text to /generate, same budgets, EOS ignored), then the proxy's added idle TTFT.

    -> {"systems": {name: tokens/s, TTFT, x ours, idle TTFT}, "config": ...}; no per-request latencies.
    """
    from deploy import bench_ray

    reqs = [(tok.decode(r.prompt_ids), r.max_new_tokens) for r in requests]
    env = {"MODEL_ID": model_id, "MAX_BATCH_SIZE": str(capacity), "LOG_LEVEL": "WARNING"}
    probes = 6 if repeats <= 1 else 30
    with bench_ray.direct_server(env, cpus) as direct, bench_ray.ray_fleet(env, cpus, [1, 2]) as ray_urls:
        results = bench_ray.interleaved({"ours": direct, **ray_urls}, reqs, repeats)
        for name, url in ray_urls.items():
            results[name].update(bench_ray.proxy_overhead(direct, url, probes))
    config = {
        "model": model_id,
        "capacity_per_replica": capacity,
        "cpus": cpus,
        "repeats": repeats,
        "idle_probes": probes,
    }
    return {"systems": results, "config": config, "requests": len(reqs)}
