"""Prefill/decode disaggregation through the router: which requests, and where (docs/pd.md).

For a model with ``[models.NAME.pd]`` (mode ``always`` or ``auto``) the front door asks
:func:`route` instead of ``RouterState.route``. The decision is router/core/disagg.py's
(``Disaggregator.plan``): a local request is routed among the replicas that prefill and decode
(role ``both``) and forwarded as usual; a disaggregated one (:class:`PdFlow`) is served by
router/service/pd_serve.py ``serve``, with vLLM's protocol. :func:`keep_local` says which
requests that protocol cannot carry; :func:`build` makes a model's disaggregator, and
:class:`ModelDisagg` keeps its counters (exported by router/service/pd_metrics.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from router.core.disagg import (
    PREFILL_LEG_OUTPUT,
    Disaggregator,
    PdSetup,
    Role,
    Site,
    keep_local_reason,
)
from router.core.load import CostModel
from router.core.types import ReplicaKey, RouteRequest
from router.service.registry import ReplicaRegistry
from router.service.settings import ModelSettings
from router.service.state import Routed, RouterState, route_request
from router.tokenize.lax import INVALID, lax_bool, lax_int
from router.tokenize.request_fields import asks_prompt_logprobs


class _Roles(Mapping[ReplicaKey, Role]):
    """The registry's replicas' roles, read where they are kept (no copy to go stale)."""

    def __init__(self, registry: ReplicaRegistry) -> None:
        self._registry = registry

    def __getitem__(self, key: ReplicaKey) -> Role:
        ep = self._registry.endpoint(key)
        if ep is None:
            raise KeyError(key)
        return Role(ep.role)

    def __iter__(self) -> Iterator[ReplicaKey]:
        return (ep.key for ep in self._registry.endpoints())

    def __len__(self) -> int:
        return len(self._registry.endpoints())


class _Sites(Mapping[ReplicaKey, Site]):
    def __init__(self, registry: ReplicaRegistry) -> None:
        self._registry = registry

    def __getitem__(self, key: ReplicaKey) -> Site:
        ep = self._registry.endpoint(key)
        if ep is None:
            raise KeyError(key)
        return Site(ep.region or "", ep.rack or "")

    def __iter__(self) -> Iterator[ReplicaKey]:
        return (ep.key for ep in self._registry.endpoints())

    def __len__(self) -> int:
        return len(self._registry.endpoints())


@dataclass(slots=True)
class ModelDisagg:
    """One model's disaggregator and its counters (exported by router/service/pd_metrics.py
    ``PdCollector``)."""

    pd: Disaggregator
    decisions: dict[str, int] = field(default_factory=dict)  # by the plan's reason
    fallbacks: dict[str, int] = field(default_factory=dict)  # prefill failures by cause
    bytes_by_link: dict[str, float] = field(default_factory=dict)
    # prefill blocks handed back when no decode replica got them, by outcome (pd_release)
    releases: dict[str, int] = field(default_factory=dict)
    releasing: set[asyncio.Task[None]] = field(default_factory=set)  # (running)

    def count(self, table: dict[str, Any], key: str, n: float = 1) -> None:
        table[key] = table.get(key, 0) + n


def build(model: ModelSettings, registry: ReplicaRegistry) -> ModelDisagg | None:
    """The model's disaggregator (None when its ``pd`` is off), predicting with the cost
    model of its ``ours`` parameters (defaults otherwise)."""
    setup: PdSetup | None = model.pd
    if setup is None:
        return None
    cost_params = model.policy_params.get("cost") or {}
    cost = CostModel(**cost_params) if isinstance(cost_params, Mapping) else CostModel()
    pd = Disaggregator(
        setup.knobs,
        cost,
        roles=_Roles(registry),
        sites=_Sites(registry),
        link=setup.link,
        sizes=setup.sizes,
    )
    return ModelDisagg(pd)


class PdFlow(NamedTuple):
    """A disaggregated request after planning: ``routed`` is its prefill leg (dispatched on
    the prefill replica under ``<id>#p``); ``request`` the client's request."""

    routed: Routed
    request: RouteRequest
    model: ModelDisagg


def route(
    state: RouterState,
    md: ModelDisagg,
    model: str,
    prompt: Any,
    request_id: str,
    now: float,
    *,
    session_id: str | None,
    max_output_tokens: int | None,
    keep_local: str = "",
) -> Routed | PdFlow:
    """Plan the request: a ``Routed`` to forward as usual (local prefill), or a
    :class:`PdFlow` for router/service/pd_serve.py ``serve`` (never when ``keep_local``
    names why vLLM's protocol cannot carry it: :func:`keep_local`). Raises KVRouterError
    like ``RouterState.route``."""
    engine = state.engines[model]
    state.fleet.restore_health(now)
    request = route_request(model, prompt, request_id, session_id, max_output_tokens)
    keys = state.registry.keys_for(model)
    plan = md.pd.plan(engine, request, keys, now, state.rng, keep_local=keep_local)
    md.count(md.decisions, plan.reason)
    if plan.prefill is None:
        assert plan.local is not None
        routed = state.route(
            model,
            prompt,
            request_id,
            now,
            session_id=session_id,
            max_output_tokens=max_output_tokens,
            replicas=(plan.local.replica,),
        )
        # retries go to the next replicas of the plan's local pool, as without disaggregation
        decision = routed.decision._replace(ranking=plan.local.ranking)
        return routed._replace(decision=decision)
    leg = state.route(
        model,
        prompt,
        request_id + "#p",
        now,
        session_id=session_id,
        max_output_tokens=PREFILL_LEG_OUTPUT,
        replicas=(plan.prefill.replica,),
    )
    return PdFlow(leg, request, md)


def keep_local(body: dict[str, Any], kind: str, max_output_tokens: int | None = None) -> str:
    """Why vLLM 0.34's protocol cannot carry this request of ``kind`` (``chat`` /
    ``completion`` / ``messages`` / ``responses``) from a prefill replica to a decode one
    ('' when it can): router.core.disagg.keep_local_reason (the reasons, shared with the
    simulator) of what the parsed body asks. ``n`` is read as vLLM reads it ("2" and 2.0
    are 2); a completion's ``prompt`` list is a batch unless it is one prompt of token ids;
    prompt logprobs: ``prompt_logprobs``, or ``echo`` with chat's ``top_logprobs`` /
    completions' ``logprobs``; ``use_beam_search`` read as vLLM reads a bool ("on" is
    true). A body vLLM refuses for a field the prefill leg overrides is kept local too
    (:data:`INVALID_BODY`; ``max_output_tokens``: the request's output limit as
    router/service/intake.py ``max_output_tokens`` reads it)."""
    if kind in ("chat", "completion") and _refused_under_prefill_caps(body, max_output_tokens):
        return INVALID_BODY
    n = lax_int(body.get("n"))
    samples = n if type(n) is int else 1
    prompt = body.get("prompt") if kind == "completion" else None
    batch = isinstance(prompt, list) and len(prompt) > 1 and not _token_ids(prompt)
    return keep_local_reason(
        kind,
        samples,
        len(prompt) if batch and isinstance(prompt, list) else 1,
        asks_prompt_logprobs(body, kind),
        lax_bool(body.get("use_beam_search")) is True,
    )


INVALID_BODY = "invalid_body"
"""The reason a body vLLM 0.34 refuses for a field the prefill leg overrides (``stream_options``,
``min_tokens``: router/service/pd_serve.py) stays local: the leg's own values would make it
valid there, so the prefill replica would compute the whole prompt for a decode leg its
engine then refuses (at request validation, before ``_with_kv_transfer_rejection_cleanup``
could hand the blocks back: they wait for the KV lease); served whole, one replica refuses
it, as vLLM does."""
_STREAM_FLAGS = ("include_usage", "continuous_usage_stats")


def _refused_under_prefill_caps(body: dict[str, Any], max_output_tokens: int | None) -> bool:
    """Whether vLLM 0.34 refuses this chat / completion body for ``stream_options`` or
    ``min_tokens``, which the prefill leg overrides: ``stream_options`` set (truthy) on a
    body whose raw ``stream`` is not (``validate_stream_options``, a model validator), or not
    a ``StreamOptions`` object (its flags pydantic bools); ``min_tokens`` not an integer (it
    is no optional field: null is refused), below 0 or above the request's output limit
    ``max_output_tokens`` when it has one (``SamplingParams._verify_args``)."""
    options = body.get("stream_options")
    if options and not body.get("stream"):
        return True
    if options is not None and (
        not isinstance(options, dict)
        or any(lax_bool(options.get(flag)) is INVALID for flag in _STREAM_FLAGS)
    ):
        return True
    if "min_tokens" not in body:
        return False
    least = lax_int(body["min_tokens"])
    if type(least) is not int:  # None or INVALID
        return True
    return least < 0 or (max_output_tokens is not None and least > max_output_tokens)


def _token_ids(prompt: list[Any]) -> bool:
    """A completion prompt given as one list of token ids (not a batch of prompts)."""
    return all(type(t) is int for t in prompt)
