"""A draft model proposing the drafts (models/draft_model.py, SPECULATIVE_MODEL): tiny GPT-2 and Llama targets on
both runtimes, with a draft that is another random model of the same tokenizer (few drafts accepted) and with a
draft that is the target itself (every greedy draft accepted): the output is the output without drafts, token for
token, and the draft's own KV books end empty. Through the server: a request chooses the draft model by method or
by name; a name the server does not serve, and a draft model with another tokenizer at startup, are refused.
"""

from __future__ import annotations

import pytest
from test_families import engine_for
from test_speculative_model import assert_same, copies, seeded_requests, workload

from conftest import PROMPTS, RUNTIMES, assert_runtime, schedule_all

pytest.importorskip("torch")

from config import Config  # noqa: E402
from core.sequence import Sequence  # noqa: E402
from core.speculative import SpecParams  # noqa: E402
from core.step import BatchPlan  # noqa: E402
from models.draft_model import DraftModel  # noqa: E402
from models.loading import ModelLoadError  # noqa: E402

pytestmark = pytest.mark.model

DRAFT = SpecParams("draft_model", num_tokens=4)


@pytest.fixture(scope="session")
def other_gpt2(tmp_path_factory) -> str:
    """A tiny random GPT-2 with the test tokenizer (the draft of another model)."""
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("draft_gpt2")), shape="tiny", seed=7)


def drafting(target: str, draft: str, runtime: str, catch_up: int = 0, **kw):
    """An engine on ``target`` whose requests draft with ``draft`` (its own engine, KV pool and books) at any
    batch, every step (not adaptive), and the drafter."""
    engine = engine_for(target, runtime, blocks=30, **kw)
    assert_runtime(engine, runtime)
    drafter = DraftModel(engine_for(draft, runtime, blocks=200, **kw), draft, catch_up)
    engine.attach_drafter(drafter)
    engine.planner.speculative, engine.planner.spec_disable_batch_size = DRAFT, 0
    engine.planner.spec_adaptive = False
    return engine, drafter


def assert_draft_books_empty(engine, drafter: DraftModel) -> None:
    """At the next step's start the draft frees what the sequences that left held: nothing stays."""
    engine.execute(BatchPlan())
    assert drafter.num_sequences == 0 and drafter.blocks.is_all_free()
    drafter.blocks.check()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_greedy_output_with_a_draft_model_is_the_output_without(pressure_model, other_gpt2, runtime):
    """Joins, chunked prefill (8 tokens a step, the draft's catch-up over several steps too), prefix-cache hits,
    preemption (30 blocks of 4 tokens), n > 1, max_tokens mid-draft, logprobs: every token and logprob is the run's
    without drafts, with a draft that is another model (the Llama target's draft is a GPT-2: same tokenizer,
    another architecture) and with the target itself as its draft, whose every greedy draft is accepted."""
    kw = {"max_num_batched_tokens": 8}
    off_engine = engine_for(pressure_model, runtime, blocks=30, **kw)
    seqs = workload(off_engine)
    schedule_all(off_engine, seqs)
    assert off_engine.planner.num_preemptions > 0
    for draft, catch_up in ((other_gpt2, 8), (pressure_model, 0)):
        engine, drafter = drafting(pressure_model, draft, runtime, catch_up, **kw)
        on = copies(seqs)
        schedule_all(engine, on)
        assert_same(seqs, on)
        stats = engine.planner.spec
        assert stats.num_draft_tokens > 20, stats
        if draft == pressure_model:
            assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens / 2, stats
        assert engine.planner.num_preemptions > 0 and engine.blocks.is_all_free()
        assert engine.stats()["spec_draft_model_forwards"] > 0
        assert_draft_books_empty(engine, drafter)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_seeded_sampling_with_a_draft_model_keeps_its_tokens(tiny_model_dir, runtime):
    """Seeded sampled rows (penalties, top-k/top-p/min-p) get the very tokens they get without drafts: the draft
    proposes greedily, the target's own seeded draw at each position decides."""
    runs = []
    for spec in (False, True):
        if spec:
            engine, _ = drafting(tiny_model_dir, tiny_model_dir, runtime)
        else:
            engine = engine_for(tiny_model_dir, runtime, blocks=30)
        seqs = seeded_requests(engine)
        schedule_all(engine, seqs)
        runs.append(seqs)
        if spec:
            assert 0 < engine.planner.spec.num_accepted_tokens < engine.planner.spec.num_draft_tokens
    assert_same(*runs)


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_model_dir, tmp_path_factory):
    """At startup, naming both models: a draft whose vocabulary differs cannot draft for the target."""
    from models.runtime import build_engine
    from scripts.make_test_model import build_checkpoint

    other = build_checkpoint(
        str(tmp_path_factory.mktemp("other_vocab")), shape="tiny", seed=1, overrides={"vocab_size": 1100}
    )
    config = Config(model_id=tiny_model_dir, speculative_model=other, runtime="torch", max_batch_size=2)
    with pytest.raises(ModelLoadError, match="vocabulary") as err:
        build_engine(config)
    assert other in str(err.value) and tiny_model_dir in str(err.value)
    with pytest.raises(ModelLoadError, match="SPECULATIVE_MODEL .*does-not-exist"):
        build_engine(Config(model_id=tiny_model_dir, speculative_model="/does-not-exist", runtime="torch"))


def test_requests_choose_the_draft_model(tiny_model_dir, other_gpt2):
    """Through the server (SPECULATIVE_MODEL on a real engine): a request choosing method draft_model, or naming the
    served draft model, answers what it answers without drafts and the drafts are counted; a request naming
    another draft model gets a 400 naming it and the served one."""
    from models.runtime import build_engine

    from conftest import assert_error, metric, run, scrape, serving

    config = {"speculative_model": other_gpt2, "max_batch_size": 2, "num_threads": 1}
    engine = build_engine(Config(model_id=tiny_model_dir, runtime="torch", **config))
    assert engine.drafter is not None

    async def go():
        async with serving(engine, **config) as c:
            body = {"prompt": PROMPTS[0] * 2, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            plain = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            for spec in ({"method": "draft_model"}, {"draft_model": other_gpt2, "num_speculative_tokens": 3}):
                r = await c.post("/v1/completions", json={**body, "speculative": spec})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == plain
            assert metric(await scrape(c), "minibatch:spec_decode_num_draft_tokens_total") > 0
            health = await c.get("/health")  # the draft model's counters ride in the engine's stats
            assert health.status_code == 200 and health.json()["engine"]["spec_draft_model_forwards"] > 0
            r = await c.post("/v1/completions", json={**body, "speculative": {"draft_model": "tiny-draft"}})
            assert_error(r, 400, contains="tiny-draft")
            assert other_gpt2 in r.text
            r = await c.post("/v1/completions", json={**body, "speculative": {"method": "ngram", "draft_model": "x"}})
            assert_error(r, 400, contains="draft_model")

    run(go())


def test_a_truncated_gguf_drafts_for_its_original_on_the_native_runtime(tmp_path_factory, monkeypatch):
    """The realistic CPU case: a GGUF target on the native runtime, its draft the same file's first block
    (``scripts/truncate_gguf.py``: the tokenizer and every other field copied, ``block_count`` 1, the later blocks'
    tensors gone), loaded through SPECULATIVE_MODEL on the target's runtime kind: greedy answers as without
    drafts. (The model images are written in this process, as ``engine_for`` does, not in a child each.)"""
    import gguf
    from gguf_files import write_gguf

    from models import image
    from models.runtime import NativeEngine, build_engine
    from scripts.make_test_model import build_checkpoint
    from scripts.truncate_gguf import truncate

    from conftest import need_native

    need_native()
    monkeypatch.setattr(
        image, "_build_in_child", lambda source, weights, out, failure: image.write_image(source, weights, out)
    )
    root = tmp_path_factory.mktemp("truncated")
    hf = build_checkpoint(str(root / "hf"), arch="llama", seed=4)
    target = write_gguf(hf, str(root / "target.gguf"), lambda name, shape: "Q8_0")
    draft = truncate(target, str(root / "draft.gguf"), 1)
    before, after = gguf.GGUFReader(target), gguf.GGUFReader(draft)
    assert after.get_field("llama.block_count").contents() == 1 < before.get_field("llama.block_count").contents()
    assert {t.name for t in after.tensors} == {t.name for t in before.tensors if not t.name.startswith("blk.1.")}
    assert after.get_field("tokenizer.ggml.tokens").contents() == before.get_field("tokenizer.ggml.tokens").contents()
    config = Config(
        model_id=target,
        speculative_model=draft,
        speculative_method="draft_model",
        speculative_disable_by_batch_size=0,
        max_batch_size=2,
        num_threads=1,
        kv_cache_dtype="fp32",
    )
    engine = build_engine(config)
    assert isinstance(engine, NativeEngine) and isinstance(engine.drafter.engine, NativeEngine)
    runs = []
    for spec in (SpecParams("off"), None):  # None: the server's default, draft_model
        seqs = [
            Sequence(prompt_token_ids=engine.encode(p * 2), max_new_tokens=20, ignore_eos=True, speculation=spec)
            for p in PROMPTS[:3]
        ]
        schedule_all(engine, seqs)
        runs.append([s.output_token_ids for s in seqs])
    assert runs[0] == runs[1]
    assert engine.planner.spec.num_draft_tokens > 0
