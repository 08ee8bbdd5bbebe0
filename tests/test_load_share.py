"""Load sharing between worker processes (router/service/load_share.py): the answer format,
and one worker's exchange with another over a real unix socket, including a peer that stops
answering (its last answer counts for STALE_AFTER_S, then it counts as idle)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from aiohttp import web

from router.core.load import NO_PEER_LOAD, LoadTracker, PeerLoad, decode_weight
from router.core.types import ReplicaKey
from router.service.load_share import (
    STALE_AFTER_S,
    LoadSharing,
    own_load,
    parse_load,
    summed,
)
from router.service.peer_sum import PeerSum
from router.service.peers import PeerClient

A = ReplicaKey("a")
A1 = ReplicaKey("a", 1)


def test_own_load_round_trips_and_leaves_out_idle_replicas() -> None:
    t = LoadTracker()
    t.add_replica(ReplicaKey("idle"))
    t.dispatch("r1", A1, prompt_tokens=100, cached_tokens=40)
    t.set_peer_load(A1, PeerLoad(prefilling=9))  # not ours: not reported
    body = json.dumps(own_load(t)).encode()
    assert parse_load(body) == {A1: PeerLoad(1, 60, 0, 0, 100, decode_weight(None))}


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b'{"load": {}}',
        b'{"load": [["a", 0, 1, 2, 3, 4, 5]]}',  # a field short
        b'{"load": [["a", 0, 1, 2, 3, 4, "5", 0.1]]}',
        b'{"load": [["a", 0, 1, 2, 3, 4, true, 0.1]]}',
        b'{"load": [["a", 0, 1, 2, 3, 4, 5, 0.1, 9]]}',  # a field too many
        b'{"load": [["a", 0, 1, 2, 3, 4, 5, -0.5]]}',  # a negative weight
        b'{"load": [["a", 0, 1, 2, 3, 4, 5, NaN]]}',
        b'{"load": [[7, 0, 1, 2, 3, 4, 5, 0.1]]}',
        # one replica twice: which row is its load? (the last silently won)
        b'{"load": [["a", 0, 1, 2, 3, 4, 5, 0.1], ["a", 0, 9, 9, 9, 9, 9, 0.1]]}',
        b"not json",
    ],
)
def test_a_malformed_answer_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_load(body)


def test_answers_are_summed_per_replica() -> None:
    got = summed([{A: PeerLoad(1, 10)}, {A: PeerLoad(2, 20), A1: PeerLoad(0, 0, 1)}])
    assert got == {A: PeerLoad(3, 30), A1: PeerLoad(0, 0, 1)}


async def test_exchange_with_a_peer_that_then_goes_away(tmp_path: Path) -> None:
    peer = LoadTracker()
    peer.dispatch("p1", A, prompt_tokens=500, cached_tokens=0)
    peer.dispatch("p2", A, prompt_tokens=300, cached_tokens=100)

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(own_load(peer))

    app = web.Application()
    app.router.add_get("/internal/load", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = str(tmp_path / "peer.sock")
    await web.UnixSite(runner, sock).start()
    mine = LoadTracker()
    mine.dispatch("m1", A, prompt_tokens=64, cached_tokens=0)
    client = PeerClient(1.0)
    sharing = LoadSharing(PeerSum(mine), client)
    try:
        await sharing.exchange([sock], now=10.0)
        v = mine.view(A, 10.0)
        assert (v.prefilling, v.queued_prefill_tokens) == (3, 64 + 500 + 200)
        peer.complete("p1")
        await sharing.exchange([sock], now=10.1)
        assert mine.view(A, 10.1).prefilling == 2  # the peer's new figure replaced the old
        await runner.cleanup()  # the peer goes away
        await sharing.exchange([sock], now=10.1 + STALE_AFTER_S / 2)
        assert mine.view(A, 0.0).prefilling == 2  # its last answer still counts...
        await sharing.exchange([sock], now=10.2 + STALE_AFTER_S)
        assert mine.view(A, 0.0).prefilling == 1  # ...then it counts as idle
        assert mine.own(A) == PeerLoad(1, 64, 0, 0, 64, decode_weight(None))
        assert sharing.peers.applied == set() and mine.own(A) != NO_PEER_LOAD
    finally:
        client.close()
        await runner.cleanup()


async def test_a_peer_that_does_not_answer_holds_up_no_other_peers_load(
    tmp_path: Path,
) -> None:
    """Worker exchange rounds (``load_sharing_ctx``) with two peers, one of which takes the
    request and never answers (a stalled worker): the other peer's load, and each change of
    it, still reaches this worker's tracker round after round, rather than once the stalled
    one's call gives up (its timeout, ``interval * 20`` = 20 s here)."""
    from router.service.config import build_settings
    from router.service.keys import STATE
    from router.service.load_share import load_sharing_ctx
    from router.service.state import RouterState
    from tests.waiting import eventually

    peer = LoadTracker()
    peer.dispatch("p1", A, prompt_tokens=500, cached_tokens=0)

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(own_load(peer))

    app = web.Application()
    app.router.add_get("/internal/load", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    live = str(tmp_path / "live.sock")
    await web.UnixSite(runner, live).start()

    release = asyncio.Event()
    asked = [0]

    async def stalled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked[0] += 1
        await release.wait()
        writer.close()

    hung = str(tmp_path / "hung.sock")
    hung_server = await asyncio.start_unix_server(stalled, hung)
    settings = build_settings(
        {"replicas": [{"url": "http://127.0.0.1:9", "model": "m", "name": "a"}]}
    )
    mine = web.Application()
    mine[STATE] = state = RouterState(settings)
    ctx = load_sharing_ctx(mine, lambda: [live, hung], interval_s=1.0)(mine)
    try:
        await anext(ctx)  # the exchange runs
        await eventually(lambda: asked[0] >= 1)
        await eventually(lambda: state.load.view(A, 0.0).prefilling == 1)
        peer.dispatch("p2", A, prompt_tokens=300, cached_tokens=0)
        await eventually(lambda: state.load.view(A, 0.0).prefilling == 2)
        assert not release.is_set() and asked[0] == 1  # one call, still waiting
    finally:
        release.set()
        with contextlib.suppress(StopAsyncIteration):
            await anext(ctx)
        hung_server.close()
        await runner.cleanup()
