"""Replicas discovered from the Redis registry (``server.discover_replicas``): a router with no
static replicas routes to what publishers register and stops when they deregister or their
lease expires; static replicas win over registrations (real Redis, real HTTP, openai client)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from router.core.types import ReplicaKey
from router.mock.server import MockSettings
from router.service.app import INDEX_SYNC, STATE
from router.service.config import build_settings
from router.service.ejection import Ejections, outlier_settings
from router.store.base import ReplicaInfo
from router.store.redis_store import RedisStore
from router.store.schema import KeySchema
from tests.backends import Backend, start_mock, start_router
from tests.ports import free_port
from tests.waiting import eventually

B = 64


async def _mock(name: str) -> tuple[web.AppRunner, str]:
    s = MockSettings(
        model="m", replica=name, block_size=B, engine_block_size=16,
        zmq_endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
    )  # fmt: skip
    return await start_mock(s)


@pytest.mark.parametrize("server_kind", ["redis", "redis_cluster"])
async def test_router_routes_to_registered_replicas_and_drops_them(
    server_kind: str, request: pytest.FixtureRequest, key_prefix: str
) -> None:
    url = request.getfixturevalue(
        "redis_cluster" if server_kind == "redis_cluster" else "redis_server"
    ).url
    schema = KeySchema(key_prefix, stream_shards=2)
    publisher_side = RedisStore.from_url(url, schema)
    runners: list[web.AppRunner] = []
    try:
        (mock_a, url_a), (mock_b, url_b) = await _mock("a"), await _mock("b")
        runners += [mock_a, mock_b]
        settings = build_settings(
            {
                "server": {"redis_url": url, "redis_key_prefix": key_prefix},
                "models": {"m": {"block_size": B}},
            }
        )
        router, base = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):  # nothing registered yet
            await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=1)

        await publisher_side.register(
            ReplicaInfo("a", url=url_a, model="m", rack="r1", block_size=B), "pub-a", 30
        )
        await publisher_side.register(
            ReplicaInfo("b", url=url_b, model="m", dp_ranks=(0, 1), block_size=B), "pub-b", 30
        )
        await eventually(lambda: len(state.registry.keys_for("m")) == 3)
        assert not state.fleet.is_static("a")
        assert state.registry.endpoint(ReplicaKey("a")).rack == "r1"  # type: ignore[union-attr]
        assert state.registry.endpoint(ReplicaKey("b", 1)).dp_rank == 1  # type: ignore[union-attr]
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        for i in range(6):
            done = await client.completions.create(model="m", prompt=[i + 1] * 10, max_tokens=1)
            assert done.choices
        picked = {d["replica"] for d in state.recent_decisions(6)}
        assert picked <= {"a", "b", "b#dp1"}

        # deregistration (a publisher's clean stop) removes the replica at once
        await publisher_side.deregister("b")
        await eventually(lambda: state.registry.keys_for("m") == (ReplicaKey("a"),))
        for i in range(4):
            await client.completions.create(model="m", prompt=[i + 50] * 10, max_tokens=1)
        assert {d["replica"] for d in state.recent_decisions(4)} == {"a"}

        # a registration that cannot be routed to is refused, not half-added
        await publisher_side.register(ReplicaInfo("c", url="not a url", model="m"), "pub-c", 30)
        await asyncio.sleep(0.3)
        assert state.registry.find("c") == []
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()
        await publisher_side.close()


async def test_discovered_replicas_stay_routable_when_redis_comes_back_empty(
    private_redis: Any,
) -> None:
    """Redis restarted empty: the router keeps routing to the replicas it discovered until
    their publishers register again, instead of answering 404 for the model meanwhile."""
    schema = KeySchema("kvr", stream_shards=2)
    publisher_side = RedisStore.from_url(private_redis.url, schema)
    runners: list[web.AppRunner] = []
    try:
        mock, mock_url = await _mock("a")
        runners.append(mock)
        settings = build_settings(
            {"server": {"redis_url": private_redis.url}, "models": {"m": {"block_size": B}}}
        )
        router, base = await start_router(settings)
        runners.append(router)
        state, sync = router.app[STATE], router.app[INDEX_SYNC]
        await publisher_side.register(ReplicaInfo("a", url=mock_url, model="m"), "pub-a", 30)
        await eventually(lambda: len(state.registry.keys_for("m")) == 1)
        await publisher_side.redis.flushall()
        await eventually(lambda: sync.stats.kept_on_data_loss == 1)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        done = await client.completions.create(model="m", prompt=[7] * 10, max_tokens=1)
        assert done.choices and state.registry.keys_for("m") == (ReplicaKey("a"),)
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()
        await publisher_side.close()


@pytest.mark.parametrize(
    "rogue",
    [
        pytest.param({"member": b"\xff\xfe"}, id="registry-member-not-utf8"),
        pytest.param({"info": "[" * 100_000 + "]" * 100_000}, id="info-nested-too-deep"),
        pytest.param({"info": '{"replica":"0z","url":1,"model":"m"}'}, id="url-not-a-string"),
        pytest.param(
            {"info": '{"replica":"0z","url":"http://h:1","model":["m"]}'}, id="model-list"
        ),
    ],
)
async def test_one_publishers_garbage_registration_does_not_stop_discovery(
    private_redis: Any, rogue: dict[str, Any]
) -> None:
    """A publisher may write its own registry member and registration (its ACL,
    docs/redis.md): what it writes there must not stop routers from bootstrapping and so
    from routing to every other replica (its name sorts first: it is read first)."""
    schema = KeySchema("kvr", stream_shards=2)
    publisher_side = RedisStore.from_url(private_redis.url, schema)
    runners: list[web.AppRunner] = []
    try:
        mock, mock_url = await _mock("a")
        runners.append(mock)
        await publisher_side.register(ReplicaInfo("a", url=mock_url, model="m"), "pub-a", 30)
        await publisher_side.register(ReplicaInfo("0z", url="http://h:1", model="m"), "pub-z", 30)
        if "member" in rogue:
            await publisher_side.redis.sadd(schema.registry, rogue["member"])
        else:
            await publisher_side.redis.hset(schema.meta("0z"), "info", rogue["info"])
        settings = build_settings(
            {"server": {"redis_url": private_redis.url}, "models": {"m": {"block_size": B}}}
        )
        router, base = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        await eventually(lambda: ReplicaKey("a") in state.registry.keys_for("m"))
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        done = await client.completions.create(model="m", prompt=[7] * 10, max_tokens=1)
        assert done.choices
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()
        await publisher_side.close()


async def test_static_replicas_win_over_registrations(
    redis_server: object, key_prefix: str
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    publisher_side = RedisStore.from_url(url, KeySchema(key_prefix, stream_shards=2))
    runners: list[web.AppRunner] = []
    try:
        (mock_a, url_a), (mock_b, url_b) = await _mock("a"), await _mock("b")
        runners += [mock_a, mock_b]
        settings = build_settings(
            {
                "server": {"redis_url": url, "redis_key_prefix": key_prefix},
                "replicas": [{"url": url_a, "model": "m", "name": "static-a"}],
                "models": {"m": {"block_size": B}},
            }
        )
        router, _ = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        # same URL under another name: refused (it would split one engine's traffic)
        await publisher_side.register(ReplicaInfo("a", url=url_a, model="m"), "pub-a", 30)
        # same name as the static one, other URL: the configuration wins
        await publisher_side.register(ReplicaInfo("static-a", url=url_b, model="m"), "pub", 30)
        await publisher_side.register(ReplicaInfo("b", url=url_b, model="m"), "pub-b", 30)
        await eventually(lambda: len(state.registry.keys_for("m")) == 2)
        await asyncio.sleep(0.2)
        endpoints = {str(ep.key): ep.base_url for ep in state.registry.endpoints()}
        assert endpoints == {"static-a": url_a, "b": url_b}
        await publisher_side.deregister("static-a")  # never removes a configured replica
        await asyncio.sleep(0.3)
        assert state.registry.find("static-a") == [ReplicaKey("static-a")]
    finally:
        for runner in runners:
            await runner.cleanup()
        await publisher_side.close()


# ---------------------------------------------------------------------------- the registry rules
# (RouterState directly: what IndexSync's listener calls on ReplicaUp / ReplicaDown)


def _state(static: list[dict[str, object]] | None = None) -> object:
    from router.service.state import RouterState

    return RouterState(
        build_settings(
            {"replicas": static or [], "models": {"m": {"block_size": B}, "n": {"block_size": B}}}
        )
    )


def _page(state: object) -> str:
    return state.metrics.render().decode()  # type: ignore[attr-defined]


def test_refused_reregistration_withdraws_the_old_address() -> None:
    state: Any = _state()
    assert state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.1:8000", model="m"))
    # the same replica now registers something unusable: the old URL must not stay routable
    assert not state.fleet.add_discovered(ReplicaInfo("a", url="ftp://10.0.0.1", model="m"))
    assert state.registry.find("a") == []
    assert ReplicaKey("a") not in state.load.replicas()


def test_unknown_models_and_taken_urls_are_refused() -> None:
    state: Any = _state([{"url": "http://10.0.0.9:8000", "model": "m", "name": "static"}])
    assert not state.fleet.add_discovered(ReplicaInfo("x", url="http://10.0.0.2:8000", model="zzz"))
    assert "zzz" not in state.engines  # publishers cannot create models
    # the static replica's URL, spelled differently
    assert not state.fleet.add_discovered(ReplicaInfo("y", url="HTTP://10.0.0.9:8000/", model="m"))
    assert not state.fleet.add_discovered(
        ReplicaInfo("z", url="http://10.0.0.9:8000/v1", model="m")
    )
    assert state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.3:80", model="m"))
    assert not state.fleet.add_discovered(ReplicaInfo("b", url="http://10.0.0.3", model="m"))  # :80
    assert sorted(str(k) for k in state.registry.keys_for("m")) == ["a", "static"]


def test_registrations_the_proxy_cannot_reach_are_refused() -> None:
    """The proxy speaks plain http to a replica's root: an https URL or one with a path,
    query or fragment would fail (or lose its path) on every request."""
    state: Any = _state()
    for url in (
        "https://10.0.0.5:8443",
        "http://10.0.0.5:8000/prefix",
        "http://10.0.0.5:8000/?x=1",
        "http://10.0.0.5:8000#f",
        "http://user:pw@10.0.0.5:8000",
        "http://10.0.0.5:0",
    ):
        assert not state.fleet.add_discovered(ReplicaInfo("p", url=url, model="m")), url
    assert state.registry.find("p") == []
    assert state.fleet.add_discovered(ReplicaInfo("p", url="http://10.0.0.5:8000/", model="m"))


def test_an_identical_reregistration_keeps_the_routing_caches() -> None:
    """A re-bootstrap re-announces every replica: the model's key tuple (which routing
    caches index positions by) must stay the same object; a real change replaces it."""
    state: Any = _state()
    info = ReplicaInfo("a", url="http://10.0.0.1:8000", model="m", dp_ranks=(0, 1))
    assert state.fleet.add_discovered(info)
    keys = state.registry.keys_for("m")
    assert state.fleet.add_discovered(
        ReplicaInfo("a", url="http://10.0.0.1:8000", model="m", dp_ranks=(0, 1))
    )
    assert state.registry.keys_for("m") is keys
    assert state.fleet.add_discovered(
        ReplicaInfo("a", url="http://10.0.0.1:8001", model="m", dp_ranks=(0, 1))
    )
    assert state.registry.keys_for("m") is not keys
    assert state.registry.endpoint(ReplicaKey("a", 1)).base_url == "http://10.0.0.1:8001"


def test_fewer_dp_ranks_forget_the_old_keys_everywhere() -> None:
    state: Any = _state()
    state.fleet.add_discovered(
        ReplicaInfo("d", url="http://10.0.0.4:8000", model="m", dp_ranks=(0, 1))
    )
    gone = ReplicaKey("d", 1)
    state.fleet.mark_unhealthy(gone, 0.0)
    state.fleet.engine_prefix_cache[gone] = (10.0, 5.0)
    state.fleet.add_discovered(ReplicaInfo("d", url="http://10.0.0.4:8000", model="m"))
    assert state.registry.find("d") == [ReplicaKey("d")]
    assert gone not in state.load.replicas()
    assert gone not in state.fleet.unhealthy_until and gone not in state.fleet.engine_prefix_cache


def test_a_removed_replica_is_not_brought_back_by_a_late_failure() -> None:
    state: Any = _state()
    state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.1:8000", model="m"))
    state.fleet.remove_discovered("a")
    state.fleet.mark_unhealthy(ReplicaKey("a"), 0.0)  # e.g. a request that was in flight to it
    state.fleet.restore_health(1e9)
    assert ReplicaKey("a") not in state.load.replicas()
    assert ReplicaKey("a") not in state.fleet.unhealthy_until


def test_drain_survives_the_replica_leaving_and_coming_back() -> None:
    state: Any = _state()
    info = ReplicaInfo("a", url="http://10.0.0.1:8000", model="m")
    state.fleet.add_discovered(info)
    state.fleet.set_draining(ReplicaKey("a"), True)  # what POST /admin/replicas/a/drain calls
    state.fleet.remove_discovered("a")  # a publisher restart during a rolling update
    state.fleet.add_discovered(info)
    assert state.load.view(ReplicaKey("a"), 0.0).draining


def test_a_drained_replica_s_ranks_registered_later_are_drained_too() -> None:
    """A drain of a whole replica (``POST /admin/replicas/a/drain``) covered the ranks it had
    then: registered again with more ranks, the new ones took requests. Undraining one rank
    ends the whole-replica drain for later ranks, the others stay as they were."""
    state: Any = _state()
    state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.1:8000", model="m"))
    state.fleet.set_replica_draining("a", True)
    state.fleet.add_discovered(
        ReplicaInfo("a", url="http://10.0.0.1:8000", model="m", dp_ranks=(0, 1, 2))
    )
    assert [state.load.view(ReplicaKey("a", r), 0.0).draining for r in (0, 1, 2)] == [True] * 3
    state.fleet.set_draining(ReplicaKey("a", 2), False)
    state.fleet.add_discovered(
        ReplicaInfo("a", url="http://10.0.0.1:8000", model="m", dp_ranks=(0, 1, 2, 3))
    )
    views = [state.load.view(ReplicaKey("a", r), 0.0).draining for r in (0, 1, 2, 3)]
    assert views == [True, True, False, False]
    state.fleet.set_replica_draining("a", False)
    assert not any(state.load.view(k, 0.0).draining for k in state.registry.find("a"))


def test_a_removed_replicas_series_leave_the_metrics_page() -> None:
    state: Any = _state()
    state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.1:8000", model="m"))
    mm = state.metrics.model("m")
    mm.outcome(ReplicaKey("a"), "ok").inc()
    sent, predicted = mm.replica(ReplicaKey("a"))
    sent.inc(100)
    predicted.inc(50)
    state.fleet.engine_prefix_cache[ReplicaKey("a")] = (100.0, 40.0)
    state.event_lag_s["a"] = 0.02  # as the direct event path sets it (router/events/direct.py)
    assert 'kvrouter_index_event_lag_seconds{replica="a"}' in _page(state)
    state.fleet.remove_discovered("a")
    assert 'replica="a"' not in _page(state)
    # and it can come back with fresh series
    state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.1:8000", model="m"))
    state.metrics.model("m").outcome(ReplicaKey("a"), "ok").inc()
    assert 'kvrouter_requests_total{model="m",outcome="ok",replica="a"} 1.0' in _page(state)


@pytest.mark.parametrize(
    "again",
    [
        ReplicaInfo("a", url="http://10.0.0.2:8000", model="m"),  # restarted elsewhere
        ReplicaInfo("a", url="http://10.0.0.1:8000", model="n"),  # now serving another model
    ],
)
def test_a_name_registered_for_another_engine_starts_afresh(again: ReplicaInfo) -> None:
    """A replica name registered again at another address, or for another model, before its
    old registration expired is another engine: the requests in flight to the old one do
    not load it, and their completion does not release the new one's."""
    state: Any = _state()
    a = ReplicaKey("a")
    assert state.fleet.add_discovered(ReplicaInfo("a", url="http://10.0.0.1:8000", model="m"))
    state.load.dispatch("old", a, prompt_tokens=100, cached_tokens=0)
    state.metrics.model("m").outcome(a, "ok").inc()
    state.fleet.mark_unhealthy(a, 0.0)
    assert state.fleet.add_discovered(again)
    view = state.load.view(a, 0.0)
    assert (view.prefilling, view.in_flight_prompt_tokens, view.healthy) == (0, 0, True)
    state.load.dispatch("new", a, prompt_tokens=50, cached_tokens=0)
    state.load.complete("old")  # the old engine answered at last
    view = state.load.view(a, 0.0)
    assert (view.prefilling, view.in_flight_prompt_tokens) == (1, 50)
    assert 'model="m",outcome="ok",replica="a"' not in _page(state)
    # the same registration spelled differently is the same engine: nothing is forgotten
    state.fleet.add_discovered(ReplicaInfo("a", url=again.url + "/", model=again.model))
    assert state.load.view(a, 0.0).prefilling == 1


def test_an_ejected_replica_that_leaves_and_comes_back_starts_with_a_clean_record() -> None:
    """Leaving forgets a replica's unhealthy mark; its failure run, ejection and penalty go
    too: else its name comes back routable yet ejected, carrying phantom requests (load)
    its new engine never failed."""
    state: Any = _state()
    ejections = Ejections(state, outlier_settings(state.settings.server))
    a = ReplicaKey("a")
    info = ReplicaInfo("a", url="http://10.0.0.1:8000", model="m")
    state.fleet.add_discovered(info)
    state.fleet.add_discovered(ReplicaInfo("b", url="http://10.0.0.2:8000", model="m"))
    for i in range(3):
        token = object()
        ejections.sent(a, token, float(i), 1.0)
        ejections.failed(a, "http_5xx", i + 0.1, token)
    view = state.load.view(a, 2.5)
    assert view.prefilling == 6 and not view.healthy  # ejected, with its phantom load
    state.fleet.remove_discovered("a")  # its publisher restarts
    ejections.failed(a, "connect", 2.6)  # an attempt that was in flight to it fails late
    state.fleet.add_discovered(info)
    ejections.sweep(2.7)
    view = state.load.view(a, 2.7)
    assert (view.prefilling, view.queued_prefill_tokens, view.healthy) == (0, 0, True)
    assert ejections.status(a, 2.7) == {
        "failures_in_a_row": 0,
        "ejected": False,
        "penalty_requests": 0,
    }
    assert 'kind="connect"' not in _page(state)  # the late failure was not counted


# ---------------------------------------------------------------------------- replica churn
# (a router runs for weeks while discovered replicas come and go at new names and addresses:
# nothing kept per replica may outlive it)


def test_churned_replicas_leave_no_failure_or_ejection_series() -> None:
    """``kvrouter_replica_failures_total`` / ``kvrouter_replica_ejections_total`` children
    of a replica that left go with it, as ``kvrouter_requests_total``'s do: else every pod
    that ever failed stays on the page, frozen, for ever."""
    state: Any = _state()
    ejections = Ejections(state, outlier_settings(state.settings.server))
    state.fleet.add_discovered(ReplicaInfo("keep", url="http://10.0.1.1:8000", model="m"))
    for i in range(40):
        name = f"pod-{i}"
        key = ReplicaKey(name)
        assert state.fleet.add_discovered(
            ReplicaInfo(name, url=f"http://10.0.0.{i + 1}:8000", model="m")
        )
        for j in range(3):
            token = object()
            ejections.sent(key, token, i + j / 10, 1.0)
            ejections.failed(key, "http_5xx", i + j / 10 + 0.01, token)
        page = _page(state)
        assert f'kind="http_5xx",model="m",replica="{name}"' in page
        assert f'model="m",reason="failures",replica="{name}"' in page
        state.fleet.remove_discovered(name)
    page = _page(state)
    assert 'replica="pod-' not in page
    assert len(ejections.failures._children) == 0
    assert len(ejections.ejections._children) == 0


async def test_churned_replicas_leave_no_decode_stall_ledger_rows() -> None:
    """Admission's decode-stall ledger (router/core/stall.py) keeps a prefill clock, a heap
    of allowances and the allowances themselves per replica: a replica that leaves takes
    them with it (its requests leave the load model too), else each pod that ever served
    keeps its rows for ever."""
    from router.service.admission import Admission
    from router.service.intake import admit
    from router.service.state import RouterState

    state = RouterState(
        build_settings({"models": {"m": {"block_size": B, "admission": {"enabled": True}}}})
    )
    adm = Admission(state)
    state.admission = adm
    loop = asyncio.get_running_loop()
    prompt = list(range(1, 200))
    for i in range(40):
        name = f"pod-{i}"
        assert state.fleet.add_discovered(
            ReplicaInfo(name, url=f"http://10.0.0.{i + 1}:8000", model="m")
        )
        body = {"model": "m", "prompt": prompt, "max_tokens": 100}
        admitted = await admit(state, body, 1000, "completion")
        routed = await adm.route(
            "m", admitted.prompt, f"r{i}", loop.time(),
            klass=1, tenant="", session_id=None, max_output_tokens=100,
        )  # fmt: skip
        assert routed.decision.replica == ReplicaKey(name)
        state.fleet.remove_discovered(name)  # its pod goes with the request in flight
    m = adm._models["m"]
    assert m is not None
    stall = m.queue.stall
    assert (len(stall), len(stall._clock), len(stall._heaps)) == (0, 0, 0)


async def test_churned_replicas_leave_no_connection_pools() -> None:
    """The proxy's keep-alive pools are per replica address: a replica that leaves (a pod
    restarted at a new address, a scale-down) takes its pool with it, its idle connections
    closed; else every address the router ever sent to keeps a pool, and its sockets."""
    from router.service.keys import FORWARDER

    router, base = await start_router(build_settings({"models": {"m": {"block_size": B}}}))
    state = router.app[STATE]
    forwarder = router.app[FORWARDER]
    backends: list[Backend] = []
    old_pools = []
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(12):
                backend = await Backend(f"b{i}", ["m"]).start()
                backends.append(backend)
                name = f"pod-{i}"
                assert state.fleet.add_discovered(
                    ReplicaInfo(name, url=backend.url, model="m", block_size=B)
                )
                body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
                async with http.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                assert backend.received
                pool = forwarder.client._pools[backend.url]
                assert pool._idle  # the answer's connection, kept alive
                old_pools.append(pool)
                state.fleet.remove_discovered(name)
        live = {ep.base_url for ep in state.registry.endpoints()}
        assert set(forwarder.client._pools) <= live
        assert set(forwarder._hosts) <= live
        assert not any(p._idle for p in old_pools)
    finally:
        await router.cleanup()
        for backend in backends:
            await backend.stop()
