"""The decode step at one batch size over given contexts, through the engine seam alone, in any checkout of
this project: run with ``PYTHONPATH=DIR`` (and ``--tree DIR``, which checks that the engine measured is that
checkout's), the same measurement runs on this engine (KV block pool, paged attention) and on the pre-pool one
(contiguous per-slot KV, commit 380e2e9) from a temporary ``git worktree`` (``benchmark.py --workload decode-step``
makes it and runs both side by side).

    PYTHONPATH=/tmp/prev python scripts/bench/decode_step.py --tree /tmp/prev --model DIR --batch 8 --steps 16

Per context: ``batch`` sequences of that many prompt tokens are admitted and prefilled, ``warmup`` decode steps
run untimed, then ``steps`` decode steps are timed one by one (``engine.step()``, nothing else in flight:
chunked prefill is set off where the checkout has the knob, so no step carries a prompt chunk). Prints
``RESULT {"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time


def measure(model: str, batch: int, contexts: list[int], steps: int, threads: int, warmup: int = 4) -> list[dict]:
    from config import Config

    try:  # a checkout from before models/runtime.py keeps HFEngine in engine.py
        from models.runtime import HFEngine
    except ImportError:
        from engine import HFEngine

    try:  # a checkout from before the package layout keeps its modules at the root
        from sequence import Sequence
    except ImportError:
        from core.sequence import Sequence

    known = {f.name for f in dataclasses.fields(Config)}
    extra = {"max_num_batched_tokens": 0} if "max_num_batched_tokens" in known else {}
    longest = max(contexts) + warmup + steps + 8
    engine = HFEngine(Config(model_id=model, max_batch_size=batch, max_model_len=longest, num_threads=threads, **extra))
    rows = []
    for ctx in contexts:
        seqs = [
            Sequence(
                prompt_token_ids=[(i * 7919 + r * 31) % 500 + 10 for i in range(ctx)],
                max_new_tokens=warmup + steps + 2,
                ignore_eos=True,
            )
            for r in range(batch)
        ]
        engine.admit(seqs)
        for _ in range(warmup):  # untimed: first-call costs (new shapes, caches) stay out of the figures
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for s in seqs:
            engine.abort(s.seq_id)
        rows.append(
            {
                "batch": batch,
                "context": ctx,
                "steps": steps,
                "step_ms": statistics.median(times) * 1e3,
                "step_ms_min": min(times) * 1e3,
                "steps_ms": [round(t * 1e3, 2) for t in times],
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", required=True, help="the checkout whose engine is measured")
    p.add_argument("--model", required=True, help="checkpoint directory both checkouts can load")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", default="100,2048")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    import engine

    if not os.path.abspath(engine.__file__).startswith(os.path.abspath(args.tree) + os.sep):
        sys.exit(f"error: engine imported from {engine.__file__}, not --tree {args.tree} (set PYTHONPATH={args.tree})")
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = measure(args.model, args.batch, contexts, args.steps, args.threads, args.warmup)
    print("RESULT " + json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
