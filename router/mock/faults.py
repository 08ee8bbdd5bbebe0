"""The mock replica's fault mode: how its completion endpoints misbehave, so the router's
outlier ejection, retries and timeouts are tested against a real process.

A mode is chosen at start (``kvrouter mock-replica --fault MODE``) and changed at run time
(``POST /admin/fault`` with ``{"mode": MODE, "rate": R}``; ``GET /admin/fault`` shows it).
Only ``POST /v1/chat/completions`` and ``/v1/completions`` are affected, and each request
only with probability ``rate`` (1: every one); ``/health``, ``/metrics`` and the rest answer
as usual (a replica whose engine misbehaves while its API server is up). Modes:

* ``none``: normal answers;
* ``CODE`` (an HTTP status, e.g. ``429``, ``500``, ``503``): an OpenAI-style error with that
  status at once; a 429 or 503 carries ``Retry-After`` (``--fault-retry-after`` seconds);
* ``hang``: accept the request and never answer;
* ``head-only``: send a 200 head (``Content-Length`` of a body that never comes), then
  silence;
* ``short-body``: send a 200 head and part of the promised body, then close the connection;
* ``break-stream``: a streamed request gets a 200 event stream with its first token's event,
  then the connection closes (no ``[DONE]``); a non-streamed one is answered as by
  ``short-body``;
* ``error-event``: a streamed request gets its first token's event, then the error event
  vLLM ends a stream with when generation fails (``data: {"error": {...}}``) and
  ``data: [DONE]``; a non-streamed one a 500 with vLLM's error body;
* ``slow:S``: wait ``S`` seconds (wall clock, whatever ``--time-scale``), then answer
  normally (a first-byte latency outlier).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_FOREVER = 1e9


@dataclass(slots=True, frozen=True)
class FaultMode:
    """One parsed mode (see the module docstring): ``kind`` is ``none``, ``status``,
    ``hang``, ``head-only``, ``short-body``, ``break-stream``, ``error-event`` or ``slow``."""

    kind: str = "none"
    status: int = 0
    delay_s: float = 0.0
    rate: float = 1.0
    retry_after_s: int = 1

    @classmethod
    def parse(cls, spec: str, rate: float = 1.0, retry_after_s: int = 1) -> FaultMode:
        """``spec`` as written (ValueError for anything else)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        text = spec.strip().lower()
        if text in ("", "none", "off"):
            return cls(rate=rate, retry_after_s=retry_after_s)
        if text in ("hang", "head-only", "short-body", "break-stream", "error-event"):
            return cls(text, rate=rate, retry_after_s=retry_after_s)
        if text.startswith("slow:"):
            delay = float(text[5:])
            if not delay >= 0:
                raise ValueError(f"slow:S needs S >= 0, got {text[5:]!r}")
            return cls("slow", delay_s=delay, rate=rate, retry_after_s=retry_after_s)
        if text.isdigit() and 400 <= int(text) <= 599:
            return cls("status", status=int(text), rate=rate, retry_after_s=retry_after_s)
        raise ValueError(
            f"unknown fault mode {spec!r}: none, a status 400-599, hang, head-only, "
            "short-body, break-stream, error-event or slow:SECONDS"
        )

    def describe(self) -> dict[str, object]:
        mode = {"status": str(self.status), "slow": f"slow:{self.delay_s:g}"}.get(
            self.kind, self.kind
        )
        return {"mode": mode, "rate": self.rate, "retry_after_s": self.retry_after_s}


@dataclass(slots=True)
class FaultBox:
    """The current mode (replaced by ``POST /admin/fault``) and how many requests it hit."""

    mode: FaultMode
    injected: int = 0


FAULTS = web.AppKey("mock_faults", FaultBox)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def inject(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Apply the current mode to a completion request (see the module docstring)."""
    box = request.app[FAULTS]
    mode = box.mode
    if (
        mode.kind == "none"
        or request.path not in COMPLETION_PATHS
        or (mode.rate < 1.0 and random.random() >= mode.rate)
    ):
        return await handler(request)
    box.injected += 1
    if mode.kind == "slow":
        await asyncio.sleep(mode.delay_s)
        return await handler(request)
    if mode.kind == "status":
        headers = {}
        if mode.status in (429, 503):
            headers["Retry-After"] = str(mode.retry_after_s)
        return web.json_response(_error(mode.status), status=mode.status, headers=headers)
    raw = await request.read()  # the whole request, as an engine would take it
    if mode.kind in ("break-stream", "error-event"):
        if _streamed(raw):
            return await _broken_stream(request, mode.kind == "error-event")
        if mode.kind == "error-event":
            return web.json_response(_error(500), status=500)
    if mode.kind == "hang":
        await asyncio.sleep(_FOREVER)  # until the client leaves (handler cancellation)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = 4096
    await response.prepare(request)
    if mode.kind == "head-only":
        await asyncio.sleep(_FOREVER)
    await response.write(b'{"id": "cmpl-broken", "object": "text_completion", "choi')
    transport = request.transport
    if transport is not None:
        transport.close()  # mid-body: the client sees the connection lost
    await asyncio.sleep(_FOREVER)
    return response  # never reached: the close cancels the handler


def _error(status: int) -> dict[str, object]:
    """vLLM's error body (``ErrorResponse``) for an injected fault."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    message = f"injected fault: status {status}"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _streamed(raw: bytes) -> bool:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("stream") is True


async def _broken_stream(request: web.Request, error_event: bool) -> web.StreamResponse:
    """A stream that fails after its first token: the connection closes, or (``error_event``)
    vLLM's error event and ``[DONE]`` end it."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if request.path == "/v1/chat/completions":
        choice: dict[str, object] = {"index": 0, "delta": {"content": "a"}, "finish_reason": None}
        first = {"id": "chatcmpl-fault", "object": "chat.completion.chunk", "choices": [choice]}
    else:
        choice = {"index": 0, "text": "a", "finish_reason": None}
        first = {"id": "cmpl-fault", "object": "text_completion", "choices": [choice]}
    await response.write(b"data: " + json.dumps(first).encode() + b"\n\n")
    if error_event:
        await response.write(b"data: " + json.dumps(_error(500)).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    transport = request.transport
    if transport is not None:
        transport.close()  # mid-stream: the client sees the connection lost
    return response  # (whatever aiohttp still writes goes nowhere)


async def get_fault(request: web.Request) -> web.Response:
    box = request.app[FAULTS]
    return web.json_response({**box.mode.describe(), "injected": box.injected})


async def set_fault(request: web.Request) -> web.Response:
    """``{"mode": MODE, "rate": R, "retry_after_s": N}`` (rate and retry_after_s optional)."""
    box = request.app[FAULTS]
    try:
        body = json.loads(await request.read() or b"{}")
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        box.mode = FaultMode.parse(
            str(body.get("mode", "none")),
            float(body.get("rate", 1.0)),
            int(body.get("retry_after_s", box.mode.retry_after_s)),
        )
    except (ValueError, TypeError) as exc:
        err = {"message": str(exc), "type": "invalid_request_error", "param": None, "code": 400}
        return web.json_response({"error": err}, status=400)
    return web.json_response({**box.mode.describe(), "injected": box.injected})


def install(app: web.Application, mode: FaultMode) -> None:
    """Add the fault middleware and ``/admin/fault`` to the mock's application."""
    app[FAULTS] = FaultBox(mode)
    app.middlewares.append(inject)
    app.router.add_get("/admin/fault", get_fault)
    app.router.add_post("/admin/fault", set_fault)
