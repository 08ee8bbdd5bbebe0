"""Synthetic agentic sessions: the traffic shape the router is built for.

A session is one user's agent loop:

* its first prompt is a *shared* system prompt (popularity Zipf over ``system_prompts``), a
  *shared* tool-definition block (one of ``tool_sets``) and the user's own message;
* a session has 1 + ``mean_turns`` turns on average (a first turn, then a geometric number
  of follow-ups of mean ``mean_turns``, at least one), at most ``max_turns``;
* every turn the model answers (``answer_tokens``), the agent runs a tool whose output
  (``tool_tokens``, Pareto heavy tail) is appended, and the next turn's prompt is the whole
  context so far: contexts grow turn by turn, up to ``max_context`` (1M tokens);
* the next turn starts ``think + tool latency`` seconds after the previous answer came back
  (closed loop: a slow fleet slows its own offered load, as real agents do);
* sessions start as a Poisson process at ``session_rate`` per second.

``open_loop=1`` makes it a conversation trace instead, the shape of Mooncake's: each turn
arrives ``turn_gap_s`` (median) after the previous turn *arrived*, whatever the fleet does, so
past saturation a turn can arrive while the previous one still waits; ``session_ids=0`` drops
the session ids (Mooncake's traces carry none), leaving the router the prefixes alone.

Token content is drawn from seeded generators (shared parts from seeds of their own, so every
session that uses system prompt 3 has the same tokens), hashed with the router's canonical
``hash_prompt``. The answer's tokens are known, so each request also carries the hashes of
the full blocks its answer completes, and an engine that caches them serves the next turn's
prefix from cache. Everything is a deterministic function of the spec (its seed included).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from router.core.errors import ConfigError
from router.core.hashing import coarsen_chain, hash_prompt, root_hash
from sim.workload import SimRequest, Workload

VOCAB = 200_000


@dataclass(slots=True, frozen=True)
class AgenticSpec:
    """Knobs of the generator; token counts are medians of log-normal draws unless noted."""

    sessions: int = 200
    session_rate: float = 0.5
    system_prompts: int = 8
    system_tokens: int = 6000
    tool_sets: int = 4
    tool_def_tokens: int = 3000
    user_tokens: int = 400
    # turns after the first: a session has 1 + Geometric(1 / max(mean_turns, 1)) turns, on
    # average mean_turns + 1 (9 by default: 200 sessions make ~1,800 requests), at most
    # max_turns, fewer where the context reaches max_context
    mean_turns: float = 8.0
    max_turns: int = 60
    answer_tokens: int = 300
    max_answer_tokens: int = 4096
    tool_tokens: int = 1500
    tool_tail_alpha: float = 1.3  # Pareto shape of tool outputs (lower: heavier tail)
    think_s: float = 2.0
    tool_latency_s: float = 3.0
    max_context: int = 1_000_000
    zipf_s: float = 1.1
    open_loop: int = 0  # 1: turns arrive turn_gap_s after the previous turn arrived
    turn_gap_s: float = 30.0
    session_ids: int = 1  # 0: requests carry no session id
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> AgenticSpec:
        """``agentic`` or ``agentic:sessions=100,seed=3,...`` (keys are field names)."""
        _, _, rest = text.partition(":")
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, int | float] = {}
        for item in filter(None, rest.split(",")):
            key, sep, val = item.partition("=")
            key = key.strip()
            if not sep or key not in kinds:
                raise ConfigError(f"bad agentic option {item!r}; known: {', '.join(sorted(kinds))}")
            try:
                values[key] = int(val) if kinds[key] in ("int", int) else float(val)
            except ValueError:
                raise ConfigError(f"agentic option {key}: not a number: {val!r}") from None
        return cls(**values)  # type: ignore[arg-type]


def _lognormal(rng: np.random.Generator, median: float, sigma: float = 0.8) -> float:
    return float(median * np.exp(rng.normal(0.0, sigma)))


def generate(spec: AgenticSpec, *, block_size: int, model: str = "sim-model") -> Workload:
    """Build the workload described by ``spec`` (deterministic in ``spec.seed``)."""
    if spec.sessions <= 0 or spec.session_rate <= 0:
        raise ConfigError("agentic: sessions and session_rate must be positive")
    rng = np.random.default_rng(spec.seed)
    root = root_hash(model)
    shared_rng = np.random.default_rng(spec.seed + 1_000_003)
    systems = [
        shared_rng.integers(0, VOCAB, max(64, int(_lognormal(shared_rng, spec.system_tokens))))
        for _ in range(spec.system_prompts)
    ]
    tools = [
        shared_rng.integers(0, VOCAB, max(64, int(_lognormal(shared_rng, spec.tool_def_tokens))))
        for _ in range(spec.tool_sets)
    ]
    ranks = np.arange(1, spec.system_prompts + 1, dtype=float)
    popularity = ranks**-spec.zipf_s
    popularity /= popularity.sum()
    prefix_memo: dict[tuple[int, int], tuple[np.ndarray, list[int]]] = {}
    requests: list[SimRequest] = []
    start = 0.0
    for s in range(spec.sessions):
        start += float(rng.exponential(1.0 / spec.session_rate))
        sys_i = int(rng.choice(spec.system_prompts, p=popularity))
        tool_i = int(rng.integers(spec.tool_sets))
        key = (sys_i, tool_i)
        if key not in prefix_memo:
            toks = np.concatenate([systems[sys_i], tools[tool_i]]).astype("<u4")
            prefix_memo[key] = (toks, hash_prompt(toks, block_size, root).hashes)
        base, base_hashes = prefix_memo[key]
        user = rng.integers(0, VOCAB, max(1, int(_lognormal(rng, spec.user_tokens))))
        tokens = np.concatenate([base, user.astype("<u4")])
        hashes = list(base_hashes)
        turns = min(spec.max_turns, 1 + int(rng.geometric(1.0 / max(spec.mean_turns, 1.0))))
        prev: str | None = None
        arrival = start
        session = f"s{s}" if spec.session_ids else None
        for t in range(turns):
            prompt = len(tokens)
            answer = int(min(spec.max_answer_tokens, max(1, _lognormal(rng, spec.answer_tokens))))
            answer_toks = rng.integers(0, VOCAB, answer).astype("<u4")
            tool_out = int(spec.tool_tokens * (1.0 + rng.pareto(spec.tool_tail_alpha)) / 2)
            tool_toks = rng.integers(0, VOCAB, max(1, tool_out)).astype("<u4")
            tokens = np.concatenate([tokens, answer_toks])
            done = len(hashes) * block_size
            hashes.extend(
                hash_prompt(
                    tokens, block_size, root, start=done, parent=hashes[-1] if hashes else None
                ).hashes
            )
            rid = f"s{s}t{t}"
            pause = _lognormal(rng, spec.think_s) + _lognormal(rng, spec.tool_latency_s)
            requests.append(
                SimRequest(
                    rid,
                    arrival,
                    prompt,
                    answer,
                    tuple(hashes[: prompt // block_size]),
                    session,
                    None if spec.open_loop else prev,
                    pause,
                    tuple(hashes[prompt // block_size : (prompt + answer) // block_size]),
                )
            )
            prev = rid
            if spec.open_loop:
                arrival += _lognormal(rng, spec.turn_gap_s)
            tokens = np.concatenate([tokens, tool_toks])
            if len(tokens) >= spec.max_context:
                break
    # in the order sessions start, each session's turns together (a closed-loop turn's
    # arrival_s is its session's start): ``head(n)`` keeps the first sessions whole, as the
    # recorded rows of the same workload (to_trace_rows) read with a limit do
    requests.sort(key=lambda r: r.arrival_s)
    meta = {"format": "agentic", "spec": {f.name: getattr(spec, f.name) for f in fields(spec)}}
    return Workload("agentic", requests, block_size, model, meta)


def to_trace_rows(workload: Workload, trace_block: int = 512) -> list[dict[str, object]]:
    """The workload as recorded-format rows (Mooncake JSONL plus ``session_id`` / ``delay``):
    ``hash_ids`` name ``trace_block``-token prefix blocks, dense in order of first appearance,
    exactly as the router's trace recorder writes them. A follow-up turn carries ``delay``
    (ms after its previous turn finished), so readers replay sessions closed loop.

    Token *content* is not kept: a reader rebuilds tokens from the ids, which preserves which
    prompts share which prefixes (the property routing depends on), not the tokens themselves.

    A follow-up is tied to its previous turn by ``session_id``: closed-loop turns without one
    (``session_ids=0`` without ``open_loop=1``) cannot be written (ConfigError); readers
    would take them as open loop, every turn at its session's start.
    """
    if any(r.after is not None and r.session_id is None for r in workload.requests):
        raise ConfigError(
            "agentic: closed-loop sessions without session ids (session_ids=0) cannot be "
            "written as trace rows: a follow-up is tied to its turn by session_id "
            "(use open_loop=1 or session_ids=1)"
        )
    dense: dict[int, int] = {}
    rows: list[dict[str, object]] = []
    for r in workload.requests:
        coarse = coarsen_chain(r.block_hashes, workload.block_size, r.prompt_tokens, trace_block)
        ids = [dense.setdefault(h, len(dense)) for h in coarse]
        row: dict[str, object] = {
            "timestamp": round(r.arrival_s * 1000),
            "input_length": r.prompt_tokens,
            "output_length": r.output_tokens,
            "hash_ids": ids,
        }
        if r.session_id is not None:
            row["session_id"] = r.session_id
        if r.after is not None:
            row["delay"] = round(r.delay_s * 1000)
        rows.append(row)
    rows.sort(key=lambda row: (int(row["timestamp"]), "delay" in row))  # type: ignore[call-overload]
    return rows
