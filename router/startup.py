"""Start-up of a long-running process (``kvrouter serve``, its workers, ``kvrouter
mock-replica``): the cyclic garbage collector is off while it imports its modules and builds
its application, and what that built is frozen out of later collections.

Start-up allocates some 60 000 objects that live as long as the process (modules, classes,
functions, settings, tables) and almost no cyclic garbage (a few hundred objects): the
collections those allocations trigger, a full one among them, walk every one of those objects
to find nothing, about a tenth of the CPU a process takes to answer /health. The collector
runs again once the process is built, over what it allocates from then on."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def building() -> Iterator[None]:
    """The block builds what lives as long as the process, with the collector off. When it
    ends normally, everything allocated so far is frozen (``gc.freeze``: never examined by a
    collection, never freed); however it ends, the collector is on again if it was on before.
    A fork after the block leaves the children's copies of those objects untouched by their
    collectors too (the pages stay shared)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
