"""Exact repeats of a request body skip prompt processing.

Parallel sampling sent as separate requests (RL rollouts, best-of-N, evaluation harnesses
re-running one prompt), client retries and load generators send byte-identical bodies. For
those, everything the router derives from the body before routing (model, validation, the
prompt's token count and block hashes, the context check, ``user`` and the output-token
limit) is a pure function of the bytes and of the settings, which do not change while the
process runs. :class:`BodyMemo` keeps that result with the body bytes themselves, found by a
64-bit xxh3 digest of them (hashing a 2 KB body costs a tenth of Python's own bytes hash) and
confirmed by comparing the bytes, so a hit is exact (a digest collision is a miss), and only
routing, which depends on live state, runs again.

Only bodies that passed admission are kept (a bad body is re-checked and answered each
time; routing may still fail for live reasons, as on any hit) and only bodies
smaller than ``max_body_bytes`` (larger ones are long agentic turns, which the incremental
tokenizer serves and which rarely repeat byte for byte). Entries are evicted least recently
used first to stay within ``budget_bytes``, counted as the body's length plus the prompt's
block hashes (every prompt's, with its row, for a batch of completion prompts), the strings
copied out of the body and a fixed overhead. The memo belongs to
the event-loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import xxhash

from router.tokenize.keying import ProcessedPrompt

# Python object overhead of an entry besides the body bytes and the hashes (tuple, key,
# ProcessedPrompt, list) and per block hash (a 64-bit int object and its list slot).
_ENTRY_OVERHEAD = 400
_PER_HASH = 44
# per prompt of a batch of completion prompts (ProcessedPrompt.batch: a row's tuple, count
# and hash list), besides its hashes
_PER_BATCH_ROW = 128


@dataclass(slots=True, frozen=True)
class Admitted:
    """What admission derived from a body, ready to be routed again."""

    model: str
    prompt: ProcessedPrompt
    session_id: str | None
    max_output_tokens: int | None
    # appended to the body so the engine reports usage on a stream (stream_usage.py)
    usage_patch: bytes | None = None
    # the body's OpenAI ``service_tier`` (checked), for SLO-aware admission
    service_tier: str | None = None
    # the body's top-level ``"stream": true``: what the first-byte deadline waits for
    stream: bool = False
    # why the request is never disaggregated, '' when it may be (disagg.keep_local)
    keep_local: str = ""
    # appended to a disaggregated request's prefill leg (pd_serve.prefill_caps)
    prefill_caps: bytes = b""
    # a Responses API body: the stored response it continues (``previous_response_id``),
    # and whether its answer's id is recorded (``store`` not false): response_ids.py
    previous_response: str | None = None
    stores: bool = False


class BodyMemo:
    """Least-recently-used map (endpoint kind, body bytes) -> :class:`Admitted`."""

    __slots__ = ("_budget", "_entries", "_max_body", "hits", "misses", "size_bytes")

    def __init__(self, budget_bytes: int, max_body_bytes: int) -> None:
        self._budget = budget_bytes
        self._max_body = max_body_bytes
        # (kind, digest) -> (body, admission); keyed by kind too: the same bytes mean different
        # prompts on /v1/completions and /v1/chat/completions
        self._entries: OrderedDict[tuple[str, int], tuple[bytes, Admitted]] = OrderedDict()
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self._budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, kind: str, raw: bytes) -> Admitted | None:
        if len(raw) >= self._max_body or self._budget <= 0:
            return None
        key = (kind, xxhash.xxh3_64_intdigest(raw))
        entry = self._entries.get(key)
        if entry is None or entry[0] != raw:
            self.misses += 1
            return None
        self.hits += 1
        found = entry[1]
        prompt = found.prompt
        if prompt.tokenize_s or prompt.hash_s:
            # first hit: from now on the entry says what a hit costs (no tokenize or hash
            # time); done here rather than in put, so bodies that never repeat (most) do not
            # pay for it
            found = replace(found, prompt=replace(prompt, tokenize_s=0.0, hash_s=0.0))
            self._entries[key] = (raw, found)
        self._entries.move_to_end(key)
        return found

    def put(self, kind: str, raw: bytes, admitted: Admitted) -> None:
        """Remember a body that was admitted. A hit returns it with no tokenize or hash time
        (``reused_tokens`` stays the incremental cache's figure of the first admission; hits
        are counted by :attr:`hits`)."""
        if len(raw) >= self._max_body or self._budget <= 0:
            return
        cost = _cost(raw, admitted)
        if cost > self._budget:
            return
        key = (kind, xxhash.xxh3_64_intdigest(raw))
        old = self._entries.pop(key, None)
        if old is not None:  # the same body again, or (never seen) another with its digest
            self.size_bytes -= _cost(*old)
        self._entries[key] = (raw, admitted)
        self.size_bytes += cost
        while self.size_bytes > self._budget:
            _, gone = self._entries.popitem(last=False)
            self.size_bytes -= _cost(*gone)


def _cost(raw: bytes, admitted: Admitted) -> int:
    # the session id and a Responses body's previous response id are decoded copies of body
    # fields: as large as they are
    session = len(admitted.session_id) if admitted.session_id else 0
    previous = len(admitted.previous_response) if admitted.previous_response else 0
    prompt = admitted.prompt
    hashes = _PER_HASH * len(prompt.block_hashes)
    # a batch keeps every prompt's row: a small body of many short prompts holds many times
    # its own size (the longest prompt's hashes, shared with block_hashes, count twice)
    for _, row in prompt.batch:
        hashes += _PER_BATCH_ROW + _PER_HASH * len(row)
    return len(raw) + session + previous + hashes + _ENTRY_OVERHEAD
