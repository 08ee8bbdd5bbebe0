"""Hash-changing keys, engine side against router side: extra keys derived by vLLM 0.33's own
``generate_block_hash_extra_keys`` / ``to_event_extra_keys`` and SGLang's ``cache_salt``, in
events encoded by the engines' own classes, re-blocked by the publisher's ``Reblocker``, must
give exactly the canonical hashes the router computes for the same request: salted blocks
match only the salt, image blocks only the image at that place."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from router.core.hashing import MmItem, hash_prompt, mm_block_extras, root_hash
from router.core.types import BlocksStored, Kind
from router.events.decode import decode_payload
from router.events.extra_keys import read_extra_keys
from router.events.model import IGNORED_KINDS, KV_KINDS, STATE_KINDS, WINDOW_KINDS
from router.events.reblock import Reblocker
from router.tokenize.pipeline import PromptProcessor
from tests.engines import load, load_file

MODEL = "m"
BE = 16  # engine block


def _request(
    n_tokens: int, mm: list[tuple[str, int, int]], salt: str | None, lora: str | None = None
) -> Any:
    """What vLLM's key derivation reads from a ``Request``."""
    features = [
        SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=off, length=length))
        for ident, off, length in mm
    ]
    lora_request = None if lora is None else SimpleNamespace(lora_name=lora, lora_path="/l")
    return SimpleNamespace(
        mm_features=features,
        lora_request=lora_request,
        cache_salt=salt,
        prompt_embeds=None,
        num_tokens=n_tokens,
    )


def vllm_event_keys(n_tokens: int, mm: list[tuple[str, int, int]], salt: str | None) -> Any:
    """Per-block event ``extra_keys`` as vLLM 0.33's block pool derives them."""
    utils = load_file("vllm_0_33_0_kv_cache_utils.py")
    req = _request(n_tokens, mm, salt)
    keys, mm_idx = [], 0
    for start in range(0, n_tokens - n_tokens % BE, BE):
        k, mm_idx = utils.generate_block_hash_extra_keys(req, start, start + BE, mm_idx)
        keys.append(k)
    return utils.to_event_extra_keys(keys)


def _payload(engine: str, **stored: Any) -> bytes:
    mod = load(engine)
    if engine.startswith("vllm"):
        stored.setdefault("lora_name", None)
    batch = mod.KVEventBatch(ts=1.0, events=[mod.BlockStored(**stored)])
    return msgspec.msgpack.encode(batch)


def reblocked(
    engine: str, tokens: list[int], block_size: int, chunks: list[int], **fields: Any
) -> list[int]:
    """Canonical KV hashes the publisher derives from the engine storing ``tokens`` in events
    of ``chunks`` engine blocks each (engine hashes stand-ins, chained)."""
    rb = Reblocker(block_size, MODEL)
    extra = fields.pop("extra_keys", None)
    out: list[int] = []
    first = 0
    for size in chunks:
        last = first + size
        stored = {
            "block_hashes": [
                hash(tuple(tokens[: (i + 1) * BE])) & (2**62 - 1) for i in range(first, last)
            ],
            "parent_block_hash": hash(tuple(tokens[: first * BE])) & (2**62 - 1) if first else None,
            "token_ids": tokens[first * BE : last * BE],
            "block_size": BE,
            "lora_id": None,
            "medium": "GPU",
            **fields,
        }
        if extra is not None:
            stored["extra_keys"] = extra[first:last]
        result = decode_payload(_payload(engine, **stored))
        assert result.batch is not None and not result.errors
        for ev in rb.convert(result.batch.events):
            assert isinstance(ev, BlocksStored) and ev.kind is Kind.KV
            out.extend(ev.hashes)
        first = last
    assert rb.stats.bad_event == 0 and rb.stats.opaque_blocks == 0
    return out


def router_side(
    tokens: list[int], block_size: int, salt: str | None = None, mm: list[MmItem] | None = None
) -> list[int]:
    extras = mm_block_extras(mm, block_size) if mm else None
    return hash_prompt(tokens, block_size, root_hash(MODEL, salt), extras=extras).hashes


TOKENS = list(range(1000, 1000 + 12 * BE))  # 12 engine blocks


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("chunks", [[12], [1, 3, 2, 6], [5, 7]])
def test_vllm_salt_and_images_match_the_router_exactly(block_size: int, chunks: list[int]) -> None:
    images = [("img-a" * 8, 20, 40), ("img-b" * 8, 70, 9)]  # 40 tokens from 20, 9 from 70
    extra = vllm_event_keys(len(TOKENS), images, "tenant-1")
    got = reblocked("vllm-0.33.0", TOKENS, block_size, chunks, extra_keys=extra)
    mm = [MmItem(20, "img-a" * 8), MmItem(70, "img-b" * 8)]
    assert got == router_side(TOKENS, block_size, "tenant-1", mm)
    # the same tokens without the salt, without the images, with another image: no match
    # beyond the blocks before what differs
    first_image_block = 20 // block_size
    plain = router_side(TOKENS, block_size, "tenant-1")
    assert got[:first_image_block] == plain[:first_image_block]
    assert got[first_image_block] != plain[first_image_block]
    other = router_side(TOKENS, block_size, "tenant-1", [MmItem(20, "img-c"), mm[1]])
    assert got[first_image_block] != other[first_image_block]
    moved = router_side(TOKENS, block_size, "tenant-1", [MmItem(21, mm[0].identifier), mm[1]])
    assert got[first_image_block] != moved[first_image_block]
    assert not set(got) & set(router_side(TOKENS, block_size, None, mm))


def test_vllm_salt_only_keys_the_first_block_and_roots_the_chain() -> None:
    extra = vllm_event_keys(len(TOKENS), [], "s")
    assert extra[0] == ("s",) and all(k is None for k in extra[1:])
    got = reblocked("vllm-0.33.0", TOKENS, 32, [4, 8], extra_keys=extra)
    assert got == router_side(TOKENS, 32, "s")
    unsalted = reblocked("vllm-0.33.0", TOKENS, 32, [12])
    assert unsalted == router_side(TOKENS, 32)
    assert not set(got) & set(unsalted)


def test_the_router_pipeline_hashes_a_salted_request_as_the_publisher_does() -> None:
    proc = PromptProcessor(MODEL, 32)
    body = {"prompt": TOKENS, "cache_salt": "tenant-9"}
    extra = vllm_event_keys(len(TOKENS), [], "tenant-9")
    assert proc.completion(body).block_hashes == reblocked(
        "vllm-0.33.0", TOKENS, 32, [12], extra_keys=extra
    )
    assert proc.completion({"prompt": TOKENS}).block_hashes == reblocked(
        "vllm-0.33.0", TOKENS, 32, [12]
    )


@pytest.mark.parametrize("engine", ["sglang-0.5.21", "sglang-0.5.23"])
def test_sglang_cache_salt_roots_the_chain(engine: str) -> None:
    got = reblocked(engine, TOKENS, 32, [3, 9], cache_salt="tenant-2")
    assert got == router_side(TOKENS, 32, "tenant-2")
    assert (
        got
        == PromptProcessor(MODEL, 32)
        .completion({"prompt": TOKENS, "cache_salt": "tenant-2"})
        .block_hashes
    )


def test_lora_name_in_extra_keys_is_the_root_not_a_key() -> None:
    utils = load_file("vllm_0_33_0_kv_cache_utils.py")
    req = _request(len(TOKENS), [], None, lora="ad1")
    keys = [utils.generate_block_hash_extra_keys(req, s, s + BE, 0)[0] for s in range(0, 64, BE)]
    event_keys = utils.to_event_extra_keys(keys)
    assert (
        read_extra_keys(event_keys[0], "ad1").mm == ()
        and not read_extra_keys(event_keys[0], "ad1").opaque
    )
    got = reblocked("vllm-0.33.0", TOKENS[:64], 32, [4], extra_keys=event_keys, lora_name="ad1")
    assert got == hash_prompt(TOKENS[:64], 32, root_hash(MODEL, None, "ad1")).hashes


def test_prompt_embedding_digests_are_not_indexed() -> None:
    rb = Reblocker(16, MODEL)
    payload = _payload(
        "vllm-0.33.0",
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=TOKENS[:32],
        block_size=16,
        lora_id=None,
        medium="GPU",
        extra_keys=[None, (b"\x01" * 32,)],
    )
    result = decode_payload(payload)
    assert result.batch is not None
    events = rb.convert(result.batch.events)
    assert [e.hashes for e in events if isinstance(e, BlocksStored)] == [
        tuple(router_side(TOKENS[:16], 16))
    ]
    assert rb.stats.opaque_blocks == 1


def test_every_vllm_kv_cache_spec_kind_is_classified() -> None:
    # vllm/v1/kv_cache_interface.py KVCacheSpecKind (0.33.0)
    kinds = {
        "full_attention": "kv",
        "mla_attention": "kv",
        "sink_full_attention": "kv",
        "mamba": "state",
        "sliding_window": "window",
        "sliding_window_mla": "window",
        "chunked_local_attention": "ignored",
        "encoder_only_attention": "ignored",
        "cross_attention": "ignored",
        "unknown": "ignored",
    }
    for kind, meaning in kinds.items():
        found = {"kv": kind in KV_KINDS, "state": kind in STATE_KINDS}
        found["window"] = kind in WINDOW_KINDS
        found["ignored"] = kind in IGNORED_KINDS
        assert [m for m, yes in found.items() if yes] == [meaning], kind


def test_sink_full_attention_only_model_is_indexed_and_unknown_kinds_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rb = Reblocker(16, MODEL)
    payload = _payload(
        "vllm-0.33.0",
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=TOKENS[:32],
        block_size=16,
        lora_id=None,
        medium="GPU",
        kv_cache_spec_kind="sink_full_attention",
    )
    result = decode_payload(payload)
    assert result.batch is not None
    (event,) = rb.convert(result.batch.events)
    assert isinstance(event, BlocksStored) and event.hashes == tuple(router_side(TOKENS[:32], 16))
    odd = _payload(
        "vllm-0.33.0",
        block_hashes=[9],
        parent_block_hash=None,
        token_ids=TOKENS[:16],
        block_size=16,
        lora_id=None,
        medium="GPU",
        kv_cache_spec_kind="new_kind_from_the_future",
    )
    for _ in range(3):
        batch = decode_payload(odd).batch
        assert batch is not None and rb.convert(batch.events) == []
    assert sum("new_kind_from_the_future" in r.message for r in caplog.records) == 1


def _cache_full_blocks(
    tokens: list[int],
    be: int,
    num_cached: int,
    num_full: int,
    kept: set[int],
    group: int,
    kind: str,
) -> Any:
    """The BlockStored of vLLM 0.34's ``BlockPool.cache_full_blocks`` for one group: hashes
    (and extra keys) of the kept blocks only (null and masked blocks skipped: mamba "align"
    mode keeps a checkpoint only where a chunk ended), token ids of the whole range."""
    mod = load("vllm-0.33.0")  # 0.34's kv_events.py is byte-identical (tests/engines/README.md)
    hashes = [hash(tuple(tokens[: (i + 1) * be])) & (2**62 - 1) for i in range(num_full)]
    return mod.BlockStored(
        block_hashes=[hashes[i] for i in range(num_cached, num_full) if i in kept],
        parent_block_hash=hashes[num_cached - 1] if num_cached else None,
        token_ids=tokens[num_cached * be : num_full * be],
        block_size=be,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )  # fmt: skip


@pytest.mark.parametrize("state_first", [False, True])
def test_vllm_034_sparse_state_checkpoints_are_indexed_where_they_are(state_first: bool) -> None:
    """vLLM 0.34's hybrid (full attention + mamba "align") events list only the checkpoints
    kept, with the tokens of the whole range: a 2,100-token prompt of 1,024-token engine
    blocks stores attention blocks 0-1 and a checkpoint at 2,048 only. The router indexes that
    checkpoint (it rejected the event: no state past the first block ever reached the index)
    and predicts vLLM's hit: 2,048 usable tokens for an extension, none for a branch before
    the checkpoint. The mamba event may come first in the batch."""
    from router.core.index import PrefixIndex
    from router.core.types import EventBatch, ReplicaKey

    be, br = 1024, 64
    tokens = [(7 * i) % 50_000 + 1 for i in range(2100)]
    kv = _cache_full_blocks(tokens, be, 0, 2, {0, 1}, 0, "full_attention")
    state = _cache_full_blocks(tokens, be, 0, 2, {1}, 1, "mamba")
    mod = load("vllm-0.33.0")
    events = [state, kv] if state_first else [kv, state]
    result = decode_payload(msgspec.msgpack.encode(mod.KVEventBatch(ts=1.0, events=events)))
    assert result.batch is not None and not result.errors
    rb = Reblocker(br, MODEL)
    out = rb.convert(result.batch.events)
    assert rb.stats.bad_event == 0 and rb.stats.unmapped_offload == 0
    index = PrefixIndex()
    key = ReplicaKey("r0")
    index.apply(EventBatch(key, tuple(out)))
    extension = hash_prompt(tokens + [9] * 900, br, root_hash(MODEL)).hashes
    hit = index.match(extension, hybrid=True).get(key)
    assert hit is not None and hit.kv_blocks == 2048 // br and hit.usable_blocks == 2048 // br
    branch = hash_prompt(tokens[:1500] + [3] * 500, br, root_hash(MODEL)).hashes
    early = index.match(branch, hybrid=True).get(key)
    assert early is not None and early.usable_blocks == 0 and early.kv_blocks == 1500 // br
