"""Releasing a prefill replica's blocks that no decode replica will pull (docs/pd.md).

vLLM 0.34's NIXL connector keeps a finished prefill's blocks for the decode replica to read
until one tells it it is done, or until the lease of ``kv_lease_duration`` seconds (30 by
default; decode replicas' heartbeats renew it) runs out (``nixl/pull_scheduler.py``
``request_finished``, ``nixl/base_worker.py`` ``_reap_expired_send_leases``). When the
decode pick fails after the prefill answered, or the decode leg reaches no decode replica
(its client left first, every one refused the connection), none will read them: the router
hands the prefill answer's ``kv_transfer_params`` to a decode-capable replica in a request
its serving layer refuses before its engine runs anything, a streamed beam-search
completion (``completion/serving.py`` ``_create_completion``, its first check). vLLM wraps
that refusal in ``_with_kv_transfer_rejection_cleanup`` (``generate/base/serving.py``): it
submits an ``abort_immediately`` request carrying the params, whose connector
``request_finished`` (``do_remote_prefill`` still set) sends the prefill replica the
notification that frees the blocks, with no transfer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from typing import Any

from router.core.types import ReplicaKey
from router.service.proxy import Forwarder
from router.service.replica_url import ReplicaUrl
from router.service.state import RouterState
from router.service.upstream import Exchange
from router.service.upstream_errors import UpstreamError
from router.service.wire import request_head

PATH = b"/v1/completions"
MAX_TARGETS = 3  # distinct replica URLs tried, in order, until one refuses the request
REFUSED = 400  # vLLM's status for the refusal (create_error_response's default)
_BODY_HEADERS = frozenset({b"content-type", b"content-encoding"})


def body(model: str, params: Mapping[str, Any]) -> bytes:
    """The request a vLLM 0.34 serving layer refuses before its engine, carrying
    ``params`` (the prefill answer's ``kv_transfer_params``, as answered)."""
    doc = {"model": model, "prompt": "release", "max_tokens": 1, "stream": True,
           "use_beam_search": True, "kv_transfer_params": params}  # fmt: skip
    return json.dumps(doc, separators=(",", ":")).encode()


def targets(
    state: RouterState, keys: Iterable[ReplicaKey], prefill: ReplicaKey
) -> list[ReplicaKey]:
    """The decode-capable ``keys`` to try, one per URL (DP ranks share an engine's
    connector side): those in rotation (busy or draining ones answer) before those out of
    it; never the prefill replica itself (its connector would notify its own engine)."""
    out: list[ReplicaKey] = []
    urls: set[str] = set()
    out_of_rotation = state.fleet.unhealthy_until
    for key in sorted(keys, key=lambda k: k in out_of_rotation):
        ep = state.registry.endpoint(key)
        if key == prefill or ep is None or ep.base_url in urls:
            continue
        urls.add(ep.base_url)
        out.append(key)
    return out[:MAX_TARGETS]


async def release(
    state: RouterState,
    forwarder: Forwarder,
    model: str,
    keys: list[ReplicaKey],
    headers: list[tuple[bytes, bytes]],
    request_id: str,
    params: Mapping[str, Any],
) -> bool:
    """Hand ``params`` to the first of ``keys`` (:func:`targets`) that refuses them as vLLM
    does (400); each attempt bounded by ``connect_timeout_s``. True once one did."""
    data = body(model, params)
    # the client's headers (a replica's API key) but for the body's own type and coding
    sent = [(k, v) for k, v in headers if k.lower() not in _BODY_HEADERS]
    sent.append((b"Content-Type", b"application/json"))
    wait = state.settings.server.connect_timeout_s
    for key in keys:
        ep = state.registry.endpoint(key)
        if ep is None:
            continue
        netloc = ReplicaUrl.parse(ep.base_url).netloc.encode()
        head = request_head(PATH, netloc, sent, request_id.encode("latin-1"), ep.dp_rank, len(data))
        upstream: Exchange | None = None
        try:
            async with asyncio.timeout(wait):
                upstream = await forwarder.client.pool(ep.base_url).send(head, data, wait)
                if upstream.body() is None:
                    await upstream.read_all()
        except (UpstreamError, TimeoutError):
            if upstream is not None:
                upstream.abort()
            continue
        upstream.release()
        if upstream.status == REFUSED:
            return True
    return False
