"""The router's routing state, owned by the event loop: what routes over the fleet (one
prefix index, one load tracker, a ``RoutingEngine`` per model: all policy logic is
router/core's), the models' prompt processors, the body memo, recent decisions and metrics.

Its parts of other concepts live beside it: the fleet (replicas, health, drains, discovery:
router/service/fleet.py), the prompt processors' construction (router/service/prompts.py)
and the metrics snapshot (router/service/snapshot.py).

Only the event-loop thread mutates the index, the load tracker and the engines. Prompt
processing of large bodies runs on worker threads; it touches only the tokenizer caches,
which lock themselves.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from router.core.disagg import Disaggregator
from router.core.errors import BadRequest, ConfigError, UnknownModel
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import Candidate, CandidateColumns, make_policy
from router.core.routing import Dispatch, RoutingEngine
from router.core.slo import SloTargets
from router.core.types import Decision, ReplicaKey, RouteRequest
from router.recorder import TraceRecorder
from router.service.body_memo import BodyMemo
from router.service.fleet import Fleet
from router.service.layout import ModelLayouts
from router.service.metrics import Metrics
from router.service.prompts import build_processor
from router.service.registry import ReplicaRegistry
from router.service.response_ids import ResponseIds
from router.service.response_share import ResponseShare
from router.service.settings import ModelSettings, Settings
from router.service.snapshot import state_snapshot
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.keying import ProcessedPrompt
from router.tokenize.pipeline import PromptProcessor

APPROXIMATE_SPECULATIVE_TTL_S = 600.0
# Bodies at least this large are not memoised (body_memo.py) and are tokenized on a worker
# thread, off the event loop (intake.py).
BODY_MEMO_MAX_BYTES = 128 * 1024


class Routed(NamedTuple):
    """A routing decision with the request it was made for (a NamedTuple: one per request)."""

    request: RouteRequest
    decision: Decision
    prompt: ProcessedPrompt
    lookup_s: float
    score_s: float
    # the longest usable hit any eligible replica offered (the decision's may be shorter)
    best_usable_tokens: int = 0
    # service class (router/core/admission.py) and its TTFT target factor, for the SLO metric
    service_class: str = "default"
    ttft_factor: float = 1.0
    # the service class's decode weight (LoadTracker.dispatch), kept for a retry's dispatch
    class_weight: float = 1.0
    # what was guessed of it on the decision's replica, taken back if the replica never
    # took the request (RouterState.withdraw)
    dispatch: Dispatch | None = None


class Pending(NamedTuple):
    """A request with its candidates, judged but not yet committed (:meth:`RouterState.
    decide`)."""

    engine: RoutingEngine
    request: RouteRequest
    prompt: ProcessedPrompt
    candidates: list[Candidate] | CandidateColumns
    lookup_s: float
    # the replicas it may go to (None: all of its model's): a gRPC Pick's ``candidates``
    replicas: Sequence[ReplicaKey] | None = None


def route_request(
    model: str,
    prompt: ProcessedPrompt,
    request_id: str,
    session_id: str | None,
    max_output_tokens: int | None,
) -> RouteRequest:
    """What the policies know of a request whose prompt was processed into ``prompt``: the
    one builder for every front end's routing (local and disaggregated)."""
    return RouteRequest(
        request_id=request_id,
        model=model,
        prompt_tokens=max(prompt.prompt_tokens, 1),
        block_hashes=prompt.block_hashes,
        block_size=prompt.block_size,
        session_id=session_id,
        max_output_tokens=max_output_tokens,
        reads_cache=prompt.reads_cache,
        samples=prompt.samples,
        prompts=prompt.prompts,
    )


class RouterState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.index = PrefixIndex(settings.server.max_speculative_blocks)
        self.load = LoadTracker()
        self.engines: dict[str, RoutingEngine] = {}
        self.fleet = Fleet(settings, self.load, self.index, self.engines, self._forget)
        self.registry: ReplicaRegistry = self.fleet.registry
        self.rng = random.Random(settings.server.seed)
        self.decisions: deque[tuple[float, str, str, int, bool, Decision]] = deque(
            maxlen=settings.server.decisions_kept
        )
        self.event_lag_s: dict[str, float] = {}
        self.processors: dict[str, PromptProcessor] = {}
        self.slos: dict[str, SloTargets] = {}
        # SLO-aware admission (router/service/admission.py), set by the app
        self.admission: Any = None
        # engine rendering of the models with render = "engine" (router/service/render.py),
        # set by the app while its HTTP client session lives
        self.renderer: Any = None
        # per model: speculative TTL of (approximate, exact) prompts (see _add_model)
        self.speculative_ttl: dict[str, tuple[float, float]] = {}
        self.layouts = ModelLayouts(self.engines, self.index, self.registry.keys_for)
        # per model with prefill/decode disaggregation on (router/service/disagg.py)
        self.disagg: dict[str, Any] = {}
        # Responses API: stored response id -> its replica (router/service/response_ids.py),
        # and the ids of the other workers and pods (router/service/response_share.py)
        self.response_ids = ResponseIds()
        self.response_share = ResponseShare(self.response_ids)
        # base URL -> requests passed there and not answered yet (router/service/pass_through)
        self.passed_in_flight: dict[str, int] = {}
        self._tokenizers: dict[tuple[Any, ...], IncrementalTokenizer] = {}
        for name in {*settings.models, *self.registry.models()}:
            self._add_model(settings.model(name))
        # small bodies only: larger ones are tokenized on worker threads (intake.py)
        self.body_memo = BodyMemo(
            int(settings.server.body_memo_mb * 2**20), max_body_bytes=BODY_MEMO_MAX_BYTES
        )
        # (last: its collector reads the rest of the state when registered)
        self.metrics = Metrics(partial(state_snapshot, self))
        if self.disagg:
            from router.service.pd_metrics import PdCollector

            self.metrics.registry.register(PdCollector(self))
        # Set while recording live traffic (app cleanup_ctx owns the file).
        self.recorder: TraceRecorder | None = None

    def _forget(self, model: str, key: ReplicaKey) -> None:
        self.metrics.forget_replica(model, key)
        self.event_lag_s.pop(str(key), None)
        engine = self.engines.get(model)
        if engine is not None:
            engine.turnover.forget(key)

    def _add_model(self, model: ModelSettings) -> None:
        try:  # its tokenizer, BPE and template files: a missing one names the model
            processor = build_processor(model, self._tokenizers)
        except ConfigError as exc:
            raise ConfigError(f"models.{model.name}: {exc}") from None
        routing = model.routing
        params = dict(model.policy_params)
        if model.policy == "ours":  # priced against the model's TPOT target unless told
            params.setdefault("tpot_target_s", model.slo.tpot_s)
            params.setdefault("ttft_tiers", model.slo.tiers)
        policy = make_policy(model.policy, params)
        self.engines[model.name] = RoutingEngine(self.index, self.load, policy, routing)
        self.processors[model.name] = processor
        self.slos[model.name] = model.slo
        if model.pd is not None:
            from router.service.disagg import build

            self.disagg[model.name] = build(model, self.registry)
        # Approximate prompts (text hashed in character chunks) never match an engine's
        # events: the router's own speculative entries are all their index, so they must
        # live a while. Exact prompts (tokenized, or token ids) get the configured TTL
        # (until the engines' events report the blocks); with no event source at all for
        # the model and no TTL set, the long one too. Giving exact prompts the long TTL
        # while events flow would keep entries the engines never made for minutes.
        ttl = routing.speculative_ttl()
        approximate = max(ttl, APPROXIMATE_SPECULATIVE_TTL_S)
        chosen = (routing.speculative_ttl_s or 0.0) > 0
        exact = ttl if chosen or processor.exact or self._has_events(model.name) else approximate
        self.speculative_ttl[model.name] = (approximate, exact)
        if model.tokenizer is not None:
            self.layouts.model_config(model.name, Path(model.tokenizer))

    def _has_events(self, model: str) -> bool:
        """Whether engines' events can reach the index for ``model`` (Redis, or a replica
        of it configured with a ZMQ endpoint)."""
        return self.settings.server.redis_url is not None or any(
            r.zmq for r in self.settings.replicas if r.model == model
        )

    # ------------------------------------------------------------------ request path

    def processor(self, model: str) -> PromptProcessor:
        proc = self.processors.get(model)
        if proc is None or not self.registry.keys_for(model):
            raise UnknownModel(f"The model '{model}' does not exist")
        return proc

    def check_context(self, model: str, prompt: ProcessedPrompt) -> None:
        limit = self.settings.model(model).context_length
        if limit is not None and prompt.exact and prompt.context_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {prompt.context_tokens} input tokens."
            )

    def route(
        self,
        model: str,
        prompt: ProcessedPrompt,
        request_id: str,
        now: float,
        *,
        session_id: str | None = None,
        max_output_tokens: int | None = None,
        replicas: Sequence[ReplicaKey] | None = None,
    ) -> Routed:
        """Pick a replica with the model's RoutingEngine and record the dispatch.

        ``replicas`` restricts the choice to a subset of the model's replicas (gRPC Pick's
        candidate list); None means all of them."""
        pending = self.decide(
            model,
            prompt,
            request_id,
            now,
            session_id=session_id,
            max_output_tokens=max_output_tokens,
            replicas=replicas,
        )
        return self.commit(pending, pending.candidates, now)

    def decide(
        self,
        model: str,
        prompt: ProcessedPrompt,
        request_id: str,
        now: float,
        *,
        session_id: str | None = None,
        max_output_tokens: int | None = None,
        replicas: Sequence[ReplicaKey] | None = None,
    ) -> Pending:
        """The first half of :meth:`route`: the request and its candidates, nothing
        recorded (admission judges it before :meth:`commit`)."""
        engine = self.engines[model]
        self.fleet.restore_health(now)
        request = route_request(model, prompt, request_id, session_id, max_output_tokens)
        t0 = time.perf_counter()
        keys = self.registry.keys_for(model) if replicas is None else replicas
        candidates = engine.candidates(request, keys, now)
        return Pending(engine, request, prompt, candidates, time.perf_counter() - t0, replicas)

    def commit(
        self,
        pending: Pending,
        candidates: list[Candidate] | CandidateColumns,
        now: float,
        *,
        class_weight: float = 1.0,
    ) -> Routed:
        """The second half of :meth:`route`: the policy's choice among ``candidates`` (the
        pending request's, or those admission allowed), recorded as dispatched."""
        engine, request, prompt = pending.engine, pending.request, pending.prompt
        t1 = time.perf_counter()
        decision = engine.choose(request, candidates, now, self.rng)
        t2 = time.perf_counter()
        ttl = self.ttl_for(request.model, prompt.exact)
        exact = prompt.exact
        dispatch = engine.dispatched(
            request, decision, now, ttl, class_weight=class_weight, exact=exact
        )
        best = engine.best_usable_tokens(request, candidates)
        routed = Routed(
            request, decision, prompt, pending.lookup_s, t2 - t1, best, dispatch=dispatch
        )
        # formatted only when asked for (recent_decisions): nothing built per request
        self.decisions.append(
            (
                time.time(),
                request.request_id,
                request.model,
                request.prompt_tokens,
                prompt.exact,
                decision,
            )
        )
        return routed

    def ttl_for(self, model: str, exact: bool) -> float:
        """How long a dispatched prompt of ``model`` is speculated (an ``exact`` one or an
        approximate one: see :meth:`_add_model`)."""
        approximate, exact_ttl = self.speculative_ttl[model]
        return exact_ttl if exact else approximate

    def retried(
        self, routed: Routed, key: ReplicaKey, now: float, *, pulled: bool = False
    ) -> Dispatch:
        """``routed``'s request is retried on ``key`` (router/service/proxy.py): recorded
        there as a dispatch is (its load, with its decode weight; speculative entries; its
        session's hint), with no predicted hit (only the decision's replica's was
        predicted). ``pulled``: the retry carries the prompt computed elsewhere (a decode
        leg's ``kv_transfer_params`` that its first replica never got: router/service/
        pd_serve.py), recorded as a decode leg is (``Disaggregator.dispatched_decode``:
        nothing to prefill there). Its load leaves the replica it was on
        (LoadTracker.dispatch), and so does its decode-stall allowance when admission
        tracks it. What the replica it was on was guessed to hold stays unless the caller
        withdraws it (:meth:`withdraw`: that replica did not take the request). Returns the
        retry's dispatch."""
        request, prompt = routed.request, routed.prompt
        # (no terms: they describe the policy's pick, which ``key`` is not)
        decision = routed.decision._replace(replica=key, usable_tokens=0, kv_tokens=0, terms={})
        ttl = self.ttl_for(request.model, prompt.exact)
        engine = self.engines[request.model]
        weight = routed.class_weight
        if pulled:
            dispatch = Disaggregator.dispatched_decode(
                engine, request, decision, now, ttl, prompt.exact, class_weight=weight
            )
        else:
            dispatch = engine.dispatched(
                request, decision, now, ttl, class_weight=weight, exact=prompt.exact
            )
        if self.admission is not None:
            self.admission.retried(routed, key)
        return dispatch

    def withdraw(self, model: str, dispatch: Dispatch | None) -> None:
        """A dispatch of ``model`` never reached its replica's cache: a refused or dropped
        connection, an error answer (RoutingEngine.withdraw); or its client left before the
        first token, so the engine aborted the prefill and will report stored only the
        blocks it finished, never the prompt's last (the session's hint, awaiting that
        block, would credit the whole prompt until it expired): its events alone tell.
        Not for a timeout or a broken answer: the replica may still be prefilling the
        prompt, and a retry is sent."""
        engine = self.engines.get(model)
        if dispatch is not None and engine is not None:
            engine.withdraw(dispatch)

    # ------------------------------------------------------------------ introspection

    def recent_decisions(self, limit: int) -> list[dict[str, Any]]:
        """The last ``limit`` decisions, newest first, as JSON-ready dicts."""
        if limit <= 0:
            return []
        out = []
        for at, rid, model, prompt_tokens, exact, d in list(self.decisions)[-limit:][::-1]:
            out.append(
                {
                    "at": at,
                    "request_id": rid,
                    "model": model,
                    "replica": str(d.replica),
                    "policy": d.policy,
                    "prompt_tokens": prompt_tokens,
                    "usable_tokens": d.usable_tokens,
                    "kv_tokens": d.kv_tokens,
                    "exact": exact,
                    "score": d.score,
                    "terms": dict(d.terms),
                    "ranking": [str(k) for k in d.ranking[:8]],
                }
            )
        return out
