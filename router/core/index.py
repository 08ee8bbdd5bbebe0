"""The prefix index: which replica caches which prefix blocks, and how much of a request's
prefix each replica can actually reuse.

Its storage is router/core/index_tables.py (the layout), its updates
router/core/index_updates.py; this module answers lookups.

Lookup: with one dict probe we learn *all* replicas holding a depth, so the query bisects
over depth on bitmasks: replicas that drop out at different depths split a segment in two,
segments where nobody drops out are skipped. Cost is O(k log n) dict probes for k distinct
match lengths, independent of the number of replicas holding the blocks.

The bisection relies on the prefix property: if a replica holds block i it holds blocks
0..i-1 too. Engines evict leaves first (vLLM frees a request's blocks tail-first, SGLang's
radix tree evicts leaves) so caches are prefix-closed; where a hole exists anyway (e.g. a
lost removal) the reported match is an upper bound that a later event corrects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.core.engine_hits import eagle_limit, peeked
from router.core.index_tables import bits
from router.core.index_updates import IndexUpdates
from router.core.prefix_match import (
    PrefixMatches,
    bisect_lengths,
    union_of,
    usable_lengths,
)
from router.core.types import Tier


class PrefixIndex(IndexUpdates):
    """Prefix-block index over many replicas. Not thread-safe; one owner mutates it."""

    # ------------------------------------------------------------------ queries

    def _holders(self, tables: list[dict[int, int]]) -> Callable[[int], int]:
        live = self._live
        if len(tables) == 1:
            get = tables[0].get

            def one(block: int) -> int:
                value = get(block)
                return 0 if value is None else bits(value) & live

            return one

        def many(block: int) -> int:
            mask = 0
            for table in tables:
                value = table.get(block)
                if value is not None:
                    mask |= bits(value)
            return mask & live

        return many

    def match(
        self,
        hashes: Sequence[int],
        *,
        hybrid: bool = False,
        now: float | None = None,
        prompt_tokens: int | None = None,
        block_size: int = 0,
        align_blocks: int = 1,
        peek_blocks: int = 0,
        fine_blocks: bool = False,
    ) -> PrefixMatches:
        """Cached prefix of ``hashes`` on every replica; ``now`` first expires speculative
        entries. The result is valid until the index next changes. ``prompt_tokens`` and
        ``block_size``: a state checkpoint is usable only before the prompt's last token
        (engines compute at least that one: vLLM caps a hit at ``prompt_tokens - 1``).
        ``align_blocks``: the engine block in router blocks (a usable prefix ends on one);
        ``peek_blocks`` (EAGLE / MTP engines): the usable prefix is what the engine grants once
        it gave back that many blocks of the hit, which for a ``hybrid`` model may first
        reach the prompt's last whole block (router/core/engine_hits.py).
        ``fine_blocks``: the engine block is finer than the router's, so a prompt cached whole
        is granted all but its last engine block, less than a router block short, which the
        block grid cannot show (a KV match is then usable whole; otherwise it ends a router
        block short of such a prompt's end, as the engine's hit does)."""
        if now is not None:
            self.expire(now)
        if not hashes or not self._live:
            return PrefixMatches.empty()
        spec_kv, spec_state = self._spec
        kv_tables = [t for t in (*self._kv, spec_kv) if t]
        if not kv_tables:
            return PrefixMatches.empty()
        kv = bisect_lengths(hashes, self._holders(kv_tables), self._live)
        if not kv:
            return PrefixMatches.empty()
        gpu: list[tuple[int, int]] | None = None
        host: list[tuple[int, int]] | None = None
        # Tier breakdown only when something lives off-GPU: GPU-only fleets skip it.
        if self._kv[Tier.CPU] or self._kv[Tier.DISK]:
            within = union_of(kv)
            gpu_tables = [t for t in (self._kv[Tier.GPU], spec_kv) if t]
            host_tables = [t for t in (self._kv[Tier.GPU], self._kv[Tier.CPU], spec_kv) if t]
            gpu = bisect_lengths(hashes, self._holders(gpu_tables), within) if gpu_tables else []
            host = bisect_lengths(hashes, self._holders(host_tables), within)
        usable: list[tuple[int, int]] | None = None
        limit = len(hashes)
        if prompt_tokens is not None and block_size > 0:
            limit = min(limit, eagle_limit(prompt_tokens, block_size, peek_blocks > 0, hybrid))
        reach = kv
        if peek_blocks > 0 or align_blocks > 1:
            # an engine block spans several of ours: a match ending inside one is not a hit
            # there (its hash covers tokens the request does not share)
            reach = peeked(kv, limit, max(align_blocks, 1), peek_blocks)
            if not hybrid:
                usable = reach
        elif not hybrid and not fine_blocks and max(length for length, _ in kv) > limit:
            # the whole prompt cached (its last token recomputed): one block less is a hit
            usable = peeked(kv, limit, 1, 0)
        if hybrid:
            state_tables = [t for t in (self._state, spec_state) if t]
            candidates = self._state_slots | (self._live if spec_state else 0)
            usable = (
                usable_lengths(hashes, reach, self._holders(state_tables), candidates, limit)
                if state_tables and reach
                else []
            )
        return PrefixMatches(self._slot_of, self._key_of, kv, gpu, host, usable)
