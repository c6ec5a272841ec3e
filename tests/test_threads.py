"""The engine's thread settings reach OpenMP and torch (docs/performance.md, "Threads"); no timing here (the
benchmark has it).

Each case starts a fresh interpreter: libgomp reads its wait policy once, when torch loads it, so only a
process that has not imported torch yet shows whether the engine set it in time. ``OMP_DISPLAY_ENV``
makes libgomp print the settings it really took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json, os, sys
from config import Config
from models.runtime import HFEngine
from models.runtime_config import physical_cores
assert "torch" not in sys.modules
engine = HFEngine(Config(model_id=sys.argv[1], max_batch_size=2, num_threads=int(sys.argv[2])))
import torch
print(json.dumps({"threads": torch.get_num_threads(), "cores": physical_cores(),
                  "tokenizers": os.environ.get("TOKENIZERS_PARALLELISM")}))
"""


def start_engine(model_dir: str, num_threads: int, **env) -> tuple[dict, str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TOKENIZERS_PARALLELISM")
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, model_dir, str(num_threads)],
        cwd=ROOT,
        env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_default_thread_settings_are_applied_before_openmp_starts(tiny_model_dir):
    got, omp_env = start_engine(tiny_model_dir, 0)
    assert "GOMP_SPINCOUNT = '100000'" in omp_env, omp_env[-2000:]
    assert got["threads"] == got["cores"]  # NUM_THREADS=0: every physical core
    assert got["tokenizers"] == "false"


def test_explicit_settings_win(tiny_model_dir):
    got, omp_env = start_engine(tiny_model_dir, 1, OMP_WAIT_POLICY="ACTIVE", TOKENIZERS_PARALLELISM="true")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in omp_env, omp_env[-2000:]
    assert "GOMP_SPINCOUNT = '30000000000'" in omp_env, omp_env[-2000:]  # ACTIVE's own spin, not ours
    assert got == {**got, "threads": 1, "tokenizers": "true"}
