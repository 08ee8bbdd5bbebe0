"""Event decoding against payloads built with msgspec from the engines' event structure
(docs/publisher.md, "Engine events"), in both encodings (positional arrays with trailing
defaults omitted, and maps with a "type" key), at both levels; and a totality check over
malformed payloads."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import msgspec
import pytest

from router.events.decode import decode_payload
from router.events.encode import encode_batch
from router.events.model import (
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
)

Hash = int | bytes


# vLLM's structs (vllm.distributed.kv_events): array_like, tagged, trailing defaults omitted.
class ArrEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(ArrEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(ArrEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(ArrEvent, tag="AllBlocksCleared"):
    pass


class ArrBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# The same structure as maps with a "type" tag.
class MapEvent(msgspec.Struct, omit_defaults=True, tag=True, tag_field="type"):
    pass


class MBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class MAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _sample(arr: bool, hashes_as_bytes: bool) -> tuple[list[Any], EngineBatch]:
    rng = random.Random(3)
    ints = [rng.getrandbits(64) for _ in range(4)]
    wire: list[Hash] = [h.to_bytes(32, "big") for h in ints] if hashes_as_bytes else list(ints)
    tokens = [rng.randrange(100_000) for _ in range(32)]
    S, R, C = (
        (BlockStored, BlockRemoved, AllBlocksCleared)
        if arr
        else (
            MBlockStored,
            MBlockRemoved,
            MAllBlocksCleared,
        )
    )
    events = [
        S(wire[:2], None, tokens, 16),  # old engine: trailing defaults omitted
        S(wire[2:3], wire[1], tokens[:16], 16, None, "CPU", None, None, 1, "mamba"),
        S(
            wire[3:],
            wire[2],
            tokens[:16],
            16,
            7,
            "GPU",
            "adapter",
            [["mm", 1]],
            0,
            "full_attention",
            None,
        ),
        R(wire[3:], "GPU", 0),
        R(wire[:1]),
        C(),
    ]
    expected = EngineBatch(
        1.5,
        (
            EngineBlockStored(tuple(ints[:2]), None, tuple(tokens), 16),
            EngineBlockStored(
                (ints[2],), ints[1], tuple(tokens[:16]), 16, None, "CPU", None, None, 1, "mamba"
            ),
            EngineBlockStored(
                (ints[3],),
                ints[2],
                tuple(tokens[:16]),
                16,
                7,
                "GPU",
                "adapter",
                [["mm", 1]],
                0,
                "full_attention",
                None,
            ),
            EngineBlockRemoved((ints[3],), "GPU", 0),
            EngineBlockRemoved((ints[0],)),
            EngineAllCleared(),
        ),
        2,
    )
    return events, expected


@pytest.mark.parametrize("batch_arr", [True, False], ids=["batch-array", "batch-map"])
@pytest.mark.parametrize("event_arr", [True, False], ids=["events-array", "events-map"])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["int-hashes", "bytes-hashes"])
def test_decodes_msgspec_payloads(batch_arr: bool, event_arr: bool, as_bytes: bool) -> None:
    events, expected = _sample(event_arr, as_bytes)
    batch = (ArrBatch if batch_arr else MapBatch)(1.5, events, 2)
    result = decode_payload(msgspec.msgpack.encode(batch))
    assert result.errors == ()
    assert result.batch == expected


def test_batch_without_rank_and_our_encoder_agree_with_msgspec() -> None:
    events, expected = _sample(True, False)
    payload = msgspec.msgpack.encode(ArrBatch(1.5, events))
    assert decode_payload(payload).batch == EngineBatch(1.5, expected.events, None)
    for encoding in ("array", "map"):
        ours = encode_batch(expected, encoding)  # type: ignore[arg-type]
        assert decode_payload(ours).batch == expected
    # Our array encoding is byte-compatible with msgspec's (what vLLM sends).
    assert encode_batch(EngineBatch(1.5, expected.events, 2), "array") == msgspec.msgpack.encode(
        ArrBatch(1.5, events, 2)
    )


def test_old_engines_positional_arrays_with_trailing_fields_omitted() -> None:
    raw = [2.0, [["BlockStored", [1], None, [5] * 4, 4], ["BlockRemoved", [1]]]]
    result = decode_payload(msgpack.packb(raw))
    assert result.errors == ()
    assert result.batch == EngineBatch(
        2.0, (EngineBlockStored((1,), None, (5,) * 4, 4), EngineBlockRemoved((1,)))
    )


def test_unknown_trailing_fields_are_ignored() -> None:
    raw = [2.0, [["BlockRemoved", [1, 2], "GPU", 0, "future-field"]], 0, "extra"]
    result = decode_payload(msgpack.packb(raw))
    assert result.batch == EngineBatch(2.0, (EngineBlockRemoved((1, 2), "GPU", 0),), 0)


BAD_PAYLOADS = [
    b"",
    b"\xc1",
    b"\x00\x01\x02",
    msgpack.packb(5),
    msgpack.packb("str"),
    msgpack.packb([]),
    msgpack.packb([1.0]),
    msgpack.packb(["ts", []]),
    msgpack.packb([1.0, "events"]),
    msgpack.packb([1.0, [], "rank"]),
    msgpack.packb([1.0, [], -4]),
    msgpack.packb({"ts": 1.0}),
    msgpack.packb({b"\xff\xfe": 1}),
    msgpack.packb([1.0, []]) + b"trailing",
]


@pytest.mark.parametrize("payload", BAD_PAYLOADS)
def test_malformed_payloads_are_reported_not_raised(payload: bytes) -> None:
    result = decode_payload(payload)
    assert result.batch is None and result.errors


BAD_EVENTS = [
    5,
    [],
    {},
    ["Nope"],
    ["BlockStored"],
    ["BlockStored", [1], None, [1, 2], 0],
    ["BlockStored", [1], None, [-1], 1],
    ["BlockStored", [1], None, [2**32], 1],
    ["BlockStored", [1.5], None, [1], 1],
    ["BlockStored", [True], None, [1], 1],
    ["BlockStored", [1], None, "tokens", 1],
    ["BlockStored", [1], None, [1], 1, "lora"],
    ["BlockStored", [1], None, [1], 1, None, 5],
    ["BlockStored", [1], [1], [1], 1],
    ["BlockStored", [b""], None, [1], 1],
    ["BlockStored", [1], None, [1], 1, None, b"\xff"],
    ["BlockRemoved", 7],
    ["BlockRemoved", [1], None, "g"],
    {"type": 3},
    {"type": "BlockRemoved"},
]


def test_malformed_events_are_skipped_and_counted_good_ones_kept() -> None:
    good = ["BlockRemoved", [9]]
    payload = msgpack.packb([1.0, [good, *BAD_EVENTS, good]])
    result = decode_payload(payload)
    assert result.batch is not None
    assert result.batch.events == (EngineBlockRemoved((9,)),) * 2
    assert len(result.errors) == len(BAD_EVENTS)


def test_random_garbage_never_raises() -> None:
    rng = random.Random(11)
    good = msgspec.msgpack.encode(ArrBatch(1.0, _sample(True, False)[0], 0))
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cut = rng.randrange(len(data) + 1)
        decode_payload(bytes(data[:cut]))  # must not raise
        decode_payload(bytes(rng.randrange(256) for _ in range(rng.randrange(40))))


def test_an_unread_event_other_than_a_store_marks_what_came_before_as_unknown() -> None:
    good, bad_store = ["BlockRemoved", [9]], ["BlockStored", [1], None, "tokens", 1]
    assert decode_payload(msgpack.packb([1.0, [good, bad_store, good]])).unknown_until is None
    for bad in (["BlockRemoved", 7], ["Nope"], {"type": 3}, {"type": "BlockRemoved"}, 5):
        result = decode_payload(msgpack.packb([1.0, [bad, good, bad_store, good]]))
        assert result.unknown_until == 0, bad
        result = decode_payload(msgpack.packb([1.0, [good, good, bad, good]]))
        assert result.unknown_until == 2, bad
