"""vLLM's per-block ``extra_keys`` in its KV events, read into what the router can hash.

vLLM publishes each block's keys untagged, in order: the LoRA name (when the event has
``lora_name``), ``(mm_identifier, offset)`` pairs, the cache salt, prompt-embedding digests
(bytes) -- ``to_event_extra_keys`` in vLLM 0.33, the same shapes since 0.20. A block holding
keys no request can reproduce is *opaque*: the re-blocker does not index it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class BlockKeys:
    """One engine block's ``extra_keys`` entry, read: multimodal ``(identifier, offset in
    the block)`` pairs, a cache salt, and whether it holds keys no request can reproduce."""

    mm: tuple[tuple[str, int], ...] = ()
    salt: str | None = None
    opaque: bool = False


NO_KEYS = BlockKeys()


def read_extra_keys(entry: Any, lora_name: str | None) -> BlockKeys:
    """One block's entry read (module docstring); the event's LoRA name, when it leads the
    entry, is dropped (the root carries it)."""
    if entry is None:
        return NO_KEYS
    if not isinstance(entry, (list, tuple)):
        return BlockKeys(opaque=True)
    items = list(entry)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]  # in the root already
    mm: list[tuple[str, int]] = []
    salt: str | None = None
    for item in items:
        if (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], int)
            and not isinstance(item[1], bool)
        ):
            mm.append((item[0], item[1]))
        elif isinstance(item, str) and salt is None:
            salt = item
        else:
            return BlockKeys(opaque=True)
    return BlockKeys(tuple(mm), salt)
