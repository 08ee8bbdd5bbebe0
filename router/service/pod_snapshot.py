"""A pods-exchange snapshot on the wire (router/service/pod_exchange.py sends and reads them).

A snapshot is one member's (``<pod>/<pid>``) own requests in flight per replica: the
:class:`~router.core.load.PeerLoad` rows of ``/internal/load``, as one JSON object with the
member (``m``), its pod (``p``), its sequence number (``s``, growing with every snapshot it
sends) and its pod instance (``n``). It also carries the member's speculative index entries
and session bindings made since its previous one, and its withdrawals of those its replicas
refused (router/service/pod_share.py: same message, ``x`` / ``i`` / ``w`` fields).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.core.load import LoadTracker, PeerLoad
from router.core.types import ReplicaKey
from router.service.load_share import own_load, parse_load
from router.service.pod_share import FIELDS
from router.service.workers import Workers


@dataclass(slots=True, frozen=True)
class Snapshot:
    """One member's own load at one moment (``seq`` grows with every snapshot it sends)."""

    member: str
    pod: str
    seq: int
    load: dict[ReplicaKey, PeerLoad]
    # the message's shared fields (router/service/pod_share.py FIELDS: rows, their ids,
    # withdrawals), unchecked; None: none
    shared: dict[str, object] | None = None
    # the sender's pod instance (``n``: shared by the worker processes of one pod, new at
    # every start); None: a sender that does not say (an earlier version)
    instance: str | None = None

    @property
    def sender(self) -> str:
        """Who sent it: its member, and its pod instance when it names one. Two pods
        configured with one ``pod_name`` may send as the same member (the same pids): every
        other pod counts each of them, not whichever spoke last."""
        return self.member if self.instance is None else f"{self.member}#{self.instance}"


def encode(
    member: str,
    pod: str,
    seq: int,
    load: LoadTracker,
    shared: Mapping[str, Any] | None = None,
    instance: str | None = None,
) -> bytes:
    """A snapshot: ``shared`` is ``Outbox.take``'s fields (router/service/pod_share.py),
    ``instance`` the sender's pod instance (:func:`pod_instance`)."""
    body: dict[str, Any] = own_load(load)
    body.update(m=member, p=pod, s=seq)
    if instance is not None:
        body["n"] = instance
    if shared:
        body.update(shared)
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes) -> Snapshot:
    """A snapshot from Redis; raises ValueError for anything else."""
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("expected an object")
    member, pod, seq = doc.get("m"), doc.get("p"), doc.get("s")
    if not isinstance(member, str) or not isinstance(pod, str) or type(seq) is not int:
        raise ValueError("snapshot without m / p / s")
    shared = {k: doc[k] for k in FIELDS if k in doc}
    instance = doc.get("n")
    if instance is not None and not isinstance(instance, str):
        raise ValueError("snapshot with a non-string n")
    return Snapshot(member, pod, seq, parse_load(data), shared or None, instance)


def pod_instance(workers: Workers | None) -> str:
    """This pod's instance: the same for all its worker processes (derived from their
    private control directory, random per start), random per process without workers. A
    member's name (``<pod>/<pid>``) alone does not tell a namesake pod apart: two containers
    of one image number their processes alike."""
    if workers is None:
        return os.urandom(8).hex()
    return hashlib.blake2b(workers.directory.encode(), digest_size=8).hexdigest()
