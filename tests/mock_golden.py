"""The bytes the mock replica sends, captured for every shape of request it answers, so a
change to how it builds its answers shows byte for byte (tests/test_mock_golden.py against
tests/fixtures/mock_golden.json).

What makes the bytes repeatable: the engine model runs on :class:`SteppedDriver`, whose model
time moves in fixed steps and never with the wall clock, so the outputs (how many tokens each
``TokensEmitted`` carries, in which order the sequences' outputs come) are the same on every
run; each request is sent once the model is idle; ``X-Request-Id`` names the answer's id. What
still varies is normalised: ``created`` / ``created_at`` (the wall clock), the random ids of
the Responses API's message items and a prefill leg's engine request id and port.

Regenerate the fixture (only when the answer is meant to change):
``PYTHONPATH=$PWD python -m tests.mock_golden > tests/fixtures/mock_golden.json``
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
from typing import Any

import aiohttp
from aiohttp import web

from router.mock.driver import EngineDriver
from router.mock.server import MockSettings, create_app
from router.mock.state import STATE
from tests.ports import free_port
from tests.waiting import eventually

MODEL = "m"
# model seconds of the driver's clock's steps, in turn: mostly shorter than a decode step (a
# chunk of one token), at times longer (a reader behind: a chunk of several)
STEPS_S = (0.004, 0.004, 0.004, 0.004, 0.004, 0.06)
SETTINGS = MockSettings(model=MODEL, block_size=16, kv_blocks=64, default_max_tokens=3)

PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks, hit on a repeat
CHAT = [{"role": "user", "content": "hello there"}]
ECHO_CHAT = [*CHAT, {"role": "assistant", "content": "well"}]
USAGE = {"include_usage": True}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
TOO_LONG = 64 * 16  # output tokens no engine of SETTINGS' size holds


def _variants() -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of every request, sent in this order to one fresh mock."""
    out: list[tuple[str, dict[str, Any]]] = []
    completion_shapes: list[dict[str, Any]] = [
        {"prompt": PROMPT, "max_tokens": 5},
        {"prompt": PROMPT, "max_tokens": 4},  # a repeat: cached
        {"prompt": "hello world", "max_tokens": 3, "logprobs": 1},
        {"prompt": "hello world", "max_tokens": 3, "logprobs": 2, "echo": True},
        {"prompt": ["ab cd"], "max_tokens": 2, "echo": True},
        {"prompt": [[1, 2, 3, 4]], "max_tokens": 2, "echo": True, "return_token_ids": True},
        {"prompt": "xyz", "max_tokens": 4, "n": 3},
        {"prompt": "xyz", "max_tokens": 3, "n": 2, "logprobs": 1, "echo": True},
        {"prompt": ["ab", "cde fg"], "max_tokens": 3},
        {"prompt": [[5, 6, 7], [8, 9, 10, 11]], "max_tokens": 2, "n": 2, "logprobs": 0},
        {"prompt": ["ab", "cd"], "max_tokens": 3, "echo": True, "logprobs": 1},
    ]
    for body in completion_shapes:
        out.append(("/v1/completions", body))
        for opts in (None, USAGE, CONTINUOUS):
            streamed = {**body, "stream": True}
            out.append(("/v1/completions", streamed | ({"stream_options": opts} if opts else {})))
    out += [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2, "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2, "logprobs": 1, "echo": True}),
        ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 2, "prompt_logprobs": 0}),
        ("/v1/completions", {"prompt": "pd", "max_tokens": 1, "kv_transfer_params": {}}),
        ("/v1/completions", {"prompt": "x" * 20, "max_tokens": 40, "stream": True}),
    ]
    chat_shapes: list[dict[str, Any]] = [
        {"messages": CHAT, "max_tokens": 5},
        {"messages": CHAT, "max_completion_tokens": 4, "max_tokens": 9},
        {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 1},
        {"messages": ECHO_CHAT, "max_tokens": 3, "echo": True},
        {"messages": ECHO_CHAT, "max_tokens": 3, "echo": True, "logprobs": True},
        {"messages": CHAT, "max_tokens": 3, "n": 3},
        {"messages": ECHO_CHAT, "max_tokens": 2, "n": 2, "echo": True, "logprobs": True},
    ]
    for body in chat_shapes:
        out.append(("/v1/chat/completions", body))
        for opts in (None, USAGE, CONTINUOUS):
            streamed = {**body, "stream": True}
            path = "/v1/chat/completions"
            out.append((path, streamed | ({"stream_options": opts} if opts else {})))
    out += [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "kv_transfer_params": {}}),
        ("/v1/messages", {"messages": CHAT, "max_tokens": 3}),
        ("/v1/messages", {"messages": CHAT, "max_tokens": 3, "stream": True}),
        ("/v1/responses", {"input": "hi there", "max_output_tokens": 3, "request_id": "resp_g"}),
        (
            "/v1/responses",
            {"input": "hi", "max_output_tokens": 3, "stream": True, "request_id": "resp_h"},
        ),
    ]
    # errors: refused requests (before and after a stream would open) and the engine's
    for path, body in [
        ("/v1/completions", {"prompt": "ab", "max_tokens": TOO_LONG}),
        ("/v1/completions", {"prompt": "ab", "n": 2, "max_tokens": TOO_LONG}),
        ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": TOO_LONG}),
        ("/v1/completions", {"prompt": ["ab", [1, 2]], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "ab", "n": 2, "kv_transfer_params": {}}),
        ("/v1/completions", {"prompt": "ab", "n": 5000}),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}),
        ("/v1/completions", {"prompt": "ab", "max_tokens": 0}),
        ("/v1/completions", {"prompt": "ab", "stream_options": USAGE}),
        ("/v1/completions", {"prompt": "ab", "prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": TOO_LONG}),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": TOO_LONG}),
        ("/v1/chat/completions", {"messages": CHAT, "model": "other"}),
        ("/v1/messages", {"messages": CHAT, "max_tokens": TOO_LONG}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": TOO_LONG, "request_id": "r"}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": TOO_LONG, "stream": True}),
    ]:
        out.append((path, body))
        if not body.get("stream"):
            out.append((path, {**body, "stream": True}))
    return out


REQUESTS = _variants()


class SteppedDriver(EngineDriver):
    """The engine model with its clock moved by :data:`STEPS_S` in turn (up to the model's
    next event), never by the wall clock: the same requests give the same outputs on every
    run. Built from the app's driver, stopped."""

    def __init__(self, old: EngineDriver) -> None:
        super().__init__(old.model, None, time_scale=1.0)
        self.t = old.now()
        self.steps = itertools.cycle(STEPS_S)

    def now(self) -> float:
        return self.t

    async def _loop(self) -> None:
        while True:
            self._pump()
            nxt = self.model.next_time()
            self._wake.clear()
            if nxt is None:
                await self._wake.wait()
            else:
                self.t = min(nxt, self.t + next(self.steps))
                await asyncio.sleep(0)


async def start(
    settings: MockSettings = SETTINGS, stepped: bool = True
) -> tuple[web.AppRunner, str]:
    """A mock replica on loopback, as ``kvrouter mock-replica`` serves it (a client gone
    cancels its handler); its engine on a :class:`SteppedDriver` if ``stepped``."""
    app = create_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    state = app[STATE]
    if not stepped:
        return runner, f"http://127.0.0.1:{port}"
    await state.driver.stop()
    state.driver = SteppedDriver(state.driver)
    await state.driver.start()
    return runner, f"http://127.0.0.1:{port}"


_VARYING = [
    (re.compile(rb'"created": \d+'), b'"created": 0'),
    (re.compile(rb'"created_at": ?\d+'), b'"created_at": 0'),
    (re.compile(rb"msg_[0-9a-f]{32}"), b"msg_X"),
    (re.compile(rb"resp_[0-9a-f]{32}"), b"resp_X"),
    (re.compile(rb'"remote_request_id": "[^"]*"'), b'"remote_request_id": "X"'),
    (re.compile(rb'"remote_port": \d+'), b'"remote_port": 0'),
    (re.compile(rb'"remote_host": "[^"]*"'), b'"remote_host": "X"'),
]


def normalised(raw: bytes) -> str:
    for pattern, fixed in _VARYING:
        raw = pattern.sub(fixed, raw)
    return raw.decode()


async def capture(url: str, app: web.Application) -> list[Any]:
    """Each request's status, content type and body (normalised), then the engine's
    counters."""
    model = app[STATE].driver.model
    out: list[Any] = []
    headers = {"X-Request-Id": "golden"}
    async with aiohttp.ClientSession() as http:
        for path, body in REQUESTS:
            await eventually(lambda: model.next_time() is None and model.pending() == 0)
            async with http.post(url + path, json={"model": MODEL, **body}, headers=headers) as r:
                raw = await r.read()
                out.append([path, body, r.status, r.content_type, normalised(raw)])
        async with http.get(url + "/metrics") as r:
            page = await r.text()
    counted = {}
    for line in page.splitlines():
        name = line.split("{")[0]
        if name.startswith("vllm:") and name.endswith("_total"):
            counted[name] = float(line.rsplit(" ", 1)[1])
    out.append(counted)
    return out


async def _main() -> None:
    runner, url = await start()
    try:
        captured = await capture(url, runner.app)
    finally:
        await runner.cleanup()
    json.dump(captured, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    asyncio.run(_main())
