#!/usr/bin/env python
"""End-to-end smoke test against a real uvicorn server on 127.0.0.1.

    python scripts/smoke.py --model weights/tiny    # start a server on a local checkpoint, test it, stop it
    python scripts/smoke.py --url http://127.0.0.1:8000   # test a server that is already running

Fires concurrent, distinct requests and checks that every answer is well formed, belongs to
its own request (the same prompt gives the same greedy tokens alone, in another order, and
under load) and that the server really batched them (its peak batch grew past 1).
Exits non-zero on any failure. Sends traffic to 127.0.0.1 only; stops only the server it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOPICS = ["the sea", "a fox", "batching", "Paris", "a robot", "the moon", "bread", "rain", "chess", "a violin"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, capacity: int) -> subprocess.Popen:
    env = dict(os.environ, MODEL_ID=model, HOST="127.0.0.1", PORT=str(port), MAX_BATCH_SIZE=str(capacity))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py")], cwd=ROOT, env=env)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"FAIL: server exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"FAIL: {url}/health not 200 within {timeout:.0f}s")


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: tell me about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}." for i in range(n)]


async def fire(client: httpx.AsyncClient, url: str, prompts: list[str], max_new: int, tag: str) -> dict[str, dict]:
    async def one(i: int, prompt: str) -> tuple[str, dict]:
        rid = f"{tag}-{i}"
        r = await client.post(f"{url}/generate", json={"request_id": rid, "prompt": prompt, "max_new_tokens": max_new})
        if r.status_code != 200:
            raise AssertionError(f"{rid}: HTTP {r.status_code}: {r.text}")
        return rid, r.json()

    pairs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return dict(pairs)


def check_answer(rid: str, body: dict, max_new: int) -> list[str]:
    errors = []
    if body.get("request_id") != rid:
        errors.append(f"{rid}: answer carries request_id {body.get('request_id')!r}")
    ids, usage, m = body.get("token_ids", []), body.get("usage", {}), body.get("metrics", {})
    if not 1 <= len(ids) <= max_new:
        errors.append(f"{rid}: {len(ids)} tokens for a budget of {max_new}")
    if usage.get("completion_tokens") != len(ids) or usage.get("prompt_tokens", 0) < 1:
        errors.append(f"{rid}: usage {usage} does not match {len(ids)} tokens")
    if body.get("finish_reason") not in ("stop", "length"):
        errors.append(f"{rid}: finish_reason {body.get('finish_reason')!r}")
    if body.get("finish_reason") == "length" and len(ids) != max_new:
        errors.append(f"{rid}: finish_reason length with {len(ids)} of {max_new} tokens")
    if not (0 <= m.get("queue_wait_ms", -1) <= m.get("ttft_ms", -1) <= m.get("e2e_ms", -1)):
        errors.append(f"{rid}: metrics out of order {m}")
    return errors


async def smoke(url: str, n: int, max_new: int) -> list[str]:
    prompts = make_prompts(n, seed=0)
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=300) as client:
        before = (await client.get(f"{url}/health")).json().get("engine", {})
        t0 = time.perf_counter()
        first = await fire(client, url, prompts, max_new, "a")
        wall = time.perf_counter() - t0
        after = (await client.get(f"{url}/health")).json().get("engine", {})
        for rid, body in first.items():
            errors += check_answer(rid, body, max_new)
        # Same prompts in reverse order: each prompt's greedy tokens must not depend on its batchmates.
        order = list(reversed(range(n)))
        second = await fire(client, url, [prompts[i] for i in order], max_new, "b")
        for j, i in enumerate(order):
            if second[f"b-{j}"]["token_ids"] != first[f"a-{i}"]["token_ids"]:
                errors.append(f"prompt {i}: different tokens in another batch order")
        # A few alone, one at a time.
        for i in range(min(3, n)):
            alone = await fire(client, url, [prompts[i]], max_new, f"solo{i}")
            if alone[f"solo{i}-0"]["token_ids"] != first[f"a-{i}"]["token_ids"]:
                errors.append(f"prompt {i}: different tokens alone than under load")
    peak = after.get("peak_batch", 0)
    steps = after.get("steps", 0) - before.get("steps", 0)
    tokens = sum(len(b["token_ids"]) for b in first.values())
    print(
        f"{n} concurrent requests: {tokens} tokens in {wall:.2f}s ({tokens / wall:.1f} tok/s), "
        f"{steps} decode steps, peak batch {peak}"
    )
    if n > 1 and peak < 2:
        errors.append(f"requests were not batched: peak batch {peak}")
    if n > 1 and steps >= tokens:
        errors.append(f"requests were not batched: {steps} steps for {tokens} tokens")
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="test this running server instead of starting one")
    p.add_argument(
        "--model", default=os.environ.get("MODEL_ID", "distilgpt2"), help="MODEL_ID for the server it starts"
    )
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--capacity", type=int, default=8)
    p.add_argument("--startup-timeout", type=float, default=300)
    args = p.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(args.model, port, args.capacity)
    try:
        wait_healthy(url, proc, args.startup_timeout)
        errors = asyncio.run(smoke(url, args.requests, args.max_new_tokens))
    except AssertionError as exc:
        errors = [str(exc)]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for e in errors:
        print("FAIL:", e)
    print("smoke: OK" if not errors else f"smoke: {len(errors)} failure(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
