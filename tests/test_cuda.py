"""The torch runtime on a GPU (issue 33): greedy parity with HF ``generate`` on the same device, the scheduler with
joins and preemption, and the server over HTTP on 127.0.0.1.

Each test runs once per ``device``: ``cuda`` rows are marked ``cuda`` and skip where torch sees no GPU (CI has none;
``scripts/gpu_check.sh`` runs them on a lent one), and the ``cpu`` rows run everywhere, so the code a GPU run
executes (these tests, the device placement of the model, its pool and its step tensors) is exercised before a GPU
is lent, not run blind. On CUDA the compiled CPU kernels are never picked: the torch runtime's generic paths run
(SDPA, ``paged_attention_torch``), fp32 with TF32 off, so parity is exact there too.
"""

from __future__ import annotations

import random

import httpx
import pytest

from core.sequence import Sequence

from conftest import PROMPTS, assert_pool_full, pool_mb, schedule_all
from live import ProcessServer


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not _cuda_available(), reason="torch sees no CUDA device")]
    ),
]
pytestmark = pytest.mark.model


class DeviceReference:
    """HF greedy ``generate`` of a checkpoint on ``device`` in fp32 (TF32 off): the ground truth there."""

    def __init__(self, model_dir: str, device: str) -> None:
        import torch
        import transformers

        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the engine's matmuls run without TF32 too
        torch.backends.cudnn.allow_tf32 = False
        self.device = torch.device(device)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(self.device).eval()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``prompt``, EOS ignored (as the sequences below ask)."""
        import torch

        ids = torch.tensor([prompt], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()


def engine_on(device: str, model_dir: str, capacity: int, **config):
    from config import Config
    from models.runtime import HFEngine

    engine = HFEngine(Config(model_id=model_dir, device=device, max_batch_size=capacity, num_threads=2, **config))
    assert engine.device.type == device and engine.model.kv.k.device.type == device
    return engine


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_parity_with_joins(device, pressure_model):
    """Sequences of several lengths admitted as others finish (capacity 3 for 6): every output equals HF greedy
    ``generate`` on the same device, fp32."""
    ref = DeviceReference(pressure_model, device)
    engine = engine_on(device, pressure_model, capacity=3)
    seqs = [
        Sequence(prompt_token_ids=ref.encode(p), max_new_tokens=4 + 3 * i, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    schedule_all(engine, seqs)
    for s in seqs:
        assert s.output_token_ids == ref.greedy(s.prompt_token_ids, s.max_new_tokens), s.seq_id
    assert_pool_full(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_parity_under_preemption_and_chunked_prefill(device, pressure_model):
    """A pool of 14 blocks x 4 tokens for up to 4 running sequences, prompts prefilled in chunks of 5 tokens:
    sequences are preempted and recomputed on the device; every output still equals HF."""
    ref = DeviceReference(pressure_model, device)
    engine = engine_on(
        device,
        pressure_model,
        capacity=4,
        kv_block_size=4,
        kv_cache_mb=pool_mb(pressure_model, 14, 4),
        max_num_batched_tokens=5,
    )
    rng = random.Random(7)
    seqs = []
    for i in range(8):
        prompt = ref.encode(rng.choice(PROMPTS) + f" {i}")[:30]
        budget = min(rng.choice([6, 12, 20]), 48 - len(prompt))
        seqs.append(Sequence(prompt_token_ids=prompt, max_new_tokens=budget, ignore_eos=True))
    schedule_all(engine, seqs)
    for s in seqs:
        assert s.output_token_ids == ref.greedy(s.prompt_token_ids, s.max_new_tokens), s.seq_id
    assert engine.planner.num_preemptions >= 1
    assert_pool_full(engine)


@pytest.mark.parametrize("device", DEVICES)
def test_server_over_http(device, tiny_model_dir):
    """``python server.py`` with DEVICE set, on 127.0.0.1: it loads on that device, and concurrent /generate
    answers (token-id prompts, EOS ignored) equal HF greedy on that device."""
    ref = DeviceReference(tiny_model_dir, device)
    prompts = [ref.encode(p) for p in PROMPTS]
    env = {"MODEL_ID": tiny_model_dir, "DEVICE": device, "RUNTIME": "torch", "MAX_BATCH_SIZE": "4", "NUM_THREADS": "2"}
    with ProcessServer(env, ready_timeout=180) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        import concurrent.futures

        def ask(prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "max_new_tokens": 8, "ignore_eos": True}
            r = client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, prompts))
        assert answers == [ref.greedy(p, 8) for p in prompts]
        assert client.get("/health").status_code == 200
        assert f" on {device}" in srv.output()  # the startup line: "loaded <model> on <device>: ..."
