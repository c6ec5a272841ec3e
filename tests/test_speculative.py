"""Speculative decoding (core/speculative.py, the planner's drafts, the engines' verification): the n-gram
proposer, and output with drafts token for token the output without them, through the planner's loop, with the
block manager's books and the KV pool as they would be without drafts.

The fake-engine half here runs anywhere, fast; through the server (HTTP, config) is ``test_speculative_http.py``,
the model half (GPT-2 and Llama, both runtimes) ``test_speculative_model.py``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from core.sequence import Sequence, SequenceStatus, group_choices
from core.speculative import NgramIndex, SpecParams, cut_drafts, verify_run
from core.step import BatchPlan
from engine import FakeEngine, RowFailure

from conftest import schedule_all

NGRAM = SpecParams("ngram", num_tokens=4, lookup_min=2, lookup_max=3)
DRAFT = SpecParams("draft_model", num_tokens=4)


class CopyDrafter:
    """A stand-in for a draft model on the fake engine (the engine's ``Drafter`` seam): it fills the rows the planner
    reserved lookahead for with the prompt's cyclic repetition (what ``copy_token`` mostly says), or ``wrong``
    tokens; some rows get fewer drafts than reserved, some none."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong, self.reserved, self.filled = wrong, 0, 0

    def propose(self, plan) -> None:
        for i, k in enumerate(plan.draft_slots):
            seq = plan.decode[i]
            n, prompt = len(seq.output_token_ids), seq.prompt_token_ids
            take = k - (seq.seq_id + n) % 3 if k else 0  # k, k - 1 or k - 2 of them
            drafts = [300 if self.wrong else prompt[(n + j) % len(prompt)] for j in range(max(take, 0))]
            plan.drafts[i] = cut_drafts(seq, drafts)
            self.reserved += k
            self.filled += len(plan.drafts[i])

    def reset(self) -> None:
        pass

    def stats(self) -> dict:
        return {"reserved": self.reserved}


def with_drafter(eng: FakeEngine, drafter: CopyDrafter) -> FakeEngine:
    eng.attach_drafter(drafter)
    return eng


# --- the proposer ------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the suffix 1 2 3 (n = 3) occurred at 0; 2 3 (n = 2) later, at 6: the longest suffix wins
    assert index.propose(tokens, 3) == [4, 5, 9]
    tokens += [4, 5]
    assert index.propose(tokens, 2) == [9, 2]  # 3 4 5 occurred at 2: what followed it
    assert index.propose(tokens + [6, 6, 6], 4) == [6]  # 6 6 at the end: the earlier 6 6 overlaps, then the end
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []  # nothing occurred before
    assert NgramIndex(1, 1).propose([5], 4) == []


def test_ngram_index_extends_incrementally():
    """Indexing as tokens come gives what indexing all at once gives."""
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    growing = NgramIndex(1, 4)
    for n in range(1, len(tokens) + 1):
        assert growing.propose(tokens[:n], 5) == NgramIndex(1, 4).propose(tokens[:n], 5), n


def test_verify_run_stops_at_the_first_difference():
    assert verify_run([7], []) == [7]
    assert verify_run([1, 2, 3], [1, 2]) == [1, 2, 3]  # all accepted, then the bonus token
    assert verify_run([1, 5, 3], [1, 2]) == [1, 5]
    assert verify_run([4, 2, 3], [1, 2]) == [4]


@pytest.mark.parametrize(
    "kw",
    [{"method": "eagle"}, {"num_tokens": 0}, {"num_tokens": 17}, {"lookup_min": 0}, {"lookup_min": 3, "lookup_max": 2}],
)
def test_spec_params_are_validated(kw):
    with pytest.raises(ValueError):
        SpecParams(**{"method": "ngram", **kw})


# --- through the planner, on the fake engine ------------------------------------------------------------------
def copy_token(seq: Sequence) -> int:
    """The fake model of a copy task: it repeats its prompt cyclically (what prompt lookup predicts), except at
    positions its prompt picks, where it says something else (a draft is rejected there)."""
    n, prompt = len(seq.output_token_ids), seq.prompt_token_ids
    salt = sum(prompt) + n
    if salt % 7 == 0:
        return 100 + salt % 150
    return prompt[n % len(prompt)]


def workload(rng: random.Random, count: int, logprobs: bool = False) -> list[Sequence]:
    """Prompts of repeating phrases (some sharing a prefix), budgets from 1 to 40, some with a stop token from
    their phrase (it lands mid-draft), some choices of one prompt (n > 1)."""
    seqs, shared = [], [rng.randrange(2, 90) for _ in range(40)]
    while len(seqs) < count:
        phrase = [rng.randrange(2, 90) for _ in range(rng.randrange(3, 9))]
        prompt = (shared[: rng.choice([0, 0, 33, 40])] + phrase * rng.randrange(1, 5))[:120]
        stops = frozenset([phrase[rng.randrange(len(phrase))]]) if rng.random() < 0.3 else frozenset()
        n = rng.choice([1, 1, 1, 2, 3])
        group = [
            Sequence(
                prompt_token_ids=list(prompt),
                max_new_tokens=rng.randrange(1, 41),
                stop_token_ids=stops,
                logprobs=1 if logprobs else None,
            )
            for _ in range(n)
        ]
        if n > 1:
            for s in group[1:]:
                s.max_new_tokens = group[0].max_new_tokens
            group_choices(group)
        seqs += group
    return seqs


def fresh_copies(seqs: list[Sequence]) -> list[Sequence]:
    """The same requests, not run yet (and grouped as they were)."""
    out, groups = [], {}
    for s in seqs:
        c = Sequence(
            prompt_token_ids=list(s.prompt_token_ids),
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=s.stop_token_ids,
            logprobs=s.logprobs,
            speculation=s.speculation,
        )
        out.append(c)
        if s.group is not None:
            groups.setdefault(id(s.group), []).append(c)
    for group in groups.values():
        group_choices(group)
    return out


def checked_engine(**kw) -> FakeEngine:
    """A FakeEngine whose shadow KV pool checks every read (``check_kv``), and whose books are checked after every
    step: consistent, and no sequence holding a slot past its newest token (no lookahead survives a step)."""
    kw.setdefault("capacity", 4)
    kw.setdefault("token_fn", copy_token)
    eng = FakeEngine(check_kv=True, **kw)
    update = eng.planner.update_from_output

    def checked(plan, output, now=None):
        result = update(plan, output, now)
        bm = eng.blocks
        bm.check()
        for seq in eng.planner.rows:
            assert bm.num_tokens(seq.seq_id) == seq.num_tokens - 1, (seq.seq_id, bm.num_tokens(seq.seq_id))
            assert len(bm.block_table(seq.seq_id)) == bm.blocks_for(seq.num_tokens - 1)
        return result

    eng.planner.update_from_output = checked
    return eng


def run_both(seqs: list[Sequence], spec: SpecParams, **kw) -> tuple[FakeEngine, FakeEngine, list[Sequence]]:
    """``seqs`` without drafts, and copies of them with ``spec``, through the planner's loop on fresh engines."""
    off, on = checked_engine(**kw), checked_engine(speculative=spec, **kw)
    copies = fresh_copies(seqs)
    schedule_all(off, seqs)
    schedule_all(on, copies)
    return off, on, copies


def assert_same_output(a: list[Sequence], b: list[Sequence]) -> None:
    for x, y in zip(a, b):
        assert y.output_token_ids == x.output_token_ids, (x.prompt_token_ids, x.max_new_tokens)
        assert y.status is x.status
        assert len(y.output_token_ids) <= y.max_new_tokens
        if x.logprobs is not None:
            assert [lp.token_id for lp in y.output_logprobs] == y.output_token_ids


@pytest.mark.parametrize(
    "kw",
    [
        {},  # whole prompts, roomy pool
        {"max_num_batched_tokens": 24},  # chunked prefill beside verifying rows, drafts in the token budget
        {"num_blocks": 14, "block_size": 8, "max_num_batched_tokens": 32},  # pressure: preemption, evictions
        {"prefix_caching": False, "block_size": 4},
    ],
    ids=["whole", "chunked", "pressure", "nocache"],
)
def test_drafts_change_no_token(kw):
    """Joins (more requests than rows), stop tokens and max_tokens landing mid-draft, chunked prefill, prefix-cache
    hits, preemption, n > 1, logprobs: the same tokens, statuses and logprobs with n-gram drafts as without."""
    seqs = workload(random.Random(1), 40, logprobs=True)
    off, on, copies = run_both(seqs, NGRAM, **kw)
    assert_same_output(seqs, copies)
    stats = on.planner.spec
    assert stats.num_accepted_tokens > 50 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert on.planner.stats()["steps"] < off.planner.stats()["steps"], "drafts saved no step"
    assert on.planner.stats()["generated_tokens"] == off.planner.stats()["generated_tokens"]
    for eng in (off, on):
        assert eng.blocks.is_all_free() and not eng.num_active()
    if "num_blocks" not in kw:  # no eviction: the prefix cache holds the same blocks (only verified tokens)
        assert set(on.blocks._cached) == set(off.blocks._cached)
    else:
        assert on.planner.num_preemptions and off.planner.num_preemptions


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_num_batched_tokens": 24}, {"num_blocks": 14, "block_size": 8, "max_num_batched_tokens": 32}],
    ids=["whole", "chunked", "pressure"],
)
def test_drafts_the_engine_fills_change_no_token(kw):
    """A proposer run by the engine (a draft model's seam): the planner reserves the lookahead, the engine fills
    fewer drafts than reserved for some rows and none for others; the same tokens, statuses and logprobs as
    without drafts, the shadow KV pool checking every read, and the books back to full."""
    seqs = workload(random.Random(4), 40, logprobs=True)
    off, drafter = checked_engine(**kw), CopyDrafter()
    on = with_drafter(checked_engine(speculative=DRAFT, **kw), drafter)
    copies = fresh_copies(seqs)
    schedule_all(off, seqs)
    schedule_all(on, copies)
    assert_same_output(seqs, copies)
    stats = on.planner.spec
    assert 50 < stats.num_accepted_tokens < stats.num_draft_tokens == drafter.filled < drafter.reserved, stats
    assert on.stats()["reserved"] == drafter.reserved  # the drafter's stats join the engine's
    assert on.planner.stats()["generated_tokens"] == off.planner.stats()["generated_tokens"]
    assert on.blocks.is_all_free() and not on.num_active()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_rejected_drafts_leave_the_books_as_without_them(method):
    """A proposer whose every draft is wrong (prompt lookup's, or one the engine runs, filling fewer drafts than the
    planner reserved for some rows): each step's books (tables, reserved slots, the free list in its order, the
    prefix cache) are exactly those of the same step without drafts."""

    class Wrong:
        def propose(self, seq, params, k):
            return [300] * k  # never a token copy_token says

    def snapshots(eng, seqs):
        shots, update = [], eng.planner.update_from_output
        name = {s.seq_id: i for i, s in enumerate(seqs)}  # the runs' sequences have other ids

        def snap(plan, output, now=None):
            result = update(plan, output, now)
            bm = eng.blocks
            shots.append(
                (
                    {name[k]: list(v) for k, v in bm._tables.items()},
                    {name[k]: v for k, v in bm._num_tokens.items()},
                    list(bm._free),
                    list(bm._evictable),
                    dict(bm._cached),
                    [name[s.seq_id] for s in eng.planner.rows],
                )
            )
            return result

        eng.planner.update_from_output = snap
        schedule_all(eng, seqs)
        return shots

    seqs = workload(random.Random(2), 24)
    kw = {"num_blocks": 40, "block_size": 4}
    if method == "ngram":
        on = checked_engine(speculative=NGRAM, **kw)
        on.planner.proposers["ngram"] = Wrong()
    else:
        on = with_drafter(checked_engine(speculative=DRAFT, **kw), CopyDrafter(wrong=True))
    on.planner.spec_adaptive = False  # every row drafts all it may: the most rollbacks
    copies = fresh_copies(seqs)
    off_shots = snapshots(checked_engine(**kw), seqs)
    on_shots = snapshots(on, copies)
    assert_same_output(seqs, copies)
    assert on.planner.spec.num_draft_tokens > 50 and on.planner.spec.num_accepted_tokens == 0
    assert len(on_shots) == len(off_shots)
    for i, (a, b) in enumerate(zip(off_shots, on_shots)):
        assert a == b, f"step {i}"


def test_drafts_stay_within_the_token_budget_and_free_blocks():
    """The drafts of a step fit the token budget left by the decode rows and the prompt chunks."""
    eng = checked_engine(speculative=SpecParams("ngram", num_tokens=8, lookup_min=1, lookup_max=2))
    eng.planner.limits.max_num_batched_tokens = 10
    seqs = [Sequence(prompt_token_ids=[5, 6] * 10, max_new_tokens=30) for _ in range(4)]
    waiting = list(seqs)
    seen = 0
    while not all(s.is_finished for s in seqs):
        plan = eng.planner.schedule(waiting)
        waiting = [s for s in waiting if s not in plan.newcomers]
        chunked = sum(c.end - c.start for c in plan.chunks)
        assert not plan.drafts or len(plan.decode) + plan.num_draft_tokens + chunked <= 10
        seen += plan.num_draft_tokens
        eng.planner.update_from_output(plan, eng.execute(plan))
    assert seen


def test_drafts_never_take_a_step_across_the_row_limit():
    """Where the engine's arithmetic changes with the step's rows (say int8 activations from 8 rows under
    ACTIVATIONS=auto), drafts never take a step from below the limit to it: a token is rounded as without drafts."""
    from models.runtime_config import exact_row_limit

    assert exact_row_limit("auto", {"int4": 1, "fp32": 1}) in (0, 8)  # 0 where the integer path is AVX2's
    assert exact_row_limit("fp32", {"int4": 1}) == exact_row_limit("int8", {"int8": 1}) == 0
    assert exact_row_limit("auto", {"fp32": 1}) == 0
    eng = checked_engine(speculative=SpecParams("ngram", num_tokens=16, lookup_min=1, lookup_max=2))
    eng.planner.spec_row_limit, eng.planner.spec_adaptive = 8, False
    seqs = [Sequence(prompt_token_ids=[5, 6] * 20, max_new_tokens=40) for _ in range(2)]
    waiting, most = list(seqs), 0
    while not all(s.is_finished for s in seqs):
        plan = eng.planner.schedule(waiting)
        waiting = [s for s in waiting if s not in plan.newcomers]
        base = len(plan.decode) + sum(c.end - c.start for c in plan.chunks)
        if plan.drafts and base < 8:  # (a step of 8 rows or more without drafts is rounded so anyway)
            assert base + plan.num_draft_tokens < 8
            most = max(most, plan.num_draft_tokens)
        eng.planner.update_from_output(plan, eng.execute(plan))
    assert most == 5


def test_no_drafts_at_or_past_the_disable_batch_size():
    eng = checked_engine(speculative=NGRAM, capacity=4)
    eng.planner.spec_disable_batch_size = 3
    seqs = [Sequence(prompt_token_ids=[5, 6, 7] * 6, max_new_tokens=n) for n in (4, 6, 30, 30)]
    waiting = list(seqs)
    while not all(s.is_finished for s in seqs):
        plan = eng.planner.schedule(waiting)
        waiting = [s for s in waiting if s not in plan.newcomers]
        if len(plan.decode) >= 3:
            assert not plan.drafts
        eng.planner.update_from_output(plan, eng.execute(plan))
    assert eng.planner.spec.num_drafts  # the last two rows, alone, did draft


def test_the_step_cost_is_learned_by_rows_and_weighs_the_drafts():
    """StepCost: the linear model before any step; a row count's own mean once seen MIN_SEEN times; the nearest
    measured count, scaled by the model, for the others. A verify step that jumps in cost (5 rows: the kernels' row
    path ends at 4) makes the draft length stop below it, where the linear model would take it."""
    from core.speculative import DraftLength, StepCost

    cost = StepCost()
    assert cost.ratio(5, 1) == pytest.approx(1 + 4 * StepCost.ROW_COST)
    for rows, ms in ((1, 10), (2, 11), (3, 12), (4, 13), (5, 30)):
        for _ in range(StepCost.MIN_SEEN - 1):
            cost.observe(rows, ms / 1000)
    assert cost.ratio(5, 1) == pytest.approx(1 + 4 * StepCost.ROW_COST)  # not seen often enough yet
    for rows, ms in ((1, 10), (2, 11), (3, 12), (4, 13), (5, 30)):
        cost.observe(rows, ms / 1000)
    assert cost.samples(5) == StepCost.MIN_SEEN and cost.ratio(5, 1) == pytest.approx(3.0)
    row = StepCost.ROW_COST
    assert cost.ratio(7, 1) == pytest.approx(3.0 * (1 + 6 * row) / (1 + 4 * row))  # from 5, the nearest seen
    cost.observe(1, 0.0)  # an unmeasured step changes nothing
    assert cost.samples(1) == StepCost.MIN_SEEN
    likely = DraftLength()
    likely.successes, likely.trials = 9.0, 10.0  # acceptance 0.9
    assert likely.length(4, 1) == 4  # linear: the 4th draft is worth its row
    assert likely.length(4, 1, steps=cost) == 3  # measured: a 5-row step costs 3 one-row steps


def test_the_planner_learns_the_step_cost_from_decode_steps_only():
    eng = checked_engine(speculative=SpecParams("ngram", num_tokens=4, lookup_min=1, lookup_max=2), capacity=2)
    seqs = [Sequence(prompt_token_ids=[5, 6] * 20, max_new_tokens=30) for _ in range(2)]
    waiting, chunked, plain = list(seqs), set(), set()
    while not all(s.is_finished for s in seqs):
        plan = eng.planner.schedule(waiting)
        waiting = [s for s in waiting if s not in plan.newcomers]
        rows = len(plan.decode) + plan.num_draft_tokens
        (chunked if plan.chunks else plain).add(rows)
        eng.planner.update_from_output(plan, eng.execute(plan))
    seen = {rows for rows in range(1, 16) if eng.planner.step_cost.samples(rows)}
    assert seen == plain - {0} and seen  # every decode-only step counted, under its rows with drafts
    chunk_only = chunked - plain
    assert not seen & chunk_only


def test_the_draft_length_follows_the_acceptance():
    """Adaptive speculation: drafts that keep being accepted grow to NUM_SPECULATIVE_TOKENS; drafts that keep being
    rejected stop (with a probe now and then), and they stop sooner in a busier batch."""
    from core.speculative import DraftLength

    good = DraftLength()
    for _ in range(10):
        k = good.length(8, 1)
        good.update(k, k)
    assert good.length(8, 1) == 8 and good.length(8, 8) >= 4
    bad = DraftLength()
    lengths = []
    for _ in range(60):
        k = bad.length(8, 1)
        lengths.append(k)
        if k:
            bad.update(k, 0)
    assert lengths[0] >= 2 and lengths[-30:].count(0) >= 18 and any(lengths[10:]), lengths  # stopped, probed again
    assert DraftLength().length(8, 8) < DraftLength().length(8, 1)

    class Wrong:
        def propose(self, seq, params, k):
            return [300] * k

    seqs = workload(random.Random(3), 12)
    wasted = {}
    for adaptive in (False, True):
        eng = checked_engine(speculative=NGRAM)
        eng.planner.proposers["ngram"] = Wrong()
        eng.planner.spec_adaptive = adaptive
        copies = fresh_copies(seqs)
        schedule_all(eng, copies)
        wasted[adaptive] = eng.planner.spec.num_draft_tokens
    assert wasted[True] < wasted[False] / 3, wasted


class ShadowDraftEngine:
    """A stand-in for the draft model's engine (what ``DraftModel`` uses of a ``ModelEngine``: its runner's
    ``forward_rows``, the planner's pool geometry, ``max_context``), numpy only, and its own runner (``model``): its
    greedy choice after token t is ``succ(t)`` but at every 5th token (a wrong draft there), and it keeps a shadow
    KV pool (each slot: the token fed there), so a test can check what the draft's K/V hold. ``fail`` makes the
    next forward raise."""

    VOCAB = 257

    def __init__(self, num_blocks: int, block_size: int = 4, max_context: int = 1024) -> None:
        self.planner = FakeEngine(num_blocks=num_blocks, block_size=block_size).planner
        self.max_context, self.block_size = max_context, block_size
        self.slots: dict[int, list] = {}
        self.fail = False
        self.model = self

    def forward_rows(self, token_ids, positions, tables, prompts=(), prompt_tables=(), starts=()):
        if self.fail:
            self.fail = False
            raise RuntimeError("draft forward failed")
        last = []
        rows = [([t], p, tb) for t, p, tb in zip(token_ids, positions, tables)]
        rows += [(list(chunk), start, tb) for chunk, start, tb in zip(prompts, starts, prompt_tables)]
        for tokens, start, table in rows:
            for j, token in enumerate(tokens):
                pos = start + j
                block = table[pos // self.block_size]
                self.slots.setdefault(block, [None] * self.block_size)[pos % self.block_size] = token
            last.append(tokens[-1])
        logits = np.zeros((len(last), self.VOCAB), np.float32)
        for i, t in enumerate(last):
            logits[i, succ_token(t) if t % 5 else 3] = 1.0
        return logits

    def holds(self, table: list[int], n: int) -> list:
        """The tokens at positions [0, n) of ``table``."""
        bs = self.block_size
        return [self.slots.get(table[p // bs], [None] * bs)[p % bs] for p in range(n)]


def succ_token(t: int) -> int:
    return t % 250 + 1


def test_a_draft_model_keeps_its_own_books(caplog):
    """``DraftModel`` on a numpy stand-in, beside a fake target that says succ(t) after t: the same tokens as
    without drafts, drafts accepted and rejected; after every step each sequence's draft K/V hold its own tokens up to
    where the draft model thinks they are valid, and its draft blocks cover no more than that step needed; a row the
    draft pool cannot hold, or whose draft forward fails, decodes without drafts; sequences that finished, were
    aborted or preempted hold no draft block once the next step starts. Every third step has no room for drafts, so
    a row's next drafting step finds the tokens accepted, rejected and decoded since its last one."""
    from models.draft_model import DraftModel

    def target(seq):
        return succ_token(seq.last_token_id)

    seqs = [Sequence(prompt_token_ids=[7 + i, 9, 11 + i] * (2 + i % 3), max_new_tokens=10 + 3 * i) for i in range(10)]
    off = checked_engine(token_fn=target, num_blocks=16, block_size=4, max_num_batched_tokens=10)
    schedule_all(off, seqs)
    shadow = ShadowDraftEngine(num_blocks=12)  # 48 slots for 4 rows: some rows find no room now and then
    drafter = DraftModel(shadow, "shadow", catch_up_tokens=12)
    on = with_drafter(
        checked_engine(token_fn=target, num_blocks=16, block_size=4, max_num_batched_tokens=10, speculative=DRAFT),
        drafter,
    )
    on.planner.spec_disable_batch_size, on.planner.spec_adaptive = 0, False
    propose = drafter.propose
    served = []

    def checked(plan):
        propose(plan)
        for seq_id, fed in drafter._fed.items():
            table = drafter.blocks.block_table(seq_id)
            valid = min(fed.valid(), fed.seq.num_tokens)
            assert shadow.holds(table, valid) == (fed.seq.prompt_token_ids + fed.seq.output_token_ids)[:valid]
        for seq, k in zip(plan.decode, plan.draft_slots):  # a row served now holds what this step feeds, no more
            if k and seq.seq_id in drafter.blocks:
                assert drafter.blocks.num_tokens(seq.seq_id) <= seq.num_tokens - 1 + k
        served.append(sum(1 for d in plan.drafts if d))
        if len(served) == 6:
            shadow.fail = True  # the next step's draft forward fails: its rows decode without drafts

    drafter.propose = checked
    copies = fresh_copies(seqs)
    aborted = copies[-1]
    waiting, steps = list(copies), 0
    while not all(s.is_finished for s in copies):
        on.planner.limits.max_num_batched_tokens = 10 if steps % 3 else 5  # every third step, no room for drafts
        plan = on.planner.schedule(waiting)
        waiting = plan.preempted + [s for s in waiting if s not in plan.newcomers]
        on.planner.update_from_output(plan, on.execute(plan))
        steps += 1
        if steps == 8 and not aborted.is_finished:
            on.abort(aborted.seq_id)
    assert_same_output(seqs[:-1], copies[:-1])
    stats = on.planner.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert on.planner.num_preemptions and drafter.stats()["spec_draft_model_forwards"]
    assert served[6] == 0 and "the draft model shadow failed" in caplog.text  # that step drafted nothing
    assert drafter.stats()["spec_draft_model_unserved_rows"] > 0
    assert on.planner.proposers["draft_model"].cost > 0  # the engine measured what a draft costs
    on.execute(BatchPlan())  # the next step frees what the sequences that left held
    assert drafter.num_sequences == 0 and drafter.blocks.is_all_free()
    drafter.blocks.check()


def test_a_draft_that_costs_a_step_must_nearly_always_be_accepted():
    """A draft model's drafts cost a forward each (``EngineProposer.cost``, a share of the target's step, measured
    by the engine and fading between measurements): the draft length's bar rises by it. A draft as slow as the
    target gains nothing even when always right; a cheap one drafts as prompt lookup would."""
    from core.speculative import DraftLength, EngineProposer

    always = DraftLength()
    for _ in range(20):
        always.update(4, 4)
    assert always.length(8, 1, cost=0.0) == 8 and always.length(8, 1, cost=0.5) == 8
    assert always.length(8, 1, cost=1.0) == 0  # as slow as the target: never worth it
    sometimes = DraftLength()  # acceptance 0.6: 0.6, 0.36, 0.22... against 0.2, 0.27, 0.28 (+ cost: 0.47, 0.51)
    assert sometimes.length(8, 1, cost=0.0) == 2 and sometimes.length(8, 1, cost=0.27) == 1
    proposer = EngineProposer()
    for _ in range(30):
        proposer.observe(0.009, 0.010)
    assert 0.85 < proposer.cost < 0.91
    for _ in range(35):
        proposer.decay()
    assert proposer.cost < 0.5  # tried again after a while


def test_a_request_chooses_its_own_speculation():
    """A sequence's SpecParams win over the server's default, either way."""
    seqs = [Sequence(prompt_token_ids=[5, 6, 7] * 6, max_new_tokens=12, speculation=NGRAM)]
    eng = checked_engine()
    schedule_all(eng, seqs)
    assert eng.planner.spec.num_drafts
    off = Sequence(prompt_token_ids=[5, 6, 7] * 6, max_new_tokens=12, speculation=SpecParams("off"))
    eng = checked_engine(speculative=NGRAM)
    schedule_all(eng, [off])
    assert not eng.planner.spec.num_drafts
    assert off.output_token_ids == seqs[0].output_token_ids


def test_a_failed_step_gives_the_lookahead_back():
    """The engine raises on a step with drafts: the rows keep only their next token's slot, as without drafts."""
    failing = []

    def fault(step_no):
        if failing:
            raise RuntimeError("boom")

    class Always:
        def propose(self, seq, params, k):
            return seq.prompt_token_ids[:k]

    eng = checked_engine(speculative=NGRAM, step_fault=fault)
    eng.planner.proposers["ngram"] = Always()
    eng.planner.spec_adaptive = False
    seqs = [Sequence(prompt_token_ids=[5, 6, 7] * 6, max_new_tokens=20) for _ in range(2)]
    eng.run_step(seqs, decode=False)
    eng.run_step()
    plan = eng.planner.schedule([])
    assert plan.num_draft_tokens == 8
    failing.append(True)
    with pytest.raises(RuntimeError):
        eng.execute(plan)
    failing.clear()
    eng.planner.abandon(plan)
    for s in seqs:
        assert eng.blocks.num_tokens(s.seq_id) == s.num_tokens
    eng.blocks.check()
    while eng.num_active():
        eng.step()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)


def test_a_row_failing_while_it_verifies_fails_alone():
    def fn(seq):
        if seq.prompt_token_ids[0] == 9 and len(seq.output_token_ids) == 5:
            return RowFailure("bad row")
        return copy_token(seq)

    eng = checked_engine(speculative=NGRAM, token_fn=fn)
    bad = Sequence(prompt_token_ids=[9, 6, 7] * 6, max_new_tokens=20)
    good = Sequence(prompt_token_ids=[5, 6, 7] * 6, max_new_tokens=20)
    schedule_all(eng, [bad, good])
    assert bad.status is SequenceStatus.FINISHED_ERROR and len(bad.output_token_ids) <= 5
    assert good.status is SequenceStatus.FINISHED_LENGTH and len(good.output_token_ids) == 20
    assert eng.blocks.is_all_free()
