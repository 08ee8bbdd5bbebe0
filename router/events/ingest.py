"""``EngineIngest``: one engine's event endpoints -> canonical index events per replica key.

payload -> ``decode_payload`` -> per data-parallel rank ``Reblocker`` -> ``sink(key, events)``.
A batch is filed under the rank its payload names when that is a rank the ingest follows (an
endpoint's ``EndpointSpec.dp_rank``), else under the rank of the endpoint it came from: an
engine numbered within a larger data-parallel group but routed to as a replica of its own
(e.g. one API server a rank behind vLLM's external load balancing) names a rank no router
routes to.
Lost batches (a gap the replay could not fill) and engine restarts clear that engine's
state: a ``AllCleared`` goes to the sink for every rank the endpoint served. Malformed
payloads and events are counted in ``stats`` and skipped; the sink is never called with
partial garbage, and nothing here raises on input. A payload that cannot be read at all, or
an event in it that is not a store and cannot be read (a removal, a clear, a type unknown),
leaves what it did to the cache unknown: the batch counts as lost and clears the engine,
then the events after the unread one are applied (a store unread is only missing: skipped).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from router.core.types import AllCleared, IndexEvent, ReplicaKey
from router.events.backlog import DEFAULT_MAX_BACKLOG_BYTES
from router.events.decode import decode_payload
from router.events.endpoints import EndpointSpec
from router.events.model import EngineBlockStored, EngineEvent
from router.events.reblock import Reblocker, ReblockStats

if TYPE_CHECKING:
    # (ZMQ, imported by the subscriber, loads only where an engine's events are followed:
    # a router without ZMQ endpoints reads the facts of this module and nothing else)
    from router.events.subscriber import ZmqEventSubscriber

log = logging.getLogger(__name__)

Sink = Callable[[ReplicaKey, list[IndexEvent]], None]


@dataclass(slots=True, frozen=True)
class EngineFacts:
    """What an engine's stores showed about it. ``lookahead_tokens``: the tokens after each
    block its hashes cover (vLLM's ``lookahead_token_ids``, SGLang's EAGLE pairs: an EAGLE /
    MTP engine that gives back no block of a hit; 0: none seen). ``names_groups``: its
    stores name their KV cache group's kind (vLLM >= 0.22; SGLang's never do), so a hybrid
    one publishes its recurrent-state checkpoints."""

    lookahead_tokens: int = 0
    names_groups: bool = False


@dataclass(slots=True)
class IngestStats:
    payloads: int = 0
    malformed_payloads: int = 0
    malformed_events: int = 0
    lost_batches: int = 0
    restarts: int = 0
    # batches naming a rank not followed, filed under their endpoint's rank instead
    foreign_rank_batches: int = 0
    # live batches dropped over a subscriber's backlog budget (refilled by replay, or lost)
    backlog_dropped: int = 0
    last_errors: list[str] = field(default_factory=list)

    def note(self, errors: Sequence[str]) -> None:
        self.last_errors = (self.last_errors + list(errors))[-20:]


class EngineIngest:
    """Turns engine payloads into canonical events for ``replica``'s keys."""

    def __init__(
        self,
        replica: str,
        model: str,
        block_size: int,
        sink: Sink,
        on_batch: Callable[[ReplicaKey, float], None] | None = None,
        on_checkpoint: Callable[[int], None] | None = None,
        on_facts: Callable[[EngineFacts], None] | None = None,
        adapter: bool = False,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
    ) -> None:
        """``on_batch(key, ts)``: called after ``sink`` with the engine's batch timestamp
        (``KVEventBatch.ts``, the engine's wall clock) when the batch gave canonical events
        and carries a timestamp. ``on_checkpoint(end)``: the token position of every new
        recurrent-state checkpoint (``Reblocker``), for layout learning. ``on_facts``: called
        with ``facts`` (:class:`EngineFacts`) each time the engine's stores show more of
        them (at most twice). ``adapter``: ``model`` is configured as a LoRA adapter of the
        engine (``Reblocker``: its entries never index the base model's blocks as its own).
        ``max_backlog_bytes``: each subscriber's live backlog budget (``ZmqEventSubscriber``)."""
        self.replica = replica
        self.model = model
        self.block_size = block_size
        self.sink = sink
        self.on_batch = on_batch
        self.on_checkpoint = on_checkpoint
        self.on_facts = on_facts
        self.adapter = adapter
        self.max_backlog_bytes = max_backlog_bytes
        self.facts = EngineFacts()
        self.reblockers: dict[int, Reblocker] = {}
        self.stats = IngestStats()
        self._ranks_of: dict[str, set[int]] = {}
        # the ranks of the endpoints subscribed to (``subscriber``): a payload naming another
        # is filed under its endpoint's rank (module docstring); the pairs (source, rank)
        # warned about
        self._followed: set[int] = set()
        self._foreign: set[tuple[str, int]] = set()

    def not_indexed(self) -> dict[str, int]:
        """Engine blocks of every rank stored but not indexed, by reason
        (``ReblockStats.not_indexed``)."""
        total = dict.fromkeys(ReblockStats().not_indexed(), 0)  # every reason, 0 at first
        for rb in self.reblockers.values():
            for reason, n in rb.stats.not_indexed().items():
                total[reason] = total.get(reason, 0) + n
        return total

    def reblocker(self, rank: int) -> Reblocker:
        rb = self.reblockers.get(rank)
        if rb is None:
            rb = self.reblockers[rank] = Reblocker(
                self.block_size, self.model, on_checkpoint=self.on_checkpoint, adapter=self.adapter
            )
        return rb

    def handle_payload(self, payload: bytes, default_rank: int = 0, source: str = "") -> None:
        """Decode one payload and pass its canonical events on. Never raises on input."""
        self.stats.payloads += 1
        result = decode_payload(payload)
        if result.errors:
            self.stats.note(result.errors)
            log.warning("malformed KV events from %s: %s", source or "engine", result.errors[:3])
        if result.batch is None:
            self.stats.malformed_payloads += 1
            self._unreadable(source, default_rank)
            return
        self.stats.malformed_events += len(result.errors)
        batch_events = result.batch.events
        if result.unknown_until is not None:
            self._unreadable(source, default_rank)
            batch_events = batch_events[result.unknown_until :]
        facts = self.facts
        if not (facts.lookahead_tokens and facts.names_groups):
            self._learn_facts(batch_events)
        rank = result.batch.data_parallel_rank
        if rank is None:
            rank = default_rank
        elif rank != default_rank and self._followed and rank not in self._followed:
            self._foreign_rank(source, rank, default_rank)
            rank = default_rank
        self._ranks_of.setdefault(source, set()).add(rank)
        rb = self.reblocker(rank)
        before = rb.stats.bad_event
        events = rb.convert(batch_events)
        if rb.stats.bad_event > before:
            self.stats.malformed_events += rb.stats.bad_event - before
            self.stats.note(rb.stats.errors[-(rb.stats.bad_event - before) :])
        if events:
            key = ReplicaKey(self.replica, rank)
            self.sink(key, events)
            if self.on_batch is not None and result.batch.ts > 0:
                self.on_batch(key, result.batch.ts)

    def _unreadable(self, source: str, default_rank: int) -> None:
        """A batch of ``source`` not read in full: what it removed is unknown, so it counts
        as lost and clears ``source`` (``reset_source``), as a batch missing from its seqs
        does; the events after the last one unread are applied then."""
        self.stats.lost_batches += 1
        log.warning("unreadable KV event batch from %s; clearing it", source or "engine")
        self.reset_source(source, default_rank)

    def _foreign_rank(self, source: str, rank: int, endpoint_rank: int) -> None:
        self.stats.foreign_rank_batches += 1
        if (source, rank) not in self._foreign and len(self._foreign) < 64:
            self._foreign.add((source, rank))
            log.warning(
                "KV events from %s name data-parallel rank %d, which replica %s does not have "
                "(its ranks: %s): filed under the endpoint's rank %d",
                source or "engine", rank, self.replica,
                " ".join(map(str, sorted(self._followed))), endpoint_rank,
            )  # fmt: skip

    def _learn_facts(self, events: Sequence[EngineEvent]) -> None:
        old = facts = self.facts
        for ev in events:
            if type(ev) is not EngineBlockStored:
                continue
            if not facts.names_groups and ev.kv_cache_spec_kind is not None:
                facts = replace(facts, names_groups=True)
            if not facts.lookahead_tokens and ev.lookahead_token_ids:
                facts = replace(facts, lookahead_tokens=ev.lookahead_tokens)
        if facts != old:
            self.facts = facts
            if self.on_facts is not None:
                self.on_facts(facts)

    def reset_source(self, source: str, default_rank: int = 0) -> None:
        """Events from ``source`` were lost or it restarted: clear what it told us."""
        for rank in self._ranks_of.get(source, {default_rank}):
            self.reblocker(rank).clear()
            self.sink(ReplicaKey(self.replica, rank), [AllCleared()])

    def clear(self, ranks: Iterable[int] = ()) -> None:
        """Forget every source (the engine restarted elsewhere, its cache new): the state
        of each of ``ranks`` and of every rank a payload named is cleared, as for a source
        that restarted (``reset_source``). The ranks followed are those of the subscribers
        made from then on."""
        for rank in sorted({*ranks, *self.reblockers}):
            self.reblocker(rank).clear()
            self.sink(ReplicaKey(self.replica, rank), [AllCleared()])
        self._ranks_of.clear()
        self._followed.clear()  # the next endpoints' subscribers name theirs
        self._foreign.clear()

    def subscriber(self, spec: EndpointSpec) -> ZmqEventSubscriber:
        from router.events.subscriber import ZmqEventSubscriber

        self._followed.add(spec.dp_rank)

        def on_payload(seq: int, payload: bytes) -> None:
            self.handle_payload(payload, spec.dp_rank, spec.endpoint)

        def on_lost(count: int) -> None:
            self.stats.lost_batches += count
            log.warning("lost %d KV event batches from %s; clearing it", count, spec.endpoint)
            self.reset_source(spec.endpoint, spec.dp_rank)

        def on_restart() -> None:
            self.stats.restarts += 1
            self.reset_source(spec.endpoint, spec.dp_rank)

        def on_dropped() -> None:
            self.stats.backlog_dropped += 1

        return ZmqEventSubscriber(
            spec.endpoint,
            on_payload,
            replay_endpoint=spec.replay_endpoint,
            topic=spec.topic,
            on_lost=on_lost,
            on_restart=on_restart,
            max_backlog_bytes=self.max_backlog_bytes,
            on_dropped=on_dropped,
        )


class SubscriberGroup:
    """Runs the subscribers of several endpoints as supervised tasks (``start``/``stop``).

    ``start`` returns once every subscriber is connected and raises what stopped one that
    never connected (a malformed endpoint, a terminated ZMQ context): a misconfigured
    publisher fails at start-up instead of waiting forever. A subscriber that fails after
    it connected is restarted with backoff (``restarts``, logged); it keeps its last
    sequence number and, as it runs again, asks the engine's replay socket from it: the
    batches it missed meanwhile come back (or count as lost, and clear that engine, when
    the replay cannot serve them), and an engine that restarted meanwhile is found
    (``ZmqEventSubscriber._catch_up``), even if it stays idle afterwards."""

    RESTART_BACKOFF_S = (0.1, 5.0)

    def __init__(self, ingest: EngineIngest, specs: Sequence[EndpointSpec]) -> None:
        self.ingest = ingest
        self.specs = tuple(specs)
        self.subscribers = [ingest.subscriber(s) for s in specs]
        self.restarts = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for sub in self.subscribers:
            self._tasks.append(
                asyncio.create_task(self._supervise(sub), name=f"zmq-sub {sub.endpoint}")
            )
        for sub, task in zip(self.subscribers, self._tasks, strict=True):
            connected = asyncio.ensure_future(sub.connected.wait())
            await asyncio.wait({connected, task}, return_when=asyncio.FIRST_COMPLETED)
            if not connected.done():
                connected.cancel()
                await self.stop()
                task.result()  # what stopped it; a subscriber never ends on its own

    async def _supervise(self, sub: ZmqEventSubscriber) -> None:
        first, most = self.RESTART_BACKOFF_S
        backoff = first
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not sub.connected.is_set():
                    raise
                self.restarts += 1
                if loop.time() - started > most:  # it ran well for a while: a fresh fault
                    backoff = first
                log.error(
                    "KV event subscriber of %s failed (%s: %s); restarting in %.1f s",
                    sub.endpoint, type(exc).__name__, exc, backoff,
                )  # fmt: skip
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, most)

    async def stop(self) -> None:
        """Stop the subscribers and wait until they have ended. A cancellation of the caller
        meanwhile is raised once they have (never swallowed: a task stopping them, then
        going on, is stopped)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        cancelled = False
        while not all(task.done() for task in tasks):
            try:
                await asyncio.wait(tasks)  # raises only the caller's own cancellation
            except asyncio.CancelledError:
                cancelled = True
        for task in tasks:
            # a task that ended with an error ended in ``start``, which raised it
            if not task.cancelled():
                task.exception()
        if cancelled:
            raise asyncio.CancelledError
