"""The KV block manager (core/block_manager.py): tables, refcounts, exhaustion, reuse, watermark, no leaks."""

from __future__ import annotations

import random

import pytest

from core.block_manager import BlockManager, NoFreeBlocksError, chain_hash, extend_block_hashes


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


def test_fork_cost_is_the_partial_block_and_holders_name_every_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.fork_cost(n) for n in (1, 4, 8, 10)] == [1, 0, 0, 1]
    free = bm.num_free_blocks
    parent = list(bm.allocate("p", 10))
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert free - bm.num_free_blocks == bm.blocks_for(10) + 2 * bm.fork_cost(10)
    assert bm.holders(parent[0]) == ["p", "c1", "c2"] and bm.holders(parent[2]) == ["p"]
    bm.free("p")  # the parent leaves first: its children keep the shared blocks, its partial block goes
    assert bm.holders(parent[0]) == ["c1", "c2"] and bm.num_used_blocks == 4
    bm.free("c1")
    bm.free("c2")
    assert bm.is_all_free()
    bm.check()


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


# --- prefix cache ------------------------------------------------------------------------------------


def hashes(tokens, block_size=4):
    return extend_block_hashes([], list(tokens), block_size)


def computed(bm, seq_id, tokens, block_size=4):
    """The sequence's tokens are all computed: its full blocks enter the cache."""
    bm.cache_blocks(seq_id, hashes(tokens, block_size))


def test_hash_chain_names_a_block_and_everything_before_it():
    a = hashes(range(12))
    assert len(a) == 3 and len(set(a)) == 3
    assert a[0] == chain_hash(b"", [0, 1, 2, 3]) and a[1] == chain_hash(a[0], [4, 5, 6, 7])
    assert hashes([*range(8), 99, 9, 10, 11])[:2] == a[:2]  # same first two blocks, same hashes
    b = hashes([7, *range(1, 12)])  # first block differs: every later hash differs too, same tokens or not
    assert not set(a) & set(b)
    assert hashes(range(11)) == a[:2]  # a partial block has no hash
    grown = a[:1]
    assert extend_block_hashes(grown, list(range(12)), 4) is grown and grown == a  # extended in place
    assert chain_hash(b"", [1, 2]) != chain_hash(b"", [1 << 32 | 1, 2])  # ids are not truncated


def test_a_cached_prefix_is_shared_by_refcount_and_only_the_rest_allocated():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = list(bm.allocate("a", 10, hashes(prompt)))
    assert bm.cached_tokens("a") == 0
    computed(bm, "a", prompt)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 7
    b = bm.allocate("b", 11, hashes([*prompt, 42]))
    assert b[:2] == a[:2] and b[2] != a[2] and bm.cached_tokens("b") == 8
    assert [bm.ref_counts[x] for x in a] == [2, 2, 1] and bm.num_free_blocks == 6
    assert bm.queried_tokens == 21 and bm.hit_tokens == 8
    bm.check()
    bm.free("a")  # the shared blocks live on in b
    assert [bm.ref_counts[x] for x in b[:2]] == [1, 1] and not bm.is_all_free()
    bm.free("b")
    assert bm.is_all_free() and bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 2
    bm.check()


def test_the_block_of_the_last_token_is_never_a_hit():
    """A prompt entirely in the cache still computes its last token (its logits): with a length that is a
    multiple of the block size, its whole last block is allocated fresh, so nothing shared is written."""
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 8, hashes(range(8)))
    computed(bm, "a", range(8))
    table = bm.allocate("b", 8, hashes(range(8)))
    assert bm.cached_tokens("b") == 4 and table[0] == bm.block_table("a")[0]
    assert table[1] != bm.block_table("a")[1] and bm.ref_counts[table[1]] == 1
    bm.allocate("c", 9, hashes(range(9)))  # one token more: both full blocks are hits
    assert bm.cached_tokens("c") == 8
    bm.check()


def test_admission_counts_only_the_blocks_really_taken():
    bm = BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(16))  # 4 blocks
    bm.allocate("a", 16, hashes(prompt))
    computed(bm, "a", prompt)
    assert bm.num_free_blocks == 2
    # 17 tokens = 5 blocks, but the first 4 are held by a: only 1 is taken.
    assert bm.admission_cost(17, hashes(prompt)) == 1 and bm.can_allocate(17, hashes(prompt))
    assert not bm.can_allocate(17)  # without the hashes: 5 blocks
    bm.allocate("b", 17, hashes(prompt))
    assert bm.num_free_blocks == 1
    bm.free("a")
    bm.free("b")
    # Free but cached blocks cost a block each (they leave the free pool) and are still hits.
    assert bm.admission_cost(17, hashes(prompt)) == 5 and bm.num_free_blocks == 6
    bm.allocate("c", 17, hashes(prompt))
    assert bm.cached_tokens("c") == 16 and bm.num_free_blocks == 1
    bm.check()


def test_free_cached_blocks_are_evicted_lru_and_only_when_needed():
    bm = BlockManager(num_blocks=6, block_size=2)
    for name, start in (("x", 0), ("y", 100)):  # x freed first: its blocks are the least recently used
        toks = list(range(start, start + 4))
        bm.allocate(name, 4, hashes(toks, 2))
        computed(bm, name, toks, 2)
    bm.free("x")  # released last block first: x1, then x0
    bm.free("y")
    x, y = hashes(range(4), 2), hashes(range(100, 104), 2)
    assert bm.num_cached_blocks == 4 and bm.num_evictable_blocks == 4
    bm.allocate("p", 4)  # the 2 plain free blocks are taken before any cached one
    assert bm.evictions == 0 and len(bm.match(x)) == 2 and len(bm.match(y)) == 2
    bm.allocate("q", 2)  # now the least recently freed cached block goes: x's last block
    assert bm.evictions == 1 and len(bm.match(x)) == 1 and len(bm.match(y)) == 2
    bm.allocate("r", 4)  # then x's first, then y's last
    assert bm.evictions == 3 and bm.match(x) == [] and len(bm.match(y)) == 1
    bm.check()


def test_a_hit_refreshes_nothing_but_a_freed_block_goes_to_the_back():
    """LRU order is the order of release: a block shared again and released again is the most recent."""
    bm = BlockManager(num_blocks=4, block_size=2)
    for name, start in (("x", 0), ("y", 10)):
        toks = list(range(start, start + 2))
        bm.allocate(name, 3, hashes(toks, 2))
        computed(bm, name, toks, 2)
        bm.free(name)
    bm.allocate("x2", 3, hashes(range(2), 2))  # x's block is shared again...
    bm.free("x2")  # ...and released after y's: y's is now the least recently used
    bm.allocate("big", 6)  # 2 plain free + 1 eviction
    assert bm.evictions == 1 and bm.match(hashes(range(10, 12), 2)) == [] and len(bm.match(hashes(range(2), 2))) == 1
    bm.check()


def test_no_block_in_use_is_ever_evicted_or_freed():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4, hashes(range(4), 2))
    computed(bm, "a", range(4), 2)
    bm.allocate("b", 5, hashes(range(5), 2))  # shares both of a's blocks, takes 1
    held = set(bm.block_table("a"))
    bm.allocate("c", 2)  # the last free block
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("d", 1)  # nothing evictable: both cached blocks are referenced
    bm.free("a")
    assert held <= set(bm.block_table("b")) and all(bm.ref_counts[x] == 1 for x in held)
    assert bm.num_free_blocks == 0 and bm.evictions == 0
    bm.check()


def test_a_hash_computed_twice_keeps_its_first_block():
    """Two sequences that computed the same prefix (before either was cached): the cache keeps the first,
    the second's block stays plain and goes back to the plain free list."""
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 3)
    bm.allocate("b", 3)
    computed(bm, "a", range(3), 2)
    computed(bm, "b", range(3), 2)
    first = bm.block_table("a")[0]
    assert bm.match(hashes(range(2), 2)) == [first] and bm.num_cached_blocks == 1
    bm.free("b")
    bm.free("a")
    assert bm.num_evictable_blocks == 1 and bm.is_all_free()
    bm.check()


def test_reset_cache_drops_only_unreferenced_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    for name, start in (("keep", 0), ("gone", 50)):
        bm.allocate(name, 5, hashes(range(start, start + 5), 2))
        computed(bm, name, range(start, start + 5), 2)
    bm.free("gone")
    assert bm.reset_cache() == 2
    assert bm.match(hashes(range(50, 54), 2)) == [] and len(bm.match(hashes(range(4), 2))) == 2
    assert bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 0 and bm.num_free_blocks == 5
    bm.check()


def test_caching_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=False)
    bm.allocate("a", 5, hashes(range(5), 2))
    computed(bm, "a", range(5), 2)
    bm.allocate("b", 5, hashes(range(5), 2))
    assert bm.num_cached_blocks == 0 and bm.cached_tokens("b") == 0 and bm.queried_tokens == 0
    assert bm.admission_cost(5, hashes(range(5), 2)) == 3
    bm.check()


def test_random_workload_with_sharing_never_leaks():
    """Random admit (prompts from a few shared prefixes) / grow / cache / free / reset, invariants checked after
    every operation: no block referenced and free, counts equal holders, the pool full again at the end."""
    rng = random.Random(1)
    bm = BlockManager(num_blocks=30, block_size=3, watermark_blocks=1)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: dict[int, list[int]] = {}
    for op in range(3000):
        choice = rng.random()
        if choice < 0.3:
            toks = rng.choice(stems)[: rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 5))]
            hs = hashes(toks, 3)
            if bm.can_allocate(len(toks), hs):
                bm.allocate(op, len(toks), hs)
                live[op] = toks
        elif choice < 0.6 and live:
            seq = rng.choice(list(live))
            if bm.can_append(seq):
                bm.append_slots(seq)
                live[seq].append(rng.randrange(50))
        elif choice < 0.8 and live:
            seq = rng.choice(list(live))
            bm.cache_blocks(seq, hashes(live[seq][: rng.randint(0, len(live[seq]))], 3))
        elif choice < 0.82:
            bm.reset_cache()
        elif live:
            seq = rng.choice(list(live))
            bm.free(seq)
            del live[seq]
        bm.check()
    for seq in list(live):
        bm.free(seq)
    assert bm.is_all_free() and bm.usage == 0.0 and bm.hit_tokens > 0 and bm.evictions > 0
    bm.check()


# --- sliding windows: release_before ---------------------------------------------------------------------------


def test_release_before_gives_back_the_blocks_a_window_left():
    from core.block_manager import RELEASED

    bm = BlockManager(num_blocks=10, block_size=4)
    table = list(bm.allocate("a", 14))  # 4 blocks
    assert bm.release_before("a", 9) == 2  # positions 0-7 are out of the window: blocks 0 and 1
    assert bm.block_table("a")[:2] == [RELEASED, RELEASED] and bm.block_table("a")[2:] == table[2:]
    assert bm.num_live_blocks("a") == 2 and bm.num_free_blocks == 8
    assert bm.release_before("a", 9) == 0  # idempotent
    assert bm.release_before("a", 100) == 1  # never the last block
    bm.append_slots("a", 3)  # 17 tokens: a fifth block
    bm.check()
    bm.free("a")
    assert bm.is_all_free()
    bm.check()


def test_a_released_cached_block_stays_cached_and_a_fork_shares_only_live_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate("a", 13)
    hashes = [bytes([i]) * 16 for i in range(3)]
    bm.cache_blocks("a", hashes)
    first = bm.block_table("a")[0]
    bm.release_before("a", 5)  # block 0 goes back, still cached: another prompt with that prefix can take it
    assert bm.num_evictable_blocks == 1 and bm.match(hashes[:1]) == [first]
    bm.fork("a", "b")
    assert bm.block_table("b")[0] == bm.block_table("a")[0]  # RELEASED in both
    bm.check()
    bm.free("a")
    bm.free("b")
    assert bm.is_all_free()
    bm.check()
