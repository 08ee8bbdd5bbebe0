"""Settings of the gRPC server; plain values so the service config can hold them without
importing grpc."""

from __future__ import annotations

from dataclasses import dataclass

# max_message_mb is below this: grpc takes its byte count as a C int (2**31 - 1 at most)
MAX_MESSAGE_MB = 2048


@dataclass(slots=True, frozen=True)
class GrpcSettings:
    """``port`` None disables gRPC; 0 picks a free port (tests).

    ``token``: every call must carry ``authorization: Bearer TOKEN`` (health and reflection
    excepted). ``admin_token``: required by the Admin service, which is refused without one.
    ``tls_cert`` / ``tls_key``: PEM files; TLS is on when both are set.
    ``max_message_mb``: larger messages are rejected with RESOURCE_EXHAUSTED.
    ``max_header_kb``: ``server.max_header_kb``, the bound of a call's metadata counted as
    an HTTP header block (0: grpc's ceiling alone, router/rpc/server.py); larger ->
    RESOURCE_EXHAUSTED with the HTTP 431's message.
    Decisions not reported within ``decision_ttl_s`` (or beyond ``max_pending_decisions``)
    are completed in the load model so a silent gateway cannot leak load.
    """

    host: str = "127.0.0.1"
    port: int | None = None
    token: str | None = None
    admin_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_mb: float = 16.0
    max_header_kb: float = 32.0
    decision_ttl_s: float = 3600.0
    max_pending_decisions: int = 100_000
