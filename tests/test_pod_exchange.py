"""Router pods sharing in-flight load through a real Redis (router/service/pod_exchange.py):
both mechanisms, standalone and Cluster, a pod that dies stops counting within the staleness
bound, and the exchange recovers by itself from a Redis restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator

import pytest

from router.bench.redis_server import LocalRedis, LocalRedisCluster
from router.core.load import LoadTracker, PeerLoad
from router.core.types import ReplicaKey
from router.service import pod_exchange, pod_exchange_app
from router.service.peer_sum import PeerSum
from router.service.pod_exchange import ExchangeSettings, PodExchange
from router.service.pod_snapshot import Snapshot, decode, encode
from router.service.pod_views import PodViews
from router.service.workers import Workers
from router.store.redis_store import connect
from router.tasks import stop
from tests.waiting import eventually

A = ReplicaKey("a", 0)
STALE_S = 0.5


class Pod:
    """One pod's tracker and exchange, running as a task."""

    def __init__(self, url: str, prefix: str, name: str, mode: str) -> None:
        self.load = LoadTracker()
        self.load.add_replica(A)
        self.client = connect(url)
        settings = ExchangeSettings(mode, prefix, name, 0.005, STALE_S)
        loop = asyncio.get_running_loop()
        self.exchange = PodExchange(settings, self.client, self.load, PeerSum(self.load), loop.time)
        self.task = asyncio.create_task(self.exchange.run())

    def prefilling(self) -> int:
        return self.load.view(A, 0.0).prefilling

    async def die(self) -> None:
        """Stop without a word to the others (a killed pod)."""
        await stop(self.task)
        await self.client.aclose()


@contextlib.asynccontextmanager
async def pods(
    url: str, prefix: str, mode: str, names: tuple[str, ...]
) -> AsyncIterator[list[Pod]]:
    running = [Pod(url, prefix, name, mode) for name in names]
    try:
        yield running
    finally:
        for pod in running:
            if not pod.task.done():
                await pod.die()


def test_snapshot_round_trip_and_views_age_out() -> None:
    load = LoadTracker()
    load.dispatch("r1", A, prompt_tokens=100, cached_tokens=40)
    snap = decode(encode("p1/7", "p1", 3, load))
    assert (snap.member, snap.pod, snap.seq) == ("p1/7", "p1", 3)
    assert snap.load[A] == load.own(A)
    with pytest.raises(ValueError):
        decode(b'{"load": []}')
    views = PodViews("me", stale_s=1.0)
    views.take(Snapshot("me/1", "me", 1, snap.load), 0.0)  # own pod: the sockets cover it
    views.take(snap, 0.0)
    assert views.total(0.9) == {A: snap.load[A]} and views.ages(0.9) == {"p1": 0.9}
    views.take(snap, 0.95)  # the same seq again (a hash re-read): not a sign of life
    assert views.total(1.01) == {}  # silent past the bound: no longer counted
    views.take(Snapshot("p1/7", "p1", 4, {A: PeerLoad(prefilling=2)}), 1.1)
    assert views.total(1.2) == {A: PeerLoad(prefilling=2)}


@pytest.mark.parametrize("mode", ["stream", "hash"])
async def test_pods_count_each_others_requests(
    mode: str, redis_server: LocalRedis, key_prefix: str
) -> None:
    async with pods(redis_server.url, key_prefix, mode, ("p1", "p2", "p3")) as (one, two, three):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        two.load.dispatch("r2", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: three.prefilling() == 2 and one.prefilling() == 2)
        assert three.load.own(A) == PeerLoad()  # counted as peers', not its own
        one.load.first_token("r1")
        one.load.complete("r1")
        await eventually(lambda: three.prefilling() == 1 and two.prefilling() == 1)
        ages = three.exchange.views.ages(asyncio.get_running_loop().time())
        assert set(ages) == {"p1", "p2"} and all(a <= STALE_S for a in ages.values())


async def test_over_redis_cluster(redis_cluster: LocalRedisCluster, key_prefix: str) -> None:
    async with pods(redis_cluster.url, key_prefix, "stream", ("p1", "p2")) as (one, two):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)


@pytest.mark.parametrize("mode", ["stream", "hash"])
async def test_a_dead_pod_stops_counting_within_the_bound(
    mode: str, redis_server: LocalRedis, key_prefix: str
) -> None:
    async with pods(redis_server.url, key_prefix, mode, ("p1", "p2")) as (one, two):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        loop = asyncio.get_running_loop()
        sender = f"{one.exchange.member}#{one.exchange.instance}"
        last_seen = two.exchange.views.views[sender].moved_at
        await one.die()
        await eventually(lambda: two.prefilling() == 0)
        # dropped by the staleness rule (not earlier, from some other cause): the view moved
        # last before the death and the drop came after the bound had passed
        assert loop.time() - last_seen > STALE_S


async def test_redis_restart_recovers(private_redis: LocalRedis) -> None:
    async with pods(private_redis.url, "kvr", "stream", ("p1", "p2")) as (one, two):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        await asyncio.to_thread(private_redis.restart)
        one.load.dispatch("r2", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 2, timeout=20)
        assert two.exchange.counters.errors > 0  # it did see Redis go away


async def test_a_dead_pods_hash_field_stays_uncounted_and_is_deleted(
    redis_server: LocalRedis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pod_exchange, "HASH_FORGET_S", 1.0)
    async with pods(redis_server.url, key_prefix, "hash", ("p1", "p2")) as (one, two):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        await one.die()
        await eventually(lambda: two.prefilling() == 0)
        # its field, re-read every poll with the same seq, is no sign of life: it must not
        # count again once dropped, and it is deleted from the hash in the end
        seen = []
        for _ in range(50):
            await asyncio.sleep(0.02)
            seen.append(two.prefilling())
        assert max(seen) == 0
        key = two.exchange.settings.hash_key
        await eventually(lambda: two.exchange.views.gone == {}, timeout=5)
        assert await two.client.hkeys(key) == [two.exchange.field.encode()]


async def test_a_pod_leaving_cleanly_stops_counting_at_once_in_hash_mode(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    async with pods(redis_server.url, key_prefix, "hash", ("p1", "p2")) as (one, two):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        await stop(one.task)
        await one.exchange.leave()  # deletes its field
        loop = asyncio.get_running_loop()
        left = loop.time()
        await eventually(lambda: two.prefilling() == 0)
        assert loop.time() - left < STALE_S / 2  # not left to age out


async def test_a_hung_redis_does_not_keep_stale_views(private_redis: LocalRedis) -> None:
    async with pods(private_redis.url, "kvr", "stream", ("p1", "p2")) as (one, two):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        assert private_redis.process is not None
        pid = private_redis.process.pid
        loop = asyncio.get_running_loop()
        os.kill(pid, signal.SIGSTOP)  # Redis stops answering: calls hang until timeouts
        try:
            hung = loop.time()
            await eventually(lambda: two.prefilling() == 0, timeout=20)
            assert loop.time() - hung < STALE_S + 0.4
        finally:
            os.kill(pid, signal.SIGCONT)


async def test_stream_ids_going_backwards_do_not_hide_live_pods(
    private_redis: LocalRedis,
) -> None:
    async with pods(private_redis.url, "kvr", "stream", ("p1", "p2")) as (one, two):
        await eventually(lambda: bool(two.exchange.views.views))
        # an entry stamped by a Redis whose clock ran ahead (stepped back since): readers'
        # last ids are now ahead of whatever the restarted Redis stamps
        await two.client.xadd(two.exchange.settings.stream_key, {b"s": b"{}"}, id=b"9" * 14)
        await eventually(lambda: two.exchange._last_id.startswith(b"9" * 14))
        await asyncio.to_thread(private_redis.restart)
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1, timeout=20)


async def test_negative_or_huge_counts_are_rejected(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    async with pods(redis_server.url, key_prefix, "stream", ("p1", "p2")) as (one, two):
        two.load.columns((A,))  # mirrored: the table takes floats
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        key = two.exchange.settings.stream_key
        for n, row in enumerate(([-1, -100, 0, 0, -100], [0, 10**400, 0, 0, 0])):
            body = {"load": [["a", 0, *row, 0.0]], "m": f"x{n}/1", "p": f"x{n}", "s": 1}
            await two.client.xadd(key, {b"s": json.dumps(body).encode()})
        await eventually(lambda: two.exchange.counters.rejected == 2)
        # neither cancels p1's request out nor leaves the mirror table behind the counts
        assert two.prefilling() == 1
        assert two.load.columns((A,)).queued_prefill_tokens[0] == 100
        assert two.exchange.counters.errors == 0


async def test_a_huge_decode_weight_is_rejected(redis_server: LocalRedis, key_prefix: str) -> None:
    """A decode weight is summed over the members and added to and taken off the tracker's
    float sums: two finite but huge ones make it infinite, and taking them off again leaves
    NaN on the replica for as long as it has requests in flight (every score of it then
    NaN). Bounded as the counts are."""
    async with pods(redis_server.url, key_prefix, "stream", ("p1", "p2")) as (one, two):
        two.load.columns((A,))  # mirrored: the table takes floats
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 1)
        key = two.exchange.settings.stream_key
        for seq, weight in ((1, 1e308), (2, 0.5)):
            for n in range(2):
                row = ["a", 0, 1, 10, 0, 0, 10, weight]
                body = {"load": [row], "m": f"x{n}/1", "p": f"x{n}", "s": seq}
                await two.client.xadd(key, {b"s": json.dumps(body).encode()})
        await eventually(lambda: two.prefilling() == 3)
        assert two.exchange.counters.rejected == 2
        weight = two.load.view(A, 0.0).decode_weight
        assert weight == pytest.approx(1 + one.load.own(A).decode_weight)
        assert two.load.columns((A,)).decode_weight[0] == pytest.approx(weight)


async def test_another_pod_with_this_pods_name_is_reported(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """Two pods configured with one ``pod_name`` ignore each other's load; the clash is
    counted (and logged) once the namesake shows it is alive, not for a dead one's leftover."""
    async with pods(redis_server.url, key_prefix, "stream", ("p1",)) as (one,):
        key = one.exchange.settings.stream_key
        await eventually(lambda: one.exchange.counters.received >= 1)  # reading its own

        async def send(member: str, seq: int) -> None:
            body = {"load": [], "m": member, "p": "p1", "s": seq}
            await one.client.xadd(key, {b"s": json.dumps(body).encode()})

        await send("p1/888888", 5)  # a leftover: one seq, never moves
        for seq in (1, 2, 3):
            await send("p1/999999", seq)
        await eventually(lambda: one.exchange.counters.name_clashes == 1)
        await send("p1/888888", 5)
        await send("p1/999999", 4)
        seen = one.exchange.counters.received
        await eventually(lambda: one.exchange.counters.received >= seen + 2)
        assert one.exchange.counters.name_clashes == 1


async def test_a_reader_catching_up_does_not_revive_a_dead_pod(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A reader cut off for a while (its last id behind) reads the backlog when it resumes:
    a member that died meanwhile, its last snapshot older than the bound, must not count
    again as if it had just spoken."""
    names = ("p1", "p2", "p3")
    async with pods(redis_server.url, key_prefix, "stream", names) as (one, two, three):
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: three.prefilling() == 1)
        await stop(three.task)  # p3 stops reading (cut off), its last id stays behind
        one.load.dispatch("r2", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: two.prefilling() == 2)
        await one.die()
        await eventually(lambda: two.prefilling() == 0)  # p1 silent past the bound
        key = two.exchange.settings.stream_key

        async def p1_older_than_the_bound() -> bool:
            entries = await two.client.xrange(key)
            last_p1 = max(pod_exchange._id_ms(i) for i, f in entries if decode(f[b"s"]).pod == "p1")
            return pod_exchange._id_ms(entries[-1][0]) - last_p1 > 2000 * STALE_S

        await eventually(p1_older_than_the_bound)  # p2's heartbeats went on
        await three.exchange.read_stream()  # p3 is back: the backlog in one read
        assert three.prefilling() == 0
        assert set(three.exchange.views.views) == {f"{two.exchange.member}#{two.exchange.instance}"}


def _redis_up(exchange: PodExchange) -> float:
    """The ``kvrouter_pod_exchange_redis_up`` gauge, as a scrape reads it."""
    for metric in pod_exchange_app._ExchangeCollector(exchange).collect():
        if metric.name == "kvrouter_pod_exchange_redis_up":
            return float(metric.samples[0].value)
    raise AssertionError("no kvrouter_pod_exchange_redis_up")


async def test_redis_refusing_writes_reads_as_down(private_redis: LocalRedis) -> None:
    """A Redis that answers reads but refuses writes (full under ``noeviction``, or a
    read-only replica after a failover): this pod's snapshots reach nobody, so the other
    pods no longer count its requests. The gauge must say so all along, not flip back to
    1 at every read that works."""
    async with pods(private_redis.url, "kvr", "stream", ("p1",)) as (one,):
        ex = one.exchange
        await eventually(lambda: ex.counters.sent >= 1 and _redis_up(ex) == 1.0)
        admin = connect(private_redis.url)
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")  # every write now fails with OOM
            await eventually(lambda: ex.counters.errors >= 1)
            seen: set[float] = set()
            errors = ex.counters.errors

            def failed_more() -> bool:
                seen.add(_redis_up(ex))
                return ex.counters.errors >= errors + 8  # and the reads working in between

            await eventually(failed_more, interval=0.001)
            assert seen == {0.0}
            await admin.config_set("maxmemory", "0")  # writes work again
            await eventually(lambda: _redis_up(ex) == 1.0)
        finally:
            await admin.config_set("maxmemory", "0")
            await admin.aclose()


async def test_a_namesake_with_this_pods_pids_is_reported(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """Two pods configured with one ``pod_name`` whose processes have the same pids (the
    same image in two containers: pid 1, or the same worker pids) send as the same member:
    the clash is still counted on both, and neither takes the other's entries for its own."""
    async with pods(redis_server.url, key_prefix, "stream", ("p1", "p1")) as (one, two):
        assert one.exchange.member == two.exchange.member  # one test process: one pid
        await eventually(
            lambda: (
                one.exchange.counters.name_clashes == 1 and two.exchange.counters.name_clashes == 1
            )
        )


def test_a_namesake_with_a_sibling_workers_pid_is_told_from_the_sibling(tmp_path) -> None:
    """With several workers, a member of this pod's name is a sibling only if it is of this
    pod's group of workers: another pod's worker that happens to have a sibling's pid (its
    container numbers its processes alike) is a namesake."""
    sibling = 424242
    (tmp_path / "workers").write_text(f"{os.getpid()}\n{sibling}\n")
    group = Workers(str(tmp_path), 2)
    other_group = Workers(str(tmp_path / "elsewhere"), 2)
    load = LoadTracker()
    settings = ExchangeSettings("stream", "k", "p1", 0.005, STALE_S)
    me = PodExchange(settings, None, load, PeerSum(load), lambda: 0.0, workers=group)
    same = PodExchange(settings, None, LoadTracker(), PeerSum(load), lambda: 0.0, workers=group)
    other = PodExchange(
        settings, None, LoadTracker(), PeerSum(load), lambda: 0.0, workers=other_group
    )
    for ex in (same, other):  # both as pid ``sibling``
        ex.member = f"p1/{sibling}"
    for _ in range(3):
        me._take(same._snapshot(0.0), 0.0)
    assert me.counters.name_clashes == 0
    for _ in range(3):
        me._take(other._snapshot(0.0), 0.0)
    assert me.counters.name_clashes == 1


async def test_a_reader_catching_up_on_a_long_backlog_does_not_revive_a_dead_pod(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A backlog longer than one XREAD's count comes in several reads; the first one holds
    only the oldest entries, so a dead member's last snapshot near its end must be dated
    by the stream's newest entry, not by that read's (which is as old as it)."""
    client = connect(redis_server.url)
    load = LoadTracker()
    load.add_replica(A)
    loop = asyncio.get_running_loop()
    settings = ExchangeSettings("stream", key_prefix, "p3", 0.005, STALE_S)
    reader = PodExchange(settings, client, load, PeerSum(load), loop.time)
    reader._last_id = b"0-0"  # cut off since before the backlog
    live, dead = LoadTracker(), LoadTracker()
    dead.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
    key = settings.stream_key
    old_ms = 1_000_000_000_000  # Redis's clock at the backlog's start (entry ids)
    try:
        for seq in range(1, pod_exchange.READ_COUNT):  # the live pod's heartbeats...
            body = encode("p2/1", "p2", seq, live)
            await client.xadd(key, {b"s": body}, id=f"{old_ms}-{seq}")
        # ... the dead pod's last word, the last entry of the first read ...
        await client.xadd(key, {b"s": encode("p1/1", "p1", 7, dead)}, id=f"{old_ms + 1}-0")
        # ... and the live pod's heartbeats since, ten seconds of them
        for n, seq in enumerate(range(pod_exchange.READ_COUNT, pod_exchange.READ_COUNT + 40)):
            body = encode("p2/1", "p2", seq, live)
            await client.xadd(key, {b"s": body}, id=f"{old_ms + 250 * (n + 1)}-0")
        last = (await client.xrevrange(key, count=1))[0][0]
        while reader._last_id != last:
            await reader.read_stream()
        assert load.view(A, 0.0).prefilling == 0
        assert set(reader.views.views) == {"p2/1"}
    finally:
        await client.aclose()


async def test_a_third_pod_counts_both_namesakes(redis_server: LocalRedis, key_prefix: str) -> None:
    """Two pods sharing one ``pod_name`` (and pids: one image in two containers) ignore each
    other, as counted; every other pod still counts both, not whichever spoke last."""
    names = ("p1", "p1", "p2")
    async with pods(redis_server.url, key_prefix, "stream", names) as (one, two, three):
        assert one.exchange.member == two.exchange.member  # one test process: one pid
        one.load.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        two.load.dispatch("r2", A, prompt_tokens=100, cached_tokens=0)
        await eventually(lambda: three.prefilling() == 2)
        for _ in range(3):  # both keep sending (heartbeats), in either order: still both
            seen = three.exchange.counters.received
            await eventually(lambda s=seen: three.exchange.counters.received >= s + 4)
            assert three.prefilling() == 2


async def test_hash_namesakes_write_a_field_each(redis_server: LocalRedis, key_prefix: str) -> None:
    """In ``hash`` mode two namesakes (one ``pod_name``, the same pids) each write a field
    of their own: a third pod counts both whatever order they write in, and one leaving
    cleanly deletes only its own field."""
    client = connect(redis_server.url)
    loads = [LoadTracker() for _ in range(3)]
    exchanges = []
    for name, load in zip(("p1", "p1", "p2"), loads, strict=True):
        load.add_replica(A)
        settings = ExchangeSettings("hash", key_prefix, name, 0.005, STALE_S)
        exchanges.append(PodExchange(settings, client, load, PeerSum(load), lambda: 0.0))
    one, two, three = exchanges
    assert one.member == two.member  # one test process: one pid
    loads[0].dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
    loads[1].dispatch("r2", A, prompt_tokens=100, cached_tokens=0)
    try:
        for now in (0.0, STALE_S / 4):  # two rounds: three's first poll dates nothing
            await one.poll_hash(now)
            await two.poll_hash(now)
            await three.poll_hash(now)
        assert loads[2].view(A, 0.0).prefilling == 2
        await one.leave()
        await three.poll_hash(STALE_S / 4)
        assert loads[2].view(A, 0.0).prefilling == 1
        fields = await client.hkeys(three.settings.hash_key)
        assert set(fields) == {two.field.encode(), three.field.encode()}
    finally:
        await client.aclose()


def _gaps(exchange: PodExchange) -> float:
    """The ``kvrouter_pod_exchange_gaps_total`` counter, as a scrape reads it."""
    for metric in pod_exchange_app._ExchangeCollector(exchange).collect():
        if metric.name == "kvrouter_pod_exchange_gaps":
            return float(metric.samples[0].value)
    raise AssertionError("no kvrouter_pod_exchange_gaps")


class Lagging:
    """A stream reader on a hand-driven clock, and a quiet and a busy member whose entries
    the test appends with ids of its choosing (Redis's clock, ms from ``T0``), the stream
    trimmed to ``MAXLEN`` entries (exactly: the test decides what is lost)."""

    T0 = 1_000_000_000_000
    MAXLEN = 20

    def __init__(self, url: str, prefix: str) -> None:
        self.client = connect(url)
        self.load = LoadTracker()
        self.load.add_replica(A)
        self.clock = [100.0]
        self.settings = ExchangeSettings(
            "stream", prefix, "p3", 0.005, STALE_S, stream_maxlen=self.MAXLEN
        )
        self.reader = PodExchange(
            self.settings, self.client, self.load, PeerSum(self.load), lambda: self.clock[0]
        )
        self.reader._last_id = b"0-0"  # reading since before the first entry
        self.quiet, self.busy = LoadTracker(), LoadTracker()
        self.quiet.dispatch("q1", A, prompt_tokens=100, cached_tokens=0)

    async def send(self, member: str, seq: int, tracker: LoadTracker, ms: int) -> None:
        body = encode(member, member.split("/")[0], seq, tracker, instance="x")
        await self.client.xadd(
            self.settings.stream_key,
            {b"s": body},
            id=f"{self.T0 + ms}-0",
            maxlen=self.MAXLEN,
            approximate=False,
        )

    async def start(self) -> None:
        """Both members heard once, at reader time 100.0."""
        await self.send("p1/1", 1, self.quiet, 0)
        await self.send("p2/1", 1, self.busy, 1)
        await self.reader.read_stream()
        assert self.prefilling() == 1 and _gaps(self.reader) == 0

    async def burst(self, first_seq: int, first_ms: int) -> None:
        """Twice what the stream keeps, from the busy member, 1 ms apart: what came before
        is trimmed."""
        for n in range(2 * self.MAXLEN):
            await self.send("p2/1", first_seq + n, self.busy, first_ms + n)

    def prefilling(self) -> int:
        return self.load.view(A, 0.0).prefilling


@pytest.mark.parametrize("aged_out_first", [False, True])
async def test_a_reader_lagging_past_the_trim_keeps_the_members_it_could_not_hear(
    aged_out_first: bool, redis_server: LocalRedis, key_prefix: str
) -> None:
    """A stream reader that falls behind the trim (a busy event loop, a burst from many
    members) loses entries, a quiet member's heartbeats among them: it must not drop that
    member as silent for lack of what it could not read, but give it one bound from the gap
    (once: a member that stays unheard stops counting), take the busy member's latest
    snapshot, and count the gap. ``aged_out_first``: the age-out timer ran before the read."""
    lag = Lagging(redis_server.url, key_prefix)
    reader = lag.reader
    try:
        await lag.start()
        # the reader pauses; p1 sends a heartbeat, then p2's burst trims it away
        await lag.send("p1/1", 2, lag.quiet, 300)
        lag.busy.dispatch("b1", A, prompt_tokens=100, cached_tokens=0)
        await lag.burst(2, 301)
        lag.clock[0] += 0.6  # p1 last read more than the bound ago
        if aged_out_first:
            reader.views.expire(lag.clock[0])
        await reader.read_stream()
        assert _gaps(reader) == 1
        assert lag.prefilling() == 2  # p1 still counted, p2's latest taken
        assert reader._last_id != b"$"  # behind, not ahead: reads on from there
        # p1 is never heard again (it died in the gap): a second gap does not keep it on
        await lag.burst(100, 600)
        lag.clock[0] += 0.6
        await reader.read_stream()
        assert _gaps(reader) == 2
        assert lag.prefilling() == 1
        assert {v.member for v in reader.views.views.values()} == {"p2/1"}
    finally:
        await lag.client.aclose()


async def test_a_reader_cut_off_past_the_trim_does_not_revive_a_dead_pod(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A reader cut off for longer than the bound while the stream was trimmed past its
    last id: a member that died meanwhile must not count again (a lost stretch that long is
    an outage: no member is assumed alive through it)."""
    lag = Lagging(redis_server.url, key_prefix)
    reader = lag.reader
    try:
        await lag.start()
        await lag.send("p1/1", 2, lag.quiet, 300)  # p1's last word
        for n in range(Lagging.MAXLEN):  # p2 on, for 2 s ...
            await lag.send("p2/1", 2 + n, lag.busy, 301 + 100 * n)
        await lag.burst(100, 2301)  # ... and a burst at the end: all that is kept
        lag.clock[0] += 2.5
        reader.views.expire(lag.clock[0])  # the age-out timer ran meanwhile
        await reader.read_stream()
        assert _gaps(reader) == 1
        assert lag.prefilling() == 0
        assert {v.member for v in reader.views.views.values()} == {"p2/1"}
    finally:
        await lag.client.aclose()


async def test_a_pod_started_after_a_death_never_counts_the_dead_pods_field(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """In ``hash`` mode a dead member's field stays up to ``HASH_FORGET_S``: a pod started
    meanwhile (a scale-up, a restart) must not count its last load, which no poll can date,
    as if it had just spoken; a live member's counts from its next write."""
    async with pods(redis_server.url, key_prefix, "hash", ("p2",)) as (two,):
        two.load.dispatch("r2", A, prompt_tokens=100, cached_tokens=0)
        dead = LoadTracker()
        dead.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        key = two.exchange.settings.hash_key
        await two.client.hset(key, "p1/1", encode("p1/1", "p1", 9, dead, instance="x"))
        load = LoadTracker()
        load.add_replica(A)
        settings = ExchangeSettings("hash", key_prefix, "p3", 0.005, STALE_S)
        new = PodExchange(settings, two.client, load, PeerSum(load), lambda: 100.0)
        await new.poll_hash(100.0)  # the first read: both fields, neither dated
        assert load.view(A, 0.0).prefilling == 0

        async def p2_counted() -> bool:
            await new.poll_hash(100.0)
            return load.view(A, 0.0).prefilling == 1

        await eventually(p2_counted)  # p2's heartbeat moved its seq; p1's never moves
        assert {v.member for v in new.views.views.values()} == {two.exchange.member}


async def test_a_hash_reader_back_from_an_outage_does_not_count_what_it_cannot_date(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """A ``hash`` reader that could not poll for longer than the bound sees, when it is back,
    fields whose seqs moved meanwhile: a member may have written and then died while it was
    away. Only a seq that moves between two polls within the bound is a sign of life."""
    async with pods(redis_server.url, key_prefix, "hash", ("p2",)) as (two,):
        dying = LoadTracker()
        dying.add_replica(A)
        key = two.exchange.settings.hash_key
        await two.client.hset(key, "p1/1", encode("p1/1", "p1", 8, dying, instance="x"))
        load = LoadTracker()
        load.add_replica(A)
        clock = [100.0]
        settings = ExchangeSettings("hash", key_prefix, "p3", 0.005, STALE_S)
        reader = PodExchange(settings, two.client, load, PeerSum(load), lambda: clock[0])
        await reader.poll_hash(clock[0])  # p1 (idle) and p2 first seen
        # p3 cut off (no poll) past the bound; meanwhile p1 sent one last snapshot and died
        dying.dispatch("r1", A, prompt_tokens=100, cached_tokens=0)
        await two.client.hset(key, "p1/1", encode("p1/1", "p1", 9, dying, instance="x"))
        clock[0] += 10 * STALE_S
        await reader.poll_hash(clock[0])  # back: p1's seq moved, but when?
        assert load.view(A, 0.0).prefilling == 0

        async def p2_counted() -> bool:
            await reader.poll_hash(clock[0])
            return {v.member for v in reader.views.views.values()} == {two.exchange.member}

        await eventually(p2_counted)  # p2's seq moves on (its heartbeats): alive; p1's not
        assert load.view(A, 0.0).prefilling == 0


async def test_a_hash_field_of_this_pods_own_dead_members_is_deleted_too(
    redis_server: LocalRedis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's reader ignores its own pod's fields for load (its workers' sockets carry it),
    but a field of its pod that no longer moves (a worker that was killed and replaced, the
    pod's previous life before a restart) must still be deleted: with no other pod to do
    it, the hash would grow at every death and every poll would read it all."""
    monkeypatch.setattr(pod_exchange, "HASH_FORGET_S", 1.0)
    async with pods(redis_server.url, key_prefix, "hash", ("p1",)) as (one,):
        idle = LoadTracker()
        key = one.exchange.settings.hash_key
        dead_sibling = f"p1/424242#{one.exchange.instance}"
        previous_life = "p1/1#0123456789abcdef"
        await one.client.hset(
            key,
            mapping={
                dead_sibling: encode("p1/424242", "p1", 7, idle, instance=one.exchange.instance),
                previous_life: encode("p1/1", "p1", 9, idle, instance="0123456789abcdef"),
            },
        )

        async def only_its_own_field() -> bool:
            return await one.client.hkeys(key) == [one.exchange.field.encode()]

        await eventually(only_its_own_field, timeout=5)
