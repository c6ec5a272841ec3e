"""KV-cache bookkeeping: a pool of fixed-size blocks, one block table per sequence. No torch.

The engine owns the tensors (one preallocated pool of ``num_blocks`` blocks of ``block_size``
token slots, every layer); this module only decides which block ids each sequence holds.
Token ``i`` of a sequence lives in slot ``i % block_size`` of block ``table[i // block_size]``.

The API follows nano-vllm / vLLM:

- ``can_allocate(n)`` / ``allocate(seq_id, n)``: admission, a new sequence's first ``n`` tokens.
  Admission keeps ``watermark`` blocks in reserve so the running sequences can still grow
  by a few blocks before anyone has to be preempted (vLLM's rule: admitting right up to the
  last block would preempt on the very next step).
- ``can_append(seq_id, n)`` / ``append_slots(seq_id, n)``: room for ``n`` more tokens of a
  running sequence (a decode step appends 1; the watermark does not apply, growth of what
  already runs takes priority over admission).
- ``free(seq_id)``: finish, abort or preemption; every block it held is released.

Every block carries a reference count so blocks can be shared: ``fork`` gives a second
sequence the first one's full blocks (``n > 1`` choices sharing a prompt), and prefix caching
can later map a hash chain of full blocks to block ids on top of the same counts. A block
returns to the free list only when its count drops to zero. The free list is a FIFO: a freed
block goes to the back and allocation takes from the front, so the most recently freed blocks
are reused last (the order a prefix cache wants for LRU eviction). Any free block serves any
sequence, so there is no fragmentation: ``num_free_blocks`` is exactly what can be allocated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; the caller must wait or preempt first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        if not 0 <= watermark_blocks < num_blocks:
            raise ValueError(f"watermark_blocks must be in [0, {num_blocks}), got {watermark_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}  # token slots reserved per sequence

    # --- queries ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

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

    def slot(self, seq_id: Hashable, position: int) -> tuple[int, int]:
        """(block id, offset in the block) of the sequence's token ``position``."""
        if not 0 <= position < self._num_tokens[seq_id]:
            raise IndexError(f"position {position} outside the {self._num_tokens[seq_id]} reserved slots")
        return self._tables[seq_id][position // self.block_size], position % self.block_size

    # --- admission --------------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits and leaves the watermark free."""
        return self.blocks_for(num_tokens) + self.watermark_blocks <= len(self._free)

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens fit in the whole pool (else the request can never run)."""
        return self.blocks_for(num_tokens) + self.watermark_blocks <= self.num_blocks

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Reserve slots for a new sequence's first ``num_tokens`` tokens; returns its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not self.can_allocate(num_tokens):
            raise NoFreeBlocksError(
                f"{self.blocks_for(num_tokens)} blocks + {self.watermark_blocks} watermark needed, "
                f"{len(self._free)} free"
            )
        self._tables[seq_id] = [self._take() for _ in range(self.blocks_for(num_tokens))]
        self._num_tokens[seq_id] = num_tokens
        return self._tables[seq_id]

    # --- growth -----------------------------------------------------------------------------------
    def blocks_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """New blocks the sequence needs to hold ``num_tokens`` more tokens."""
        have = len(self._tables[seq_id])
        return max(0, self.blocks_for(self._num_tokens[seq_id] + num_tokens) - have)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq_id, num_tokens) <= len(self._free)

    def append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> list[int]:
        """Reserve ``num_tokens`` more slots; returns the block ids newly added (often none).

        The sequence's last block must be its own (refcount 1) when a slot in it is reserved:
        a shared block is never written (``fork`` gives each sequence its own partial block).
        """
        table, used = self._tables[seq_id], self._num_tokens[seq_id]
        need = self.blocks_to_append(seq_id, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocksError(f"{need} blocks needed, {len(self._free)} free")
        if used % self.block_size and self.ref_counts[table[-1]] != 1:
            raise RuntimeError(f"block {table[-1]} is shared; sequence {seq_id!r} cannot write into it")
        new = [self._take() for _ in range(need)]
        table.extend(new)
        self._num_tokens[seq_id] = used + num_tokens
        return new

    # --- release and sharing ----------------------------------------------------------------------
    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's table; its blocks return to the pool once no one else holds them.

        Released last block first, so that a sequence's early blocks (its prompt, the part a
        prefix cache would reuse) stay in the pool longest.
        """
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id]
        for block in reversed(table):
            self._release(block)

    def fork(self, parent: Hashable, child: Hashable) -> tuple[int, int] | None:
        """Give ``child`` the parent's tokens: full blocks are shared (refcount + 1), a partial last
        block is replaced by a fresh one for the child.

        Returns ``(parent_block, child_block)`` when the engine must copy the partial block's
        contents, else None. Raises ``NoFreeBlocksError`` (and changes nothing) when no block is free.
        """
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already holds blocks")
        table, used = self._tables[parent], self._num_tokens[parent]
        partial = used % self.block_size != 0
        if partial and not self._free:
            raise NoFreeBlocksError("no free block for the child's partial last block")
        shared = table[:-1] if partial else list(table)
        for block in shared:
            self.ref_counts[block] += 1
        copy = None
        if partial:
            copy = (table[-1], self._take())
            shared.append(copy[1])
        self._tables[child] = shared
        self._num_tokens[child] = used
        return copy

    def check(self) -> None:
        """Assert the bookkeeping is consistent (tests): every block is free xor referenced, and
        each block's count equals the number of tables holding it."""
        held = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                held[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            count = self.ref_counts[block]
            assert held[block] == count, f"block {block}: count {count}, held {held[block]}"
            assert (block in free) == (held[block] == 0), f"block {block}: free list disagrees with its count"
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._num_tokens[seq_id]), f"sequence {seq_id!r}: table size"

    # --- internals --------------------------------------------------------------------------------
    def _take(self) -> int:
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
