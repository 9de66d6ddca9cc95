"""Ray Serve request routers for quill replicas (configured with RequestRouterConfig).

- QuillPrefixRouter: quill.cluster.routing.PrefixRoutingPolicy (longest cached prefix by quill's
  own block hashes, least loaded when queues are imbalanced).
- RoundRobinRouter: each replica in turn, the baseline a prefix-blind balancer gives.

Ray Serve's own PowerOfTwoChoicesRequestRouter is the third choice (`--router pow2`).
"""

from __future__ import annotations

import itertools
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from quill.cluster.routing import DEFAULT_IMBALANCE, PrefixRoutingPolicy, QuillCall


def _call(pending_request: Optional[PendingRequest]) -> QuillCall | None:
    if pending_request is None:
        return None
    return next((arg for arg in pending_request.args if isinstance(arg, QuillCall)), None)


class QuillPrefixRouter(RequestRouter):
    """Routes each request to the replica holding the longest run of its prompt's KV blocks."""

    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE, report_margin_s: float = 10.0):
        self.policy = PrefixRoutingPolicy(imbalance_threshold=int(imbalance_threshold), report_margin_s=float(report_margin_s))

    def _read_reports(self, replicas: List[RunningReplica]) -> None:
        for replica in replicas:
            stats = replica.routing_stats or {}
            if "prefix_hashes" in stats:
                self.policy.report(replica.replica_id.unique_id, float(stats.get("at", 0.0)), stats["prefix_hashes"])

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._read_reports(candidate_replicas)
        call = _call(pending_request)
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        ranks = self.policy.rank(list(by_id), call.block_hashes if call is not None else ())
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        call = _call(pending_request)
        self.policy.routed(replica_id.unique_id, call.block_hashes if call is not None else ())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)


class RoundRobinRouter(RequestRouter):
    """Each replica in turn (by replica id), skipping to the next if one is full."""

    def initialize_state(self, **kwargs):
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[replica] for replica in ordered[start:] + ordered[:start]]
