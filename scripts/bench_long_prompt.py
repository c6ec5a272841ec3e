"""Long prompts arriving while streams decode: max inter-token latency at several chunked-prefill budgets.

The ``long-prompt`` workload of scripts/benchmark.py (one implementation; this is its short command): 8
streams decode while 4 prompts of 1500-2000 tokens arrive. Without chunking (``MAX_NUM_BATCHED_TOKENS=0``)
each long prompt is prefilled whole inside one step, so every stream stalls for it; with a budget the
prompts load a chunk per step. Reported per budget, side by side in one run: each stream's max inter-token
latency (its worst stall), their max and median, the long prompts' TTFT, and the ratio to the first budget.

    python scripts/bench_long_prompt.py --model weights/SmolLM2-135M-Instruct.Q4_1.gguf --budgets 0,512
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory, hub id or .gguf (context >= 2100)")
    ap.add_argument("--budgets", default="0,512", help="MAX_NUM_BATCHED_TOKENS values to compare (0 = off)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per budget (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = physical cores)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from scripts.benchmark import main as benchmark

    systems = ",".join(f"ours:budget={int(b)}" for b in args.budgets.split(","))
    cmd = ["--model", args.model, "--workload", "long-prompt", "--systems", systems]
    cmd += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
    return benchmark(cmd + (["--json", args.json] if args.json else []))


if __name__ == "__main__":
    sys.exit(main())
