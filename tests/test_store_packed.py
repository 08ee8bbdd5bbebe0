"""PackedTable / ReplicaState / codec / schema: the byte layout the Redis store keeps."""

from __future__ import annotations

import random

import pytest

from router.core.errors import ConfigError
from router.core.types import AllCleared, BlocksRemoved, BlocksStored, Kind, ReplicaKey, Tier
from router.store.base import BatchChange, LoadChange, LoadSample, ReplicaInfo, ReplicaState
from router.store.codec import decode_change, decode_events, encode_change, encode_events
from router.store.packed import MAX_FILL, PackedTable, parse_records
from router.store.schema import KeySchema


def _table_content(table: PackedTable) -> dict[int, int]:
    hashes, masks = parse_records(table.all_buckets().values())
    return dict(zip(hashes.tolist(), masks.tolist(), strict=True))


def test_packed_table_matches_a_dict_model_through_growth_and_removal() -> None:
    rng = random.Random(7)
    table = PackedTable()
    model: dict[int, int] = {}
    pool = [rng.getrandbits(64) for _ in range(5000)]
    for step in range(30_000):
        block = rng.choice(pool)
        bit = 1 << rng.randrange(3)
        if rng.random() < 0.7:
            assert table.add(block, bit) == (not model.get(block, 0) & bit)
            model[block] = model.get(block, 0) | bit
        else:
            assert table.discard(block, bit) == bool(model.get(block, 0) & bit)
            if block in model:
                model[block] &= ~bit
                if not model[block]:
                    del model[block]
        if step % 1000 == 0:
            table.maybe_grow()
    table.maybe_grow()
    assert _table_content(table) == model
    assert table.count == len(model)
    assert table.bits > 0 and table.count <= MAX_FILL << table.bits
    assert all(table.get(b) == m for b, m in list(model.items())[:200])


def test_take_changes_reports_dirty_buckets_and_deletions() -> None:
    table = PackedTable()
    table.add(5, 1)
    rebuilt, changes = table.take_changes()
    assert not rebuilt and changes == {0: (5).to_bytes(8, "big") + b"\x01"}
    table.discard(5, 1)
    assert table.take_changes() == (False, {0: b""})
    assert table.take_changes() == (False, {})


def test_parse_records_rejects_torn_values() -> None:
    with pytest.raises(ValueError):
        parse_records([b"\x00" * 10])


def test_replica_state_snapshot_events_round_trip() -> None:
    st = ReplicaState(ReplicaKey("r1"))
    st.apply(
        [
            BlocksStored((1, 2, 3)),
            BlocksStored((2, 3), Tier.CPU),
            BlocksStored((3,), kind=Kind.STATE),
            BlocksRemoved((1,)),
        ]
    )
    events = st.snapshot().events()
    assert BlocksStored((2, 3), Tier.GPU) in events
    assert BlocksStored((2, 3), Tier.CPU) in events
    assert BlocksStored((3,), Tier.GPU, Kind.STATE) in events
    st.apply([AllCleared()])
    assert st.snapshot().events() == ()


def test_codec_round_trips_and_rejects_garbage() -> None:
    events = (
        BlocksStored((1, 2**64 - 1), Tier.CPU),
        BlocksRemoved((7,), Tier.GPU, Kind.STATE),
        AllCleared(),
    )
    assert decode_events(encode_events(events)) == events
    change = BatchChange(ReplicaKey("a", 2), 9, events)
    assert decode_change(encode_change(change)) == change
    load = LoadChange(ReplicaKey("a"), LoadSample(1, 2, 0.5, 3.0))
    assert decode_change(encode_change(load)) == load
    for bad in (
        {},
        {b"t": b"B", b"r": b"a", b"d": b"x", b"s": b"1", b"e": b""},
        {b"t": b"B", b"r": b"a", b"d": b"0", b"s": b"1", b"e": b"\xc1"},
        {b"t": b"B", b"r": b"a", b"d": b"0", b"s": b"1", b"e": b"\x91\x94\x00\x09\x00\xc4\x01a"},
        {b"t": b"U", b"r": b"a", b"i": b"{not json"},
        {b"t": b"U", b"r": b"a", b"i": b'{"replica": "bad{name}"}'},
        {b"t": b"Z", b"r": b"a"},
        {b"t": b"L", b"r": b"a", b"d": b"0", b"l": b'{"running": "x"}'},
    ):
        with pytest.raises(ValueError):
            decode_change(bad)


def test_schema_keys_share_a_hash_tag_per_replica() -> None:
    s = KeySchema("kvr", stream_shards=4)
    keys = [s.meta("r1"), s.kv("r1", 0), s.state("r1", 1), s.load("r1"), s.lease("r1")]
    assert all("{r1}" in k for k in keys)
    assert s.shard_of("r1") == s.shard_of("r1") and 0 <= s.shard_of("r1") < 4
    assert len({s.shard_of(f"r{i}") for i in range(100)}) == 4
    with pytest.raises(ConfigError):
        ReplicaInfo("has{brace}")
    with pytest.raises(ConfigError):
        KeySchema("x", stream_shards=0)
