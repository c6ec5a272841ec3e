"""Memory high-water under many distinct prompt lengths (``models/native_memory.py``).

Each distinct prompt length is a new shape for every linear; oneDNN's and ideep's per-shape caches and
the heap used to grow RSS by ~500 MB over 300 lengths on the tiny model, and further on a second pass.
A fresh interpreter (the cache caps must be in place before torch's first oneDNN op) runs 150 distinct
lengths twice and reports RSS; the growth must stay bounded and the second pass must not grow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import sys
    from config import Config
    from engine import HFEngine
    from sequence import Sequence

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

    engine = HFEngine(Config(model_id=sys.argv[1], max_batch_size=4, num_threads=2))
    vocab = len(engine.tokenizer)

    def one_pass():
        for length in range(2, 302, 2):  # 150 distinct prompt lengths, each prefilled then decoded
            prompt = [(i * 7 + length) % (vocab - 1) + 1 for i in range(length)]
            seq = Sequence(prompt_token_ids=prompt, max_new_tokens=2, ignore_eos=True)
            engine.admit([seq])
            engine.step()

    start = rss_mb()
    one_pass()
    first = rss_mb()
    one_pass()
    print("RSS", start, first, rss_mb())
    """
)


def test_distinct_prompt_lengths_keep_rss_bounded(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model_dir], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    start, first, second = (int(x) for x in proc.stdout.split("RSS", 1)[1].split())
    # Measured: +54 MB over 300 lengths with the caps and trimming, +526 MB without.
    assert first - start < 150, (start, first, second)
    assert second - first < 40, (start, first, second)
