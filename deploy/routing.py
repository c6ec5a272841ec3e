"""Prefix-affinity routing for the MiniBatch replicas: Ray Serve's request-router API (``RequestRouterConfig``).

A prefix cache only pays off when requests that share a prompt prefix reach the replica that holds it. The
gateway (deploy/gateway.py) hashes a request's prompt prefix into ``prefix_key`` and passes it to the replica
call; this router, which Serve runs inside the gateway's DeploymentHandle, sends every key to one replica:

* the replica is chosen by rendezvous hashing (highest ``blake2b(key, replica id)``): each gateway replica picks
  the same one without sharing state, and when a replica is added or removed only the keys of that replica move;
* while that replica has at least ``max_affinity_load`` requests in flight (default MAX_BATCH_SIZE, a full batch:
  beyond it the request would wait in the replica's queue while another could start it at once), or it refuses
  the request (``max_ongoing_requests`` reached), the request falls back to Serve's power of two choices. The load
  is the larger of what this router has routed there and not seen complete (exact for one gateway) and Serve's
  queue-length cache (which also counts other gateways' requests, but lags behind a burst);
* requests without a key (``GET /metrics``, an unparsable body, affinity off) go straight to power of two choices.

Each replica chosen is for the request it was chosen for (Serve's base behaviour), not handed to the oldest pending
request as under Serve's FIFOMixin, which would give one key's replica to another key's request.
"""

from __future__ import annotations

import hashlib
import math
import time

# Serve's default router, whose choose_replicas is the fallback (called as a function, as Serve's own LLM prefix
# router does); it is not exported under ray.serve.request_router.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

PREFIX_KEY = "prefix_key"  # the replica call's keyword argument that carries the key
ASSIGNED_TTL_S = 5.0  # how long an assignment counts as load before the replica has accepted it


def rendezvous_score(key: str, replica: str) -> int:
    """A deterministic 64-bit score of (key, replica); the highest-scoring replica owns the key."""
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(key: str, replicas: list[str]) -> str:
    """The replica (by id) that ``key`` maps to among ``replicas``."""
    return max(replicas, key=lambda replica: rendezvous_score(key, replica))


def request_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get(PREFIX_KEY)
    return key if isinstance(key, str) and key else None


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Same prefix, same replica (unless it is loaded); power of two choices otherwise. See the module docstring."""

    def initialize_state(self, max_affinity_load: int = 8) -> None:
        """``request_router_kwargs`` from the deployment: the load at which affinity gives way."""
        self.max_affinity_load = int(max_affinity_load)
        # replica -> {internal request id: when it was assigned there, or inf once the replica accepted it}
        self.in_flight: dict[ReplicaID, dict[str, float]] = {}

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Serve's hook where a replica is assigned to the request (matched by its internal id). Counted from here, not
        from ``on_request_routed`` (once the replica accepted), because a burst is assigned before any answer comes."""
        if self._get_pending_request_matching_internal_request_id(request_metadata) is not None:
            self.in_flight.setdefault(replica.replica_id, {})[request_metadata.internal_request_id] = time.monotonic()
        super()._fulfill_next_pending_request(replica, request_metadata)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The replica accepted: it counts until ``on_request_completed``, which may already have come (a short
        request can finish before Serve calls this), so only a request still counted is marked."""
        ids = self.in_flight.get(replica_id, {})
        if pending_request.metadata.internal_request_id in ids:
            ids[pending_request.metadata.internal_request_id] = math.inf

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id, {}).pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's hook when the set of replicas changes: forget the counts of replicas that are gone."""
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        in_flight = getattr(self, "in_flight", {})  # (Serve may call this before initialize_state)
        self.in_flight = {replica_id: ids for replica_id, ids in in_flight.items() if replica_id in current}

    def load(self, replica: RunningReplica) -> int:
        """Requests in flight at ``replica``, as far as this router knows. An assignment that the replica has not
        accepted within ASSIGNED_TTL_S (refused, or its caller left) stops counting."""
        ids = self.in_flight.get(replica.replica_id, {})
        expired = time.monotonic() - ASSIGNED_TTL_S
        for request_id in [k for k, t in ids.items() if t < expired]:
            del ids[request_id]
        return max(len(ids), self._replica_queue_len_cache.get(replica.replica_id) or 0)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas to try in turn: [the key's owner], then the power-of-two pair."""
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidate_replicas, pending_request=pending_request
        )
        key = request_key(pending_request)
        if key is None or not candidate_replicas:
            return fallback
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        preferred = by_id[owner(key, list(by_id))]
        if self.load(preferred) >= self.max_affinity_load:
            return fallback
        return [[preferred], *fallback]
