"""Approximate prompt hashing for models without a configured tokenizer.

The text is cut into chunks of ``block_size * chars_per_token`` characters and the chunks are
hashed in a chain, like token blocks, in a namespace of their own. Engines never publish
these hashes, so an approximate model routes on the router's own *speculative* entries
(what it sent where, kept for the speculative TTL): session affinity and shared system
prompts still work, engine evictions are not seen. ``/ready`` and the metrics say so.
"""

from __future__ import annotations

import xxhash

from router.core.hashing import HASH_SEED, root_hash

DEFAULT_CHARS_PER_TOKEN = 4.0


def approx_root(model: str, cache_salt: str | None = None, lora: str | None = None) -> int:
    """The root of approximate hashes: apart from exact ones, and per adapter (``lora``)."""
    kind = "\0approximate" if lora is None else f"\0approximate\0{lora}"
    return root_hash(model, cache_salt, kind)


def approx_tokens(text: str, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> int:
    """Estimated token count of ``text``."""
    return -(-len(text) // max(1, round(chars_per_token))) if text else 0


def approx_hashes(
    text: str, block_size: int, root: int, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> list[int]:
    """Chained hashes of the full ``block_size``-token (estimated) chunks of ``text``."""
    chunk = max(1, round(block_size * chars_per_token))
    data = text.encode("utf-8", "surrogatepass")
    out = []
    h = root
    digest = xxhash.xxh3_64_intdigest
    for off in range(0, len(data) - chunk + 1, chunk):
        h = digest(h.to_bytes(8, "little") + data[off : off + chunk], HASH_SEED)
        out.append(h)
    return out
