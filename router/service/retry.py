"""What makes the proxy's retries safe and bounded (router/service/proxy.py, ``Forwarder``):

* **When.** Only before any byte reached the client: a refused or dropped connection, a 429
  or 5xx answer, a response that broke off, or no first byte by the attempt's deadline. The
  proxy holds a response's head until its first body data (a stream) or its whole body (any
  other answer) has arrived, so each of those is still retryable.
* **Where.** On the next-best replica of the decision's ranking still in rotation and not
  draining (a retry is a new request to it), never twice on one replica
  key (a data-parallel rank is a replica of its own: one whose engine dropped a request may
  leave the other ranks well; a refused connection skips them all), at most
  ``server.max_retries`` times.
* **How long.** ``server.request_timeout_s`` from the first attempt bounds them all: each
  attempt waits at most what is left of it and none starts once it is spent; running out
  of it is the request's deadline, not the replica's failure (no outlier ejection).
* **How many.** A :class:`RetryBudget` per router process: retries may add at most
  ``server.retry_budget_ratio`` of the requests of the last 10 s, plus
  ``server.retry_budget_min`` (so a quiet router still retries), judged when an attempt
  fails (not when it was sent: requests failing at once would all retry); past it the
  failed attempt's answer goes to the client (Envoy's and Linkerd's retry budgets: retries
  cannot multiply the load of a struggling fleet).
* **The first-byte deadline** scales with the work the router predicts before that byte:
  :func:`first_byte_deadline` (prefill of the replica's queued prompt tokens and this prompt
  with the model's default cost model; for an answer that is not a stream, its decode too)
  times ``server.first_byte_factor``, at least ``server.first_byte_min_s``, at most
  ``server.first_byte_timeout_s``.
"""

from __future__ import annotations

import datetime
import email.utils
import time
from collections import deque

from router.core.load import CostModel

WINDOW_S = 10.0
_COST = CostModel()
# the decode time assumed per output token of an answer that is not a stream (generous:
# the deadline only has to catch replicas that do not answer at all)
DECODE_S_PER_TOKEN = 0.05


class RetryBudget:
    """Requests and retries of the last :data:`WINDOW_S` seconds, in one-second buckets;
    ``now`` is passed in."""

    __slots__ = ("_buckets", "min_retries", "ratio")

    def __init__(self, ratio: float, min_retries: int) -> None:
        self.ratio = ratio
        self.min_retries = min_retries
        self._buckets: deque[list[float]] = deque()  # [second, requests, retries]

    def _bucket(self, now: float) -> list[float]:
        second = float(int(now))
        b = self._buckets
        if not b or b[-1][0] != second:
            b.append([second, 0.0, 0.0])
            while b and b[0][0] <= second - WINDOW_S:
                b.popleft()
        return b[-1]

    def request(self, now: float) -> None:
        self._bucket(now)[1] += 1

    def allows(self, now: float) -> bool:
        """Whether one more retry fits the budget."""
        self._bucket(now)
        requests = sum(x[1] for x in self._buckets)
        retries = sum(x[2] for x in self._buckets)
        return retries < self.min_retries + self.ratio * requests

    def spend(self, now: float) -> None:
        self._bucket(now)[2] += 1


def expected_first_byte_s(
    queued_prefill_tokens: int,
    prompt_tokens: int,
    usable_tokens: int,
    stream: bool,
    max_output_tokens: int | None,
) -> float:
    """The time the router predicts before an answer's first byte: the prefill of what the
    replica has queued (this prompt's uncached part included, as dispatched) and, for an
    answer that is not a stream, its decode (infinite without ``max_tokens``: then the
    deadline is ``first_byte_timeout_s`` and the attempt's latency is not judged)."""
    queued = max(queued_prefill_tokens, prompt_tokens - usable_tokens)
    steps = int(_COST.steps_for(queued))
    t = float(_COST.prefill_s(queued, usable_tokens)) + steps * _COST.step_overhead_s
    if not stream:
        if max_output_tokens is None:
            return float("inf")  # an answer of unknown length: only the read timeout bounds it
        t += max_output_tokens * DECODE_S_PER_TOKEN
    return t


def first_byte_deadline(
    expected_s: float, minimum_s: float, factor: float, maximum_s: float
) -> float:
    """Seconds to wait for an attempt's first byte: ``factor`` x the prediction, within
    [``minimum_s``, ``maximum_s``]."""
    return min(max(minimum_s, factor * expected_s), maximum_s)


def retry_after_s(value: bytes | None, wall_now: float | None = None) -> float | None:
    """A ``Retry-After`` header's delay in seconds: its delta-seconds form, or its HTTP-date
    form (RFC 9110 10.2.3) less ``wall_now`` (default: the wall clock); a date past,
    garbage, or a delay of a day or more: None."""
    if not value:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # ("-0000": UTC, no zone said)
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp() - (time.time() if wall_now is None else wall_now)
    return seconds if 0 < seconds < 86400 else None
