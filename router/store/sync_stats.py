"""``SyncStats``: what an ``IndexSync`` (router/store/sync.py) has done, as counts that only
grow; the service exports some of them (router/service/background.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SyncStats:
    bootstraps: int = 0
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    resyncs: int = 0
    purges: int = 0
    malformed: int = 0
    errors: int = 0
    entries_loaded: int = 0
    stale: int = 0  # keys found behind (or ahead of) a store that stood still: resynced
    kept_on_data_loss: int = 0  # replicas kept through a store's data loss (grace)
    downs_ignored: int = 0  # ReplicaDown entries of a replica whose lease lives: ignored
    orphans_reaped: int = 0  # replicas whose state outlived them, deleted by the sweep
    streams_reset: int = 0  # change streams found behind the cursor (lost): re-bootstrapped
    unreadable: int = 0  # snapshot reads of registered keys whose state did not parse
    loads_stale: int = 0  # load entries older than the key's last, or than load_max_age_s
