"""The KV block manager (block_manager.py): tables, refcounts, exhaustion, reuse, watermark, no leaks."""

from __future__ import annotations

import random

import pytest

from block_manager import BlockManager, NoFreeBlocksError


def test_allocate_append_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate("a", 6)  # 6 tokens -> 2 blocks, the second half full
    assert len(table) == 2 and bm.num_free_blocks == 6 and bm.num_tokens("a") == 6
    assert bm.slot("a", 5) == (table[1], 1)
    assert bm.append_slots("a") == [] and bm.append_slots("a") == []  # slots 6, 7 are in block 2
    assert bm.num_tokens("a") == 8
    new = bm.append_slots("a")  # slot 8 opens block 3
    assert len(new) == 1 and bm.block_table("a") == [*table[:2], new[0]] and bm.slot("a", 8) == (new[0], 0)
    bm.check()
    bm.free("a")
    assert bm.num_free_blocks == 8 and "a" not in bm
    bm.check()


def test_append_many_slots_at_once_for_a_prefill_chunk():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 3)
    assert bm.blocks_to_append("a", 1) == 0 and bm.blocks_to_append("a", 2) == 1 and bm.blocks_to_append("a", 10) == 3
    assert len(bm.append_slots("a", 10)) == 3
    assert bm.num_tokens("a") == 13 and len(bm.block_table("a")) == 4
    bm.check()


def test_zero_token_allocation_holds_no_block_until_it_grows():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate("a", 0) == [] and bm.num_free_blocks == 2
    assert len(bm.append_slots("a", 1)) == 1
    bm.check()


def test_exhaustion_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 4)  # 2 blocks
    assert not bm.can_allocate(3) and bm.can_allocate(2)
    with pytest.raises(NoFreeBlocksError, match="2 blocks"):
        bm.allocate("b", 3)
    assert "b" not in bm and bm.num_free_blocks == 1
    bm.append_slots("a", 2)  # takes the last block
    assert not bm.can_append("a") and bm.blocks_to_append("a") == 1
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots("a")
    assert bm.num_tokens("a") == 6 and len(bm.block_table("a")) == 3
    bm.check()


def test_watermark_limits_admission_not_growth():
    bm = BlockManager(num_blocks=10, block_size=4, watermark_blocks=2)
    assert bm.can_allocate(32) and not bm.can_allocate(33)  # 8 blocks + 2 watermark = 10
    assert bm.can_ever_allocate(32) and not bm.can_ever_allocate(33)
    bm.allocate("a", 32)
    assert not bm.can_allocate(1)  # only the watermark is left
    assert bm.can_append("a", 8) and len(bm.append_slots("a", 8)) == 2  # running sequences may use it
    assert bm.num_free_blocks == 0
    bm.check()


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(4, 16, watermark_blocks=4)
    bm = BlockManager(4, 2)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("a", 1)
    with pytest.raises(IndexError):
        bm.slot("a", 1)


def test_freed_blocks_are_reused_without_fragmentation():
    """Interleaved sequences leave scattered holes; any free block serves any sequence, so one
    sequence can then take the whole pool."""
    bm = BlockManager(num_blocks=12, block_size=4)
    for i in range(6):
        bm.allocate(i, 8)  # 2 blocks each, interleaved by growth below
    for i in range(0, 6, 2):
        bm.free(i)
    assert bm.num_free_blocks == 6 and bm.can_allocate(24) and not bm.can_allocate(25)
    table = bm.allocate("big", 24)
    assert len(set(table)) == 6
    for i in range(1, 6, 2):
        bm.free(i)
    bm.free("big")
    assert bm.num_free_blocks == 12 and bm.can_allocate(48)
    bm.check()


def test_free_list_reuses_the_least_recently_freed_block_first():
    bm = BlockManager(num_blocks=4, block_size=1)
    bm.allocate("a", 2)  # blocks 0, 1
    bm.allocate("b", 2)  # blocks 2, 3
    bm.free("b")  # released last block first: 3, then 2
    bm.free("a")  # 1, then 0
    assert bm.allocate("c", 4) == [3, 2, 1, 0]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = list(bm.allocate("p", 10))  # blocks: full, full, partial (2 of 4)
    copy = bm.fork("p", "c")
    child = bm.block_table("c")
    assert child[:2] == parent[:2] and child[2] != parent[2] and copy == (parent[2], child[2])
    assert [bm.ref_counts[b] for b in parent] == [2, 2, 1] and bm.ref_counts[child[2]] == 1
    bm.append_slots("c", 2)  # writes into its own partial block
    bm.check()
    bm.free("p")  # shared blocks survive: the child still holds them
    assert bm.ref_counts[parent[0]] == 1 and bm.num_free_blocks == 8 - 3
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check()


def test_fork_at_a_block_boundary_shares_everything():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("p", 8)
    assert bm.fork("p", "c") is None and bm.num_free_blocks == 2
    new = bm.append_slots("c")  # the next token opens a block of its own
    assert len(new) == 1 and new[0] not in bm.block_table("p")
    bm.check()


def test_a_shared_block_is_never_written():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("p", 8)
    bm.fork("p", "c")
    bm.free("c")
    bm.allocate("x", 2)
    # Simulate a table whose partial last block is shared (a prefix cache must never build one).
    bm.ref_counts[bm.block_table("x")[-1]] += 1
    with pytest.raises(RuntimeError, match="shared"):
        bm.append_slots("x")


def test_fork_without_a_free_block_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("p", 6)
    with pytest.raises(NoFreeBlocksError):
        bm.fork("p", "c")
    assert "c" not in bm and bm.ref_counts == [1, 1]


def test_random_workload_never_leaks():
    """Random admit / grow / fork / free, with the invariants checked after every operation; the pool
    is full again at the end."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=3, watermark_blocks=2)
    live: list[int] = []
    for op in range(3000):
        choice = rng.random()
        if choice < 0.3:
            n = rng.randint(0, 20)
            if bm.can_allocate(n):
                bm.allocate(op, n)
                live.append(op)
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(op, n)
        elif choice < 0.7 and live:
            seq, n = rng.choice(live), rng.randint(1, 4)
            if bm.can_append(seq, n):
                bm.append_slots(seq, n)
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.append_slots(seq, n)
        elif choice < 0.8 and live:
            try:
                bm.fork(rng.choice(live), op)
                live.append(op)
            except NoFreeBlocksError:
                pass
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check()
        assert bm.num_used_blocks == sum(1 for c in bm.ref_counts if c)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0
    bm.check()
