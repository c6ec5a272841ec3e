"""Model gates, for every model family: continuous-batched greedy tokens equal each prompt's standalone HF generate.

Checkpoints are built by the tests (random weights, trained BPE tokenizer), saved, and loaded back
through ``from_pretrained(path)``, the path users hit: tiny GPT-2 (pad unset, and a pad id distinct
from EOS), tiny Llama (grouped-query attention, tied and untied lm_head), and a GPT-2 of distilgpt2's
shape (768 x 6, vocab 50257) so the kernels run at the widths the benchmark uses. The reference's
stop set is the checkpoint's own EOS (``Reference.eos``), never the engine's. For the default-EOS
gates each checkpoint's EOS is re-pointed at a token its greedy output really emits mid-way
(``conftest.repoint_eos``), so several sequences of a batch stop by EOS while others go on.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from conftest import (
    EOS_PROMPTS,
    PROMPTS,
    Reference,
    drive,
    expected,
    kernel_unavailable,
    make_engine,
    repoint_eos,
    run,
    seqs_for,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from config import Config  # noqa: E402
from core.sequence import Sequence  # noqa: E402
from models.hf_baseline import HFModelRunner  # noqa: E402
from models.loading import ModelLoadError  # noqa: E402
from models.runtime import HFEngine  # noqa: E402
from scheduler import Scheduler  # noqa: E402

pytestmark = pytest.mark.model

FAMILIES = ["gpt2-tiny", "gpt2-tiny-pad", "llama-tied", "llama-untied"]


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    if request.param == "gpt2-tiny":
        return request.getfixturevalue("tiny_model_dir")
    if request.param == "gpt2-tiny-pad":
        return request.getfixturevalue("tiny_pad_model_dir")
    tied = request.param == "llama-tied"
    return build_checkpoint(str(tmp_path_factory.mktemp(request.param)), arch="llama", seed=2, tied=tied)


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def eos_model_dir(model_dir, tmp_path_factory) -> str:
    """The same checkpoint with an EOS that its greedy outputs really emit."""
    out = str(tmp_path_factory.mktemp("eos"))
    repoint_eos(model_dir, out, EOS_PROMPTS)
    return out


def assert_some_stop_by_eos(seqs: list[Sequence], eos: set[int], at_least: int = 2) -> None:
    """At least ``at_least`` sequences ended on EOS before their budget, while another one outlived them."""
    stopped = [s for s in seqs if s.finish_reason == "stop" and s.output_token_ids[-1] in eos]
    assert len(stopped) >= at_least, [(s.finish_reason, s.output_token_ids) for s in seqs]
    assert all(len(s.output_token_ids) < s.max_new_tokens for s in stopped)
    assert any(s.finish_time > min(x.finish_time for x in stopped) for s in seqs)


def test_default_eos_parity(eos_model_dir):
    """The checkpoint's EOS ends several sequences mid-batch; the engine gets it from the checkpoint too."""
    reference = Reference(eos_model_dir)
    engine = make_engine(eos_model_dir, capacity=len(EOS_PROMPTS))
    seqs = seqs_for(reference, EOS_PROMPTS, [16] * len(EOS_PROMPTS))
    drive(engine, [(0, seqs)])
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, reference.eos), seq.prompt_token_ids
    assert_some_stop_by_eos(seqs, reference.eos)


def test_ragged_budgets_evict_at_different_steps(model_dir, reference):
    engine = make_engine(model_dir, capacity=6)
    seqs = seqs_for(reference, PROMPTS, [3, 17, 1, 9, 30, 5], ignore_eos=True)
    drive(engine, [(0, seqs)])
    for seq in seqs:
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == expected(reference, seq, set())
    assert engine.num_active() == 0


def test_stop_token_the_model_really_emits(model_dir, reference):
    """Pin a stop token taken from the middle of one prompt's real greedy output."""
    probe = reference.generate(reference.encode(PROMPTS[1]), 24, set())
    candidates = [t for i, t in enumerate(probe) if i >= 3 and t not in probe[:i]]
    assert candidates, f"greedy output too repetitive to pick a stop token: {probe}"
    stop = candidates[0]
    engine = make_engine(model_dir, capacity=4, stop_token_ids=(stop,))
    seqs = seqs_for(reference, PROMPTS[:4], [24, 24, 24, 24])
    drive(engine, [(0, seqs)])
    stops = reference.eos | {stop}
    assert seqs[1].output_token_ids[-1] == stop and seqs[1].finish_reason == "stop"
    assert len(seqs[1].output_token_ids) < 24
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, stops)


@pytest.mark.parametrize("fused", [True, False], ids=["admit_and_step", "admit-then-step"])
def test_mid_stream_join_short_request_leaves_first(model_dir, reference, fused):
    engine = make_engine(model_dir, capacity=4)
    longs = seqs_for(reference, PROMPTS[:3], [40, 40, 40], ignore_eos=True)
    short = seqs_for(reference, [PROMPTS[4]], [4], ignore_eos=True)
    drive(engine, [(0, longs), (7, short)], fused=fused)
    assert short[0].finish_time < min(s.finish_time for s in longs)
    for seq in longs + short:
        assert seq.output_token_ids == expected(reference, seq, set())


@pytest.mark.parametrize("small_gemm", [True, False], ids=["small-gemm", "onednn-only"])
def test_both_linear_kernels_across_the_small_batch_threshold(model_dir, reference, small_gemm):
    """20 ragged sequences, 6 more joining mid-run in mixed steps: the batch shrinks from 20
    through 16 (small_gemm.MAX_ROWS) to 1, so decode steps switch from oneDNN to the small-batch
    kernel mid-run (when it is on)."""
    engine = make_engine(model_dir, capacity=20, small_gemm=small_gemm)
    if small_gemm and not engine.model.small_gemm:
        from models.kernels import small_gemm as kernel

        kernel_unavailable("the small-batch kernel", kernel.KERNEL.unavailable_reason)
    budgets = [1 + (i * 7) % 23 for i in range(26)]
    seqs = seqs_for(reference, [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(26)], budgets, ignore_eos=True)
    drive(engine, [(0, seqs[:20]), (3, seqs[20:23]), (9, seqs[23:])])
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, set())


def test_prompts_from_one_token_to_hundreds(model_dir, reference):
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while batching tokens".split()
    long_prompt = " ".join(rng.choice(words) for _ in range(400))
    engine = make_engine(model_dir, capacity=3)
    seqs = seqs_for(reference, ["A", long_prompt, PROMPTS[1]], [12, 12, 12], ignore_eos=True)
    assert seqs[0].prompt_len == 1 and seqs[1].prompt_len >= 300
    drive(engine, [(0, seqs)])
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, set())


def test_first_token_finish_needs_no_decode_step(model_dir, reference):
    engine = make_engine(model_dir, capacity=2)
    seq = seqs_for(reference, [PROMPTS[0]], [1])[0]
    engine.admit([seq])
    assert seq.is_finished and seq.finish_reason in ("length", "stop")
    assert engine.num_active() == 0 and engine.stats()["steps"] == 0
    assert seq.output_token_ids == expected(reference, seq, reference.eos)


def test_scheduler_churn_matches_standalone(model_dir, reference):
    """Through the asyncio scheduler: many requests, capacity 3, staggered arrivals."""
    rng = random.Random(1)
    engine = make_engine(model_dir, capacity=3)
    seqs = [
        Sequence(
            prompt_token_ids=reference.encode(rng.choice(PROMPTS) + f" {i}"), max_new_tokens=rng.choice([1, 4, 9, 16])
        )
        for i in range(10)
    ]

    async def main():
        sched = Scheduler(engine, max_queue_depth=100)
        sched.start()
        futures = []
        for i, seq in enumerate(seqs):
            futures.append(sched.submit(seq))
            if i % 3 == 2:
                await asyncio.sleep(0.01)
        done = await asyncio.wait_for(asyncio.gather(*futures), timeout=120)
        await sched.stop()
        return done

    done = run(main())
    assert [d.seq_id for d in done] == [s.seq_id for s in seqs]
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, reference.eos)
    assert engine.num_active() == 0


def test_static_runner_parity(model_dir, reference):
    runner = HFModelRunner(model_dir, model=reference.model, tokenizer=reference.tokenizer)
    prompts = [reference.encode(p) for p in PROMPTS]
    budgets = [5, 12, 1, 20, 8, 16]
    outs = runner.run_batch(prompts, budgets, ignore_eos=True)
    for prompt, budget, out in zip(prompts, budgets, outs):
        assert len(out) == budget
        assert out == reference.generate(prompt, budget, set())


def test_unsupported_architecture_fails_at_startup(tmp_path):
    cfg = transformers.OPTConfig(
        vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2, word_embed_proj_dim=16
    )
    transformers.OPTForCausalLM(cfg).save_pretrained(tmp_path)
    from scripts.make_test_model import train_tokenizer

    train_tokenizer(300, with_pad=False).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'opt'"):
        make_engine(str(tmp_path))


# --- distilgpt2's shape: the kernels at the widths the benchmark uses ---------------------------------


@pytest.fixture(scope="module")
def distil_shaped_dir(tmp_path_factory) -> str:
    """A random GPT-2 of distilgpt2's shape (768 x 6, vocab 50257), initializer_range 0.1 (0.02 near-ties
    the logits), with its EOS re-pointed at a token its greedy outputs emit mid-way."""
    from scripts.make_test_model import build_checkpoint

    src = build_checkpoint(str(tmp_path_factory.mktemp("d2src")), shape="distilgpt2", initializer_range=0.1, seed=5)
    out = str(tmp_path_factory.mktemp("d2"))
    repoint_eos(src, out, EOS_PROMPTS, n_tokens=8, min_hits=2)
    return out


def test_distilgpt2_shape_parity(distil_shaped_dir):
    """18 sequences (17 rows: more than the small-batch kernel takes, so decode steps cross from oneDNN to
    it as they leave), ragged budgets, default EOS stopping some mid-batch, two joining mid-run in
    mixed steps. Few tokens each: the HF reference costs ~0.4 s a token at this size here."""
    reference = Reference(distil_shaped_dir)
    engine = make_engine(distil_shaped_dir, capacity=17)
    extra = [f"{p} {i}" for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    # The probed prompts get the budget their EOS was found within; the others 1-3 tokens.
    seqs = seqs_for(reference, EOS_PROMPTS + extra, [7] * len(EOS_PROMPTS) + [1 + i % 3 for i in range(len(extra))])
    drive(engine, [(0, seqs[:17]), (2, seqs[17:])])
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, reference.eos), seq.prompt_token_ids
    assert_some_stop_by_eos(seqs, reference.eos)


# --- configuration on a real model: MAX_MODEL_LEN, NUM_THREADS, the KV memory formula ----------------


@pytest.mark.parametrize("max_model_len, want", [(0, 1024), (48, 48), (5000, 1024)], ids=["0", "N", "beyond"])
def test_max_model_len_sizes_the_cache_and_bounds_admission(model_dir, reference, max_model_len, want):
    """0 = the model's context window (1024 here), N = N, beyond the window = the window. A sequence that
    fills the window exactly runs with parity; one token more is refused before it is queued."""
    from engine import AdmissionError

    engine = make_engine(model_dir, capacity=2, max_model_len=max_model_len)
    kv = engine.model.kv  # the default pool holds every slot at the full context, in whole blocks
    assert engine.max_context == want and kv.num_blocks == 2 * -(-want // kv.block_size)
    if want > 64:
        return
    prompt = (reference.encode(" ".join(PROMPTS)) * 8)[: want - 4]
    fits = Sequence(prompt_token_ids=prompt, max_new_tokens=4, ignore_eos=True)
    over = Sequence(prompt_token_ids=prompt, max_new_tokens=5, ignore_eos=True)
    assert engine.check_admissible(fits) is None and "context window of 48" in engine.check_admissible(over)
    with pytest.raises(AdmissionError):
        engine.admit([over])
    drive(engine, [(0, [fits])])
    assert fits.output_token_ids == expected(reference, fits, set()) and fits.num_tokens == want


def test_num_threads_zero_means_the_physical_cores(model_dir):
    from models.runtime_config import physical_cores

    before = torch.get_num_threads()
    try:
        HFEngine(Config(model_id=model_dir, max_batch_size=1, num_threads=0))
        assert torch.get_num_threads() == physical_cores()
        HFEngine(Config(model_id=model_dir, max_batch_size=1, num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_kv_memory_formula_in_the_readme(model_dir, reference):
    """Docs: a token costs 2 x layers x KV heads x head_dim x 4 bytes; the default pool is what
    MAX_BATCH_SIZE x MAX_MODEL_LEN tokens need, in whole KV_BLOCK_SIZE blocks; KV_CACHE_MB buys
    KV_CACHE_MB x 2^20 / (KV_BLOCK_SIZE x bytes per token) blocks."""
    cfg = reference.model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4
    engine = make_engine(model_dir, capacity=3, max_model_len=100)
    block = engine.model.kv.block_size
    assert engine.model.kv.nbytes == 3 * -(-100 // block) * block * per_token
    sized = HFEngine(Config(model_id=model_dir, max_batch_size=3, max_model_len=100, kv_cache_mb=1))
    assert sized.model.kv.num_blocks == 2**20 // (sized.model.kv.block_size * per_token)
