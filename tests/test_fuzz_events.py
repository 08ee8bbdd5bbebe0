"""Fuzzing the engine-event path: decoder -> re-blocker -> prefix index; nothing may raise.

Inputs (hypothesis): raw bytes; msgpack documents shaped like ``KVEventBatch`` (array and
map encodings, at both levels) whose fields hold arbitrary msgpack values (huge and
negative ints, bytes, strings, floats, nested containers, NaN); and valid payloads with
bytes flipped, inserted or cut. Each input goes through ``EngineIngest.handle_payload``, the
publisher's and the direct router's entry point, which feeds a real ``PrefixIndex``; the
ingest is shared across examples so re-blocker state accumulates as in a long-lived process.

Default run: ~4,300 inputs. ``pytest -m soak tests/test_fuzz_events.py``: >= 100,000.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.index import PrefixIndex
from router.core.types import EventBatch, IndexEvent, ReplicaKey
from router.events.decode import decode_payload
from router.events.encode import encode_batch
from router.events.ingest import EngineIngest
from router.events.model import (
    DecodeResult,
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
)

# Hypothesis examples per strategy (3 strategies) and seeded grammar-fuzzer inputs. Hypothesis
# draws the structured documents slowly (~15 ms each), so volume comes from the grammar fuzzer,
# which produces the same shapes from a seeded random.Random.
SHORT = (60, 2000)  # default run: ~2,200 inputs (the soak run: SOAK)
SOAK = (4000, 90_000)  # -m soak: ~102,000 inputs

TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", ""]
FIELDS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "ts",
    "events",
    "data_parallel_rank",
]

ints = st.one_of(
    st.integers(-5, 70),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, 16, 64, 2**31, 2**63 - 1, 2**64 - 1, -1]),
)
scalars = st.one_of(
    ints,
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=12),
    st.text(max_size=12),
    st.sampled_from(TAGS + ["GPU", "CPU", "cpu", "mamba", "full_attention", "kda"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5)
    ),
    max_leaves=24,
)
hash_lists = st.lists(st.one_of(ints, st.binary(min_size=1, max_size=9)), max_size=6)
token_lists = st.lists(st.integers(0, 2**32), max_size=80)


@st.composite
def events(draw: Any) -> Any:
    tag = draw(st.sampled_from(TAGS))
    fields: list[Any] = [
        draw(st.one_of(hash_lists, values)),
        draw(st.one_of(ints, st.none(), values)),
        draw(st.one_of(token_lists, values)),
        draw(st.one_of(st.integers(-2, 70), values)),
    ]
    fields += draw(st.lists(values, max_size=8))
    if draw(st.booleans()):
        return [tag, *fields[: draw(st.integers(0, len(fields)))]]
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", *FIELDS[5:12]]
    out = {"type": tag}
    for name, value in zip(names, fields, strict=False):
        if draw(st.booleans()):
            out[name] = value
    return out


@st.composite
def batches(draw: Any) -> bytes:
    evs = draw(st.lists(st.one_of(events(), values), max_size=6))
    ts = draw(st.one_of(st.floats(0, 2e9), values))
    rank = draw(st.one_of(st.none(), st.integers(-3, 70000), values))
    if draw(st.booleans()):
        doc: Any = [ts, evs, rank][: draw(st.integers(0, 3))] + draw(st.lists(values, max_size=2))
    else:
        doc = {"ts": ts, "events": evs, "data_parallel_rank": rank}
    try:
        return msgpack.packb(doc, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return msgpack.packb([ts if isinstance(ts, float) else 0.0, []])


def _valid_payload(seed: int, encoding: str) -> bytes:
    rng = random.Random(seed)
    tokens = tuple(rng.randrange(50_000) for _ in range(64))
    evs: tuple[Any, ...] = (
        EngineBlockStored((1, 2, 3, 4), None, tokens, 16),
        EngineBlockRemoved((2,)),
        EngineAllCleared(),
        EngineBlockStored((7,), 4, tokens[:16], 16, medium="CPU"),
    )
    if seed % 2:  # full, recurrent-state and sliding-window groups (checkpoints in both)
        window = EngineBlockStored(
            (1, 2, 3, 4), None, tokens, 16, group_idx=2,
            kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=33,
        )  # fmt: skip
        mixed = (
            EngineBlockStored((2, 4), None, tokens, 16, group_idx=1, kv_cache_spec_kind="mamba"),
            window,
            EngineBlockRemoved((3,), group_idx=2),
        )
        evs = evs[:1] + mixed + evs[1:]
    return encode_batch(EngineBatch(1.0, evs, rng.choice([None, 0, 1])), encoding)  # type: ignore[arg-type]


@st.composite
def mutated(draw: Any) -> bytes:
    data = bytearray(
        _valid_payload(draw(st.integers(0, 5)), draw(st.sampled_from(["array", "map"])))
    )
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 3))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == 0 and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == 1:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == 2:
            del data[pos:]
        else:
            del data[pos : pos + draw(st.integers(1, 8))]
    return bytes(data)


def _rand_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 3 and r < 0.12:
        return [_rand_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    if depth < 3 and r < 0.2:
        return {rng.choice(FIELDS): _rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return rng.choice(
        [
            lambda: rng.randint(-5, 70),
            lambda: rng.randint(-(2**63), 2**64 - 1),
            lambda: None,
            lambda: rng.random() < 0.5,
            lambda: rng.choice([float("nan"), float("inf"), -1.5, 0.0, 1e300]),
            lambda: rng.randbytes(rng.randint(0, 12)),
            lambda: "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 8))),
            lambda: rng.choice(TAGS + ["GPU", "CPU", "mamba", "full_attention", "kda"]),
        ]
    )()


def random_payload(rng: random.Random) -> bytes:
    """A seeded grammar fuzzer: the shapes of :func:`batches` without hypothesis's cost."""
    evs: list[Any] = []
    for _ in range(rng.randint(0, 6)):
        if rng.random() < 0.15:
            evs.append(_rand_value(rng))
            continue
        tag = rng.choice(TAGS)
        hashes = [
            rng.choice([rng.randint(-(2**63), 2**64 - 1), rng.randint(0, 50), rng.randbytes(8)])
            for _ in range(rng.randint(0, 6))
        ]
        tokens = [rng.randint(0, 2**32) for _ in range(rng.choice([0, 16, 32, 17, 64, 5]))]
        fields: list[Any] = [
            hashes if rng.random() < 0.8 else _rand_value(rng),
            rng.choice([None, rng.randint(-1, 2**64 - 1), _rand_value(rng)]),
            tokens if rng.random() < 0.8 else _rand_value(rng),
            rng.choice([16, 8, 32, 0, -1, 17, _rand_value(rng)]),
        ]
        fields += [_rand_value(rng) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.3:  # well-formed groups: several state-like ones mixed, of
            # every kind (windows of several sizes, recurrent state), so some engines have both
            group = rng.choice([0, 1, 1, 2, 3])
            kind = rng.choice(
                ["sliding_window", "sliding_window_mla", "full_attention", "mamba", "kda"]
            )
            window = rng.choice([1, 16, 33, 128, None, -4])
            fields = [*fields[:4], None, "GPU", None, None, group, kind, window]
        if rng.random() < 0.5:
            evs.append([tag, *fields[: rng.randint(0, len(fields))]])
        else:
            names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", *FIELDS[5:12]]
            ev = {"type": tag}
            ev.update({n: v for n, v in zip(names, fields, strict=False) if rng.random() < 0.7})
            evs.append(ev)
    ts = rng.choice([1.0, rng.random() * 2e9, _rand_value(rng)])
    rank = rng.choice([None, 0, 1, rng.randint(-3, 70_000), _rand_value(rng)])
    doc: Any = (
        [ts, evs, rank][: rng.randint(0, 3)]
        if rng.random() < 0.5
        else {"ts": ts, "events": evs, "data_parallel_rank": rank}
    )
    try:
        data = msgpack.packb(doc, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        data = msgpack.packb([1.0, []])
    if rng.random() < 0.2:  # and some byte-level damage on top
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            if buf:
                buf[rng.randrange(len(buf))] = rng.randrange(256)
        data = bytes(buf[: rng.randint(0, len(buf))] if rng.random() < 0.3 else buf)
    return data


class Harness:
    """One long-lived ingest into a real index; records what reached the index."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.applied = 0
        self.ingest = EngineIngest("fuzz", "m", 16, self._sink)

    def _sink(self, key: ReplicaKey, evs: list[IndexEvent]) -> None:
        self.index.add_replica(key)
        self.index.apply(EventBatch(key, tuple(evs)))
        if self.index.garbage_ratio() > 1.0:
            self.index.compact()
        self.applied += len(evs)

    def feed(self, payload: bytes) -> DecodeResult:
        result = decode_payload(payload)
        assert isinstance(result, DecodeResult)
        if result.batch is not None:
            for ev in result.batch.events:
                assert isinstance(ev, (EngineBlockStored, EngineBlockRemoved, EngineAllCleared))
        self.ingest.handle_payload(payload, source="fuzz")
        return result


def _run(budget: tuple[int, int]) -> Harness:
    examples, grammar = budget
    logging.getLogger("router.events").setLevel(logging.ERROR)  # malformed input is expected
    h = Harness()
    common = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @common
    @given(st.binary(max_size=300))
    def raw(payload: bytes) -> None:
        h.feed(payload)

    @common
    @given(batches())
    def structured(payload: bytes) -> None:
        h.feed(payload)

    @common
    @given(mutated())
    def flipped(payload: bytes) -> None:
        h.feed(payload)

    raw()
    structured()
    flipped()
    rng = random.Random(20241129)
    for _ in range(grammar):
        h.feed(random_payload(rng))
    return h


def test_valid_payloads_still_decode() -> None:
    for enc in ("array", "map"):
        result = decode_payload(_valid_payload(0, enc))
        assert result.batch is not None and not result.errors
        assert len(result.batch.events) == 4


def test_fuzz_event_path_never_raises() -> None:
    h = _run(SHORT)
    assert h.ingest.stats.payloads >= 2000
    # the structured strategy reaches the index, not only the error paths
    assert h.ingest.stats.malformed_payloads < h.ingest.stats.payloads
    assert h.applied > 0
    h.index.stats()  # the index is still consistent enough to report


@pytest.mark.soak
@pytest.mark.timeout(600)  # ~90 s on an idle 2-core machine: the default 120 s is no bound
def test_soak_fuzz_event_path_100k() -> None:
    h = _run(SOAK)
    print({"payloads": h.ingest.stats.payloads, "malformed": h.ingest.stats.malformed_payloads})
    assert h.ingest.stats.payloads >= 100_000
