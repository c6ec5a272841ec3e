"""Systems: (model_dir, workload) -> (once() -> per-request dicts, config dict).

Each ``once()`` runs every request of the workload, each at its arrival time and after the request it
waits for (``workloads.drive``), and returns per request, in seconds from t0: ``start`` (sent), ``first`` (first
token), ``end`` (finished) and ``token_times`` (every delivered token, where the system shows them), plus
``tokens`` (delivered) and ``tag``. ``once.stop`` / ``once.peak_rss_mb``, when set, stop a server and read
its peak RSS; ``once.run_stats``, when set, holds figures of the last run (ours: prefill tokens computed,
KV blocks in use). ``ours_ray`` is the exception: Ray Serve against our own HTTP server, measured side by
side by ``deploy/bench_ray.py`` (``run_ours_ray``). Here: ours (in-process and as a server), the registry
(``SYSTEM_FNS``, ``parse_system``); the HF baselines are ``hf_systems.py``, llama-server ``llamacpp.py``, the server
processes' handling ``servers.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

from . import ROOT
from .hf_systems import system_hf_cb, system_static_hf
from .llamacpp import system_llamacpp
from .servers import _free_port, _log_path, _process_handles, _wait_healthy
from .workloads import Request, Workload, drive, slot_context


class Unsupported(Exception):
    """This system cannot express this workload (its timing, its settings): reported as skipped, not failed."""


def unsupported(base: str, workload: Workload) -> str | None:
    """Why ``base`` cannot run ``workload``, or None."""
    if workload.only and base not in workload.only:
        return f"n/a: this workload is for {', '.join(workload.only)} only"
    if base == "static_hf" and workload.timed and not _in_turn(workload):
        return "n/a: static batches cannot send requests at arrival times or after other requests"
    if base == RAY_SYSTEM and workload.timed:
        return "n/a: ours_ray sends every request at t0 (deploy/bench_ray.py)"
    if base == "hf_cb" and workload.timed:
        return "n/a: this harness queues every hf_cb request at t0 (no arrival times or dependencies)"
    return None


def _in_turn(workload: Workload) -> bool:
    """One request at a time, each after the previous: what static batches of 1 do anyway."""
    reqs = workload.requests
    return workload.capacity == 1 and all(
        r.arrival == 0 and not r.continues and r.after == (i - 1 if i else None) for i, r in enumerate(reqs)
    )


# ours' options in a system name ("ours:int8", "ours:budget=0:prefix=off") -> environment variables
OURS_OPTIONS = {
    "budget": "MAX_NUM_BATCHED_TOKENS",
    "pcap": "MAX_PREFILL_TOKENS_WHILE_DECODING",
    "prefix": "PREFIX_CACHING",
    "kv": "KV_CACHE_MB",
    "runtime": "RUNTIME",
    "isa": "KERNEL_ISA",
    "kvd": "KV_CACHE_DTYPE",
    "act": "ACTIVATIONS",
    "pack": "PACK_WEIGHTS",
    "spec": "SPECULATIVE_METHOD",
    "k": "NUM_SPECULATIVE_TOKENS",
    "draft": "SPECULATIVE_MODEL",
    "lmin": "PROMPT_LOOKUP_MIN",
    "lmax": "PROMPT_LOOKUP_MAX",
    "device": "DEVICE",
}


def ours_env(workload: Workload, gguf: str, weights: str, options: dict) -> dict[str, str]:
    """The environment ours' Config is read from: the workload's settings, then the system's options. A GGUF's
    peer is llama.cpp, given the workload's longest request as its context per slot: ours gets the same (unless
    the workload sets MAX_MODEL_LEN), so peak RSS compares weights and runtime rather than KV caches of
    different sizes."""
    env = {"MAX_BATCH_SIZE": str(workload.capacity), "NUM_THREADS": "0", "WEIGHTS": weights}
    if gguf:
        env["MAX_MODEL_LEN"] = str(slot_context(workload.requests))
    env.update(workload.ours_env)
    if "draft" in options:  # a draft model: draft_model drafts unless the system says otherwise
        env["SPECULATIVE_METHOD"] = "draft_model"
        env["SPECULATIVE_MODEL"] = draft_model_path(options["draft"], gguf)
    for key, value in options.items():
        if key == "draft":
            continue
        # SPECULATIVE_METHOD=off is a method, PACK_WEIGHTS=off a choice: the others' on / off are booleans
        flag = {"on": "true", "off": "false"} if key not in ("spec", "pack") else {}
        env[OURS_OPTIONS[key]] = flag.get(value, value)
    return env


def draft_model_path(draft: str, gguf: str) -> str:
    """``ours:draft=N`` (an integer): the served GGUF truncated to its first N blocks (``scripts/truncate_gguf.py``,
    written once into the cache: a draft of the same tokenizer); anything else is a MODEL_ID (a .gguf path...)."""
    if not draft.isdigit():
        return draft
    if not gguf:
        raise SystemExit(f"ours:draft={draft} truncates the served GGUF: it needs a GGUF model (--model X.gguf)")
    from models.cache_dir import cache_subdir
    from scripts.truncate_gguf import truncate

    out = os.path.join(cache_subdir("drafts"), f"{os.path.basename(gguf).removesuffix('.gguf')}-{draft}-layers.gguf")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        truncate(gguf, out + ".tmp", int(draft))
        os.replace(out + ".tmp", out)
    return out


def system_ours(model_dir: str, workload: Workload, weights: str = "auto", gguf: str = "", fork: str = "on", **options):
    """Our server's engine behind the scheduler; ``weights`` is its WEIGHTS setting, ``gguf`` the file a .gguf
    model is served from (at its own precision under "auto"); ``fork`` "off" sends a request's ``n`` choices as
    separate sequences instead of one group (``sequence.group_choices``); ``options`` (budget, pcap, prefix, kv)
    set MAX_NUM_BATCHED_TOKENS, MAX_PREFILL_TOKENS_WHILE_DECODING, PREFIX_CACHING and KV_CACHE_MB. The settings go
    through the environment into ``Config.from_env``, as for the server, so a knob this checkout does not know yet
    is simply not applied (the config reported says which were)."""
    import dataclasses

    from config import Config
    from core.sampling import SamplingParams
    from core.sequence import Sequence, group_choices
    from models.runtime import build_engine
    from scheduler import Scheduler, engine_thread

    env = ours_env(workload, gguf, weights, options)
    os.environ.update(env)  # before Config is built: knobs added to config.py later are read from here too
    config = Config.from_env({**os.environ, "MODEL_ID": gguf or model_dir})
    thread = engine_thread()  # builds the engine and makes every call into it, as the server does
    engine = thread.submit(build_engine, config).result()  # RUNTIME picks NativeEngine or HFEngine, as the server's
    kv_bytes_per_token = engine.kv_pool_bytes / (engine.blocks.num_blocks * engine.blocks.block_size)
    stats: dict = {}

    def once() -> list[dict]:
        engine.reset_prefix_cache()  # every run starts cold: the warm-up must not serve the timed runs' prompts
        before = engine.planner.prefill_tokens_computed
        spec_before = spec_counters(engine)
        peak_used = 0

        async def main():
            sched = Scheduler(engine, max_queue_depth=sum(r.n for r in workload.requests) + 1, executor=thread)
            sched.start()

            async def send(r: Request, prompt: list[int]):
                """The request's ``n`` choices (sampled, choice j seeded j, when ``n`` > 1): all their tokens and
                the times they arrived."""
                seqs = [Sequence(prompt, r.max_new_tokens, ignore_eos=r.ignore_eos) for _ in range(r.n)]
                if r.n > 1:
                    for j, seq in enumerate(seqs):
                        seq.sampling = SamplingParams(temperature=1.0, seed=j)
                    if fork == "on":
                        group_choices(seqs)
                outs = await asyncio.gather(*(one(seq) for seq in seqs))
                return [t for ids, _ in outs for t in ids], sorted(t for _, times in outs for t in times)

            async def one(seq: Sequence):
                nonlocal peak_used
                times: list[float] = []

                def listener(s: Sequence) -> None:  # on the event loop, after each step that gave s tokens
                    nonlocal peak_used
                    times.extend([time.perf_counter()] * (len(s.output_token_ids) - len(times)))
                    peak_used = max(peak_used, engine.blocks.num_used_blocks)

                await sched.submit(seq, listener)
                times.extend([seq.finish_time] * (len(seq.output_token_ids) - len(times)))
                return seq.output_token_ids, times

            try:
                return await drive(workload.requests, send)
            finally:
                await sched.stop()

        out = asyncio.run(main())
        stats["kv_peak_used_mib"] = peak_used * engine.blocks.block_size * kv_bytes_per_token / 2**20
        stats["num_preemptions"] = engine.planner.num_preemptions
        after = engine.planner.prefill_tokens_computed
        stats["prefill_tokens_computed"] = after - before
        if spec_before is not None:  # this run's speculative decoding: drafts proposed, accepted, per position
            now = spec_counters(engine)
            stats["spec"] = {
                k: [a - b for a, b in zip(v, spec_before[k])] if isinstance(v, list) else v - spec_before[k]
                for k, v in now.items()
            }
            stats["spec"]["run_seconds"] = max(t["end"] for t in out) if out else 0.0
        return out

    once.engine = engine
    once.thread = thread
    once.run_stats = stats
    resident = engine.model.resident_weights()
    known = {f.name.upper() for f in dataclasses.fields(Config)}
    return once, {
        "engine": f"{type(engine).__name__} (hand-written forward, KV block pool, packed / quantized linears)",
        "capacity": workload.capacity,
        "weights": weights,
        "env": env,
        "env_not_in_config": sorted(k for k in env if k not in known),
        "max_model_len": engine.max_context,
        "max_num_batched_tokens": engine.planner.max_num_batched_tokens,
        "kv_pool_mib": round(engine.kv_pool_bytes / 2**20, 1),
        "kv_cache_dtype": getattr(engine, "kv_cache_dtype", "fp32"),
        "kv_pool_tokens": engine.blocks.num_blocks * engine.blocks.block_size,
        "kv_blocks": engine.blocks.num_blocks,
        "kv_block_size": engine.blocks.block_size,
        # the pre-pool design: every slot reserved MAX_MODEL_LEN tokens up front
        "per_slot_reservation_mib": round(workload.capacity * engine.max_context * kv_bytes_per_token / 2**20, 1),
        "resident_weight_mb": {fmt: round(n / 2**20, 1) for fmt, n in resident.items()},
    }


def spec_counters(engine) -> dict | None:
    """Speculative decoding's counters so far (the planner's, and a draft model's forwards and seconds), or None
    for a checkout without them."""
    if not hasattr(engine.planner, "spec"):
        return None
    counters = dict(engine.planner.spec.as_dict())
    drafter = getattr(engine, "drafter", None)
    if drafter is not None:
        counters.update({k: v for k, v in drafter.stats().items() if "kv" not in k})
    return counters


def system_ours_server(model_dir: str, workload: Workload, weights: str = "auto", gguf: str = "", **options):
    """``python server.py`` in its own process, as an operator runs it, configured like ``ours`` (``ours_env``, plus
    without ``fork``), fed over HTTP like llama-server: every request's token ids to ``/generate``, streamed
    (each event carries its tokens' ids: token times, and the output a continued turn resends), greedy, EOS
    ignored. A request's ``n`` choices go as n requests (seeded 0..n-1). Its peak RSS is the server process's own,
    so it compares with llama-server's like for like (``ours`` runs in the benchmark's worker, beside its harness).
    """
    import sys

    import httpx

    requests, capacity = workload.requests, workload.capacity
    env = ours_env(workload, gguf, weights, options)
    limit = max(r.max_new_tokens for r in requests)
    env.update({"MODEL_ID": gguf or model_dir, "LOG_LEVEL": "WARNING", "MAX_NEW_TOKENS_LIMIT": str(limit)})
    env["MAX_QUEUE_DEPTH"] = str(sum(r.n for r in requests) + 1)
    # One client (this harness) queues the whole workload at once: no share of the queue, no time limits.
    env.update({"MAX_CLIENT_QUEUE_SHARE": "1", "MAX_QUEUE_TIME_S": "0", "REQUEST_TIMEOUT_S": "0"})
    port = _free_port()
    env.update({"HOST": "127.0.0.1", "PORT": str(port)})
    log_path = _log_path(f"ours-server-{port}.log")
    log_file = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "server.py")], env={**os.environ, **env}, stdout=log_file, stderr=log_file
    )
    _wait_healthy(proc, f"http://127.0.0.1:{port}/ready", 600, log_path, "the server")  # a first start builds an image

    async def stream(client, prompt: list[int], r: Request, seed: int | None):
        body = {"prompt": prompt, "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos, "stream": True}
        if seed is not None:
            body.update({"temperature": 1.0, "seed": seed})
        ids: list[int] = []
        times: list[float] = []
        async with client.stream("POST", f"http://127.0.0.1:{port}/generate", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                new = json.loads(line[6:]).get("token_ids") or []
                ids += new
                times += [time.perf_counter()] * len(new)
        return ids, times

    async def send(client, r: Request, prompt: list[int]):
        if r.n == 1:
            return await stream(client, prompt, r, None)
        outs = await asyncio.gather(*(stream(client, prompt, r, j) for j in range(r.n)))
        return [t for ids, _ in outs for t in ids], sorted(t for _, times in outs for t in times)

    def once() -> list[dict]:
        async def main():
            limits = httpx.Limits(max_connections=sum(r.n for r in requests) + 1, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                return await drive(requests, lambda r, prompt: send(client, r, prompt))

        return asyncio.run(main())

    once.peak_rss_mb, once.stop = _process_handles(proc, log_file, 30)
    return once, {"engine": "python server.py (its own process, over HTTP)", "capacity": capacity, "env": env}


SYSTEM_FNS = {
    "static_hf": system_static_hf,
    "hf_cb": system_hf_cb,
    "ours": system_ours,
    "ours_server": system_ours_server,
    "llamacpp": system_llamacpp,
}
RAY_SYSTEM = "ours_ray"  # not a SYSTEM_FNS entry: three HTTP servers measured side by side (run_ours_ray)


def parse_system(name: str) -> tuple[str, dict]:
    """ "ours:int8" -> ("ours", {"weights": "int8"}); "ours:budget=0:prefix=off" -> ("ours", {"budget": "0",
    "prefix": "off"}); "llamacpp:cache=on" -> ("llamacpp", {"cache": "on"}); plain names -> (name, {})."""
    base, *parts = name.split(":")
    allowed = {
        "ours": {"weights", "fork", *OURS_OPTIONS},
        "ours_server": {"weights", *OURS_OPTIONS},
        "llamacpp": {"cache", "kvd", "spec", "n", "m", "isa"},
        "static_hf": {"device", "dtype"},
        "hf_cb": {"device", "dtype"},
    }.get(base, set())
    kwargs = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key, value = (key, value) if eq else ("weights", key)
        kwargs[key] = value
    if (base not in SYSTEM_FNS and base != RAY_SYSTEM) or not set(kwargs) <= allowed or "" in kwargs.values():
        known = ", ".join([*SYSTEM_FNS, RAY_SYSTEM])
        raise SystemExit(
            f"unknown system {name!r} (choose from {known}; ours:auto|fp32|int8|int4, "
            f"ours:budget=N (MAX_NUM_BATCHED_TOKENS), ours:prefix=on|off, ours:kv=MiB, ours:fork=off, "
            "ours:runtime=torch|native (RUNTIME), ours:device=cuda (DEVICE), ours:spec=off|ngram|draft_model "
            "(SPECULATIVE_METHOD), ours:k=N (NUM_SPECULATIVE_TOKENS), ours:lmin=N / ours:lmax=N (PROMPT_LOOKUP_MIN / "
            "PROMPT_LOOKUP_MAX), ours:draft=N|PATH (SPECULATIVE_MODEL: the "
            "served GGUF's first N blocks, or a MODEL_ID), ours_server: as ours but fork; "
            "llamacpp:cache=on, llamacpp:spec=ngram-simple|ngram-map-k|ngram-mod...[:n=N][:m=M], llamacpp:isa=avx2 "
            "(scripts/build_llamacpp.py --isa avx2); "
            "ours:runtime=torch|native (RUNTIME), ours:kvd=fp32|fp16|bf16|int8 (KV_CACHE_DTYPE), ours:device=cuda "
            "(DEVICE), ours_server: as ours but fork; llamacpp:cache=on, llamacpp:kvd=f16|q8_0 (-ctk / -ctv); "
            "static_hf and hf_cb: device=cuda, dtype=fp32|bf16|fp16)"
        )
    return base, kwargs


def ray_missing() -> str | None:
    """Why ``ours_ray`` cannot run here, or None when Ray Serve is installed."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'ray[serve]==2.60.0', see requirements.txt): ours_ray skipped"
    return None


def run_ours_ray(model_id: str, tok, workload: Workload, repeats: int, cpus: int) -> dict:
    """``python server.py`` (``ours``) against Ray Serve with 1 and 2 replicas (``ours_ray1``, ``ours_ray2``),
    all over HTTP on 127.0.0.1, by ``deploy/bench_ray.py``: ``repeats`` interleaved rounds of the workload
    (its prompts as text to /generate, same budgets, EOS ignored), then the proxy's added idle TTFT.

    -> {"systems": {name: tokens/s, TTFT, x ours, idle TTFT}, "config": ...}; no per-request latencies.
    """
    from deploy import bench_ray

    requests, capacity = workload.requests, workload.capacity
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
