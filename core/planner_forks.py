"""The planner's placing of newcomers and its forks (parallel sampling, ``Sequence.group``): a choice admitted while
another choice of its group computes the same prompt takes no prompt of its own; it shares every block of that
parent (``BlockManager.fork``) and waits while the parent prefills. When the parent's last chunk is computed, the
child gets a copy of the parent's partial block and its prompt logprobs; a parent that leaves before its prompt is
complete hands its place to its first child. A part of ``core.planner.Planner``, whose books it keeps."""

from __future__ import annotations

from core.block_manager import BlockManager
from core.sequence import Sequence


class ForkBooks:
    """Newcomers' blocks, forks and the prefilling list, on the planner's books (set up by ``Planner.__init__``)."""

    blocks: BlockManager
    _prefilling: list[Sequence]
    _computed: dict[int, int]
    _forks: dict[int, list[Sequence]]
    _parent_of: dict[int, Sequence]
    _admitted: dict[int, int]
    num_forks: int
    num_block_copies: int

    def _place(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """KV blocks for each newcomer: a choice whose prompt another computes forks it, any other allocates all
        its tokens, its cached prefix shared. Returns the ones that compute, with how many tokens were cached."""
        computing, ids = [], {s.seq_id for s in self._prefilling}
        for seq in seqs:
            source = self._fork_source(seq, ids)
            if source is None:
                computing.append((seq, self._allocate(seq)))
                ids.add(seq.seq_id)
            else:
                self._fork(seq, source)
        return computing

    @staticmethod
    def _fork_source(seq: Sequence, computing: set[int]) -> Sequence | None:
        """A choice of ``seq``'s group that computes the same prompt (its seq_id in ``computing``: prefilling, or
        admitted before ``seq`` in this step), neither of them with output yet (a recomputed sequence never
        forks) and with the prompt logprobs ``seq`` wants; None if there is none."""
        if seq.group is None or seq.output_token_ids:
            return None
        for other in seq.group:
            if (
                other is not seq
                and other.seq_id in computing
                and not other.output_token_ids
                and other.lora_id == seq.lora_id
                and seq.prompt_logprobs_k in (None, other.prompt_logprobs_k)
                and other.prompt_token_ids == seq.prompt_token_ids
            ):
                return other
        return None

    def _fork(self, child: Sequence, parent: Sequence) -> None:
        """The child shares the parent's blocks (its own fresh partial block) and waits for its prompt."""
        self.blocks.fork(parent.seq_id, child.seq_id)
        self._forks.setdefault(parent.seq_id, []).append(child)
        self._parent_of[child.seq_id] = parent
        if child.num_cached_tokens is None:  # the prompt's cache hit is the parent's (usage reports it once)
            child.num_cached_tokens = parent.num_cached_tokens

    def _complete_forks(self, parents: list[Sequence]) -> list[Sequence]:
        """After a forward computed the prompts of ``parents`` (and the engine copied their partial blocks): each
        forked child takes the parent's prompt logprobs and stops waiting. Returns each parent followed by its
        children: the order of their first tokens."""
        order = [x for p in parents for x in (p, *self._forks.get(p.seq_id, ()))]
        for parent in parents:
            for child in self._forks.pop(parent.seq_id, ()):
                del self._parent_of[child.seq_id]
                if parent.prompt_len % self.blocks.block_size:
                    self.num_block_copies += 1
                if child.prompt_logprobs_k is not None:
                    child.prompt_logprobs = list(parent.prompt_logprobs)
                child.block_hashes = list(parent.block_hashes)  # same prompt, same chain (spares the hashing)
                self.num_forks += 1
        return order

    def _hand_over(self, parent: Sequence) -> None:
        """A prefilling parent leaves (aborted, preempted, failed) while choices wait on it: the first of them
        takes its place in the prefill queue and the others wait on it instead. It goes on from where the parent
        got, since it shares the prompt's full blocks, but from no further than the start of the partial last
        block: its own copy of that one holds nothing yet. It keeps the prompt logprobs scored so far."""
        children = self._forks.pop(parent.seq_id, None)
        if not children:
            return
        heir, rest = children[0], children[1:]
        del self._parent_of[heir.seq_id]
        bs = self.blocks.block_size
        start = self._computed[heir.seq_id] = min(self._computed[parent.seq_id], parent.prompt_len // bs * bs)
        if heir.prompt_logprobs_k is not None:  # the parent scored positions [0, start) already
            heir.prompt_logprobs = list(parent.prompt_logprobs[: start + 1]) if start else []
        self._prefilling.insert(self._prefilling.index(parent), heir)
        if rest:
            self._forks[heir.seq_id] = rest
            for child in rest:
                self._parent_of[child.seq_id] = heir

    def _drop_fork(self, child: Sequence) -> None:
        """A forked choice leaves before its parent's prompt is complete: its blocks go back (the shared ones
        stay with the parent)."""
        parent = self._parent_of.pop(child.seq_id)
        siblings = self._forks[parent.seq_id]
        siblings.remove(child)
        if not siblings:
            del self._forks[parent.seq_id]
        self._admitted.pop(child.seq_id, None)
        self.blocks.free(child.seq_id)

    def _drop_prefilling(self, seq: Sequence) -> None:
        self._hand_over(seq)
        self._prefilling.remove(seq)
        self._computed.pop(seq.seq_id, None)
        self._admitted.pop(seq.seq_id, None)
        if seq.seq_id in self.blocks:
            self.blocks.free(seq.seq_id)

    def _unplace_all(self, seqs: list[Sequence]) -> None:
        """Undo the placing of newcomers (a failed plan or step): children before the parents they forked."""
        for seq in reversed(seqs):
            if seq.seq_id in self._parent_of:
                self._drop_fork(seq)
            elif seq in self._prefilling:
                self._drop_prefilling(seq)
            elif seq.seq_id in self.blocks:
                self.blocks.free(seq.seq_id)
            self._admitted.pop(seq.seq_id, None)
