"""Prefill/decode disaggregation: replica roles, the link between two replicas, the bytes a
remote prefill moves, and the per-request decision to disaggregate. Pure: the simulator and
the service (router/service/disagg.py) run this same code.

A request is *disaggregated* when one replica (role ``prefill`` or ``both``) computes its
prompt and another (role ``decode`` or ``both``) receives the prompt's KV, plus the recurrent
(KDA / mamba) state at the prompt end for a hybrid model, and decodes. vLLM's protocol
(docs/pd.md): the prefill replica answers a ``max_tokens: 1`` request whose
``kv_transfer_params`` ask for a remote decode; the decode replica gets the original request
with the answer's ``kv_transfer_params`` and pulls the blocks it does not hold itself.

The decision (:meth:`Disaggregator.plan`), per request, under ``mode``:

* ``off``: never; the policy routes among the replicas that can decode (the service
  builds no Disaggregator for such a model: it routes among all replicas, roles ignored).
* ``always``: always, whenever a prefill replica and a decode replica exist.
* ``auto``: remote prefill only when it pays: at least ``min_uncached_tokens`` of the prompt
  are not usable-cached where it would run locally, the local usable hit is at most
  ``max_local_hit`` of the prompt, and the predicted cost of the remote path (prefill queue +
  prefill on the prefill replica + transfer) is below the local one (queue + prefill on the
  decode replica + ``w_interference`` x the TPOT budget that prefill takes from the decoders
  running there: a busy decode side). Otherwise local prefill.

The prefill replica is the policy's choice among prefill-capable replicas (usable hit, KV and
state checkpoint, against load); the decode replica (:meth:`Disaggregator.pick_decode`) the
cheapest decode-capable one by the request's predicted decode time there, pending prefill
stalls, transfer time over the link from the prefill replica, and the rack / region
penalties: a decode replica in the prefill replica's NVL72 rack is preferred, another region
is a last resort.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from router.core.eligibility import eligible_columns, filter_candidates
from router.core.errors import ConfigError, NoReplicaAvailable
from router.core.load import EXPECTED_OUTPUT_TOKENS, CostModel
from router.core.routing import Dispatch, RoutingEngine
from router.core.types import NO_MATCH, Decision, ReplicaKey, RouteRequest
from router.core.xp import ARRAY, SCALAR, Ops

PD_MODES = ("off", "always", "auto")

# The prefill leg of a disaggregated request decodes nothing: recorded with this output
# length its decode weight (router/core/load.py) is ~0, so it does not look like a fragile
# decoder to the interference term.
PREFILL_LEG_OUTPUT = 1 << 30


class Role(enum.Enum):
    """What a replica does in a disaggregated fleet."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL

    @classmethod
    def parse(cls, text: str | None) -> Role:
        """``prefill`` / ``decode`` / ``both`` (None or empty: both); else ConfigError."""
        if not text:
            return cls.BOTH
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ConfigError(f"role must be prefill, decode or both, not {text!r}") from None


@dataclass(slots=True, frozen=True)
class Site:
    """Where a replica runs: its region and its rack (an NVL72 domain) in that region."""

    region: str = ""
    rack: str = ""


NO_SITE = Site()
"""Where a replica no site is known for runs: a site of its own (no rack)."""


class Link(enum.Enum):
    """The path KV takes between two replicas."""

    SAME = "same"  # the same replica: nothing moves
    NVLINK = "nvlink"  # same rack: NVLink switch fabric
    NETWORK = "network"  # same region, another rack: the scale-out network (RDMA)
    REGION = "region"  # another region: the data-centre interconnect


LINKS: tuple[Link, ...] = (Link.SAME, Link.NVLINK, Link.NETWORK, Link.REGION)
"""The links by code (``LinkModel.link_code``; the order of ``Disaggregator._link_tables``)."""


@dataclass(slots=True, frozen=True)
class LinkModel:
    """Bandwidth (bytes/s, per replica of 8 GPUs) and latency (s) of each link.

    Sources (order of magnitude, not measured here): NVIDIA GB300 NVL72: NVLink 5 at 1.8 TB/s
    per GPU inside the rack (8 GPUs a replica: 14.4 TB/s; ~10 TB/s taken as achievable);
    ConnectX-8 SuperNIC, 800 Gb/s per GPU across racks, ~50 GB/s a GPU achieved by RDMA
    KV transfer engines (NIXL / Mooncake transfer-engine reports): 400 GB/s a replica, plus a
    connection/setup latency; between regions a few 100 Gb/s DCI links shared by the fleet
    (10 GB/s, tens of ms). Override from configuration or the simulator's profile."""

    nvlink_bytes_per_s: float = 10e12
    nvlink_latency_s: float = 20e-6
    network_bytes_per_s: float = 400e9
    network_latency_s: float = 200e-6
    region_bytes_per_s: float = 10e9
    region_latency_s: float = 0.03

    def __post_init__(self) -> None:
        if min(self.nvlink_bytes_per_s, self.network_bytes_per_s, self.region_bytes_per_s) <= 0:
            raise ConfigError("link bandwidths must be positive")
        if min(self.nvlink_latency_s, self.network_latency_s, self.region_latency_s) < 0:
            raise ConfigError("link latencies must be >= 0")

    @staticmethod
    def link(a: Site, b: Site, same_replica: bool = False) -> Link:
        return LINKS[LinkModel.link_code(a, b, same_replica)]

    @staticmethod
    def link_code(a: Site, b: Site, same_replica: bool = False) -> int:
        """The link between ``a`` and ``b`` as its position in ``LINKS`` (a plain int: a
        large fleet's decode pick codes every candidate)."""
        if same_replica:
            return 0
        if a.region != b.region:
            return 3
        if a.rack and a.rack == b.rack:
            return 1
        return 2

    def seconds(self, link: Link, nbytes: float) -> float:
        """Time to move ``nbytes`` over ``link`` (0 for nothing or the same replica)."""
        latency, bandwidth = self.tables()
        code = LINKS.index(link)
        return float(self.transfer_s(latency[code], bandwidth[code], nbytes))

    def tables(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Latency (s) and bandwidth (bytes/s) of each link, in ``LINKS`` order (nothing
        moves to the same replica: no latency, no limit)."""
        return (
            (0.0, self.nvlink_latency_s, self.network_latency_s, self.region_latency_s),
            (math.inf, self.nvlink_bytes_per_s, self.network_bytes_per_s, self.region_bytes_per_s),
        )

    @staticmethod
    def transfer_s(latency: Any, bandwidth: Any, nbytes: Any) -> Any:
        """Time to move ``nbytes`` over a link of ``latency`` and ``bandwidth`` (0 when
        nothing moves): on numbers or on arrays alike."""
        return (nbytes > 0) * (latency + nbytes / bandwidth)


@dataclass(slots=True, frozen=True)
class TransferSizes:
    """What a remote prefill moves: ``kv_bytes_per_token`` of attention KV for every prompt
    token the decode replica does not hold, plus ``state_bytes`` of recurrent state (the
    KDA / mamba layers' state at the prompt end; 0 for a dense model). The kimi-k3 profile:
    9.2 KB/token of MLA latent KV and ~24 MB of KDA state (sim/profiles/kimi-k3.toml)."""

    kv_bytes_per_token: float = 9216.0
    state_bytes: float = 24e6

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 0 or self.state_bytes < 0:
            raise ConfigError("transfer sizes must be >= 0")

    def kv_bytes(self, tokens: Any, xp: Ops = SCALAR) -> Any:
        return xp.maximum(tokens, 0) * self.kv_bytes_per_token

    def total(self, tokens: Any, hybrid: bool, xp: Ops = SCALAR) -> Any:
        """Bytes moved for ``tokens`` of KV (and the state, for a hybrid model); ``tokens``
        a number or an array (``xp``)."""
        return self.kv_bytes(tokens, xp) + (self.state_bytes if hybrid else 0.0)


def keep_local_reason(
    endpoint: str,
    samples: int = 1,
    prompts: int = 1,
    prompt_logprobs: bool = False,
    beam_search: bool = False,
) -> str:
    """Why vLLM 0.34's protocol cannot carry a request from a prefill replica to a decode
    one ('' when it can), from what it is: its ``endpoint`` (the API: ``messages``,
    ``responses``, else chat or completions, as router/recorder.py names them), the
    sequences it samples (``n``), the prompts it sends together (a completions batch),
    whether it asks prompt logprobs and whether it is a beam search. The one rule: the
    service applies it to a parsed body (router/service/disagg.py ``keep_local``), the
    simulator to a recorded row.

    * ``messages_api``: an Anthropic Messages API request; the router's prefill leg rewrites
      OpenAI fields (``max_tokens``, ``stream_options``) and reads an OpenAI answer, so these
      are served where they are routed;
    * ``responses_api``: an OpenAI Responses API request, for the same reason (its answer is
      not a chat completion's);
    * ``beam_search``: ``use_beam_search``; vLLM runs a beam search as its own one-token
      requests, which carry no ``kv_transfer_params``
      (``entrypoints/generate/beam_search/online.py``), so the prefill leg would answer
      none, its prefill wasted;
    * ``parallel_sampling``: ``n`` > 1; the connector hands over one sequence's blocks;
    * ``batch_prompts``: a completion of several prompts; vLLM answers the first prompt's
      ``kv_transfer_params`` only (``openai/completion/serving.py``), and the decode leg
      would pull that prompt's blocks for every prompt of the batch;
    * ``prompt_logprobs``: vLLM then reads no prefix cache and no transferred KV
      (``Request.skip_reading_external_kv``), so the decode replica would prefill the whole
      prompt again."""
    if endpoint == "messages":
        return "messages_api"
    if endpoint == "responses":
        return "responses_api"
    if beam_search:
        return "beam_search"
    if samples > 1:
        return "parallel_sampling"
    if prompts > 1:
        return "batch_prompts"
    if prompt_logprobs:
        return "prompt_logprobs"
    return ""


@dataclass(slots=True, frozen=True)
class PdKnobs:
    """The decision's settings (module doc); ``sim tune`` searches them."""

    mode: str = "auto"
    min_uncached_tokens: int = 4096
    max_local_hit: float = 0.5
    w_interference: float = 4.0
    tpot_target_s: float = 0.1
    margin_s: float = 0.0
    rack_penalty_s: float = 2.0
    region_penalty_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in PD_MODES:
            raise ConfigError(f"pd mode must be one of {', '.join(PD_MODES)}, not {self.mode!r}")
        if self.min_uncached_tokens < 0 or not 0.0 <= self.max_local_hit <= 1.0:
            raise ConfigError("min_uncached_tokens >= 0 and max_local_hit in [0, 1]")
        if self.tpot_target_s <= 0:
            raise ConfigError("tpot_target_s must be positive")


class PdPlan(NamedTuple):
    """``prefill`` None: prefill locally on ``local`` (the plain decision). Else prefill on
    ``prefill.replica`` and decode where :meth:`Disaggregator.pick_decode` says, once the
    prefill is done. ``reason`` names the rule that decided (exported as a label)."""

    local: Decision | None
    prefill: Decision | None
    reason: str

    @property
    def remote(self) -> bool:
        return self.prefill is not None


class DecodePick(NamedTuple):
    """The decode replica of a disaggregated request and what reaching it costs."""

    decision: Decision
    link: Link
    transfer_bytes: float
    transfer_s: float


class Disaggregator:
    """Roles and sites of one model's replicas, plus the decision (module doc). Replicas
    missing from ``roles`` are ``both``; from ``sites``, a site of their own (no rack)."""

    def __init__(
        self,
        knobs: PdKnobs,
        cost: CostModel,
        *,
        roles: Mapping[ReplicaKey, Role] | None = None,
        sites: Mapping[ReplicaKey, Site] | None = None,
        link: LinkModel | None = None,
        sizes: TransferSizes | None = None,
    ) -> None:
        self.knobs = knobs
        self.cost = cost
        self.roles: Mapping[ReplicaKey, Role] = roles if roles is not None else {}
        self.sites: Mapping[ReplicaKey, Site] = sites if sites is not None else {}
        self.link = link or LinkModel()
        self.sizes = sizes or TransferSizes()

    def role(self, key: ReplicaKey) -> Role:
        return self.roles.get(key, Role.BOTH)

    def site(self, key: ReplicaKey) -> Site:
        return self.sites.get(key, NO_SITE)

    def pools(
        self, replicas: Sequence[ReplicaKey]
    ) -> tuple[list[ReplicaKey], list[ReplicaKey], list[ReplicaKey]]:
        """(prefill-capable, decode-capable, both) replicas, in ``replicas`` order."""
        get, both_role = self.roles.get, Role.BOTH
        pre: list[ReplicaKey] = []
        dec: list[ReplicaKey] = []
        both: list[ReplicaKey] = []
        for r in replicas:
            role = get(r, both_role)
            if role is both_role:
                pre.append(r)
                dec.append(r)
                both.append(r)
            elif role is Role.PREFILL:
                pre.append(r)
            else:
                dec.append(r)
        return pre, dec, both

    # ------------------------------------------------------------------ the decision

    def plan(
        self,
        engine: RoutingEngine,
        request: RouteRequest,
        replicas: Sequence[ReplicaKey],
        now: float,
        rng: random.Random,
        *,
        keep_local: str = "",
    ) -> PdPlan:
        """Local or remote prefill for ``request`` (module doc). Raises NoReplicaAvailable
        when no replica can serve it either way. ``keep_local``: why vLLM's protocol cannot
        carry the request ('' when it can; ``keep_local_reason``'s: docs/pd.md); such a
        request is routed as a local one, with that reason."""
        mode = self.knobs.mode
        pre, dec, both = self.pools(replicas)
        if not dec:
            raise NoReplicaAvailable("no replica can decode")
        local_pool = both if mode != "off" else dec
        if mode == "off":
            return PdPlan(engine.route(request, dec, now, rng), None, "off")
        if not pre:  # no replica prefills (and none does both): decode replicas prefill
            reason = keep_local or "no_prefill_replica"
            return PdPlan(engine.route(request, dec, now, rng), None, reason)
        local: Decision | None = None
        if local_pool:
            try:
                local = engine.route(request, local_pool, now, rng)
            except NoReplicaAvailable:
                local = None
        if keep_local:
            if local is None:
                local = engine.route(request, dec, now, rng)
            return PdPlan(local, None, keep_local)
        if mode == "auto" and local is not None:
            reason = self._keep_local(request, local)
            if reason:
                return PdPlan(local, None, reason)
        try:
            prefill = engine.route(self.prefill_request(request), pre, now, rng)
        except NoReplicaAvailable:
            # no prefill replica can take it: prefilled where it is decoded (a decode-only
            # replica can prefill too: the fallback vLLM's protocol allows)
            if local is None:
                local = engine.route(request, dec, now, rng)
            return PdPlan(local, None, "no_prefill_replica")
        if mode == "auto" and local is not None:
            if prefill.replica == local.replica:
                return PdPlan(local, None, "same_replica")
            if not self._pays(request, local, prefill, engine, now):
                return PdPlan(local, None, "cheaper_local")
        return PdPlan(local, prefill, "always" if mode == "always" else "remote_pays")

    @staticmethod
    def prefill_request(request: RouteRequest) -> RouteRequest:
        """The prefill leg as the policies and the load tracker see it."""
        return request._replace(
            request_id=request.request_id + "#p", max_output_tokens=PREFILL_LEG_OUTPUT
        )

    def _keep_local(self, request: RouteRequest, local: Decision) -> str:
        """Why the request stays local before looking at prefill replicas ('' if none)."""
        k = self.knobs
        uncached = request.prompt_tokens - local.usable_tokens
        if uncached < k.min_uncached_tokens:
            return "few_uncached"
        if local.usable_tokens > k.max_local_hit * request.prompt_tokens:
            return "local_hit"
        return ""

    def _pays(
        self,
        request: RouteRequest,
        local: Decision,
        prefill: Decision,
        engine: RoutingEngine,
        now: float,
    ) -> bool:
        """Remote cost (queue + prefill there + transfer) below the local one (queue +
        prefill + the decoders' TPOT budget that prefill takes) by ``margin_s``."""
        cost, k = self.cost, self.knobs
        prompt = request.prompt_tokens
        lv = engine.load.view(local.replica, now)
        local_prefill = cost.prefill_s(prompt - local.usable_tokens, local.usable_tokens)
        local_queue = cost.prefill_s(lv.queued_prefill_tokens)
        interference = local_prefill * lv.decode_weight / k.tpot_target_s
        local_cost = local_queue + local_prefill + k.w_interference * interference
        pv = engine.load.view(prefill.replica, now)
        remote_prefill = cost.prefill_s(prompt - prefill.usable_tokens, prefill.usable_tokens)
        link = self.link.link(self.site(prefill.replica), self.site(local.replica))
        hybrid = engine.layout.hybrid
        moved = self.link.seconds(link, self.sizes.total(prompt - local.usable_tokens, hybrid))
        remote_cost = cost.prefill_s(pv.queued_prefill_tokens) + remote_prefill + moved
        return bool(remote_cost + k.margin_s < local_cost)

    def pick_decode(
        self,
        engine: RoutingEngine,
        request: RouteRequest,
        prefill_replica: ReplicaKey,
        replicas: Sequence[ReplicaKey],
        now: float,
        rng: random.Random,
    ) -> DecodePick:
        """The decode replica for ``request`` whose prompt ``prefill_replica`` computed:
        the lowest predicted decode time of the request there (step time x its output
        tokens, 256 when unknown) + the pending prefills that will stall it + transfer +
        rack / region penalty, all in seconds. Ties go to the rng. Raises NoReplicaAvailable
        when none can decode. From ``engine.columnar_min`` decode-capable replicas on, the
        scores are arrays (the same formula, :meth:`_decode_scores`, and the same pick)."""
        _, dec, _ = self.pools(replicas)
        if not dec:
            raise NoReplicaAvailable("no replica can decode")
        hybrid = engine.hybrid_for(replicas)
        matches = engine.matches(request, replicas, now)
        here = self.site(prefill_replica)
        code_of, site = self.link.link_code, self.site
        if len(dec) >= engine.columnar_min:
            load = engine.load.columns(dec)
            at = np.flatnonzero(eligible_columns(load, engine.settings.busy))
            keys = [dec[i] for i in at]
            codes = np.fromiter(
                (code_of(here, site(k), k == prefill_replica) for k in keys),
                dtype=np.intp,
                count=len(keys),
            )
            latency, bandwidth, penalty = (np.asarray(t)[codes] for t in self._link_tables())
            usable_blocks = matches.columns(engine.index.slots(dec))[3][at]
            scores, usable, nbytes, move_s = self._decode_scores(
                ARRAY, request, hybrid, usable_blocks, load.decoding[at],
                load.decode_context_tokens[at], load.queued_prefill_tokens[at],
                (codes == 0).astype(np.int64), latency, bandwidth, penalty,
            )  # fmt: skip
            ties = np.flatnonzero(scores == scores.min())
            j = int(ties[rng.randrange(len(ties))])
            order = np.argsort(scores, kind="stable")
            ranking = tuple(keys[i] for i in order.tolist() if keys[i] != keys[j])
            pick = (
                float(scores[j]), keys[j], int(usable[j]), float(nbytes[j]), float(move_s[j]),
                int(codes[j]),
            )  # fmt: skip
        else:
            tables = self._link_tables()
            best: list[tuple[float, ReplicaKey, int, float, float, int]] = []
            scored: list[tuple[float, ReplicaKey]] = []
            for key, view in filter_candidates(dec, engine.load, engine.settings.busy, now):
                code = code_of(here, site(key), key == prefill_replica)
                score, use, moved, secs = self._decode_scores(
                    SCALAR, request, hybrid, matches.get(key, NO_MATCH).usable_blocks,
                    view.decoding, view.decode_context_tokens, view.queued_prefill_tokens,
                    int(code == 0), tables[0][code], tables[1][code], tables[2][code],
                )  # fmt: skip
                scored.append((score, key))
                if not best or score < best[0][0]:
                    best = [(score, key, use, moved, secs, code)]
                elif score == best[0][0]:
                    best.append((score, key, use, moved, secs, code))
            pick = best[rng.randrange(len(best))]
            ranking = tuple(r for _, r in sorted(scored, key=lambda t: t[0]) if r != pick[1])
        score, key, use, moved, secs, code = pick
        decision = Decision(
            key,
            "pd_decode",
            use,
            use,
            score,
            {"transfer_s": secs, "transfer_bytes": moved},
            ranking,
        )
        return DecodePick(decision, LINKS[code], moved, secs)

    def retry_transfer(
        self,
        engine: RoutingEngine,
        request: RouteRequest,
        prefill_replica: ReplicaKey,
        key: ReplicaKey,
        replicas: Sequence[ReplicaKey],
    ) -> tuple[Link, float]:
        """The link and bytes of ``request``'s pull from ``prefill_replica`` by ``key``, a
        decode replica the decode leg was retried on: no usable hit is known there (as the
        retry's dispatch records it), so the whole prompt (and the state) moves."""
        same = key == prefill_replica
        link = self.link.link(self.site(prefill_replica), self.site(key), same)
        hybrid = engine.hybrid_for(replicas)
        return link, 0.0 if same else float(self.sizes.total(request.prompt_tokens, hybrid))

    def _link_tables(
        self,
    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """Latency (s), bandwidth (bytes/s) and placement penalty (s) of each link, in
        ``LINKS`` order (``LinkModel.tables``)."""
        k = self.knobs
        latency, bandwidth = self.link.tables()
        return latency, bandwidth, (0.0, 0.0, k.rack_penalty_s, k.region_penalty_s)

    def _decode_scores(
        self,
        xp: Ops,
        request: RouteRequest,
        hybrid: bool,
        usable_blocks: Any,
        decoding: Any,
        context_tokens: Any,
        queued_prefill_tokens: Any,
        same: Any,
        latency: Any,
        bandwidth: Any,
        penalty: Any,
    ) -> tuple[Any, Any, Any, Any]:
        """Score, usable tokens, bytes moved and transfer seconds of decoding ``request`` on
        one candidate (numbers, ``xp=SCALAR``) or on many (arrays, ``xp=ARRAY``): one
        formula for both. ``same``: 1 where the candidate is the prefill replica itself;
        ``latency`` / ``bandwidth`` / ``penalty``: its link's (``_link_tables``)."""
        cost = self.cost
        prompt = request.prompt_tokens
        out = request.max_output_tokens or EXPECTED_OUTPUT_TOKENS
        usable = xp.minimum(usable_blocks * request.block_size, prompt)
        nbytes = (1 - same) * self.sizes.total(prompt - usable, hybrid, xp)
        move_s = self.link.transfer_s(latency, bandwidth, nbytes)
        step = cost.step_overhead_s + cost.decode_step_s(decoding + 1, context_tokens + prompt)
        stall = cost.prefill_s(queued_prefill_tokens, 0, xp)
        return step * out + stall + move_s + penalty, usable, nbytes, move_s

    @staticmethod
    def dispatched_decode(
        engine: RoutingEngine,
        request: RouteRequest,
        decision: Decision,
        now: float,
        speculative_ttl_s: float | None = None,
        exact: bool = True,
        *,
        class_weight: float = 1.0,
    ) -> Dispatch:
        """Record the decode leg sent per ``decision`` (its replica and its own usable hit:
        a :class:`DecodePick`'s, or none known for a retry on another replica) as
        ``RoutingEngine.dispatched`` records a request: its whole prompt arrives computed
        (load), the decode replica will hold it (speculative entries when the TTL is > 0)
        and is the session's replica for its next turn (it also holds the answer). Returns
        what was guessed (``RoutingEngine.withdraw``). The blocks it pulls (all but its own
        usable hit) are stored there as a local prefill's would be, evicting as many: the
        cache turnover meter counts them."""
        # (no terms: the policy's figures of a prefill there, which this leg does not run)
        whole = decision._replace(usable_tokens=request.prompt_tokens, terms={})
        dispatch = engine.dispatched(
            request, whole, now, speculative_ttl_s, class_weight=class_weight, exact=exact
        )
        pulled = request.prompt_tokens - decision.usable_tokens
        engine.turnover.dispatched(decision.replica, pulled / request.block_size)
        return dispatch


@dataclass(slots=True, frozen=True)
class PdSetup:
    """A model's disaggregation settings as configured (``[models.NAME.pd]``): the decision's
    knobs, the link model and the transfer sizes, from one flat table."""

    knobs: PdKnobs = PdKnobs()
    link: LinkModel = LinkModel()
    sizes: TransferSizes = TransferSizes()

    @classmethod
    def from_mapping(cls, table: Mapping[str, object], tpot_target_s: float) -> PdSetup:
        """Keys of PdKnobs (but ``tpot_target_s``: the model's), LinkModel and TransferSizes;
        unknown keys or bad values raise ConfigError."""
        parts: dict[type, dict[str, object]] = {PdKnobs: {}, LinkModel: {}, TransferSizes: {}}
        for key, value in table.items():
            for kind, into in parts.items():
                if key in {f.name for f in fields(kind)} and key != "tpot_target_s":
                    into[key] = value
                    break
            else:
                raise ConfigError(f"unknown pd setting {key!r}")
        try:
            return cls(
                PdKnobs(**parts[PdKnobs], tpot_target_s=tpot_target_s),  # type: ignore[arg-type]
                LinkModel(**parts[LinkModel]),  # type: ignore[arg-type]
                TransferSizes(**parts[TransferSizes]),  # type: ignore[arg-type]
            )
        except TypeError as exc:
            raise ConfigError(f"pd settings: {exc}") from None
