"""Stored-response ids across router processes: the other worker processes and router pods.

A process records the ids of the stored responses it relayed (router/service/response_ids.py);
vLLM keeps a response only in the replica that made it, so a follow-up naming it
(``previous_response_id``) or a ``GET`` / ``cancel`` of it must find that replica whichever
process the client reaches. :meth:`ResponseShare.find` is asked only when this process does
not know the id itself (a known id, and every request naming none, costs nothing more):

1. the other workers of this ``kvrouter serve`` (``server.workers > 1``): ``GET
   /internal/responses/{id}`` on every control socket at once (router/service/control.py;
   answered from that worker's own map, ``{"model", "replica", "owner"}`` or 404), the first holder
   found wins, all within :data:`LOOKUP_TIMEOUT_S`;
2. else, with ``server.redis_url`` (router pods), one ``GET`` of the id's key in Redis
   (router/store/response_ids.py), within :data:`LOOKUP_TIMEOUT_S` too.

A holder found is kept in this process's map. With Redis, every id this process records is
also written there (``SET ... PX server.response_ids_ttl_s``), off the client's path: the
record queues it (at most :data:`OUTBOX_MAX`, the oldest dropped and counted) and a
background task writes what is queued in pipelines of up to :data:`WRITE_BATCH`. A failed
write goes back to the head of the queue and is tried again after a pause that doubles
from :data:`RETRY_MIN_S` to :data:`RETRY_MAX_S`, so an outage shorter than the queue's
reach loses no id. A failed write or lookup is counted (``kvrouter_response_id_writes_total``,
``kvrouter_response_id_lookups_total``) and logged once per outage, never raised: the
request is then routed as if the id were unknown. Lookups of one id at once share one
lookup; at most :data:`MAX_LOOKUPS` ids are looked up at once (beyond, unknown). Only ids
:func:`~router.service.response_ids.shareable` are written or looked up.

An id Redis does not have is asked for once more after :data:`RECHECK_S`: a follow-up can
reach another pod while the first pod's write is still on its way (within about a Redis
round trip of the answer), and an id nobody knows is a request that fails anyway, so only
those wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import quote

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from router.service.peers import PeerClient
from router.service.response_ids import Holder, ResponseIds, shareable
from router.service.settings import ServerSettings
from router.store.response_ids import ResponseIdStore
from router.store.schema import KeySchema
from router.tasks import running

_log = logging.getLogger(__name__)
PATH_PREFIX = "/internal/responses/"
LOOKUP_TIMEOUT_S = 1.0  # the other workers' answers; Redis's GET
WRITE_TIMEOUT_S = 5.0  # one pipeline of writes
MAX_LOOKUPS = 1024
OUTBOX_MAX = 4096
WRITE_BATCH = 256
RETRY_MIN_S = 0.2  # the pause after a failed write, doubled while writes keep failing ...
RETRY_MAX_S = 5.0  # ... up to this
RECHECK_S = 0.05  # an id Redis did not have is asked for again after this
SOURCES = ("workers", "redis")
RESULTS = ("found", "missed", "failed")


def holder_json(holder: Holder) -> dict[str, str]:
    """A control socket's answer for a known id (:data:`PATH_PREFIX`)."""
    return {"model": holder.model, "replica": holder.replica, "owner": holder.owner}


def parse_holder(body: bytes) -> Holder:
    """A control socket's answer; ValueError for anything else."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(str(exc)) from None
    model = value.get("model") if isinstance(value, dict) else None
    replica = value.get("replica") if isinstance(value, dict) else None
    owner = value.get("owner", "") if isinstance(value, dict) else None
    if not (
        isinstance(model, str)
        and model
        and isinstance(replica, str)
        and replica
        and isinstance(owner, str)
    ):
        raise ValueError(f"expected {{'model', 'replica', 'owner'}}, got {value!r}")
    return Holder(model, replica, owner)


@dataclass(slots=True)
class _Counters:
    lookups: dict[tuple[str, str], int]
    written: int = 0
    write_failed: int = 0
    dropped: int = 0  # queued writes pushed out unsent (outbox full)
    skipped: int = 0  # lookups not made: MAX_LOOKUPS ids were being looked up


class ResponseShare:
    """This process's part (module docstring): ``ids`` is its own map. Sources join while
    the app runs: the other workers (:meth:`join_workers`), Redis (:meth:`use_store`)."""

    def __init__(self, ids: ResponseIds) -> None:
        self.ids = ids
        self.counters = _Counters({(s, r): 0 for s in SOURCES for r in RESULTS})
        self._siblings: Callable[[], list[str]] | None = None
        self._peers: PeerClient | None = None
        self._store: ResponseIdStore | None = None
        self._outbox: deque[tuple[str, str, str, str]] = deque()
        self._wake = asyncio.Event()
        self._pending: dict[str, asyncio.Future[Holder | None]] = {}
        self._failing = {s: False for s in SOURCES}
        self._metrics: set[int] = set()  # ids of the registries counting these

    @property
    def remote(self) -> bool:
        """Whether any other process can be asked."""
        return self._siblings is not None or self._store is not None

    # ------------------------------------------------------------------ sources

    def join_workers(self, sockets: Callable[[], list[str]], client: PeerClient) -> None:
        """Ask the workers at ``sockets()`` (the others' control sockets) with ``client``."""
        self._siblings, self._peers = sockets, client

    def leave_workers(self) -> None:
        self._siblings = self._peers = None

    def use_store(self, store: ResponseIdStore | None) -> None:
        """Write recorded ids to ``store`` and look up there (None: no more)."""
        self._store = store
        if store is None:
            self._outbox.clear()

    def count_in(self, registry: CollectorRegistry) -> None:
        """Expose the counters in ``registry`` (once per registry)."""
        if id(registry) not in self._metrics:
            self._metrics.add(id(registry))
            registry.register(_ShareCollector(self))

    # ------------------------------------------------------------------ recording

    def record(self, response_id: str, model: str, replica: str, owner: str = "") -> None:
        """``replica`` of ``model`` holds ``response_id``, made for ``owner``: kept in this
        process's map and, with Redis, queued for it (never waits)."""
        self.ids.put(response_id, model, replica, owner)
        if self._store is None or not shareable(response_id):
            return
        if len(self._outbox) >= OUTBOX_MAX:
            self._outbox.popleft()
            self.counters.dropped += 1
        self._outbox.append((response_id, model, replica, owner))
        self._wake.set()

    async def write_queued(self) -> bool:
        """Write what is queued until none is left; False at the first failed batch, which
        is counted and put back at the head of the queue (the oldest beyond
        :data:`OUTBOX_MAX` dropped, counted)."""
        while self._outbox and (store := self._store) is not None:
            n = min(len(self._outbox), WRITE_BATCH)
            batch = [self._outbox.popleft() for _ in range(n)]
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await store.put(batch)
            except Exception as exc:
                _raise_if_cancelled()
                self.counters.write_failed += n
                self._failed("redis", "writing stored-response ids", exc)
                if self._store is store:
                    self._outbox.extendleft(reversed(batch))
                    while len(self._outbox) > OUTBOX_MAX:
                        self._outbox.popleft()
                        self.counters.dropped += 1
                return False
            _raise_if_cancelled()
            self.counters.written += n
            self._recovered("redis")
        return True

    async def write_forever(self) -> None:
        """The background writer: :meth:`write_queued` whenever a record was queued, and
        again after a pause while writes fail (module docstring). It connects first, so
        neither the first write nor the first lookup waits for that."""
        if (store := self._store) is not None:
            with contextlib.suppress(Exception):  # (the first write or lookup tells)
                async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                    await store.ping()
        pause = RETRY_MIN_S
        while True:
            _raise_if_cancelled()
            await self._wake.wait()
            self._wake.clear()
            while not await self.write_queued():
                await asyncio.sleep(pause)
                pause = min(RETRY_MAX_S, pause * 2)
            pause = RETRY_MIN_S

    # ------------------------------------------------------------------ finding

    async def find(self, response_id: str) -> Holder | None:
        """The holder of ``response_id``: this process's own, else (module docstring) the
        other workers', else Redis's, kept here once found; None when nobody knows it."""
        found = self.ids.get(response_id)
        if found is not None or not self.remote or not shareable(response_id):
            return found
        pending = self._pending.get(response_id)
        if pending is None:
            if len(self._pending) >= MAX_LOOKUPS:
                self.counters.skipped += 1
                return None
            pending = self._pending[response_id] = asyncio.ensure_future(
                self._find_elsewhere(response_id)
            )
            pending.add_done_callback(lambda _: self._pending.pop(response_id, None))
        # one client leaving must not cancel the lookup others wait for
        return await asyncio.shield(pending)

    async def _find_elsewhere(self, response_id: str) -> Holder | None:
        found = None
        try:
            if self._siblings is not None and self._peers is not None:
                found = await self._ask_workers(self._siblings(), self._peers, response_id)
            if found is None and self._store is not None:
                found = await self._ask_store(self._store, response_id)
        except Exception:  # a bug here must not fail the request: the id stays unknown
            _log.exception("looking up stored-response id %r failed", response_id)
            return None
        if found is not None:
            self.ids.put(response_id, *found)
        return found

    async def _ask_workers(
        self, sockets: list[str], client: PeerClient, response_id: str
    ) -> Holder | None:
        if not sockets:
            return None
        path = PATH_PREFIX + quote(response_id, safe="")
        asks = [asyncio.ensure_future(self._ask_worker(client, s, path)) for s in sockets]
        failed = False
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                for next_answer in asyncio.as_completed(asks):
                    got = await next_answer
                    if isinstance(got, Holder):
                        self._count("workers", "found")
                        return got
                    failed = failed or got is False
        except TimeoutError:
            failed = True
        finally:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        self._count("workers", "failed" if failed else "missed")
        return None

    async def _ask_worker(self, client: PeerClient, socket: str, path: str) -> Holder | bool:
        """The holder per the worker at ``socket``; True: it does not know the id; False:
        no answer (logged)."""
        got = await client.call(socket, "GET", path)
        if not isinstance(got, str) and got.status == 404:
            return True
        try:
            if isinstance(got, str) or got.status != 200:
                raise ValueError(got if isinstance(got, str) else got.why_not())
            return parse_holder(got.body)
        except ValueError as exc:
            _log.debug("no stored-response id from %s: %s", socket, exc)
            return False

    async def _ask_store(self, store: ResponseIdStore, response_id: str) -> Holder | None:
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                got = await store.get(response_id)
                if got is None:  # perhaps still on its way (module docstring)
                    await asyncio.sleep(RECHECK_S)
                    got = await store.get(response_id)
        except Exception as exc:  # Redis away or slow, a foreign value: as unknown
            _raise_if_cancelled()
            self._count("redis", "failed")
            self._failed("redis", "looking up a stored-response id", exc)
            return None
        _raise_if_cancelled()
        self._recovered("redis")
        self._count("redis", "missed" if got is None else "found")
        return None if got is None else Holder(*got)

    def _count(self, source: str, result: str) -> None:
        self.counters.lookups[source, result] += 1

    def _failed(self, source: str, what: str, exc: BaseException) -> None:
        if not self._failing[source]:
            _log.warning("%s in %s failed: %s", what, source, str(exc) or type(exc).__name__)
        self._failing[source] = True

    def _recovered(self, source: str) -> None:
        if self._failing[source]:
            _log.info("stored-response ids: %s answers again", source)
        self._failing[source] = False


def _raise_if_cancelled() -> None:
    """Re-raise a cancellation of the running task that the Redis client turned into an
    error of its own, or swallowed (stopping must stop; a timeout of ours must fire)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _ShareCollector(Collector):
    def __init__(self, share: ResponseShare) -> None:
        self.share = share

    def collect(self) -> Iterable[Metric]:
        c = self.share.counters
        lookups = CounterMetricFamily(
            "kvrouter_response_id_lookups",
            "Stored-response ids this process did not know, looked up in the other worker "
            "processes, then in Redis (result found / missed / failed: no answer in time, "
            "or a bad one); skipped: not looked up, too many lookups at once",
            labels=["source", "result"],
        )
        for (source, result), n in c.lookups.items():
            lookups.add_metric([source, result], n)
        lookups.add_metric(["none", "skipped"], c.skipped)
        writes = CounterMetricFamily(
            "kvrouter_response_id_writes",
            "Stored-response ids written to Redis for the other router pods (result "
            "written / failed / dropped: queued too long while Redis was slow)",
            labels=["result"],
        )
        writes.add_metric(["written"], c.written)
        writes.add_metric(["failed"], c.write_failed)
        writes.add_metric(["dropped"], c.dropped)
        yield lookups
        yield writes


def siblings_ctx(
    share: ResponseShare, sockets: Callable[[], list[str]], registry: CollectorRegistry
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx``: while the app runs, ``share`` asks the workers at ``sockets()``."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        client = PeerClient(LOOKUP_TIMEOUT_S)
        share.join_workers(sockets, client)
        share.count_in(registry)
        try:
            yield
        finally:
            share.leave_workers()
            client.close()

    return ctx


def redis_ctx(
    share: ResponseShare, server: ServerSettings, registry: CollectorRegistry
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx``: while the app runs, ``share`` writes to and looks up in the Redis
    of ``server.redis_url`` (under ``server.redis_key_prefix``, for
    ``server.response_ids_ttl_s``) with a connection of its own, and writes what is still
    queued at the stop (for up to a second)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from router.store.redis_store import connect

        client = connect(
            server.redis_url or "",
            socket_timeout=LOOKUP_TIMEOUT_S,
            socket_connect_timeout=LOOKUP_TIMEOUT_S,
        )
        schema = KeySchema(server.redis_key_prefix, server.redis_stream_shards)
        share.use_store(ResponseIdStore(client, schema, server.response_ids_ttl_s))
        share.count_in(registry)
        try:
            async with running(share.write_forever(), name="response-id-writer"):
                yield
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await share.write_queued()
        finally:
            share.use_store(None)
            with contextlib.suppress(Exception):
                await client.aclose()

    return ctx
