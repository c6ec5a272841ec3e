"""KV-cache bookkeeping: a pool of fixed-size blocks, one block table per sequence, and the prefix cache. No torch.

The engine owns the tensors (one preallocated pool of ``num_blocks`` blocks of ``block_size``
token slots, every layer); this module only decides which block ids each sequence holds.
Token ``i`` of a sequence lives in slot ``i % block_size`` of block ``table[i // block_size]``.

The API follows nano-vllm / vLLM:

- ``can_allocate(n, hashes)`` / ``allocate(seq_id, n, hashes)``: admission, a new sequence's first
  ``n`` tokens, its leading blocks taken from the prefix cache where ``hashes`` match.
  Admission keeps ``watermark`` blocks in reserve so the running sequences can still grow
  by a few blocks before anyone has to be preempted (vLLM's rule: admitting right up to the
  last block would preempt on the very next step).
- ``can_append(seq_id, n)`` / ``append_slots(seq_id, n)``: room for ``n`` more tokens of a
  running sequence (a decode step appends 1; the watermark does not apply, growth of what
  already runs takes priority over admission).
- ``cache_blocks(seq_id, hashes)``: the sequence's first ``len(hashes)`` blocks are full and
  computed; they enter the prefix cache under those hashes.
- ``free(seq_id)``: finish, abort or preemption; every block it held is released.
- ``release_before(seq_id, position)``: a model whose every layer has a sliding window never reads a position again
  once it has left the window; the sequence's blocks that hold only such positions go back to the pool early (the
  cached ones stay cached, evictable) and their table entries become ``RELEASED``.

Every block carries a reference count so blocks can be shared: a prefix-cache hit shares a cached
block (count + 1), and ``fork`` gives a second sequence the first one's full blocks. A block
returns to the free pool only when its count drops to zero.

**Prefix caching** (vLLM's automatic prefix caching). A full block is identified by its *chain hash*: ``hash(block
i) = BLAKE2b-128(hash(block i - 1) || token ids of block i as little-endian int64)``, with the empty string for
block -1 (``chain_hash``, ``extend_block_hashes``), or a LoRA adapter's seed (``lora_seed``): so a hash names the
block's tokens, everything before them and the adapter, which is all its K/V depend on (a prompt under two adapters
shares no block; under one adapter it shares as under the base). Any other input that would change a block's K/V
(multimodal inputs, another model) must be mixed into the hash the same way. A collision-resistant hash, because a
collision would hand one request's K/V to another. Only full, computed blocks are cached (``cache_blocks``); a
sequence's partial last block is always its own and never shared, so a shared block is never written. ``allocate``
shares the longest cached prefix, in whole blocks, of the hashes it is given (the caller leaves out the block
holding the last token, which must be computed to get its logits).

The free pool has two parts: blocks that hold nothing reusable (FIFO: a freed block goes to the
back, allocation takes from the front) and free blocks that are still cached (*evictable*, in LRU
order). Allocation takes a plain free block first and evicts the least recently freed cached block
only when none is left, so cached blocks live as long as the pool can afford. A sequence releases
its blocks last block first, so its early blocks (the prefix others share) are evicted last. Any
free block serves any sequence, so there is no fragmentation: ``num_free_blocks`` (both parts)
is exactly what can be allocated. ``is_all_free()`` is "no block referenced" (every block free or
free-and-cached): the pool is full again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full block of ``tokens`` whose preceding block hashed to ``parent`` (b"" for the first)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, seed: bytes = b""
) -> list[bytes]:
    """Append to ``hashes`` (the chain hashes of the first ``len(hashes)`` blocks of ``token_ids``) those of
    every further full block of ``token_ids``; returns ``hashes``. Tokens only ever append, so a
    sequence keeps its list and extends it as blocks fill. ``seed`` stands before the first block: what besides
    the tokens makes the K/V (``lora_seed``)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else seed, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def lora_seed(lora_id: int) -> bytes:
    """The chain's seed for a sequence of LoRA adapter ``lora_id`` (0, the base model: none): 16 bytes, like a parent
    hash, so a base chain's block could hash the same only if some parent hash equalled it (a BLAKE2b preimage)."""
    return b"lora\0\0\0\0" + lora_id.to_bytes(8, "little") if lora_id else b""


RELEASED = -1  # a table entry whose block went back to the pool: no position in it is read again (release_before)


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; the caller must wait or preempt first."""


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, watermark_blocks: int = 0, enable_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        if not 0 <= watermark_blocks < num_blocks:
            raise ValueError(f"watermark_blocks must be in [0, {num_blocks}), got {watermark_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # free, nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently freed first
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # chain hash -> the block holding it (in use or evictable)
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}  # token slots reserved per sequence
        self._num_hashed: dict[Hashable, int] = {}  # leading blocks of a table known full and computed
        self._hit_blocks: dict[Hashable, int] = {}  # blocks the sequence got from the cache at allocation
        self._first_live: dict[Hashable, int] = {}  # table entries before this one are RELEASED
        # Prefix-cache counters, in tokens (vLLM's queries/hits pair) and blocks.
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # --- queries ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held by a sequence or evictable."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (``kv_cache_usage_perc``); evictable cached blocks count as free."""
        return self.num_used_blocks / self.num_blocks

    def is_all_free(self) -> bool:
        """No block is referenced: every block is free or free-and-cached (the pool is full again)."""
        return not self._tables and self.num_free_blocks == self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block ids in token order (the manager's own list: do not modify)."""
        return self._tables[seq_id]

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots reserved for the sequence (its KV length once they are written)."""
        return self._num_tokens[seq_id]

    def num_hashed_blocks(self, seq_id: Hashable) -> int:
        """Leading blocks of the sequence that are in the prefix cache (hits, or registered by ``cache_blocks``)."""
        return self._num_hashed[seq_id]

    def cached_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose K/V the sequence got from the prefix cache at allocation (need not be computed)."""
        return self._hit_blocks[seq_id] * self.block_size

    def num_live_blocks(self, seq_id: Hashable) -> int:
        """Blocks the sequence holds now (its table less the entries ``release_before`` gave back)."""
        return sum(b != RELEASED for b in self._tables[seq_id])

    def holders(self, block: int) -> list[Hashable]:
        """The sequences whose tables hold ``block`` (a scan of every table: for checks in tests)."""
        return [seq_id for seq_id, table in self._tables.items() if block in table]

    def slot(self, seq_id: Hashable, position: int) -> tuple[int, int]:
        """(block id, offset in the block) of the sequence's token ``position``."""
        if not 0 <= position < self._num_tokens[seq_id]:
            raise IndexError(f"position {position} outside the {self._num_tokens[seq_id]} reserved slots")
        return self._tables[seq_id][position // self.block_size], position % self.block_size

    # --- prefix cache -----------------------------------------------------------------------------
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` in the cache (in use or evictable); a pure query."""
        blocks: list[int] = []
        if self.enable_caching:
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def is_cached(self, block_hash: bytes) -> bool:
        return self.enable_caching and block_hash in self._cached

    def cache_blocks(self, seq_id: Hashable, hashes: Sequence[bytes]) -> None:
        """The sequence's first ``len(hashes)`` blocks are full and computed, with these chain hashes: they
        enter the cache. A hash already cached in another block (two sequences computed the same prefix)
        keeps its block; this one stays uncached and returns to the plain free list when released."""
        if not self.enable_caching:
            return
        table, done = self._tables[seq_id], self._num_hashed[seq_id]
        if len(hashes) > len(table) or len(hashes) * self.block_size > self._num_tokens[seq_id]:
            raise ValueError(f"sequence {seq_id!r}: {len(hashes)} full blocks claimed, it holds {len(table)}")
        for i in range(done, len(hashes)):
            block, h = table[i], hashes[i]
            if block != RELEASED and h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h
        self._num_hashed[seq_id] = max(done, len(hashes))

    def reset_cache(self) -> int:
        """Drop every unreferenced cached block from the cache (they become plain free blocks); blocks a
        sequence holds stay cached. Returns how many were dropped."""
        dropped = len(self._evictable)
        for block in self._evictable:
            del self._cached[self._hash_of[block]]
            self._hash_of[block] = None
            self._free[block] = None
        self._evictable.clear()
        return dropped

    # --- admission --------------------------------------------------------------------------------
    def admission_cost(self, num_tokens: int, hashes: Sequence[bytes] = ()) -> int:
        """Free-pool blocks a new sequence of ``num_tokens`` tokens takes, given the hashes of its leading full
        blocks (the ones it may share): all its blocks but the leading cache hits that some sequence holds
        (an evictable hit comes out of the free pool, so it costs a block like a fresh one). Never less than
        ``allocate`` takes, whatever is allocated or evicted before it."""
        shared = 0
        for block in self.match(hashes[: (num_tokens - 1) // self.block_size if num_tokens else 0]):
            if self.ref_counts[block] == 0:
                break
            shared += 1
        return self.blocks_for(num_tokens) - shared

    def can_allocate(self, num_tokens: int, hashes: Sequence[bytes] = ()) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits and leaves the watermark free."""
        return self.admission_cost(num_tokens, hashes) + self.watermark_blocks <= self.num_free_blocks

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens fit in the whole pool (else the request can never run)."""
        return self.blocks_for(num_tokens) + self.watermark_blocks <= self.num_blocks

    def allocate(self, seq_id: Hashable, num_tokens: int, hashes: Sequence[bytes] = ()) -> list[int]:
        """Reserve slots for a new sequence's first ``num_tokens`` tokens; returns its block table.

        ``hashes``: chain hashes of its leading full blocks. The longest cached prefix of them, short of the
        block holding the last token (always computed, for its logits), is shared instead of allocated:
        ``cached_tokens(seq_id)`` says how many tokens need no computing.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        hits = self.match(hashes[: (num_tokens - 1) // self.block_size if num_tokens else 0])
        fresh = self.blocks_for(num_tokens) - len(hits)
        taken = fresh + sum(1 for b in hits if self.ref_counts[b] == 0)
        if taken + self.watermark_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"{taken} blocks + {self.watermark_blocks} watermark needed, {self.num_free_blocks} free"
            )
        for block in hits:  # first, so that taking fresh blocks cannot evict them
            self._share(block)
        self._tables[seq_id] = hits + [self._take() for _ in range(fresh)]
        self._num_tokens[seq_id] = num_tokens
        self._num_hashed[seq_id] = self._hit_blocks[seq_id] = len(hits)
        if self.enable_caching:
            self.queried_tokens += num_tokens
            self.hit_tokens += len(hits) * self.block_size
        return self._tables[seq_id]

    # --- growth -----------------------------------------------------------------------------------
    def blocks_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """New blocks the sequence needs to hold ``num_tokens`` more tokens."""
        have = len(self._tables[seq_id])
        return max(0, self.blocks_for(self._num_tokens[seq_id] + num_tokens) - have)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq_id, num_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> list[int]:
        """Reserve ``num_tokens`` more slots; returns the block ids newly added (often none).

        The sequence's last block must be its own (refcount 1) when a slot in it is reserved:
        a shared block is never written (``fork`` gives each sequence its own partial block, and only
        full blocks are ever cached).
        """
        table, used = self._tables[seq_id], self._num_tokens[seq_id]
        need = self.blocks_to_append(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"{need} blocks needed, {self.num_free_blocks} free")
        if used % self.block_size and self.ref_counts[table[-1]] != 1:
            raise RuntimeError(f"block {table[-1]} is shared; sequence {seq_id!r} cannot write into it")
        new = [self._take() for _ in range(need)]
        table.extend(new)
        self._num_tokens[seq_id] = used + num_tokens
        return new

    def append_lookahead(self, seq_id: Hashable, num_tokens: int) -> int:
        """Reserve up to ``num_tokens`` more slots for speculative draft tokens, from plain free blocks only (a
        lookahead never evicts a cached block); returns how many were reserved. ``rollback`` gives them back."""
        table, used = self._tables[seq_id], self._num_tokens[seq_id]
        room = (len(table) + len(self._free)) * self.block_size - used
        num_tokens = max(0, min(num_tokens, room))
        if num_tokens:
            self.append_slots(seq_id, num_tokens)
        return num_tokens

    def rollback(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shrink the sequence's reserved slots to ``num_tokens`` (rejected draft tokens' slots): the blocks past
        them go back to the front of the free list, last first, so that after rolling back this step's lookaheads
        in the reverse order they were taken the pool is exactly as if they had never been. They were taken
        fresh for the lookahead, so nothing else holds or caches them."""
        table = self._tables[seq_id]
        keep = self.blocks_for(num_tokens)
        if num_tokens > self._num_tokens[seq_id]:
            raise ValueError(f"sequence {seq_id!r}: cannot roll back to {num_tokens} of {self._num_tokens[seq_id]}")
        for block in reversed(table[keep:]):
            assert self.ref_counts[block] == 1 and self._hash_of[block] is None, f"block {block} is not a lookahead"
            self.ref_counts[block] = 0
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        del table[keep:]
        self._num_tokens[seq_id] = num_tokens

    # --- release and sharing ----------------------------------------------------------------------
    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's table; its blocks return to the pool once no one else holds them, the
        cached ones as evictable (still cached).

        Released last block first, so that a sequence's early blocks (its prompt, the part the prefix
        cache reuses most) are evicted last.
        """
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id], self._num_hashed[seq_id], self._hit_blocks[seq_id]
        self._first_live.pop(seq_id, None)
        for block in reversed(table):
            if block != RELEASED:
                self._release(block)

    def release_before(self, seq_id: Hashable, position: int) -> int:
        """The sequence's blocks holding only positions before ``position`` (none of them is read again: they left
        every layer's sliding window) go back to the pool, the cached ones as evictable (still cached), and their
        table entries become ``RELEASED``; the last block is always kept (it is being written). Returns how many
        blocks went back."""
        table = self._tables[seq_id]
        first, stop = self._first_live.get(seq_id, 0), min(max(0, position) // self.block_size, len(table) - 1)
        released = 0
        for i in range(first, stop):
            if table[i] != RELEASED:
                self._release(table[i])
                table[i] = RELEASED
                released += 1
        self._first_live[seq_id] = max(first, stop)
        return released

    def fork_cost(self, num_tokens: int) -> int:
        """Free-pool blocks ``fork`` takes from a parent holding ``num_tokens`` tokens: a copy of its partial
        last block, or nothing when they end on a block boundary."""
        return 1 if num_tokens % self.block_size else 0

    def fork(self, parent: Hashable, child: Hashable) -> tuple[int, int] | None:
        """Give ``child`` the parent's tokens: full blocks are shared (refcount + 1), a partial last
        block is replaced by a fresh one for the child.

        Returns ``(parent_block, child_block)`` when the engine must copy the partial block's
        contents, else None. Raises ``NoFreeBlocksError`` (and changes nothing) when no block is free.
        The parent's blocks need not be computed yet: the engine forks the choices of an ``n`` > 1 request at
        admission and copies the partial block once the parent has computed the prompt; until then the
        child reads nothing, and only the parent writes the shared blocks.
        """
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already holds blocks")
        table, used = self._tables[parent], self._num_tokens[parent]
        partial = used % self.block_size != 0
        if partial and not self.num_free_blocks:
            raise NoFreeBlocksError("no free block for the child's partial last block")
        shared = table[:-1] if partial else list(table)
        for block in shared:
            if block != RELEASED:
                self.ref_counts[block] += 1
        copy = None
        if partial:
            copy = (table[-1], self._take())
            shared.append(copy[1])
        self._tables[child] = shared
        self._first_live[child] = self._first_live.get(parent, 0)
        self._num_tokens[child] = used
        self._num_hashed[child] = min(self._num_hashed[parent], used // self.block_size)
        self._hit_blocks[child] = 0
        return copy

    def check(self) -> None:
        """Assert the bookkeeping is consistent (tests): every block is free xor referenced, each block's count
        equals the number of tables holding it, free blocks are cached exactly when evictable, and the cache
        maps each hash to the one block that carries it."""
        held = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                if block != RELEASED:
                    held[block] += 1
        assert not set(self._free) & set(self._evictable), "a block is free and evictable at once"
        for block in range(self.num_blocks):
            count, free = self.ref_counts[block], block in self._free or block in self._evictable
            assert held[block] == count, f"block {block}: count {count}, held {held[block]}"
            assert free == (count == 0), f"block {block}: free pool disagrees with its count"
            if free:
                assert (block in self._evictable) == (self._hash_of[block] is not None), f"block {block}: evictable"
        assert len(self._cached) == sum(h is not None for h in self._hash_of), "cache and block hashes differ"
        for h, block in self._cached.items():
            assert self._hash_of[block] == h, f"block {block}: cached under another hash"
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._num_tokens[seq_id]), f"sequence {seq_id!r}: table size"
            for block in table[: self._hit_blocks[seq_id]]:
                assert block == RELEASED or self.ref_counts[block] >= 1, f"sequence {seq_id!r}: hit {block} unheld"
            live = self._first_live.get(seq_id, 0)
            assert RELEASED not in table[live:], f"sequence {seq_id!r}: a released block after {live}"

    # --- internals --------------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for writing: a plain free one, else the least recently freed cached one (evicted)."""
        if self._free:
            block, _ = self._free.popitem(last=False)
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of[block]]
            self._hash_of[block] = None
            self.evictions += 1
        self.ref_counts[block] = 1
        return block

    def _share(self, block: int) -> None:
        """One more holder of a cached block (out of the evictable list if nobody held it)."""
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self._hash_of[block] is not None:
                self._evictable[block] = None
            else:
                self._free[block] = None
