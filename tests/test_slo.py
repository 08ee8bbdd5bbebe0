"""SLO targets (router/core/slo.py) and the goodput figures the simulator reports."""

from __future__ import annotations

import math
from typing import Any

import pytest

from router.core.slo import (
    DEFAULT_TIERS,
    DEFAULT_TPOT_S,
    SLO_SCALES,
    SloTargets,
    SloTier,
    goodput,
    parse_tiers,
    tpot_s,
)
from sim.metrics import RequestRecord, slo_figures


def test_a_prompt_takes_the_target_of_the_first_tier_it_fits() -> None:
    slo = SloTargets()
    assert slo.ttft_target_s(1) == 2.0
    assert slo.ttft_target_s(8192) == 2.0
    assert slo.ttft_target_s(8193) == 5.0
    assert slo.ttft_target_s(131072) == 15.0
    assert slo.ttft_target_s(1_000_000) == 60.0
    assert slo.tpot_s == DEFAULT_TPOT_S
    assert [t.label for t in slo.tiers] == ["le8k", "le32k", "le128k", "any"]


def test_a_bounded_last_tier_keeps_its_target_for_longer_prompts() -> None:
    slo = SloTargets((SloTier(1000, 1.0), SloTier(4000, 3.0)), 0.05)
    assert slo.ttft_target_s(10**6) == 3.0
    assert slo.tiers[-1] == SloTier(None, 3.0)


def test_flat_targets_override_the_tiers() -> None:
    flat = SloTargets.flat(ttft_s=0.5, tpot_s=0.02)
    assert flat.ttft_target_s(1) == flat.ttft_target_s(10**6) == 0.5
    assert flat.tpot_s == 0.02
    assert SloTargets.flat(tpot_s=0.2).tiers == DEFAULT_TIERS


def test_met_needs_both_halves() -> None:
    slo = SloTargets.flat(ttft_s=1.0, tpot_s=0.1)
    assert slo.met(100, 0.9, 0.09)
    assert not slo.met(100, 1.1, 0.09)
    assert not slo.met(100, 0.9, 0.11)
    assert slo.met(100, 0.9, None)  # one output token: no TPOT to miss
    assert not slo.met(100, math.nan, None)  # never answered


def test_tpot_is_time_after_the_first_token_per_further_token() -> None:
    assert tpot_s(2.0, 1.0, 11) == pytest.approx(0.1)
    assert tpot_s(2.0, 1.0, 1) is None
    assert tpot_s(2.0, 1.0, 0) is None


@pytest.mark.parametrize(
    ("text", "tiers"),
    [
        ("8192:2,*:60", (SloTier(8192, 2.0), SloTier(None, 60.0))),
        (" 1000 : 0.5 , 2000:1 ", (SloTier(1000, 0.5), SloTier(2000, 1.0))),
    ],
)
def test_tier_tables_parse(text: str, tiers: tuple[SloTier, ...]) -> None:
    assert parse_tiers(text) == tiers


@pytest.mark.parametrize("text", ["8192", "x:1", "8192:fast", "8192:2:3"])
def test_a_bad_tier_table_names_the_bad_item(text: str) -> None:
    with pytest.raises(ValueError, match="bad SLO tier"):
        parse_tiers(text)


@pytest.mark.parametrize(
    "tiers",
    [
        (),
        (SloTier(None, 1.0), SloTier(100, 2.0)),  # unbounded before the last
        (SloTier(200, 1.0), SloTier(100, 2.0)),  # not increasing
        (SloTier(100, 0.0),),
        (SloTier(100, math.inf),),
        (SloTier(0, 1.0),),
    ],
)
def test_inconsistent_targets_are_refused(tiers: tuple[SloTier, ...]) -> None:
    with pytest.raises(ValueError):
        SloTargets(tiers)


def test_a_non_positive_tpot_target_is_refused() -> None:
    with pytest.raises(ValueError):
        SloTargets(tpot_s=0.0)


def test_goodput_is_the_share_of_true_flags() -> None:
    assert goodput([True, False, True, True]) == 0.75
    assert goodput([]) == 0.0


def _record(prompt: int, ttft: float, e2e: float, output: int, rejected: bool = False) -> Any:
    r = RequestRecord("r", 0.0, prompt, 0)
    r.first, r.finish, r.output, r.rejected = ttft, e2e, output, rejected
    return r


def test_simulated_goodput_counts_every_request_and_each_half() -> None:
    slo = SloTargets((SloTier(1000, 1.0), SloTier(None, 5.0)), 0.1)
    records = [
        _record(500, 0.5, 1.4, 10),  # meets both (TPOT 0.1)
        _record(500, 1.5, 2.0, 10),  # TTFT missed
        _record(5000, 4.0, 8.0, 11),  # TPOT 0.4 missed
        _record(5000, 4.0, 4.0, 1),  # one token: meets
        _record(500, math.nan, math.nan, 0, rejected=True),
    ]
    got = slo_figures(records, slo)
    assert got["goodput"] == 0.4
    assert got["slo_ttft_met"] == 0.6
    assert got["slo_tpot_met"] == 0.6
    assert got["goodput_by_tier"] == {"le1000": pytest.approx(1 / 3, abs=1e-5), "any": 0.5}


def test_a_scaled_slo_scales_every_target_and_rejects_a_bad_factor() -> None:
    slo = SloTargets((SloTier(1000, 1.0), SloTier(None, 5.0)), 0.1)
    half = slo.scaled(0.5)
    assert [(t.max_prompt_tokens, t.ttft_s) for t in half.tiers] == [(1000, 0.5), (None, 2.5)]
    assert half.tpot_s == 0.05 and slo.scaled(1.0) == slo
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="SLO scale"):
            slo.scaled(bad)


def test_goodput_by_slo_scale_recounts_each_request_under_each_scale() -> None:
    slo = SloTargets((SloTier(1000, 1.0), SloTier(None, 5.0)), 0.1)
    records = [
        _record(500, 0.5, 1.4, 10),  # TTFT 0.5, TPOT 0.1: meets at 1 and 2, not at 0.5
        _record(500, 1.5, 2.0, 10),  # TTFT 1.5 (target 1): meets at 2 only
        _record(5000, 4.0, 8.0, 11),  # TPOT 0.4: misses even at 2 (0.2)
        _record(5000, 4.0, 4.0, 1),  # one token, TTFT 4 of 5: meets at 1 and 2
        _record(500, math.nan, math.nan, 0, rejected=True),  # never meets
    ]
    got = slo_figures(records, slo)["goodput_by_slo_scale"]
    assert list(got) == [f"{f:g}" for f in SLO_SCALES] == ["0.25", "0.5", "1", "2"]
    assert got == {"0.25": 0.0, "0.5": 0.0, "1": 0.4, "2": 0.6}
    assert got["1"] == slo_figures(records, slo)["goodput"]
    # a class's TTFT factor (admission's, here the default class's) applies at every scale
    flex = slo_figures(records, slo, ttft_factor=(1.0, 2.0, 1.0))["goodput_by_slo_scale"]
    assert flex["1"] == 0.6  # the second request's TTFT 1.5 is within 2 x 1 s


def test_a_class_is_promised_its_factor_with_admission_on_or_off() -> None:
    from router.core.admission import DEFAULT, FLEX, AdmissionSettings, class_ttft_factor

    assert class_ttft_factor(None, FLEX) == 4.0 and class_ttft_factor(None, DEFAULT) == 1.0
    tuned = AdmissionSettings(ttft_factor=(1.0, 1.0, 2.0))
    assert class_ttft_factor(tuned, FLEX) == 2.0
    slo = SloTargets((SloTier(None, 1.0),))
    assert slo.judge(10, 3.0, None, 4.0)[1:] == (True, True)
    assert not slo.met(10, 3.0, None) and slo.met(10, 3.0, None, 4.0)


def test_the_simulator_judges_an_answer_not_streamed_as_the_live_figures_do() -> None:
    """The same answered requests, one streamed and one not (its client gets the whole
    answer at once: no TTFT of its own), through the live replay's figures
    (router/demo/figures.py) and the simulator's (sim/metrics.py): the same goodput, SLO
    halves and TTFT / TPOT percentiles. The simulator judged an answer not streamed by the
    engine's first token, which its client never saw, and counted its TTFT and TPOT."""
    from router.demo.figures import summarize as live_figures
    from router.demo.replay import Outcome
    from sim.metrics import summarize as sim_figures

    slo = SloTargets((SloTier(1000, 1.0), SloTier(None, 5.0)), 0.1)
    # (prompt, engine's first token, finish, one sequence's output tokens, streamed)
    answers = [(500, 0.3, 0.8, 11, True), (500, 0.2, 1.5, 100, False)]
    outcomes, records = [], []
    for prompt, first, finish, output, streamed in answers:
        ttft = first if streamed else math.nan  # what the client measured
        outcomes.append(Outcome(True, ttft, prompt, e2e_s=finish, output_tokens=output))
        r = _record(prompt, first, finish, output)
        r.stream = streamed
        records.append(r)
    live = live_figures(outcomes, slo)
    sim = sim_figures(records, [1.0], ["r"], slo)
    assert live["goodput"] == 0.5  # the answer not streamed took 1.5 s of a 1 s target
    assert sim["goodput"] == live["goodput"]
    assert sim["goodput_by_slo_scale"] == live["goodput_by_slo_scale"]
    assert sim["slo_ttft_met"] == 0.5 and sim["slo_tpot_met"] == 1.0
    assert sim["ttft_ms_p50"] == live["ttft_p50_ms"] == 300.0  # streamed answers alone
    assert sim["tpot_ms_p50"] == live["tpot_p50_ms"] == 50.0
