"""The torch-free runtime (RUNTIME=native, ``models.runtime.NativeEngine``): a model image run by the whole-step kernel.

Gates: HF's greedy tokens (on the dequantized weights) through the scheduler with joins, chunked prefill and
preemption; the torch engine's exact tokens and logprobs for every sampling feature (both run the same kernel on
the same bits, so nothing may differ); which runtime RUNTIME picks; and a real server that serves without ever
loading torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from test_prefix_cache import submit_all

from config import Config, ConfigError
from core.sampling import SamplingParams
from core.sequence import Sequence, group_choices

from conftest import PROMPTS, Reference, expected, need_native, pool_mb, seqs_for

pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_config(model_dir: str, weights: str, blocks: int = 64, **config) -> Config:
    base = {"max_batch_size": 4, "num_threads": 2, "kv_block_size": 4, "kv_cache_mb": pool_mb(model_dir, blocks, 4)}
    base["kv_cache_dtype"] = "fp32"  # exact: KV_CACHE_DTYPE=auto would pick int8 beside these quantized weights
    return Config(model_id=model_dir, weights=weights, **{**base, **config})


def native_engine(model_dir: str, weights: str, blocks: int = 64, **config):
    from models.runtime import NativeEngine

    return NativeEngine(engine_config(model_dir, weights, blocks, **config))


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("blocks, budget", [(64, 6), (14, 0)], ids=["chunked", "preempting"])
def test_greedy_parity_through_the_scheduler(pressure_model, weights, blocks, budget):
    """9 ragged prompts over 4 slots, joining while others decode: with prefill chunked 6 tokens a step (chunks ride
    with decode rows), and on a pool small enough to preempt and recompute. Every token is HF's greedy token on
    the dequantized weights."""
    from models.quant import dequantize_hf_model_

    need_native()
    ref = Reference(pressure_model)
    dequantize_hf_model_(ref.model, weights)
    engine = native_engine(pressure_model, weights, blocks, max_num_batched_tokens=budget)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(9)]
    seqs = seqs_for(ref, prompts, [1 + (i * 7) % 13 for i in range(9)], ignore_eos=True)
    submit_all(engine, [seqs[:5], seqs[5:]], gap=0.05)
    for seq in seqs:
        assert seq.output_token_ids == expected(ref, seq, set()), (weights, seq.prompt_token_ids)
    if blocks == 14:
        assert engine.planner.num_preemptions > 0


def feature_sequences(ref: Reference) -> list[Sequence]:
    """One of each sampling feature, plus an n=3 group of seeded choices (forked from one prefill)."""
    ids = ref.encode(PROMPTS[0])
    distinct = sorted(set(ids))
    params = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.0, top_k=5, seed=8),
        SamplingParams(temperature=1.0, top_p=0.6, seed=9),
        SamplingParams(temperature=0.7, min_p=0.2, seed=10),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(logit_bias=((distinct[0], 5.0), (distinct[1], -100.0))),
    ]
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(prompt_token_ids=ref.encode(PROMPTS[i % len(PROMPTS)]), max_new_tokens=9, ignore_eos=True)
        seq.sampling = p
        seq.logprobs = 3
        seq.prompt_logprobs_k = 2 if i % 2 == 0 else None
        seqs.append(seq)
    group = [Sequence(prompt_token_ids=ids, max_new_tokens=7, ignore_eos=True) for _ in range(3)]
    for j, seq in enumerate(group):
        seq.sampling = SamplingParams(temperature=1.0, seed=j)
    group_choices(group)
    return seqs + group


def outcome(seqs: list[Sequence]) -> list:
    return [(s.output_token_ids, s.output_logprobs, s.prompt_logprobs, s.finish_reason) for s in seqs]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_sampling_feature_gives_the_torch_engines_tokens_and_logprobs(pressure_model, weights):
    """Seeded sampling (temperature, top-k, top-p, min-p), penalties, logit bias, logprobs, prompt logprobs and
    forked choices: the native engine's outcome equals the torch engine's, token for token and logprob for logprob
    (the same kernel computes the same logits; sampling is the same numpy code)."""
    from models.runtime import HFEngine

    need_native()
    ref = Reference(pressure_model)
    outcomes = []
    for make in (HFEngine, native_engine_for):
        engine = make(engine_config(pressure_model, weights, max_num_batched_tokens=8))
        seqs = feature_sequences(ref)
        submit_all(engine, [seqs])
        outcomes.append(outcome(seqs))
        assert all(s.output_token_ids for s in seqs)
    assert outcomes[0] == outcomes[1]


def native_engine_for(config: Config):
    from models.runtime import NativeEngine

    return NativeEngine(config)


def test_runtime_setting_is_validated():
    assert Config.from_env({"RUNTIME": "native"}).runtime == "native"
    with pytest.raises(ConfigError, match="RUNTIME must be one of auto, torch, native"):
        Config.from_env({"RUNTIME": "tensorrt"})
    with pytest.raises(ConfigError, match="native runs on the CPU only"):
        Config.from_env({"RUNTIME": "native", "DEVICE": "cuda"})


@pytest.mark.parametrize(
    "env, native",
    [
        ({"MODEL_ID": "m.gguf"}, True),  # a GGUF at its own quantization
        ({"MODEL_ID": "m.gguf", "WEIGHTS": "fp32"}, False),
        ({"MODEL_ID": "dir", "WEIGHTS": "int8"}, True),
        ({"MODEL_ID": "dir", "WEIGHTS": "int4"}, True),
        ({"MODEL_ID": "dir"}, False),  # a safetensors checkpoint at auto is fp32
        ({"MODEL_ID": "dir", "WEIGHTS": "int8", "RUNTIME": "torch"}, False),
        ({"MODEL_ID": "dir", "RUNTIME": "native"}, True),
        ({"MODEL_ID": "dir", "WEIGHTS": "int8", "DEVICE": "cuda"}, False),
    ],
)
def test_auto_runtime_serves_quantized_weights_natively(env, native, monkeypatch):
    import models.native
    from models.runtime_config import uses_native_runtime

    monkeypatch.setattr(models.native, "unavailable_reason", lambda: None)
    assert uses_native_runtime(Config.from_env(env)) is native


def test_auto_runtime_falls_back_to_torch_where_the_kernel_cannot_run(monkeypatch, caplog):
    import models.native
    from models.runtime_config import uses_native_runtime

    monkeypatch.setattr(models.native, "unavailable_reason", lambda: "no AVX2 on this CPU")
    assert not uses_native_runtime(Config.from_env({"MODEL_ID": "m.gguf"}))
    assert "no AVX2 on this CPU" in caplog.text


SERVER_CHECK = textwrap.dedent(
    """
    import json, sys
    import httpx
    url, pid = sys.argv[1], int(sys.argv[2])
    out = {}
    # OpenAI's default temperature (1.0) samples: EOS may come at any step unless ignored
    body = {"prompt": "Hello there", "max_tokens": 6, "logprobs": 2, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    out["completion"] = r.status_code, r.json()["usage"]["completion_tokens"]
    out["completion_logprobs"] = len(r.json()["choices"][0]["logprobs"]["top_logprobs"])
    body = {"prompt": "Hi", "max_new_tokens": 4, "temperature": 0.9, "seed": 3}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    out["generate"] = r.status_code
    body = {"prompt": "Pick:", "max_new_tokens": 8, "choice": ["yes", "no"]}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    out["choice"] = r.status_code, r.json()["text"]
    with open(f"/proc/{pid}/maps") as f:
        out["torch_mapped"] = any("libtorch" in line for line in f)
    print(json.dumps(out))
    """
)


def test_a_native_server_serves_without_loading_torch(pressure_model):
    """``python server.py`` with quantized weights (RUNTIME=auto): completions with logprobs, seeded sampling and a
    grammar-constrained choice all answer, and libtorch is never mapped into the server process."""
    from models.image import ensure_image

    from live import ProcessServer

    need_native()
    ensure_image(pressure_model, "int8")  # built here (a torch child), so the server finds it cached
    server = ProcessServer({"MODEL_ID": pressure_model, "WEIGHTS": "int8", "MAX_BATCH_SIZE": "2", "NUM_THREADS": "1"})
    try:
        result = subprocess.run(
            [sys.executable, "-c", SERVER_CHECK, server.url, str(server.proc.pid)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
    assert out["completion"] == [200, 6] and out["completion_logprobs"] == 6
    assert out["generate"] == 200
    assert out["choice"][0] == 200 and out["choice"][1] in ("yes", "no")
    assert out["torch_mapped"] is False
