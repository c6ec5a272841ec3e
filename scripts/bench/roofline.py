"""Inside the ``ours`` worker: the engine's decode step against the bare forward, and the bare forward
against this machine's roofline (measured fp32 matmul peak and copy bandwidth); the cost of a step is
the model's own (``MixedForward.flops_per_token`` / ``weight_bytes``), so per WEIGHTS setting: a step
streams each linear's one copy in its own format (fp32 4 bytes per weight, int8 1.06, int4 0.625)."""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time


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


def decode_cost(model, batch: int, context: int) -> tuple[int, int]:
    """(FLOPs, weight bytes) of one decode step of ``batch`` rows at ``context``, as the model counts them:
    every row costs ``flops_per_token``; the step streams every linear's weight once."""
    return batch * model.flops_per_token(context), sum(model.weight_bytes().values())


async def _scheduled_steps(engine, thread, batch: int, prompt: list[int], steps: int) -> list[float]:
    """Seconds between decode steps as the scheduler delivers them (its engine calls on ``thread``):
    ``batch`` copies of ``prompt``, ``steps`` + 1 tokens each."""
    from core.sequence import Sequence
    from scheduler import Scheduler

    stamps: list[float] = []
    sched = Scheduler(engine, max_queue_depth=batch + 1, executor=thread)
    sched.on_tokens = lambda seqs: stamps.append(time.perf_counter())
    sched.start()
    seqs = [Sequence(prompt_token_ids=prompt, max_new_tokens=steps + 1, ignore_eos=True) for _ in range(batch)]
    await asyncio.gather(*(sched.submit(s) for s in seqs))
    await sched.stop()
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # step-to-step, after the admit callback


def _bare_steps(model, block_size: int, batch: int, prompt: list[int], steps: int) -> list[float]:
    """Same rows, same positions, nothing but the model's forward (over blocks of its own: the engine is idle)."""
    per_row = -(-(len(prompt) + steps + 1) // block_size)
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(batch)]
    model.forward_rows([], [], [], [prompt] * batch, tables)
    n = len(prompt)
    return [_timed(functools.partial(model.forward_rows, [11] * batch, [n + s] * batch, tables)) for s in range(steps)]


def overhead_and_roofline(
    engine, thread, batch_sizes: list[int], prompt_len: int, steps: int, peaks: dict, rounds: int = 6
) -> list[dict]:
    """Per batch size: our decode step inside the scheduler loop vs the bare forward alone, both on
    ``thread``, the engine thread that built ``engine`` (``scheduler.engine_thread``: OpenMP's workers
    spin only while one thread's pool runs the model)."""
    model = engine.model
    rows = []
    for batch in batch_sizes:
        if batch > engine.capacity:
            continue
        prompt = [(i * 7919) % 200 + 10 for i in range(prompt_len)]

        # Pair the two, round by round, so that a noisy minute hits both alike; the overhead is the
        # median of the per-round ratios.
        engine_steps, bare, ratios = [], [], []
        for _ in range(rounds):
            engine_round = asyncio.run(_scheduled_steps(engine, thread, batch, prompt, steps))
            bare_round_ms = thread.submit(_bare_steps, model, engine.blocks.block_size, batch, prompt, steps).result()
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
                "weight_mb_per_step": weight_bytes / 1e6,  # the bound's bytes, per format below
                "weight_mb_by_format": {fmt: n / 1e6 for fmt, n in sorted(model.weight_bytes().items())},
                "bound": "memory" if memory_s >= compute_s else "compute",
                "roofline_step_ms": max(compute_s, memory_s) * 1e3,
                "roofline_fraction": max(compute_s, memory_s) / (bare_ms / 1e3),
                "bare_tokens_per_s": batch / (bare_ms / 1e3),
            }
        )
    return rows


def linear_kernel_rates(model, rows: tuple[int, ...], repeats: int = 3) -> list[dict]:
    """Per row count M: GB/s of weights streamed through every linear of the model in turn, by the kernel the
    linears run on their one copy: small_gemm.c over fp32 panels (``small_gemm_gb_s``: the small-batch kernel up
    to its MAX_ROWS, panel_gemm above), else oneDNN over its reordered copy (``onednn_gb_s``), or quant_gemm.
    Call it on the engine thread that built the model (``scheduler.engine_thread``), as the engine runs."""
    import torch

    linears = model.linears()
    if linears and linears[0].quant is not None:  # quantized: the one kernel every call takes
        return quant_kernel_rates(linears, rows, repeats)
    if not linears or (linears[0].small is None and not linears[0].onednn):
        return []
    key = "small_gemm_gb_s" if linears[0].small is not None else "onednn_gb_s"
    weight_bytes = sum(lin.streamed_bytes for lin in linears)

    def rate(m: int) -> float:
        xs = {lin.in_features: torch.randn(m, lin.in_features) for lin in linears}
        runs = []
        for _ in range(repeats + 1):  # the first pass warms up
            runs.append(_timed(lambda: [lin(xs[lin.in_features]) for lin in linears]))
        return weight_bytes / min(runs[1:]) / 1e9

    return [{"rows": m, key: rate(m)} for m in rows]


def quant_kernel_rates(linears: list, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """Per row count M: GB/s of packed int8/int4 weights streamed by quant_gemm through every linear (on the
    engine thread, as ``linear_kernel_rates``)."""
    import torch

    from models.kernels import quant_gemm

    weight_bytes = sum(lin.streamed_bytes for lin in linears)

    out = []
    for m in rows:
        xs = {lin.in_features: torch.randn(m, lin.in_features) for lin in linears}
        one_pass = functools.partial(_quant_pass, quant_gemm, xs, linears)
        runs = [_timed(one_pass) for _ in range(repeats + 1)]  # the first pass warms up
        out.append({"rows": m, "quant_gemm_gb_s": weight_bytes / min(runs[1:]) / 1e9, "fmt": linears[0].fmt})
    return out


def _quant_pass(quant_gemm, xs: dict, linears: list) -> None:
    """Every linear once on its input width's activation (xs: in_features -> [M, in])."""
    for lin in linears:
        quant_gemm.matmul(xs[lin.in_features], lin.quant)


# --- per-type decode matvec rates (``python -m scripts.bench.roofline``) ---------------------------------------

MATVEC_SHAPES = ((8192, 2048), (2048, 8192))  # [out, in]: a 1B model's up/gate and down projections
MATVEC_PATHS = ("fp32", "int8_panel", "int8_rows")  # quant_gemm.c; int_dot.c's panel path; its row path (int_rows.c)
READ_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_read.c")


def cold_bytes(l3_size: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int:
    """Bytes of weight copies per matrix, taken in turn, so that each call streams its weight from memory as a decode
    step does: twice the last-level cache (a Xeon VM here reports a 480 MiB L3, another machine 32 MiB), at least
    256 MiB."""
    try:
        with open(l3_size) as f:
            text = f.read().strip().upper()
        l3 = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    except (OSError, ValueError):
        l3 = 0
    return max(256 * 2**20, 2 * l3)


def stream_reader():
    """stream_read.c loaded: ``read(ptr, nbytes, threads) -> sum of the bytes``, the roofline's reference reader."""
    import ctypes

    from models.kernels import build

    lib = build.build_and_load(READ_SOURCE, ["-O3", "-mavx2", "-fopenmp", "-shared", "-fPIC"])
    lib.stream_read.restype = ctypes.c_uint64
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib.stream_read


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """GB/s this machine reads with ``threads`` threads (stream_read.c over ``mib`` MiB, far past the caches), best
    of ``repeats``: one moment's figure; matvec_rates pairs each kernel with a read of its own copies."""
    import numpy as np

    read = stream_reader()
    data = np.ones(mib * 2**20, np.uint8)
    read(data.ctypes.data, data.nbytes, threads)
    best = min(_timed(functools.partial(read, data.ctypes.data, data.nbytes, threads)) for _ in range(repeats))
    return data.nbytes / best / 1e9


def baseline_kernel(tree: str):
    """int_dot.c of another checkout (``tree``: its root, e.g. ``git worktree add /tmp/base <commit>``), built into
    the kernel cache and declared as this one (its ISA: the one this checkout's kernel runs; its row path: on)."""
    import ctypes

    from models.kernels import build, int_dot

    lib = int_dot.declare(build.build_and_load(os.path.join(tree, "models", "kernels", "int_dot.c"), int_dot.FLAGS))
    lib.int_dot_isa.restype, lib.int_dot_isa.argtypes = ctypes.c_int, [ctypes.c_int]
    lib.int_dot_isa(int_dot.ISAS.index(int_dot.isa()))
    return lib


def matvec_rates(
    types: tuple[str, ...],
    rows: tuple[int, ...],
    threads: int,
    shapes=MATVEC_SHAPES,
    rounds: int = 7,
    baseline: str | None = None,
) -> list[dict]:
    """GB/s of weight streamed by one decode matvec (x [rows, in] @ W^T, W random valid GGUF blocks of each type),
    per shape, row count and path (``MATVEC_PATHS``: quant_gemm's fp32 activations, int_dot's 8-row panels, its
    row path; with ``baseline``, a checkout's root, also that checkout's row path: ``int8_rows_base``; a type the
    integer path does not take, F16, BF16 or F32, has the fp32 path only; a type ``int_dot.PACKABLE``, also its
    packed weights, ``int8_packed``, and ``read_packed``, a read of those copies), on
    ``threads`` threads, each call on a weight no cache holds (``cold_bytes`` of copies). Beside them ``read``:
    stream_read.c reading the same copies, the reference a type's share of the bandwidth is taken against. The paths
    alternate round by round (a noisy minute hits each alike); the best call counts."""
    import numpy as np
    import torch

    from models.gguf.blocks import TYPES, random_blocks
    from models.kernels import int_dot, quant_gemm

    lib = int_dot.load()
    if lib is None or quant_gemm.load() is None:
        raise RuntimeError("the quantized kernels are unavailable here")
    saved = torch.get_num_threads(), lib.int_dot_row_path(-1)
    torch.set_num_threads(threads)
    calls = {
        "fp32": lambda x, w: quant_gemm.matmul(x, w),
        "int8_panel": lambda x, w: (lib.int_dot_row_path(0), int_dot.gemm(x, w, threads=threads)),
        "int8_rows": lambda x, w: (lib.int_dot_row_path(saved[1]), int_dot.gemm(x, w, threads=threads)),
    }
    read = stream_reader()
    calls["read"] = lambda x, w: read(w.data.data_ptr(), w.data.numel(), threads)
    packs: dict[int, np.ndarray] = {}  # id(w) -> its packed copy (a type in int_dot.PACKABLE)
    calls["int8_packed"] = lambda x, w: int_dot.gemm_packed(x, packs[id(w)], w.fmt, w.out_features, threads=threads)
    calls["read_packed"] = lambda x, w: read(packs[id(w)].ctypes.data, packs[id(w)].nbytes, threads)
    paths = MATVEC_PATHS
    if baseline:
        base = baseline_kernel(baseline)
        calls["int8_rows_base"] = lambda x, w: int_dot.gemm(x, w, threads=threads, lib=base)
        paths = (*MATVEC_PATHS, "int8_rows_base")
    out, cold = [], cold_bytes()
    try:
        for fmt in types:
            here = (*(paths if fmt in int_dot.FORMATS else ("fp32",)), "read")
            if fmt in int_dot.PACKABLE:
                here = (*here, "int8_packed", "read_packed")
            for n, k in shapes:
                t = TYPES[fmt]
                raw = random_blocks(fmt, n * k // t.block, np.random.default_rng(0), 0.01).reshape(n, -1)
                ws = []  # each packed copy made right after its source: the two sets share the memory
                packs.clear()
                for _ in range(-(-cold // raw.nbytes)):
                    ws.append(quant_gemm.from_blocks(fmt, raw.copy(), k))
                    if fmt in int_dot.PACKABLE:
                        packs[id(ws[-1])] = int_dot.pack(ws[-1])
                for m in rows:
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    best = dict.fromkeys(here, float("inf"))
                    for _ in range(rounds):
                        for path in here:
                            calls[path](x, ws[-1])  # the row-path switch
                            for w in ws[:-1]:
                                best[path] = min(best[path], _timed(functools.partial(calls[path], x, w)))
                    row = {"type": fmt, "shape": f"{n}x{k}", "rows": m, "threads": threads}
                    row.update({f"{path}_gb_s": raw.nbytes / best[path] / 1e9 for path in here})
                    out.append(row)
    finally:
        torch.set_num_threads(saved[0])
        lib.int_dot_row_path(saved[1])
    return out


def packed_share(row: dict) -> float:
    """A roofline row's packed path against the read of the packed copies (0 for a type not packed)."""
    return row["int8_packed_gb_s"] / row["read_packed_gb_s"] if "int8_packed_gb_s" in row else 0.0


def _machine() -> str:
    from models.kernels import build

    name = build.cpuinfo().get("model name", "unknown CPU")
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return f"{name}, {os.cpu_count()} CPUs, load average {load}"


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from models.kernels import int_dot

    p = argparse.ArgumentParser(description="Read bandwidth and per-type decode matvec GB/s (fp32 vs int8 paths).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4", help="activation rows per call, comma-separated")
    p.add_argument(
        "--types",
        default=",".join(int_dot.FORMATS),
        help="GGUF types, comma-separated (default: the integer path's; any GGUF type times its fp32 path)",
    )
    p.add_argument(
        "--shapes",
        default=",".join(f"{n}x{k}" for n, k in MATVEC_SHAPES),
        help="weight shapes out x in, comma-separated (default: a 1B model's up/gate and down projections)",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--baseline", help="another checkout's root: also time its int_dot.c row path (int8_rows_base)")
    p.add_argument(
        "--isa", choices=int_dot.ISAS, help="time the integer path's form for this ISA (default: the best the CPU has)"
    )
    args = p.parse_args(argv)
    if args.isa and int_dot.force_isa(args.isa) != args.isa:
        p.error(f"this CPU has no {args.isa} (the integer path would run {int_dot.isa()})")
    read = read_bandwidth(args.threads)  # the run's start; "of read" is against each row's paired read
    rates = matvec_rates(
        tuple(args.types.split(",")),
        tuple(int(r) for r in args.rows.split(",")),
        args.threads,
        shapes=tuple(tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")),
        rounds=args.rounds,
        baseline=args.baseline,
    )
    packed = ("int8_packed", "read_packed") if any(r.get("int8_packed_gb_s") for r in rates) else ()
    paths = (*MATVEC_PATHS, *(("int8_rows_base",) if args.baseline else ()), "read", *packed)
    print(f"# {_machine()}; int_dot ISA {int_dot.isa()}; {args.threads} threads; read bandwidth {read:.1f} GB/s")
    print(f"{'type':<6} {'shape':<10} {'rows':>4} " + " ".join(f"{p:>14}" for p in paths) + "  rows/fp32  of read")
    for r in rates:  # "of read": the best path's share of its copies' read (the fp32 one alone for some types)
        gbs = " ".join(f"{r[f'{p}_gb_s']:>14.1f}" if f"{p}_gb_s" in r else f"{'-':>14}" for p in paths)
        fp32, rows_ = r["fp32_gb_s"], r.get("int8_rows_gb_s")
        ratio = f"{rows_ / fp32:8.2f}x" if rows_ else f"{'-':>9}"
        share = max((rows_ or 0) / r["read_gb_s"], fp32 / r["read_gb_s"], packed_share(r))
        print(f"{r['type']:<6} {r['shape']:<10} {r['rows']:>4} {gbs}  {ratio}  {share:6.0%}")
    if args.json:
        with open(args.json, "w") as f:
            run = {"machine": _machine(), "isa": int_dot.isa(), "threads": args.threads, "read_gb_s": read}
            json.dump({**run, "rates": rates}, f, indent=1)


if __name__ == "__main__":
    main()
