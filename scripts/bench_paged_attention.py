"""Decode attention over every layer of one step: paged kernel vs today's contiguous SDPA, side by side.

For each model shape, batch and context: the contiguous baseline is the per-slot cache
(``[capacity, KVH, max_len, D]`` per layer, SDPA over the view ``[:B, :, :L]`` with a position
mask, as the engine runs decode today); the paged variants read the same contexts from a block pool
whose blocks are scattered at random (a pool after many requests came and went), with block sizes 16
and 32 and two physical layouts: token-major ``[blocks, bs, KVH, D]`` and head-major
``[blocks, KVH, bs, D]``; ``gather+sdpa`` is the torch fallback. Times are per step (all layers,
caches cold between layers like in a real step), best of ``--reps`` rounds taken in turns. With
``--threads 1`` the clock is the thread's CPU time, which a shared machine's other processes do not
inflate (memory-bandwidth contention still shows); with more threads it is wall time.

    python scripts/bench_paged_attention.py --threads 1 --reps 9
    python scripts/bench_paged_attention.py --dtypes --threads 1 --contexts 1600,8192 --batch 8

``--dtypes``: the paged kernel alone (head-major, block 32) over a pool of each KV_CACHE_DTYPE (fp32, fp16,
bf16, int8), each under KERNEL_ISA=avx2 and auto (AVX-512 where the CPU has it), in turns: ms per step and the
pool bytes it read per second (docs/kv-cache.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from models.kernels import paged_attention as pa

SHAPES = {  # name: (layers, H, KVH, D)
    "smollm2-135m": (30, 9, 3, 64),
    "distilgpt2": (6, 12, 12, 64),
}


def timed(variants: dict, layers: int, reps: int, clock=time.perf_counter) -> dict[str, float]:
    """Best seconds of one pass of fn(layer) over every layer, per variant. The variants take turns
    (round-robin, rotated start) so contention on a shared machine hits them alike; the minimum is the
    least disturbed sample."""
    samples: dict[str, list[float]] = {label: [] for label in variants}
    labels = list(variants)
    for rep in range(reps + 1):
        for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
            fn = variants[label]
            start = clock()
            for layer in range(layers):
                fn(layer)
            if rep:  # the first round warms up
                samples[label].append(clock() - start)
    return {label: min(s) for label, s in samples.items()}


def contiguous(layers, B, H, KVH, D, ctx, gen):
    """Today's layout: [layers, B, KVH, max_len, D], decode attends the view [:B, :, :ctx]."""
    k = torch.randn(layers, B, KVH, ctx + 16, D, generator=gen)
    v = torch.randn(layers, B, KVH, ctx + 16, D, generator=gen)
    q = torch.randn(B, H, D, generator=gen)
    pos = torch.full((B,), ctx - 1)
    mask = (torch.arange(ctx) <= pos[:, None]).view(B, 1, 1, ctx)

    def run(layer):
        F.scaled_dot_product_attention(
            q.view(B, KVH, H // KVH, D), k[layer, :, :, :ctx], v[layer, :, :, :ctx], attn_mask=mask, scale=D**-0.5
        )

    return run


def paged(layers, B, H, KVH, D, ctx, bs, head_major, fallback, gen):
    per_row = -(-ctx // bs)
    nb = B * per_row + 8
    shape = (layers, nb, KVH, bs, D) if head_major else (layers, nb, bs, KVH, D)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if head_major:  # the kernel's logical shape is [blocks, bs, KVH, D]
        k, v = k.transpose(2, 3), v.transpose(2, 3)
    tables = torch.randperm(nb, generator=gen)[: B * per_row].view(B, per_row).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=gen)
    fn = pa.paged_attention_torch if fallback else pa.paged_attention

    def run(layer):
        fn(q, k[layer], v[layer], tables, lens, D**-0.5)

    return run


POOL_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def paged_dtype(layers, B, H, KVH, D, ctx, dtype, gen):
    """The engine's layout (head-major, block 32) over a pool of ``dtype`` elements (int8 with its scales)."""
    bs = 32
    per_row = -(-ctx // bs)
    nb = B * per_row + 8
    shape = (layers, nb, KVH, bs, D)
    (k, ks), (v, vs) = (pa.to_pool_dtype(torch.randn(shape, generator=gen), dtype) for _ in range(2))
    scales = None if ks is None else (ks.transpose(2, 3), vs.transpose(2, 3))
    k, v = k.transpose(2, 3), v.transpose(2, 3)
    tables = torch.randperm(nb, generator=gen)[: B * per_row].view(B, per_row).to(torch.int32)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=gen)
    pool_bytes = 2 * B * ctx * KVH * (D * k.element_size() + (4 if ks is not None else 0))

    def run(layer):
        layer_scales = None if scales is None else (scales[0][layer], scales[1][layer])
        pa.paged_attention(q, k[layer], v[layer], tables, lens, D**-0.5, scales=layer_scales)

    return run, pool_bytes


def compare_dtypes(args, gen, clock) -> None:
    from models.kernels.build import set_kernel_isa

    for name in args.shapes.split(","):
        layers, H, KVH, D = SHAPES[name]
        for ctx in (int(c) for c in args.contexts.split(",")):
            runs, nbytes = {}, {}
            for dt_name, dtype in POOL_DTYPES.items():
                run, nbytes[dt_name] = paged_dtype(layers, args.batch, H, KVH, D, ctx, dtype, gen)
                for isa in ("avx2", "auto"):
                    runs[f"{dt_name} {isa}"] = (lambda r, i: lambda layer: (set_kernel_isa(i), r(layer)))(run, isa)
            best = timed(runs, layers, args.reps, clock)
            base = best["fp32 avx2"]
            for label, seconds in best.items():
                per_layer = nbytes[label.split()[0]]
                print(
                    f"{name:13s} B={args.batch} ctx={ctx:5d} {label:10s} {seconds * 1e3:8.2f} ms  "
                    f"{base / seconds:5.2f}x fp32  {per_layer * layers / seconds / 1e9:6.1f} GB/s of pool"
                )
            del runs
    set_kernel_isa("auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="100,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", action="store_true", help="the paged kernel per KV_CACHE_DTYPE and ISA")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if pa.load() is None:
        sys.exit(f"kernel unavailable: {pa.KERNEL.unavailable_reason}")
    gen = torch.Generator().manual_seed(0)
    B = args.batch
    if args.dtypes:
        compare_dtypes(args, gen, time.thread_time if args.threads == 1 else time.perf_counter)
        return
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"threads={args.threads} batch={B} reps={args.reps}; {clock} ms per step (all layers), ratio to contiguous")
    for name in args.shapes.split(","):
        layers, H, KVH, D = SHAPES[name]
        for ctx in (int(c) for c in args.contexts.split(",")):
            variants = {"contiguous sdpa": contiguous(layers, B, H, KVH, D, ctx, gen)}
            for bs in (16, 32):
                variants[f"paged bs={bs} token-major"] = paged(layers, B, H, KVH, D, ctx, bs, False, False, gen)
                variants[f"paged bs={bs} head-major"] = paged(layers, B, H, KVH, D, ctx, bs, True, False, gen)
            variants["gather+sdpa bs=16"] = paged(layers, B, H, KVH, D, ctx, 16, False, True, gen)
            best = timed(variants, layers, args.reps, time.thread_time if args.threads == 1 else time.perf_counter)
            base = best["contiguous sdpa"] * 1e3
            for label, seconds in best.items():
                ms = seconds * 1e3
                print(f"{name:13s} ctx={ctx:5d} {label:28s} {ms:8.2f} ms  {ms / base:5.2f}x")
            del variants


if __name__ == "__main__":
    main()
