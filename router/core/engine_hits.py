"""What an engine holds after prefilling a prompt, and which cached prefix it grants a later
request, in router blocks: vLLM v1's rules (0.34: ``v1/core/sched/scheduler.py``
``_mamba_block_aligned_split``, ``v1/kv_cache_interface.py``
``get_mamba_prefill_checkpoint_position``, ``v1/core/single_type_kv_cache_manager.py``
``find_longest_cache_hit``).

Terms: ``N`` prompt tokens, ``B`` the router block, ``A`` the engines' cache-hit alignment in
router blocks (``StateLayout.alignment_blocks``: vLLM's scheduler block, 1,024 tokens or so
for a hybrid model, against a router block of 64), ``floor_A(x) = x // A * A``; ``eagle``:
the engines run EAGLE / MTP speculative decoding.

* KV: an engine caches whole engine blocks, ``floor_A(N // B)`` blocks of the prompt.
* Recurrent state (hybrid models, mamba "align" mode): the prefill is split so that a
  state lands on the last engine block boundary before the prompt's last token,
  ``floor_A((N - 1) // B)`` (``N - l`` with lookahead hashes of ``l`` > 1 tokens), which is
  the checkpoint vLLM keeps of the prompt (its default ``prefix_cache_retention_interval`` 0
  retains only that replay boundary: a block-aligned prompt leaves no state at ``N``); with
  EAGLE ``floor_A(N // B)`` less one engine block (the draft head recomputes the last
  matched block, so a state there would never serve).
* A hit: at most ``floor_A((N - 1) // B)`` blocks (the last token is recomputed for its
  logits); with EAGLE every hit gives back one engine block, and a hybrid model's draft
  group first looks one block past the ``N - 1`` cap (:func:`eagle_limit`: a block-aligned
  prompt sent again is granted ``N`` less one engine block), and a hybrid
  checkpoint at ``L`` serves only where the cached KV runs on to ``L + A``.
  ``PrefixIndex.match`` applies it through :func:`peeked`.
"""

from __future__ import annotations

from bisect import insort
from typing import NamedTuple

from router.core.state_layout import StateLayout
from router.core.types import RouteRequest


def floor_to(blocks: int, align: int) -> int:
    """``blocks`` rounded down to a multiple of ``align`` (>= 1)."""
    return blocks // align * align


def prompt_end_checkpoint(
    prompt_tokens: int, block_size: int, align: int, eagle: bool, lookahead: int = 0
) -> int:
    """Where (router blocks, 0: nowhere) an engine keeps the last recurrent-state checkpoint
    of a prompt of ``prompt_tokens`` tokens: vLLM 0.34's
    ``get_mamba_prefill_checkpoint_position`` in router blocks of ``block_size`` tokens
    (``lookahead``: the tokens after each block its hashes cover)."""
    reach = prompt_tokens if eagle else prompt_tokens - max(1, lookahead)
    end = floor_to(max(reach, 0) // block_size, align)
    if eagle:
        end -= align
    return max(end, 0)


def eagle_limit(prompt_tokens: int, block_size: int, eagle: bool, hybrid: bool) -> int:
    """The router blocks of a prompt a hit may reach before an EAGLE engine gives one engine
    block back (otherwise the hit itself): vLLM caps a hit at ``N - 1`` tokens
    (``Request.get_max_cache_hit_length``). A hybrid model's coordinator lets its EAGLE
    group look one block past the cap (``eagle_proof_margin``) within the prompt's hashed
    whole blocks before dropping one (``HybridKVCacheCoordinator.find_longest_cache_hit``),
    so there the reach is ``N // B``: a block-aligned prompt sent again is granted all but
    its last engine block. A model of one KV cache group has no such margin
    (``UnitaryKVCacheCoordinator`` passes the ``N - 1`` cap as it is)."""
    return (prompt_tokens if eagle and hybrid else prompt_tokens - 1) // block_size


def peeked(kv: list[tuple[int, int]], cap: int, align: int, peek: int) -> list[tuple[int, int]]:
    """KV match groups ``(length, replica mask)`` as an engine that drops ``peek`` blocks
    of every hit grants them: capped at ``cap``, on the ``align`` grid, ``peek`` shorter;
    groups left empty are dropped (masks stay disjoint; lengths may repeat)."""
    out: list[tuple[int, int]] = []
    for length, mask in kv:
        granted = floor_to(min(length, cap), align) - peek
        if granted > 0:
            out.append((granted, mask))
    return out


class EngineHolds(NamedTuple):
    """What the replica a request was sent to will hold of its prompt once prefilled.
    ``kv_blocks``: its full engine blocks; ``state_hashes``: the checkpoints a hybrid engine
    keeps (grid and prompt end; empty for a KV-only model); ``next_hit_blocks``: what a later
    turn extending the prompt reuses there (the session hint's reach). A NamedTuple: built
    once a dispatch (router/core/types.py says why)."""

    kv_blocks: int
    state_hashes: tuple[int, ...]
    next_hit_blocks: int


def engine_holds(
    request: RouteRequest, layout: StateLayout, eagle: bool, lookahead: int = 0
) -> EngineHolds:
    """:class:`EngineHolds` for ``request`` under ``layout`` (see the module docstring;
    ``lookahead``: the tokens after each block the engines' hashes cover)."""
    hashes = request.block_hashes
    align = layout.alignment_blocks
    kv = len(hashes) // align * align  # floor_to, inline: once a dispatch
    if not layout.hybrid:
        return EngineHolds(kv, (), max(kv - align, 0) if eagle else kv)
    end = prompt_end_checkpoint(request.prompt_tokens, request.block_size, align, eagle, lookahead)
    end = max(min(end, kv - align if eagle else kv), 0)  # only blocks it has hashes of
    grid = layout.interval_blocks
    # grid points up to the prompt's end: the state after the whole prompt is kept where
    # the grid falls on it (a block-aligned prompt), past its own checkpoint
    at = list(range(grid, (end if eagle else kv) + 1, grid)) if grid > 0 else []
    if end and (grid <= 0 or end % grid):
        insort(at, end)
    return EngineHolds(kv, tuple(hashes[p - 1] for p in at), at[-1] if at else 0)


def granted_blocks(
    held: int, request: RouteRequest, layout: StateLayout, eagle: bool, fine: bool = False
) -> int:
    """Of a prefix of ``request`` that a replica reuses ``held`` blocks of for a request
    extending it (:attr:`EngineHolds.next_hit_blocks`, a session hint's reach), what the
    engine grants ``request`` itself, as ``PrefixIndex.match`` does: a hit ends before the
    prompt's last token, on the engine block grid, with EAGLE one engine block shorter; a
    hybrid model's hit ends on a checkpoint (below the hint's, on the grid: 0 with none).
    ``fine``: engine blocks finer than the router's (``PrefixIndex.match``'s
    ``fine_blocks``)."""
    align = layout.alignment_blocks
    peek = align if eagle else 0
    shaped = peek > 0 or align > 1
    limit = min(
        len(request.block_hashes),
        eagle_limit(request.prompt_tokens, request.block_size, eagle, layout.hybrid),
    )
    if not shaped and not layout.hybrid:
        return held if fine else min(held, max(limit, 0))  # as the index has it
    cap = floor_to(limit, align) - peek if shaped else limit
    if held <= cap:
        return held
    if not layout.hybrid:
        return max(cap, 0)
    grid = layout.interval_blocks
    return floor_to(cap, grid) if grid > 0 and cap > 0 else 0
