"""Prefill/decode disaggregation in the simulator: which replica plays which role, where it
sits, and the run's transfer figures. The decision itself is router/core/disagg.py's, the
same code the service runs; sim/cluster.py moves the legs between engines.

Roles (``--pd``, ``--prefill-share F``): in each rack the first ``round(F x replicas of the
rack)`` replicas (at least one when F > 0) are ``prefill``; the others are ``decode`` under
``always`` and ``both`` under ``auto`` (so ``auto`` can keep a request local); under ``off``
every replica is ``both`` and nothing is disaggregated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.core.disagg import Link, Role, Site, TransferSizes
from router.core.types import ReplicaKey


def sites_of(keys: Sequence[ReplicaKey]) -> dict[ReplicaKey, Site]:
    """Sites from the simulator's replica names ``reg{g}-rack{k}-r{i}``."""
    out = {}
    for k in keys:
        region, rack, _ = k.replica.split("-", 2)
        out[k] = Site(region, f"{region}-{rack}")
    return out


def roles_of(
    keys: Sequence[ReplicaKey], sites: dict[ReplicaKey, Site], mode: str, share: float
) -> dict[ReplicaKey, Role]:
    """Roles by rack (module doc)."""
    if mode == "off" or share <= 0:
        return dict.fromkeys(keys, Role.BOTH)
    rest = Role.DECODE if mode == "always" else Role.BOTH
    by_rack: dict[Site, list[ReplicaKey]] = {}
    for k in keys:
        by_rack.setdefault(sites[k], []).append(k)
    out: dict[ReplicaKey, Role] = {}
    for members in by_rack.values():
        n = min(len(members) - 1, max(1, round(share * len(members))))
        if n <= 0:  # a rack of one: it does both
            out.update(dict.fromkeys(members, Role.BOTH))
            continue
        for i, k in enumerate(members):
            out[k] = Role.PREFILL if i < n else rest
    return out


def sizes_of(kv_bytes_per_token: float, state_bytes: float) -> TransferSizes:
    return TransferSizes(kv_bytes_per_token, state_bytes)


@dataclass(slots=True)
class PdStats:
    """Counts of one run: requests disaggregated, bytes moved by link, prefill fallbacks.
    ``transfers``: the disaggregated requests whose prefill leg ended and moved its bytes (a
    fallback moves none); ``transfer_ms_mean`` is over them."""

    requests: int = 0
    remote: int = 0
    fallbacks: int = 0
    transfers: int = 0
    bytes_total: float = 0.0
    bytes_cross_rack: float = 0.0
    transfer_s: float = 0.0

    def moved(self, link: Link, nbytes: float, seconds: float) -> None:
        self.transfers += 1
        self.bytes_total += nbytes
        if link in (Link.NETWORK, Link.REGION):
            self.bytes_cross_rack += nbytes
        self.transfer_s += seconds

    def summary(self) -> dict[str, object]:
        return {
            "pd_share": round(self.remote / self.requests, 5) if self.requests else 0.0,
            "cross_rack_transfer_share": (
                round(self.bytes_cross_rack / self.bytes_total, 5) if self.bytes_total else 0.0
            ),
            "transfer_gb": round(self.bytes_total / 1e9, 3),
            "transfer_ms_mean": (
                round(1000 * self.transfer_s / self.transfers, 3) if self.transfers else 0.0
            ),
            "pd_fallbacks": self.fallbacks,
        }
