"""The planner's prefix cache: every full block a sequence has computed is registered under its chain hash after the
forward that wrote it, and stays cached when the sequence ends, until the pool needs the block; a newcomer shares
the longest cached prefix of its tokens in whole blocks (short of the block holding its last token, whose logits it
needs), or waits for a block another sequence is computing right now. A sequence that still needs its prompt
logprobs skips the lookup: cached blocks have no logits. A part of ``core.planner.Planner``, whose books it reads."""

from __future__ import annotations

from core.block_manager import BlockManager, extend_block_hashes, lora_seed
from core.sequence import Sequence


class PrefixBooks:
    """Chain hashes, lookups and caching of computed blocks, on the planner's books (set up by
    ``Planner.__init__``)."""

    blocks: BlockManager
    _prefilling: list[Sequence]
    _computed: dict[int, int]
    kv_window: int

    def _block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chain hashes of the full blocks among the sequence's first ``num_tokens`` tokens (kept on the
        sequence and extended as its blocks fill)."""
        n, bs = num_tokens // self.blocks.block_size, self.blocks.block_size
        if len(seq.block_hashes) < n:
            tokens = (seq.prompt_token_ids + seq.output_token_ids)[: n * bs]
            extend_block_hashes(seq.block_hashes, tokens, bs, lora_seed(seq.lora_id))  # an adapter's K/V are its own
        return seq.block_hashes[:n]

    def _lookup(self, seq: Sequence) -> list[bytes]:
        """What a newcomer may find in the cache: its full blocks before the one holding its last token (that
        one is computed, for its logits); nothing when caching is off, it still needs prompt logprobs, or it is an
        embedding pooled over every position (a cached block has no hidden states)."""
        if not self.blocks.enable_caching or needs_prompt_logprobs(seq) or seq.pooling == "mean":
            return []
        return self._block_hashes(seq, seq.num_tokens - 1)

    def _waits_for_prefix(self, seq: Sequence, ahead: list[Sequence]) -> bool:
        """Whether the first block ``seq`` would have to compute is being computed by an admitted sequence still
        prefilling, or will be by one of ``ahead`` (admitted before it in the same step): then it waits one
        or a few steps and shares the block instead of computing it twice."""
        hashes = self._lookup(seq)
        hit = len(self.blocks.match(hashes))
        if hit == len(hashes):
            return False
        wanted = hashes[hit]
        for other in [*self._prefilling, *ahead]:
            if needs_prompt_logprobs(other) or not self.blocks.enable_caching:
                continue
            done = self._computed.get(other.seq_id, 0) // self.blocks.block_size
            if wanted in self._block_hashes(other, other.num_tokens)[done:]:
                return True
        return False

    def _allocate(self, seq: Sequence) -> int:
        """Blocks for all of a newcomer's tokens, its cached prefix shared; returns how many tokens are cached."""
        self.blocks.allocate(seq.seq_id, seq.num_tokens, self._lookup(seq))
        cached = self.blocks.cached_tokens(seq.seq_id)
        if seq.num_cached_tokens is None:  # the first admission: what the prompt found in the cache
            seq.num_cached_tokens = min(cached, seq.prompt_len)
        return cached

    def _cache_computed(self, seq: Sequence, computed: int) -> None:
        """The sequence's first ``computed`` tokens are in its blocks: its full blocks among them enter the cache;
        under a sliding window on every layer (``kv_window``), the blocks that left it go back to the pool (its
        next query, at position ``computed``, reads keys from ``computed - kv_window + 1`` on)."""
        bm = self.blocks
        if bm.enable_caching and computed // bm.block_size > bm.num_hashed_blocks(seq.seq_id):
            bm.cache_blocks(seq.seq_id, self._block_hashes(seq, computed))
        if self.kv_window and seq.seq_id in bm:
            bm.release_before(seq.seq_id, computed - self.kv_window + 1)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no sequence holds (``POST /admin/reset_prefix_cache``); returns how many."""
        return self.blocks.reset_cache()


def needs_prompt_logprobs(seq: Sequence) -> bool:
    """The sequence asked for prompt logprobs and does not have them all yet (a recomputed one may)."""
    return seq.prompt_logprobs_k is not None and len(seq.prompt_logprobs) < seq.prompt_len
