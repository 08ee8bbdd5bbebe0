"""The project's exception hierarchy. Edges map these to HTTP statuses and gRPC codes;
the core only raises them."""

from __future__ import annotations


class KVRouterError(Exception):
    """Base of every error kvrouter raises on purpose."""


class BadRequest(KVRouterError):
    """The caller sent something malformed or out of bounds (HTTP 400, INVALID_ARGUMENT)."""


class UnknownModel(KVRouterError):
    """No replica serves the requested model (HTTP 404, NOT_FOUND)."""


class NoReplicaAvailable(KVRouterError):
    """No replica can take the request now (HTTP 503 with Retry-After, UNAVAILABLE)."""

    def __init__(self, message: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class ShuttingDown(NoReplicaAvailable):
    """The router stops (SIGTERM) and will not route the request: one held by SLO-aware
    admission then, or one it would hold during the drain (HTTP 503 with Retry-After and
    code ``router_stopping``, UNAVAILABLE): another router may serve it now."""

    def __init__(self) -> None:
        super().__init__("the router is stopping and routes no more requests; retry on another")


class Overloaded(KVRouterError):
    """SLO-aware admission refused the request: it cannot meet its SLO now (HTTP 429 with
    Retry-After and code ``slo_<reason>``, RESOURCE_EXHAUSTED). ``reason``: ``deadline`` or
    ``queue_full``; ``klass``: its service class's name."""

    def __init__(self, message: str, reason: str, klass: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.klass = klass
        self.retry_after_s = retry_after_s


class ConfigError(KVRouterError):
    """Settings are invalid; raised at start-up, never on the request path."""
