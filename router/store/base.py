"""The store interface shared by the in-memory and the Redis implementations.

Write side (the publisher; exactly one writer per replica, guarded by a lease):
``register`` -> ``write`` batches (per ``ReplicaKey``, ``seq`` increasing by one) ->
``heartbeat`` every few seconds -> ``publish_load`` -> ``deregister``. ``reset`` replaces a
replica's whole stored state (start-up, or after the store lost its data).

Read side (routers, through ``router.store.sync.IndexSync``): ``instance_token`` ->
``cursor`` -> ``list_replicas`` + ``read_replicas`` (bootstrap) -> ``read_changes`` from the
cursor (follow) -> ``leases`` (expiry check). Because a writer commits a batch's state before
appending it to the change stream, a snapshot read after taking the cursor contains every
batch older than the cursor; later batches arrive as changes and are told apart by ``seq``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from router.core.disagg import Role
from router.core.errors import ConfigError
from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    IndexEvent,
    Kind,
    ReplicaKey,
    Tier,
)
from router.store.packed import PackedTable, hashes_by_bit
from router.store.schema import check_replica_name


class LeaseTaken(Exception):
    """Another writer holds this replica's lease (a second publisher registered the same
    replica name): the one that gets this stands down and writes nothing more."""

    def __init__(self, replica: str, holder: str) -> None:
        super().__init__(f"the lease of replica {replica!r} is held by publisher {holder!r}")
        self.replica = replica
        self.holder = holder


class LeaseLost(Exception):
    """A write fenced by its writer's lease found the lease gone (it expired while the writer
    was stalled, or the store lost its data): nothing was written; the writer must register
    again and republish its state in full."""

    def __init__(self, replica: str) -> None:
        super().__init__(f"the lease of replica {replica!r} is gone")
        self.replica = replica


class SeqMismatch(Exception):
    """A write found the stored ``seq`` of these keys other than the one before its own:
    the store went back (restored from an older snapshot, a failover that lost writes) or
    another writer wrote them, so buckets the write did not touch may be stale. The write
    was made all the same; the writer must replace its state in full (``reset``)."""

    def __init__(self, keys: Sequence[ReplicaKey]) -> None:
        super().__init__(f"stored seq not the writer's last for {', '.join(map(str, keys))}")
        self.keys = tuple(keys)


# data-parallel ranks of one replica: how many (an NVL72 rack holds 72 GPUs; ranks of
# several racks behind one server stay far under it) and how large a rank's index may be
MAX_DP_RANKS = 1024
MAX_DP_RANK = 65536


@dataclass(slots=True, frozen=True)
class ReplicaInfo:
    """What a publisher registers about its replica. ``state_interval_blocks`` is the
    recurrent-state checkpoint grid in router blocks (configured at the publisher, else
    learned from the engine's checkpoints; 0: none known); ``publishes_state``: the engine
    published recurrent-state checkpoints (a hybrid model); ``state_alignment_blocks``: the
    block count every checkpoint lands on, learned (0: not known yet); ``lookahead_tokens``:
    the tokens after each block the engine's hashes cover (vLLM's ``lookahead_token_ids``;
    0: none seen); ``names_groups``: the engine's stores name their KV cache group kind
    (vLLM >= 0.22: a hybrid one publishes checkpoints). The publisher registers again when
    what it learned changes
    (router.core.state_layout)."""

    replica: str
    url: str = ""
    model: str = ""
    rack: str = ""
    region: str = ""
    dp_ranks: tuple[int, ...] = (0,)
    block_size: int = 64
    state_interval_blocks: int = 0
    engine: str = "vllm"
    publishes_state: bool = False
    role: str = "both"  # prefill / decode / both (router/core/disagg.py)
    state_alignment_blocks: int = 0
    lookahead_tokens: int = 0
    names_groups: bool = False

    def __post_init__(self) -> None:
        # (a registration is a publisher's word: a wrong type would fail later, in the
        # router's discovery, for every replica read with it)
        for name in ("replica", "url", "model", "rack", "region", "engine", "role"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        check_replica_name(self.replica)
        Role.parse(self.role)  # ConfigError: a ValueError to from_json's callers
        ranks = self.dp_ranks
        if not ranks or any(not 0 <= r < MAX_DP_RANK for r in ranks):
            raise ValueError(f"dp_ranks must be a non-empty list of ints in [0, {MAX_DP_RANK})")
        # (each rank is a routing key in every router: one publisher must not make millions)
        if len(ranks) > MAX_DP_RANKS or len(set(ranks)) != len(ranks):
            raise ValueError(f"dp_ranks must be at most {MAX_DP_RANKS} distinct ranks")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if not isinstance(self.state_interval_blocks, int) or self.state_interval_blocks < 0:
            raise ValueError("state_interval_blocks must be a non-negative integer")
        if not isinstance(self.publishes_state, bool):
            raise ValueError("publishes_state must be true or false")
        if not isinstance(self.state_alignment_blocks, int) or self.state_alignment_blocks < 0:
            raise ValueError("state_alignment_blocks must be a non-negative integer")
        if not isinstance(self.lookahead_tokens, int) or self.lookahead_tokens < 0:
            raise ValueError("lookahead_tokens must be a non-negative integer")
        if not isinstance(self.names_groups, bool):
            raise ValueError("names_groups must be true or false")

    @property
    def hybrid(self) -> bool:
        return self.publishes_state or self.state_interval_blocks > 0

    def replica_keys(self) -> list[ReplicaKey]:
        return [ReplicaKey(self.replica, r) for r in self.dp_ranks]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ReplicaInfo:
        """Parse a stored info; unknown fields are ignored, bad ones raise ValueError."""
        try:
            raw: dict[str, Any] = json.loads(text)
            known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            if "dp_ranks" in known:
                known["dp_ranks"] = tuple(int(r) for r in known["dp_ranks"])
            return cls(**known)
        except (TypeError, KeyError, ValueError, ConfigError, RecursionError) as exc:
            raise ValueError(f"bad replica info: {exc}") from None


@dataclass(slots=True, frozen=True)
class LoadSample:
    """Engine load as scraped by the publisher; ``wall_ts`` is the publisher's wall clock."""

    running: int
    waiting: int
    kv_usage: float
    wall_ts: float
    # the engine's cumulative prefix-cache counters in prompt tokens, when it exports them
    # (absent in samples of older publishers)
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None

    def to_json(self) -> str:
        out = asdict(self)
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            if out[name] is None:
                del out[name]
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> LoadSample:
        try:
            raw = json.loads(text)
            queries, hits = raw.get("prefix_cache_queries"), raw.get("prefix_cache_hits")
            return cls(
                int(raw["running"]),
                int(raw["waiting"]),
                float(raw["kv_usage"]),
                float(raw["wall_ts"]),
                float(queries) if queries is not None else None,
                float(hits) if hits is not None else None,
            )
        except (TypeError, KeyError, ValueError, AttributeError, RecursionError) as exc:
            raise ValueError(f"bad load sample: {exc}") from None


@dataclass(slots=True, frozen=True)
class ReplicaSnapshot:
    """The stored cache content of one ``ReplicaKey``; ``seq`` is the last batch it includes."""

    key: ReplicaKey
    seq: int
    kv_hashes: npt.NDArray[np.uint64]
    kv_masks: npt.NDArray[np.uint8]
    state_hashes: npt.NDArray[np.uint64]

    @property
    def entries(self) -> int:
        return len(self.kv_hashes) + len(self.state_hashes)

    def events(self) -> tuple[IndexEvent, ...]:
        """The snapshot as index events: one BlocksStored per tier, then state checkpoints."""
        out: list[IndexEvent] = []
        for tier in Tier:
            hashes = hashes_by_bit(self.kv_hashes, self.kv_masks, 1 << tier)
            if hashes:
                out.append(BlocksStored(tuple(hashes), tier, Kind.KV))
        if len(self.state_hashes):
            out.append(BlocksStored(tuple(self.state_hashes.tolist()), Tier.GPU, Kind.STATE))
        return tuple(out)


@dataclass(slots=True, frozen=True)
class UnreadableSnapshot:
    """A registered ``ReplicaKey`` whose stored state does not parse (a torn record, a
    foreign write): not "not registered" (None). The reader keeps what it knew of the key
    and reads it again later."""

    key: ReplicaKey
    reason: str


# ---------------------------------------------------------------------------- changes


@dataclass(slots=True, frozen=True)
class BatchChange:
    key: ReplicaKey
    seq: int
    events: tuple[IndexEvent, ...]


@dataclass(slots=True, frozen=True)
class ResetChange:
    """The replica's stored state was replaced whole at ``seq``: re-read it."""

    key: ReplicaKey
    seq: int


@dataclass(slots=True, frozen=True)
class LoadChange:
    key: ReplicaKey
    sample: LoadSample


@dataclass(slots=True, frozen=True)
class ReplicaUp:
    info: ReplicaInfo


@dataclass(slots=True, frozen=True)
class ReplicaDown:
    replica: str


Change = BatchChange | ResetChange | LoadChange | ReplicaUp | ReplicaDown


@dataclass(slots=True)
class ChangeRead:
    """One ``read_changes`` result; ``malformed`` counts entries that could not be decoded.
    ``unread``: the change streams this read could not reach (a Redis Cluster node down:
    the others were read; ``cursor`` keeps their position)."""

    changes: list[Change]
    cursor: object
    malformed: int = 0
    unread: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- write side


@dataclass(slots=True)
class ReplicaState:
    """The authoritative cache content of one ``ReplicaKey``, held by its only writer."""

    key: ReplicaKey
    seq: int = 0
    kv: PackedTable = field(default_factory=PackedTable)
    state: PackedTable = field(default_factory=PackedTable)

    def apply(self, events: Sequence[IndexEvent]) -> None:
        """Fold canonical events in; tables remember which buckets changed."""
        for event in events:
            if isinstance(event, AllCleared):
                self.kv.clear()
                self.state.clear()
                continue
            if event.kind is Kind.STATE:
                table, bit = self.state, 1
            else:
                table, bit = self.kv, 1 << event.tier
            if isinstance(event, BlocksStored):
                for block in event.hashes:
                    table.add(block, bit)
            elif isinstance(event, BlocksRemoved):
                for block in event.hashes:
                    table.discard(block, bit)
        self.kv.maybe_grow()
        self.state.maybe_grow()

    def snapshot(self) -> ReplicaSnapshot:
        kv = self.kv.records()
        st = self.state.records()
        return ReplicaSnapshot(
            self.key,
            self.seq,
            kv["h"].astype(np.uint64),
            kv["m"].astype(np.uint8),
            st["h"].astype(np.uint64),
        )


class IndexStore(Protocol):
    """Shared index storage (see the module docstring for the protocol)."""

    # write side
    async def register(
        self, info: ReplicaInfo, owner: str, lease_ttl_s: float, *, take_over: bool = True
    ) -> None:
        """Write the info and take the lease for ``owner`` (the last to register owns it);
        the stored state of DP ranks the info no longer lists is deleted. Without
        ``take_over``, raises ``LeaseTaken`` instead when another owner holds the lease."""
        ...

    async def heartbeat(self, replica: str, owner: str, lease_ttl_s: float) -> bool:
        """Renew ``owner``'s lease; False when it was gone (expired, or the store lost its
        data); raises ``LeaseTaken`` when another owner holds it."""
        ...

    async def deregister(self, replica: str, owner: str | None = None) -> bool:
        """Delete the replica (the state of every DP rank it has stored, not only the
        registered ranks); with ``owner``, only while the lease is that owner's or free (a
        superseded publisher must not delete its successor's state). True if deleted. The
        ReplicaDown is not announced when the replica registered again meanwhile."""
        ...

    async def reap(self, replica: str) -> bool:
        """Delete a replica whose lease is gone (as ``deregister``): a registered one, or
        an orphan (:meth:`orphans`); False if it is alive (or absent). A registry entry
        left without any key of the replica is removed (True, no ReplicaDown)."""
        ...

    async def orphans(self) -> list[str]:
        """Replicas whose state outlived them: written after the replica was reaped or
        deregistered (the last flush of a publisher that stalled past its lease and then
        died), with neither a lease nor a registration; and registered replicas without a
        lease whose registration is gone or does not parse. :meth:`reap` deletes them."""
        ...

    async def write(
        self,
        writes: Sequence[tuple[ReplicaState, tuple[IndexEvent, ...]]],
        owner: str | None = None,
    ) -> None:
        """Commit each state's changed buckets and its ``seq`` (already incremented by the
        caller), then append each batch of events to the change stream. A store that keeps
        a state in pieces raises ``SeqMismatch`` (after doing all of that) when the stored
        seq a state's commit replaced was not ``seq - 1``. With ``owner``, a replica's
        write is made only while its lease is ``owner``'s, checked in the same atomic step:
        otherwise nothing of that replica's is written and ``LeaseTaken`` (another owner
        holds it) or ``LeaseLost`` (it is gone) is raised, after the other replicas'."""
        ...

    async def reset(self, states: Sequence[ReplicaState], owner: str | None = None) -> None:
        """Replace the stored content of these replica keys with ``states`` in full; fenced
        by ``owner``'s lease as :meth:`write`."""
        ...

    async def publish_load(
        self, key: ReplicaKey, sample: LoadSample, owner: str | None = None
    ) -> None:
        """Store and announce a load sample; fenced by ``owner``'s lease as :meth:`write`."""
        ...

    async def stored_seq(self, key: ReplicaKey) -> int | None: ...

    async def stored_seqs(self, keys: Sequence[ReplicaKey]) -> list[int | None]:
        """``stored_seq`` of each key, in one round trip where the store allows."""
        ...

    async def settle_shards(self) -> bool:
        """Agree on the change streams' shard count with every process of the store: read
        the stored count (store this one's when there is none) and follow it. True when the
        count this store uses changed (its cursor and writes move to other streams)."""
        ...

    # read side
    async def instance_token(self) -> str: ...

    async def cursor(self) -> object: ...

    async def streams_behind(self, cursor: object) -> list[str]:
        """The change streams whose newest entry is older than ``cursor``'s position in them:
        the stream was lost and began again below it (a Redis Cluster node restarted empty,
        or failed over, on a host whose clock is behind the old one's). Read on from
        ``cursor``, such a stream would show nothing until its ids pass it."""
        ...

    async def list_replicas(self) -> list[ReplicaInfo]: ...

    async def registration(self, replica: str) -> ReplicaInfo | None:
        """The registration the store holds for ``replica``: None when there is none, or
        it does not parse. A ``ReplicaUp`` change says that it changed; this says what it
        is (a change entry may be an old one appended again: IndexSync)."""
        ...

    async def read_replicas(
        self, keys: Sequence[ReplicaKey]
    ) -> list[ReplicaSnapshot | UnreadableSnapshot | None]:
        """Each key's stored state, read atomically per key: None when its replica is not
        registered, ``UnreadableSnapshot`` when it is and its state does not parse."""
        ...

    async def read_changes(self, cursor: object, block_s: float, count: int) -> ChangeRead: ...

    async def leases(self, replicas: Sequence[str]) -> dict[str, bool]: ...

    async def close(self) -> None: ...
