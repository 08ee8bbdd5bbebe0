"""Who a request is: its request id and its session, as every front end reads them.

The request id is the client's ``X-Request-Id`` or a fresh unpredictable one
(:func:`request_id_of`), made unique among the requests in flight right before routing
(:func:`unique_in_flight`); the session is the ``X-Session-Id`` header or what the body names
(:func:`session_of`, :func:`body_session`), kept bounded (:func:`session_key`). Used by the
front door (router.service.handling), its body checks (router.service.intake), SLO admission
(router.service.admission) and gRPC Pick.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import xxhash

from router.service.gate import tenant_of
from router.service.state import RouterState


class _RandomIds:
    """Fresh 32-hex-digit request ids from the OS's random bytes, drawn 4 KiB at a time.

    Unpredictable (ids are echoed to clients, and one client must not be able to guess
    another's), with one ``os.urandom`` system call per 256 ids rather than one per request.
    A forked worker starts with a fresh buffer, so workers never repeat each other's ids."""

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._buf = b""
        self._pos = 0

    def next(self) -> str:
        pos = self._pos
        if pos + 16 > len(self._buf):
            self._buf, pos = os.urandom(4096), 0
        self._pos = pos + 16
        return self._buf[pos : pos + 16].hex()


_ids = _RandomIds()
os.register_at_fork(after_in_child=_ids.reset)


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id``, else a fresh 32-hex-digit id. Decoded as latin-1, byte
    for byte: the replica and the client get the id back as ``.encode("latin-1")``."""
    for k, v in headers:
        if len(k) == 12 and k.lower() == b"x-request-id" and v:
            return v.decode("latin-1")
    return _ids.next()


_MAX_SESSION_ID = 128


def session_key(value: object) -> str | None:
    """A session id as the router keeps it: a non-empty string, at most 128 characters
    (longer ones are replaced by their 64-bit digest, so a client cannot grow the session
    table's memory with its ids, and so are ids that are no UTF-8 text: a JSON body's lone
    surrogate escape, a header's stray bytes, which pod digests and recorded labels encode);
    None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    if len(value) > _MAX_SESSION_ID or not _utf8(value):
        return "xxh3:" + xxhash.xxh3_64_hexdigest(value.encode("utf-8", "surrogatepass"))
    return value


def _utf8(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (no lone surrogate)."""
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def session_of(headers: Iterable[tuple[bytes, bytes]], body_session: str | None) -> str | None:
    """The request's session: the ``X-Session-Id`` header (vllm-router's), else what the body
    named (``metadata.session_id``, else ``user``; see
    :func:`~router.service.intake.admit`). The header's bytes are read as the id's UTF-8,
    as a JSON body's ``session_id`` and gRPC Pick's (a proto string) give it, so a session
    keeps its key whichever carries it (bytes that are no UTF-8 are kept as surrogate
    escapes, then digested: :func:`session_key`).

    Scoped by the API key presented (:func:`scoped_session`)."""
    session = body_session
    for k, v in headers:
        if len(k) == 12 and k.lower() == b"x-session-id" and v:
            session = session_key(v.decode("utf-8", "surrogateescape"))
            break
    return scoped_session(headers, session)


def scoped_session(headers: Iterable[tuple[bytes, bytes]], session: str | None) -> str | None:
    """``session`` as the router keys it: after the digest of the API key the request
    presented (:func:`~router.service.gate.tenant_of`, as admission names the tenant), so two
    clients whose ids collide ("default", a user number) each keep their own session's hint
    rather than overwriting each other's. No key: the id as it came."""
    if session is None:
        return None
    tenant = tenant_of(headers)
    return tenant + "/" + session if tenant else session


def body_session(body: dict[str, Any]) -> str | None:
    """``session_id`` (vLLM's request field), else ``metadata.session_id`` (OpenAI's
    free-form request metadata), else ``prompt_cache_key`` (OpenAI's key of requests that
    share a prompt prefix: a conversation's, which OpenAI has replace ``user`` for caching),
    else ``user`` (one end user: all their conversations)."""
    found = session_key(body.get("session_id"))
    if found is not None:
        return found
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        found = session_key(metadata.get("session_id"))
        if found is not None:
            return found
    found = session_key(body.get("prompt_cache_key"))
    if found is not None:
        return found
    return session_key(body.get("user"))


def unique_in_flight(state: RouterState, request_id: str) -> str:
    """``request_id``, made unique among this process's requests in flight: the load tracker
    keys requests by id, so a client re-sending an id that is still in flight (a retry that
    did not wait, or two clients with the same id) gets ``<id>-<8 hex digits>`` instead of
    taking over the other request's accounting. The replica sees that id too. A disaggregated
    request's prefill leg is in flight as ``<id>#p`` (router/service/disagg.py) and its
    replica gets ``<id>``: that counts too (:func:`in_flight`), as does an id admission
    holds or has not released yet (router/service/admission.py ``taken``), and so does a
    request ``<id>#p`` in its prefill leg (``<id>#p#p``): its decode leg will be ``<id>#p``,
    this request's own prefill leg, and the load tracker keeps one record per id. Call it
    right before routing (no ``await`` in between)."""
    if (
        in_flight(state, request_id)
        or state.load.tracks(request_id + "#p#p")
        or (state.admission is not None and state.admission.taken(request_id))
    ):
        request_id = f"{request_id}-{_ids.next()[:8]}"
    return request_id


def in_flight(state: RouterState, request_id: str) -> bool:
    """Whether ``request_id`` is in flight in this process's load tracker: as a request, or
    as a disaggregated request's prefill leg (``<id>#p``, whose decode leg is ``<id>``)."""
    load = state.load
    return load.tracks(request_id) or load.tracks(request_id + "#p")
