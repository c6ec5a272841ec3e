"""llama.cpp's llama-server as a benchmark system: (model_dir, workload) -> (once() -> per-request dicts, config
dict), on the same GGUF, threads and requests as ours."""

from __future__ import annotations

import asyncio
import json
import time

from .servers import _free_port, _log_path, _process_handles, start_llama_server
from .workloads import Request, Workload, drive, slot_context


def system_llamacpp(
    model_dir: str,
    workload: Workload,
    gguf: str = "",
    cache: str = "off",
    repack: str = "auto",
    kvd: str = "",
    spec: str = "",
    n: str = "",
    m: str = "",
    isa: str = "native",
):
    """llama.cpp's llama-server (scripts/build_llamacpp.py) on the same GGUF: -np CAPACITY slots, the
    same threads, every request's token ids to its /completion with ignore_eos, streamed with the token
    ids of each chunk (``return_tokens``: token times, and the output a continued turn resends).
    ``cache=on`` lets it reuse a slot's cached prompt prefix (``cache_prompt``; off by default). ``repack``: its
    weight repacking (``on``, ``off`` = ``--no-repack``, ``auto``: on, and off again where the server dies
    while starting with it: seen on an AVX-512 Xeon VM, a segfault in its repacked Q8_0 GEMM at warm-up). ``spec``: its
    ``--spec-type`` (``ngram-simple``, ``ngram-map-k``, ``ngram-mod`` ...), ``n`` / ``m`` that type's lookup and
    draft lengths (``--spec-ngram-<type>-size-n`` / ``-size-m``; ``ngram-mod``: ``--spec-ngram-mod-n-match`` /
    ``-n-max``); its drafts and accepted drafts per run come from each answer's ``timings``.
    ``kvd``: its KV cache type for K and V (``-ctk`` / ``-ctv``: f16 by default, q8_0 ...; its flash attention,
    on by default here, reads a quantized V). ``isa``: which build runs (``scripts/build_llamacpp.py --isa``):
    ``native`` (-march=native), or ``avx2``, ggml's portable AVX2 build, the peer of ``ours:isa=avx2`` on an
    AVX-512 machine (what an AVX2-only CPU runs, on the same silicon)."""
    import httpx
    import torch

    from scripts.build_llamacpp import binary_path

    binary = binary_path(isa=isa)
    if binary is None:
        raise RuntimeError(
            f"llama-server ({isa}) is not built: run python scripts/build_llamacpp.py --isa {isa} (10-30 min, once)"
        )
    if not gguf:
        raise RuntimeError("llamacpp needs --model to be a .gguf file")
    requests, capacity = workload.requests, workload.capacity
    context = workload.slot_context or slot_context(requests)
    port = _free_port()
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
    if spec:
        cmd += ["--spec-type", spec]
        kind = spec.removeprefix("ngram-")
        names = ("n-match", "n-max") if kind == "mod" else ("size-n", "size-m")
        for name, value in zip(names, (n, m)):
            if value:
                cmd += [f"--spec-ngram-{kind}-{name}", value]
    if kvd:
        cmd += ["-ctk", kvd, "-ctv", kvd]
    log_path = _log_path(f"llamacpp-{port}.log")
    drafts = {"spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0}
    proc, log_file, repacked = start_llama_server(cmd, f"http://127.0.0.1:{port}/health", log_path, repack)

    async def send(client, r: Request, prompt: list[int]):
        body = {
            "prompt": prompt,
            "n_predict": r.max_new_tokens,
            "temperature": 0,
            "ignore_eos": r.ignore_eos,
            "stream": True,
            "cache_prompt": cache == "on",
            "return_tokens": True,
        }
        ids: list[int] = []
        times: list[float] = []
        async with client.stream("POST", f"http://127.0.0.1:{port}/completion", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                new = chunk.get("tokens") or []
                ids += new
                times += [time.perf_counter()] * len(new)
                timings = chunk.get("timings") or {}
                if chunk.get("stop") and "draft_n" in timings:
                    drafts["spec_num_draft_tokens"] += timings["draft_n"]
                    drafts["spec_num_accepted_tokens"] += timings.get("draft_n_accepted", 0)
        return ids, times

    def once() -> list[dict]:
        drafts.update(dict.fromkeys(drafts, 0))

        async def main():
            # No keep-alive: a request sent in turn after an idle gap must not meet a connection the server closed.
            limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                return await drive(requests, lambda r, prompt: send(client, r, prompt))

        return asyncio.run(main())

    once.peak_rss_mb, once.stop = _process_handles(proc, log_file, 10)
    if spec:
        once.run_stats = {"spec": drafts}
    return once, {
        "engine": f"llama-server ({binary}), -np {capacity}, -c {capacity * context}"
        + ("" if repacked else ", --no-repack")
        + (f", {' '.join(cmd[cmd.index('--spec-type') :])}" if spec else ""),
        "capacity": capacity,
        "kv_cache_type": kvd or "f16 (default)",
        "cache_prompt": cache == "on",
        "repack": repacked,
    }
