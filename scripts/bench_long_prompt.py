"""Long prompts arriving while streams decode: max inter-token latency with chunked prefill on and off.

8 streams decode (short prompts, ``--stream-tokens`` new tokens each); once every stream has its
first tokens, 4 prompts of 1500-2000 tokens arrive. Without chunking each long prompt is prefilled
whole inside one step, so every stream stalls for it; with ``MAX_NUM_BATCHED_TOKENS`` the prompts
load a chunk per step. Reported per setting: each stream's max inter-token latency (its worst stall),
their max and median, and the wall time of the whole run. Both settings run in one process, one
after the other (the model is loaded once per setting).

    python scripts/bench_long_prompt.py --model <checkpoint dir> --budgets 0,512
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import Config  # noqa: E402
from engine import HFEngine  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from sequence import Sequence  # noqa: E402


def run_once(model: str, budget: int, threads: int, stream_tokens: int, seed: int) -> dict:
    engine = HFEngine(
        Config(
            model_id=model,
            max_batch_size=12,
            max_model_len=2304,
            num_threads=threads,
            max_num_batched_tokens=budget,
        )
    )
    rng = random.Random(seed)
    vocab = min(engine.vocab_size, 30000)
    streams = [
        Sequence(
            prompt_token_ids=[rng.randrange(100, vocab) for _ in range(32)],
            max_new_tokens=stream_tokens,
            ignore_eos=True,
        )
        for _ in range(8)
    ]
    longs = [
        Sequence(
            prompt_token_ids=[rng.randrange(100, vocab) for _ in range(rng.randint(1500, 2000))],
            max_new_tokens=8,
            ignore_eos=True,
        )
        for _ in range(4)
    ]
    stamps: dict[int, list[float]] = {s.seq_id: [] for s in streams}

    async def main() -> float:
        sched = Scheduler(engine, max_queue_depth=100)
        sched.start()
        start = time.perf_counter()
        futures = [sched.submit(s, lambda s: stamps[s.seq_id].append(time.perf_counter())) for s in streams]
        while min(len(v) for v in stamps.values()) < 4:  # every stream decoding
            await asyncio.sleep(0.005)
        futures += [sched.submit(s) for s in longs]
        await asyncio.wait_for(asyncio.gather(*futures), timeout=1800)
        await sched.stop()
        return time.perf_counter() - start

    wall = asyncio.run(main())
    worst = [max(b - a for a, b in zip(v, v[1:])) for v in stamps.values()]
    return {
        "budget": budget,
        "max_itl_s": max(worst),
        "median_stream_max_itl_s": statistics.median(worst),
        "per_stream_max_itl_s": [round(w, 3) for w in worst],
        "wall_s": wall,
        "preemptions": engine.num_preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (or hub id / .gguf)")
    ap.add_argument("--budgets", default="0,512", help="MAX_NUM_BATCHED_TOKENS values to compare (0 = off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = [
        run_once(args.model, int(b), args.threads, args.stream_tokens, args.seed) for b in args.budgets.split(",")
    ]
    for r in results:
        print(
            f"MAX_NUM_BATCHED_TOKENS={r['budget']:5d}: max ITL {r['max_itl_s']:.3f} s, median of streams' max "
            f"{r['median_stream_max_itl_s']:.3f} s, wall {r['wall_s']:.1f} s, preemptions {r['preemptions']}; "
            f"per stream {r['per_stream_max_itl_s']}"
        )
    if len(results) >= 2 and results[-1]["max_itl_s"]:
        print(f"worst stall, first / last setting: {results[0]['max_itl_s'] / results[-1]['max_itl_s']:.2f}x")


if __name__ == "__main__":
    main()
