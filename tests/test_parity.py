"""Model gates: continuous-batched greedy tokens equal each prompt's standalone HF generate.

Checkpoints are built by the tests (tiny random GPT-2, trained BPE tokenizer), saved, and
loaded back through ``from_pretrained(path)``, the path users hit. When a real distilgpt2
sits in the local HF cache the same gates run on it too.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from conftest import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from config import Config  # noqa: E402
from engine import HFEngine  # noqa: E402
from model_runner import HFModelRunner, trim  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from sequence import Sequence  # noqa: E402

pytestmark = pytest.mark.model

PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "def fibonacci(n):\n    a, b = 0, 1\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman",
    "Numbers: 0 1 2 3 4 5",
]


def distilgpt2_local() -> str | None:
    """'distilgpt2' when it loads from the local HF cache without network, else None."""
    try:
        transformers.AutoConfig.from_pretrained("distilgpt2", local_files_only=True)
        return "distilgpt2"
    except Exception:
        return None


@pytest.fixture(scope="module", params=["tiny", "tiny_pad", "distilgpt2"])
def model_dir(request) -> str:
    if request.param == "distilgpt2":
        name = distilgpt2_local()
        if name is None:
            pytest.skip("distilgpt2 is not in the local Hugging Face cache (no hub access here)")
        return name
    return request.getfixturevalue(f"{request.param}_model_dir")


class Reference:
    """Standalone greedy generate, one prompt at a time: the ground truth."""

    def __init__(self, model_dir: str) -> None:
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, stops: set[int]) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(
            input_ids=ids,  # only input_ids and attention_mask: no token_type_ids
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stops) or None,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0,
        )
        return trim(out[0, len(prompt) :].tolist(), max_new_tokens, stops)


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


def make_engine(model_dir: str, capacity: int = 4, stop_token_ids: tuple[int, ...] = (), **config) -> HFEngine:
    return HFEngine(
        Config(model_id=model_dir, max_batch_size=capacity, stop_token_ids=stop_token_ids, num_threads=2, **config)
    )


def drive(engine: HFEngine, batches: list[tuple[int, list[Sequence]]], fused: bool = True) -> None:
    """Step the engine; admit each (step_no, seqs) group at that step (when capacity allows).

    fused: a group joining a running batch is prefilled in the decode step's forward
    (``admit_and_step``, as the scheduler does); else ``admit`` then ``step``.
    """
    pending = sorted(batches, key=lambda b: b[0])
    step = 0
    while pending or engine.num_active():
        joining = []
        while pending and pending[0][0] <= step and engine.num_active() + len(joining) + len(pending[0][1]) <= engine.capacity:
            joining += pending.pop(0)[1]
        if fused and joining and engine.num_active():
            engine.admit_and_step(joining)
        else:
            engine.admit(joining)
            engine.step()
        step += 1
        assert step < 10_000


def seqs_for(ref: Reference, prompts: list[str], budgets: list[int], **kw) -> list[Sequence]:
    return [Sequence(prompt_token_ids=ref.encode(p), max_new_tokens=n, **kw) for p, n in zip(prompts, budgets)]


def expected(ref: Reference, seq: Sequence, stops: set[int]) -> list[int]:
    return ref.generate(seq.prompt_token_ids, seq.max_new_tokens, stops)


def engine_stops(engine: HFEngine) -> set[int]:
    return set(engine.stop_token_ids)


def test_default_eos_parity(model_dir, reference):
    engine = make_engine(model_dir, capacity=4)
    seqs = seqs_for(reference, PROMPTS[:4], [24, 24, 24, 24])
    drive(engine, [(0, seqs)])
    for seq in seqs:
        assert seq.output_token_ids == expected(reference, seq, engine_stops(engine)), seq.prompt_token_ids


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
    stops = engine_stops(engine)
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

        pytest.skip(f"the small-batch kernel is unavailable here: {kernel.unavailable_reason}")
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
    assert seq.output_token_ids == expected(reference, seq, engine_stops(engine))


def test_scheduler_churn_matches_standalone(model_dir, reference):
    """Through the asyncio scheduler: many requests, capacity 3, staggered arrivals."""
    rng = random.Random(1)
    engine = make_engine(model_dir, capacity=3)
    seqs = [
        Sequence(prompt_token_ids=reference.encode(rng.choice(PROMPTS) + f" {i}"), max_new_tokens=rng.choice([1, 4, 9, 16]))
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
        assert seq.output_token_ids == expected(reference, seq, engine_stops(engine))
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
    from make_test_model import train_tokenizer

    train_tokenizer(300, with_pad=False).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'opt'"):
        make_engine(str(tmp_path))
