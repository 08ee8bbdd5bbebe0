"""The mock replica's default event layout is current vLLM's: the batches our encoder writes
hold the same msgpack values as what vLLM 0.33.0's own msgspec structs write for the same
events (msgspec sizes its map headers for the most fields a struct may have, so only the
header widths differ), vLLM's own decoder reads them, and so does every peer that decodes
vLLM's events (vllm-router's ``kv_aware``)."""

from __future__ import annotations

import msgpack
import msgspec

from router.events.decode import decode_payload
from router.events.encode import encode_batch
from router.events.model import (
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
)
from router.mock.server import MockSettings
from tests.engines import load

VLLM = load("vllm-0.33.0")


def _ours() -> EngineBatch:
    return EngineBatch(
        1.25,
        (
            EngineBlockStored((11, 12), None, tuple(range(32)), 16, medium="GPU", group_idx=0),
            EngineBlockStored(
                (13,),
                12,
                tuple(range(16)),
                16,
                lora_id=3,
                medium="CPU",
                lora_name="adapter",
                group_idx=1,
                kv_cache_spec_kind="mamba",
            ),
            EngineBlockRemoved((11,), "GPU", 0),
            EngineBlockRemoved((13,), None),
            EngineAllCleared(),
        ),
        None,
    )


def _theirs(rank: int | None) -> object:
    events = [
        VLLM.BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", None, group_idx=0),
        VLLM.BlockStored(
            [13],
            12,
            list(range(16)),
            16,
            3,
            "CPU",
            "adapter",
            group_idx=1,
            kv_cache_spec_kind="mamba",
        ),
        VLLM.BlockRemoved([11], "GPU", group_idx=0),
        VLLM.BlockRemoved([13], None),
        VLLM.AllBlocksCleared(),
    ]
    if rank is None:
        return VLLM.KVEventBatch(ts=1.25, events=events)
    return VLLM.KVEventBatch(ts=1.25, events=events, data_parallel_rank=rank)


def _values(raw: bytes) -> object:
    return msgpack.unpackb(raw, strict_map_key=False)


def test_our_default_layout_holds_vllms_own_values() -> None:
    ours = _ours()
    assert _values(encode_batch(ours)) == _values(msgspec.msgpack.encode(_theirs(None)))
    ranked = EngineBatch(ours.ts, ours.events, 2)
    assert _values(encode_batch(ranked, "vllm")) == _values(msgspec.msgpack.encode(_theirs(2)))
    # the older layouts are not it
    assert _values(encode_batch(ours, "array")) != _values(encode_batch(ours))


def test_vllms_decoder_reads_ours_and_ours_reads_every_layout() -> None:
    decoded = msgspec.msgpack.decode(encode_batch(_ours()), type=VLLM.KVEventBatch)
    assert [type(e).__name__ for e in decoded.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert decoded.events[1].lora_name == "adapter"
    assert decoded.events[1].kv_cache_spec_kind == "mamba"
    for layout in ("vllm", "array", "map"):
        assert decode_payload(encode_batch(_ours(), layout)).batch == _ours()  # type: ignore[arg-type]


def test_the_mock_publishes_the_current_layout_by_default() -> None:
    assert MockSettings(model="m").encoding == "vllm"
