"""The planner's bookkeeping through FakeEngine and the synchronous driver: atomic admission, stepping, eviction,
compaction, abort, reset.

``ShadowEngine`` keeps a shadow "KV cache" (the token ids each sequence's blocks would hold) and checks on every
decode that each row's sequence holds exactly its prompt plus all its outputs but the newest, so a stale row fails
the test.
"""

from __future__ import annotations

import random

import pytest

from config import Config
from core.sequence import Sequence, SequenceStatus
from engine import AdmissionError, FakeEngine, RowFailure
from models.runtime import build_engine

from conftest import Boom

STOP = 999


def seq(prompt=(5, 6, 7), max_new: int = 4, **kw) -> Sequence:
    return Sequence(prompt_token_ids=list(prompt), max_new_tokens=max_new, **kw)


def letters(prompt_ids, n: int) -> list[int]:
    """FakeEngine's default tokens, computed independently of letter_token."""
    s = sum(prompt_ids)
    return [ord("a") + 1 + (s * 7 + i * 3) % 26 for i in range(n)]


def tagged_token(s: Sequence) -> int:
    """A token that names its sequence (prompt[0]) and its position; never EOS or STOP."""
    return 10_000 * s.prompt_token_ids[0] + len(s.output_token_ids) + 1


def tagged(prompt0: int, n: int) -> list[int]:
    return [10_000 * prompt0 + i + 1 for i in range(n)]


class ShadowEngine(FakeEngine):
    """Keeps a shadow "KV cache" per sequence (the token ids its blocks would hold) and checks at every decode that
    each row's sequence holds exactly its prompt plus all its outputs but the newest."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.kv: dict[int, list[int]] = {}

    def _prefill(self, seqs, first_row):
        assert first_row == len(self.planner.rows)
        tokens = super()._prefill(seqs, first_row)
        for s in seqs:
            self.kv[s.seq_id] = s.prompt_token_ids + s.output_token_ids
        return tokens

    def _decode(self, seqs):
        for r, s in enumerate(seqs):
            expected = s.prompt_token_ids + s.output_token_ids[:-1]
            assert self.kv[s.seq_id] == expected, f"row {r} holds stale state for seq {s.seq_id}"
        tokens = super()._decode(seqs)
        for s in seqs:
            self.kv[s.seq_id].append(s.last_token_id)
        return tokens

    def reset_state(self):
        super().reset_state()
        self.kv = {}


def engine(**kw) -> ShadowEngine:
    """A ShadowEngine that also checks the block tables (``check_kv``): with paged KV, compacting the rows only
    renumbers them, so what a wrong move would break is a sequence reading another's (or a freed) block."""
    kw.setdefault("capacity", 4)
    kw.setdefault("check_kv", True)
    return ShadowEngine(**kw)


def assert_rows_consistent(eng: FakeEngine) -> None:
    rows = eng.planner.rows
    assert len(rows) == eng.num_active() <= eng.capacity
    assert len({id(s) for s in rows}) == len(rows), "a sequence holds two rows"
    assert all(s.status is SequenceStatus.RUNNING for s in rows)
    assert eng.active_sequences() == rows


# --- admission ------------------------------------------------------------------------------------


def test_admit_gives_first_token_and_runs():
    eng = engine()
    s = seq(prompt=(3, 4), max_new=5)
    assert eng.admit([s]) == [s.seq_id]
    assert s.status is SequenceStatus.RUNNING
    assert s.output_token_ids == letters([3, 4], 1)
    assert s.admit_time is not None and s.first_token_time is not None
    assert s.admit_time <= s.first_token_time
    assert eng.num_active() == 1
    assert 0 in s.stop_token_ids  # the engine's EOS joined the sequence's stop set


def test_admit_empty_list_is_noop():
    eng = engine()
    assert eng.admit([]) == []
    assert eng.num_active() == 0


@pytest.mark.parametrize("capacity, already, newcomers", [(1, 0, 2), (4, 0, 5), (4, 3, 2), (4, 4, 1), (8, 5, 4)])
def test_admit_over_capacity_admits_nothing(capacity, already, newcomers):
    eng = engine(capacity=capacity)
    old = [seq(prompt=(i + 1,), max_new=50) for i in range(already)]
    eng.admit(old)
    before = [list(s.output_token_ids) for s in old]
    new = [seq(prompt=(100 + i,), max_new=50) for i in range(newcomers)]
    with pytest.raises(AdmissionError, match="capacity"):
        eng.admit(new)
    assert eng.num_active() == already
    assert eng.planner.rows == old
    assert [s.output_token_ids for s in old] == before
    assert all(s.status is SequenceStatus.WAITING and s.output_token_ids == [] for s in new)
    assert eng.stats()["generated_tokens"] == already


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_too_long_sequence_in_group_admits_nothing(bad_index):
    eng = engine(capacity=4, max_context=16)
    group = [seq(prompt=(i + 1,) * 4, max_new=4) for i in range(3)]
    group[bad_index] = seq(prompt=(9,) * 10, max_new=7)  # 17 > 16
    with pytest.raises(AdmissionError, match=rf"sequence {group[bad_index].seq_id}: .*context window of 16"):
        eng.admit(group)
    assert eng.num_active() == 0
    assert all(s.status is SequenceStatus.WAITING and not s.output_token_ids for s in group)
    assert eng.step() == []


def test_empty_prompt_in_group_admits_nothing():
    eng = engine()
    group = [seq(), seq(prompt=())]
    with pytest.raises(AdmissionError, match="empty"):
        eng.admit(group)
    assert eng.num_active() == 0


@pytest.mark.parametrize("already", [0, 2])
def test_admit_fault_admits_nothing(already):
    armed = {"on": False}

    def fault(seqs):
        if armed["on"]:
            raise Boom("prefill exploded")

    eng = engine(capacity=4, admit_fault=fault, token_fn=tagged_token)
    old = [seq(prompt=(i + 1,), max_new=10) for i in range(already)]
    eng.admit(old)
    armed["on"] = True
    new = [seq(prompt=(50 + i,), max_new=10) for i in range(2)]
    with pytest.raises(Boom):
        eng.admit(new)
    assert eng.num_active() == already
    assert all(s.status is SequenceStatus.WAITING and not s.output_token_ids for s in new)
    # The active batch is untouched and keeps decoding correctly.
    eng.step()
    for s in old:
        assert s.output_token_ids == tagged(s.prompt_token_ids[0], 2)
    # Once the fault clears, the same sequences can be admitted.
    armed["on"] = False
    eng.admit(new)
    assert eng.num_active() == already + 2
    assert_rows_consistent(eng)


# --- stepping and eviction -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 8])
def test_step_advances_each_sequence_exactly_one_token(n):
    eng = engine(capacity=8)
    seqs = [seq(prompt=(i + 1, 2 * i + 3), max_new=100) for i in range(n)]
    eng.admit(seqs)
    for k in range(1, 6):
        assert eng.step() == []
        for s in seqs:
            assert len(s.output_token_ids) == 1 + k
            assert s.output_token_ids == letters(s.prompt_token_ids, 1 + k)
    stats = eng.stats()
    assert {k: stats[k] for k in ("steps", "peak_batch", "generated_tokens")} == {
        "steps": 5,
        "peak_batch": n,
        "generated_tokens": 6 * n,
    }
    # 2 prompt + 6 output tokens each, one not yet fed: 7 slots -> 1 block of 32 per sequence.
    assert stats["kv_free_blocks"] == stats["kv_blocks"] - n and stats["num_preemptions"] == 0


def test_step_with_nothing_active():
    eng = engine()
    assert eng.step() == []
    assert eng.step_calls == 0
    assert eng.stats()["steps"] == 0


@pytest.mark.parametrize("max_new", [2, 3, 7])
def test_evicted_at_max_new_tokens(max_new):
    eng = engine()
    s = seq(max_new=max_new)
    keeper = seq(prompt=(1,), max_new=100)
    eng.admit([s, keeper])
    for _ in range(max_new - 2):
        assert eng.step() == []
        assert s.status is SequenceStatus.RUNNING
    assert eng.step() == [s]
    assert s.status is SequenceStatus.FINISHED_LENGTH
    assert s.finish_reason == "length"
    assert s.output_token_ids == letters(s.prompt_token_ids, max_new)
    assert s.finish_time is not None
    assert eng.planner.rows == [keeper]
    assert eng.step() == []  # reported once only
    assert len(s.output_token_ids) == max_new


@pytest.mark.parametrize("where", ["engine", "sequence"])
@pytest.mark.parametrize("stop_at", [1, 3])
def test_evicted_at_stop_token(where, stop_at):
    def token_fn(s):
        return STOP if len(s.output_token_ids) == stop_at else tagged_token(s)

    stops = (0, STOP) if where == "engine" else (0,)
    eng = engine(token_fn=token_fn, stop_token_ids=stops)
    s = seq(prompt=(4,), max_new=50, stop_token_ids=frozenset({STOP}) if where == "sequence" else frozenset())
    other = seq(prompt=(8,), max_new=50, stop_token_ids=frozenset())
    eng.admit([s, other])
    finished = []
    for _ in range(stop_at):
        finished += eng.step()
    assert s in finished
    assert s.status is SequenceStatus.FINISHED_STOPPED
    assert s.finish_reason == "stop"
    assert s.output_token_ids == tagged(4, stop_at) + [STOP]
    # The other sequence saw the same token only where the stop id is the engine's.
    assert (other in finished) is (where == "engine")


def test_ignore_eos_runs_to_length():
    eng = engine(token_fn=lambda s: STOP, stop_token_ids=(STOP,))
    s = seq(max_new=3, ignore_eos=True)
    eng.admit([s])
    eng.step()
    assert eng.step() == [s]
    assert s.status is SequenceStatus.FINISHED_LENGTH
    assert s.output_token_ids == [STOP] * 3


@pytest.mark.parametrize("how", ["length", "stop"])
def test_finishing_on_first_token_holds_no_slot(how):
    eng = engine(
        capacity=2, token_fn=lambda s: STOP if s.prompt_token_ids[0] == 1 else tagged_token(s), stop_token_ids=(STOP,)
    )
    if how == "length":
        quick = seq(prompt=(2,), max_new=1)
        status, first = SequenceStatus.FINISHED_LENGTH, tagged(2, 1)
    else:
        quick = seq(prompt=(1,), max_new=10)
        status, first = SequenceStatus.FINISHED_STOPPED, [STOP]
    assert eng.admit([quick]) == [quick.seq_id]
    assert quick.status is status
    assert quick.output_token_ids == first
    assert eng.num_active() == 0
    # Both slots are still free.
    a, b = seq(prompt=(3,), max_new=5), seq(prompt=(4,), max_new=5)
    eng.admit([a, b])
    assert eng.num_active() == 2
    assert eng.abort(quick.seq_id) is False


def test_first_token_finishers_in_a_group_are_compacted():
    eng = engine(capacity=6, token_fn=tagged_token)
    group = [seq(prompt=(i + 1,), max_new=1 if i in (0, 2, 3) else 6) for i in range(6)]
    eng.admit(group)
    survivors = [s for s in group if s.max_new_tokens == 6]
    assert sorted(eng.planner.rows, key=lambda s: s.seq_id) == survivors
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in group if s not in survivors)
    assert_rows_consistent(eng)
    while eng.num_active():
        eng.step()  # ShadowEngine checks every row's cached state
        assert_rows_consistent(eng)
    for s in survivors:
        assert s.output_token_ids == tagged(s.prompt_token_ids[0], 6)


# --- row compaction ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budgets",
    [
        [9, 2, 9],  # the middle row leaves
        [2, 9, 9, 9],  # the first row leaves
        [9, 9, 9, 2],  # the last row leaves (no move)
        [3, 9, 3, 9, 3],  # several holes in one step
        [9, 2, 2, 9, 9, 9],  # adjacent holes, movers from the tail
        [2, 3, 4, 5, 6, 7, 8, 9],
        [9, 8, 7, 6, 5, 4, 3, 2],
    ],
)
def test_compaction_keeps_survivors_tokens(budgets):
    eng = engine(capacity=len(budgets), token_fn=tagged_token)
    seqs = [seq(prompt=(i + 1,), max_new=b) for i, b in enumerate(budgets)]
    eng.admit(seqs)
    finished_at: dict[int, int] = {}
    step = 0
    while eng.num_active():
        step += 1
        for s in eng.step():
            assert s.seq_id not in finished_at
            finished_at[s.seq_id] = step
        assert_rows_consistent(eng)
        assert eng.planner.rows == [s for s in eng.planner.rows if not s.is_finished]
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.output_token_ids == tagged(s.prompt_token_ids[0], s.max_new_tokens)
        assert finished_at[s.seq_id] == s.max_new_tokens - 1


def test_compaction_moves_a_middle_row():
    eng = engine(capacity=3, token_fn=tagged_token)
    a, b, c = (seq(prompt=(i,), max_new=m) for i, m in ((1, 9), (2, 2), (3, 9)))
    eng.admit([a, b, c])
    assert eng.step() == [b]
    assert eng.planner.rows == [a, c]
    eng.step()
    assert c.output_token_ids == tagged(3, 3)


@pytest.mark.parametrize("fail_at", [0, 1, 3], ids=["on-its-first-token", "at-step-1", "at-step-3"])
def test_a_failing_row_finishes_alone_and_its_row_is_compacted(fail_at):
    """A RowFailure from the tensor work fails that sequence alone (FINISHED_ERROR, its stable reason);
    its batchmates take their tokens in the same call and go on, in compacted rows."""

    def token_fn(s: Sequence):
        if s.prompt_token_ids == [2] and len(s.output_token_ids) == fail_at:
            return RowFailure("row 2 failed")
        return tagged_token(s)

    eng = engine(capacity=4, token_fn=token_fn)
    a, b, c = (seq(prompt=(i,), max_new=6) for i in (1, 2, 3))
    eng.admit([a, b])
    assert b.is_finished == (fail_at == 0)  # failed at admission: it holds no row
    finished = eng.admit_and_step([c])
    while eng.num_active():
        finished += eng.step()
        assert_rows_consistent(eng)
    assert b.status is SequenceStatus.FINISHED_ERROR and b.error == "row 2 failed" and b.finish_reason == "error"
    assert b.output_token_ids == tagged(2, fail_at)
    for s, p in ((a, 1), (c, 3)):
        assert s.finish_reason == "length" and s.output_token_ids == tagged(p, 6)
    assert (b in finished) == (fail_at > 0)


def test_compaction_random_churn():
    rng = random.Random(1234)
    eng = engine(capacity=5, token_fn=tagged_token, max_context=64)
    pending = [seq(prompt=(i + 1,) * rng.randint(1, 4), max_new=rng.randint(1, 12)) for i in range(60)]
    queue = list(pending)
    while queue or eng.num_active():
        free = eng.capacity - eng.num_active()
        take = rng.randint(0, free)
        if take:
            eng.admit(queue[:take])
            del queue[:take]
        assert_rows_consistent(eng)
        if rng.random() < 0.1 and eng.num_active():
            victim = rng.choice(eng.planner.rows)
            assert eng.abort(victim.seq_id)
        eng.step()
        assert_rows_consistent(eng)
    for s in pending:
        assert s.is_finished
        n = len(s.output_token_ids)
        assert s.output_token_ids == tagged(s.prompt_token_ids[0], n)
        if s.status is SequenceStatus.FINISHED_LENGTH:
            assert n == s.max_new_tokens
        else:
            assert s.status is SequenceStatus.FINISHED_ABORTED and n < s.max_new_tokens


# --- abort, reset ------------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_abort_frees_the_slot(victim):
    eng = engine(capacity=3, token_fn=tagged_token)
    seqs = [seq(prompt=(i + 1,), max_new=20) for i in range(3)]
    eng.admit(seqs)
    eng.step()
    v = seqs[victim]
    assert eng.abort(v.seq_id) is True
    assert v.status is SequenceStatus.FINISHED_ABORTED
    assert v.finish_reason == "abort"
    assert eng.num_active() == 2 and v not in eng.planner.rows
    assert eng.abort(v.seq_id) is False  # already gone
    newcomer = seq(prompt=(7,), max_new=20)
    eng.admit([newcomer])  # the freed slot is usable
    for _ in range(3):
        eng.step()
    assert_rows_consistent(eng)
    assert len(v.output_token_ids) == 2
    for s in seqs:
        if s is not v:
            assert s.output_token_ids == tagged(s.prompt_token_ids[0], 5)
    assert newcomer.output_token_ids == tagged(7, 4)


def test_abort_unknown_id():
    eng = engine()
    eng.admit([seq()])
    assert eng.abort(-12345) is False
    assert eng.num_active() == 1


def test_reset_empties_and_stays_usable():
    eng = engine(capacity=3, token_fn=tagged_token)
    eng.admit([seq(prompt=(i + 1,), max_new=10) for i in range(3)])
    eng.step()
    eng.reset()
    assert eng.num_active() == 0
    assert eng.resets == 1
    assert eng.step() == []
    fresh = [seq(prompt=(i + 1,), max_new=3) for i in range(3)]
    eng.admit(fresh)  # full capacity again
    eng.step()
    assert eng.step() == fresh
    assert [s.output_token_ids for s in fresh] == [tagged(i + 1, 3) for i in range(3)]


# --- check_admissible ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, max_new, expected",
    [
        (0, 4, "prompt is empty after tokenization"),
        (10, 6, None),  # exactly the window
        (10, 7, "prompt (10 tokens) + max_new_tokens (7) exceeds the model's context window of 16 tokens"),
        (16, 1, "prompt (16 tokens) + max_new_tokens (1) exceeds the model's context window of 16 tokens"),
        (1, 15, None),
    ],
)
def test_check_admissible(prompt_len, max_new, expected):
    eng = engine(max_context=16)
    assert eng.check_admissible(seq(prompt=(3,) * prompt_len, max_new=max_new)) == expected


def test_sequence_filling_the_window_runs_to_the_end():
    eng = engine(capacity=1, max_context=12)
    s = seq(prompt=(3,) * 8, max_new=4)
    eng.admit([s])
    while eng.num_active():
        eng.step()
    assert s.num_tokens == 12
    assert s.status is SequenceStatus.FINISHED_LENGTH


# --- FakeEngine surface ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["hello", "", "héllo wörld", "日本語 😀", "\x00\n"])
def test_encode_decode_round_trip(text):
    eng = FakeEngine()
    ids = eng.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(1 <= t <= 256 for t in ids)
    assert eng.decode(ids) == text


def test_decode_skips_eos_and_out_of_range():
    eng = FakeEngine()
    assert eng.decode([0, ord("h") + 1, 0, ord("i") + 1, 5000]) == "hi"


def test_build_engine_fake():
    eng = build_engine(Config(model_id="fake", max_batch_size=3, stop_token_ids=(42,)))
    assert isinstance(eng, FakeEngine)
    assert eng.capacity == 3
    assert eng.stop_token_ids == frozenset({0, 42})
    assert eng.model_name == "fake"
