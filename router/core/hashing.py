"""Canonical prefix-block hashing.

``h[i] = xxh3_64(le64(h[i-1]) || le32(tokens of block i), seed)`` with ``h[-1]`` a root
derived from the model name and the optional cache salt / LoRA name. ``h[i]`` names the
whole prefix up to and including block i, so two requests share ``h[i]`` exactly when they
share their first ``(i + 1) * block_size`` tokens (and model, salt, LoRA).

Only full blocks are hashed; the partial tail is reported so callers can count tokens.

Multimodal items (an image's placeholder tokens) change a block's hash the way they change
the engine's: a block in which an item *starts* is hashed on with the item's identifier and
its offset in the block (``mm_block_extras``): ``h'[i] = xxh3_64(le64(h[i]) || extra, seed)``.
Later blocks inherit it through the chain, so a prefix that contains an image matches only a
prefix with the same image at the same place (vLLM keys every block the item overlaps; with
the item's length fixed by its content, keying the block where it starts is equivalent, and
it can be derived from engine events of any block size).

Speed: tokens are laid out once with numpy into a buffer where every block is preceded by
an 8-byte slot for its parent hash; the per-block loop then only writes 8 bytes and hashes a
memoryview slice, with no per-token Python work (``kvrouter bench hash``).
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

HASH_SEED = 0x6B76_726F_7574_6572  # "kvrouter"
_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1
# up to this many blocks ``hash_prompt`` hashes slices of the tokens' bytes, no row layout
SMALL_BLOCKS = 8

TokenIds = Sequence[int] | npt.NDArray[np.integer] | bytes


@dataclass(slots=True, frozen=True)
class HashedPrompt:
    """Block hashes of a prompt plus how many tokens were left over in the partial tail."""

    hashes: list[int]
    block_size: int
    tail_tokens: int

    @property
    def full_tokens(self) -> int:
        return len(self.hashes) * self.block_size


def root_hash(model: str, cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """``h[-1]``: separates hash namespaces of models, cache salts and LoRA adapters."""
    text = f"kvrouter/v1\0{model}\0{cache_salt or ''}\0{lora_name or ''}"
    return xxhash.xxh3_64_intdigest(text.encode("utf-8"), seed=HASH_SEED)


def as_u32_array(tokens: TokenIds) -> npt.NDArray[np.uint32]:
    """Token ids as a little-endian uint32 array (a view when they already are one).

    Raises ValueError for ids outside [0, 2**32).
    """
    if isinstance(tokens, bytes):
        if len(tokens) % 4:
            raise ValueError("token bytes must be a multiple of 4 (little-endian uint32)")
        return np.frombuffer(tokens, dtype="<u4")
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.dtype("<u4"):
            return tokens.astype("<u4", copy=False)
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2**32)")
        return tokens.astype("<u4")
    try:
        # array('I') converts a list in C, faster than numpy, and range-checks each id.
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    out = np.frombuffer(packed, dtype=np.uint32)
    return out if sys.byteorder == "little" else out.byteswap().view("<u4")


def hash_block_tokens(parent: int, tokens: TokenIds, seed: int = HASH_SEED) -> int:
    """Hash of one block given its parent's hash (the reference definition)."""
    body = as_u32_array(tokens).tobytes()
    return xxhash.xxh3_64_intdigest(_U64.pack(parent & _MASK64) + body, seed=seed)


@dataclass(slots=True, frozen=True, order=True)
class MmItem:
    """A multimodal item of a prompt: its placeholder tokens start at token ``start``;
    ``identifier`` is the engine's hash of its content (vLLM ``mm_feature.identifier``)."""

    start: int
    identifier: str


def mm_block_extras(items: Sequence[MmItem], block_size: int) -> dict[int, bytes]:
    """Block index -> the extra key of that block: the items starting in it, by offset."""
    by_block: dict[int, list[MmItem]] = {}
    for item in items:
        if item.start < 0:
            raise ValueError("multimodal item before the prompt start")
        by_block.setdefault(item.start // block_size, []).append(item)
    out: dict[int, bytes] = {}
    for block, found in by_block.items():
        parts = [b"mm"]
        for item in sorted(set(found)):
            ident = item.identifier.encode("utf-8")
            parts.append(struct.pack("<II", item.start - block * block_size, len(ident)) + ident)
        out[block] = b"".join(parts)
    return out


def hash_prompt(
    tokens: TokenIds,
    block_size: int,
    root: int,
    *,
    start: int = 0,
    parent: int | None = None,
    seed: int = HASH_SEED,
    extras: dict[int, bytes] | None = None,
) -> HashedPrompt:
    """Chained hashes of every full block of ``tokens``.

    ``start``/``parent`` continue a chain: blocks are hashed from token ``start`` (a multiple of
    ``block_size``) with ``parent`` as the hash of the block before it; the returned list then
    holds only the new hashes. This is how incremental tokenization avoids rehashing a prefix.
    ``extras``: block index in ``tokens`` -> extra key mixed into that block's hash
    (``mm_block_extras``).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if start % block_size:
        raise ValueError("start must be a multiple of block_size")
    arr = as_u32_array(tokens)
    n_blocks = (len(arr) - start) // block_size if len(arr) > start else 0
    tail = len(arr) - start - n_blocks * block_size if len(arr) > start else 0
    if n_blocks == 0:
        return HashedPrompt([], block_size, tail)
    h = (root if parent is None else parent) & _MASK64
    digest = xxhash.xxh3_64_intdigest
    first = start // block_size
    if n_blocks <= SMALL_BLOCKS:
        # A few blocks (engine events re-blocked one at a time): slicing their bytes costs
        # less than laying out the rows below; the same bytes are hashed.
        body = arr[start : start + n_blocks * block_size].tobytes()
        width = 4 * block_size
        pack = _U64.pack
        small = [0] * n_blocks
        for i in range(n_blocks):
            h = digest(pack(h) + body[i * width : (i + 1) * width], seed)
            if extras:
                extra = extras.get(first + i)
                if extra is not None:
                    h = digest(pack(h) + extra, seed)
            small[i] = h
        return HashedPrompt(small, block_size, tail)
    # Row i = [parent slot (2 x u32)] + block i's tokens; hashing row i hashes le64(parent)||block.
    rows = np.empty((n_blocks, block_size + 2), dtype="<u4")
    rows[:, 2:] = arr[start : start + n_blocks * block_size].reshape(n_blocks, block_size)
    buf = memoryview(rows.reshape(-1).view(np.uint8).data)
    step = 4 * (block_size + 2)
    out = [0] * n_blocks
    pack_into = _U64.pack_into
    if extras:
        for i in range(n_blocks):
            off = i * step
            pack_into(buf, off, h)
            h = digest(buf[off : off + step], seed)
            extra = extras.get(first + i)
            if extra is not None:
                h = digest(_U64.pack(h) + extra, seed)
            out[i] = h
        return HashedPrompt(out, block_size, tail)
    for i in range(n_blocks):
        off = i * step
        pack_into(buf, off, h)
        h = digest(buf[off : off + step], seed)
        out[i] = h
    return HashedPrompt(out, block_size, tail)


def chain_from_block_ids(ids: Sequence[int], root: int, seed: int = HASH_SEED) -> list[int]:
    """Canonical-looking hash chain for traces that name blocks by id (Mooncake ``hash_ids``).

    Each id already names a whole prefix; chaining it with its parent keeps ids of different
    traces or models apart. Used by the simulator when it does not synthesise token content.
    """
    out: list[int] = []
    h = root & _MASK64
    for block_id in ids:
        h = xxhash.xxh3_64_intdigest(_U64.pack(h) + _U64.pack(block_id & _MASK64), seed=seed)
        out.append(h)
    return out


def coarsen_chain(
    hashes: Sequence[int], block_size: int, total_tokens: int, coarse_block: int = 512
) -> list[int]:
    """Hashes naming each ``coarse_block``-token prefix block of a prompt, Mooncake style.

    ``hashes`` is the prompt's chain at ``block_size`` (which must divide ``coarse_block``);
    the hash ending each coarse block already names that whole prefix, so no rehashing is
    needed. Mooncake traces also give the partial last block an id: it is derived from the
    last full fine block before the end and the tail length, so it matches between two
    prompts that agree up to their last full fine block and have the same length.
    Returns ``ceil(total_tokens / coarse_block)`` ids.
    """
    if block_size <= 0 or coarse_block % block_size:
        raise ValueError("block_size must divide coarse_block")
    ratio = coarse_block // block_size
    full = total_tokens // coarse_block
    if len(hashes) < full * ratio:
        raise ValueError("hash chain shorter than total_tokens implies")
    out = [hashes[(k + 1) * ratio - 1] for k in range(full)]
    tail = total_tokens - full * coarse_block
    if tail:
        fine = min(len(hashes), total_tokens // block_size)
        parent = hashes[fine - 1] if fine else 0
        out.append(
            xxhash.xxh3_64_intdigest(_U64.pack(parent) + _U64.pack(tail), seed=~HASH_SEED & _MASK64)
        )
    return out


def coarse_prefix_ids(
    hashes: Sequence[int], block_size: int, total_tokens: int, coarse_block: int = 512
) -> list[int]:
    """:func:`coarsen_chain` at any ``block_size``: exact where ``block_size`` divides
    ``coarse_block``; else each coarse block (ending ``e`` tokens in, the prompt's end for a
    partial last one) is named by the last whole fine block ending at or before ``e`` and the
    tokens from its end to ``e`` (a block ending on a fine boundary: that fine hash). Two
    prompts agreeing on their first ``e`` tokens get the same id, so a turn extending the
    previous one shares every whole coarse block of it; two parting inside a fine block look
    shared up to that block's end at most (less than ``block_size`` tokens more than they
    are; before a first whole fine block, every prompt looks shared). Returns
    ``ceil(total_tokens / coarse_block)`` ids."""
    if block_size > 0 and coarse_block % block_size == 0:
        return coarsen_chain(hashes, block_size, total_tokens, coarse_block)
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if len(hashes) < total_tokens // block_size:
        raise ValueError("hash chain shorter than total_tokens implies")
    out = []
    for k in range(-(-total_tokens // coarse_block)):
        end = min((k + 1) * coarse_block, total_tokens)
        fine, rest = divmod(end, block_size)
        parent = hashes[fine - 1] if fine else 0
        if not rest:
            out.append(parent)
        else:
            out.append(
                xxhash.xxh3_64_intdigest(
                    _U64.pack(parent) + _U64.pack(rest), seed=~HASH_SEED & _MASK64
                )
            )
    return out
