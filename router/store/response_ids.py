"""Which replica holds a stored Responses API response, in Redis: router pods share the ids
they record (router/service/response_share.py) through one key per id.

Key ``<p>:resp:<id>`` (:meth:`~router.store.schema.KeySchema.response`), a STRING written
with ``SET ... PX <ttl>`` (a later record of the id overwrites it and its expiry) and read
with one ``GET``. Its value is :func:`encode_holder`'s: the JSON array ``[model, replica]``
(``["m","r0"]``), or ``[model, replica, owner]`` for a response of a client key (the key's
digest, router/service/stored_responses.py ``owner_of``), at most :data:`MAX_VALUE_BYTES`.
Single-key commands only, so a Redis Cluster serves them as a standalone Redis does (a batch of
writes is a non-transactional pipeline, which the cluster client splits by node). The connection is
the caller's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from router.store.schema import KeySchema

MAX_VALUE_BYTES = 4096


def encode_holder(model: str, replica: str, owner: str = "") -> bytes:
    """The stored value of a response held by ``replica`` of ``model``, made for
    ``owner`` ("": no client key)."""
    value = [model, replica, owner] if owner else [model, replica]
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def decode_holder(raw: bytes) -> tuple[str, str, str]:
    """(model, replica, owner) of a stored value; ValueError for anything else."""
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(f"response holder of {len(raw)} bytes")
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"response holder: {exc}") from None
    if (
        not isinstance(value, list)
        or len(value) not in (2, 3)
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise ValueError(f"response holder: expected [model, replica(, owner)], got {value!r}")
    return value[0], value[1], value[2] if len(value) == 3 else ""


class ResponseIdStore:
    """The Redis commands of the shared response ids over ``client`` (a redis-py asyncio
    client, standalone or cluster; binary replies). ``ttl_s``: how long an id is kept."""

    def __init__(self, client: Any, schema: KeySchema, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.client = client
        self.schema = schema
        self.ttl_ms = max(1, int(ttl_s * 1000))

    async def ping(self) -> None:
        await self.client.ping()

    async def put(self, records: Sequence[tuple[str, str, str, str]]) -> None:
        """Write ``(response id, model, replica, owner)`` records, in one pipeline."""
        if not records:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for response_id, model, replica, owner in records:
                pipe.set(
                    self.schema.response(response_id),
                    encode_holder(model, replica, owner),
                    px=self.ttl_ms,
                )
            await pipe.execute()

    async def get(self, response_id: str) -> tuple[str, str, str] | None:
        """(model, replica, owner) holding ``response_id``; None when Redis has no such id.
        ValueError for a value that is not :func:`encode_holder`'s."""
        raw = await self.client.get(self.schema.response(response_id))
        return None if raw is None else decode_holder(bytes(raw))
