"""The routing step both the service and the simulator run: filter candidates, look up the
prefix index once, ask the policy, record the dispatch (load and speculative entries)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.core.errors import NoReplicaAvailable
from router.core.index import PrefixIndex
from router.core.load import LoadTracker, LoadView
from router.core.policies import Candidate, Policy
from router.core.types import NO_MATCH, Decision, ReplicaKey, RouteRequest


@dataclass(slots=True, frozen=True)
class BusyThresholds:
    """A replica above any threshold is skipped while some replica is below all of them.

    ``None`` disables a threshold. When every healthy replica is busy, ``reject_when_all_busy``
    decides between refusing the request (the edge answers 429/503) and routing among all.
    """

    max_in_flight: int | None = None
    max_queued_prefill_tokens: int | None = None
    max_kv_usage: float | None = None
    reject_when_all_busy: bool = False

    @property
    def enabled(self) -> bool:
        """Whether any threshold is set."""
        return (
            self.max_in_flight is not None
            or self.max_queued_prefill_tokens is not None
            or self.max_kv_usage is not None
        )

    def busy(self, load: LoadView) -> bool:
        return (
            (self.max_in_flight is not None and load.in_flight >= self.max_in_flight)
            or (
                self.max_queued_prefill_tokens is not None
                and load.queued_prefill_tokens >= self.max_queued_prefill_tokens
            )
            or (self.max_kv_usage is not None and load.kv_usage >= self.max_kv_usage)
        )


@dataclass(slots=True, frozen=True)
class RoutingSettings:
    """Per-model routing settings. ``state_interval_blocks`` is the recurrent-state grid the
    router assumes when it speculates (0: the model is not hybrid)."""

    block_size: int = 64
    hybrid: bool = False
    state_interval_blocks: int = 0
    speculative_ttl_s: float = 0.0
    busy: BusyThresholds = BusyThresholds()


def filter_candidates(
    replicas: Sequence[ReplicaKey], load: LoadTracker, busy: BusyThresholds, now: float
) -> list[tuple[ReplicaKey, LoadView]]:
    """Healthy, non-draining replicas, the busy ones dropped while others remain."""
    up: list[tuple[ReplicaKey, LoadView]] = []
    for r in replicas:
        v = load.view(r, now)
        if v.healthy and not v.draining:
            up.append((r, v))
    if not up:
        raise NoReplicaAvailable("no healthy replica is available")
    if not busy.enabled:
        return up
    free = [(r, v) for r, v in up if not busy.busy(v)]
    if free:
        return free
    if busy.reject_when_all_busy:
        raise NoReplicaAvailable("every replica is over its busy threshold", busy=True)
    return up


def speculative_state_hashes(hashes: Sequence[int], interval_blocks: int) -> list[int]:
    """State checkpoints a hybrid engine will hold after serving this prompt: every
    ``interval_blocks`` blocks plus the last full block (engines snapshot at prefill end)."""
    if not hashes or interval_blocks <= 0:
        return []
    picked = list(hashes[interval_blocks - 1 :: interval_blocks])
    if not picked or picked[-1] != hashes[-1]:
        picked.append(hashes[-1])
    return picked


class RoutingEngine:
    """Index + load + policy for one model. Pure: the caller passes ``now`` and ``rng``."""

    def __init__(
        self,
        index: PrefixIndex,
        load: LoadTracker,
        policy: Policy,
        settings: RoutingSettings,
    ) -> None:
        self.index = index
        self.load = load
        self.policy = policy
        self.settings = settings

    def candidates(
        self, request: RouteRequest, replicas: Sequence[ReplicaKey], now: float
    ) -> list[Candidate]:
        eligible = filter_candidates(replicas, self.load, self.settings.busy, now)
        matches = self.index.match(request.block_hashes, hybrid=self.settings.hybrid, now=now)
        return [
            Candidate(r, matches.get(r, NO_MATCH), view, self.index.replica_size(r)[0])
            for r, view in eligible
        ]

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaKey],
        now: float,
        rng: random.Random,
    ) -> Decision:
        """Pick a replica; raises NoReplicaAvailable when none can take the request."""
        return self.policy.choose(request, self.candidates(request, replicas, now), now, rng)

    def dispatched(self, request: RouteRequest, decision: Decision, now: float) -> None:
        """Record that ``request`` was sent per ``decision`` (load, speculative entries)."""
        self.load.dispatch(
            request.request_id, decision.replica, request.prompt_tokens, decision.usable_tokens
        )
        ttl = self.settings.speculative_ttl_s
        if ttl > 0 and request.block_hashes:
            states = (
                speculative_state_hashes(request.block_hashes, self.settings.state_interval_blocks)
                if self.settings.hybrid
                else []
            )
            self.index.speculate(decision.replica, request.block_hashes, states, now, ttl)
