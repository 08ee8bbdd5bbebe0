"""The gate of the public port: the checks every request passes before it is answered,
whatever its route (router.service.handling.handle calls it). Compiled with the hot path
(``make compile``); configured from :class:`router.service.security.Limits`.

Client API keys are compared in constant time: the presented key is hashed (SHA-256) and
compared with ``hmac.compare_digest`` against *every* configured digest, so neither the
position of a match nor a common prefix shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import TYPE_CHECKING

import xxhash

from router.service.errors import ErrorReply

if TYPE_CHECKING:
    from router.service.security import Limits

_PASS: tuple[None, None] = (None, None)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def tenant_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """Who presented the request's API key (:func:`presented_key`), as admission's fairness
    and the session table scope by it: the key's 64-bit digest in hex, "" for no key. The
    key's own bytes are digested (as :func:`_digest` does), whatever they are."""
    key = presented_key(headers)
    return xxhash.xxh3_64_hexdigest(key.encode("utf-8", "surrogateescape")) if key else ""


class ApiKeys:
    """A set of client keys checked in constant time. Empty: no key required."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def check(self, given: str) -> int | None:
        """The index of the matching key (its identity for limits), None when no key matches.
        Every configured digest is compared, whatever the outcome."""
        probe = _digest(given)
        found = -1
        for i, d in enumerate(self._digests):
            if hmac.compare_digest(probe, d):
                found = i
        return found if found >= 0 else None


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The API key a client presented: ``Authorization: Bearer KEY``, ``api-key: KEY`` or
    ``x-api-key: KEY`` (the Anthropic SDKs' header, Claude Code's with an API key). The
    header's bytes are read as UTF-8, as clients send a key and as :func:`_digest` encodes a
    configured one (bytes that are not UTF-8 kept, as surrogates), so a key with non-ASCII
    characters matches."""
    auth = api_key = ""
    for k, v in headers:
        name = k.lower()
        if name == b"authorization" and not auth:
            auth = v.decode("utf-8", "surrogateescape")
        elif (name == b"api-key" or name == b"x-api-key") and not api_key:
            api_key = v.decode("utf-8", "surrogateescape")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return api_key.strip()


def header_refusal(header_bytes: int, limit: int) -> ErrorReply | None:
    """The 431 refusal of a request whose header block (an HTTP request's, a gRPC call's
    metadata: router/rpc/calls.py ``metadata_bytes``) is ``header_bytes`` long, over
    ``limit`` bytes (``server.max_header_kb``; 0: unlimited); None within it."""
    if not limit or header_bytes <= limit:
        return None
    return ErrorReply(
        431,
        f"request headers are {header_bytes} bytes; the limit is {limit} (server.max_header_kb)",
        "request_header_fields_too_large",
    )


# the paths answered without a client key: the probes and the scraper's page (they carry
# none); the admin routes (``/admin/...``) have a token of their own
OPEN_PATHS = frozenset({b"/health", b"/ping", b"/ready", b"/metrics"})


def protected(path: bytes) -> bool:
    """Whether a path needs the client's API key (and counts against its concurrency
    limit): every path but :data:`OPEN_PATHS` and the admin routes, so whatever reaches a
    replica (the OpenAI API's ``/v1/...``, vLLM's ``/tokenize``, ``/pooling``,
    ``/v2/...``) and any route added later is keyed, and an unknown path is a 401 before it
    is a 404."""
    return path not in OPEN_PATHS and not path.startswith(b"/admin/")


class Gate:
    """The checks every request of the public port passes before it is answered, whatever
    the route: the header block's size, then for every :func:`protected` path (all but the
    probes, ``/metrics`` and the admin routes) the API key and the per-key (per-address
    without keys) concurrency. :meth:`admit` and :meth:`release` are called by
    the front door (router.service.handling.handle) around the request's whole answer.

    The gRPC Router service holds its callers to the same keys and limits with the same
    object (one per process, ``app[GATE]``): its calls are identified by :meth:`caller` and
    a Pick holds a slot (:meth:`hold`) until its decision ends (router/rpc/router_service.py),
    so a key's HTTP requests and gRPC decisions share one limit."""

    __slots__ = ("_counted", "_in_flight", "_keys", "_max_header", "_per_key", "_retry_after")

    def __init__(self, limits: Limits) -> None:
        self._keys = ApiKeys(limits.api_keys)
        self._per_key = limits.max_concurrent_per_key
        self._max_header = limits.max_header_bytes
        self._retry_after = (("Retry-After", str(limits.retry_after_s)),)
        self._in_flight: dict[object, int] = {}
        self._counted = bool(self._keys) or self._per_key > 0

    def admit(
        self, path: bytes, headers: list[tuple[bytes, bytes]], header_bytes: int, peer: str
    ) -> tuple[ErrorReply | None, object]:
        """(the refusal, None to go on; the identity to :meth:`release` after the answer,
        None when nothing is counted)."""
        too_large = header_refusal(header_bytes, self._max_header)
        if too_large is not None:
            return too_large, None
        if not self._counted or not protected(path):
            return _PASS
        refused, ident = self.caller(presented_key(headers), peer)
        if refused is not None:
            return refused, None
        return self.hold(ident)

    def refuses_key(self, path: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether :meth:`admit` will refuse this request for its key (keys configured, a
        :func:`protected` path, no key that matches), known from its head alone: the server
        then keeps none of its body (router/service/http_connection.py), which an
        unauthenticated client could otherwise make it buffer up to ``max_body_mb``."""
        return (
            bool(self._keys)
            and protected(path)
            and (self._keys.check(presented_key(headers)) is None)
        )

    def keyed(self) -> bool:
        """Whether client keys are configured (a caller must present one)."""
        return bool(self._keys)

    def caller(self, given: str, peer: str) -> tuple[ErrorReply | None, object]:
        """Who a client is, for its limits, whatever carries its request (:meth:`admit` for
        the public port, the gRPC Router service for its calls, router/rpc/server.py):
        (the 401 refusal of a missing or wrong key ``given``, None to go on; the index of the
        matching key, or the client's address ``peer`` when no keys are configured)."""
        if self._keys:
            found = self._keys.check(given)
            if found is None:
                return ErrorReply(
                    401,
                    "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
                    "invalid_api_key",
                ), None
            return None, found
        return None, peer

    def hold(self, ident: object) -> tuple[ErrorReply | None, object]:
        """One more request in flight for the client ``ident`` (from :meth:`caller`), under
        the per-key concurrency limit: (the 429 refusal, None to go on; ``ident`` to
        :meth:`release` when the request is over, None when nothing is counted)."""
        per_key = self._per_key
        if not per_key:
            return _PASS
        count = self._in_flight.get(ident, 0)
        if count >= per_key:
            return ErrorReply(
                429,
                f"too many concurrent requests for this key (limit {per_key}); retry later",
                "too_many_concurrent_requests",
                headers=self._retry_after,
            ), None
        self._in_flight[ident] = count + 1
        return None, ident

    def release(self, ident: object) -> None:
        left = self._in_flight[ident] - 1
        if left:
            self._in_flight[ident] = left
        else:
            del self._in_flight[ident]
