"""The ``vllm_cache_aware`` baseline: vllm-router 0.1.17's ``cache_aware`` on the router's own
approximate tree (router/core/vllm_router.py)."""

from __future__ import annotations

import random

from router.core.load import LoadView
from router.core.policies import Candidate, make_policy, uses_prefix_index
from router.core.types import PrefixMatch, ReplicaKey, RouteRequest
from router.core.vllm_router import VllmCacheAware

A, B, C = ReplicaKey("a"), ReplicaKey("b"), ReplicaKey("c")
NO_MATCH = PrefixMatch(0, 0, 0, 0)


def prompt(*hashes: int, tokens: int | None = None, rid: str = "x") -> RouteRequest:
    """A prompt of ``len(hashes)`` full 16-token blocks (or ``tokens``)."""
    return RouteRequest(rid, "m", tokens or 16 * len(hashes), list(hashes), 16)


def fleet(*in_flight: int) -> list[Candidate]:
    """Candidates A, B, C... with these in-flight counts; the index says nothing."""
    keys = [A, B, C][: len(in_flight)]
    return [
        Candidate(k, NO_MATCH, LoadView(in_flight=n)) for k, n in zip(keys, in_flight, strict=True)
    ]


def choose(
    policy: VllmCacheAware, request: RouteRequest, cands: list[Candidate], now: float = 0.0
) -> ReplicaKey:
    return policy.choose(request, cands, now, random.Random(0)).replica


def test_a_new_prompt_goes_to_the_least_loaded_the_first_of_equal_ones() -> None:
    policy = VllmCacheAware()
    assert choose(policy, prompt(1, 2), fleet(3, 1, 1)) == B
    assert choose(policy, prompt(7, 8), fleet(0, 0, 0)) == A


def test_it_follows_its_own_tree_above_the_threshold_not_the_index() -> None:
    policy = VllmCacheAware()
    assert choose(policy, prompt(1, 2, 3, 4), fleet(0, 5, 5)) == A
    # the index knows nothing (no events are read): the tree learned the prompt at routing
    assert not uses_prefix_index(policy)
    assert policy.matched_blocks(prompt(1, 2, 9), A) == 2
    # 2 of 4 blocks (50 %) match on A: above 0.3, so A although B and C are idle
    decision = policy.choose(prompt(1, 2, 5, 6), fleet(10, 0, 0), 0.0, random.Random(0))
    assert decision.replica == A and decision.terms["match_rate"] == 0.5
    assert decision.terms["cache"] == 1.0
    # 1 of 4 blocks (25 %): not above the threshold, the least loaded instead
    assert choose(policy, prompt(1, 7, 8, 9), fleet(10, 2, 1)) == C


def test_imbalance_overrides_the_cache() -> None:
    policy = VllmCacheAware()
    choose(policy, prompt(1, 2, 3), fleet(0, 0, 0))  # A learns the prompt
    # 65 more than the least, and more than 1.5 x: balance (65 - 0 > 64)
    balanced = policy.choose(prompt(1, 2, 3), fleet(65, 0, 4), 0.0, random.Random(0))
    assert balanced.replica == B and balanced.terms["balanced"] == 1.0
    # the balanced choice learned the prompt too: B holds it now, and most recently
    assert policy.matched_blocks(prompt(1, 2, 3), B) == 3
    # a difference of 64 is not above the absolute threshold: the cache wins, idle C loses
    assert choose(policy, prompt(1, 2, 3), fleet(0, 64, 0)) == B
    # 100 against 70: above 64 apart is not enough, 100 is not above 1.5 x 70
    assert choose(VllmCacheAware(), prompt(5), fleet(100, 170, 70)) == C  # new prompt: least


def test_of_equal_matches_the_most_recently_used_wins() -> None:
    policy = VllmCacheAware(balance_abs_threshold=1000)
    choose(policy, prompt(1, 2), fleet(0, 9, 9))  # A
    choose(policy, prompt(1, 2), fleet(0, 9, 9))  # A again: the cache
    choose(policy, prompt(3, 4), fleet(9, 0, 9))  # B learns another prompt
    policy._learn(prompt(1, 2), B)  # B sent the same prefix most recently
    assert choose(policy, prompt(1, 2, 5), fleet(0, 0, 0)) == B
    policy._learn(prompt(1, 2), A)
    assert choose(policy, prompt(1, 2, 6), fleet(0, 0, 0)) == A


def test_eviction_runs_on_its_interval_and_cuts_leaves_first() -> None:
    policy = VllmCacheAware(eviction_interval_s=10.0, max_tree_tokens=3 * 16)
    choose(policy, prompt(1, 2, 3, 4, 5), fleet(0, 1), now=0.0)  # A: 5 blocks
    choose(policy, prompt(6, 7), fleet(1, 0), now=1.0)  # B: 2 blocks
    assert policy.matched_blocks(prompt(1, 2, 3, 4, 5), A) == 5
    choose(policy, prompt(9), fleet(0, 1), now=9.0)  # before the interval: nothing cut
    assert policy.matched_blocks(prompt(1, 2, 3, 4, 5), A) == 5
    choose(policy, prompt(10), fleet(1, 0), now=10.0)  # the cycle: every tree to 3 blocks
    # A held 1-5 and 9: the least recently used go first, the deepest of a chain before
    # its root, so the prefix 1-2 survives with the newer 9
    assert policy.matched_blocks(prompt(1, 2, 3, 4, 5), A) == 2
    assert policy.matched_blocks(prompt(9), A) == 1
    assert policy.matched_blocks(prompt(6, 7), B) == 2  # B is within the cap


def test_it_is_a_registered_baseline_with_vllm_routers_defaults() -> None:
    policy = make_policy("vllm_cache_aware", {"cache_threshold": 0.5})
    assert isinstance(policy, VllmCacheAware) and policy.cache_threshold == 0.5
    defaults = VllmCacheAware()  # vllm-router 0.1.17 --help
    assert (defaults.cache_threshold, defaults.balance_abs_threshold) == (0.3, 64)
    assert (defaults.balance_rel_threshold, defaults.eviction_interval_s) == (1.5, 120.0)


def test_the_simulator_runs_it_without_the_index_and_it_finds_the_shared_prefixes() -> None:
    from sim.cluster import ClusterConfig, Simulation
    from sim.profiles import load_profile
    from sim.workload import load_trace

    workload = load_trace("mooncake", block_size=64, limit=400)
    config = ClusterConfig(profile=load_profile("dense-70b"), replicas=4, block_size=64)
    runs = {
        p: Simulation(workload, config, p).run().summary
        for p in ("round_robin", "vllm_cache_aware")
    }
    again = Simulation(workload, config, "vllm_cache_aware").run().summary
    assert again["token_hit_rate"] == runs["vllm_cache_aware"]["token_hit_rate"]  # deterministic
    assert runs["vllm_cache_aware"]["token_hit_rate"] > 2 * runs["round_robin"]["token_hit_rate"]
