"""A client that leaves before its first token took the prompt's prefill away with it: the
engine aborts the request and reports stored only the blocks it finished, never the
prompt's last. The session's hint (and the speculative entries) made at dispatch would
otherwise credit the replica with the whole prompt until the hint expires; they are taken
back, so the index alone tells what the engine kept. Real HTTP on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from router.core.session import SessionHint
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

MODEL = "kimi-test"
SESSION = "conv-1"


@dataclass
class Door:
    url: str
    state: RouterState
    backend: Backend
    http: aiohttp.ClientSession

    def hint(self) -> SessionHint | None:
        sessions = self.state.engines[MODEL].sessions
        assert sessions is not None
        return sessions.get(SESSION, asyncio.get_running_loop().time())

    def held(self, prompt: str) -> int:
        """Blocks of ``prompt`` the index holds on the replica (speculated included)."""
        hashes = self.state.processor(MODEL).completion({"prompt": prompt}).block_hashes
        got = self.state.index.match(list(hashes)).get(ReplicaKey("b0"))
        return 0 if got is None else got.kv_blocks

    async def turn(self, prompt: str, stream: bool) -> aiohttp.ClientResponse:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
        headers = {"X-Session-Id": SESSION}
        return await self.http.post(self.url + "/v1/completions", json=body, headers=headers)


@pytest.fixture
async def door() -> AsyncIterator[Door]:
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table(context_length=100_000)},
        }
    )
    runner, url = await start_router(settings)
    http = aiohttp.ClientSession()
    try:
        yield Door(url, runner.app[STATE], backend, http)
    finally:
        for gate in (backend.gate, backend.prefill_gate):
            if gate is not None:
                gate.set()
        await http.close()
        await runner.cleanup()
        await backend.stop()


FIRST = "The tides rise and fall with the moon, day after day. " * 20
SECOND = FIRST + "And the sailors learned to read them, one season after another. " * 20


async def _leave(door: Door, stream: bool) -> None:
    """Send the second turn and leave before its first token: a stream once its head came
    (the engine's prefill under way), else while the replica has not answered."""
    if stream:
        door.backend.prefill_gate = asyncio.Event()
        async with await door.turn(SECOND, stream=True) as r:
            assert r.status == 200
    else:
        door.backend.gate = asyncio.Event()
        task: asyncio.Task[Any] = asyncio.ensure_future(door.turn(SECOND, stream=False))
        await eventually(lambda: len(door.backend.received) == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await eventually(lambda: not door.state.load.in_flight(), message="never completed")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_turn_left_before_its_first_token_credits_nothing_of_its_prompt(
    door: Door, stream: bool
) -> None:
    async with await door.turn(FIRST, stream=False) as r:
        assert r.status == 200
    first = door.hint()
    assert first is not None and first.replica == ReplicaKey("b0")
    await _leave(door, stream)
    # the session's hint is the first turn's again, which the engine did finish
    assert door.hint() == first
    assert door.held(SECOND) <= first.blocks  # nothing past the first turn speculated
