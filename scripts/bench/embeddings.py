"""The ``embeddings`` workload: ``POST /v1/embeddings`` throughput, ours (``python server.py``, its own process) against
llama.cpp's ``llama-server --embeddings --pooling mean`` on the same GGUF, the same threads and slots.

Both get the same seeded inputs as token ids (windows of 32-256 tokens of the benchmark's texts; quick: fewer),
``batch`` inputs per request, every request sent at t0 (the servers batch them as they can). Reported per system:
inputs/s and input tokens/s over the run (the median of ``repeats`` runs after a warm-up), request latency p50 / p95,
peak RSS, and how far each system's vectors are from ours (cosine similarity: both are mean-pooled, L2-normalized
final hidden states of the same weights, computed by different kernels). ``llamacpp`` runs one input per micro-batch,
``llamacpp:batch=default`` at its default batch sizes (see ``start_llamacpp``: its vectors then depend on the batch).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

from scripts.bench import ROOT
from scripts.bench.servers import _free_port, _log_path, _process_handles, _wait_healthy, start_llama_server
from scripts.bench.workloads import PROMPT_TEXTS

EMBEDDINGS = "embeddings"


def inputs(tok, seed: int, quick: bool) -> list[list[int]]:
    """Seeded windows of the benchmark's texts as token ids: 64 inputs of 32-256 tokens (quick: 16 of 16-64)."""
    rng = random.Random(seed)
    text = " ".join(PROMPT_TEXTS * 20)
    ids = tok.encode(text, add_special_tokens=False)
    count, lo, hi = (16, 16, 64) if quick else (64, 32, 256)
    out = []
    for _ in range(count):
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - n)
        out.append(ids[start : start + n])
    return out


def start_ours(gguf: str, capacity: int, threads: int, context: int, count: int):
    """``python server.py`` on ``gguf``: -> (url, peak_rss_mb(), stop())."""
    env = {
        "MODEL_ID": gguf,
        "MAX_BATCH_SIZE": str(capacity),
        "NUM_THREADS": str(threads),
        "MAX_MODEL_LEN": str(context),
        "LOG_LEVEL": "WARNING",
        "MAX_QUEUE_DEPTH": str(count + 1),
        "MAX_CLIENT_QUEUE_SHARE": "1",
        "MAX_QUEUE_TIME_S": "0",
        "REQUEST_TIMEOUT_S": "0",
        "EMBEDDING_POOLING": "mean",
    }
    port = _free_port()
    env.update({"HOST": "127.0.0.1", "PORT": str(port)})
    log_path = _log_path(f"ours-embeddings-{port}.log")
    log_file = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "server.py")], env={**os.environ, **env}, stdout=log_file, stderr=log_file
    )
    _wait_healthy(proc, f"http://127.0.0.1:{port}/ready", 600, log_path, "the server")
    return f"http://127.0.0.1:{port}", *_process_handles(proc, log_file, 30)


def start_llamacpp(gguf: str, capacity: int, threads: int, context: int, batch: str = "input"):
    """``llama-server --embeddings --pooling mean`` on ``gguf``, ``capacity`` slots of ``context`` tokens. ``batch``
    "input": its batch and micro-batch the longest input (an embedding needs its input in one micro-batch), so a
    micro-batch rarely holds two inputs; "default": its defaults (2048, 512; or the longest input if longer), where
    several inputs share a micro-batch and, measured on SmolLM2 (llama.cpp 0.3.36's build here), their vectors
    change: cosine 0.64-0.97 against the same input alone for 5 of 8 inputs, where ours is batch-invariant and within
    0.9998 of llama.cpp's alone. -> (url, peak_rss_mb(), stop())."""
    from scripts.build_llamacpp import binary_path

    binary = binary_path()
    if binary is None:
        raise RuntimeError("llama-server is not built: run python scripts/build_llamacpp.py (10-30 min, once)")
    port = _free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--embeddings", "--pooling", "mean"]
    cmd += ["-np", str(capacity), "-c", str(capacity * context), "-t", str(threads), "--no-webui"]
    sizes = (context, context) if batch == "input" else (max(2048, context), max(512, context))
    cmd += ["-b", str(sizes[0]), "-ub", str(sizes[1])]
    log_path = _log_path(f"llamacpp-embeddings-{port}.log")
    proc, log_file, _ = start_llama_server(cmd, f"http://127.0.0.1:{port}/health", log_path, "auto")
    return f"http://127.0.0.1:{port}", *_process_handles(proc, log_file, 10)


async def run_once(url: str, requests: list[list[list[int]]]) -> tuple[float, list[float], list[list[float]]]:
    """Every request at t0 -> (wall seconds, each request's latency, the vectors in input order)."""
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(batch: list[list[int]]):
            start = time.perf_counter()
            r = await client.post(f"{url}/v1/embeddings", json={"input": batch, "encoding_format": "float"})
            r.raise_for_status()
            data = sorted(r.json()["data"], key=lambda d: d["index"])
            return time.perf_counter() - start, [d["embedding"] for d in data]

        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(b) for b in requests))
        wall = time.perf_counter() - t0
    return wall, [lat for lat, _ in answers], [v for _, vs in answers for v in vs]


def measure(start, requests: list[list[list[int]]], warmup: int, repeats: int) -> dict:
    """One system: started, warmed up, ``repeats`` timed runs; the median run's figures."""
    url, peak_rss_mb, stop = start()
    try:
        for _ in range(warmup):
            asyncio.run(run_once(url, requests))
        runs = [asyncio.run(run_once(url, requests)) for _ in range(repeats)]
        rss = peak_rss_mb()
    finally:
        stop()
    walls = [w for w, _, _ in runs]
    wall, latencies, vectors = runs[walls.index(statistics.median_low(walls))]
    count, tokens = sum(map(len, requests)), sum(len(x) for batch in requests for x in batch)
    latencies = sorted(latencies)
    return {
        "inputs_per_s": count / wall,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "latency_p50_ms": 1e3 * latencies[len(latencies) // 2],
        "latency_p95_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        "peak_rss_mb": rss,
        "runs_s": walls,
        "vectors": vectors,
    }


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import numpy as np

    out = []
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        out.append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))))
    return out


def embeddings_bench(args, tok, gguf: str, systems: list[str]) -> dict:
    """The workload over ``systems`` (ours, llamacpp) -> {"systems": {name: figures}, "cosine": ..., settings}."""
    if not gguf:
        raise SystemExit("the embeddings workload needs --model to be a .gguf file (llama.cpp serves the same file)")
    items = inputs(tok, args.seed, args.quick)
    batch, capacity = 4, 8
    requests = [items[i : i + batch] for i in range(0, len(items), batch)]
    context = max(map(len, items))
    starters = {
        "ours": lambda: start_ours(gguf, capacity, args.threads, context, len(items)),
        "llamacpp": lambda: start_llamacpp(gguf, capacity, args.threads, context),
        "llamacpp:batch=default": lambda: start_llamacpp(gguf, capacity, args.threads, context, "default"),
    }
    results: dict = {}
    for name in systems:
        if name not in starters:
            known = ", ".join(starters)
            results[name] = {"failed": True, "skipped": True, "error": f"{name} is not one of {known} here"}
            continue
        try:
            results[name] = measure(starters[name], requests, args.warmup, args.repeats)
        except Exception as exc:  # a system that fails is reported as failed, the others still run
            results[name] = {"failed": True, "error": f"{type(exc).__name__}: {exc}"}
    out = {"inputs": len(items), "tokens": sum(map(len, items)), "batch": batch, "capacity": capacity}
    ours = results.get("ours", {})
    for name, r in results.items():
        if name != "ours" and "vectors" in r and "vectors" in ours:
            cos = cosines(ours["vectors"], r["vectors"])
            out.setdefault("cosine_to_ours", {})[name] = {"min": min(cos), "mean": statistics.fmean(cos)}
    for r in results.values():
        r.pop("vectors", None)
    out["systems"] = results
    return out


def report_embeddings(result: dict) -> None:
    print(
        f"\n== embeddings: {result['inputs']} inputs ({result['tokens']} tokens), {result['batch']} per request, "
        f"all at t0, {result['capacity']} slots =="
    )
    print("| system | inputs/s | input tokens/s | latency p50 (ms) | p95 (ms) | peak RSS (MB) |")
    print("|---|---|---|---|---|---|")
    base = result["systems"].get("llamacpp", {})
    for name, r in result["systems"].items():
        if r.get("failed"):
            print(f"| {name} | {'skipped' if r.get('skipped') else 'failed'}: {r['error']} |||||")
            continue
        ratio = (
            f" ({r['inputs_per_s'] / base['inputs_per_s']:.2f}x)"
            if name != "llamacpp" and "inputs_per_s" in base
            else ""
        )
        print(
            f"| {name} | {r['inputs_per_s']:.1f}{ratio} | {r['tokens_per_s']:.0f} | {r['latency_p50_ms']:.0f} | "
            f"{r['latency_p95_ms']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    for name, c in result.get("cosine_to_ours", {}).items():
        print(f"{name} against ours, cosine per input: mean {c['mean']:.5f}, min {c['min']:.5f}")
