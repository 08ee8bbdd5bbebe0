"""Which replica holds a stored Responses API response (``previous_response_id`` affinity).

vLLM keeps a response (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the API server that
made it: a request naming it as ``previous_response_id``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` only work there. The router learns response id ->
replica from the answers of requests with ``store`` not false (a JSON answer's ``id``, a
stream's ``response.created`` event; ids of at most :data:`MAX_ID_CHARS` characters) and
keeps the most recent :data:`MAX_IDS` (least-recently-used first out), each with the API
key that made it: with client keys, only that key's requests find it. The map is per router
process; a process that does not find an id asks the other worker processes and Redis
(router/service/response_share.py). An id nobody knows is routed as usual (the engine then
answers, 404 when it does not hold the response).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import NamedTuple

MAX_IDS = 100_000
MAX_ID_CHARS = 256  # longer ids are not recorded (nor looked up elsewhere)
# vLLM's JSON answer begins with the response's id (pydantic's field order)
_JSON_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([^"\\]{1,%d})"' % MAX_ID_CHARS)
# the stream's ``response.created`` event: ``data: {"response":{"id":"resp_..."``
_CREATED_ID = re.compile(rb'data: \{"response":\{"id":"([^"\\]{1,%d})"' % MAX_ID_CHARS)


class Holder(NamedTuple):
    """The model and the replica (name) that made a stored response, and whose it is: the
    digest of the API key that asked for it when the router checks client keys, "" when it
    runs open (router/service/stored_responses.py ``owner_of``)."""

    model: str
    replica: str
    owner: str = ""


class ResponseIds:
    """Response id -> :class:`Holder`, bounded (module docstring)."""

    __slots__ = ("_ids", "_max")

    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self._ids: OrderedDict[str, Holder] = OrderedDict()
        self._max = max_ids

    def __len__(self) -> int:
        return len(self._ids)

    def put(self, response_id: str, model: str, replica: str, owner: str = "") -> None:
        self._ids[response_id] = Holder(model, replica, owner)
        self._ids.move_to_end(response_id)
        while len(self._ids) > self._max:
            self._ids.popitem(last=False)

    def get(self, response_id: str) -> Holder | None:
        found = self._ids.get(response_id)
        if found is not None:
            self._ids.move_to_end(response_id)
        return found


def id_of_answer(payload: bytes) -> str | None:
    """The ``id`` of a JSON Responses answer (its first key, as vLLM writes it; else the
    whole body parsed)."""
    found = _JSON_ID.match(payload)
    if found is not None:
        return found.group(1).decode("utf-8", "replace")
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    value = obj.get("id") if isinstance(obj, dict) else None
    return value if _bounded(value) else None


def id_of_stream(chunk: bytes) -> str | None:
    """The response id of a piece of a Responses stream holding its ``response.created``
    event (None when it does not)."""
    if b"response.created" not in chunk:
        return None
    found = _CREATED_ID.search(chunk)
    if found is not None:
        return found.group(1).decode("utf-8", "replace")
    for line in chunk.split(b"\n"):
        if line.startswith(b"data:") and b'"response.created"' in line:
            try:
                obj = json.loads(line[5:])
            except (ValueError, RecursionError):
                return None
            response = obj.get("response") if isinstance(obj, dict) else None
            value = response.get("id") if isinstance(response, dict) else None
            return value if _bounded(value) else None
    return None


def _bounded(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def shareable(response_id: str) -> bool:
    """Whether ``response_id`` may be recorded or looked up in another process: within
    :data:`MAX_ID_CHARS` and valid UTF-8 text (a client's id may hold lone surrogates)."""
    if not 0 < len(response_id) <= MAX_ID_CHARS:
        return False
    try:
        response_id.encode()
    except UnicodeEncodeError:
        return False
    return True
