"""Who waits, and who is admitted next: the scheduler's waiting queue and its fairness policy. No torch.

Every sequence belongs to a client (``Sequence.client_id``: who sent it, ``api.serving.client_id``) and to a
request (``Sequence.request_key``: one HTTP request's sequences, its prompts x ``n`` choices; 0 = a request of its
own). Under policy ``"fair"`` (SCHEDULING_POLICY, the default):

* **Admission order.** The client holding the fewest batch slots goes first, then, within that client, the
  request holding the fewest; ties go to the oldest. A request's own sequences keep their order (preempted ones
  first). So a request's 256 sequences do not all go ahead of a later arrival: each request's next turn comes in
  its order (a turn: one sequence, or the choices of one prompt, which share its prefill). Sequences of one client
  and one-sequence requests (every benchmark, every plain ``/generate``) come out first come, first served.
* **Fair share of the slots.** When every slot is taken and the next in that order belongs to a client (or, within
  one client, a request) that holds at least two slots fewer than another, the scheduler preempts one sequence of
  the most-served one that has held its slot a second or more (``preemption_victim``; it waits again with its
  tokens and is recomputed later, as after a KV preemption). The gap narrows by two, so the slot never moves back
  (no thrashing); a lone client, requests of one sequence each, or short answers never preempt anyone.
* **A client's share of the queue.** One client's waiting sequences are at most ``max_client_waiting``
  (MAX_CLIENT_QUEUE_SHARE x MAX_QUEUE_DEPTH): beyond it that client gets ``QueueFullError`` (a 503) while the
  others still get in.

Policy ``"fcfs"``: arrival order (preempted first) and no preemption for fairness: one request's sequences can fill
every slot for as long as they run.

The scheduler calls ``admission_order(running)`` when it admits, ``preemption_victim(head, running)`` when the
engine is full, and the plain queue operations (``append``, ``extendleft`` for preempted sequences, ``remove``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from core.sequence import Sequence

POLICIES = ("fair", "fcfs")


class QueueFullError(Exception):
    """The waiting queue is at MAX_QUEUE_DEPTH, or this client holds its share of it."""


def _siblings(a: Sequence, b: Sequence) -> bool:
    """Choices of one prompt (``Sequence.group``), neither with output yet (a preempted choice is recomputed alone)."""
    return a.group is not None and b.group is a.group and not a.output_token_ids and not b.output_token_ids


def request_of(seq: Sequence) -> object:
    """The request a sequence belongs to (its own when it has no ``request_key``)."""
    return seq.request_key or ("seq", seq.seq_id)


class FairQueue:
    """The waiting sequences, indexed by seq_id (append, remove: O(1)) and grouped by client and request."""

    def __init__(self, policy: str = "fair", max_client_waiting: int = 0, min_slot_s: float = 1.0) -> None:
        """``max_client_waiting``: most sequences one client may have waiting (0 = no limit of its own).
        ``min_slot_s``: how long a sequence holds its slot before fair share may preempt it."""
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)} (got {policy!r})")
        self.policy = policy
        self.max_client_waiting = max_client_waiting
        self.min_slot_s = min_slot_s
        self._seqs: dict[int, Sequence] = {}  # arrival order, preempted ones in front: the fcfs order
        self._requests: dict[object, dict[int, Sequence]] = {}  # request -> its waiting sequences, in order
        self._clients: dict[str, dict[object, None]] = {}  # client -> its waiting requests, oldest first
        self._client_waiting: Counter[str] = Counter()

    # --- the queue ---------------------------------------------------------------------------------------------
    def append(self, seq: Sequence) -> None:
        """Queue a newcomer; QueueFullError when its client already holds its share of the queue."""
        client = seq.client_id
        if self.max_client_waiting and self._client_waiting[client] >= self.max_client_waiting:
            raise QueueFullError(
                f"this client has {self._client_waiting[client]} sequences waiting, its share of the queue "
                f"(MAX_CLIENT_QUEUE_SHARE)"
            )
        self._seqs[seq.seq_id] = seq
        self._add(seq)

    def extendleft(self, seqs: list[Sequence]) -> None:
        """Put preempted ``seqs`` (in this order) back, each ahead of everything else of its request (and, for
        fcfs, of everything waiting). O(queue); preemption is rare."""
        self._seqs = {**{s.seq_id: s for s in seqs}, **self._seqs}
        for seq in reversed(seqs):
            self._add(seq, front=True)

    def remove(self, seq_id: int) -> Sequence | None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        key, client = request_of(seq), seq.client_id
        waiting = self._requests[key]
        del waiting[seq_id]
        if not waiting:
            del self._requests[key]
            del self._clients[client][key]
            if not self._clients[client]:
                del self._clients[client]
        self._client_waiting[client] -= 1
        if not self._client_waiting[client]:
            del self._client_waiting[client]
        return seq

    def clear(self) -> None:
        self._seqs.clear()
        self._requests.clear()
        self._clients.clear()
        self._client_waiting.clear()

    def waiting_of(self, client: str) -> int:
        """Sequences of ``client`` waiting."""
        return self._client_waiting[client]

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and self._seqs.get(seq.seq_id) is seq

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._seqs.values()))

    def __len__(self) -> int:
        return len(self._seqs)

    def _add(self, seq: Sequence, front: bool = False) -> None:
        key, client = request_of(seq), seq.client_id
        requests = self._clients.setdefault(client, {})
        waiting = self._requests.setdefault(key, {})
        if key not in requests:  # a preempted sequence's request comes back ahead of the client's younger ones
            if front:
                self._clients[client] = {key: None, **requests}
            else:
                requests[key] = None
        if front:
            self._requests[key] = {seq.seq_id: seq, **waiting}
        else:
            waiting[seq.seq_id] = seq
        self._client_waiting[client] += 1

    # --- the policy ----------------------------------------------------------------------------------------------
    def admission_order(self, running: Iterable[Sequence]) -> Iterator[Sequence]:
        """The waiting sequences in the order to admit them, given ``running`` (the sequences holding slots); each
        one yielded counts as holding a slot for the ones after it. Lazy: the scheduler takes them while they fit
        and stops at the first that does not (it never skips it)."""
        if self.policy == "fcfs":
            yield from list(self._seqs.values())
            return
        running = list(running)
        by_client = Counter(s.client_id for s in running)
        by_request = Counter(request_of(s) for s in running)
        taken: Counter[object] = Counter()  # per request: its sequences yielded so far
        cursors: dict[object, list[Sequence]] = {}
        while True:
            best = None  # (client's slots, request's slots, arrival, client, request)
            for client, requests in self._clients.items():
                pick = self._best_request(requests, by_request, taken)
                if pick is None:
                    continue
                served, arrival, key = pick
                rank = (by_client[client], served, arrival)
                if best is None or rank < best[0]:
                    best = (rank, key)
            if best is None:
                return
            key = best[1]
            if key not in cursors:
                cursors[key] = list(self._requests[key].values())
            waiting = cursors[key]
            # A turn is one sequence, or the choices of one prompt waiting together (an n > 1 group): admitted
            # in one call, they share its prefill (the engine forks the first one's prompt to the others).
            first = waiting[taken[key]]
            while taken[key] < len(waiting) and (waiting[taken[key]] is first or _siblings(first, waiting[taken[key]])):
                seq = waiting[taken[key]]
                taken[key] += 1
                by_client[seq.client_id] += 1
                by_request[key] += 1
                yield seq

    def _best_request(
        self, requests: dict[object, None], by_request: Counter, taken: Counter
    ) -> tuple[int, float, object] | None:
        """(slots held, arrival, request) of the client's request to admit from next: fewest slots, then oldest. The
        requests are kept oldest first, so the first one holding no slot wins at once."""
        best = None
        for key in requests:
            waiting = self._requests[key]
            if taken[key] >= len(waiting):
                continue
            served = by_request[key]
            if best is None or served < best[0]:
                best = (served, next(iter(waiting.values())).arrival_time, key)
                if served == 0:
                    break
        return best

    def preemption_victim(self, head: Sequence, running: Iterable[Sequence], now: float) -> Sequence | None:
        """The running sequence to preempt so that ``head`` (the next to admit, for whom no slot is free) gets its
        share, or None. A sequence of another client qualifies when that client holds at least two slots more than
        ``head``'s; of ``head``'s own client, when its request holds at least two more than ``head``'s request; and
        only once it has held its slot ``min_slot_s`` (a short answer finishes instead: no churn among many small
        requests, and the choices of a prompt admitted together stay together while they fork). The most-served
        client's, then request's, most recently admitted sequence goes (the least work lost)."""
        if self.policy != "fair":
            return None
        running = list(running)
        old = [s for s in running if s.slot_since is not None and now - s.slot_since >= self.min_slot_s]
        if not old:
            return None
        by_client = Counter(s.client_id for s in running)
        by_request = Counter(request_of(s) for s in running)
        client, key = head.client_id, request_of(head)
        best, victim = None, None
        for seq in old:
            other = request_of(seq)
            if seq.client_id != client:
                if by_client[seq.client_id] < by_client[client] + 2:
                    continue
                level = 1  # another client's slots first: clients share before requests do
            elif other != key and by_request[other] >= by_request[key] + 2:
                level = 0
            else:
                continue
            rank = (level, by_client[seq.client_id], by_request[other], seq.admit_time or 0.0, seq.seq_id)
            if best is None or rank > best:
                best, victim = rank, seq
        return victim
