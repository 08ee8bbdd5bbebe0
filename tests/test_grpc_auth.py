"""gRPC credentials per service, and the client keys' limits across both ports: a router app
(HTTP and gRPC on loopback, real channels) whose Router service takes the client API keys
and holds a Pick to the key's concurrency limit with the HTTP front door's own gate
(router/service/gate.py), while Index publishing keeps ``grpc_token`` and Admin keeps
``admin_token``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest

from router.rpc.gen import (
    admin_pb2,
    admin_pb2_grpc,
    index_pb2,
    index_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from router.rpc.server import client_address, serve_grpc
from router.rpc.settings import GrpcSettings
from router.service.config import build_settings
from router.service.gate import Gate
from router.service.keys import GRPC_PORT
from router.service.security import Limits
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

MODEL = "kimi"
KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-fedcba9876543210"
GATEWAY = "gw-token-5c1e9d"
ADMIN = "adm-7f3c9a1b2d4e"
RETRY_AFTER_S = 3
Meta = tuple[tuple[str, str], ...]
FIRST_TOKEN = router_pb2.ReportRequest.FIRST_TOKEN
COMPLETED = router_pb2.ReportRequest.COMPLETED
FAILED = router_pb2.ReportRequest.FAILED


def bearer(secret: str) -> Meta:
    return (("authorization", f"Bearer {secret}"),)


@dataclass
class Front:
    """A running router app: its HTTP URL, a channel to its gRPC port, its one replica."""

    url: str
    channel: grpc.aio.Channel
    backend: Backend

    async def pick(self, meta: Meta, **fields: Any) -> router_pb2.PickResponse:
        fields.setdefault("model", MODEL)
        request = router_pb2.PickRequest(text="hello there", **fields)
        stub = router_pb2_grpc.RouterStub(self.channel)
        return await stub.Pick(request, metadata=meta, timeout=10)

    async def report(self, meta: Meta, decision_id: str, phase: int = COMPLETED) -> bool:
        request = router_pb2.ReportRequest(decision_id=decision_id, phase=phase)
        stub = router_pb2_grpc.RouterStub(self.channel)
        answer = await stub.Report(request, metadata=meta, timeout=10)
        return bool(answer.accepted)

    async def refused(self, meta: Meta, **fields: Any) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await self.pick(meta, **fields)
        return exc.value

    async def publish(self, meta: Meta) -> list[Any]:
        async def one() -> AsyncIterator[index_pb2.IndexEventBatch]:
            stored = index_pb2.IndexEvent(type=index_pb2.IndexEvent.STORED, hashes=[11, 12])
            yield index_pb2.IndexEventBatch(replica="b0", seq=1, events=[stored])

        stub = index_pb2_grpc.IndexStub(self.channel)
        for attempt in range(2):
            try:
                return [a.outcome async for a in stub.Publish(one(), metadata=meta, timeout=10)]
            except grpc.aio.AioRpcError as exc:
                # the client's own gRPC core failing a stream the server refused before its
                # first message went out (seen under a loaded machine) is no answer of the
                # server's: that stream is sent once more (as tests/test_fuzz_grpc.py does)
                core = (exc.code(), exc.details()) == (
                    grpc.StatusCode.INTERNAL,
                    "Internal error from Core",
                )
                if not core or attempt:
                    raise
        raise AssertionError("unreachable")

    async def stats(self, meta: Meta) -> admin_pb2.StatsResponse:
        stub = admin_pb2_grpc.AdminStub(self.channel)
        return await stub.Stats(admin_pb2.StatsRequest(), metadata=meta, timeout=10)

    async def load(self) -> tuple[int, int, int]:
        """(decisions awaiting Report, requests in flight, the replica's queued prefill
        tokens), as the Admin service tells them."""
        stub = admin_pb2_grpc.AdminStub(self.channel)
        stats = await self.stats(bearer(ADMIN))
        listed = await stub.ListReplicas(
            admin_pb2.ListReplicasRequest(), metadata=bearer(ADMIN), timeout=10
        )
        (replica,) = listed.replicas
        return stats.decisions, stats.in_flight, replica.queued_prefill_tokens

    async def post(self, key: str | None) -> int:
        """One ``POST /v1/completions`` (held while the replica's gate is closed)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
        async with (
            aiohttp.ClientSession() as http,
            http.post(self.url + "/v1/completions", json=body, headers=headers) as r,
        ):
            await r.read()
            return r.status


@asynccontextmanager
async def running(**server: Any) -> AsyncIterator[Front]:
    """A router app with ``server`` settings, gRPC on a free port, one replica whose answers
    wait for ``backend.gate`` (set: they go through at once)."""
    backend = Backend("b0", [MODEL], gate=asyncio.Event())
    backend.gate.set()  # type: ignore[union-attr]
    await backend.start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0, "grpc_port": 0, **server},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{runner.app[GRPC_PORT]}") as channel:
            yield Front(url, channel, backend)
    finally:
        await runner.cleanup()
        await backend.stop()


KEYED = {
    "api_keys": f"{KEY_A},{KEY_B}",
    "max_concurrent_per_key": 2,
    "retry_after_s": RETRY_AFTER_S,
    "admin_token": ADMIN,
}


def code_of(exc: BaseException) -> Any:
    assert isinstance(exc, grpc.aio.AioRpcError), exc
    return exc.code()


async def test_client_keys_authorise_router_calls_and_nothing_else() -> None:
    async with running(**KEYED, grpc_token=GATEWAY) as front:
        # a client key: Pick and Report, as HTTP takes it
        picked = await front.pick(bearer(KEY_A))
        assert picked.replica == "b0" and picked.decision_id
        assert await front.report(bearer(KEY_A), picked.decision_id)
        assert (await front.pick((("api-key", KEY_B),))).decision_id  # HTTP's other header
        assert await front.post(KEY_A) == 200
        # a missing or wrong key: UNAUTHENTICATED, the HTTP answer's message
        for meta in ((), bearer(KEY_A + "x"), bearer(""), (("authorization", KEY_A),)):
            refused = await front.refused(meta)
            assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, meta
            assert "API key" in (refused.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await front.report(bearer("nope"), picked.decision_id)
        assert code_of(exc.value) == grpc.StatusCode.UNAUTHENTICATED
        # a client key never writes the index nor reaches the Admin service
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await front.publish(bearer(KEY_A))
        assert code_of(exc.value) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await front.stats(bearer(KEY_A))
        assert code_of(exc.value) == grpc.StatusCode.UNAUTHENTICATED
        # grpc_token as before: Router and Index calls, not Admin
        gw = await front.pick(bearer(GATEWAY))
        assert await front.report(bearer(GATEWAY), gw.decision_id)
        assert await front.publish(bearer(GATEWAY)) == [index_pb2.PublishAck.APPLIED]
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await front.stats(bearer(GATEWAY))
        assert code_of(exc.value) == grpc.StatusCode.UNAUTHENTICATED
        assert (await front.stats(bearer(ADMIN))).replicas == 1
        # the gateway's token is no client key on HTTP
        assert await front.post(GATEWAY) == 401


async def test_without_grpc_token_client_keys_serve_router_and_index_is_closed() -> None:
    """api_keys with grpc_port and no grpc_token (once a ConfigError): Router calls take the
    client keys; Index publishing is refused to everyone, keys included."""
    async with running(**KEYED) as front:
        picked = await front.pick(bearer(KEY_A))
        assert await front.report(bearer(KEY_A), picked.decision_id)
        assert (await front.refused(())).code() == grpc.StatusCode.UNAUTHENTICATED
        for meta in ((), bearer(KEY_A)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await front.publish(meta)
            assert code_of(exc.value) == grpc.StatusCode.UNAUTHENTICATED
            assert "grpc_token" in (exc.value.details() or "")


async def test_a_keys_http_requests_and_grpc_picks_share_its_concurrency_limit() -> None:
    """The gate counts requests in flight per key; a Pick is in flight until its decision
    ends (a COMPLETED or FAILED Report). Limit 2: one held HTTP request and one gRPC
    decision of key A fill it, on either port."""
    async with running(**KEYED, grpc_token=GATEWAY) as front:
        gate = front.backend.gate
        assert gate is not None
        gate.clear()  # the replica holds answers: HTTP requests stay in flight
        http = asyncio.create_task(front.post(KEY_A))
        await eventually(lambda: len(front.backend.received) == 1)
        first = await front.pick(bearer(KEY_A))  # the key's second slot
        # full: a third request of key A is refused on both ports
        refused = await front.refused(bearer(KEY_A))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many concurrent requests" in (refused.details() or "")
        trailers = dict(refused.trailing_metadata() or ())
        assert trailers["retry-after"] == str(RETRY_AFTER_S)
        assert trailers["grpc-retry-pushback-ms"] == str(RETRY_AFTER_S * 1000)
        assert await front.post(KEY_A) == 429
        # other keys, and the gateway's token (not held to per-key limits), go on
        other = await front.pick(bearer(KEY_B))
        gateway = [await front.pick(bearer(GATEWAY)) for _ in range(3)]
        # a refused Pick (unknown model) gives its slot back at once
        assert await front.report(bearer(KEY_B), other.decision_id, FAILED)
        for _ in range(3):
            bad = await front.refused(bearer(KEY_B), model="nope")
            assert bad.code() == grpc.StatusCode.NOT_FOUND
        both = [await front.pick(bearer(KEY_B)) for _ in range(2)]
        assert (await front.refused(bearer(KEY_B))).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the decision's end frees key A's slot: a COMPLETED report, then a new Pick
        assert await front.report(bearer(KEY_A), first.decision_id, COMPLETED)
        second = await front.pick(bearer(KEY_A))
        assert (await front.refused(bearer(KEY_A))).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # ... and the HTTP request's answer frees the other
        gate.set()
        assert await http == 200
        assert await front.post(KEY_A) == 200
        assert await front.report(bearer(KEY_A), second.decision_id, FAILED)
        for d in both:
            assert await front.report(bearer(KEY_B), d.decision_id)
        for d in gateway:
            assert await front.report(bearer(GATEWAY), d.decision_id)


async def test_a_report_ends_only_a_decision_its_own_caller_made() -> None:
    """A decision belongs to the caller that picked it: its client key, or the gateway's
    token. A Report from any other caller is answered as one of an unknown decision id
    (``accepted`` false, whatever the phase), so it cannot end or start decoding another
    key's decision, nor free that key's slot, nor tell that the id exists."""
    async with running(**KEYED, grpc_token=GATEWAY) as front:
        mine = await front.pick(bearer(KEY_A), request_id="req-a-1")  # a caller-chosen id
        assert mine.decision_id == "req-a-1"
        other = await front.pick(bearer(KEY_A))  # key A's second slot: its limit is full
        gw = await front.pick(bearer(GATEWAY))
        before = await front.load()
        assert before[:2] == (3, 3) and before[2] > 0
        for meta, decision in (
            (bearer(KEY_B), mine),
            (bearer(GATEWAY), mine),  # the gateway's token is no key's owner
            (bearer(KEY_A), gw),  # nor a key the gateway's
            (bearer(KEY_B), gw),
        ):
            for phase in (FIRST_TOKEN, COMPLETED, FAILED):
                assert not await front.report(meta, decision.decision_id, phase), meta
        assert not await front.report(bearer(KEY_B), "never-picked")  # the same answer
        # nothing changed: the decisions, their load (no first token), key A's slots
        assert await front.load() == before
        refused = await front.refused(bearer(KEY_A))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # another key may use the same id: its own decision (key A's untouched), which only
        # its own Report ends; a caller reusing its own id in flight is refused
        theirs = await front.pick(bearer(KEY_B), request_id="req-a-1")
        assert theirs.decision_id == "req-a-1"
        assert await front.report(bearer(KEY_B), "req-a-1")
        assert await front.load() == before
        again = await front.refused(bearer(GATEWAY), request_id=gw.decision_id)
        assert again.code() == grpc.StatusCode.INVALID_ARGUMENT
        # no id may spell a key's scoped one (owner NUL id)
        squat = await front.refused(bearer(GATEWAY), request_id="key:0\x00req-a-1")
        assert squat.code() == grpc.StatusCode.INVALID_ARGUMENT
        # each owner's own reports are applied
        assert await front.report(bearer(KEY_A), mine.decision_id, FIRST_TOKEN)
        assert (await front.load())[2] < before[2]
        assert await front.report(bearer(KEY_A), mine.decision_id)
        assert (await front.pick(bearer(KEY_A))).decision_id  # its slot is free again
        assert await front.report(bearer(GATEWAY), gw.decision_id, FAILED)
        assert await front.report(bearer(KEY_A), other.decision_id)
        assert (await front.load())[:2] == (1, 1)


async def test_without_keys_a_client_address_is_limited_on_both_ports() -> None:
    """No client keys, no token: the gate counts per client address, the gRPC peer's as
    the HTTP client's."""
    async with running(max_concurrent_per_key=1) as front:
        gate = front.backend.gate
        assert gate is not None
        gate.clear()
        http = asyncio.create_task(front.post(None))
        await eventually(lambda: len(front.backend.received) == 1)
        refused = await front.refused(())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        gate.set()
        assert await http == 200
        picked = await front.pick(())
        assert await front.post(None) == 429  # the Pick's decision holds the address's slot
        assert await front.report((), picked.decision_id)
        assert await front.post(None) == 200


async def test_an_unreported_decision_gives_its_slot_back_when_it_expires() -> None:
    """A client that never reports holds its slots until the decisions expire
    (``decision_ttl_s``), as their load does; the next Pick expires them first."""
    settings = build_settings(
        {
            "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    now = [1000.0]
    gate = Gate(Limits(api_keys=(KEY_A,), max_concurrent_per_key=1))
    gen = serve_grpc(
        RouterState(settings),
        GrpcSettings(port=0, decision_ttl_s=60.0),
        lambda: now[0],
        gate=gate,
    )
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            front = Front("", channel, Backend("none", []))
            await front.pick(bearer(KEY_A))
            assert (await front.refused(bearer(KEY_A))).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            now[0] += 61.0
            await front.pick(bearer(KEY_A))
            # a refused Pick keeps no slot
            now[0] += 61.0
            assert (await front.refused(bearer(KEY_A), model="")).code() == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
            await front.pick(bearer(KEY_A))
    finally:
        await gen.aclose()


async def test_an_unreported_decision_expires_without_another_pick() -> None:
    """Decisions expire on their own after ``decision_ttl_s``, not only when a next Pick
    comes: a gateway that picked and then went away for good (its traffic moved to HTTP)
    leaves neither load on the replica nor its key's slot taken, which the key's HTTP
    requests share."""
    settings = build_settings(
        {
            "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    now = [1000.0]
    gate = Gate(Limits(api_keys=(KEY_A,), max_concurrent_per_key=1))
    state = RouterState(settings)
    gen = serve_grpc(state, GrpcSettings(port=0, decision_ttl_s=60.0), lambda: now[0], gate=gate)
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            front = Front("", channel, Backend("none", []))
            await front.pick(bearer(KEY_A))
            assert state.load.in_flight() == 1
            now[0] += 61.0  # no Pick, no Report from here on
            await eventually(lambda: state.load.in_flight() == 0)
            refused, held = gate.hold(0)  # KEY_A's slot (the gate's key 0) is free again
            assert refused is None
            gate.release(held)
    finally:
        await gen.aclose()


@pytest.mark.parametrize(
    "peer,address",
    [
        ("ipv4:127.0.0.1:50412", "127.0.0.1"),
        ("ipv6:%5B::1%5D:50412", "::1"),
        ("ipv6:[2001:db8::7]:443", "2001:db8::7"),
        ("unix:/tmp/kv.sock", "unix:/tmp/kv.sock"),
        ("", ""),
        (None, ""),
    ],
)
def test_grpc_peers_are_named_as_http_names_clients(peer: str | None, address: str) -> None:
    assert client_address(peer) == address
