"""ZMQ event loss, duplication and reordering: the index converges to the engine's true state.

A real ZMQ chain: engine ``KVEventPublisher`` (PUB + replay ROUTER) -> a chaos relay (SUB ->
PUB that drops, duplicates and reorders messages at random) -> the router's subscriber
(``DirectEvents``: decoder, re-blocker, replay on gaps) -> ``PrefixIndex``. The engine keeps
the ground truth: which blocks of which prompt it caches after a random workload of stores,
tail evictions and occasional full clears. Afterwards the relay is switched to pass-through
and the engine sends one empty batch (a loss is detected on the *next* message, as with a
real engine), then every prompt's indexed prefix must equal the cached one exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import pytest
import zmq
import zmq.asyncio

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.events.direct import DirectEvents
from router.events.ingest import EndpointSpec
from router.events.model import EngineAllCleared, EngineBlockRemoved, EngineBlockStored
from router.events.zmq_pub import KVEventPublisher
from tests.ports import free_port
from tests.waiting import eventually

B = 16  # engine block == router block, so the truth is one engine block per canonical block
KEY = ReplicaKey("eng")


@dataclass
class ChaosRelay:
    """SUB from the engine, PUB to the router, mangling what passes."""

    source: str
    rng: random.Random
    p_drop: float = 0.1
    p_dup: float = 0.1
    p_reorder: float = 0.1
    enabled: bool = True
    counts: dict[str, int] = field(
        default_factory=lambda: {"passed": 0, "dropped": 0, "duplicated": 0, "reordered": 0}
    )

    def __post_init__(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.source)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{free_port()}")
        self.endpoint = str(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        held: list[bytes] | None = None
        while True:
            frames = await self.sub.recv_multipart()
            if not self.enabled:
                if held is not None:
                    await self.pub.send_multipart(held)
                    held = None
                await self.pub.send_multipart(frames)
                self.counts["passed"] += 1
                continue
            r = self.rng.random()
            if r < self.p_drop:
                self.counts["dropped"] += 1
                continue
            if r < self.p_drop + self.p_reorder and held is None:
                held = frames  # goes out after the next message
                self.counts["reordered"] += 1
                continue
            await self.pub.send_multipart(frames)
            self.counts["passed"] += 1
            if held is not None:
                await self.pub.send_multipart(held)
                held = None
            if self.rng.random() < self.p_dup:
                await self.pub.send_multipart(frames)
                self.counts["duplicated"] += 1

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sub.close(0)
        self.pub.close(0)


class TruthEngine:
    """Prompts of distinct tokens; ``cached[i]`` = how many leading blocks of prompt i the
    engine holds. Emits the matching vLLM events."""

    def __init__(self, rng: random.Random, prompts: int = 40, max_blocks: int = 12) -> None:
        self.rng = rng
        self.prompts = [
            [rng.randrange(1, 50_000) for _ in range(rng.randint(2, max_blocks) * B)]
            for _ in range(prompts)
        ]
        self.cached = [0] * prompts

    def _hash(self, i: int, block: int) -> int:
        return hash((i, tuple(self.prompts[i][: (block + 1) * B]))) & (2**63 - 1)

    def step(self) -> list[object]:
        r = self.rng.random()
        i = self.rng.randrange(len(self.prompts))
        n = len(self.prompts[i]) // B
        have = self.cached[i]
        if r < 0.02:
            self.cached = [0] * len(self.prompts)
            return [EngineAllCleared()]
        if r < 0.65 and have < n:
            upto = self.rng.randint(have + 1, n)
            hashes = tuple(self._hash(i, b) for b in range(have, upto))
            parent = self._hash(i, have - 1) if have else None
            tokens = tuple(self.prompts[i][have * B : upto * B])
            self.cached[i] = upto
            return [EngineBlockStored(hashes, parent, tokens, B)]
        if have:
            keep = self.rng.randint(0, have - 1)  # evict a tail (LRU evicts leaves first)
            self.cached[i] = keep
            return [EngineBlockRemoved(tuple(self._hash(i, b) for b in range(keep, have)))]
        return []


def canonical(tokens: list[int]) -> list[int]:
    return hash_prompt(tokens, B, root_hash("m")).hashes


async def _run_chaos(seed: int, steps: int, encoding: str, pace_s: float = 0.0) -> dict[str, int]:
    """``pace_s``: pause after every batch (an engine publishes one batch per scheduler step)."""
    rng = random.Random(seed)
    eng = TruthEngine(rng)
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}",
        f"tcp://127.0.0.1:{free_port()}",
        buffer_steps=100_000,
        encoding=encoding,  # type: ignore[arg-type]
    )
    pub.start()
    relay = ChaosRelay(pub.endpoint, random.Random(seed + 1))
    index = PrefixIndex()
    direct = DirectEvents(index)
    direct.add_replica("eng", "m", B, [EndpointSpec(relay.endpoint, pub.replay_endpoint)])
    try:
        await direct.start()
        await asyncio.sleep(0.3)  # ZMQ slow joiner on both hops
        for n in range(steps):
            events = eng.step()
            await pub.publish(events)  # type: ignore[arg-type]
            if pace_s:
                await asyncio.sleep(pace_s)
            elif n % 25 == 0:
                await asyncio.sleep(0.005)  # let the relay and subscriber run
        await asyncio.sleep(0.2)
        relay.enabled = False
        await pub.publish([])  # the next message after a loss reveals it

        def converged() -> bool:
            for i, tokens in enumerate(eng.prompts):
                m = index.match(canonical(tokens)).get(KEY)
                got = m.kv_blocks if m is not None else 0
                if got != eng.cached[i]:
                    return False
            return index.replica_size(KEY)[0] == sum(eng.cached)

        await eventually(converged)
        sub = direct._groups[0].subscribers[0]
        return {
            **relay.counts,
            "gaps": sub.stats.gaps,
            "replayed": sub.stats.replayed,
            "duplicates": sub.stats.duplicates,
            "lost": sub.stats.lost,
        }
    finally:
        await direct.stop()
        await relay.close()
        await pub.close()


@pytest.mark.parametrize(("seed", "encoding"), [(1, "array"), (2, "map"), (3, "array")])
async def test_index_converges_under_loss_duplication_and_reordering(
    seed: int, encoding: str
) -> None:
    counts = await _run_chaos(seed, 400, encoding)
    # the relay really mangled the stream, and the subscriber really repaired it
    assert counts["dropped"] > 10 and counts["duplicated"] > 10 and counts["reordered"] > 10
    assert counts["gaps"] > 0 and counts["replayed"] > 0 and counts["duplicates"] > 0
    assert counts["lost"] == 0


@pytest.mark.soak
async def test_soak_index_converges_over_a_long_mangled_stream() -> None:
    # 20,000 batches at ~1,000 batches/s (an engine emits one per scheduler step, ~10-50 ms)
    counts = await _run_chaos(11, 20_000, "array", pace_s=0.001)
    print(counts)
    assert counts["lost"] == 0
