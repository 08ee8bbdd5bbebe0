"""Prefill/decode disaggregation through the router over real HTTP: vLLM's
``kv_transfer_params`` protocol between mock replicas playing both roles, one OpenAI answer
(streamed or not), the rack-aware pairing, decode-side blocks reaching the index through the
engines' KV events, and the fallbacks (router/service/disagg.py, router/mock/pd.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.types import ReplicaKey
from router.mock.server import MockSettings
from router.mock.state import STATE as MOCK
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import metric_sample, start_mock, start_router
from tests.ports import free_port
from tests.waiting import eventually

B = 64
MODEL = "m"
TOKEN = "admin-secret"
PROFILE = """
name = "pd-small"
block_size = 64
kv_blocks = 20000
hybrid = true
checkpoint = "every_n"
checkpoint_interval_tokens = 4096
state_checkpoint_blocks = 40.0
kv_bytes_per_token = 9216.0
state_bytes = 24e6

[cost]
step_overhead_s = 0.002
prefill_s_per_token = 1e-6
decode_s_per_seq = 1e-4
"""
# (name, role, rack)
FLEET = [("p0", "prefill", "rack0"), ("d0", "decode", "rack0"), ("d1", "decode", "rack1")]


class Mocks:
    def __init__(self) -> None:
        self.runners: list[Any] = []
        self.urls: dict[str, str] = {}
        self.zmq: dict[str, str] = {}

    def counters(self, name: str) -> Any:
        return self.runners[list(self.urls).index(name)].app[MOCK].counters


@pytest.fixture
async def mocks(tmp_path: Path) -> AsyncIterator[Mocks]:
    profile = tmp_path / "pd-small.toml"
    profile.write_text(PROFILE)
    m = Mocks()
    try:
        for name, _, rack in FLEET:
            zmq = f"tcp://127.0.0.1:{free_port()}"
            s = MockSettings(
                model=MODEL, replica=name, profile=str(profile), block_size=B,
                zmq_endpoint=zmq, rack=rack, region="reg0", time_scale=0.05,
            )  # fmt: skip
            runner, url = await start_mock(s)
            m.runners.append(runner)
            m.urls[name] = url
            m.zmq[name] = zmq
        yield m
    finally:
        for r in m.runners:
            await r.cleanup()


def _both_and_decode(both: str, decode: str) -> list[dict[str, Any]]:
    """Replica tables: ``p0`` prefills and decodes (rack0), ``d0`` decodes (rack1)."""
    return [
        {"url": both, "model": MODEL, "name": "p0", "role": "both", "rack": "rack0",
         "region": "reg0"},
        {"url": decode, "model": MODEL, "name": "d0", "role": "decode", "rack": "rack1",
         "region": "reg0"},
    ]  # fmt: skip


def _settings(replicas: list[dict[str, Any]], mode: str = "always", **server: Any) -> Any:
    return build_settings(
        {
            # no active probes: the fallbacks under test must meet dead and stub replicas
            # that a probe would take out of rotation first
            "server": {"max_retries": 2, "admin_token": TOKEN, "health_interval_s": 0, **server},
            "replicas": replicas,
            "models": {MODEL: {"block_size": B, "hybrid": True, "pd": {"mode": mode}}},
        }
    )


def _replicas(m: Mocks) -> list[dict[str, Any]]:
    return [
        {"url": m.urls[n], "model": MODEL, "name": n, "role": role, "rack": rack,
         "region": "reg0", "zmq": m.zmq[n]}
        for n, role, rack in FLEET
    ]  # fmt: skip


def _prompt(seed: int, n: int = 3000) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(n)]


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body) as r,
    ):
        return r.status, await r.read(), r.headers.get("Content-Type", "")


async def test_protocol_both_roles_stream_and_rack_pairing(mocks: Mocks) -> None:
    router, url = await start_router(_settings(_replicas(mocks)))
    try:
        prompt = _prompt(1)
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": prompt, "max_tokens": 5})
        assert status == 200, raw
        answer = json.loads(raw)
        # the decode leg's own answer: null, as vLLM dumps it
        assert answer["object"] == "text_completion" and answer["kv_transfer_params"] is None
        assert answer["usage"]["completion_tokens"] == 5  # the decode replica's whole answer
        assert mocks.counters("p0").prefill_legs == 1
        # the decode replica in the prefill replica's rack pulled the KV and the state
        assert mocks.counters("d0").decode_legs == 1 and mocks.counters("d1").decode_legs == 0
        assert mocks.counters("d0").pulled_bytes == len(prompt) * 9216.0 + 24e6
        # streamed: one SSE answer ending in [DONE], with the usage the client asked for
        body = {"model": MODEL, "prompt": _prompt(2), "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        status, raw, ctype = await _post(url, body)
        assert status == 200 and ctype.startswith("text/event-stream")
        events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
        assert len(text.split()) == 4
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        assert mocks.counters("p0").prefill_legs == 2 and mocks.counters("d0").decode_legs == 2
        # the decode replica's blocks reach the router's index through its KV events
        state = router.app[STATE]
        hashes = hash_prompt(prompt, B, root_hash(MODEL)).hashes

        def published() -> bool:
            match = state.index.match(hashes, hybrid=True).get(ReplicaKey("d0"))
            return match is not None and match.usable_blocks == len(hashes)

        await eventually(published)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            page = await r.text()
        assert metric_sample(page, "kvrouter_pd_decisions_total", reason="always") == 2
        assert metric_sample(page, "kvrouter_replica_role", replica="p0", role="prefill") == 1
        assert (metric_sample(page, "kvrouter_pd_transfer_bytes_total", link="nvlink") or 0) > 0
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/admin/pd", headers={"X-Admin-Token": TOKEN}) as r,
        ):
            view = (await r.json())["models"][MODEL]
        assert view["mode"] == "always" and view["prefill"] == ["p0"]
    finally:
        await router.cleanup()


async def test_fallbacks_prefill_down_and_decode_down(mocks: Mocks) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    replicas = _replicas(mocks)
    # the only prefill replica is down: each request is prefilled on its decode replica
    replicas[0] = {**replicas[0], "url": dead}
    del replicas[0]["zmq"]
    router, url = await start_router(_settings(replicas))
    try:
        for seed in (3, 4):
            status, raw, _ = await _post(
                url, {"model": MODEL, "prompt": _prompt(seed), "max_tokens": 3}
            )
            assert status == 200, raw
            assert json.loads(raw)["usage"]["completion_tokens"] == 3
        assert mocks.counters("d0").decode_legs + mocks.counters("d1").decode_legs == 0
        assert mocks.counters("d0").requests + mocks.counters("d1").requests == 2
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            page = await r.text()
        fell = metric_sample(page, "kvrouter_pd_prefill_fallbacks_total", cause="connect_error")
        assert fell is not None and fell >= 1
    finally:
        await router.cleanup()
    # the decode replica in the prefill replica's rack is down: retried on the other one
    replicas = _replicas(mocks)
    replicas[1] = {**replicas[1], "url": dead}
    del replicas[1]["zmq"]
    router, url = await start_router(_settings(replicas))
    try:
        body = {"model": MODEL, "prompt": _prompt(5), "max_tokens": 3, "stream": True}
        status, raw, _ = await _post(url, body)
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        assert mocks.counters("d1").decode_legs == 1
    finally:
        await router.cleanup()


async def test_a_prefill_replica_refusing_connections_leaves_rotation_with_every_rank(
    mocks: Mocks,
) -> None:
    """Nothing listens at a prefill replica's URL, which all its DP ranks share: one leg's
    refused connection takes every rank out of rotation, as the forwarder does for a
    request (each rank would otherwise cost a request one more refused leg)."""
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = _replicas(mocks)
    replicas[0] = {**replicas[0], "url": dead, "dp_ranks": 2}
    del replicas[0]["zmq"]
    router, url = await start_router(_settings(replicas))
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(6), "max_tokens": 2})
        assert status == 200, raw
        fleet = router.app[STATE].fleet
        assert set(fleet.unhealthy_until) >= {ReplicaKey("p0"), ReplicaKey("p0", 1)}
    finally:
        await router.cleanup()


async def test_auto_keeps_short_prompts_local(mocks: Mocks) -> None:
    replicas = _replicas(mocks)
    for r in replicas[1:]:
        r["role"] = "both"
    router, url = await start_router(_settings(replicas, mode="auto"))
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(6, 200)})
        assert status == 200, raw
        assert mocks.counters("p0").prefill_legs == 0  # 200 tokens: prefilled where decoded
        assert router.app[STATE].disagg[MODEL].decisions == {"few_uncached": 1}
    finally:
        await router.cleanup()


def test_roles_in_config_and_registrations() -> None:
    from router.core.errors import ConfigError
    from router.store.base import ReplicaInfo

    info = ReplicaInfo("p0", url="http://a:1", model=MODEL, role="prefill", rack="r0")
    assert ReplicaInfo.from_json(info.to_json()).role == "prefill"
    assert ReplicaInfo.from_json('{"replica": "old"}').role == "both"  # older publishers
    with pytest.raises(ValueError):
        ReplicaInfo.from_json('{"replica": "x", "role": "router"}')
    with pytest.raises(ConfigError, match="role"):
        _settings([{"url": "http://a:1", "model": MODEL, "role": "router"}])
    with pytest.raises(ConfigError, match="pd"):
        build_settings({"models": {MODEL: {"pd": {"mode": "auto", "bogus": 1}}}})
    # off: served as a model without a pd table, every replica routable whatever its role
    # (docs/pd.md); the simulator's --pd off gives every replica the role both
    off = build_settings({"models": {MODEL: {"pd": {"mode": "off"}}}})
    assert off.models[MODEL].pd is None


async def test_the_prefill_request_is_vllms(mocks: Mocks) -> None:
    """What the prefill replica receives, byte for byte the fields vLLM's proxies set, and
    what the decode replica gets back from its answer."""
    from aiohttp import web

    seen: list[tuple[dict[str, Any], str]] = []
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
              "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 1}  # fmt: skip

    async def prefill(request: web.Request) -> web.Response:
        seen.append((await request.json(), request.headers.get("X-Request-Id", "")))
        return web.json_response({"object": "text_completion", "choices": [],
                                  "kv_transfer_params": params})  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", prefill)
    runner, prefill_url = await _serve_app(app)
    replicas = _replicas(mocks)
    replicas[0] = {**replicas[0], "url": prefill_url}
    del replicas[0]["zmq"]
    router, url = await start_router(_settings(replicas))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}],
                "stream": True, "stream_options": {"include_usage": True},
                "max_completion_tokens": 7}  # fmt: skip
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "r1"}) as r,
        ):
            assert r.status == 200
            raw = await r.read()
        assert raw.rstrip().endswith(b"data: [DONE]")
        ((got, rid),) = seen
        assert rid == "r1"
        assert got["stream"] is False and got["stream_options"] is None
        assert got["max_tokens"] == 1 and got["max_completion_tokens"] == 1
        assert got["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }  # fmt: skip
        assert got["messages"] == body["messages"]
        # the decode replica pulled what the answer named (remote_engine_id "x": no rack)
        assert mocks.counters("d0").decode_legs + mocks.counters("d1").decode_legs == 1
    finally:
        await router.cleanup()
        await runner.cleanup()


# ---------------------------------------------------------------- review: defects found


async def _serve_app(app: Any) -> tuple[Any, str]:
    """Serve the aiohttp ``app`` on a free loopback port: its runner (to clean up) and URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


class _Prefill:
    """A prefill stub answering vLLM-style ``kv_transfer_params``; records what it got;
    ``hook`` runs before it answers, ``gate`` holds answers until set."""

    PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
              "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 1}  # fmt: skip

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], str]] = []
        self.hook: Any = None
        self.gate: Any = None
        self.status = 200  # another: answered as an error
        self.retry_after = ""  # the error's Retry-After header, when set
        self.runner: Any = None
        self.url = ""

    async def _answer(self, request: Any) -> Any:
        from aiohttp import web

        self.seen.append((await request.json(), request.headers.get("X-Request-Id", "")))
        if self.hook is not None:
            self.hook()
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            headers = {"Retry-After": self.retry_after} if self.retry_after else None
            return web.json_response(
                {"error": {"message": "boom"}}, status=self.status, headers=headers
            )
        return web.json_response(
            {"object": "text_completion", "choices": [], "kv_transfer_params": self.PARAMS}
        )

    async def start(self) -> _Prefill:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        self.runner, self.url = await _serve_app(app)
        return self


def _stub_settings(
    prefill: str, decode: list[tuple[str, str]], mode: str = "always", **server: Any
) -> Any:
    reps = [{"url": prefill, "model": MODEL, "name": "p0", "role": "prefill", "rack": "rack0",
             "region": "reg0"}]  # fmt: skip
    for i, (u, role) in enumerate(decode):
        reps.append({"url": u, "model": MODEL, "name": f"d{i}", "role": role, "rack": "rack0",
                     "region": "reg0"})  # fmt: skip
    return _settings(reps, mode=mode, **server)


async def test_a_prefill_replica_failing_every_leg_is_ejected() -> None:
    """Prefill legs answered 5xx feed outlier ejection as failed requests do: after
    ``outlier_consecutive_failures`` of them the prefill replica is ejected, so requests
    stop paying a failed leg before their local prefill; every request is answered."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    prefill.status = 500
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        failures = state.settings.server.outlier_consecutive_failures
        for i in range(failures + 2):
            status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(i, 300)})
            assert status == 200, raw
        assert len(prefill.seen) == failures  # the legs after the ejection went nowhere
        assert len(decode.received) == failures + 2
        assert ReplicaKey("p0") in state.fleet.unhealthy_until
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_no_decode_replica_after_prefill_answers_with_retry_after() -> None:
    """The decode pick fails after the prefill leg (every decode replica went out of
    rotation meanwhile): a 503 like any other, streamed or not, in OpenAI's shape
    (``service_unavailable`` / ``no_replica_available``) with its Retry-After, never the
    prefill leg's answer nor an empty 200."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    prefill.hook = lambda: state.fleet.mark_unhealthy(ReplicaKey("d0"), 0.0)
    state.fleet.restore_health = lambda now: None  # stays out while the request is served
    try:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": _prompt(11 + stream), "stream": stream}
            async with (
                aiohttp.ClientSession() as http,
                http.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 503, await r.text()
                assert r.headers["Content-Type"].startswith("application/json")
                assert int(r.headers["Retry-After"]) >= 1
                error = (await r.json())["error"]
            assert error["type"] == "service_unavailable", error
            assert error["code"] == "no_replica_available", error
            assert isinstance(error["message"], str) and error["message"]
            assert set(error) == {"message", "type", "param", "code"}, error
        assert len(prefill.seen) == 2
        # the decode replica got no decode leg, only the transfers to release (pd_release)
        await eventually(lambda: len(decode.received) == 2)
        for got in decode.received:
            assert got["body"]["use_beam_search"] is True, got
            assert got["body"]["kv_transfer_params"] == _Prefill.PARAMS
        assert state.load.in_flight() == 0
        for _, rid in prefill.seen:
            assert state.load.replica_of(rid + "#p") is None
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            page = await r.text()
        # the refusal is counted as the router's own answer, as a refusal before routing is
        assert f'kvrouter_requests_total{{model="{MODEL}",outcome="rejected",replica=""' in page
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_no_decode_replica_after_prefill_is_a_row_of_offered_load(tmp_path: Path) -> None:
    """A disaggregated request refused for want of a decode replica after its prefill leg
    (a 503, as one refused before routing) was no row of the recorded trace, though a
    refusal before routing is one: a replay offered less load. It is a row with its
    ``status`` and no outcome (router.service.answer_relay ``record_request``)."""
    from tests.backends import Backend

    trace = tmp_path / "trace.jsonl"
    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    settings = _stub_settings(
        prefill.url, [(decode.url, "decode")], record_path=str(trace), record_key="k"
    )
    router, url = await start_router(settings)
    state = router.app[STATE]
    prefill.hook = lambda: state.fleet.mark_unhealthy(ReplicaKey("d0"), 0.0)
    state.fleet.restore_health = lambda now: None  # stays out while the request is served
    try:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": _prompt(21 + stream), "stream": stream,
                    "max_tokens": 9}  # fmt: skip
            async with (
                aiohttp.ClientSession() as http,
                http.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 503, await r.text()
    finally:
        await router.cleanup()  # (flushes the trace)
        await prefill.runner.cleanup()
        await decode.stop()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r.get("status"), r.get("stream")) for r in rows] == [(503, False), (503, True)]
    for row in rows:
        assert row["output_length"] == 9 and row["input_length"] == 3000, row
        assert not {"replica", "pred_hit", "cached", "ttft_ms"} & row.keys(), row


async def test_local_request_is_retried_on_the_next_replica() -> None:
    """``auto`` keeps a short prompt local: a replica that refuses it is not the end, the
    next one of the local pool serves it (as without disaggregation)."""
    import random

    from tests.backends import Backend

    dead = f"http://127.0.0.1:{free_port()}"
    prefill = await _Prefill().start()
    live = await Backend("b1", [MODEL]).start()
    settings = _stub_settings(prefill.url, [(dead, "both"), (live.url, "both")], mode="auto")
    for seed in range(6):
        router, url = await start_router(settings)
        router.app[STATE].rng = random.Random(seed)
        try:
            status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(seed, 200)})
            assert status == 200, (seed, raw)
        finally:
            await router.cleanup()
    assert not prefill.seen
    await prefill.runner.cleanup()
    await live.stop()


async def test_client_kv_transfer_params_never_reach_a_replica() -> None:
    """A client's own ``kv_transfer_params`` (a decode leg pointing at any host and blocks)
    are not forwarded: not on the prefill fallback, not on a local request."""
    from tests.backends import Backend

    forged = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
              "remote_block_ids": [7, 8, 9], "remote_host": "203.0.113.9",
              "remote_port": 5600}  # fmt: skip
    prefill = await Backend("p0", [MODEL]).start()  # answers no kv_transfer_params: fallback
    decode = await Backend("d0", [MODEL]).start()
    try:
        for mode, role, n in (("always", "decode", 3000), ("auto", "both", 200)):
            router, url = await start_router(
                _stub_settings(prefill.url, [(decode.url, role)], mode=mode)
            )
            try:
                body = {"model": MODEL, "prompt": _prompt(12, n), "kv_transfer_params": forged}
                status, raw, _ = await _post(url, body)
                assert status == 200, raw
            finally:
                await router.cleanup()
            got = decode.received[-1]["body"]
            assert got.get("kv_transfer_params") is None, (mode, got)
        assert prefill.received[-1]["body"]["kv_transfer_params"]["do_remote_decode"] is True
    finally:
        await prefill.stop()
        await decode.stop()


async def test_min_tokens_stays_off_the_prefill_leg() -> None:
    """vLLM refuses ``min_tokens`` above ``max_tokens`` (1 on the prefill leg), so the toy
    proxy leaves it out there; the decode leg keeps the client's."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    try:
        body = {"model": MODEL, "prompt": _prompt(13), "max_tokens": 9, "min_tokens": 5}
        status, raw, _ = await _post(url, body)
        assert status == 200, raw
        ((got, _),) = prefill.seen
        assert got["max_tokens"] == 1 and got.get("min_tokens", 0) <= 1
        sent = decode.received[-1]["body"]
        assert sent["min_tokens"] == 5 and sent["max_tokens"] == 9
        assert sent["kv_transfer_params"] == _Prefill.PARAMS
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_prefill_caps_follow_the_parsed_body_not_its_spelling() -> None:
    """A key written with JSON escapes is the same key to the engine: the prefill leg caps
    ``max_completion_tokens`` and ``min_tokens`` however the client spelled them."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    try:
        body = json.dumps({"model": MODEL, "prompt": _prompt(14), "max_tokens": 9})
        raw = body[:-1] + ', "max_completion_token\\u0073": 7, "min_token\\u0073": 5}'
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                url + "/v1/completions",
                data=raw.encode(),
                headers={"Content-Type": "application/json"},
            ) as r,
        ):
            assert r.status == 200, await r.read()
        ((got, _),) = prefill.seen
        assert got["max_tokens"] == 1 and got["max_completion_tokens"] == 1
        assert got["min_tokens"] == 0
        sent = decode.received[-1]["body"]
        assert sent["max_completion_tokens"] == 7 and sent["min_tokens"] == 5
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_parallel_sampling_is_not_disaggregated() -> None:
    """vLLM's P/D carries one request's blocks: with ``n`` > 1 the prefill replica's other
    samples hold their KV until a timeout and the decode side has one sample's blocks. Such
    a request is prefilled where it is decoded."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    try:
        body = {"model": MODEL, "prompt": _prompt(14), "max_tokens": 4, "n": 2}
        status, raw, _ = await _post(url, body)
        assert status == 200, raw
        assert not prefill.seen
        sent = decode.received[-1]["body"]
        assert sent["n"] == 2 and sent.get("kv_transfer_params") is None
        decisions = router.app[STATE].disagg[MODEL].decisions
        assert decisions == {"parallel_sampling": 1}
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_same_request_id_twice_in_flight_gets_two_ids_on_the_legs() -> None:
    """Two requests with one ``X-Request-Id`` at once: the second's legs carry another id
    (older NIXL connectors pair the legs by it: one request must not get the other's KV)."""
    import asyncio

    from tests.backends import Backend

    prefill = await _Prefill().start()
    prefill.gate = asyncio.Event()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        async with aiohttp.ClientSession() as http:

            async def one(seed: int) -> int:
                body = {"model": MODEL, "prompt": _prompt(seed)}
                async with http.post(
                    url + "/v1/completions", json=body, headers={"X-Request-Id": "same"}
                ) as r:
                    await r.read()
                    return r.status

            first = asyncio.ensure_future(one(15))
            await eventually(lambda: len(prefill.seen) == 1)
            second = asyncio.ensure_future(one(16))
            await eventually(lambda: len(prefill.seen) == 2)
            prefill.gate.set()
            assert await first == 200 and await second == 200
        ids = [rid for _, rid in prefill.seen]
        assert ids[0] == "same" and ids[1] != "same"
        legs = [r["headers"]["x-request-id"] for r in decode.received]
        assert sorted(legs) == sorted(ids)
        assert not state.load._flights
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_requests_vllm_cannot_hand_over_stay_local() -> None:
    """vLLM 0.34 answers a completion batch's first prompt's ``kv_transfer_params`` only
    (the decode leg would pull one prompt's blocks for all of them), a request asking
    prompt logprobs reads no transferred KV (the decode replica prefills it again), and a
    beam search sends none (its prefill leg would answer no transfer params). All are
    prefilled where they are decoded; a single prompt of token ids is not a batch."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    words = " ".join(f"w{i}" for i in range(3000))
    chat = [{"role": "user", "content": words}]
    cases = [
        ("/v1/completions", {"prompt": [words, words + " x"]}, "batch_prompts"),
        ("/v1/completions", {"prompt": [_prompt(17), _prompt(18)]}, "batch_prompts"),
        ("/v1/completions", {"prompt": _prompt(19), "prompt_logprobs": 0}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": _prompt(20), "echo": True, "logprobs": 1},
         "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": chat, "echo": True}, "prompt_logprobs"),
        # values vLLM reads leniently: "2" is n = 2, "true" is echo
        ("/v1/completions", {"prompt": _prompt(22), "n": "2"}, "parallel_sampling"),
        ("/v1/chat/completions", {"messages": chat, "echo": "true"}, "prompt_logprobs"),
        # beam search runs its own one-token requests, which carry no kv_transfer_params
        # (entrypoints/generate/beam_search/online.py): the prefill leg would answer none
        ("/v1/completions", {"prompt": _prompt(23), "use_beam_search": True}, "beam_search"),
        ("/v1/chat/completions", {"messages": chat, "use_beam_search": "on"}, "beam_search"),
    ]  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            for path, extra, _ in cases:
                body = {"model": MODEL, "max_tokens": 3, **extra}
                async with http.post(url + path, json=body) as r:
                    assert r.status == 200, (extra, await r.read())
                sent = decode.received[-1]["body"]
                assert sent.get("kv_transfer_params") is None, extra
            assert not prefill.seen
            # echo alone on a completion asks no prompt logprobs: disaggregated
            body = {"model": MODEL, "prompt": _prompt(21), "echo": True, "max_tokens": 3}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.read()
            assert len(prefill.seen) == 1
        decisions = router.app[STATE].disagg[MODEL].decisions
        assert decisions == {
            "batch_prompts": 2, "prompt_logprobs": 4, "parallel_sampling": 1, "beam_search": 2,
            "always": 1,
        }  # fmt: skip
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


# vLLM 0.34's NIXL connector's answer to a prefill leg (nixl/pull_scheduler.py
# request_finished) and the scheduler's remote_prefill_cached_tokens
VLLM_PARAMS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "remote_blocks_expiry_time", "remote_registration_generation",
    "transfer_mode", "remote_prefill_cached_tokens",
}  # fmt: skip


async def test_mock_legs_speak_vllm_034s_transfer_params(mocks: Mocks) -> None:
    """The mock's prefill answer carries what vLLM 0.34 answers, and its decode side reads
    it as vLLM does: ``usage`` reports ``remote_prefill_cached_tokens``, the prefill's hit,
    with no mock-only field, so a peer relaying vLLM's fields gets vLLM's accounting."""
    prompt = _prompt(22)
    asks = {"do_remote_decode": True, "do_remote_prefill": False}
    leg = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": asks}
    for _ in range(2):  # the second prefill finds the first one's blocks
        status, raw, _ = await _post(mocks.urls["p0"], leg)
        assert status == 200, raw
    params = json.loads(raw)["kv_transfer_params"]
    assert set(params) >= VLLM_PARAMS, VLLM_PARAMS - set(params)
    assert params["remote_engine_id"] == "p0" and params["remote_num_tokens"] == len(prompt)
    assert all(isinstance(g, list) for g in params["remote_block_ids"])
    hit = params["remote_prefill_cached_tokens"]
    assert hit > 0
    vllm_only = {k: v for k, v in params.items() if k in VLLM_PARAMS}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": vllm_only}
    status, raw, _ = await _post(mocks.urls["d1"], body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert mocks.counters("d1").decode_legs == 1


async def test_a_decode_retry_prefills_locally_instead_of_reusing_the_transfer() -> None:
    """The decode replica that got the prefill's ``kv_transfer_params`` answers 500: vLLM
    has released the prefill replica's blocks by then (pulled, or freed on the rejection:
    ``_with_kv_transfer_rejection_cleanup``), so the retry on the next decode replica goes
    with the original body (a local prefill), never the same params (freed blocks)."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    near = await Backend("d0", [MODEL], fail_next=1).start()
    far = await Backend("d1", [MODEL]).start()
    reps = [
        {"url": prefill.url, "model": MODEL, "name": "p0", "role": "prefill", "rack": "rack0"},
        {"url": near.url, "model": MODEL, "name": "d0", "role": "decode", "rack": "rack0"},
        {"url": far.url, "model": MODEL, "name": "d1", "role": "decode", "rack": "rack1"},
    ]
    for r in reps:
        r["region"] = "reg0"
    router, url = await start_router(_settings(reps))
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(23), "max_tokens": 3})
        assert status == 200, raw
        assert len(prefill.seen) == 1
        # the pick in the prefill replica's rack got the params and failed
        assert near.received[-1]["body"]["kv_transfer_params"] == _Prefill.PARAMS
        assert far.received[-1]["body"].get("kv_transfer_params") is None
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await near.stop()
        await far.stop()


async def test_a_grpc_pick_of_an_id_in_a_prefill_leg_is_refused() -> None:
    """An HTTP request's prefill leg is in flight as ``<id>#p``, and its decode leg will be
    dispatched as ``<id>``: a gRPC Pick of that id meanwhile is refused as an id in flight
    (docs/grpc.md), else the decode leg's dispatch takes over the Pick's load record, and the
    Pick's Report then ends the decode leg's while it still runs (its replica looks idle)."""
    import asyncio

    import grpc

    from router.rpc.gen import router_pb2, router_pb2_grpc
    from router.service.keys import GRPC_PORT
    from tests.backends import Backend

    prefill = await _Prefill().start()
    prefill.gate = asyncio.Event()
    decode = await Backend("d0", [MODEL]).start()
    from dataclasses import replace

    settings = _stub_settings(prefill.url, [(decode.url, "decode")])
    settings = replace(settings, server=replace(settings.server, grpc_port=0))
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        async with (
            aiohttp.ClientSession() as http,
            grpc.aio.insecure_channel(f"127.0.0.1:{router.app[GRPC_PORT]}") as channel,
        ):
            body = {"model": MODEL, "prompt": _prompt(24), "max_tokens": 3}
            post = asyncio.ensure_future(
                http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "r1"})
            )
            await eventually(lambda: len(prefill.seen) == 1)
            stub = router_pb2_grpc.RouterStub(channel)
            pick = router_pb2.PickRequest(
                model=MODEL, token_ids=router_pb2.TokenIds(ids=_prompt(25)), request_id="r1"
            )
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Pick(pick, timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "already in flight" in (exc.value.details() or "")
            prefill.gate.set()
            async with await post as r:
                assert r.status == 200, await r.read()
        assert not state.load._flights
    finally:
        prefill.gate.set()
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_a_prefill_fallback_records_the_decode_replica_as_holding_the_prompt() -> None:
    """A prefill leg that answers no ``kv_transfer_params`` falls back to a local prefill on
    the decode replica: that replica computes and holds the prompt, as after a transfer, so
    the router's speculative entries and the session's hint name it (the next turn finds
    its prefix there), not only the prefill replica the leg was routed to."""
    import asyncio

    from tests.backends import Backend

    prefill = await Backend("p0", [MODEL]).start()  # answers no kv_transfer_params: fallback
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        async with aiohttp.ClientSession() as http:
            for seed, session in ((26, None), (27, "s-fallback")):
                headers = {"X-Session-Id": session} if session else {}
                body = {"model": MODEL, "prompt": _prompt(seed), "max_tokens": 3}
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.read()
        assert len(prefill.received) == 2 and len(decode.received) == 2
        assert state.disagg[MODEL].fallbacks == {"no_transfer_params": 2}
        # without a session: speculative entries
        hashes = hash_prompt(_prompt(26), B, root_hash(MODEL)).hashes
        held = state.index.match(hashes).get(ReplicaKey("d0"))
        assert held is not None and held.kv_blocks == len(hashes), held
        # a session's turn: its hint (which carries the session's next turn instead)
        sessions = state.engines[MODEL].sessions
        assert sessions is not None
        hint = sessions.get("s-fallback", asyncio.get_running_loop().time())
        assert hint is not None and hint.replica == ReplicaKey("d0"), hint
    finally:
        await router.cleanup()
        await prefill.stop()
        await decode.stop()


async def test_a_disaggregated_requests_ttft_counts_its_prefill_leg() -> None:
    """The time to first token of a disaggregated request is its prefill leg's plus its
    decode leg's first token (what its client waits): ``kvrouter_ttft_seconds`` and the SLO
    counts must not time it from the decode leg alone, or a slow prefill replica never
    shows (every request would meet its TTFT target)."""
    import asyncio

    from tests.backends import Backend

    held_s = 0.4
    prefill = await _Prefill().start()
    prefill.gate = asyncio.Event()
    # the prefill replica takes ``held_s`` to answer
    prefill.hook = lambda: asyncio.get_running_loop().call_later(held_s, prefill.gate.set)
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        body = {"model": MODEL, "prompt": _prompt(28), "max_tokens": 3, "stream": True}
        status, raw, _ = await _post(url, body)
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw
        assert len(prefill.seen) == 1 and decode.received[-1]["body"]["kv_transfer_params"]
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 1
        ttft = metric_sample(page, "kvrouter_ttft_seconds_sum", model=MODEL)
        assert ttft is not None and ttft >= held_s, ttft
    finally:
        prefill.gate.set()
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


@pytest.mark.parametrize("status", [400, 503])
async def test_a_prefill_leg_answered_an_error_leaves_no_guess_on_its_replica(
    status: int,
) -> None:
    """The prefill replica refused the leg (an error status): it holds none of the prompt,
    which the decode replica prefilled locally; the index and the session's hint say so
    (before, the prefill replica kept its guessed blocks until their TTL, so the next
    request sharing the prefix was planned to prefill there on a hit it did not have)."""
    import asyncio

    from tests.backends import Backend

    prefill = await _Prefill().start()
    prefill.status = status
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        async with aiohttp.ClientSession() as http:
            for seed, session in ((28, None), (30, "s-refused")):
                headers = {"X-Session-Id": session} if session else {}
                body = {"model": MODEL, "prompt": _prompt(seed), "max_tokens": 3}
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.read()
        assert len(prefill.seen) == 2 and len(decode.received) == 2
        # without a session: speculative entries
        hashes = hash_prompt(_prompt(28), B, root_hash(MODEL)).hashes
        found = state.index.match(hashes)
        assert found.get(ReplicaKey("p0")).kv_blocks == 0
        assert found.get(ReplicaKey("d0")).kv_blocks == len(hashes)
        # a session's turn: its hint
        sessions = state.engines[MODEL].sessions
        assert sessions is not None
        hint = sessions.get("s-refused", asyncio.get_running_loop().time())
        assert hint is not None and hint.replica == ReplicaKey("d0"), hint
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_a_decode_leg_answered_an_error_leaves_no_guess_on_its_replica() -> None:
    """The decode replica refused the decode leg (400, relayed to the client): it holds
    none of the prompt; the prefill replica, which prefilled it, keeps its guess."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL], fail_next=1, fail_status=400).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(29)})
        assert status == 400, raw
        hashes = hash_prompt(_prompt(29), B, root_hash(MODEL)).hashes
        found = state.index.match(hashes)
        assert found.get(ReplicaKey("d0")).kv_blocks == 0
        assert found.get(ReplicaKey("p0")).kv_blocks == len(hashes)
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_a_refused_prefill_leg_is_withdrawn_before_the_decode_pick() -> None:
    """A prefill replica that also decodes (role ``both``) refuses the leg (a 4xx, no
    failure of the replica: it stays a decode candidate): the decode replica is picked on
    an index that no longer credits it with the prompt (the leg's guesses are withdrawn
    first, as the simulator does), so when it is picked to prefill locally its predicted
    hit is what it holds: nothing (before, the refused leg's guess made it a whole-prompt
    hit, in its load and in the prediction error)."""
    from tests.backends import Backend

    both = await Backend("p0", [MODEL], fail_next=1, fail_status=400).start()
    decode = await Backend("d0", [MODEL]).start()
    reps = _both_and_decode(both.url, decode.url)
    router, url = await start_router(_settings(reps))
    state = router.app[STATE]
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(31), "max_tokens": 3})
        assert status == 200, raw
        assert len(both.received) == 2 and not decode.received  # the leg, then the request
        assert state.disagg[MODEL].fallbacks == {"http_4xx": 1}
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_prediction_error_tokens_count", model=MODEL) == 1
        # predicted on p0 minus what its engine reported cached (none): 0, not the prompt
        exact = metric_sample(
            page, "kvrouter_prediction_error_tokens_bucket", model=MODEL, le="0.0"
        )
        assert exact == 1, page
    finally:
        await router.cleanup()
        await both.stop()
        await decode.stop()


async def test_a_hung_prefill_replica_gives_up_at_the_first_byte_deadline() -> None:
    """A prefill replica that takes the leg and never answers: the leg has the first-byte
    deadline every upstream attempt has (``first_byte_min_s`` .. ``first_byte_timeout_s``,
    scaled by the predicted prefill), then the decode replica prefills locally. Before,
    the leg waited out ``first_byte_timeout_s`` (600 s) and the request with it."""
    import asyncio

    from tests.backends import Backend

    prefill = await Backend("p0", [MODEL], hang=True).start()
    decode = await Backend("d0", [MODEL]).start()
    settings = _stub_settings(prefill.url, [(decode.url, "decode")], first_byte_min_s=0.5)
    assert settings.server.first_byte_timeout_s >= 600
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        body = {"model": MODEL, "prompt": _prompt(32), "max_tokens": 3}
        # a bound on a hang, far below the 600 s the leg used to wait
        status, raw, _ = await asyncio.wait_for(_post(url, body), 60)
        assert status == 200, raw
        assert len(prefill.received) == 1 and len(decode.received) == 1
        assert decode.received[0]["body"].get("kv_transfer_params") is None
        assert state.disagg[MODEL].fallbacks == {"timeout": 1}
        await eventually(lambda: prefill.cancelled == 1)  # the leg's connection was closed
        assert not state.load._flights
    finally:
        await router.cleanup()
        await prefill.stop()
        await decode.stop()


def _http_date_in(seconds: float) -> str:
    """An HTTP-date (RFC 9110 5.6.7) ``seconds`` from now: Retry-After's other form."""
    import email.utils
    import time

    return email.utils.formatdate(time.time() + seconds, usegmt=True)


@pytest.mark.parametrize(("status", "form"), [(429, "delay"), (503, "delay"), (503, "date")])
async def test_a_prefill_legs_retry_after_ejects_its_replica_at_once(
    status: int, form: str
) -> None:
    """A prefill replica answering 429 / 503 with ``Retry-After`` is ejected for that long at
    once, as a replica answering a request so is (docs/operations.md): the next request's
    leg does not go there. Before, the header was ignored and the replica got legs until
    ``outlier_consecutive_failures`` of them had failed. The header's HTTP-date form
    (RFC 9110 10.2.3: ``Retry-After = HTTP-date / delay-seconds``) too: before, a date
    was read as no Retry-After at all."""
    from tests.backends import Backend

    prefill = await _Prefill().start()
    prefill.status = status
    prefill.retry_after = "30" if form == "delay" else _http_date_in(30)
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    state.fleet.restore_health = lambda now: None  # no readmission while the test runs
    try:
        for seed in (33, 34):
            status_, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(seed)})
            assert status_ == 200, raw
        assert len(prefill.seen) == 1  # the second request's leg went nowhere
        assert len(decode.received) == 2
        assert ReplicaKey("p0") in state.fleet.unhealthy_until
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_a_decode_legs_first_byte_is_not_predicted_as_a_prefill_of_its_prompt() -> None:
    """The decode replica gets the prompt computed (the prefill replica's KV, pulled): the
    router records it with nothing to prefill there, and its first byte (deadline, latency
    sample) is predicted the same way: the prefill queued there, the transfer, no prefill of
    the prompt. Before, it was predicted as a local prefill of all the prefill replica had
    not cached: a hung decode replica held a long prompt's client 4x that prefill (100 s
    for 500k tokens) before the retry, and a decode replica slow to answer every pulled
    prompt (recomputing it) looked on time to latency ejection."""
    import asyncio

    from router.core.load import CostModel
    from router.service.keys import FORWARDER
    from tests.backends import Backend

    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL], gate=asyncio.Event()).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    detector = router.app[FORWARDER].ejections.detector
    n = 60_000
    try:
        body = {"model": MODEL, "prompt": _prompt(35, n), "max_tokens": 3, "stream": True}
        post = asyncio.ensure_future(_post(url, body))
        await eventually(lambda: len(decode.received) == 1)
        assert decode.received[0]["body"]["kv_transfer_params"] == _Prefill.PARAMS
        ((_, expect),) = detector._replicas[ReplicaKey("d0")].pending.values()
        assert expect < CostModel().prefill_s(n) / 10, expect
        decode.gate.set()
        status, raw, _ = await post
        assert status == 200, raw
    finally:
        decode.gate.set()
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_a_request_whose_id_is_another_ones_prefill_leg_gets_its_own() -> None:
    """The load tracker keys a prefill leg ``<id>#p`` and its decode leg ``<id>``: request
    A (id ``x#p``, its leg ``x#p#p``) and request B (id ``x``, its leg ``x#p``) would share
    ``x#p`` once A's decode leg starts while B's prefill leg runs. B gets an id of its own,
    so each leg keeps its record. Before, A's decode dispatch replaced B's leg's record
    (its prefill replica looked idle) and B's leg, ending, removed A's decode leg's record
    while A decoded (its decode replica looked idle)."""
    import asyncio

    from aiohttp import web

    from tests.backends import Backend

    gates: dict[str, asyncio.Event] = {}
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        rid = request.headers.get("X-Request-Id", "")
        seen.append(rid)
        await gates.setdefault(rid, asyncio.Event()).wait()
        return web.json_response(
            {"object": "text_completion", "choices": [], "kv_transfer_params": _Prefill.PARAMS}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner, prefill_url = await _serve_app(app)
    decode = await Backend("d0", [MODEL], gate=asyncio.Event()).start()
    settings = _stub_settings(prefill_url, [(decode.url, "decode")])
    router, url = await start_router(settings)
    flights = router.app[STATE].load._flights
    try:
        async with aiohttp.ClientSession() as http:

            async def post(rid: str, seed: int) -> int:
                body = {"model": MODEL, "prompt": _prompt(seed), "max_tokens": 3}
                headers = {"X-Request-Id": rid}
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    await r.read()
                    return r.status

            a = asyncio.ensure_future(post("x#p", 36))
            await eventually(lambda: len(seen) == 1)
            b = asyncio.ensure_future(post("x", 37))
            await eventually(lambda: len(seen) == 2)
            gates.setdefault(seen[0], asyncio.Event()).set()  # A's prefill leg answers
            await eventually(lambda: len(decode.received) == 1)
            assert len(flights) == 2, list(flights)  # A's decode leg and B's prefill leg
            gates.setdefault(seen[1], asyncio.Event()).set()  # B's prefill leg answers
            await eventually(lambda: len(decode.received) == 2)
            assert len(flights) == 2, list(flights)  # both decode legs
            assert decode.gate is not None
            decode.gate.set()
            assert await a == 200 and await b == 200
        assert not flights
    finally:
        for g in gates.values():
            g.set()
        if decode.gate is not None:
            decode.gate.set()
        await router.cleanup()
        await runner.cleanup()
        await decode.stop()


@pytest.mark.parametrize("fault", ["hang", "503"])
async def test_a_failed_prefill_legs_fallback_skips_the_replica_that_failed_it(
    fault: str,
) -> None:
    """A prefill replica that also decodes (role ``both``) fails the leg (no answer by its
    deadline, or a 5xx): the local prefill goes to another decode replica, as the
    forwarder's retry of a failed attempt never goes back to the replica that failed it.
    Before, the decode pick chose the failed replica again (no transfer to price), so the
    client waited out a second deadline there, and with ``max_retries`` 0 got a 504 while
    a healthy decode replica was idle."""
    from tests.backends import Backend

    if fault == "hang":
        both = await Backend("p0", [MODEL], hang=True).start()
    else:
        both = await Backend("p0", [MODEL], fail_next=2, fail_status=503).start()
    decode = await Backend("d0", [MODEL]).start()
    reps = _both_and_decode(both.url, decode.url)
    router, url = await start_router(_settings(reps, max_retries=0, first_byte_min_s=0.5))
    state = router.app[STATE]
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(38), "max_tokens": 3})
        assert status == 200, raw
        assert len(both.received) == 1  # the leg only
        assert len(decode.received) == 1
        assert decode.received[0]["body"].get("kv_transfer_params") is None
        cause = "timeout" if fault == "hang" else "http_5xx"
        assert state.disagg[MODEL].fallbacks == {cause: 1}
        assert not state.load._flights
    finally:
        await router.cleanup()
        await both.stop()
        await decode.stop()


async def test_a_decode_leg_retried_after_a_refused_connection_books_no_prefill() -> None:
    """The picked decode replica refuses the connection (it never got the transfer
    params): the next decode replica gets them and pulls the prompt, so the router records
    nothing to prefill there, as for the first pick. Before, the retry was booked as a
    local prefill of the whole prompt: that replica looked busy prefilling (to the policy,
    to the decode pick of other requests, to admission) until its first byte."""
    import asyncio

    from tests.backends import Backend

    prefill = await _Prefill().start()
    far = await Backend("d1", [MODEL], gate=asyncio.Event()).start()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    reps = [
        {"url": prefill.url, "model": MODEL, "name": "p0", "role": "prefill", "rack": "rack0"},
        {"url": dead, "model": MODEL, "name": "d0", "role": "decode", "rack": "rack0"},
        {"url": far.url, "model": MODEL, "name": "d1", "role": "decode", "rack": "rack1"},
    ]
    for r in reps:
        r["region"] = "reg0"
    router, url = await start_router(_settings(reps))
    state = router.app[STATE]
    try:
        body = {"model": MODEL, "prompt": _prompt(40), "max_tokens": 3, "stream": True}
        post = asyncio.ensure_future(_post(url, body))
        await eventually(lambda: len(far.received) == 1)
        assert far.received[0]["body"]["kv_transfer_params"] == _Prefill.PARAMS
        now = asyncio.get_running_loop().time()
        # (at most the one token an engine computes on a whole-prompt hit)
        assert state.load.view(ReplicaKey("d1"), now).queued_prefill_tokens <= 1
        assert far.gate is not None
        far.gate.set()
        status, raw, _ = await post
        assert status == 200, raw
    finally:
        if far.gate is not None:
            far.gate.set()
        await router.cleanup()
        await prefill.runner.cleanup()
        await far.stop()


async def test_a_prefill_replica_answering_garbage_is_ejected() -> None:
    """A prefill replica whose legs answer 200 with a body that is no JSON (a broken
    engine or a proxy in front of it) fails them as a broken answer does: after
    ``outlier_consecutive_failures`` of them it is ejected, so requests stop paying a
    useless leg before their local prefill. Before, such an answer counted as a success
    for outlier ejection: the replica stayed in rotation for ever."""
    from aiohttp import web

    from tests.backends import Backend

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"<html>oops</html>", content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner, prefill_url = await _serve_app(app)
    decode = await Backend("d0", [MODEL]).start()
    settings = _stub_settings(prefill_url, [(decode.url, "decode")])
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        failures = state.settings.server.outlier_consecutive_failures
        for i in range(failures):
            status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(i, 300)})
            assert status == 200, raw
        assert state.disagg[MODEL].fallbacks == {"bad_answer": failures}
        assert ReplicaKey("p0") in state.fleet.unhealthy_until
    finally:
        await router.cleanup()
        await runner.cleanup()
        await decode.stop()
