"""Forwarding a routed request to its replica and the response back, byte for byte.

* One ``aiohttp.ClientSession`` with keep-alive pools per replica host (``limit_per_host``),
  ``auto_decompress=False`` so bodies pass through exactly as the replica sent them.
* The request body is forwarded as received (unknown fields and vendor extensions included);
  hop-by-hop headers are dropped, ``X-Request-Id`` is set, and ``X-data-parallel-rank`` when
  the replica has several DP ranks.
* Connect errors and 5xx answers (both before any body byte reached the client) are retried
  on the next-best replica of the decision's ranking, at most ``max_retries`` times.
* Streams are relayed chunk by chunk as they arrive. A client that disconnects cancels the
  handler (``handler_cancellation``) or fails a write; either way the upstream response is
  closed, which aborts the request on the replica.
* Feedback: first body chunk -> ``LoadTracker.first_token``; end -> ``complete``; the
  replica's ``usage.prompt_tokens_details.cached_tokens`` (non-streaming body, or the usage
  chunk of a stream) is compared with the predicted usable hit.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.core.types import ReplicaKey
from router.service.errors import error_response
from router.service.state import Routed, RouterState

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def forward_headers(request: web.Request, request_id: str, dp_rank: int | None) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP
    )
    out["X-Request-Id"] = request_id
    if dp_rank is not None:
        out["X-data-parallel-rank"] = str(dp_rank)
    return out


def response_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP)


def cached_tokens_of(payload: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a JSON body or SSE lines, if any."""
    if b"cached_tokens" not in payload:
        return None
    candidates = [payload]
    if b"data:" in payload:
        candidates = [
            line[5:].strip()
            for line in payload.splitlines()
            if line.startswith(b"data:") and b"cached_tokens" in line
        ]
    for raw in reversed(candidates):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        usage = obj.get("usage") if isinstance(obj, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(value, int):
            return value
    return None


class Forwarder:
    """Sends routed requests upstream; one per app."""

    def __init__(self, state: RouterState, session: aiohttp.ClientSession) -> None:
        self.state = state
        self.session = session
        s = state.settings.server
        self.timeout = aiohttp.ClientTimeout(
            total=s.request_timeout_s,
            sock_connect=s.connect_timeout_s,
            sock_read=s.first_byte_timeout_s,
        )
        self.max_retries = s.max_retries
        self.debug_header = s.debug_header

    def _debug(self, routed: Routed, key: ReplicaKey, attempt: int) -> str:
        d = routed.decision
        first = attempt == 0  # retries go to replicas whose hit was not predicted
        return (
            f"replica={key}; policy={d.policy}; "
            f"usable_tokens={d.usable_tokens if first else 0}; "
            f"kv_tokens={d.kv_tokens if first else 0}; "
            f"prompt_tokens={routed.request.prompt_tokens}; "
            f"exact={str(routed.prompt.exact).lower()}; attempt={attempt}"
        )

    async def forward(
        self, request: web.Request, path: str, body: bytes, routed: Routed
    ) -> web.StreamResponse:
        state = self.state
        metrics = state.metrics
        model = routed.request.model
        rid = routed.request.request_id
        loop = asyncio.get_running_loop()
        keys = [routed.decision.replica, *routed.decision.ranking][: self.max_retries + 1]
        started = loop.time()
        last_error = "no replica answered"
        for attempt, key in enumerate(keys):
            ep = state.registry.endpoint(key)
            if ep is None:
                continue
            if attempt > 0:
                state.load.complete(rid)
                state.load.dispatch(rid, key, routed.request.prompt_tokens, 0)
            final = attempt == len(keys) - 1
            try:
                upstream = await self.session.post(
                    ep.base_url + path,
                    data=body,
                    headers=forward_headers(request, rid, ep.dp_rank),
                    timeout=self.timeout,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                state.mark_unhealthy(key, loop.time())
                metrics.requests.labels(model, str(key), "connect_error").inc()
                last_error = f"replica {key} unreachable: {exc.__class__.__name__}"
                if not final:
                    metrics.retries.labels(model, "connect_error").inc()
                continue
            except TimeoutError:
                state.load.complete(rid)
                metrics.requests.labels(model, str(key), "timeout").inc()
                return error_response(504, f"replica {key} did not answer in time", code="timeout")
            except aiohttp.ClientError as exc:
                metrics.requests.labels(model, str(key), "connect_error").inc()
                last_error = f"replica {key} failed: {exc}"
                if not final:
                    metrics.retries.labels(model, "client_error").inc()
                continue
            if upstream.status >= 500 and not final:
                upstream.release()
                metrics.requests.labels(model, str(key), "upstream_5xx").inc()
                metrics.retries.labels(model, f"http_{upstream.status}").inc()
                last_error = f"replica {key} answered {upstream.status}"
                continue
            try:
                return await self._relay(request, upstream, routed, key, attempt, started)
            finally:
                upstream.release()
        state.load.complete(rid)
        return error_response(
            502 if keys else 503,
            f"{last_error}; gave up after {len(keys)} attempt(s)",
            code="upstream_unavailable",
            headers={"Retry-After": str(state.settings.server.retry_after_s)},
        )

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        routed: Routed,
        key: ReplicaKey,
        attempt: int,
        started: float,
    ) -> web.StreamResponse:
        state = self.state
        metrics = state.metrics
        model = routed.request.model
        rid = routed.request.request_id
        headers = response_headers(upstream)
        headers.setdefault("X-Request-Id", rid)
        if self.debug_header:
            headers["X-KVRouter-Decision"] = self._debug(routed, key, attempt)
        outcome = (
            "ok"
            if upstream.status < 400
            else ("upstream_5xx" if upstream.status >= 500 else "upstream_4xx")
        )
        streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        loop = asyncio.get_running_loop()
        resp: web.StreamResponse | None = None
        try:
            if not streaming:
                try:
                    payload = await upstream.read()
                except (TimeoutError, aiohttp.ClientPayloadError) as exc:
                    timeout = isinstance(exc, asyncio.TimeoutError)
                    metrics.requests.labels(
                        model, str(key), "timeout" if timeout else "upstream_broken"
                    ).inc()
                    upstream.close()
                    return error_response(
                        504 if timeout else 502,
                        f"replica {key} {'timed out' if timeout else 'broke off its answer'}",
                        code="upstream_timeout" if timeout else "upstream_error",
                    )
                state.load.first_token(rid)
                self._feedback(routed, attempt, payload)
                metrics.requests.labels(model, str(key), outcome).inc()
                return web.Response(status=upstream.status, body=payload, headers=headers)
            resp = web.StreamResponse(status=upstream.status, headers=headers)
            await resp.prepare(request)
            tail: deque[bytes] = deque()
            tail_bytes = 0
            last = 0.0
            first = True
            async for chunk in upstream.content.iter_any():
                now = loop.time()
                if first:
                    state.load.first_token(rid)
                    metrics.ttft.labels(model).observe(now - started)
                    first = False
                else:
                    metrics.itl.labels(model).observe(now - last)
                last = now
                await resp.write(chunk)
                tail.append(chunk)
                tail_bytes += len(chunk)
                while tail_bytes > 8192 and len(tail) > 1:
                    tail_bytes -= len(tail.popleft())
            await resp.write_eof()
            self._feedback(routed, attempt, b"".join(tail))
            metrics.requests.labels(model, str(key), outcome).inc()
            return resp
        except asyncio.CancelledError:
            metrics.requests.labels(model, str(key), "cancelled").inc()
            upstream.close()  # abort the request on the replica
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            # the client went away mid-stream: abort upstream, nothing left to answer
            metrics.requests.labels(model, str(key), "cancelled").inc()
            upstream.close()
            return resp if resp is not None else web.Response(status=499)
        except (TimeoutError, aiohttp.ClientPayloadError):
            # the replica stalled or broke mid-response: abort the client connection too, so a
            # truncated stream is never mistaken for a complete one
            metrics.requests.labels(model, str(key), "upstream_broken").inc()
            upstream.close()
            raise
        finally:
            state.load.complete(rid)

    def _feedback(self, routed: Routed, attempt: int, payload: bytes) -> None:
        cached = cached_tokens_of(payload)
        if cached is None:
            return
        model = routed.request.model
        metrics = self.state.metrics
        metrics.engine_cached_tokens.labels(model).inc(cached)
        if attempt == 0 and routed.prompt.exact:
            metrics.prediction_error.labels(model).observe(routed.decision.usable_tokens - cached)
