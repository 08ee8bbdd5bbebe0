"""Which replicas exist, what they serve and where they listen.

From settings, plus the replicas publishers register in Redis (``Fleet.add_discovered``
calls ``upsert``/``remove`` on the event loop; docs/redis.md, "Replica discovery").
A replica with ``dp_ranks`` = N yields N schedulable :class:`ReplicaKey` s sharing one URL.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from router.core.types import ReplicaKey
from router.service.replica_url import ReplicaUrl
from router.service.settings import ReplicaSettings


@dataclass(slots=True, frozen=True)
class Endpoint:
    """Where to send a request for one schedulable key."""

    key: ReplicaKey
    base_url: str  # http://host[:port] (ReplicaUrl.base)
    model: str
    dp_rank: int | None  # set when the replica has several DP ranks
    rack: str | None = None
    region: str | None = None
    role: str = "both"


class ReplicaRegistry:
    def __init__(self, replicas: Iterable[ReplicaSettings] = ()) -> None:
        self._by_name: dict[str, ReplicaSettings] = {}
        self._endpoints: dict[ReplicaKey, Endpoint] = {}
        # per model, a tuple rebuilt on every change: routing caches where each key sits in
        # the index and load table for as long as it sees the same tuple (RoutingEngine)
        self._by_model: dict[str, tuple[ReplicaKey, ...]] = {}
        for r in replicas:
            self.upsert(r)

    def upsert(self, replica: ReplicaSettings) -> None:
        """Add or replace a replica (all its DP ranks)."""
        self.remove(replica.name)
        self._by_name[replica.name] = replica
        keys = self._keys_of(replica)
        for key in keys:
            self._endpoints[key] = Endpoint(
                key,
                ReplicaUrl.parse(replica.url).base,
                replica.model,
                key.dp_rank if replica.dp_ranks > 1 else None,
                replica.rack,
                replica.region,
                replica.role,
            )
        self._by_model[replica.model] = (*self._by_model.get(replica.model, ()), *keys)

    @staticmethod
    def _keys_of(replica: ReplicaSettings) -> tuple[ReplicaKey, ...]:
        return tuple(ReplicaKey(replica.name, rank) for rank in range(replica.dp_ranks))

    def remove(self, name: str) -> list[ReplicaKey]:
        """Forget a replica; returns its keys (so the caller can drop index and load state)."""
        old = self._by_name.pop(name, None)
        if old is None:
            return []
        keys = self._keys_of(old)
        for k in keys:
            del self._endpoints[k]
        gone = set(keys)
        left = tuple(k for k in self._by_model.get(old.model, ()) if k not in gone)
        if left:
            self._by_model[old.model] = left
        else:
            self._by_model.pop(old.model, None)
        return list(keys)

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def keys_for(self, model: str) -> tuple[ReplicaKey, ...]:
        """The model's keys; the same tuple object until the model's replicas change."""
        return self._by_model.get(model, ())

    def endpoint(self, key: ReplicaKey) -> Endpoint | None:
        return self._endpoints.get(key)

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def get(self, name: str) -> ReplicaSettings | None:
        return self._by_name.get(name)

    def replicas(self) -> list[ReplicaSettings]:
        return list(self._by_name.values())

    def find(self, name: str) -> list[ReplicaKey]:
        """Keys of a replica name, or the single key a ``name#dpN`` string names."""
        replica = self._by_name.get(name)
        if replica is not None:
            return list(self._keys_of(replica))
        key = ReplicaKey.parse(name)
        return [key] if key in self._endpoints else []
