"""router/core/disagg.py: roles, links, transfer sizes and the disaggregation decision."""

from __future__ import annotations

import random

import pytest

from router.core.disagg import (
    Disaggregator,
    Link,
    LinkModel,
    PdKnobs,
    Role,
    Site,
    TransferSizes,
)
from router.core.errors import ConfigError, NoReplicaAvailable
from router.core.index import PrefixIndex
from router.core.load import CostModel, LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.types import BlocksStored, EventBatch, Kind, ReplicaKey, RouteRequest

BLOCK = 64
KEYS = tuple(ReplicaKey(n) for n in ("p0", "d0", "p1", "d1"))
SITES = {
    KEYS[0]: Site("reg0", "rack0"),
    KEYS[1]: Site("reg0", "rack0"),
    KEYS[2]: Site("reg0", "rack1"),
    KEYS[3]: Site("reg0", "rack1"),
}


def test_roles_parse() -> None:
    assert Role.parse(None) is Role.BOTH
    assert Role.parse("Prefill") is Role.PREFILL
    assert Role.DECODE.decodes and not Role.DECODE.prefills
    with pytest.raises(ConfigError):
        Role.parse("router")


def test_links_and_sizes() -> None:
    link = LinkModel()
    a, b, c = Site("r", "k0"), Site("r", "k1"), Site("s", "k0")
    assert link.link(a, a) is Link.NVLINK
    assert link.link(a, b) is Link.NETWORK
    assert link.link(a, c) is Link.REGION
    assert link.link(a, a, same_replica=True) is Link.SAME
    nbytes = TransferSizes(9216, 24e6).total(100_000, hybrid=True)
    assert nbytes == 100_000 * 9216 + 24e6
    assert TransferSizes(9216, 24e6).total(100_000, hybrid=False) == 100_000 * 9216
    times = [link.seconds(k, nbytes) for k in (Link.SAME, Link.NVLINK, Link.NETWORK, Link.REGION)]
    assert times[0] == 0.0 and times == sorted(times) and times[1] > 0
    with pytest.raises(ConfigError):
        PdKnobs(mode="sometimes")


def _fleet(mode: str, roles: dict[ReplicaKey, Role]) -> tuple[RoutingEngine, Disaggregator]:
    index, load = PrefixIndex(), LoadTracker()
    for k in KEYS:
        index.add_replica(k)
        load.add_replica(k)
    cost = CostModel()
    engine = RoutingEngine(
        index, load, make_policy("ours"), RoutingSettings(block_size=BLOCK, hybrid=True)
    )
    pd = Disaggregator(PdKnobs(mode=mode), cost, roles=roles, sites=SITES)
    return engine, pd


def _request(rid: str, tokens: int, base: int = 0) -> RouteRequest:
    hashes = [base + i + 1 for i in range(tokens // BLOCK)]
    return RouteRequest(rid, "m", tokens, hashes, BLOCK, None, 200)


def _busy(engine: RoutingEngine, key: ReplicaKey, n: int) -> None:
    """``n`` short-answer sequences decoding on ``key``."""
    for i in range(n):
        rid = f"busy-{key}-{i}"
        engine.load.dispatch(rid, key, 1000, 0, 20)
        engine.load.first_token(rid)


PD_ROLES = {KEYS[0]: Role.PREFILL, KEYS[1]: Role.BOTH, KEYS[2]: Role.PREFILL, KEYS[3]: Role.BOTH}


def test_off_and_short_prompts_stay_local() -> None:
    rng = random.Random(0)
    engine, pd = _fleet("off", PD_ROLES)
    plan = pd.plan(engine, _request("a", 64_000), KEYS, 0.0, rng)
    assert not plan.remote and plan.local is not None
    assert plan.local.replica in (KEYS[1], KEYS[3])  # prefill-only replicas never decode
    engine, pd = _fleet("auto", PD_ROLES)
    plan = pd.plan(engine, _request("b", 1024), KEYS, 0.0, rng)
    assert (plan.remote, plan.reason) == (False, "few_uncached")


def test_auto_goes_remote_when_the_decode_side_is_busy_and_pairs_in_rack() -> None:
    rng = random.Random(0)
    engine, pd = _fleet("auto", PD_ROLES)
    req = _request("long", 64_000)
    assert not pd.plan(engine, req, KEYS, 0.0, rng).remote  # idle decoders: local pays
    for k in (KEYS[1], KEYS[3]):
        _busy(engine, k, 40)
    plan = pd.plan(engine, req, KEYS, 0.0, rng)
    assert plan.remote and plan.reason == "remote_pays"
    assert plan.prefill is not None and plan.prefill.replica in (KEYS[0], KEYS[2])
    pick = pd.pick_decode(engine, req, plan.prefill.replica, KEYS, 0.0, rng)
    assert pick.link is Link.NVLINK  # the decode replica in the prefill replica's rack
    assert SITES[pick.decision.replica].rack == SITES[plan.prefill.replica].rack
    assert pick.transfer_bytes == pd.sizes.total(64_000, hybrid=True)
    assert pick.transfer_s == pd.link.seconds(Link.NVLINK, pick.transfer_bytes)


def test_a_usable_local_hit_keeps_the_request_local() -> None:
    rng = random.Random(0)
    engine, pd = _fleet("auto", PD_ROLES)
    for k in (KEYS[1], KEYS[3]):
        _busy(engine, k, 40)
    req = _request("hit", 64_000)
    hashes = tuple(req.block_hashes[:600])  # 60% of the prompt: still 25,600 tokens to prefill
    engine.index.apply(EventBatch(KEYS[3], (BlocksStored(hashes),)))
    engine.index.apply(EventBatch(KEYS[3], (BlocksStored(hashes[-1:], kind=Kind.STATE),)))
    plan = pd.plan(engine, req, KEYS, 0.0, rng)
    assert (plan.remote, plan.reason) == (False, "local_hit")
    assert plan.local is not None and plan.local.replica == KEYS[3]


def test_always_disaggregates_and_prices_only_what_decode_lacks() -> None:
    rng = random.Random(0)
    roles = {KEYS[0]: Role.PREFILL, KEYS[1]: Role.DECODE, KEYS[2]: Role.PREFILL}
    roles[KEYS[3]] = Role.DECODE
    engine, pd = _fleet("always", roles)
    req = _request("x", 8192)
    plan = pd.plan(engine, req, KEYS, 0.0, rng)
    assert plan.remote and plan.local is None and plan.reason == "always"
    assert plan.prefill is not None
    # the decode replica of the other rack already holds half of the prompt (KV + state)
    other = KEYS[3] if SITES[plan.prefill.replica].rack == "rack0" else KEYS[1]
    half = tuple(req.block_hashes[:64])
    engine.index.apply(EventBatch(other, (BlocksStored(half),)))
    engine.index.apply(EventBatch(other, (BlocksStored(half[-1:], kind=Kind.STATE),)))
    pick = pd.pick_decode(engine, req, plan.prefill.replica, KEYS, 0.0, rng)
    assert pick.decision.replica != other  # a cross-rack penalty outweighs half the bytes
    cross = Disaggregator(
        PdKnobs(mode="always", rack_penalty_s=0.0), pd.cost, roles=roles, sites=SITES
    )
    pick = cross.pick_decode(engine, req, plan.prefill.replica, KEYS, 0.0, rng)
    if pick.decision.replica == other:
        assert pick.link is Link.NETWORK
        assert pick.transfer_bytes == pd.sizes.total(8192 - 64 * BLOCK, hybrid=True)


def _pick(
    pd: Disaggregator,
    engine: RoutingEngine,
    request: RouteRequest,
    prefill: ReplicaKey,
    keys: tuple[ReplicaKey, ...],
    seed: int,
) -> object:
    rng = random.Random(seed)
    try:
        pick = pd.pick_decode(engine, request, prefill, keys, 100.0, rng)
    except NoReplicaAvailable as exc:
        return ("refused", str(exc), exc.busy)
    return pick, rng.random()  # the same draws were made


@pytest.mark.parametrize("seed", range(200))
def test_the_array_decode_pick_decides_as_the_per_candidate_one(seed: int) -> None:
    """Random fleets (roles, regions, racks with and without names, cached tiers and state,
    load, unhealthy / draining / busy replicas, a replica named twice): the columnar decode
    pick returns the same replica, score, tokens, transfer, link and ranking, and makes the
    same random draws, as the per-candidate one."""
    from tests.test_routing_columns import _busy, _fleet, _populate

    rng = random.Random(seed)
    index, load, keys = _fleet(rng, rng.randrange(1, 40))
    chain = [rng.getrandbits(63) for _ in range(rng.randrange(1, 12))]
    _populate(rng, index, load, keys, chain, 100.0)
    if rng.random() < 0.3:
        keys = keys + keys[: rng.randrange(1, 4)]
    roles = {k: rng.choice([Role.PREFILL, Role.DECODE, Role.BOTH]) for k in keys}
    sites = {
        k: Site(rng.choice(["reg0", "reg1"]), rng.choice(["", "rack0", "rack1", "rack2"]))
        for k in keys
        if rng.random() < 0.9  # the rest: a site of their own
    }
    hybrid = rng.random() < 0.5
    settings = RoutingSettings(block_size=rng.choice([16, 64]), hybrid=hybrid, busy=_busy(rng))
    policy = make_policy("ours")
    per_candidate = RoutingEngine(index, load, policy, settings, columnar_min=10**9)
    arrays = RoutingEngine(index, load, policy, settings, columnar_min=1)
    knobs = PdKnobs(rack_penalty_s=rng.choice([0.0, 2.0]), region_penalty_s=rng.choice([0.0, 10.0]))
    sizes = TransferSizes(state_bytes=rng.choice([0.0, 24e6]))
    pd = Disaggregator(knobs, CostModel(), roles=roles, sites=sites, sizes=sizes)
    for step in range(3):
        tokens = len(chain) * settings.block_size + rng.randrange(0, settings.block_size)
        prompt = rng.choice([tokens, 1, rng.randrange(1, tokens + 1)])
        blocks = min(len(chain), prompt // settings.block_size)
        request = RouteRequest(
            f"q{step}", "m", prompt, chain[:blocks], settings.block_size, None,
            rng.choice([None, 3, 300]),
        )  # fmt: skip
        prefill = rng.choice(keys)
        decided = _pick(pd, arrays, request, prefill, keys, seed)
        assert decided == _pick(pd, per_candidate, request, prefill, keys, seed)
        load.dispatch(f"m{step}", rng.choice(keys), rng.randrange(1, 5000), 0)


def test_a_decode_leg_counts_the_blocks_it_receives_in_its_replicas_turnover() -> None:
    """The decode replica stores the prompt blocks it pulls (all but its own hit) as a local
    prefill would have: they evict as many of its cached blocks, so the cache turnover
    meter (router/core/turnover.py, fed by each dispatch's uncached blocks) counts them.
    Before, the decode leg was recorded as a whole-prompt hit there and counted nothing: a
    decode replica taking every remote prefill looked as calm as an idle one."""
    rng = random.Random(0)
    roles = {KEYS[0]: Role.PREFILL, KEYS[1]: Role.DECODE, KEYS[2]: Role.PREFILL}
    roles[KEYS[3]] = Role.DECODE
    engine, pd = _fleet("always", roles)
    engine.turnover.sample(0.0, KEYS, lambda k: 0, lambda k: 0)  # meters for every replica
    req = _request("t", 8192)
    plan = pd.plan(engine, req, KEYS, 0.0, rng)
    assert plan.prefill is not None
    engine.dispatched(pd.prefill_request(req), plan.prefill, 0.0)
    pick = pd.pick_decode(engine, req, plan.prefill.replica, KEYS, 0.0, rng)
    dispatch = pd.dispatched_decode(engine, req, pick.decision, 0.0)
    meters = engine.turnover._meters
    assert meters[plan.prefill.replica].sent == 8192 / BLOCK
    assert meters[pick.decision.replica].sent == (8192 - pick.decision.usable_tokens) / BLOCK
    # its load is still a prefill-free arrival: the whole prompt came computed
    assert engine.load.view(pick.decision.replica, 0.0).queued_prefill_tokens <= 1
    assert dispatch.replica == pick.decision.replica


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_a_fleet_without_prefill_replicas_counts_no_prefill_replica(mode: str) -> None:
    """Every prefill-capable replica gone (deregistered, or a fleet of decode replicas):
    the request is prefilled where it is decoded, for the reason docs/pd.md names,
    ``no_prefill_replica``, as when the prefill replicas are all out of rotation. Before,
    it was counted as ``off`` in ``kvrouter_pd_decisions_total`` though the mode was on."""
    rng = random.Random(0)
    engine, pd = _fleet(mode, dict.fromkeys(KEYS, Role.DECODE))
    plan = pd.plan(engine, _request("np", 64_000), KEYS, 0.0, rng)
    assert not plan.remote and plan.local is not None
    assert plan.reason == "no_prefill_replica"
    engine, pd = _fleet("off", dict.fromkeys(KEYS, Role.DECODE))
    assert pd.plan(engine, _request("np2", 64_000), KEYS, 0.0, rng).reason == "off"
