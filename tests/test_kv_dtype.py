"""KV_CACHE_DTYPE through the engines and the scheduler: fp16, bf16 and int8 pools under the pressure and prefix
gates (preemption and recompute, prefix sharing, chunked prefill, n > 1 forks) on both runtimes; the pool's bytes
(KV_CACHE_MB buys 2x / ~3.8x the tokens); what the startup log and /metrics say; bad settings.

fp32 stays exact (the parity gates of test_kv_pool.py and test_prefix_cache.py run it). A narrower pool changes
the math by its rounding, so the gates here state a bound against HF's fp32 greedy tokens on the test checkpoints
(``AGREEMENT``: the share of generated tokens before each sequence's first difference, measured) plus
determinism: the same schedule on a fresh engine gives the same tokens, and a prompt sent again (its blocks now in
the prefix cache) gives the same tokens again.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_prefix_cache import seq, submit_all

from config import Config, ConfigError
from core.sequence import Sequence, group_choices

from conftest import PROMPTS, Reference, bounded, expected, pool_mb, runtime_knobs, serving

NARROW = ["fp16", "bf16", "int8"]
# Least share of greedy tokens (before each sequence's first difference) that equal HF fp32's, per dtype, on the
# tiny random test checkpoints, whose near-tied logits flip at the smallest change (measured on this schedule,
# torch / native: fp16 0.93-1.0, bf16 0.88-1.0, int8 0.71-0.89); SmolLM2's figures are in docs/kv-cache.md.
AGREEMENT = {"fp16": 0.85, "bf16": 0.8, "int8": 0.6}


def schedule(ref: Reference) -> list[list[Sequence]]:
    """Groups run one after another: 10 sequences over 3 shared stems (preempted in a small pool, their cached
    blocks hit on recompute), then the first sequence's prompt twice more, then an n = 3 group forked from one
    prefill."""
    stems = [ref.encode(p + " and then")[:12] for p in PROMPTS[:3]]
    first = [seq(stems[i % 3] + ref.encode(f" {i}")[:2], 8 + (i * 5) % 12, ignore_eos=True) for i in range(10)]
    again = [seq(first[0].prompt_token_ids, first[0].max_new_tokens, ignore_eos=True) for _ in range(2)]
    forks = [seq(ref.encode(PROMPTS[4])[:14], 9, ignore_eos=True) for _ in range(3)]
    group_choices(forks)
    return [first, again, forks]


def engine_for(model_dir: str, runtime: str, kv_dtype: str, blocks: int = 16, sized_for: str = ""):
    """An engine of 4 slots over a pool of ``kv_dtype`` elements, KV_CACHE_MB that of ``blocks`` blocks of 4 tokens
    of ``sized_for`` elements (default: of ``kv_dtype``), prefill chunked 5 tokens a step."""
    from models.runtime import HFEngine, NativeEngine

    knobs = {**runtime_knobs(runtime), "kv_cache_dtype": kv_dtype}
    cfg = Config(
        model_id=model_dir,
        max_batch_size=4,
        num_threads=2,
        kv_block_size=4,
        kv_cache_mb=pool_mb(model_dir, blocks, 4, sized_for or kv_dtype),
        max_num_batched_tokens=5,
        **knobs,
    )
    return (NativeEngine if runtime == "native" else HFEngine)(cfg)


def run_schedule(model_dir: str, runtime: str, kv_dtype: str, ref: Reference):
    engine = engine_for(model_dir, runtime, kv_dtype)
    groups = schedule(ref)
    submit_all(engine, groups)
    seqs = [s for g in groups for s in g]
    assert engine.planner.num_preemptions >= 1 and engine.blocks.hit_tokens > 0 and engine.planner.num_forks == 2
    engine.blocks.check()
    assert engine.blocks.is_all_free() and engine.num_active() == 0
    return engine, seqs


def agreement(ref: Reference, seqs: list[Sequence]) -> float:
    """Share of all generated tokens that come before their sequence's first difference from HF's greedy output."""
    same = total = 0
    for s in seqs:
        want = expected(ref, s, set())
        n = next((i for i, (a, b) in enumerate(zip(s.output_token_ids, want)) if a != b), len(want))
        same, total = same + n, total + len(want)
    return same / total


@pytest.fixture(scope="module")
def checkpoints(request, tmp_path_factory) -> dict[str, str]:
    """The test checkpoints by family: tiny random GPT-2 and Llama (GQA: 4 query heads over 2 K/V heads)."""
    from scripts.make_test_model import build_checkpoint

    llama = build_checkpoint(str(tmp_path_factory.mktemp("llama_kv")), arch="llama", seed=2, tied=False)
    return {"gpt2": request.getfixturevalue("tiny_model_dir"), "llama": llama}


# Every narrow dtype on Llama (GQA, RoPE: SmolLM2's family), int8 (the farthest from fp32) on GPT-2 too; both
# runtimes each.
GATES = [
    (f, r, d)
    for f, d in [("llama", "fp16"), ("llama", "bf16"), ("llama", "int8"), ("gpt2", "int8")]
    for r in ("torch", "native")
]


@pytest.mark.model
@pytest.mark.parametrize("family, runtime, kv_dtype", GATES)
def test_pressure_and_prefix_gates_with_a_narrower_pool(checkpoints, family, runtime, kv_dtype):
    """Preemption and recompute, prefix hits, chunked prefill and n = 3 forks over an fp16 / bf16 / int8 pool: the
    tokens agree with HF's fp32 greedy ones within the bound, a second run of the same schedule on a fresh engine
    gives the same tokens, and the prompt sent twice more (from the prefix cache) gives its tokens again."""
    pressure_model = checkpoints[family]
    ref = Reference(pressure_model)
    if runtime == "native":  # the image's int8 weights, dequantized, are the reference's
        from models.quant import dequantize_hf_model_

        dequantize_hf_model_(ref.model, "int8")
    engine, seqs = run_schedule(pressure_model, runtime, kv_dtype, ref)
    share = agreement(ref, seqs)
    assert share >= AGREEMENT[kv_dtype], (kv_dtype, share)
    _, again = run_schedule(pressure_model, runtime, kv_dtype, ref)
    assert [s.output_token_ids for s in again] == [s.output_token_ids for s in seqs]
    first, repeats = seqs[0], seqs[10:12]
    assert all(r.output_token_ids == first.output_token_ids and r.num_cached_tokens > 0 for r in repeats)
    forks = seqs[12:]
    assert forks[0].output_token_ids == forks[1].output_token_ids == forks[2].output_token_ids  # greedy choices


# Families whose attention reads the pool differently from Llama's, each over a narrow pool on both runtimes: every
# layer sliding (Mistral: blocks that left the window go back to the pool), soft-capped scores on alternating local
# and global layers (Gemma 2), a partial rotary and a window (Phi-3).
FAMILY_GATES = [
    (a, d, r)
    for a, d in [("mistral", "int8"), ("gemma2", "fp16"), ("gemma2", "int8"), ("phi3", "bf16")]
    for r in ("torch", "native")
]


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    """arch -> its tiny checkpoint (``make_test_model.FAMILIES``: 20-key windows, soft-caps that bite), built once."""
    from scripts.make_test_model import build_checkpoint

    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_checkpoint(str(tmp_path_factory.mktemp(arch)), arch=arch, seed=3)
        return built[arch]

    return get


@pytest.mark.model
@pytest.mark.parametrize("arch, kv_dtype, runtime", FAMILY_GATES)
def test_windows_and_soft_caps_over_a_narrower_pool(family_checkpoint, arch, kv_dtype, runtime):
    """A 40-token prompt decoding 24 tokens past a 20-key window, two prompts sharing 3 blocks, others joining; in a
    pool small enough to preempt, prefill chunked 8 tokens a step, then the last prompt again (a prefix hit): the
    tokens agree with HF's fp32 greedy ones within the dtype's bound, and a fresh engine gives the same tokens."""
    from test_families import BLOCK, engine_for, long_prompt, spec_of

    from conftest import seqs_for

    model_dir = family_checkpoint(arch)
    ref = Reference(model_dir)
    if runtime == "native":  # the image's int8 weights, dequantized, are the reference's
        from models.quant import dequantize_hf_model_

        dequantize_hf_model_(ref.model, "int8")
    slides = all(spec_of(model_dir).windows)
    stem = ref.encode(" ".join(PROMPTS))[: 3 * BLOCK]

    def run() -> list[Sequence]:
        weights = {} if runtime == "native" else {"weights": "fp32"}
        engine = engine_for(
            model_dir,
            runtime,
            blocks=16 if slides else 24,
            max_num_batched_tokens=8,
            kv_cache_dtype=kv_dtype,
            **weights,
        )
        assert engine.kv_cache_dtype == kv_dtype and engine.planner.kv_window == (20 if slides else 0)
        first = [seq(long_prompt(ref, 40), 24, ignore_eos=True)]
        shared = [seq([*stem, *ref.encode(tail)], 20, ignore_eos=True) for tail in (" zebra quilt", " a lazy dog")]
        others = seqs_for(ref, PROMPTS[:2], [16, 12], ignore_eos=True)
        probe = seq(long_prompt(ref, 14), 9, ignore_eos=True)  # inside the window: its 3 full blocks get cached
        again = [seq(probe.prompt_token_ids, 9, ignore_eos=True)]
        groups = [first + shared + others[:1], [*others[1:], probe], again]
        submit_all(engine, groups)
        assert engine.planner.num_preemptions >= 1 and again[0].num_cached_tokens > 0, engine.planner.num_preemptions
        engine.blocks.check()
        assert engine.blocks.is_all_free() and engine.num_active() == 0
        return [s for g in groups for s in g]

    seqs = run()
    share = agreement(ref, seqs)
    assert share >= FAMILY_AGREEMENT[kv_dtype], (arch, kv_dtype, runtime, share)
    assert [s.output_token_ids for s in run()] == [s.output_token_ids for s in seqs]
    assert seqs[-1].output_token_ids == seqs[-2].output_token_ids  # from the prefix cache, the same tokens


# Measured on this schedule (torch / native): Mistral int8 0.65 / 0.58, Gemma 2 fp16 1.0 / 1.0 and int8 0.89 / 1.0,
# Phi-3 bf16 1.0 / 0.8 (head_dim 16: int8's one scale covers few values, so it rounds coarsest here).
FAMILY_AGREEMENT = {"fp16": 0.9, "bf16": 0.7, "int8": 0.5}


@pytest.mark.model
@pytest.mark.parametrize("runtime", ["torch", "native"])
def test_kv_cache_mb_buys_more_tokens_with_a_narrower_dtype(pressure_model, runtime, caplog):
    """The same KV_CACHE_MB holds 2x the blocks at fp16 / bf16 and ~4x at int8 (its scales counted); the startup
    log and the engine (what /metrics reports) name the dtype."""
    blocks = {}
    for kv_dtype in ("fp32", "fp16", "bf16", "int8"):
        with caplog.at_level("INFO", logger="minibatch.engine"):
            engine = engine_for(pressure_model, runtime, kv_dtype, blocks=40, sized_for="fp32")
        blocks[kv_dtype] = engine.blocks.num_blocks
        assert engine.kv_cache_dtype == kv_dtype  # what /metrics' kv_cache_info reports (api/ops.py)
        assert engine.kv_pool_bytes <= pool_mb(pressure_model, 40, 4) * 2**20
        assert f"KV cache {kv_dtype}," in caplog.text
    assert blocks["fp32"] == 40 and blocks["fp16"] == blocks["bf16"] == 80
    head_dim = 16  # both test checkpoints' (make_test_model.py): int8 holds 16 bytes and a 4-byte scale per head
    assert blocks["int8"] == 40 * 4 * head_dim // (head_dim + 4) == 128


def test_the_server_reports_its_engines_dtype_on_metrics_and_health():
    """/metrics through the app: the engine's kv_cache_dtype as kv_cache_info's label ("none" for the fake, whose pool
    holds no K/V) and the pool's bytes; /health's engine stats stay integers."""
    from engine import FakeEngine

    class Int8Fake(FakeEngine):
        kv_cache_dtype, kv_pool_bytes = "int8", 4096

    async def body():
        for engine, dtype, nbytes in ((FakeEngine(capacity=2), "none", 0), (Int8Fake(capacity=2), "int8", 4096)):
            async with serving(engine) as c:
                text = (await c.get("/metrics")).text
                assert f'minibatch:kv_cache_info{{dtype="{dtype}"}} 1.0' in text
                assert f"minibatch:kv_cache_bytes {float(nbytes)}" in text
                health = await c.get("/health")
                assert health.status_code == 200 and all(isinstance(v, int) for v in health.json()["engine"].values())

    bounded(body)


def test_metrics_name_the_dtype():
    from api.metrics import ServerMetrics

    live = {"kv_cache_dtype": "int8", "kv_cache_bytes": 1234.0, "kv_cache_blocks": 3.0}
    text = ServerMetrics(lambda: live).render().decode()
    assert 'minibatch:kv_cache_info{dtype="int8"} 1.0' in text
    assert "minibatch:kv_cache_bytes 1234.0" in text


@pytest.mark.parametrize("value", ["auto", "fp32", "fp16", "bf16", "int8"])
def test_kv_cache_dtypes(value):
    assert Config.from_env({"KV_CACHE_DTYPE": value}).kv_cache_dtype == value


@pytest.mark.parametrize("value", ["fp8", "float16", "INT8", "q4_0"])
def test_an_unknown_kv_cache_dtype_names_the_variable_and_the_choices(value):
    with pytest.raises(ConfigError, match="KV_CACHE_DTYPE must be one of auto, fp32, fp16, bf16, int8"):
        Config.from_env({"KV_CACHE_DTYPE": value})


@pytest.mark.parametrize(
    "env, dtype",
    [
        ({"MODEL_ID": "dir"}, "fp32"),  # fp32 weights: the exact pool
        ({"MODEL_ID": "dir", "WEIGHTS": "fp32"}, "fp32"),
        ({"MODEL_ID": "m.gguf"}, "int8"),  # a GGUF at its own quantization
        ({"MODEL_ID": "m.gguf", "WEIGHTS": "fp32"}, "fp32"),
        ({"MODEL_ID": "dir", "WEIGHTS": "int8"}, "int8"),
        ({"MODEL_ID": "dir", "WEIGHTS": "int4"}, "int8"),
        ({"MODEL_ID": "m.gguf", "KV_CACHE_DTYPE": "fp16"}, "fp16"),  # an explicit choice stands
        ({"MODEL_ID": "dir", "KV_CACHE_DTYPE": "bf16"}, "bf16"),
    ],
)
def test_auto_is_fp32_beside_fp32_weights_and_int8_beside_quantized_ones(env, dtype, monkeypatch):
    """What a server picks (the tests' own engines run auto as fp32: conftest._exact_kv_pool)."""
    from models import runtime_config

    from conftest import SERVING_AUTO_KV

    monkeypatch.setattr(runtime_config, "AUTO_QUANTIZED_KV", SERVING_AUTO_KV["dtype"])
    assert SERVING_AUTO_KV["dtype"] == "int8"
    assert runtime_config.kv_cache_dtype(Config.from_env(env)) == dtype


def test_a_dtype_the_cpu_cannot_run_fails_at_startup_with_one_line(monkeypatch):
    """fp16 on a CPU without F16C: one line that says what to use instead (checked before the model loads)."""
    from models import kv_dtype, runtime_config
    from models.loading import ModelLoadError

    monkeypatch.setattr(kv_dtype, "cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(ModelLoadError, match="F16C") as err:
        runtime_config._check_kv_dtype(Config(kv_cache_dtype="fp16"))
    assert "\n" not in str(err.value)
    for ok in ("fp32", "bf16", "int8"):
        runtime_config._check_kv_dtype(Config(kv_cache_dtype=ok))


@pytest.mark.parametrize("dtype", ["fp32", *NARROW])
def test_the_torch_cache_is_a_view_of_the_one_numpy_pool(dtype):
    """On the CPU the torch forward's K/V tensors are the native runner's numpy pool (``models.kv_pool.KVPool``),
    not a copy: a torch write is in the pool's arrays, and a block copied in the pool is in the tensors."""
    torch = pytest.importorskip("torch")
    from models.kv_cache import PagedKVCache

    cache = PagedKVCache(2, 5, 4, 2, 8, torch.device("cpu"), dtype)
    pool = cache.pool
    assert pool.nbytes == cache.nbytes and len(pool.arrays()) == (4 if dtype == "int8" else 2)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache.write(1, torch.tensor([3, 3, 0]), torch.tensor([0, 1, 2]), k, v)
    written = [a[1, 3, :, :2].copy() for a in (pool.k, pool.v)]
    assert all(np.any(a != 0) for a in written) and not np.any(pool.k[0])
    cache.copy_block(3, 4)
    assert torch.equal(cache.k[:, 4], cache.k[:, 3]) and np.array_equal(pool.v[1, 4, :, :2], written[1])
    if dtype == "int8":
        assert np.array_equal(pool.k_scale[:, 4], pool.k_scale[:, 3]) and np.any(pool.k_scale[1, 4])
    with pytest.raises(ValueError, match="outside the pool"):
        cache.copy_block(0, 5)
