"""Time to ``/ready`` and the server's memory at load, for one MODEL_ID: a first start (empty image cache) and the
starts after it (docs/performance.md "Starting a big file").

    python -m scripts.bench.startup --model llama-1b:Q4_K_M --starts 3

Each start is ``python server.py`` (``RUNTIME`` as the environment says) with ``MINIBATCH_CACHE`` the benchmark's
own cache directory (``<cache>/startup-bench``), whose converted metadata and model images are removed before the
first start: nothing converted or built for the model is cached then, only the compiled kernels (built once per
machine and cache directory, before the first start and outside its time). It prints, per start, the seconds from
launch to a 200 on /ready, and the server process's peak RSS (VmHWM) and RSS (VmRSS) when it became ready, in MiB:
their ratio says whether the load made transient copies. The image build's child process is not the server: its
time counts, its memory does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

from . import ROOT


def _memory(pid: int) -> dict[str, float]:
    """VmHWM and VmRSS of ``pid`` in MiB (from /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) / 1024
    return out


def start_once(model_id: str, cache: str, tree: str = ROOT, timeout: float = 900.0) -> dict:
    """One ``python server.py`` of the checkout ``tree`` on ``model_id`` with ``MINIBATCH_CACHE=cache``: {seconds,
    VmHWM, VmRSS} at the first 200 on /ready. The server is stopped afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MODEL_ID=model_id, PORT=str(port), HOST="127.0.0.1", LOG_LEVEL="warning")
    env["MINIBATCH_CACHE"] = cache
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "server.py"], cwd=tree, env=env)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                raise SystemExit(f"the server on {model_id} did not become ready")
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, **_memory(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a MODEL_ID, or a scale model (llama-1b:Q4_K_M)")
    parser.add_argument("--starts", type=int, default=3, help="starts: the first builds the image, the rest reuse it")
    parser.add_argument("--tree", default=ROOT, help="the checkout whose server starts (another commit: before/after)")
    args = parser.parse_args(argv)
    from .scale_model import ensure_gguf, parse

    model_id = ensure_gguf(args.model) if parse(args.model) else args.model
    print(f"{model_id}; load average {os.getloadavg()[0]:.2f}", flush=True)
    from models.cache_dir import cache_subdir
    from models.kernels import build_all_into

    cache = cache_subdir("startup-bench")
    for name in ("images", "checkpoints"):  # what a model's first start builds
        shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
    build_all_into(cache, args.tree)
    for i in range(args.starts):
        r = start_once(model_id, cache, args.tree)
        print(
            f"start {i + 1} ({'first' if i == 0 else 'cached'}): {r['seconds']:.2f} s to /ready; RSS at ready "
            f"{r['VmRSS']:.0f} MiB, peak {r['VmHWM']:.0f} MiB ({r['VmHWM'] / r['VmRSS']:.2f}x)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
