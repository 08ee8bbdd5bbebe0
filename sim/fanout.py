"""Routed requests that run as several engine requests: ``n`` > 1 sequences of one prompt,
and the rows of a completions batch. The simulation (sim/cluster.py) routes each once and
asks these ledgers which engine requests to submit, which engine outputs to book as the
request's own, and when the request ends.

A request sampling ``n`` > 1 sequences (``SimRequest.samples``; :class:`SampledRequests`) is
routed as one (its ``n`` counted in the router's load, as the service counts it; never
disaggregated, as the service keeps it local: ``keep_local`` ``parallel_sampling``) and runs
as vLLM v1 runs it: one engine request per sequence (``sim.engine.sampled``, as the mock
replica submits them), all on the replica it went to, queued together. The first prefills
the prompt; the others hit the blocks it computed before they were admitted and decode
alongside it. (The engine model caches a block at the end of the step that computed it,
vLLM as it allocates it: sequences admitted in the same step as the first prefill the prompt
again here, where vLLM's hit them.) The request's first token is the first sequence's, its
finish the last sequence's.

The requests of one completions batch (``SimRequest.batch``: a recording's rows of one
batch; :class:`CompletionBatches`) are one request to the service: they arrive with the
batch's first request (in workload order; the others' own arrival and ``after`` are not
used), are routed once as the router routes a batch (the longest prompt's blocks, the first
of the longest, every prompt's tokens counted, ``prompts`` = the batch's size) and all run on
that replica, each an engine request of its own prompt. The batch's load is booked as the
service books it, one flight of all its prompts (``LoadTracker.dispatch`` ``prompts``: each
prompt's sequences, every prompt's tokens) under its first request's id: it starts decoding
at the first token of any of its rows and ends when the last of them ends (the service's
answer ends with its last sequence), and so does its admission ticket; a closed-loop turn
tied to any of its rows follows the whole batch's end, as the live replay's turn follows the
batch's one answer. A refusal or a shed refuses all of them, and so does the engine when it
cannot take one of them (vLLM checks every prompt before it starts any: a 400 for the
whole request; sim/cluster.py asks the engine model's ``refusal`` first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.engine import EngineRequest, Finished, FirstToken, Rejected
from sim.engine import sampled as engine_sequences
from sim.workload import SimRequest


class SampledRequests:
    """The requests sampling ``n`` > 1 sequences that have not ended yet (module doc).
    False when there is none."""

    __slots__ = ("_held_finish", "_request_of", "_running")

    def __init__(self) -> None:
        # request id -> (its request, engine ids of its sequences not ended)
        self._running: dict[str, tuple[SimRequest, set[str]]] = {}
        self._request_of: dict[str, str] = {}  # an extra sequence's engine id -> its request id
        self._held_finish: dict[str, Finished] = {}  # a request's Finished, held for the others

    def __bool__(self) -> bool:
        return bool(self._running)

    def arrived(self, req: SimRequest) -> None:
        """``req`` (``samples`` > 1) reached the router."""
        self._running[req.request_id] = (req, {req.request_id})

    def other_sequences(self, ereq: EngineRequest) -> list[EngineRequest]:
        """The engine requests of ``ereq``'s other sequences, to submit behind it on the same
        engine at the same time (none unless ``ereq`` is a sampled request's own)."""
        entry = self._running.get(ereq.request_id)
        if entry is None:
            return []
        others = engine_sequences(ereq, entry[0].samples)[1:]
        for seq in others:
            self._request_of[seq.request_id] = ereq.request_id
            entry[1].add(seq.request_id)
        return others

    def output(self, out: Any) -> tuple[bool, Finished | None]:
        """Book an engine output. Returns whether ``out`` is to be booked as any request's
        (an output of a request that samples one sequence; a sampled request's own
        sequence's first token, or its rejection: none ran, the others being as large) and,
        when ``out`` ended a sampled request's last sequence, the request's Finished to book
        then: at the latest end of any of its sequences, with its own sequence's figures."""
        sid: str = out.request_id
        kind = type(out)
        rid = self._request_of.get(sid)
        if rid is None:  # a request's own sequence
            rid = sid
        elif kind is Finished or kind is Rejected:
            del self._request_of[sid]
        entry = self._running.get(rid)
        if entry is None:
            return rid == sid, None
        running = entry[1]
        if kind is FirstToken:
            return rid == sid, None
        if kind is Rejected and rid == sid:  # none ran (the others are as large)
            del self._running[rid]
            self._held_finish.pop(rid, None)
            return True, None
        if kind is not Finished and kind is not Rejected:
            return False, None
        running.discard(sid)
        held = self._held_finish.pop(rid, None)
        if kind is Finished:
            if held is None:
                held = Finished(rid, out.time, out.prompt_tokens, out.cached_tokens, 0)
            if rid == sid:  # the request's own figures, at the latest end of any sequence
                held = Finished(
                    rid, max(out.time, held.time), out.prompt_tokens, out.cached_tokens,
                    out.output_tokens,
                )  # fmt: skip
            elif out.time > held.time:
                held = Finished(
                    rid, out.time, held.prompt_tokens, held.cached_tokens, held.output_tokens
                )
        if running:
            if held is not None:
                self._held_finish[rid] = held
            return False, None
        del self._running[rid]
        return False, held


class CompletionBatches:
    """The completions batches of a run (module doc): each batch's rows after its first,
    kept with the first (whose id names the batch's flight), and the rows of each dispatched
    batch that have not ended."""

    __slots__ = ("_first_of", "_flight_of", "_left", "_others")

    def __init__(self) -> None:
        self._first_of: dict[str, str] = {}  # batch -> its first request's id
        self._others: dict[str, list[SimRequest]] = {}  # that id -> the batch's other rows
        self._flight_of: dict[str, str] = {}  # a dispatched batch's row id -> its first's id
        self._left: dict[str, set[str]] = {}  # that id -> the rows not ended yet

    def joins_first(self, req: SimRequest) -> bool:
        """Take ``req`` in workload order; True when it is a batch's row after the first,
        which arrives with the first (kept here, not scheduled on its own)."""
        if req.batch is None:
            return False
        first = self._first_of.setdefault(req.batch, req.request_id)
        if first == req.request_id:
            return False
        self._others.setdefault(first, []).append(req)
        return True

    def others(self, request_id: str) -> Sequence[SimRequest]:
        """The other rows of the batch whose first request is ``request_id`` (none when it
        is not a batch's first)."""
        return self._others.get(request_id, ())

    def dispatched(self, rows: Sequence[SimRequest]) -> None:
        """``rows`` (a request, then its batch's other rows) were sent: a batch's flight is
        booked under its first request's id until the last of its rows ends."""
        if len(rows) > 1:
            first = rows[0].request_id
            self._left[first] = {r.request_id for r in rows}
            for row in rows:
                self._flight_of[row.request_id] = first

    def flight(self, request_id: str) -> str:
        """The id ``request_id``'s load is booked under: its batch's first request's, or
        its own."""
        return self._flight_of.get(request_id, request_id)

    def ended(self, request_id: str) -> tuple[str, tuple[str, ...]] | None:
        """``request_id`` ended (finished or rejected). Returns its flight and the requests
        that end with it (itself; a batch's every row when it was the last of them), or
        None while rows of its batch still run."""
        flight = self._flight_of.pop(request_id, request_id)
        left = self._left.get(flight)
        if left is None:
            return flight, (request_id,)
        left.discard(request_id)
        if left:
            return None
        del self._left[flight]
        return flight, (flight, *(r.request_id for r in self._others.get(flight, ())))
