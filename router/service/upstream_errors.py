"""The errors of the pooled upstream client (router/service/upstream.py).

A module of their own because ``make compile`` compiles the client, and mypyc cannot compile
an exception class with two builtin bases (``UpstreamTimeout`` is also a ``TimeoutError``):
these stay interpreted, which costs nothing (they are raised only when a request fails).
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Base of the client's errors."""


class ConnectFailed(UpstreamError):
    """No response byte came back: connection refused, reset or closed before answering.
    ``connected``: a connection was made (the upstream took it, then closed it unanswered),
    as opposed to the address refusing or not answering the connect at all."""

    def __init__(self, message: str, *, connected: bool = False) -> None:
        super().__init__(message)
        self.connected = connected


class UpstreamTimeout(UpstreamError, TimeoutError):
    """A connect, first-byte, read or total timeout expired."""


class UpstreamBroken(UpstreamError):
    """The response started but broke off (connection lost, malformed HTTP)."""


class TotalTimeout(UpstreamTimeout):
    """The request's total time (``Pool.send``'s ``total_s``, ``server.request_timeout_s``
    less what its earlier attempts took) ran out: the request's deadline, not a sign that
    the replica failed."""
