"""Stored-response ids across router processes (router/service/response_share.py): a
follow-up naming ``previous_response_id`` and ``GET /v1/responses/{id}`` reach the replica
holding the response whichever worker process (``kvrouter serve --workers 2``) or router pod
(two routers sharing a real Redis) the client reaches, and not only the one that relayed it.
Real mock replicas keeping a store (elsewhere they answer 404, as vLLM), real HTTP, a real
redis-server; the key schema and codec of the Redis side on their own."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import openai
import pytest
from aiohttp import web

from router.bench.redis_server import LocalRedis
from router.mock.server import MockSettings
from router.service.app import STATE
from router.service.config import build_settings
from router.service.response_ids import MAX_ID_CHARS, Holder, ResponseIds, shareable
from router.service.response_share import ResponseShare, holder_json, parse_holder
from router.store.redis_store import connect
from router.store.response_ids import ResponseIdStore, decode_holder, encode_holder
from router.store.schema import KeySchema
from tests.backends import metric_sample, start_mock, start_router
from tests.procs import Fleet
from tests.test_workers_admin import call
from tests.test_workers_admin import start_router as start_workers
from tests.waiting import eventually

MODEL = "m"


class Replica(NamedTuple):
    name: str
    url: str


@pytest.fixture
async def replicas() -> Any:
    """Two mock replicas of model ``m`` (no KV events), each keeping its responses."""
    runners: list[web.AppRunner] = []
    out = []
    try:
        for name in ("r0", "r1"):
            runner, url = await start_mock(
                MockSettings(model=MODEL, replica=name, block_size=16, engine_block_size=16)
            )
            runners.append(runner)
            out.append(Replica(name, url))
        yield out
    finally:
        for runner in runners:
            await runner.cleanup()


async def holder_of(replicas: list[Replica], response_id: str) -> str:
    """The replica whose store holds ``response_id`` (asked directly: the others 404)."""
    held = []
    async with aiohttp.ClientSession() as http:
        for r in replicas:
            async with http.get(f"{r.url}/v1/responses/{response_id}") as got:
                if got.status == 200:
                    held.append(r.name)
    assert len(held) == 1, held
    return held[0]


def _body(text: str, previous: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 3}
    if previous is not None:
        body["previous_response_id"] = previous
    return body


# ---------------------------------------------------------------------- the Redis side


def test_the_key_schema_and_the_holder_codec() -> None:
    assert KeySchema("kvr").response("resp_1") == "kvr:resp:resp_1"
    assert KeySchema("t1", stream_shards=2).response("a:b{c}") == "t1:resp:a:b{c}"
    raw = encode_holder("Qwen/Qwen3-8B é", "r0")
    assert raw == '["Qwen/Qwen3-8B é","r0"]'.encode()
    assert decode_holder(raw) == ("Qwen/Qwen3-8B é", "r0", "")
    # a response made with a client key carries the key's digest
    raw = encode_holder("m", "r0", "8fe1f57124a9932b")
    assert raw == b'["m","r0","8fe1f57124a9932b"]'
    assert decode_holder(raw) == ("m", "r0", "8fe1f57124a9932b")
    assert parse_holder(json.dumps(holder_json(Holder("m", "r0", "o"))).encode()) == (
        Holder("m", "r0", "o")
    )
    assert parse_holder(b'{"model":"m","replica":"r0"}') == Holder("m", "r0", "")
    for not_holder in (b'{"model":"m","replica":"r0","owner":3}', b'{"model":"m"}', b"[]"):
        with pytest.raises(ValueError):
            parse_holder(not_holder)
    for bad in (
        b"",
        b"{",
        b'{"model":"m","replica":"r"}',
        b'["m"]',
        b'["m","r",""]',
        b'["m","r",3]',
        b'["m","r","o","x"]',
        b'["m",""]',
        b'["m",3]',
        b"\xff\xfe",
        b'["' + b"m" * 5000 + b'","r"]',
        b"[" * 100_000,
    ):
        with pytest.raises(ValueError):
            decode_holder(bad)
    # what may travel to other processes: bounded, encodable
    assert shareable("resp_" + "a" * (MAX_ID_CHARS - 5))
    assert not shareable("resp_" + "a" * MAX_ID_CHARS)
    assert not shareable("")
    assert not shareable("resp_\ud800")


async def test_the_store_writes_with_an_expiry_and_reads_back(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    client = connect(redis_server.url)
    try:
        store = ResponseIdStore(client, KeySchema(key_prefix), ttl_s=60)
        await store.put([("resp_a", "m", "r0", ""), ("resp_b", "other", "r1", "k")])
        assert await store.get("resp_a") == ("m", "r0", "")
        assert await store.get("resp_b") == ("other", "r1", "k")
        assert await store.get("resp_none") is None
        ttl = await client.pttl(f"{key_prefix}:resp:resp_a")
        assert 0 < ttl <= 60_000
        await client.set(f"{key_prefix}:resp:resp_bad", b"not json")
        with pytest.raises(ValueError):
            await store.get("resp_bad")
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- worker processes


async def _lookups(proc: Any, source: str, result: str) -> float:
    """``kvrouter_response_id_lookups_total`` summed over every worker (the all-worker
    ``/metrics`` page)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(proc.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r,
    ):
        page = await r.text()
    total = 0.0
    for worker in ("0", "1"):
        total += (
            metric_sample(
                page,
                "kvrouter_response_id_lookups_total",
                worker=worker,
                source=source,
                result=result,
            )
            or 0.0
        )
    return total


async def test_every_worker_finds_the_replica_holding_a_response(
    tmp_path: Path, replicas: list[Replica]
) -> None:
    """Each request goes over a fresh connection, so SO_REUSEPORT spreads them over both
    workers; a worker that did not relay the response asks the other over its control
    socket. Every follow-up must reach the holder (elsewhere the mock answers 404), every
    ``GET`` too; the loop runs until workers found each other's ids, so both served."""
    with Fleet(tmp_path) as fleet:
        proc = await start_workers(fleet, replicas, workers=2, engine="fast")
        status, first = await call(proc, "POST", "/v1/responses", _body("hello"))
        assert status == 200, first
        holder = await holder_of(replicas, first["id"])
        previous = first["id"]
        for i in range(200):
            # chained: each turn is recorded by the worker that relayed it, and the next one
            # lands on either
            status, turn = await call(proc, "POST", "/v1/responses", _body(f"{i}", previous))
            assert status == 200, turn  # the holder's store had the previous response
            status, got = await call(proc, "GET", f"/v1/responses/{turn['id']}")
            assert status == 200 and got["id"] == turn["id"], got
            assert await holder_of(replicas, turn["id"]) == holder
            previous = turn["id"]
            if i >= 3 and await _lookups(proc, "workers", "found") >= 2:
                break
        else:
            raise AssertionError("the workers never asked each other")
        status, got = await call(proc, "GET", "/v1/responses/resp_nobody")
        assert status == 404, got
        assert got["error"]["message"] == "Response with id 'resp_nobody' not found."
        assert await _lookups(proc, "workers", "missed") >= 1
        assert await _lookups(proc, "workers", "failed") == 0


# ---------------------------------------------------------------------- router pods


def _pod(replicas: list[Replica], url: str, prefix: str, **server: Any) -> Any:
    return build_settings(
        {
            "server": {"redis_url": url, "redis_key_prefix": prefix, **server},
            "replicas": [{"url": r.url, "model": MODEL, "name": r.name} for r in replicas],
            "models": {MODEL: {"block_size": 16, "policy": "round_robin"}},
        }
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_pods_find_the_replica_holding_a_response_through_redis(
    stream: bool, replicas: list[Replica], redis_server: LocalRedis, key_prefix: str
) -> None:
    """A response made through pod A is continued and retrieved through pod B, whose own
    round robin would send every other request elsewhere; the conversation then goes on
    alternating pods, each finding the ids the other recorded."""
    pods = []
    clients = []
    redis = connect(redis_server.url)
    try:
        for _ in range(2):
            running, url = await start_router(
                _pod(replicas, redis_server.url, key_prefix, response_ids_ttl_s=600)
            )
            pods.append(running)
            clients.append(openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0))

        async def ask(pod: int, text: str, previous: str | None = None) -> Any:
            args = _body(text, previous)
            if not stream:
                return await clients[pod].responses.create(**args)
            final = None
            async for event in await clients[pod].responses.create(stream=True, **args):
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response
            assert final is not None
            return final

        first = await ask(0, "hello")
        holder = await holder_of(replicas, first.id)
        assert pods[0].app[STATE].response_ids.get(first.id) == (MODEL, holder, "")
        made = [first.id]
        for i in range(4):
            pod = (i + 1) % 2  # B, A, B, A: each continues what the other pod relayed
            turn = await ask(pod, f"and then {i}", made[-1])
            assert pods[pod].app[STATE].recent_decisions(1)[0]["replica"] == holder
            made.append(turn.id)
        # the last one through the pod that did not relay it (unknown there until now),
        # then every one through both
        got = await clients[1].responses.retrieve(made[-1])
        assert got.id == made[-1] and got.output
        for response_id in made:
            for client in clients:
                assert (await client.responses.retrieve(response_id)).id == response_id
        # what Redis holds: model and replica, with the configured expiry
        raw = await redis.get(f"{key_prefix}:resp:{first.id}")
        assert json.loads(raw) == [MODEL, holder]
        assert 0 < await redis.pttl(f"{key_prefix}:resp:{first.id}") <= 600_000
        page = pods[1].app[STATE].metrics.render().decode()
        found = metric_sample(
            page, "kvrouter_response_id_lookups_total", source="redis", result="found"
        )
        assert found and found >= 3
        written = metric_sample(page, "kvrouter_response_id_writes_total", result="written")
        assert written and written >= 2
        # an id nobody knows: a 404 in OpenAI's shape; a follow-up of it is routed as usual
        with pytest.raises(openai.NotFoundError):
            await clients[1].responses.retrieve("resp_nobody")
        with pytest.raises(openai.NotFoundError):  # the engine's 404
            await ask(1, "x", "resp_nobody")
        page = pods[1].app[STATE].metrics.render().decode()
        missed = metric_sample(
            page, "kvrouter_response_id_lookups_total", source="redis", result="missed"
        )
        assert missed and missed >= 2
    finally:
        for client in clients:
            await client.close()
        for pod in pods:
            await pod.cleanup()
        await redis.aclose()


async def test_without_redis_sharing_a_pod_does_not_find_the_others_ids(
    replicas: list[Replica], redis_server: LocalRedis, key_prefix: str
) -> None:
    """``response_ids_ttl_s = 0``: nothing is written to Redis nor looked up there."""
    pods = []
    try:
        for _ in range(2):
            running, url = await start_router(
                _pod(replicas, redis_server.url, key_prefix, response_ids_ttl_s=0)
            )
            pods.append((running, url))
        async with aiohttp.ClientSession() as http:
            async with http.post(pods[0][1] + "/v1/responses", json=_body("hi")) as r:
                assert r.status == 200
                made = (await r.json())["id"]
            async with http.get(f"{pods[1][1]}/v1/responses/{made}") as r:
                assert r.status == 404
        redis = connect(redis_server.url)
        try:
            assert await redis.keys(f"{key_prefix}:resp:*") == []
        finally:
            await redis.aclose()
    finally:
        for running, _ in pods:
            await running.cleanup()


async def test_a_hung_redis_fails_lookups_and_holds_up_no_answer(
    replicas: list[Replica], private_redis: LocalRedis
) -> None:
    """Redis stops answering (SIGSTOP): a response is still made and relayed (its write
    waits in the background), a lookup of an id this pod does not know gives up within
    its bound (counted as failed) and the id is unknown: 404."""
    running, url = await start_router(_pod(replicas, private_redis.url, "kvr"))
    state = running.app[STATE]
    assert private_redis.process is not None
    pid = private_redis.process.pid
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            async with http.post(url + "/v1/responses", json=_body("hi")) as r:
                assert r.status == 200
                made = (await r.json())["id"]
            await eventually(lambda: state.response_share.counters.written >= 1)
            os.kill(pid, signal.SIGSTOP)
            try:
                async with http.post(url + "/v1/responses", json=_body("more", made)) as r:
                    assert r.status == 200  # known here: Redis is not asked
                    later = (await r.json())["id"]
                async with http.get(f"{url}/v1/responses/{later}") as r:
                    assert r.status == 200
                async with http.get(url + "/v1/responses/resp_elsewhere") as r:
                    assert r.status == 404
                failed = state.response_share.counters.lookups["redis", "failed"]
                assert failed == 1
            finally:
                os.kill(pid, signal.SIGCONT)
            # the write queued while Redis hung went out, or was counted as failed
            await eventually(
                lambda: (
                    state.response_share.counters.written
                    + state.response_share.counters.write_failed
                    >= 2
                ),
                timeout=20,
            )
    finally:
        await running.cleanup()


async def test_a_write_refused_by_redis_is_written_when_it_accepts_again(
    replicas: list[Replica], private_redis: LocalRedis
) -> None:
    """Redis refuses writes (``min-replicas-to-write``: a real error at once): the id stays
    queued and is retried, not dropped; once Redis accepts writes the other pod finds it."""
    redis = connect(private_redis.url)
    pods = []
    try:
        for _ in range(2):
            pods.append(await start_router(_pod(replicas, private_redis.url, "kvr")))
        share = pods[0][0].app[STATE].response_share
        await redis.config_set("min-replicas-to-write", 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(pods[0][1] + "/v1/responses", json=_body("hi")) as r:
                assert r.status == 200
                made = (await r.json())["id"]
            await eventually(lambda: share.counters.write_failed >= 2)  # tried again
            assert await redis.get(f"kvr:resp:{made}") is None
            assert share.counters.dropped == 0 and share.counters.written == 0
            await redis.config_set("min-replicas-to-write", 0)
            await eventually(lambda: share.counters.written == 1, timeout=20)
            async with http.get(f"{pods[1][1]}/v1/responses/{made}") as r:
                assert r.status == 200
                assert (await r.json())["id"] == made
    finally:
        for running, _ in pods:
            await running.cleanup()
        await redis.aclose()


async def test_an_id_written_just_after_a_miss_is_found_on_the_recheck(
    redis_server: LocalRedis, key_prefix: str
) -> None:
    """The holder pod's write lands between this pod's first ``GET`` and its recheck (made
    deterministic: the store writes it right after answering the first one): found."""
    client = connect(redis_server.url)

    class WrittenAfterTheFirstGet(ResponseIdStore):
        gets = 0

        async def get(self, response_id: str) -> tuple[str, str, str] | None:
            got = await super().get(response_id)
            self.gets += 1
            if self.gets == 1:
                await self.put([(response_id, MODEL, "r1", "")])
            return got

    try:
        share = ResponseShare(ResponseIds())
        store = WrittenAfterTheFirstGet(client, KeySchema(key_prefix), ttl_s=60)
        share.use_store(store)
        assert await share.find("resp_late") == Holder(MODEL, "r1")
        assert store.gets == 2
        assert share.counters.lookups["redis", "found"] == 1
        assert share.counters.lookups["redis", "missed"] == 0
        assert share.ids.get("resp_late") == Holder(MODEL, "r1")  # kept here
        assert await share.find("resp_never") is None  # asked twice, counted once
        assert store.gets == 4 and share.counters.lookups["redis", "missed"] == 1
    finally:
        await client.aclose()
