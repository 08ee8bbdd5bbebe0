"""Service-level objectives: a TTFT target by prompt-length tier and a TPOT target.

A request *meets its SLO* when its time to first token is within the target of its prompt's
tier and its time per output token, ``(last token - first token) / (output tokens - 1)``
(vLLM's, vllm/v1/metrics/stats.py ``IterationStats.update_from_finished_request``: not the
wait after the last token for the usage chunk or the stream's end), is within the TPOT
target (a request with at most one output token has no TPOT and meets that half).
*Goodput* is the share of requests that meet their SLO; a request that failed or was
rejected does not.

Tiers are ordered by ``max_prompt_tokens``; a prompt belongs to the first tier whose bound
it does not exceed, the last tier (bound ``None``) takes the rest. The defaults follow public
serving benchmarks for large models (MLPerf Inference's server scenarios: TTFT 2 s and TPOT
200 ms for Llama-2-70B, TTFT 6 s and TPOT 175 ms for Llama-3.1-405B; the interactive
scenario 450 ms / 40 ms) and grow the TTFT target with the prompt, since prefill time does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SloTier:
    """Prompts of at most ``max_prompt_tokens`` (``None``: any length) must see their first
    token within ``ttft_s``."""

    max_prompt_tokens: int | None
    ttft_s: float

    @property
    def label(self) -> str:
        """A short name for metrics: ``le8k``, ``le128k``, ``gt128k`` ..."""
        if self.max_prompt_tokens is None:
            return "any"
        return f"le{_short(self.max_prompt_tokens)}"


def _short(tokens: int) -> str:
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return str(tokens)


DEFAULT_TIERS: tuple[SloTier, ...] = (
    SloTier(8192, 2.0),
    SloTier(32768, 5.0),
    SloTier(131072, 15.0),
    SloTier(None, 60.0),
)
DEFAULT_TPOT_S = 0.1


def tier_for(tiers: Sequence[SloTier], prompt_tokens: int) -> SloTier:
    """The first of ``tiers`` (ordered by bound) whose bound ``prompt_tokens`` does not
    exceed; the last one past every bound."""
    for t in tiers:
        if t.max_prompt_tokens is None or prompt_tokens <= t.max_prompt_tokens:
            return t
    return tiers[-1]


@dataclass(slots=True, frozen=True)
class SloTargets:
    """TTFT targets by prompt tier and one TPOT target, in seconds."""

    tiers: tuple[SloTier, ...] = DEFAULT_TIERS
    tpot_s: float = DEFAULT_TPOT_S

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("an SLO needs at least one TTFT tier")
        bounds = [t.max_prompt_tokens for t in self.tiers]
        if any(b is None for b in bounds[:-1]):
            raise ValueError("only the last TTFT tier may be unbounded")
        finite = [b for b in bounds if b is not None]
        if finite != sorted(set(finite)) or any(b <= 0 for b in finite):
            raise ValueError("TTFT tier bounds must be positive and increasing")
        if any(not (t.ttft_s > 0 and math.isfinite(t.ttft_s)) for t in self.tiers):
            raise ValueError("TTFT targets must be positive seconds")
        if not (self.tpot_s > 0 and math.isfinite(self.tpot_s)):
            raise ValueError("the TPOT target must be positive seconds")
        if bounds[-1] is not None:  # a prompt longer than every bound keeps the last target
            last = self.tiers[-1]
            object.__setattr__(self, "tiers", (*self.tiers, SloTier(None, last.ttft_s)))

    @classmethod
    def flat(cls, ttft_s: float | None = None, tpot_s: float | None = None) -> SloTargets:
        """The defaults with one TTFT target for every prompt (``ttft_s``) and/or another
        TPOT target; ``None`` keeps the default of that half."""
        tiers = DEFAULT_TIERS if ttft_s is None else (SloTier(None, ttft_s),)
        return cls(tiers, DEFAULT_TPOT_S if tpot_s is None else tpot_s)

    def scaled(self, factor: float) -> SloTargets:
        """Every target (each tier's TTFT and the TPOT) times ``factor``: the same SLO made
        stricter (< 1) or looser (> 1), as serving papers sweep it (DistServe's "SLO
        scale"). ValueError for a factor that is not a positive finite number."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"an SLO scale must be a positive number, not {factor!r}")
        tiers = tuple(SloTier(t.max_prompt_tokens, t.ttft_s * factor) for t in self.tiers)
        return SloTargets(tiers, self.tpot_s * factor)

    def tier(self, prompt_tokens: int) -> SloTier:
        return tier_for(self.tiers, prompt_tokens)

    def ttft_target_s(self, prompt_tokens: int) -> float:
        return self.tier(prompt_tokens).ttft_s

    def ttft_budget_s(self, prompt_tokens: int, ttft_factor: float = 1.0) -> float:
        """The TTFT a request with that prompt is promised: its tier's target times its
        service class's ``ttft_factor`` (router.core.admission ``class_ttft_factor``)."""
        return self.ttft_target_s(prompt_tokens) * ttft_factor

    def judge(
        self, prompt_tokens: int, ttft_s: float, tpot_s: float | None, ttft_factor: float = 1.0
    ) -> tuple[SloTier, bool, bool]:
        """The one SLO judgement of a finished request (the service's metric, the
        simulator's goodput, the benchmarks'): its prompt's tier, whether its TTFT was within
        :meth:`ttft_budget_s` (NaN, never answered, is not) and whether its TPOT was within
        the target (``tpot_s`` None, at most one output token: met)."""
        tier = self.tier(prompt_tokens)
        ttft_ok = ttft_s <= tier.ttft_s * ttft_factor
        return tier, ttft_ok, tpot_s is None or tpot_s <= self.tpot_s

    def met(
        self, prompt_tokens: int, ttft_s: float, tpot_s: float | None, ttft_factor: float = 1.0
    ) -> bool:
        """Whether a finished request met both targets (``tpot_s`` None: one output token)."""
        _, ttft_ok, tpot_ok = self.judge(prompt_tokens, ttft_s, tpot_s, ttft_factor)
        return ttft_ok and tpot_ok

    def labels(self) -> Sequence[str]:
        return [t.label for t in self.tiers]


SLO_SCALES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
"""The scales ``goodput_by_slo_scale`` reports (the simulator's and ``kvrouter bench live``'s
figures): where a fleet meets its SLO easily, goodput at 1 no longer tells routers apart; at
a stricter scale it still does, and at a looser one it shows what is lost past saturation."""


def scale_label(factor: float) -> str:
    """``0.25`` -> ``"0.25"``, ``1.0`` -> ``"1"``: the key of a scale in reports."""
    return f"{factor:g}"


Answered = tuple[int, float, float | None]
"""One answered request as the SLO sees it: prompt tokens, TTFT and TPOT in seconds (TPOT
None for an answer of at most one token)."""


def answered_as(
    prompt_tokens: int,
    ttft_s: float,
    e2e_s: float,
    output_tokens: int,
    streamed: bool = True,
    last_s: float | None = None,
) -> Answered:
    """One answered request as its client saw it, for the SLO: the one rule the live
    figures (router/demo/replay.py ``Outcome.judged``), the service's
    (router.service.answer_relay ``count_slo``) and the simulator's goodput judge by.
    ``output_tokens``: one sequence's. ``last_s``: when its last token came (from its
    start, as ``ttft_s``), which its TPOT is timed to; None: at its end, ``e2e_s`` (the
    simulator's finish is its last token; a gRPC Report tells only of the end). An answer
    not streamed has no TTFT of its own (its first token reaches the client with the
    whole answer): judged by its E2E, its TPOT not judged."""
    if not streamed:
        return prompt_tokens, e2e_s, None
    last = e2e_s if last_s is None else last_s
    return prompt_tokens, ttft_s, tpot_s(last, ttft_s, output_tokens)


def sequence_tokens(output_tokens: int, sequences: int) -> int:
    """One sequence's output tokens, as a request's usage tells them: ``output_tokens``
    every sequence's (``n`` for each prompt, a completions batch's every prompt), over its
    ``sequences``, rounded up. The live figures (router/demo/replay.py ``Outcome``) and the
    simulator's (sim/metrics.py ``answers``, a batch's rows as one answer) judge by it."""
    sequences = max(sequences, 1)
    return -(-output_tokens // sequences)


def count_met(answered: Iterable[Answered], targets: SloTargets) -> int:
    """How many of ``answered`` met ``targets``."""
    return sum(targets.met(prompt, ttft, tpot) for prompt, ttft, tpot in answered)


def goodput_by_scale(
    answered: Sequence[Answered], n: int, slo: SloTargets, scales: Sequence[float] = SLO_SCALES
) -> dict[str, float]:
    """Goodput under ``slo`` scaled by each of ``scales``: the share of ``n`` requests (failed
    ones included, as misses) among which ``answered`` are the answered ones."""
    return {
        scale_label(f): (round(count_met(answered, slo.scaled(f)) / n, 5) if n else 0.0)
        for f in scales
    }


def tpot_s(last_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first, from the first token (``ttft_s``) to the
    last (``last_s``, on the same clock); None for answers of at most one token."""
    if output_tokens <= 1:
        return None
    return (last_s - ttft_s) / (output_tokens - 1)


def parse_tiers(text: str) -> tuple[SloTier, ...]:
    """``"8192:2,32768:5,131072:15,*:60"`` (prompt-token bound : TTFT seconds; ``*`` for the
    unbounded last tier) -> tiers. Raises ValueError with the offending item."""
    tiers: list[SloTier] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        bound, sep, target = item.partition(":")
        try:
            if not sep:
                raise ValueError
            limit = None if bound.strip() in ("*", "") else int(bound)
            tiers.append(SloTier(limit, float(target)))
        except ValueError:
            raise ValueError(
                f"bad SLO tier {item!r}: expected PROMPT_TOKENS:TTFT_SECONDS or *:TTFT_SECONDS"
            ) from None
    return tuple(tiers)


def goodput(flags: Iterable[bool]) -> float:
    """Share of true values (0.0 for none)."""
    n = met = 0
    for f in flags:
        n += 1
        met += bool(f)
    return met / n if n else 0.0
