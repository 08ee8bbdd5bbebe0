"""Goodput in the service: the model's SLO from the config, SLO attainment of answers on
/metrics (non-streamed ones: tests/test_slo_unstreamed.py), the session id read from
``X-Session-Id`` / ``metadata`` / ``user``, and the TPOT target handed to ``ours``. Real HTTP
on loopback, both HTTP engines, the official openai client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from router.core.errors import ConfigError
from router.core.policies import Ours
from router.core.slo import SloTargets, SloTier
from router.service.app import STATE
from router.service.config import build_settings, load_settings
from router.service.request_identity import body_session, session_key, session_of
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.test_audit_metrics import series
from tests.waiting import eventually

MODEL = "kimi-test"
ENGINES = ["fast"]
CHAT = [{"role": "user", "content": "Why is the sky blue? " * 30}]


@dataclass
class Fleet:
    url: str
    state: RouterState
    client: openai.AsyncOpenAI

    async def slo_counts(self) -> dict[str, float]:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as r:
            return series(await r.text(), "kvrouter_slo_requests_total")


async def _fleet(engine: str, slo: dict[str, Any]) -> AsyncIterator[Fleet]:
    backend = await Backend("b0", [MODEL]).start()
    backend.chunk_delay_s = 0.02  # 4 chunks ~20 ms apart
    settings = build_settings(
        {
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table(context_length=100_000, slo=slo)},
        }
    )
    runner, url = await start_router(settings, engine)
    app = runner.app
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        yield Fleet(url, app[STATE], client)
    finally:
        await client.close()
        await runner.cleanup()
        await backend.stop()


@pytest.fixture(params=ENGINES)
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    async for f in _fleet(str(request.param), {}):
        yield f


@pytest.fixture(params=ENGINES)
async def strict_fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """TTFT target 10 s, TPOT target 1 ms: the backend's ~20 ms chunks miss it."""
    async for f in _fleet(str(request.param), {"ttft_s": 10.0, "tpot_s": 0.001}):
        yield f


async def _stream(client: openai.AsyncOpenAI, **extra: Any) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, stream=True, **extra
    )
    async for _ in stream:
        pass


async def test_streamed_answers_count_by_slo_tier_and_result(fleet: Fleet) -> None:
    await _stream(fleet.client)
    await _stream(fleet.client)
    await fleet.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)

    async def judged() -> bool:  # the two streams and the non-streamed answer (its E2E)
        counts = await fleet.slo_counts()
        return sum(v for k, v in counts.items() if 'tier="le8k"' in k) == 3.0

    # met or missed is the machine's timing (20 ms chunks against the default targets): the
    # results themselves are test_a_missed_tpot_target_is_counted_as_such's subject
    await eventually(judged, 5.0)
    assert fleet.state.slos[MODEL] == SloTargets()


async def test_a_missed_tpot_target_is_counted_as_such(strict_fleet: Fleet) -> None:
    await _stream(strict_fleet.client)
    await eventually_counts(
        strict_fleet, f'{{class="default",model="{MODEL}",result="tpot_missed",tier="any"}}', 1.0
    )
    engine = strict_fleet.state.engines[MODEL]
    assert isinstance(engine.policy, Ours) and engine.policy.tpot_target_s == 0.001


@pytest.fixture(params=ENGINES)
async def tpot_fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """TTFT target 10 s, TPOT target 10 ms: each sequence's ~20 ms chunks miss it."""
    async for f in _fleet(str(request.param), {"ttft_s": 10.0, "tpot_s": 0.01}):
        yield f


async def test_tpot_is_judged_per_sequence_of_a_sampled_or_batched_stream(
    tpot_fleet: Fleet,
) -> None:
    """vLLM decodes a request's ``n`` sequences of each of its prompts side by side and its
    usage sums their tokens: 8 sequences of 4 tokens, ~20 ms apart, report 32. The router
    took the TPOT as the time after the first token over 31 tokens (~2 ms: met); each
    sequence took ~20 ms a token, which misses the 10 ms target."""
    await _stream(tpot_fleet.client, n=8)
    key = f'{{class="default",model="{MODEL}",result="tpot_missed",tier="any"}}'
    await eventually_counts(tpot_fleet, key, 1.0)
    stream = await tpot_fleet.client.completions.create(
        model=MODEL, prompt=["Once upon a time"] * 4, n=2, max_tokens=4, stream=True
    )
    async for _ in stream:
        pass
    await eventually_counts(tpot_fleet, key, 2.0)


async def eventually_counts(fleet: Fleet, key: str, expected: float) -> None:
    """The stream's books close right after its last byte went out: poll the page until
    they do (at most 5 s)."""

    async def counted() -> bool:
        return (await fleet.slo_counts()).get(key) == expected

    await eventually(counted, 5.0, message=key)


async def test_the_session_id_reaches_the_routing_engine(fleet: Fleet) -> None:
    sessions = fleet.state.engines[MODEL].sessions
    assert sessions is not None
    await _stream(fleet.client, extra_headers={"X-Session-Id": "conv-7"}, user="someone")
    await fleet.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, metadata={"session_id": "conv-8"}
    )
    await fleet.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, user="user-9"
    )
    await eventually(lambda: len(sessions) == 3)
    key = [(b"Authorization", b"Bearer " + fleet.client.api_key.encode())]
    for sid in ("conv-7", "conv-8", "user-9"):
        scoped = session_of(key, sid)  # the client's API key scopes its sessions
        assert scoped is not None and scoped != sid
        assert sessions.get(scoped, asyncio.get_running_loop().time()) is not None, sid


def test_session_ids_come_from_the_header_then_metadata_then_user() -> None:
    body = {"metadata": {"session_id": "m"}, "user": "u"}
    assert body_session(body) == "m"
    assert body_session({**body, "session_id": "v"}) == "v"  # vLLM's own field first
    assert body_session({**body, "session_id": ""}) == "m"
    assert body_session({"user": "u"}) == "u"
    assert body_session({"metadata": {"session_id": 7}, "user": "u"}) == "u"
    assert body_session({"metadata": "odd"}) is None
    # OpenAI's prompt_cache_key (a conversation's cache key, which replaces ``user`` there)
    # before the end user
    assert body_session({"prompt_cache_key": "k", "user": "u"}) == "k"
    assert body_session({**body, "prompt_cache_key": "k"}) == "m"
    assert body_session({"prompt_cache_key": "", "user": "u"}) == "u"
    assert session_of([(b"X-Session-Id", b"h")], "m") == "h"
    assert session_of([(b"x-session-id", b"")], "m") == "m"
    assert session_of([], None) is None
    long = "x" * 500
    key = session_key(long)
    assert key is not None and key.startswith("xxh3:") and len(key) < 40
    assert session_key(long) == key and session_key(long + "y") != key


def test_a_non_ascii_session_header_is_keyed_as_the_body_and_grpc_key_it() -> None:
    """``X-Session-Id`` bytes are the id's UTF-8 (as a gateway putting the header in gRPC
    Pick's ``session_id``, a proto string, and a JSON body's ``session_id`` have it): one
    session's turns meet whichever carries the id, a long one's digest too."""
    for sid in ("sesión-1", "会话-" + "x" * 200):
        header = [(b"X-Session-Id", sid.encode())]
        assert session_of(header, None) == session_key(sid) == body_session({"session_id": sid})
    # bytes that are no UTF-8, and a JSON body's lone surrogate escape: keyed by a digest
    # every part of the router can encode (pod digests, recorded trace labels)
    for got in (session_of([(b"X-Session-Id", b"a\xff")], None), session_key("a\ud800")):
        assert got is not None and got.startswith("xxh3:")
        got.encode()
    assert session_of([(b"X-Session-Id", b"a\xff")], None) != session_key("a\ud800")


def test_sessions_are_scoped_by_the_api_key_presented() -> None:
    """Two clients whose session ids collide ("default", a user number) keep apart: the id
    is scoped by the key presented, whichever header or body member carries either."""
    alice = [(b"Authorization", b"Bearer alice"), (b"X-Session-Id", b"default")]
    bob = [(b"x-api-key", b"bob"), (b"X-Session-Id", b"default")]
    a, b = session_of(alice, None), session_of(bob, None)
    assert a is not None and b is not None and a != b
    assert a.endswith("/default") and b.endswith("/default")
    # the same key, by another header, and the id from the body: the same session
    assert session_of([(b"api-key", b"alice")], "default") == a
    assert session_of([(b"Authorization", b"Bearer  alice ")], "default") == a
    # a key that is no UTF-8 is a key like any other
    odd = session_of([(b"x-api-key", b"k\xff")], "default")
    assert odd is not None and odd not in (a, b) and odd.encode()
    # no key: the id as it came; no id: no session, key or not
    assert session_of([], "default") == "default"
    assert session_of([(b"Authorization", b"Bearer alice")], None) is None


def test_slo_settings_from_the_file_and_the_environment(tmp_path: Any) -> None:
    table = {"replicas": [{"url": "http://h:1", "model": "m"}]}
    tiers = build_settings(
        {**table, "models": {"m": {"slo": {"ttft_tiers": "1000:0.5,*:4", "tpot_s": 0.05}}}}
    )
    assert tiers.model("m").slo == SloTargets((SloTier(1000, 0.5), SloTier(None, 4.0)), 0.05)
    env = load_settings(
        environ={
            "KVROUTER_REPLICAS": "m=http://h:1",
            "KVROUTER_MODELS__M__SLO__TTFT_S": "3",
            "KVROUTER_MODELS__M__SESSION_TTL_S": "30",
        }
    )
    assert env.model("m").slo == SloTargets((SloTier(None, 3.0),))
    assert env.model("m").routing.session_ttl_s == 30.0
    for bad in ({"ttft_tiers": "fast"}, {"tpot_s": 0}, {"tpot": 1}, "x"):
        with pytest.raises(ConfigError, match=r"models\.m\.slo"):
            build_settings({**table, "models": {"m": {"slo": bad}}})
    with pytest.raises(ConfigError, match="SLO__"):
        load_settings(environ={"KVROUTER_MODELS__M__SLO": "1"})


async def test_a_flex_request_is_judged_as_flex_with_admission_off(
    strict_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class's SLO does not depend on whether admission is on: with it off (this model has
    no admission table) a flex request is still counted in its class, against its class's
    TTFT factor (4x by default), as the simulator judges it (sim/metrics.py)."""
    import router.service.answer_relay as answer_relay

    factors: list[tuple[str, float]] = []
    count = answer_relay.count_slo

    def spy(state: Any, model: str, prompt: int, factor: float, klass: str, *rest: Any) -> None:
        factors.append((klass, factor))
        count(state, model, prompt, factor, klass, *rest)

    monkeypatch.setattr(answer_relay, "count_slo", spy)
    assert strict_fleet.state.settings.model(MODEL).admission is None
    await _stream(strict_fleet.client, service_tier="flex")
    await eventually_counts(
        strict_fleet, f'{{class="flex",model="{MODEL}",result="tpot_missed",tier="any"}}', 1.0
    )
    assert factors == [("flex", 4.0)]


async def test_tpot_is_timed_to_the_last_token_not_the_streams_end() -> None:
    """vLLM times a request's TPOT from its first token to its last
    (vllm/v1/metrics/stats.py ``IterationStats.update_from_finished_request``:
    ``(last_token_ts - first_token_ts) / (num_generation_tokens - 1)``), and so does the
    simulator, whose finish is its last token. The router timed it to the stream's end:
    a stream whose two tokens came in one read, and whose usage chunk and ``[DONE]`` came
    later, missed a 1 us TPOT target by that wait, though its tokens came 0 s apart."""
    from tests.test_upstream_wire import SSE_HEAD, Scripted, _chat, _chunk, _token

    usage = (
        b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":'
        b'{"prompt_tokens":40,"completion_tokens":2,"total_tokens":42}}\n\n'
    )
    replica = await Scripted(
        [
            SSE_HEAD + _chunk(_token(0) + _token(1)),
            _chunk(usage + b"data: [DONE]\n\n") + b"0\r\n\r\n",
        ]
    ).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0, "outlier_detection": False},
            "replicas": [{"url": replica.url, "model": MODEL, "name": "r0"}],
            "models": {MODEL: kimi_model_table(slo={"ttft_s": 100.0, "tpot_s": 1e-6})},
        }
    )
    runner, url = await start_router(settings)
    fleet = Fleet(url, runner.app[STATE], openai.AsyncOpenAI(api_key="unused"))
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.post(url + "/v1/chat/completions", json=_chat(True)) as resp,
        ):
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the tokens
            replica.step()  # then the usage and the stream's end
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        key = f'{{class="default",model="{MODEL}",result="met",tier="any"}}'
        await eventually_counts(fleet, key, 1.0)
    finally:
        await fleet.client.close()
        await runner.cleanup()
        await replica.stop()
