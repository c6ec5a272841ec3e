#!/usr/bin/env python
"""Static HF generate vs our continuous batching, side by side on the same requests, in one run.

    python scripts/benchmark.py                         # seed workload, distilgpt2 (or a same-shape random model offline)
    python scripts/benchmark.py --quick --json out.json # small and fast

Each system runs in its own subprocess (so peak RSS is its own), on the same seeded
requests, all queued at t0, EOS ignored so each request delivers exactly its budget.
Every system gets an untimed warm-up, then ``--repeats`` timed runs; the table shows
medians, and the ratios against static HF are computed within this one run.
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
from dataclasses import asdict, dataclass

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


@dataclass
class Request:
    prompt: str
    max_new_tokens: int


def seed_workload(seed: int = 0, n: int = 32) -> list[Request]:
    rng = random.Random(seed)
    return [Request(rng.choice(PROMPT_TEXTS), rng.choice([8, 16, 32, 48])) for _ in range(n)]


WORKLOADS = {"seed": (seed_workload, 8)}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# --- systems (each runs inside a worker subprocess) ---------------------------------------------
def run_static(model_dir: str, requests: list[Request], capacity: int) -> list[dict]:
    """FCFS batches of `capacity` through HF generate; a request finishes when its batch does."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from model_runner import HFModelRunner

    runner = HFModelRunner(model_dir)
    prompts = [runner.encode(r.prompt) for r in requests]

    class FirstStep(LogitsProcessor):
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
            first = FirstStep()
            width = max(len(p) for p in prompts[start : start + capacity])
            ids = torch.full((len(batch), width), runner.pad_id)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(prompts[start : start + capacity]):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            with torch.inference_mode():
                gen = runner.model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=None,
                    max_new_tokens=max(r.max_new_tokens for r in batch), pad_token_id=runner.pad_id,
                    logits_processor=LogitsProcessorList([first]),
                )
            end = time.perf_counter()
            for row, r in enumerate(batch):
                n = min(r.max_new_tokens, gen.shape[1] - width)
                out.append({"tokens": n, "ttft": first.time - t0, "e2e": end - t0})
        return out

    return once


def run_ours(model_dir: str, requests: list[Request], capacity: int):
    import asyncio

    from config import Config
    from engine import HFEngine
    from scheduler import Scheduler
    from sequence import Sequence

    engine = HFEngine(Config(model_id=model_dir, max_batch_size=capacity))
    prompts = [engine.encode(r.prompt) for r in requests]

    def once() -> list[dict]:
        async def main():
            sched = Scheduler(engine, max_queue_depth=len(requests) + 1)
            sched.start()
            t0 = time.perf_counter()
            seqs = [
                Sequence(prompt_token_ids=p, max_new_tokens=r.max_new_tokens, ignore_eos=True, arrival_time=t0)
                for p, r in zip(prompts, requests)
            ]
            done = await asyncio.gather(*(sched.submit(s) for s in seqs))
            await sched.stop()
            return t0, done

        t0, done = asyncio.run(main())
        return [
            {"tokens": len(s.output_token_ids), "ttft": s.first_token_time - t0, "e2e": s.finish_time - t0}
            for s in done
        ]

    return once


SYSTEMS = {"static_hf": run_static, "ours": run_ours}


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
    }


def worker(args) -> None:
    """Run one system on one workload; print one JSON line."""
    import torch

    from engine import physical_cores

    torch.set_num_threads(args.threads or physical_cores())
    fn, capacity = WORKLOADS[args.workload]
    requests = fn(seed=args.seed)[: args.limit or None]
    once = SYSTEMS[args.system](args.model_dir, requests, capacity)
    once()  # untimed warm-up
    runs = [summarize(once()) for _ in range(args.repeats)]
    best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
    best["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    best["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    best["capacity"] = capacity
    best["requests"] = len(requests)
    print("RESULT " + json.dumps(best))


def resolve_model(name: str) -> tuple[str, str]:
    """(directory or id to load, note). Falls back to a distilgpt2-shaped random checkpoint offline."""
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name)
        return name, f"model {name}"
    except Exception as exc:  # no hub access, missing dir
        if name != "distilgpt2":
            raise SystemExit(f"cannot load model {name!r}: {exc}")
    from make_test_model import build_checkpoint

    path = os.path.join(ROOT, "models", "bench-distilgpt2")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_checkpoint(path, shape="distilgpt2", initializer_range=0.02)
    return path, "distilgpt2 could not be loaded offline: using a distilgpt2-shaped RANDOM-weight checkpoint"


def machine_line(threads: int) -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} logical CPUs, {threads} torch threads, torch {torch.__version__}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="distilgpt2")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="seed")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = physical cores)")
    p.add_argument("--quick", action="store_true", help="8 requests, 1 timed run")
    p.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.repeats, args.limit = 1, 8

    from tqdm import tqdm

    from engine import physical_cores

    threads = args.threads or physical_cores()
    model_dir, note = resolve_model(args.model)
    print(note)
    print("machine:", machine_line(threads))
    results: dict[str, dict] = {}
    systems = [s for s in args.systems.split(",") if s]
    for system in tqdm(systems, desc=f"workload {args.workload}", unit="system"):
        cmd = [
            sys.executable, os.path.abspath(__file__), "--worker", "1", "--system", system,
            "--model-dir", model_dir, "--workload", args.workload, "--repeats", str(args.repeats),
            "--seed", str(args.seed), "--threads", str(threads), "--limit", str(args.limit),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results[system] = {"failed": True, "error": err}
        else:
            results[system] = json.loads(line[len("RESULT "):])
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_dir, "note": note, "machine": machine_line(threads), "workload": args.workload,
                       "repeats": args.repeats, "results": results}, f, indent=2)
    return 1 if any(r.get("failed") for r in results.values()) else 0


def print_table(results: dict[str, dict]) -> None:
    base = results.get("static_hf", {}).get("tokens_per_s")
    head = f"{'system':<12} {'tok/s':>8} {'x static':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} {'TPOT p50':>9} {'RSS MB':>7}"
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        if r.get("failed"):
            print(f"{name:<12} FAILED: {r['error']}")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        print(
            f"{name:<12} {r['tokens_per_s']:>8.1f} {ratio:>8} {r['latency_ms']['p50']:>8.0f} {r['latency_ms']['p95']:>8.0f} "
            f"{r['latency_ms']['p99']:>8.0f} {r['ttft_ms']['p50']:>9.0f} {r['tpot_ms']['p50']:>9.1f} {r['peak_rss_mb']:>7.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())
