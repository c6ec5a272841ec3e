#!/usr/bin/env python
"""Every system on the same requests, the same model and the same machine, in one run.

    python scripts/benchmark.py                                  # seed workload, all systems
    python scripts/benchmark.py --workload seed,scale,sweep --json bench.json --plot bench_plots
    python scripts/benchmark.py --quick --json out.json          # small and fast (used by the tests)

Systems: ``static_hf`` (HF ``generate`` on FCFS batches, model_runner.py), ``hf_cb``
(transformers' own continuous batching, ``generate_batch``), ``ours`` (HFEngine behind the
asyncio scheduler; ``ours:int8`` etc. at another WEIGHTS setting), ``llamacpp`` (llama.cpp's
llama-server on the same .gguf, built once by scripts/build_llamacpp.py; not in the default set).
Each runs in its own subprocess (peak RSS is its own; llama.cpp's is its server's) on the same
seeded token-id requests, all queued at t0, EOS ignored so each request delivers exactly its
budget: an untimed warm-up, then ``--repeats`` timed runs, reporting the median run. A
system that fails is reported as failed with its error. Figures are comparable within one
run only (this machine is shared and noisy): read the ratios.

Alongside, for ours: the decode step as the scheduler sees it against the bare forward
(``model.decode`` alone, same batch and context lengths) -> engine overhead, and the bare
forward's achieved GFLOP/s and weight bandwidth against this machine's measured fp32 matmul
peak and copy bandwidth -> roofline fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

PROMPT_TEXTS = [
    "Hello!",
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Summarize the plot of a heist movie in two sentences, focusing on the twist at the end.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his curious cat. "
    "Every morning they rowed out past the lighthouse, and every evening they came back with a story. "
    "One day the cat found a bottle with a map inside it.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "# Explain what this function returns for n = 10 and why:\n",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Translate to French: I would like a cup of coffee and a croissant, please.",
]
SYSTEMS = ("static_hf", "hf_cb", "ours")
SWEEP_CAPACITIES = (1, 2, 4, 8, 16, 32)


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int


# --- workloads: (tokenizer, seed, quick) -> (requests, capacity) ---------------------------------
def seed_workload(tok, seed: int, quick: bool) -> tuple[list[Request], int]:
    """32 requests at t0, capacity 8, prompts from a one-liner to a paragraph and code, budgets 8-48."""
    rng = random.Random(seed)
    reqs = [Request(tok.encode(rng.choice(PROMPT_TEXTS)), rng.choice([8, 16, 32, 48])) for _ in range(32)]
    return (reqs[:8] if quick else reqs), 8


def _window(tok, rng: random.Random, length: int) -> list[int]:
    """A prompt of exactly `length` tokens cut from the prompt texts."""
    ids = tok.encode(" ".join(PROMPT_TEXTS))
    while len(ids) < length + 1:
        ids = ids + ids
    start = rng.randrange(0, len(ids) - length)
    return ids[start : start + length]


def scale_workload(tok, seed: int, quick: bool) -> tuple[list[Request], int]:
    """128 requests at t0, capacity 32, prompts 16-256 tokens, budgets 16-128."""
    rng = random.Random(seed)
    n = 32 if quick else 128
    return [Request(_window(tok, rng, rng.randint(16, 256)), rng.randint(16, 128)) for _ in range(n)], 32


def sweep_workload(tok, seed: int, quick: bool, capacity: int) -> tuple[list[Request], int]:
    """The same 32 requests (prompts 32-64 tokens, 32 new tokens each) at a given capacity."""
    rng = random.Random(seed)
    n = 8 if quick else 32
    return [Request(_window(tok, rng, rng.randint(32, 64)), 16 if quick else 32) for _ in range(n)], capacity


def build_workload(name: str, tok, seed: int, quick: bool, capacity: int = 0):
    if name == "seed":
        return seed_workload(tok, seed, quick)
    if name == "scale":
        return scale_workload(tok, seed, quick)
    if name == "sweep":
        return sweep_workload(tok, seed, quick, capacity)
    raise ValueError(name)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# --- systems: (model_dir, requests, capacity) -> (once() -> per-request dicts, config dict) ------
def system_static_hf(model_dir: str, requests: list[Request], capacity: int):
    """FCFS batches of `capacity` through HF generate; a request finishes when its batch does."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from model_runner import HFModelRunner

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
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.full((len(batch), width), runner.pad_id)  # [B, W] left-padded
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
                mask[row, width - len(r.prompt_ids) :] = 1
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


def slot_context(requests: list[Request]) -> int:
    """Tokens of KV cache per slot that every request fits in (llama.cpp gets -c slots x this)."""
    return max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + 8


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


def parse_system(name: str) -> tuple[str, dict]:
    """ "ours:int8" -> ("ours", {"weights": "int8"}); plain names -> (name, {})."""
    base, _, weights = name.partition(":")
    if base not in SYSTEM_FNS or (weights and base != "ours"):
        raise SystemExit(f"unknown system {name!r} (choose from {', '.join(SYSTEM_FNS)}; ours:auto|fp32|int8|int4)")
    return base, ({"weights": weights} if weights else {})


def summarize(per_request: list[dict]) -> dict:
    wall = max(r["e2e"] for r in per_request)
    tokens = sum(r["tokens"] for r in per_request)
    lat = [r["e2e"] * 1e3 for r in per_request]
    ttft = [r["ttft"] * 1e3 for r in per_request]
    tpot = [(r["e2e"] - r["ttft"]) * 1e3 / (r["tokens"] - 1) for r in per_request if r["tokens"] > 1]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_ms": {"p50": percentile(lat, 0.5), "p95": percentile(lat, 0.95), "p99": percentile(lat, 0.99)},
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95)},
        "tpot_ms": {"p50": percentile(tpot, 0.5), "p95": percentile(tpot, 0.95)},
        "latencies_ms": sorted(lat),
    }


# --- bare forward, engine overhead and roofline (inside the `ours` worker) -----------------------
def machine_peaks() -> dict:
    """Measured fp32 matmul peak (GFLOP/s) and copy bandwidth (GB/s) of this machine, best of a few."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    src, dst = torch.empty(64 * 2**20), torch.empty(64 * 2**20)  # 256 MiB each
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return {"matmul_gflops": 2 * 2048**3 / best / 1e9, "copy_gb_s": 2 * src.numel() * 4 / copy / 1e9}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_linears(model) -> list:
    """Every ``gpt2.Linear`` of our model (blocks and lm_head), found by walking its attributes."""
    from models.layers import Linear

    found, seen = [], set()

    def walk(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Linear):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif hasattr(obj, "__dict__") and type(obj).__module__ in ("models.gpt2", "models.llama"):
            for x in vars(obj).values():
                walk(x)

    walk(model)
    return found


def linear_shapes(model) -> list[tuple[int, int]]:
    """(out, in) of every linear in our model."""
    return [(lin.out_features, lin.in_features) for lin in model_linears(model)]


def decode_cost(model, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, weight bytes) of one decode step: linears (2*out*in per token) + attention (4*L*H*D per layer)."""
    shapes = linear_shapes(model)
    linear_flops = sum(2 * o * i for o, i in shapes)
    kv = model.kv.k
    n_layer, _, n_kv_head, _, head_dim = kv.shape
    q_heads = getattr(model, "n_head", n_kv_head)
    attn_flops = n_layer * 4 * context * q_heads * head_dim
    # bytes a step streams: each linear's one copy the step reads (a quantized weight's packed bytes)
    weight_bytes = sum(
        lin.quant.nbytes if lin.quant is not None else lin.out_features * lin.in_features * 4
        for lin in model_linears(model)
    )
    return batch * (linear_flops + attn_flops), weight_bytes


def overhead_and_roofline(
    engine, batch_sizes: list[int], prompt_len: int, steps: int, peaks: dict, rounds: int = 6
) -> list[dict]:
    """Per batch size: our decode step inside the scheduler loop vs the bare forward alone."""
    import asyncio

    from scheduler import Scheduler
    from sequence import Sequence

    model = engine.model
    rows = []
    for batch in batch_sizes:
        if batch > engine.capacity:
            continue
        prompt = [(i * 7919) % 200 + 10 for i in range(prompt_len)]

        async def scheduled() -> list[float]:
            stamps: list[float] = []
            sched = Scheduler(engine, max_queue_depth=batch + 1)
            sched.on_tokens = lambda seqs: stamps.append(time.perf_counter())
            sched.start()
            seqs = [Sequence(prompt_token_ids=prompt, max_new_tokens=steps + 1, ignore_eos=True) for _ in range(batch)]
            await asyncio.gather(*(sched.submit(s) for s in seqs))
            await sched.stop()
            return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # step-to-step, after the admit callback

        def bare_round() -> list[float]:
            """Same rows, same positions, nothing but model.decode (over blocks of its own: the engine is idle)."""
            per_row = -(-(prompt_len + steps + 1) // model.kv.block_size)
            tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(batch)]
            model.prefill([prompt] * batch, tables)
            return [_timed(lambda: model.decode([11] * batch, [prompt_len + s] * batch, tables)) for s in range(steps)]

        # Pair the two, round by round, so that a noisy minute hits both alike; the overhead is the
        # median of the per-round ratios. The bare forward runs in a worker thread of its own, as
        # the engine does: an OpenMP team left spinning by one thread slows another thread's team
        # badly on a 2-core box.
        engine_steps, bare, ratios = [], [], []
        for _ in range(rounds):
            engine_round = asyncio.run(scheduled())
            with ThreadPoolExecutor(max_workers=1) as pool:
                bare_round_ms = pool.submit(bare_round).result()
            ratios.append(statistics.median(engine_round) / statistics.median(bare_round_ms))
            engine_steps += engine_round
            bare += bare_round_ms
        engine_ms = statistics.median(engine_steps) * 1e3
        bare_ms = statistics.median(bare) * 1e3
        flops, weight_bytes = decode_cost(model, batch, prompt_len + steps // 2)
        compute_s = flops / (peaks["matmul_gflops"] * 1e9)
        memory_s = weight_bytes / (peaks["copy_gb_s"] * 1e9)
        rows.append(
            {
                "batch": batch,
                "context": prompt_len + steps // 2,
                "engine_step_ms": engine_ms,
                "bare_step_ms": bare_ms,
                "overhead_pct": (statistics.median(ratios) - 1) * 100,
                "overhead_pct_per_round": [(r - 1) * 100 for r in ratios],
                "bare_gflops": flops / (bare_ms / 1e3) / 1e9,
                "bare_weight_gb_s": weight_bytes / (bare_ms / 1e3) / 1e9,
                "roofline_step_ms": max(compute_s, memory_s) * 1e3,
                "roofline_fraction": max(compute_s, memory_s) / (bare_ms / 1e3),
                "bare_tokens_per_s": batch / (bare_ms / 1e3),
            }
        )
    return rows


def linear_kernel_rates(model, rows: tuple[int, ...], repeats: int = 3) -> list[dict]:
    """Per row count M: GB/s of weights streamed through every linear of the model in turn, by
    oneDNN and by the small-batch kernel (small_gemm.c), on the model's own packed weights.
    Runs in a worker thread of its own, as the engine does."""
    import torch

    from models.kernels import small_gemm

    linears = model_linears(model)
    if linears and linears[0].quant is not None:  # quantized: the one kernel every call takes
        return quant_kernel_rates(linears, rows, repeats)
    if not linears or not linears[0].onednn:
        return []
    weight_bytes = sum(lin.out_features * lin.in_features * 4 for lin in linears)

    def onednn(x, lin):
        return torch.ops.mkldnn._linear_pointwise(x, lin.weight, None, "none", [], "")

    def kernel(x, lin):
        return small_gemm.matmul(x, lin.small, lin.out_features)

    def rate(fn, m: int) -> float:
        xs = {lin.in_features: torch.randn(m, lin.in_features) for lin in linears}
        runs = []
        for _ in range(repeats + 1):  # the first pass warms up
            runs.append(_timed(lambda: [fn(xs[lin.in_features], lin) for lin in linears]))
        return weight_bytes / min(runs[1:]) / 1e9

    def measure() -> list[dict]:
        out = []
        for m in rows:
            entry = {"rows": m, "onednn_gb_s": rate(onednn, m)}
            if linears[0].small is not None:
                entry["small_gemm_gb_s"] = rate(kernel, m)
            out.append(entry)
        return out

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(measure).result()


def quant_kernel_rates(linears: list, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """Per row count M: GB/s of packed int8/int4 weights streamed by quant_gemm through every linear."""
    import torch

    from models.kernels import quant_gemm

    weight_bytes = sum(lin.quant.nbytes for lin in linears)

    def measure() -> list[dict]:
        out = []
        for m in rows:
            xs = {lin.in_features: torch.randn(m, lin.in_features) for lin in linears}
            runs = [
                _timed(lambda: [quant_gemm.matmul(xs[lin.in_features], lin.quant) for lin in linears])
                for _ in range(repeats + 1)
            ]  # the first pass warms up
            out.append({"rows": m, "quant_gemm_gb_s": weight_bytes / min(runs[1:]) / 1e9, "fmt": linears[0].fmt})
        return out

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(measure).result()


# --- worker and driver ---------------------------------------------------------------------------
def worker(args) -> None:
    """Run one system on one workload (one capacity); print one JSON line."""
    import torch
    from transformers import AutoTokenizer

    from engine import physical_cores

    torch.set_num_threads(args.threads or physical_cores())
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    requests, capacity = build_workload(args.workload, tok, args.seed, args.quick, args.capacity)
    peaks = machine_peaks() if args.overhead else None  # first, before any other thread has run torch
    base, kwargs = parse_system(args.system)
    if base in ("ours", "llamacpp"):
        kwargs["gguf"] = args.gguf
    once, config = SYSTEM_FNS[base](args.model_dir, requests, capacity, **kwargs)
    try:
        once()  # untimed warm-up
        runs = [summarize(once()) for _ in range(args.repeats)]
        server_rss = once.peak_rss_mb() if hasattr(once, "peak_rss_mb") else None
    finally:
        if hasattr(once, "stop"):
            once.stop()
    result = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
    result["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    result["capacity"] = capacity
    result["requests"] = len(requests)
    result["config"] = config
    if base == "ours" and args.overhead:
        sizes = [b for b in (1, 8, 32) if b <= capacity] if not args.quick else [min(2, capacity)]
        result["machine_peaks"] = peaks
        result["overhead"] = overhead_and_roofline(
            once.engine, sizes, 64, 8 if args.quick else 16, peaks, 2 if args.quick else 6
        )
        result["linear_kernels"] = linear_kernel_rates(once.engine.model, (1, 8) if args.quick else (1, 4, 8, 16, 32))
    result["peak_rss_mb"] = server_rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def run_worker(args, system: str, model_dir: str, workload: str, capacity: int = 0, overhead: bool = False) -> dict:
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--system",
            system,
            "--model-dir",
            model_dir,
            "--workload",
            workload,
            "--repeats",
            str(args.repeats),
            "--seed",
            str(args.seed),
            "--threads",
            str(args.threads),
            "--capacity",
            str(capacity),
            "--gguf",
            args.gguf,
        ]
        + (["--quick"] if args.quick else [])
        + (["--overhead"] if overhead else [])
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": True, "error": f"timed out after {args.timeout}s"}
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
        err = next((l for l in reversed(lines) if "Error" in l or "error" in l), lines[-1] if lines else "no output")
        return {"failed": True, "error": err.strip()[:300]}
    return json.loads(line[len("RESULT ") :])


def resolve_model(name: str) -> tuple[str, str]:
    """(directory or id to load, note). A .gguf file is converted once (checkpoints.py); distilgpt2
    falls back to a distilgpt2-shaped random checkpoint offline."""
    from checkpoints import is_gguf, resolve_model_id

    if is_gguf(name):
        return resolve_model_id(name), (
            f"model: {name} (GGUF: ours serves the file at its WEIGHTS setting, auto = its own quantization; "
            "llamacpp reads the file; the HF baselines run its fp32 conversion)"
        )
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name)
        return name, f"model: {name}"
    except Exception as exc:  # no hub access, missing dir
        if name != "distilgpt2":
            raise SystemExit(f"cannot load model {name!r}: {exc}")
    from make_test_model import build_checkpoint

    path = os.path.join(ROOT, "weights", "bench-distilgpt2")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_checkpoint(path, shape="distilgpt2", initializer_range=0.02)
    return (
        path,
        "model: distilgpt2 could not be loaded offline, so a distilgpt2-shaped RANDOM-weight checkpoint (6x768, vocab 50257) stands in",
    )


def machine_line(threads: int) -> str:
    import torch

    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {threads} torch threads, torch {torch.__version__}, Python {platform.python_version()}, fp32"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="distilgpt2", help="hub id or local checkpoint directory (or .gguf)")
    p.add_argument("--workload", default="seed", help="comma-separated: seed, scale, sweep")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = physical cores)")
    p.add_argument("--quick", action="store_true", help="a few requests, 1 timed run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per system run before it counts as failed")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--plot", help="write PNG plots into this directory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--capacity", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--overhead", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gguf", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.repeats = 1

    from tqdm import tqdm

    from engine import physical_cores

    args.threads = args.threads or physical_cores()
    model_dir, note = resolve_model(args.model)
    from checkpoints import is_gguf

    args.gguf = os.path.abspath(os.path.expanduser(args.model)) if is_gguf(args.model) else ""
    machine = machine_line(args.threads)
    print(note)
    print("machine:", machine)
    workloads = [w for w in args.workload.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        parse_system(s)
    jobs = []
    for w in workloads:
        caps = (SWEEP_CAPACITIES[:2] if args.quick else SWEEP_CAPACITIES) if w == "sweep" else (0,)
        jobs += [(w, c, s) for c in caps for s in systems]
    results: dict = {w: {} for w in workloads}
    for w, cap, system in tqdm(jobs, desc="benchmark", unit="run"):
        overhead = system.startswith("ours") and w != "sweep"
        r = run_worker(args, system, model_dir, w, cap, overhead)
        if w == "sweep":
            results[w].setdefault(system, {})[str(cap)] = r
        else:
            results[w][system] = r
    for w in workloads:
        print(f"\n== workload {w} ==")
        if w == "sweep":
            print_sweep(results[w])
        else:
            print_table(results[w])
            for name, r in results[w].items():
                if name.startswith("ours") and "overhead" in r:
                    print(f"\n-- {name} --")
                    print_overhead(r)
                    print_linear_kernels(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": model_dir,
                    "note": note,
                    "machine": machine,
                    "repeats": args.repeats,
                    "quick": args.quick,
                    "results": results,
                },
                f,
                indent=2,
            )
        print(f"\nwrote {args.json}")
    if args.plot:
        for path in plot(results, args.plot, note):
            print("wrote", path)
    failed = [(w, s) for w in results for s, r in results[w].items() if r.get("failed")]
    return 1 if "ours" in {s for _, s in failed} else 0


def print_table(results: dict) -> None:
    base = results.get("static_hf", {}).get("tokens_per_s")
    cb = results.get("hf_cb", {}).get("tokens_per_s")
    lc = results.get("llamacpp", {}).get("tokens_per_s")
    head = (
        f"{'system':<10} {'tok/s':>7} {'x static':>8} {'x hf_cb':>7} {'x llama':>7} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
        f"{'TTFT50':>7} {'TTFT95':>7} {'TPOT50':>7} {'TPOT95':>7} {'RSS MB':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        if r.get("failed"):
            print(f"{name:<10} FAILED: {r['error']}")
            continue
        x_static = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        x_cb = f"{r['tokens_per_s'] / cb:.2f}" if cb else "-"
        x_lc = f"{r['tokens_per_s'] / lc:.2f}" if lc else "-"
        lat, ttft, tpot = r["latency_ms"], r["ttft_ms"], r["tpot_ms"]
        print(
            f"{name:<10} {r['tokens_per_s']:>7.1f} {x_static:>8} {x_cb:>7} {x_lc:>7} "
            f"{lat['p50']:>7.0f} {lat['p95']:>7.0f} "
            f"{lat['p99']:>7.0f} {ttft['p50']:>7.0f} {ttft['p95']:>7.0f} {tpot['p50']:>7.1f} {tpot['p95']:>7.1f} "
            f"{r['peak_rss_mb']:>6.0f}"
        )


def print_overhead(ours: dict) -> None:
    peaks = ours["machine_peaks"]
    print(
        f"\nmachine peaks: fp32 matmul {peaks['matmul_gflops']:.0f} GFLOP/s, copy bandwidth {peaks['copy_gb_s']:.1f} GB/s"
    )
    head = (
        f"{'batch':>5} {'context':>7} {'engine ms':>9} {'bare ms':>8} {'overhead':>8} {'GFLOP/s':>8} "
        f"{'weights GB/s':>12} {'roofline ms':>11} {'of roofline':>11}"
    )
    print(head)
    for o in ours["overhead"]:
        print(
            f"{o['batch']:>5} {o['context']:>7} {o['engine_step_ms']:>9.1f} {o['bare_step_ms']:>8.1f} "
            f"{o['overhead_pct']:>7.1f}% {o['bare_gflops']:>8.1f} {o['bare_weight_gb_s']:>12.1f} "
            f"{o['roofline_step_ms']:>11.1f} {o['roofline_fraction'] * 100:>10.0f}%"
        )


def print_linear_kernels(ours: dict) -> None:
    rates = ours.get("linear_kernels") or []
    if not rates:
        return
    print("\nweights streamed per second through every linear (GB/s), by rows per call:")
    if "quant_gemm_gb_s" in rates[0]:
        print(f"{'rows':>5} {'quant_gemm (' + rates[0]['fmt'] + ')':>18}")
        for r in rates:
            print(f"{r['rows']:>5} {r['quant_gemm_gb_s']:>18.1f}")
        return
    print(f"{'rows':>5} {'oneDNN':>8} {'small_gemm':>10}")
    for r in rates:
        small = f"{r['small_gemm_gb_s']:>10.1f}" if "small_gemm_gb_s" in r else f"{'off':>10}"
        print(f"{r['rows']:>5} {r['onednn_gb_s']:>8.1f} {small}")


def print_sweep(results: dict) -> None:
    caps = sorted({int(c) for sys_r in results.values() for c in sys_r})
    print(f"{'tok/s at capacity':<18}" + "".join(f"{c:>8}" for c in caps))
    for name, by_cap in results.items():
        cells = []
        for c in caps:
            r = by_cap.get(str(c), {})
            cells.append(f"{'FAIL':>8}" if r.get("failed") else f"{r.get('tokens_per_s', float('nan')):>8.1f}")
        print(f"{name:<18}" + "".join(cells))


def _footnote(fig, note: str) -> None:
    """The model note under the axes (savefig's tight bbox grows the canvas to hold it)."""
    import textwrap

    fig.text(0.5, -0.02, textwrap.fill(note, 110), ha="center", va="top", fontsize=6)


def plot(results: dict, out_dir: str, note: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if "sweep" in results:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, by_cap in results["sweep"].items():
            pts = sorted((int(c), r["tokens_per_s"]) for c, r in by_cap.items() if not r.get("failed"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (max concurrent sequences)")
        ax.set_ylabel("delivered tokens/s")
        ax.set_title("Throughput vs capacity (sweep workload)")
        ax.grid(alpha=0.3)
        ax.legend()
        _footnote(fig, note)
        paths.append(os.path.join(out_dir, "throughput_vs_capacity.png"))
        fig.savefig(paths[-1], dpi=130, bbox_inches="tight")
        plt.close(fig)
    for w, res in results.items():
        if w == "sweep":
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, r in res.items():
            if not r.get("failed"):
                lat = r["latencies_ms"]
                ax.step([x / 1e3 for x in lat], [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=name)
        ax.set_xlabel("request latency from t0 (s)")
        ax.set_ylabel("fraction of requests done")
        ax.set_title(f"Latency CDF ({w} workload)")
        ax.grid(alpha=0.3)
        ax.legend()
        _footnote(fig, note)
        paths.append(os.path.join(out_dir, f"latency_cdf_{w}.png"))
        fig.savefig(paths[-1], dpi=130, bbox_inches="tight")
        plt.close(fig)
    return paths


if __name__ == "__main__":
    sys.exit(main())
