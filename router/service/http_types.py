"""What the router's HTTP server hands to the code that answers: one parsed request and
one whole answer, as plain values (no HTTP library's types), so every route, the two hot
endpoints and the admin API alike, is written against the same two classes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote_to_bytes

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class HttpRequest:
    """One request as the server parsed it. ``body`` is empty when ``too_large`` (a body over
    ``server.max_body_mb`` is discarded as it arrives); ``header_bytes`` is the size of the
    header block (names, values and 4 bytes of framing per line); ``peer`` the client's
    address ('' on a unix socket)."""

    method: bytes
    target: bytes  # path and query, as sent
    path: bytes  # the target without its query
    headers: Headers
    body: bytes
    peer: str = ""
    header_bytes: int = 0
    too_large: bool = False
    keep_alive: bool = True

    def header(self, name: str) -> str:
        """The first value of header ``name`` (any case), '' when absent."""
        low = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k.lower() == low:
                return v.decode("latin-1")
        return ""

    def query(self) -> dict[str, str]:
        """The query string's parameters (the last value of a repeated one)."""
        _, _, raw = self.target.partition(b"?")
        found = parse_qs(raw.decode("latin-1"), keep_blank_values=True)
        return {k: v[-1] for k, v in found.items()}


@dataclass(slots=True, frozen=True)
class Reply:
    """A whole answer (Content-Length framing)."""

    status: int
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Reply:
        return cls(status, json.dumps(value).encode(), ((b"Content-Type", b"application/json"),))

    @classmethod
    def text(cls, body: bytes, content_type: bytes, *extra: tuple[bytes, bytes]) -> Reply:
        return cls(200, body, ((b"Content-Type", content_type), *extra))


def path_segment(raw: bytes) -> str:
    """A percent-decoded path segment (``name%23dp1`` -> ``name#dp1``)."""
    return unquote_to_bytes(raw).decode("utf-8", "surrogateescape")
