"""Where an engine publishes its KV events: ``EndpointSpec`` per endpoint, and the endpoints
of every data-parallel rank of an engine, derived as the engines derive them (vLLM's and
SGLang's ``ZmqEventPublisher.offset_endpoint_port``: rank N on the configured port + N, replay
port + N too). Shared by the router's direct mode and the publisher sidecar."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EndpointSpec:
    """One engine event endpoint. ``dp_rank``: the rank its batches are filed under when
    their payload names none, or a rank the replica's endpoints do not
    (router/events/ingest.py)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if a subscriber can connect to it: ``tcp://host:port`` (a host, not
    ``*``, and a port 1-65535), ``ipc://path`` or ``inproc://name``; else ValueError, so a
    typo is a configuration error instead of a subscriber that cannot start."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme in ("ipc", "inproc") and rest:
        return endpoint
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if colon and host and host != "*" and port.isdigit() and 0 < int(port) < 65536:
            return endpoint
    raise ValueError(
        f"endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    )


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint data-parallel rank ``dp_rank`` of an engine publishes on, given the
    configured one, as vLLM's and SGLang's ``ZmqEventPublisher.offset_endpoint_port`` derive
    it: tcp port + rank (vLLM leaves port 0, "any", alone), ``inproc://x`` -> ``x_dp<rank>``.
    Raises ValueError for other transports with a rank > 0 (the engines do too)."""
    if dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"no port in endpoint {endpoint!r}")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + dp_rank}"
    raise ValueError(f"endpoint {endpoint!r}: dp rank > 0 needs tcp:// or inproc://")


def rank_endpoints(
    endpoint: str, replay_endpoint: str | None, dp_ranks: Sequence[int], topic: str = ""
) -> tuple[EndpointSpec, ...]:
    """One ``EndpointSpec`` per data-parallel rank of an engine configured with ``endpoint``
    (and ``replay_endpoint``): rank N on the ports + N (``offset_endpoint``)."""
    return tuple(
        EndpointSpec(
            offset_endpoint(endpoint, rank),
            None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank),
            topic,
            rank,
        )
        for rank in dp_ranks
    )


def engine_endpoints(
    endpoints: Sequence[str],
    replay_endpoints: Sequence[str],
    dp_ranks: Sequence[int],
    topic: str = "",
) -> tuple[EndpointSpec, ...]:
    """The endpoints to follow for one engine: one endpoint per rank given explicitly
    (``endpoints[i]`` serves ``dp_ranks[i]``), or one configured endpoint for all ranks, which
    publish on its port + rank (``rank_endpoints``). ``replay_endpoints``: none, or one per
    endpoint. Raises ValueError when the counts do not fit or an endpoint is malformed
    (``check_endpoint``)."""
    if not endpoints:
        raise ValueError("no KV-event endpoint")
    for endpoint in (*endpoints, *replay_endpoints):
        check_endpoint(endpoint)
    if replay_endpoints and len(replay_endpoints) != len(endpoints):
        raise ValueError("give one replay endpoint per event endpoint, or none")
    ranks = list(dp_ranks) or [0]
    if len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise ValueError(f"dp ranks must be distinct and >= 0: {ranks}")
    if len(endpoints) == 1:
        return rank_endpoints(
            endpoints[0], replay_endpoints[0] if replay_endpoints else None, ranks, topic
        )
    if len(endpoints) != len(ranks):
        raise ValueError(
            f"{len(endpoints)} event endpoints for {len(ranks)} dp ranks: give one endpoint "
            "(rank N publishes on its port + N) or one per rank"
        )
    return tuple(
        EndpointSpec(ep, replay_endpoints[i] if replay_endpoints else None, topic, ranks[i])
        for i, ep in enumerate(endpoints)
    )
