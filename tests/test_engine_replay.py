"""The engines' own publishers (vLLM 0.25.1 / 0.33.0, SGLang 0.5.21 / 0.5.23: both replay
layouts, tests/engines) -> the router's direct mode and the Redis publisher sidecar: history
loaded by replay beside a warm engine, a gap refilled by replay without clearing, every
data-parallel rank followed on the engine's own port offsets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq

from router.bench.redis_server import LocalRedis
from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.events.direct import DirectEvents
from router.events.endpoints import engine_endpoints, offset_endpoint
from router.events.subscriber import parse_replay_reply
from router.publisher.publisher import Publisher, PublisherSettings
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from router.store.sync import IndexSync
from tests.engines import ENGINES, TOPIC_IN_REPLAY, load
from tests.engines.harness import RefEngine, free_port_run
from tests.waiting import eventually

B = 32  # router block: two 16-token engine blocks
MODEL = "m"


def canonical(tokens: list[int]) -> list[int]:
    return hash_prompt(tokens, B, root_hash(MODEL)).hashes


@pytest.fixture(params=sorted(ENGINES))
def engine_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Ports:
    def __init__(self, ranks: int = 1) -> None:
        self.pub = free_port_run(ranks)
        self.replay = free_port_run(ranks)
        while self.pub <= self.replay < self.pub + ranks:
            self.replay = free_port_run(ranks)

    def specs(self, ranks: int = 1) -> tuple[object, ...]:
        return engine_endpoints(
            [f"tcp://127.0.0.1:{self.pub}"], [f"tcp://127.0.0.1:{self.replay}"], range(ranks)
        )


@pytest.fixture
def engines() -> Iterator[list[RefEngine]]:
    made: list[RefEngine] = []
    yield made
    for eng in made:
        eng.close()


async def _follow(ports: Ports, index: PrefixIndex, ranks: int = 1) -> DirectEvents:
    direct = DirectEvents(index)
    direct.add_replica("eng", MODEL, B, ports.specs(ranks))  # type: ignore[arg-type]
    await direct.start()
    return direct


async def _until_live(direct: DirectEvents, engs: list[RefEngine]) -> None:
    """Until every subscriber receives live messages (ZMQ joins asynchronously): publish
    empty batches until one arrived on each."""
    subs = direct._groups[0].subscribers
    for sub, eng in zip(subs, engs, strict=True):

        def live(sub: object = sub, eng: RefEngine = eng) -> bool:
            if sub.stats.messages == 0:  # type: ignore[attr-defined]
                eng.publish()
            return sub.stats.messages > 0  # type: ignore[attr-defined]

        await eventually(live)


def test_reply_layouts_as_a_dealer_receives_them() -> None:
    seq = (7).to_bytes(8, "big")
    end = (-1).to_bytes(8, "big", signed=True)
    assert parse_replay_reply([b"", seq, b"p"]) == (7, b"p")  # vLLM <= 0.25, SGLang <= 0.5.21
    assert parse_replay_reply([b"", b"kv", seq, b"p"]) == (7, b"p")  # since 0.26 / 0.5.22
    assert parse_replay_reply([b"", b"", end, b""]) == (-1, b"")
    assert parse_replay_reply([b"", end, b""]) == (-1, b"")
    assert parse_replay_reply([b"x", seq, b"p"]) is None  # no delimiter
    assert parse_replay_reply([b"", b"short", b"p"]) is None
    assert parse_replay_reply([b"", b"t", seq, b"p", b"more"]) is None


def test_engine_replay_frames_are_the_documented_layouts(engine_name: str) -> None:
    """What each engine's replay ROUTER sends, received by a DEALER (recorded here)."""
    ports = Ports()
    eng = RefEngine(engine_name, ports.pub, ports.replay, topic="kv")
    try:
        eng.publish(eng.stored(eng.prompt(2)))
        eng.wait_sent()
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{ports.replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000)
        reply = dealer.recv_multipart()
        assert dealer.poll(5000)
        end = dealer.recv_multipart()
        dealer.close(0)
    finally:
        eng.close()
    end_seq = (-1).to_bytes(8, "big", signed=True)
    if TOPIC_IN_REPLAY[engine_name]:
        assert reply[:3] == [b"", b"kv", (0).to_bytes(8, "big")] and len(reply) == 4
        assert end == [b"", b"", end_seq, b""]
    else:
        assert reply[:2] == [b"", (0).to_bytes(8, "big")] and len(reply) == 3
        assert end == [b"", end_seq, b""]


async def test_history_of_a_warm_engine_is_loaded_by_replay(
    engine_name: str, engines: list[RefEngine]
) -> None:
    ports = Ports()
    eng = RefEngine(engine_name, ports.pub, ports.replay)
    engines.append(eng)
    tokens = eng.prompt(12)
    for first in range(0, 8, 2):  # cached before the router exists
        eng.publish(eng.stored(tokens, first, first + 2))
    eng.wait_sent()
    index = PrefixIndex()
    direct = await _follow(ports, index)
    try:
        want = canonical(tokens)
        await eventually(lambda: index.match(want).get(ReplicaKey("eng")).kv_blocks == 4)
        sub = direct._groups[0].subscribers[0]
        assert sub.stats.replayed == 4 and sub.stats.malformed_frames == 0
        # a later block chains onto the replayed history
        eng.publish(eng.stored(tokens, 8, 12))
        await eventually(lambda: index.match(want).get(ReplicaKey("eng")).kv_blocks == 6)
        assert direct.ingests["eng"].stats.lost_batches == 0
    finally:
        await direct.stop()


async def test_a_gap_is_refilled_by_replay_without_clearing(
    engine_name: str, engines: list[RefEngine]
) -> None:
    ports = Ports()
    eng = RefEngine(engine_name, ports.pub, ports.replay)
    engines.append(eng)
    index = PrefixIndex()
    direct = await _follow(ports, index)
    try:
        await _until_live(direct, [eng])
        tokens = eng.prompt(16)
        want = canonical(tokens)
        key = ReplicaKey("eng")
        eng.publish(eng.stored(tokens, 0, 4))
        await eventually(lambda: index.match(want).get(key).kv_blocks == 2)
        sub = direct._groups[0].subscribers[0]
        replayed = sub.stats.replayed
        eng.wire.drop = 3  # three batches never reach the subscriber
        for first in (4, 6, 8):
            eng.publish(eng.stored(tokens, first, first + 2))
        eng.publish(eng.stored(tokens, 10, 16))
        await eventually(lambda: index.match(want).get(key).kv_blocks == 8)
        assert sub.stats.gaps == 1 and sub.stats.replayed - replayed == 3
        assert sub.stats.lost == 0
        assert direct.ingests["eng"].stats.lost_batches == 0  # nothing was cleared
    finally:
        await direct.stop()


def test_rank_endpoints_are_the_engines_own_offsets() -> None:
    for name in ("vllm-0.33.0", "sglang-0.5.23"):
        offset = load(name).ZmqEventPublisher.offset_endpoint_port
        for ep in ("tcp://10.0.0.7:5557", "tcp://*:6000", "inproc://kv"):
            for rank in range(4):
                assert offset_endpoint(ep, rank) == offset(ep, rank), (name, ep, rank)
    assert offset_endpoint("tcp://h:0", 2) == "tcp://h:0"  # vLLM: port 0 left to the OS
    with pytest.raises(ValueError):
        offset_endpoint("ipc:///tmp/kv", 1)
    with pytest.raises(ValueError):
        engine_endpoints(["tcp://a:1", "tcp://a:2"], [], [0, 1, 2])


async def test_direct_mode_follows_every_dp_rank(
    engine_name: str, engines: list[RefEngine]
) -> None:
    ports = Ports(ranks=3)
    # each rank is its own engine publisher given the same configured ports, as the
    # engine starts them: it offsets them by its rank itself
    ranks = [RefEngine(engine_name, ports.pub, ports.replay, dp_rank=r, seed=r) for r in range(3)]
    engines.extend(ranks)
    warm = ranks[2].prompt(4)
    ranks[2].publish(ranks[2].stored(warm))  # rank 2 is warm before the router starts
    ranks[2].wait_sent()
    index = PrefixIndex()
    direct = await _follow(ports, index, ranks=3)
    try:
        await _until_live(direct, ranks)
        prompts = [eng.prompt(6) for eng in ranks]
        for eng, tokens in zip(ranks, prompts, strict=True):
            eng.publish(eng.stored(tokens))
        for r, tokens in enumerate(prompts):
            want = canonical(tokens)
            await eventually(
                lambda w=want, r=r: index.match(w).get(ReplicaKey("eng", r)).kv_blocks == 3
            )
            others = [index.match(want).get(ReplicaKey("eng", o)).kv_blocks for o in range(3)]
            assert sum(others) == 3  # only on its own rank
        assert index.match(canonical(warm)).get(ReplicaKey("eng", 2)).kv_blocks == 2
    finally:
        await direct.stop()


async def test_a_payload_naming_a_rank_not_followed_is_filed_under_its_endpoints(
    engine_name: str, engines: list[RefEngine]
) -> None:
    """An engine started as data-parallel rank 2 of a larger group but routed to as a replica
    of its own (vLLM's external load balancing: one API server per rank) publishes on its
    port + 2 with rank 2 in every payload. Followed at that endpoint as the replica's only
    rank (0), its blocks are that rank's: the router routes to rank 0 alone, and a key for
    rank 2 would be one nobody routes to (the replica would look cold for ever)."""
    ports = Ports(ranks=3)
    eng = RefEngine(engine_name, ports.pub, ports.replay, dp_rank=2)
    engines.append(eng)
    index = PrefixIndex()
    direct = DirectEvents(index)
    specs = engine_endpoints(
        [f"tcp://127.0.0.1:{ports.pub + 2}"], [f"tcp://127.0.0.1:{ports.replay + 2}"], [0]
    )
    direct.add_replica("eng", MODEL, B, specs)
    await direct.start()
    try:
        await _until_live(direct, [eng])
        tokens = eng.prompt(6)
        eng.publish(eng.stored(tokens))
        want = canonical(tokens)
        await eventually(lambda: index.match(want).get(ReplicaKey("eng", 0)).kv_blocks == 3)
        assert index.replicas() == [ReplicaKey("eng", 0)]
    finally:
        await direct.stop()


async def test_direct_mode_routes_a_sliding_window_model_on_complete_windows(
    engines: list[RefEngine],
) -> None:
    """vLLM's own publisher, a full + sliding-window model (window 40 tokens: 3 engine
    blocks of 16 before a hit's end), over ZMQ into the router's direct mode: the prefix is
    usable only where the window group still holds the window."""
    ports = Ports()
    eng = RefEngine("vllm-0.33.0", ports.pub, ports.replay)
    engines.append(eng)
    index = PrefixIndex()
    direct = await _follow(ports, index)
    try:
        await _until_live(direct, [eng])
        tokens = eng.prompt(8)  # 4 router blocks
        window = {
            "group_idx": 1,
            "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 40,
        }
        full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        eng.publish(eng.stored(tokens, group=full), eng.stored(tokens, group=window))
        # the engine evicts the first 4 window blocks (freed as the window slid past)
        eng.publish(eng.removed(tokens, 0, 4, group_idx=1))
        key = ReplicaKey("eng")
        whole = canonical(tokens)
        await eventually(lambda: index.match(whole, hybrid=True).get(key).usable_blocks == 4)
        # a branch after 3 router blocks: all its KV is cached, its window (engine blocks
        # 4-6) is not, nor any earlier one
        branch = canonical(tokens[: 3 * B] + [1] * B)
        found = index.match(branch, hybrid=True).get(key)
        assert (found.kv_blocks, found.usable_blocks) == (3, 0)
        # the window blocks come back: the branch is usable again
        eng.publish(eng.stored(tokens, 0, 4, group=window))
        await eventually(lambda: index.match(branch, hybrid=True).get(key).usable_blocks == 3)
        assert index.publishes_state(key)  # what makes the router treat the model as hybrid
    finally:
        await direct.stop()


@pytest.fixture
async def store(redis_server: LocalRedis, key_prefix: str) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(redis_server.url, KeySchema(key_prefix, 4))
    yield s
    await s.close()


@pytest.mark.parametrize("engine_name", ["vllm-0.33.0", "sglang-0.5.23"])
async def test_redis_mode_replays_history_refills_gaps_and_follows_ranks(
    engine_name: str, engines: list[RefEngine], store: RedisStore
) -> None:
    ports = Ports(ranks=2)
    ranks = [RefEngine(engine_name, ports.pub, ports.replay, dp_rank=r, seed=r) for r in range(2)]
    engines.extend(ranks)
    history = ranks[1].prompt(4)
    ranks[1].publish(ranks[1].stored(history))
    ranks[1].wait_sent()
    info = ReplicaInfo("eng", url="http://eng", model=MODEL, dp_ranks=(0, 1), block_size=B)
    settings = PublisherSettings(info=info, endpoints=ports.specs(2), flush_interval_s=0.01)  # type: ignore[arg-type]
    publisher = Publisher(settings, store)
    index = PrefixIndex()
    sync = IndexSync(store, index, audit_interval_s=0.1, block_s=0.05)
    await publisher.start()
    await sync.start()
    try:
        await eventually(
            lambda: index.match(canonical(history)).get(ReplicaKey("eng", 1)).kv_blocks == 2
        )
        subs = publisher.subscribers.subscribers
        for sub, eng in zip(subs, ranks, strict=True):

            def live(sub: object = sub, eng: RefEngine = eng) -> bool:
                if sub.stats.messages == 0:  # type: ignore[attr-defined]
                    eng.publish()
                return sub.stats.messages > 0  # type: ignore[attr-defined]

            await eventually(live)
        tokens = ranks[0].prompt(8)
        ranks[0].publish(ranks[0].stored(tokens, 0, 2))
        ranks[0].wire.drop = 2
        ranks[0].publish(ranks[0].stored(tokens, 2, 4))
        ranks[0].publish(ranks[0].stored(tokens, 4, 6))
        ranks[0].publish(ranks[0].stored(tokens, 6, 8))
        await eventually(
            lambda: index.match(canonical(tokens)).get(ReplicaKey("eng", 0)).kv_blocks == 4
        )
        assert publisher.ingest.stats.lost_batches == 0
        assert index.match(canonical(history)).get(ReplicaKey("eng", 1)).kv_blocks == 2
    finally:
        await sync.stop()
        await publisher.stop()
    await asyncio.sleep(0)


@pytest.mark.parametrize("engine_name", ["vllm-0.33.0", "sglang-0.5.23"])
async def test_the_publisher_files_a_foreign_rank_under_its_endpoints(
    engine_name: str, engines: list[RefEngine], store: RedisStore
) -> None:
    """The sidecar, as the direct mode: a payload naming rank 2 from the endpoint of the
    replica's only rank is written to that rank's keys (``kv:0``), which routers read."""
    ports = Ports(ranks=3)
    eng = RefEngine(engine_name, ports.pub, ports.replay, dp_rank=2)
    engines.append(eng)
    tokens = eng.prompt(6)
    eng.publish(eng.stored(tokens))
    eng.wait_sent()
    info = ReplicaInfo("eng", url="http://eng", model=MODEL, dp_ranks=(0,), block_size=B)
    specs = engine_endpoints(
        [f"tcp://127.0.0.1:{ports.pub + 2}"], [f"tcp://127.0.0.1:{ports.replay + 2}"], [0]
    )
    settings = PublisherSettings(info=info, endpoints=specs, flush_interval_s=0.01)
    publisher = Publisher(settings, store)
    index = PrefixIndex()
    sync = IndexSync(store, index, audit_interval_s=0.1, block_s=0.05)
    await publisher.start()
    await sync.start()
    try:
        want = canonical(tokens)
        await eventually(lambda: index.match(want).get(ReplicaKey("eng", 0)).kv_blocks == 3)
        assert list(publisher.writer.states) == [ReplicaKey("eng", 0)]
        assert publisher.ingest.stats.foreign_rank_batches >= 1
    finally:
        await sync.stop()
        await publisher.stop()
    await asyncio.sleep(0)


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://10.0.0.1", "tcp://*:5557", "tcp://h:0", "tcp://h:70000", "10.0.0.1:5557", "ipc://"],
)
def test_malformed_endpoints_are_refused_naming_them(endpoint: str) -> None:
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        engine_endpoints([endpoint], [], [0])
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        engine_endpoints(["tcp://h:5557"], [endpoint], [0])


def test_endpoints_the_engines_use_are_accepted() -> None:
    for endpoint in ("tcp://10.0.0.1:5557", "tcp://[::1]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert engine_endpoints([endpoint], [], [0])[0].endpoint == endpoint
