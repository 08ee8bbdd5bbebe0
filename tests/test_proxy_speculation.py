"""What a failed dispatch leaves in the index: a replica that did not take the prompt (it
refused or dropped the connection, answered an error) loses the guesses the router made of
it at once, so the next request sharing the prefix is not sent there for a hit it does not
hold; one that may be prefilling it (no first byte in time) keeps them.

Real mock replicas (tests/backends.py) on loopback, the router in process (its state read
directly: the prefix index and the session table)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import aiohttp
import pytest

from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.ports import RefusedPort
from tests.waiting import eventually

MODEL = "kimi-test"
TOKEN = "admin-secret"


@asynccontextmanager
async def _router(
    backends: Sequence[Backend | tuple[str, str]], **server: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, RouterState]]:
    """The router in front of ``backends`` (a Backend, or (name, url) of something else)."""
    replicas = [
        {"url": b.url, "model": MODEL, "name": b.name}
        if isinstance(b, Backend)
        else {"url": b[1], "model": MODEL, "name": b[0]}
        for b in backends
    ]
    settings = build_settings(
        {
            "server": {"admin_token": TOKEN, "health_interval_s": 0, **server},
            "replicas": replicas,
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    http = aiohttp.ClientSession()
    try:
        yield url, http, running.app[STATE]
    finally:
        await http.close()
        await running.cleanup()


def _body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": f"a long question about {text} " * 30}],
        **extra,
    }


def _guessed(state: RouterState, body: dict[str, Any]) -> dict[str, int]:
    """Blocks of ``body``'s prompt the index holds per replica name (guessed or reported)."""
    hashes = state.processors[MODEL].chat(body).block_hashes
    assert len(hashes) > 4
    found = state.index.match(hashes)
    return {ep.key.replica: found.get(ep.key).kv_blocks for ep in state.registry.endpoints()}


async def _post(url: str, http: aiohttp.ClientSession, body: dict[str, Any], **headers: str) -> int:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def _settled(state: RouterState) -> bool:
    now = asyncio.get_running_loop().time()
    return all(state.load.view(k, now).in_flight == 0 for k in state.registry.keys_for(MODEL))


@pytest.mark.parametrize("status", [400, 429, 500, 503])
async def test_an_error_answer_withdraws_the_replicas_guess(status: int) -> None:
    """The replica's only attempt answered an error (context too long, overloaded, ...):
    it holds nothing of the prompt, and the index must not say it does."""
    b0 = await Backend("b0", [MODEL], fail_next=1, fail_status=status).start()
    try:
        async with _router([b0], max_retries=0) as (url, http, state):
            body = _body("the sea")
            assert await _post(url, http, body) == status
            assert _guessed(state, body) == {"b0": 0}
            assert state.index.stats().speculative_entries == 0
            # a success is guessed as before
            assert await _post(url, http, body) == 200
            assert _guessed(state, body)["b0"] > 0
    finally:
        await b0.stop()


async def test_a_retry_withdraws_the_guess_of_the_replica_that_answered_an_error() -> None:
    """The first replica answered 500, the retry's replica served it: only the latter is
    guessed to hold the prompt."""
    failing = await Backend("failing", [MODEL], fail_next=1000).start()
    serving = await Backend("serving", [MODEL]).start()
    try:
        async with _router([failing, serving], max_retries=1) as (url, http, state):
            for i in range(40):  # until one went to the failing replica first
                body = _body("the hills")
                body["messages"][0]["content"] = f"{i}: " + body["messages"][0]["content"]
                assert await _post(url, http, body) == 200
                guessed = _guessed(state, body)
                assert guessed == {"failing": 0, "serving": guessed["serving"]}, guessed
                assert guessed["serving"] > 0, guessed
                if failing.received:
                    break
            assert failing.received
            await eventually(partial(_settled, state))
    finally:
        await failing.stop()
        await serving.stop()


async def test_a_refused_or_dropped_connection_withdraws_the_guess() -> None:
    """Nothing listens at one replica's URL, another takes the connection and closes it
    unanswered: neither holds the prompt; the replica that served the retry does."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    dropping = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    dead = RefusedPort()
    live = await Backend("live", [MODEL]).start()
    replicas = [("dead", dead.url), ("drop", dropping), live]
    try:
        async with _router(replicas, max_retries=2) as (url, http, state):
            for text in ("the moon", "the stars", "the clouds"):
                body = _body(text)
                assert await _post(url, http, body) == 200
                guessed = _guessed(state, body)
                assert guessed["dead"] == guessed["drop"] == 0, guessed
                assert guessed["live"] > 0, guessed
    finally:
        server.close()
        dead.close()
        await live.stop()


async def test_no_first_byte_in_time_keeps_the_guess() -> None:
    """A replica that does not answer by the first-byte deadline may be prefilling the
    prompt (its queue was longer than predicted): its guess stays until the engine's events
    or the TTL settle it."""
    b0 = await Backend("b0", [MODEL], hang=True).start()
    try:
        deadline = {"first_byte_min_s": 0.2, "first_byte_timeout_s": 0.2}
        async with _router([b0], max_retries=0, **deadline) as (url, http, state):
            body = _body("the wind")
            assert await _post(url, http, body) == 504
            assert _guessed(state, body)["b0"] > 0
    finally:
        await b0.stop()


async def test_a_failed_turn_leaves_the_sessions_hint_on_its_last_served_turn() -> None:
    """A session's turn that its replica refused (here: 400) is not held there: the
    session's hint goes back to the turn before, which the replica did serve, rather than
    credit the replica with the refused turn's whole prompt."""
    b0 = await Backend("b0", [MODEL]).start()
    try:
        async with _router([b0], max_retries=0) as (url, http, state):
            sessions = state.engines[MODEL].sessions
            assert sessions is not None
            session = {"X-Session-Id": "s1"}
            first = _body("the river")
            assert await _post(url, http, first, **session) == 200
            now = asyncio.get_running_loop().time()
            served = sessions.get("s1", now)
            assert served is not None and served.blocks > 0
            second = _body("the river")
            second["messages"] += [
                {"role": "assistant", "content": "it flows"},
                {"role": "user", "content": "where to? " * 40},
            ]
            b0.fail_next, b0.fail_status = 1, 400
            assert await _post(url, http, second, **session) == 400
            hint = sessions.get("s1", asyncio.get_running_loop().time())
            assert hint == served
            # a session whose only turn was refused has no hint at all
            b0.fail_next = 1
            assert await _post(url, http, _body("the lake"), **{"X-Session-Id": "s2"}) == 400
            assert sessions.get("s2", asyncio.get_running_loop().time()) is None
    finally:
        await b0.stop()
