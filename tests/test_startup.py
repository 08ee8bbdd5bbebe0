"""Start-up of ``kvrouter serve`` and ``kvrouter mock-replica``: the collector is off while a
process imports and builds, and on (with what it built frozen) once it has (router/startup.py)."""

from __future__ import annotations

import gc

import pytest

from router.startup import building


def test_building_turns_the_collector_off_then_on_with_its_objects_frozen() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with building():
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]  # what start-up builds: it lives on
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(kept)


def test_building_turns_the_collector_back_on_when_start_up_fails() -> None:
    with pytest.raises(ValueError), building():
        raise ValueError("refused setting")
    assert gc.isenabled()


def test_building_leaves_a_collector_that_was_off_off() -> None:
    gc.disable()
    try:
        with building():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
