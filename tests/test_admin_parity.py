"""The gRPC Admin service against the HTTP admin endpoints of one running router: the same
answers for the same state, and NOT_FOUND for a name the router does not know. A real
HTTP server and a real grpcio channel on loopback, sharing one RouterState."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest

from router.core.types import ReplicaKey
from router.rpc.gen import admin_pb2, admin_pb2_grpc
from router.rpc.server import loop_clock, serve_grpc
from router.rpc.settings import GrpcSettings
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import kimi_model_table, start_router

ADMIN = "admin-secret"
MODEL = "kimi"
METADATA = (("authorization", f"Bearer {ADMIN}"),)


@pytest.fixture
async def router() -> AsyncIterator[tuple[RouterState, str, admin_pb2_grpc.AdminStub]]:
    settings = build_settings(
        {
            "server": {"admin_token": ADMIN},
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"},
                {"url": "http://127.0.0.1:10", "model": MODEL, "name": "b", "dp_ranks": 2},
            ],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    state = running.app[STATE]
    gen = serve_grpc(state, GrpcSettings(port=0, admin_token=ADMIN), loop_clock)
    _server, port = await gen.__anext__()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield state, url, admin_pb2_grpc.AdminStub(channel)
    finally:
        await channel.close()
        await gen.aclose()
        await running.cleanup()


async def _http_rows(url: str) -> dict[str, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url + "/admin/replicas", headers={"X-Admin-Token": ADMIN}) as r,
    ):
        assert r.status == 200
        return {row["replica"]: row for row in (await r.json())["replicas"]}


async def test_list_replicas_answers_as_the_http_rows_with_a_penalised_replica(
    router: Any,
) -> None:
    state, url, stub = router
    state.load.dispatch("r1", ReplicaKey("a", 0), 1000, 200)
    state.fleet.set_draining(ReplicaKey("b", 1), True)
    # a failing replica's penalty is phantom load for routing, not requests it has
    state.load.set_penalty(ReplicaKey("b", 0), 2, 8192)
    http = await _http_rows(url)
    listed = await stub.ListReplicas(admin_pb2.ListReplicasRequest(), metadata=METADATA)
    grpc_rows = {str(ReplicaKey(r.replica, r.dp_rank)): r for r in listed.replicas}
    assert set(grpc_rows) == set(http) == {"a", "b", "b#dp1"}
    for name, row in http.items():
        got = grpc_rows[name]
        assert (got.in_flight, got.queued_prefill_tokens) == (
            row["in_flight"],
            row["queued_prefill_tokens"],
        ), name
        assert (got.healthy, got.draining) == (row["healthy"], row["draining"]), name
        assert (got.kv_entries, got.state_entries) == (
            row["index_kv_blocks"],
            row["index_state_blocks"],
        ), name
    assert http["a"]["in_flight"] == 1 and http["b"]["in_flight"] == 0
    stats = await stub.Stats(admin_pb2.StatsRequest(), metadata=METADATA)
    assert stats.in_flight == sum(r.in_flight for r in listed.replicas) == 1


async def test_list_replicas_of_an_unknown_model_is_not_found(router: Any) -> None:
    _, _, stub = router
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.ListReplicas(admin_pb2.ListReplicasRequest(model="nope"), metadata=METADATA)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in (exc.value.details() or "")
    listed = await stub.ListReplicas(admin_pb2.ListReplicasRequest(model=MODEL), metadata=METADATA)
    assert len(listed.replicas) == 3


async def test_drain_answers_as_http_for_unknown_names_and_ranks(router: Any) -> None:
    _, url, stub = router
    async with aiohttp.ClientSession() as s:
        for name in ("nope", "b%23dp7"):
            path = f"{url}/admin/replicas/{name}/drain"
            async with s.post(path, headers={"X-Admin-Token": ADMIN}) as r:
                assert r.status == 404
    for req in (
        admin_pb2.DrainRequest(replica="nope"),
        admin_pb2.DrainRequest(replica="b", dp_rank=7),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Drain(req, metadata=METADATA)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Drain(admin_pb2.DrainRequest(), metadata=METADATA)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
