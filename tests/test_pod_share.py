"""Router pods sharing speculative entries and session bindings through a real Redis
(router/service/pod_share.py over router/service/pod_exchange.py): a session bound on one
pod is honoured by another, a prefix just sent from one pod draws the same-prefix request on
another to the same replica before any engine event, shared entries lapse with their
sender's TTL, and malformed or oversized messages are counted and ignored."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Sequence

from router.bench.redis_server import LocalRedis
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import Dispatch, RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    Decision,
    EventBatch,
    ReplicaKey,
    RouteRequest,
)
from router.service.peer_sum import PeerSum
from router.service.pod_exchange import ExchangeSettings, PodExchange
from router.service.pod_share import MAX_BLOCKS, MAX_MESSAGE_BYTES, MAX_ROWS, PodShare, _pack
from router.service.pod_snapshot import encode
from router.store.redis_store import connect
from tests.waiting import eventually

MODEL = "m"
KEYS = tuple(ReplicaKey(f"r{i}") for i in range(4))
BLOCK = 64


def settings(spec_ttl: float, session_ttl: float = 600.0) -> RoutingSettings:
    return RoutingSettings(block_size=BLOCK, speculative_ttl_s=spec_ttl, session_ttl_s=session_ttl)


class Pod:
    """One pod: its own index, load, engine and exchange (a task on the test's loop)."""

    def __init__(
        self, url: str, prefix: str, name: str, routing: RoutingSettings, mode: str = "stream"
    ) -> None:
        self.index = PrefixIndex()
        self.load = LoadTracker()
        for key in KEYS:
            self.load.add_replica(key)
        self.engine = RoutingEngine(self.index, self.load, make_policy("ours"), routing)
        self.share = PodShare({MODEL: self.engine}, lambda model, key: key in KEYS)
        self.share.attach()
        self.client = connect(url)
        loop = asyncio.get_running_loop()
        ex = ExchangeSettings(mode, prefix, name, 0.005, 0.5)
        self.exchange = PodExchange(
            ex, self.client, self.load, PeerSum(self.load), loop.time, self.share
        )
        self.task = asyncio.create_task(self.exchange.run())
        self.rng = random.Random(1)
        self.n = 0

    def route(self, hashes: Sequence[int], session: str | None = None) -> tuple[ReplicaKey, int]:
        """Route and finish at once (no load left behind): (replica, usable tokens)."""
        self.n += 1
        rid = f"{self.exchange.member}-{self.n}"
        request = RouteRequest(rid, MODEL, len(hashes) * BLOCK, list(hashes), BLOCK, session)
        now = asyncio.get_running_loop().time()
        decision = self.engine.route(request, KEYS, now, self.rng)
        self.engine.dispatched(request, decision, now)
        self.load.first_token(rid)
        self.load.complete(rid)
        return decision.replica, decision.usable_tokens

    def dispatch(self, hashes: Sequence[int], session: str | None, to: ReplicaKey) -> Dispatch:
        """Send a request to ``to`` and leave it in flight: its dispatch."""
        self.n += 1
        rid = f"{self.exchange.member}-{self.n}"
        request = RouteRequest(rid, MODEL, len(hashes) * BLOCK, list(hashes), BLOCK, session)
        now = asyncio.get_running_loop().time()
        return self.engine.dispatched(request, self.engine.route(request, [to], now, self.rng), now)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.client.aclose()


@contextlib.asynccontextmanager
async def two_pods(
    url: str, prefix: str, routing: RoutingSettings, mode: str = "stream"
) -> AsyncIterator[list[Pod]]:
    pods = [Pod(url, prefix, name, routing, mode) for name in ("p1", "p2")]
    try:
        # both read the stream (each has seen the other's first snapshot) before the test
        await eventually(lambda: all(p.exchange.views.views for p in pods))
        yield pods
    finally:
        for pod in pods:
            await pod.stop()


async def test_a_session_bound_on_one_pod_is_honoured_by_another(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    # no speculative entries at all: only the session binding can carry the affinity
    async with two_pods(redis_server.url, key_prefix, settings(0.0)) as (one, two):
        turn1 = list(range(1, 17))
        replica, _ = one.route(turn1, session="conversation-1")
        await eventually(lambda: two.share.counters.applied_sessions == 1)
        assert two.index.match(turn1).get(replica).kv_blocks == 0  # nothing in its index
        turn2 = [*turn1, 101, 102, 103, 104]
        assert two.route(turn2, session="other")[1] == 0  # another session: no credit
        got, usable = two.route(turn2, session="conversation-1")
        assert (got, usable) == (replica, len(turn1) * BLOCK)


async def test_a_hash_mode_members_first_dispatch_reaches_the_others(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """In ``hash`` mode a reader polls every field within the bound: the first message of a
    member it has been reading (its heartbeats) that carries rows was written since the
    previous poll, not long ago. Its rows apply, as every later message's do."""
    async with two_pods(redis_server.url, key_prefix, settings(0.0), "hash") as (one, two):
        # two has read one's field (its heartbeats) at more than one poll
        first = two.exchange.counters.received
        await eventually(lambda: two.exchange.counters.received > first + 2)
        turn1 = list(range(1, 17))
        replica, _ = one.route(turn1, session="conversation-5")
        await eventually(lambda: two.share.counters.applied_sessions == 1)
        got, usable = two.route([*turn1, 101, 102], session="conversation-5")
        assert (got, usable) == (replica, len(turn1) * BLOCK)


async def test_a_hash_reader_back_from_an_outage_does_not_take_rows_it_cannot_date(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A ``hash`` reader that could not poll for longer than the bound finds, when it is
    back, a field whose version moved meanwhile: its rows may have been written just after
    the last poll, and their TTLs counted down since (the member may have died then). They
    must not apply as if just sent: the sender's own entries lapsed long ago."""
    routing = RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True)
    clock = [100.0]
    client = connect(redis_server.url)
    try:
        pods = []
        for name in ("p1", "p2"):
            load = LoadTracker()
            for key in KEYS:
                load.add_replica(key)
            engine = RoutingEngine(PrefixIndex(), load, make_policy("ours"), routing)
            share = PodShare({MODEL: engine}, lambda model, key: key in KEYS)
            share.attach()
            ex = ExchangeSettings("hash", key_prefix, name, 0.005, 0.5)
            exchange = PodExchange(ex, client, load, PeerSum(load), lambda: clock[0], share)
            pods.append((engine, share, exchange))
        (sender, _, one), (reader, got, two) = pods

        def send(prompt: list[int], session: str) -> Dispatch:
            request = RouteRequest(session, MODEL, len(prompt) * BLOCK, prompt, BLOCK, session)
            decision = sender.route(request, [KEYS[1]], clock[0], random.Random(1))
            return sender.dispatched(request, decision, clock[0])

        async def poll(step: float) -> None:
            clock[0] += step
            await one.poll_hash(clock[0])
            await two.poll_hash(clock[0])

        await poll(0.0)
        await poll(0.01)
        refused = send(list(range(1, 9)), "conversation-6")
        await poll(0.01)
        assert got.counters.applied_sessions == 1  # read within the bound: applies
        assert reader.index.match(list(range(1, 10)), now=clock[0]).get(KEYS[1]).kv_blocks == 8
        send(list(range(50, 58)), "conversation-7")
        sender.withdraw(refused)
        clock[0] += 0.01
        await one.poll_hash(clock[0])  # its last message; then it dies
        clock[0] += 20.0  # two polls again 20 s later: one's new entries lapsed at 130 s
        await two.poll_hash(clock[0])
        assert got.counters.applied_spec == 1 and got.counters.applied_sessions == 1
        # what it took of the earlier message is taken back all the same
        assert got.counters.withdrawn == 1
        assert reader.index.match(list(range(1, 10)), now=clock[0]).get(KEYS[1]).kv_blocks == 0
        assert reader.sessions is not None
        assert reader.sessions.get("conversation-6", clock[0]) is None
        clock[0] += 20.0
        assert reader.index.match(list(range(50, 59)), now=clock[0]).get(KEYS[1]).kv_blocks == 0
        assert reader.sessions.get("conversation-7", clock[0]) is None
    finally:
        await client.aclose()


async def test_a_session_id_json_can_carry_but_utf_8_cannot_is_shared_too(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A JSON body's ``user`` may hold a lone surrogate escape (``"\\ud800"``), which the
    router's parser takes as Python's standard library does: its session digest must not
    raise, or the dispatch fails after its load was counted (a request in flight forever on
    its replica) and, once another pod's binding is known, every request of that session
    fails in routing."""
    async with two_pods(redis_server.url, key_prefix, settings(0.0)) as (one, two):
        session = "conversation-\ud800"
        turn1 = list(range(1, 17))
        replica, _ = one.route(turn1, session=session)
        assert one.load.in_flight() == 0  # routed and finished: nothing left behind
        await eventually(lambda: two.share.counters.applied_sessions == 1)
        got, usable = two.route([*turn1, 101, 102, 103, 104], session=session)
        assert (got, usable) == (replica, len(turn1) * BLOCK)


async def test_speculative_entries_draw_the_same_prefix_before_any_event(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    async with two_pods(redis_server.url, key_prefix, settings(30.0, 0.0)) as (one, two):
        prefix = list(range(1000, 1032))
        replica, _ = one.route(prefix)
        await eventually(lambda: two.share.counters.applied_spec == 1)
        got, usable = two.route([*prefix, 7, 8])
        assert (got, usable) == (replica, len(prefix) * BLOCK)
        # and back: pod one learns what pod two just sent (its own entry came first)
        assert one.share.counters.applied_spec == 0
        await eventually(lambda: one.share.counters.applied_spec == 1)


async def test_a_dispatch_refused_on_one_pod_is_withdrawn_on_another(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    routing = RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True)
    async with two_pods(redis_server.url, key_prefix, routing) as (one, two):
        prompt = list(range(300, 320))
        refused = one.dispatch(prompt, "conversation-2", KEYS[2])
        counters = two.share.counters
        await eventually(lambda: counters.applied_spec == counters.applied_sessions == 1)
        assert two.index.match(prompt).get(KEYS[2]).kv_blocks == 20
        assert two.engine.sessions is not None
        loop = asyncio.get_running_loop()
        assert two.engine.sessions.get("conversation-2", loop.time()) is not None
        one.engine.withdraw(refused)  # the replica refused it
        await eventually(lambda: two.index.match(prompt).get(KEYS[2]).kv_blocks == 0)
        assert two.engine.sessions.get("conversation-2", loop.time()) is None
        assert not two.index.awaits(KEYS[2], prompt[-1])


async def test_a_pod_that_leaves_sends_the_withdrawals_it_still_held(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A dispatch refused in a pod's last moments: the pod's leaving message carries the
    withdrawal, or the other pods keep the refused dispatch's entries and binding for
    their whole TTL (stream mode; a hash mode pod's row is deleted as it leaves)."""
    routing = RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True)
    async with two_pods(redis_server.url, key_prefix, routing) as (one, two):
        prompt = list(range(500, 520))
        refused = one.dispatch(prompt, "conversation-4", KEYS[0])
        counters = two.share.counters
        await eventually(lambda: counters.applied_spec == counters.applied_sessions == 1)
        one.task.cancel()  # stopping: its exchange loop sends nothing more
        with contextlib.suppress(asyncio.CancelledError):
            await one.task
        one.engine.withdraw(refused)  # the replica refused it as the pod stopped
        await one.exchange.leave()
        await eventually(lambda: two.index.match(prompt).get(KEYS[0]).kv_blocks == 0)
        assert two.engine.sessions is not None
        loop = asyncio.get_running_loop()
        assert two.engine.sessions.get("conversation-4", loop.time()) is None


async def test_a_withdrawal_in_flight_when_the_pod_stops_goes_in_its_leaving_message(
    private_redis: LocalRedis,
) -> None:
    """A pod stops while its last message waits on a Redis that holds writes (``CLIENT
    PAUSE WRITE``, as a failover does): the stop cancels that write, which never lands,
    so its withdrawal must go in the leaving message, or the other pods keep the refused
    dispatch's entries and binding for their whole TTL."""
    routing = RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True)
    async with two_pods(private_redis.url, "kvr", routing) as (one, two):
        prompt = list(range(600, 620))
        refused = one.dispatch(prompt, "conversation-8", KEYS[3])
        counters = two.share.counters
        await eventually(lambda: counters.applied_spec == counters.applied_sessions == 1)
        admin = connect(private_redis.url)
        try:
            await admin.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
            one.engine.withdraw(refused)  # the replica refused it
            await eventually(lambda: not one.share.outbox)  # its message is on its way
            one.task.cancel()  # the pod stops
            with contextlib.suppress(asyncio.CancelledError):
                await one.task
            leaving = asyncio.create_task(one.exchange.leave())
            await admin.execute_command("CLIENT", "UNPAUSE")
            await leaving
            await eventually(lambda: two.index.match(prompt).get(KEYS[3]).kv_blocks == 0)
            assert two.engine.sessions is not None
            loop = asyncio.get_running_loop()
            assert two.engine.sessions.get("conversation-8", loop.time()) is None
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
            await admin.aclose()


async def test_a_withdrawal_redis_refused_is_sent_again(private_redis: LocalRedis) -> None:
    """A message Redis refuses (full under ``noeviction``, a failover) carried a
    withdrawal: it must go in a later message, or the other pods keep the refused
    dispatch's entries and binding for their whole TTL."""
    routing = RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True)
    async with two_pods(private_redis.url, "kvr", routing) as (one, two):
        prompt = list(range(400, 420))
        refused = one.dispatch(prompt, "conversation-3", KEYS[1])
        counters = two.share.counters
        await eventually(lambda: counters.applied_spec == counters.applied_sessions == 1)
        admin = connect(private_redis.url)
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")  # every write now fails with OOM
            errors = one.exchange.counters.errors
            one.engine.withdraw(refused)  # the replica refused it
            # a message made after the withdrawal (the second refused since) carried it
            await eventually(lambda: one.exchange.counters.errors >= errors + 2)
            await admin.config_set("maxmemory", "0")
            await eventually(lambda: two.index.match(prompt).get(KEYS[1]).kv_blocks == 0)
            assert two.engine.sessions is not None
            loop = asyncio.get_running_loop()
            assert two.engine.sessions.get("conversation-3", loop.time()) is None
        finally:
            await admin.config_set("maxmemory", "0")
            await admin.aclose()


def test_shared_entries_lapse_with_the_senders_ttl() -> None:
    routing = settings(1.0, 2.0)
    sender = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
    receiver = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
    out = PodShare({MODEL: sender}, lambda m, k: True)
    out.attach()
    into = PodShare({MODEL: receiver}, lambda m, k: True)
    hashes = [5, 6, 7]
    request = RouteRequest("r", MODEL, 3 * BLOCK, hashes, BLOCK, "s")
    sender.on_dispatch(request, KEYS[1], [], 0.0, 1.0, 3)  # as dispatched() at t=0
    rows = out.outbox.take(0.5)  # sent half a second later: 0.5 s / 1.5 s left
    into.apply(rows, 100.0)  # read on a clock of its own
    assert receiver.index.match(hashes, now=100.4).get(KEYS[1]).kv_blocks == 3
    assert receiver.sessions is not None
    assert receiver.sessions.get("s", 101.4) is not None
    assert receiver.index.match(hashes, now=100.6).get(KEYS[1]).kv_blocks == 0
    assert receiver.sessions.get("s", 101.6) is None
    # rows known to have waited in the stream (age from the entry ids) lose that much
    late = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
    PodShare({MODEL: late}, lambda m, k: True).apply(rows, 100.0, age_s=0.4)
    assert late.index.match(hashes, now=100.05).get(KEYS[1]).kv_blocks == 3
    assert late.index.match(hashes, now=100.15).get(KEYS[1]).kv_blocks == 0
    # rows for a replica this pod does not serve are skipped, not applied elsewhere
    skip = PodShare({MODEL: receiver}, lambda m, k: False)
    sender.on_dispatch(request, KEYS[2], [], 200.0, 1.0, 3)
    skip.apply(out.outbox.take(200.0), 200.0)
    assert skip.counters.applied_spec == 0 and skip.counters.rejected == 0


async def test_malformed_or_oversized_messages_are_counted_and_ignored(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    async with two_pods(redis_server.url, key_prefix, settings(30.0)) as (one, two):
        good = list(range(50, 60))
        bad_rows = [
            ["m"],
            [MODEL, "r0", 0, -5, "", "", "", 0, "0", 0],
            [MODEL, "r0", 0, 1000, "not base64!", "", "", 0, "0", 0],
            [MODEL, "r0", 0, 1000, "", "", "12", "x", "0", 1000],
            [MODEL, "r0", 0, 1000, "", "", "-1", 3, "0", 1000],
        ]
        junk = [
            b"not json",
            b"[" * 100_000,
            b'{"load": [], "m": "x/1", "p": "x", "s": 1, "x": "rows?"}',
            b'{"load": [], "m": "x/1", "p": "x", "s": 2, "x": '
            + json.dumps(bad_rows).encode()
            + b"}",
            b'{"load": [], "m": "x/1", "p": "x", "s": 3, "x": []' + b" " * MAX_MESSAGE_BYTES + b"}",
        ]
        key = two.exchange.settings.stream_key
        for data in junk:
            await two.client.xadd(key, {b"s": data})
        await two.client.xadd(key, {b"other": b"field"})
        counters = two.share.counters, two.exchange.counters
        await eventually(lambda: counters[0].rejected + counters[1].rejected >= 10, timeout=5)
        assert two.share.counters.rejected == 1 + len(bad_rows)
        assert two.exchange.counters.rejected == 4
        replica, _ = one.route(good)
        await eventually(lambda: two.share.counters.applied_spec == 1)
        assert two.route([*good, 1]) == (replica, len(good) * BLOCK)
        assert not two.task.done() and not one.task.done()


def test_a_hash_field_seen_first_is_not_trusted_for_its_rows() -> None:
    """In hash mode a field may have been written long before the first poll reads it (its
    member dead): its rows wait for the member's next version."""
    engine = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings(30.0))
    sender = PodShare({MODEL: engine}, lambda m, k: True)
    sender.attach()
    share = PodShare({MODEL: engine}, lambda m, k: True)
    ex = ExchangeSettings("hash", "kvr", "me", 0.005, 0.5)
    exchange = PodExchange(ex, None, LoadTracker(), PeerSum(LoadTracker()), lambda: 0.0, share)
    request = RouteRequest("r", MODEL, BLOCK, [9], BLOCK, "s")

    def message(seq: int) -> bytes:
        engine.on_dispatch(request, KEYS[0], [], 0.0, 30.0, 1)
        return encode("old/1", "old", seq, LoadTracker(), sender.outbox.take(0.0))

    exchange._take(message(1), 0.0, dated=False)  # the first poll: it cannot date it
    exchange._take(message(1), 0.0)  # the same version again, at the next poll
    assert share.counters.applied_spec == 0
    exchange._take(message(2), 0.0)
    assert share.counters.applied_spec == 1


def test_a_shared_entry_never_outlives_the_readers_own_ttl() -> None:
    """A row's TTL (a peer's, or a malformed one) is capped like a session's: never longer
    than this pod speculates itself."""
    engine = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings(2.0))
    share = PodShare({MODEL: engine}, lambda m, k: True)
    huge = 10**15  # ms: some 30,000 years
    share.apply({"x": [[MODEL, "r0", 0, huge, _pack((5, 6)), "", "", 0, "0", 0]]}, 100.0)
    assert share.counters.applied_spec == 1
    assert engine.index.match([5, 6], now=101.9).get(KEYS[0]).kv_blocks == 2
    assert engine.index.match([5, 6], now=102.1).get(KEYS[0]).kv_blocks == 0
    longer = PodShare({MODEL: engine}, lambda m, k: True, lambda model: 600.0)
    longer.apply({"x": [[MODEL, "r0", 0, huge, _pack((7,)), "", "", 0, "0", 0]]}, 100.0)
    assert engine.index.match([7], now=699.0).get(KEYS[0]).kv_blocks == 1
    assert engine.index.match([7], now=701.0).get(KEYS[0]).kv_blocks == 0


def _session_shared(
    routing: RoutingSettings, turn1: tuple[int, ...]
) -> tuple[RoutingEngine, RoutingEngine, Decision]:
    """A sender pod routes session ``s``'s first turn; a receiver pod learns its binding."""
    sender = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
    receiver = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
    for engine in (sender, receiver):
        for key in KEYS:
            engine.load.add_replica(key)
    out = PodShare({MODEL: sender}, lambda m, k: True)
    out.attach()
    into = PodShare({MODEL: receiver}, lambda m, k: True)
    first = RouteRequest("t1", MODEL, len(turn1) * BLOCK + 5, list(turn1), BLOCK, "s")
    decision = sender.route(first, KEYS, 0.0, random.Random(1))
    sender.dispatched(first, decision, 0.0)
    into.apply(out.outbox.take(0.0), 0.0)
    assert into.counters.applied_sessions == 1
    return sender, receiver, decision


def test_a_shared_session_hint_lapses_when_the_engines_events_come() -> None:
    """A peer's binding covers the event lag as the pod's own hints do: once the replica's
    events report the prompt stored, the index alone tells, an eviction since included."""
    turn1 = tuple(range(1, 19))
    _, receiver, decision = _session_shared(RoutingSettings(BLOCK, speculative_ttl_s=0.0), turn1)
    second = RouteRequest("t2", MODEL, 24 * BLOCK + 5, [*turn1, *range(50, 56)], BLOCK, "s")

    def credited() -> int:
        got = receiver.candidates(second, KEYS, 1.0)
        assert isinstance(got, list)
        return next(c.match.usable_blocks for c in got if c.replica == decision.replica)

    assert credited() == 18  # the lag: the binding
    receiver.index.apply(EventBatch(decision.replica, [BlocksStored(turn1)]))
    receiver.index.apply(EventBatch(decision.replica, [BlocksRemoved(turn1[6:])]))
    assert credited() == 6  # what the index still holds


def test_a_shared_session_hint_credits_only_what_the_engine_will_grant() -> None:
    """A peer's binding reaches as far as the sender's own hint: the engine's grant (here
    engine blocks of 4 router blocks and EAGLE's dropped block), not the whole prompt."""
    routing = RoutingSettings(
        block_size=BLOCK, speculative_ttl_s=0.0, engine_block_size=4 * BLOCK, eagle=True
    )
    turn1 = tuple(range(1, 19))  # 18 router blocks: 16 in engine blocks, 12 granted
    sender, receiver, decision = _session_shared(routing, turn1)
    second = RouteRequest("t2", MODEL, 24 * BLOCK + 5, [*turn1, *range(50, 56)], BLOCK, "s")

    def credited(engine: RoutingEngine) -> int:
        got = engine.candidates(second, KEYS, 1.0)
        assert isinstance(got, list)
        return next(c.match.usable_blocks for c in got if c.replica == decision.replica)

    assert credited(sender) == 12
    assert credited(receiver) == credited(sender)
    # the replica restarted since (its cache forgotten here): the binding credits nothing
    receiver.index.add_replica(decision.replica)
    receiver.index.apply(EventBatch(decision.replica, [AllCleared()]))
    assert credited(receiver) == 0


def test_a_message_of_long_prompts_stays_within_what_readers_take() -> None:
    """``MAX_ROWS`` pending dispatches of ``MAX_BLOCKS`` blocks (a burst, or what piled up
    while Redis hung) would make a message over ``MAX_MESSAGE_BYTES``, which every reader
    drops whole, its load snapshot included: the rows a message cannot hold go in the next
    ones, and every row arrives."""
    sender = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings(30.0))
    receiver = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings(30.0))
    out = PodShare({MODEL: sender}, lambda m, k: True)
    out.attach()
    into = PodShare({MODEL: receiver}, lambda m, k: True)
    ex = ExchangeSettings("stream", "kvr", "me", 0.005, 0.5)
    exchange = PodExchange(ex, None, LoadTracker(), PeerSum(LoadTracker()), lambda: 0.0, into)
    for i in range(MAX_ROWS):
        hashes = [i * MAX_BLOCKS + j + 1 for j in range(MAX_BLOCKS)]
        request = RouteRequest(f"r{i}", MODEL, MAX_BLOCKS * BLOCK, hashes, BLOCK)
        sender.on_dispatch(request, KEYS[i % len(KEYS)], [hashes[-1]], 0.0, 30.0, 0)
    seq = 0
    while out.outbox and seq < MAX_ROWS:
        seq += 1
        data = encode("them/1", "them", seq, LoadTracker(), out.outbox.take(0.0))
        assert len(data) <= MAX_MESSAGE_BYTES
        exchange._take(data, 0.0)
    assert exchange.counters.rejected == 0 and into.counters.rejected == 0
    assert into.counters.applied_spec == MAX_ROWS
    last = [(MAX_ROWS - 1) * MAX_BLOCKS + j + 1 for j in range(MAX_BLOCKS)]
    assert receiver.index.match(last, now=1.0).get(KEYS[-1]).kv_blocks == MAX_BLOCKS


class Pair:
    """A sender pod's engine and a receiver pod's; the sender's messages go through the
    exchange's own encoding and reading (``encode`` / ``PodExchange._take``), by hand."""

    def __init__(self, routing: RoutingSettings) -> None:
        self.sender = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
        self.receiver = RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), routing)
        for engine in (self.sender, self.receiver):
            for key in KEYS:
                engine.load.add_replica(key)
        self.out = PodShare({MODEL: self.sender}, lambda m, k: True)
        self.out.attach()
        self.into = PodShare({MODEL: self.receiver}, lambda m, k: True)
        ex = ExchangeSettings("stream", "kvr", "me", 0.005, 0.5)
        self.exchange = PodExchange(
            ex, None, LoadTracker(), PeerSum(LoadTracker()), lambda: 0.0, self.into
        )
        self.seq = 0

    def dispatch(
        self, engine: RoutingEngine, hashes: Sequence[int], session: str | None, to: ReplicaKey,
        now: float,
    ) -> Dispatch:  # fmt: skip
        self.seq += 1
        request = RouteRequest(
            f"q{self.seq}", MODEL, len(hashes) * BLOCK, list(hashes), BLOCK, session
        )
        decision = engine.route(request, [to], now, random.Random(1))
        return engine.dispatched(request, decision, now)

    def send(self, now: float) -> dict[str, object]:
        """The sender's next message, read by the receiver; returns it decoded."""
        self.seq += 1
        data = encode("them/1", "them", self.seq, LoadTracker(), self.out.outbox.take(now))
        self.exchange._take(data, now)
        doc: dict[str, object] = json.loads(data)
        return doc


def test_a_withdrawn_dispatch_is_taken_back_on_the_other_pods() -> None:
    """A dispatch the replica refused (RoutingEngine.withdraw) leaves no trace on the other
    pods either: its speculative entries go (those no later call named again: the
    receiver's own here), its session binding gives way to the session's previous one, and
    its last block is no longer awaited (which would keep the binding crediting for the
    session's whole TTL: no event comes of a prompt the replica never took)."""
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True))
    a, b = KEYS[0], KEYS[1]
    turn1 = list(range(1, 17))
    pair.dispatch(pair.sender, turn1, "s", a, 0.0)
    pair.send(0.0)
    turn2 = [*turn1, *range(100, 108)]
    refused = pair.dispatch(pair.sender, turn2, "s", b, 1.0)
    pair.send(1.0)
    receiver = pair.receiver
    assert receiver.sessions is not None and pair.sender.sessions is not None
    assert receiver.index.match(turn2, now=1.5).get(b).kv_blocks == 24
    assert receiver.sessions.get("s", 1.5) is not None
    assert receiver.sessions.get("s", 1.5).replica == b  # type: ignore[union-attr]
    assert receiver.index.awaits(b, turn2[-1])
    pair.dispatch(receiver, turn1[:8], None, b, 1.5)  # the receiver's own guess of b
    pair.sender.withdraw(refused)
    pair.send(2.0)
    assert pair.into.counters.rejected == 0 and pair.exchange.counters.rejected == 0
    assert receiver.index.match(turn2, now=2.0).get(b).kv_blocks == 8  # its own guess
    assert receiver.index.match(turn1, now=2.0).get(a).kv_blocks == 16  # turn 1's stays
    hint = receiver.sessions.get("s", 2.0)
    assert hint is not None and hint.replica == a
    assert (hint.replica, hint.blocks) == (a, pair.sender.sessions.get("s", 2.0).blocks)  # type: ignore[union-attr]
    assert not receiver.index.awaits(b, turn2[-1])
    # the receiver's credit for the session's next turn is the sender's own
    turn3 = RouteRequest("t3", MODEL, 30 * BLOCK, [*turn2, *range(200, 206)], BLOCK, "s")
    got = {c.replica: c.match.usable_blocks for c in receiver.candidates(turn3, KEYS, 2.0)}  # type: ignore[union-attr]
    own = {c.replica: c.match.usable_blocks for c in pair.sender.candidates(turn3, KEYS, 2.0)}  # type: ignore[union-attr]
    assert got[b] == 8 and own[b] == 0 and got[a] == own[a] > 0


def test_a_dispatch_withdrawn_before_it_was_sent_is_never_sent() -> None:
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True))
    pair.sender.withdraw(pair.dispatch(pair.sender, list(range(1, 9)), "s", KEYS[2], 0.0))
    assert not pair.out.outbox
    pair.dispatch(pair.sender, list(range(20, 29)), None, KEYS[3], 0.0)
    doc = pair.send(0.0)
    assert len(doc["x"]) == 1 and "w" not in doc  # type: ignore[arg-type]
    assert pair.into.counters.applied_spec == 1 and pair.into.counters.applied_sessions == 0
    assert pair.receiver.index.match(list(range(1, 9)), now=1.0).get(KEYS[2]).kv_blocks == 0


def test_a_message_that_did_not_get_through_goes_again() -> None:
    """What a refused message carried goes in the next one, rows with the TTLs then
    remaining; a dispatch withdrawn meanwhile (while Redis was being asked) goes only as
    its withdrawal."""
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=30.0))
    outbox, receiver = pair.out.outbox, pair.receiver
    sent = pair.dispatch(pair.sender, list(range(1, 9)), None, KEYS[1], 0.0)
    pair.send(0.0)
    assert receiver.index.match(list(range(1, 9)), now=1.0).get(KEYS[1]).kv_blocks == 8
    pair.sender.withdraw(sent)
    kept = pair.dispatch(pair.sender, list(range(20, 29)), None, KEYS[2], 1.0)
    refused = pair.dispatch(pair.sender, list(range(40, 49)), None, KEYS[3], 1.0)
    lost = outbox.take(1.0)  # a message Redis refuses
    assert lost["i"] == [kept.shared, refused.shared] and lost["w"] == [sent.shared]
    pair.sender.withdraw(refused)  # meanwhile
    outbox.put_back()
    doc = pair.send(2.0)
    assert doc["i"] == [kept.shared] and doc["w"] == [sent.shared, refused.shared]
    assert [row[3] for row in doc["x"]] == [29_000]  # type: ignore[attr-defined]
    assert receiver.index.match(list(range(1, 9)), now=2.0).get(KEYS[1]).kv_blocks == 0
    assert receiver.index.match(list(range(20, 29)), now=2.0).get(KEYS[2]).kv_blocks == 9
    assert receiver.index.match(list(range(40, 49)), now=2.0).get(KEYS[3]).kv_blocks == 0


def test_a_row_heard_twice_is_taken_once() -> None:
    """A message the sender took for lost (Redis did not answer in time) may have got
    through after all: its rows come again in the next one. Taken twice, the second
    binding would replace the first of the same dispatch, and its withdrawal would give
    the session back that refused binding."""
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=30.0, speculate_sessions=True))
    a, b = KEYS[0], KEYS[1]
    turn1 = list(range(1, 17))
    pair.dispatch(pair.sender, turn1, "s", a, 0.0)
    pair.send(0.0)
    turn2 = [*turn1, *range(100, 108)]
    refused = pair.dispatch(pair.sender, turn2, "s", b, 1.0)
    pair.send(1.0)  # it reached the readers, but Redis's answer did not come back
    pair.out.outbox.put_back()
    again = pair.send(1.5)
    assert again["i"] == [refused.shared]
    assert pair.into.counters.applied_sessions == 2  # turn 1, and turn 2 once
    pair.sender.withdraw(refused)
    pair.send(2.0)
    receiver = pair.receiver
    assert receiver.sessions is not None
    hint = receiver.sessions.get("s", 2.0)
    assert hint is not None and hint.replica == a
    assert receiver.index.match(turn2, now=2.0).get(b).kv_blocks == 0


def test_a_binding_read_late_loses_to_the_readers_own_later_one() -> None:
    """A reader catching up on a backlog (it was cut off from Redis) reads a binding
    another pod made before the reader's own next turn of the same session: its own, the
    more recent, stays the session's (as the sender made it, not as the reader read it)."""
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=0.0))
    a, b = KEYS[0], KEYS[1]
    turn1 = list(range(1, 17))
    pair.dispatch(pair.sender, turn1, "s", a, 2.0)  # the other pod, at 2
    late = encode("them/1", "them", 1, LoadTracker(), pair.out.outbox.take(2.0))
    pair.dispatch(pair.receiver, [*turn1, *range(100, 108)], "s", b, 5.0)  # its own, at 5
    pair.exchange._take(late, 10.0, age_s=8.0)  # read at 10, known to be 8 s old
    assert pair.into.counters.applied_sessions == 1
    assert pair.receiver.sessions is not None
    hint = pair.receiver.sessions.get("s", 10.0)
    assert hint is not None and hint.replica == b
    # a binding made after its own still wins, and lapses at its sender's expiry
    pair.dispatch(pair.sender, turn1, "s", a, 6.0)
    late = encode("them/1", "them", 2, LoadTracker(), pair.out.outbox.take(6.0))
    pair.exchange._take(late, 10.0, age_s=4.0)
    hint = pair.receiver.sessions.get("s", 10.0)
    assert hint is not None and hint.replica == a and hint.at == 6.0


def test_withdrawals_reach_readers_of_the_previous_version_as_nothing() -> None:
    """A rolling update runs pods of both versions: the dispatch rows (``x``) keep the
    previous version's ten fields, and what names and withdraws them travels in fields of
    the message it never reads; a message of the previous version (rows without ids)
    applies here as before."""
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=30.0))
    sent = pair.dispatch(pair.sender, list(range(1, 9)), None, KEYS[1], 0.0)
    first = pair.send(0.0)
    pair.sender.withdraw(sent)
    second = pair.send(0.0)
    assert all(isinstance(row, list) and len(row) == 10 for row in first["x"])  # type: ignore[attr-defined]
    assert "x" not in second and second["w"]
    old = PodShare(
        {MODEL: RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings(30.0))},
        lambda m, k: True,
    )
    old.apply({"x": first["x"]}, 0.0)  # what a previous version's reader takes of either
    old.apply({}, 0.0)
    assert old.counters.applied_spec == 1 and old.counters.rejected == 0


def test_malformed_withdrawals_are_counted_and_ignored() -> None:
    pair = Pair(RoutingSettings(BLOCK, speculative_ttl_s=30.0))
    sent = pair.dispatch(pair.sender, list(range(1, 9)), None, KEYS[1], 0.0)
    doc = pair.send(0.0)
    assert doc["x"]
    junk: list[dict[str, object]] = [
        {"w": "1"},
        {"w": [1.5, "2", -3]},
        {"w": [0] * 100_000},
        {"x": [], "i": [1, 2]},
        {"x": [[MODEL, "r3", 0, 1000, _pack((7, 8)), "", "", 0, "0", 0]], "i": [[1]]},
    ]
    for seq, fields in enumerate(junk, 1000):
        body = {"load": [], "m": "them/1", "p": "them", "s": seq, **fields}
        pair.exchange._take(json.dumps(body).encode(), 0.0)
    assert pair.into.counters.rejected == 1 + 3 + 1 + 1 + 1
    pair.sender.withdraw(sent)  # the real withdrawal still works
    pair.send(0.0)
    assert pair.receiver.index.match(list(range(1, 9)), now=1.0).get(KEYS[1]).kv_blocks == 0
