"""Where a replica publishes its KV events, asked of the replica itself: vLLM (0.34 and later)
answers ``GET /kv_event_sources`` with the resolved ``KVEventsConfig`` of each data-parallel
rank's publisher (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", ...}, "1": ...}``, ports
already offset per rank; ``{}`` when events are off). A replica configured with ``zmq =
"auto"`` is followed at those endpoints (router/service/background.py ``direct_events``).

The engine reports the addresses it *binds*: a wildcard host (``*``, ``0.0.0.0``, ``::``)
becomes the replica's own host from its URL, which is where a subscriber connects; an
explicit host is kept. :func:`event_sources` reads an answer; :func:`ask` asks until one is
usable; :func:`ask_once` asks once; :func:`watch` asks a followed replica again every
``SOURCES_RECHECK_S`` (one that restarted may publish elsewhere). The router's direct mode
and the publisher sidecar both use them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn
from urllib.parse import urlsplit

import aiohttp

from router.events.endpoints import EndpointSpec, check_endpoint

_log = logging.getLogger(__name__)

SOURCES_PATH = "/kv_event_sources"
_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
# a replica followed at the endpoints it named is asked again this often (seconds): one
# restarted publishing elsewhere is followed there (``watch``)
SOURCES_RECHECK_S = 10.0


class NoEventSources(ValueError):
    """The replica's answer names no endpoint the router can follow (events off, another
    publisher, a port chosen by the OS, an unreadable answer): say which, for the operator."""


def connectable(endpoint: str, replica_url: str) -> str:
    """``endpoint`` as a subscriber reaches it: a wildcard tcp host replaced by the host of
    ``replica_url``; ValueError when it still cannot be connected to (``check_endpoint``)."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if colon and host in _WILDCARDS:
            target = urlsplit(replica_url).hostname
            if not target:
                raise ValueError(f"replica URL {replica_url!r} has no host")
            if ":" in target:  # an IPv6 literal
                target = f"[{target}]"
            endpoint = f"tcp://{target}:{port}"
    return check_endpoint(endpoint)


def event_sources(answer: Any, replica_url: str) -> tuple[EndpointSpec, ...]:
    """The endpoints to follow from a ``/kv_event_sources`` answer, one per rank in rank
    order; raises :class:`NoEventSources` naming what is missing."""
    if not isinstance(answer, Mapping):
        raise NoEventSources("the answer is not a JSON object of ranks")
    if not answer:
        raise NoEventSources(
            "the replica publishes no KV events (start vLLM with --kv-events-config "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\')'
        )
    specs: list[EndpointSpec] = []
    for key, config in answer.items():
        try:
            rank = int(key)
        except (TypeError, ValueError):
            raise NoEventSources(f"rank {key!r} is not a number") from None
        specs.append(_spec(rank, config, replica_url))
    specs.sort(key=lambda s: s.dp_rank)
    return tuple(specs)


def _spec(rank: int, config: Any, replica_url: str) -> EndpointSpec:
    where = f"rank {rank}"
    if rank < 0 or not isinstance(config, Mapping):
        raise NoEventSources(f"{where}: not a publisher configuration")
    if config.get("enable_kv_cache_events") is False or config.get("publisher") != "zmq":
        raise NoEventSources(f"{where}: publisher {config.get('publisher')!r}, not zmq")
    endpoint, replay, topic = (
        config.get("endpoint"),
        config.get("replay_endpoint"),
        config.get("topic") or "",
    )
    if not isinstance(endpoint, str) or not isinstance(topic, str):
        raise NoEventSources(f"{where}: no endpoint")
    if replay is not None and not isinstance(replay, str):
        raise NoEventSources(f"{where}: replay_endpoint {replay!r} is not a string")
    try:
        return EndpointSpec(
            connectable(endpoint, replica_url),
            connectable(replay, replica_url) if replay else None,
            topic,
            rank,
        )
    except ValueError as exc:
        raise NoEventSources(f"{where}: {exc}") from None


async def ask(
    replica_url: str, name: str, *, max_pause_s: float = 30.0
) -> tuple[EndpointSpec, ...]:
    """Ask ``replica_url`` where it publishes until it answers with usable endpoints: again
    after 1 s, the pause doubling to ``max_pause_s``; each new reason for not following it
    logged once (as replica ``name``). Cancel to give up."""
    pause, said = 1.0, ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as http:
        while True:
            try:
                return await _asked(http, replica_url)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
                if reason != said:
                    _log.warning("replica %s: KV events not followed yet: %s", name, reason)
                    said = reason
            await asyncio.sleep(pause)
            pause = min(pause * 2, max_pause_s)


async def ask_once(replica_url: str) -> tuple[EndpointSpec, ...] | None:
    """:func:`ask` once: the endpoints, or None when the replica does not answer with usable
    ones now (down, restarting)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as http:
        try:
            return await _asked(http, replica_url)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None


async def watch(
    replica_url: str,
    name: str,
    specs: tuple[EndpointSpec, ...],
    moved: Callable[[tuple[EndpointSpec, ...]], Awaitable[None]],
) -> NoReturn:
    """Replica ``name`` at ``replica_url`` is followed at ``specs`` (its answer): ask it
    again every ``SOURCES_RECHECK_S`` and, when it names other endpoints (it restarted
    publishing on other ports, or with another dp size), call ``moved`` with them (the
    caller forgets what the old endpoints said and follows the new ones). An answer that
    fails (the replica down, restarting) changes nothing. Cancel to stop."""
    while True:
        await asyncio.sleep(SOURCES_RECHECK_S)
        now = await ask_once(replica_url)
        if now is None or now == specs:
            continue
        _log.warning("replica %s: its KV events moved; following them anew", name)
        await moved(now)
        specs = now


async def _asked(http: aiohttp.ClientSession, replica_url: str) -> tuple[EndpointSpec, ...]:
    async with http.get(replica_url.rstrip("/") + SOURCES_PATH) as resp:
        if resp.status != 200:
            raise NoEventSources(f"GET {SOURCES_PATH} answered {resp.status}")
        return event_sources(await resp.json(content_type=None), replica_url)
