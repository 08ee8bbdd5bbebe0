"""One ``/metrics`` page for all worker processes (``server.workers = N > 1``).

With SO_REUSEPORT a scrape lands on whichever worker the kernel picks, and each worker
counts only its own requests: scraped as is, a counter would jump between the workers'
values from one scrape to the next and ``rate()`` would be meaningless. So the worker that
receives ``GET /metrics`` asks every other worker for its own page over its control socket
(router/service/control.py) and answers with all of them, each sample labelled with
``worker="<index>"`` (0 .. N-1, stable across restarts of the router, unlike pids):
``sum without (worker) (rate(kvrouter_requests_total[1m]))`` is the router's rate. Two
gauges say whether the page is complete: ``kvrouter_workers`` (configured) and
``kvrouter_workers_scraped`` (whose samples this page holds); a worker that does not answer
within the timeout is left out rather than failing the scrape. ``kvrouter_worker_restarts_total``
counts the workers the parent started to replace ones that died (router/service/supervisor.py).

The merge works on the text exposition format (version 0.0.4): all samples of a metric
family must stay together, so the pages are merged family by family, headers once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence

from router.service.peers import peer_call

INDEX_HEADER = "X-KVRouter-Worker-Index"
_TIMEOUT_S = 2.0


_NAME = re.compile(r"[^{ ]*")  # a sample line's metric name: up to its labels or value


def labelled(sample: str, worker: str) -> str:
    """``sample`` (one exposition line) with ``worker="<worker>"`` as its first label."""
    cut = _NAME.match(sample).end()  # type: ignore[union-attr]  # (matches any string)
    label = f'worker="{worker}"'
    if sample[cut : cut + 1] == "{":
        sep = "" if sample[cut + 1 : cut + 2] == "}" else ","
        return f"{sample[: cut + 1]}{label}{sep}{sample[cut + 1 :]}"
    return f"{sample[:cut]}{{{label}}}{sample[cut:]}"


def families(page: str) -> list[tuple[str, list[str], list[str]]]:
    """The page's metric families in order: (name, ``# HELP`` / ``# TYPE`` lines, samples)."""
    out: list[tuple[str, list[str], list[str]]] = []
    # "\n" only: label values may hold other line breaks (U+2028, U+0085, ...), which the
    # text format does not escape and str.splitlines would cut a sample at
    for line in page.split("\n"):
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # other comments carry nothing
            if not out or out[-1][0] != parts[2]:
                out.append((parts[2], [], []))
            out[-1][1].append(line)
        else:
            if not out:  # samples before any header: a family of their own
                out.append(("", [], []))
            out[-1][2].append(line)
    return out


def merge(pages: Iterable[tuple[str, str]]) -> str:
    """One page from ``(worker label, page)`` pairs: each family once, with the samples of
    every worker that has it, in the order the workers are given."""
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for worker, page in pages:
        for name, headers, samples in families(page):
            if name not in merged:
                merged[name] = (headers, [])
            merged[name][1].extend(labelled(s, worker) for s in samples)
    lines: list[str] = []
    for headers, samples in merged.values():
        lines += headers
        lines += samples
    return "\n".join(lines) + "\n"


def _completeness(configured: int, scraped: int, restarts: int) -> str:
    return (
        "# HELP kvrouter_workers Worker processes the router was started with.\n"
        "# TYPE kvrouter_workers gauge\n"
        f"kvrouter_workers {configured}\n"
        "# HELP kvrouter_workers_scraped Worker processes whose samples this page holds.\n"
        "# TYPE kvrouter_workers_scraped gauge\n"
        f"kvrouter_workers_scraped {scraped}\n"
        "# HELP kvrouter_worker_restarts_total Worker processes started to replace ones "
        "that died.\n"
        "# TYPE kvrouter_worker_restarts_total counter\n"
        f"kvrouter_worker_restarts_total {restarts}\n"
    )


async def _peer_page(socket_path: str) -> tuple[str, str] | None:
    """(worker index, page) of the worker listening on ``socket_path``; None if it did not
    answer in time or answered otherwise."""
    got = await peer_call(socket_path, "GET", "/internal/metrics", timeout_s=_TIMEOUT_S)
    if isinstance(got, str) or got.status != 200:
        return None
    index = got.header(INDEX_HEADER)
    if index is None or not index.isdigit():
        return None
    return index, got.body.decode()


async def all_workers_page(
    own_index: int, own_page: bytes, peer_sockets: Sequence[str], configured: int, restarts: int
) -> bytes:
    """This worker's page merged with the pages of the workers at ``peer_sockets``;
    ``restarts``: the workers the parent replaced so far."""
    got = await asyncio.gather(*(_peer_page(p) for p in peer_sockets))
    pages = [(str(own_index), own_page.decode())] + [g for g in got if g is not None]
    pages.sort(key=lambda p: int(p[0]))
    tail = _completeness(configured, len(pages), restarts)
    # a line at a time over every worker's page: in a worker thread, as the pages themselves
    # are written (router/service/exposition.py), not on the event loop
    return await asyncio.get_running_loop().run_in_executor(None, _merged, pages, tail)


def _merged(pages: list[tuple[str, str]], tail: str) -> bytes:
    return (merge(pages) + tail).encode()
