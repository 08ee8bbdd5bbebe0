"""The router's live state, owned by the event loop: one prefix index, one load tracker, a
``RoutingEngine`` per model (all policy logic is router/core's), prompt processors, the
replica registry, recent decisions and metrics.

Only the event-loop thread mutates the index, the load tracker and the engines. Prompt
processing of large bodies runs on worker threads; it touches only the tokenizer caches,
which lock themselves.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from router.core.errors import BadRequest, ConfigError, UnknownModel
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.slo import SloTargets
from router.core.types import Decision, ReplicaKey, RouteRequest
from router.recorder import TraceRecorder
from router.service.body_memo import BodyMemo
from router.service.config import ModelSettings, ReplicaSettings, Settings, replica_url_problem
from router.service.layout import ModelLayouts
from router.service.metrics import Metrics, ReplicaGauge, StateSnapshot
from router.service.registry import ReplicaRegistry
from router.store.base import ReplicaInfo
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import ProcessedPrompt, PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import load_tokenizer_dir, read_tokenizer_config

_log = logging.getLogger(__name__)

APPROXIMATE_SPECULATIVE_TTL_S = 600.0
# Bodies at least this large are not memoised (body_memo.py) and are tokenized on a worker
# thread, off the event loop (handling.py).
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


def build_processor(
    model: ModelSettings, tokenizers: dict[tuple[Any, ...], IncrementalTokenizer]
) -> PromptProcessor:
    """The prompt processor of one model; tokenizers with the same files are shared."""
    block = model.routing.block_size
    if model.tokenizer is None:
        template = None
        if model.chat_template:
            template = _template_file(model.chat_template)
        return PromptProcessor(
            model.name, block, template=template, chars_per_token=model.chars_per_token
        )
    spec = (model.tokenizer, model.bpe_file, model.pattern, model.num_reserved)
    directory = Path(model.tokenizer)
    files = load_tokenizer_dir(
        directory, bpe_file=model.bpe_file, pattern=model.pattern, num_reserved=model.num_reserved
    )
    inc = tokenizers.get(spec)
    if inc is None:
        inc = tokenizers[spec] = IncrementalTokenizer(
            files.tokenizer, budget_bytes=int(model.cache_mb * 2**20)
        )
    if model.chat_template:
        template = _template_file(model.chat_template, read_tokenizer_config(directory))
    else:
        template = ChatTemplate.from_tokenizer_config(files.config, directory)
    if template is not None:
        _log.info(
            "model %s: chat template is %s",
            model.name,
            "message-local: long conversations render only their new messages"
            if template.local_for(None) is not None
            else "not message-local: long conversations are rendered whole each turn",
        )
    if model.images is not None and model.images.token not in files.tokenizer.special_tokens:
        raise ConfigError(
            f"models.{model.name}.images.token: {model.images.token!r} is not a special token "
            "of the tokenizer"
        )
    return PromptProcessor(
        model.name,
        block,
        tokenizer=inc,
        template=template,
        add_bos_to_completions=model.add_bos_to_completions,
        chars_per_token=model.chars_per_token,
        images=model.images,
    )


def _template_file(path: str, config: Mapping[str, Any] | None = None) -> ChatTemplate:
    try:
        source = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read chat template {path}: {exc.strerror}") from None
    found = ChatTemplate.from_tokenizer_config({**(config or {}), "chat_template": source})
    assert found is not None
    return found


class RouterState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.index = PrefixIndex(settings.server.max_speculative_blocks)
        self.load = LoadTracker()
        self.registry = ReplicaRegistry(settings.replicas)
        self._static_names = frozenset(r.name for r in settings.replicas)
        self.drained: set[ReplicaKey] = set()  # see set_draining
        self.rng = random.Random(settings.server.seed)
        self.decisions: deque[tuple[float, str, str, int, bool, Decision]] = deque(
            maxlen=settings.server.decisions_kept
        )
        self.unhealthy_until: dict[ReplicaKey, float] = {}
        self.event_lag_s: dict[str, float] = {}
        # the engines' own cumulative prefix-cache counters (queried, hit prompt tokens) per
        # replica key, from publishers' load samples or the router's own scrape
        self.engine_prefix_cache: dict[ReplicaKey, tuple[float, float]] = {}
        self.engines: dict[str, RoutingEngine] = {}
        self.processors: dict[str, PromptProcessor] = {}
        self.slos: dict[str, SloTargets] = {}
        # per model: speculative TTL of (approximate, exact) prompts (see _add_model)
        self.speculative_ttl: dict[str, tuple[float, float]] = {}
        self.layouts = ModelLayouts(self.engines, self.index, self.registry.keys_for)
        self._tokenizers: dict[tuple[Any, ...], IncrementalTokenizer] = {}
        for name in {*settings.models, *self.registry.models()}:
            self._add_model(settings.model(name))
        for ep in self.registry.endpoints():
            self.load.add_replica(ep.key)
            self.index.add_replica(ep.key)
        # small bodies only: larger ones are tokenized on worker threads (handling.py)
        self.body_memo = BodyMemo(
            int(settings.server.body_memo_mb * 2**20), max_body_bytes=BODY_MEMO_MAX_BYTES
        )
        self.metrics = Metrics(self.snapshot)
        # Set while recording live traffic (app cleanup_ctx owns the file).
        self.recorder: TraceRecorder | None = None

    def _add_model(self, model: ModelSettings) -> None:
        processor = build_processor(model, self._tokenizers)
        routing = model.routing
        params = dict(model.policy_params)
        if model.policy == "ours":  # priced against the model's TPOT target unless told
            params.setdefault("tpot_target_s", model.slo.tpot_s)
        policy = make_policy(model.policy, params)
        self.engines[model.name] = RoutingEngine(self.index, self.load, policy, routing)
        self.processors[model.name] = processor
        self.slos[model.name] = model.slo
        # Approximate prompts (text hashed in character chunks) never match an engine's
        # events: the router's own speculative entries are all their index, so they must
        # live a while. Exact prompts (tokenized, or token ids) get the configured TTL (event
        # lag cover); with no event source at all for the model, the long one too. Giving
        # exact prompts the long TTL while events flow would keep entries the engines have
        # evicted, or never made, for minutes (over-predicted hits).
        ttl = routing.speculative_ttl_s
        approximate = max(ttl, APPROXIMATE_SPECULATIVE_TTL_S)
        exact = ttl if ttl > 0 or processor.exact or self._has_events(model.name) else approximate
        self.speculative_ttl[model.name] = (approximate, exact)
        if model.tokenizer is not None:
            self.layouts.model_config(model.name, Path(model.tokenizer))

    def _has_events(self, model: str) -> bool:
        """Whether engines' events can reach the index for ``model`` (Redis, or a replica
        of it configured with a ZMQ endpoint)."""
        return self.settings.server.redis_url is not None or any(
            r.zmq for r in self.settings.replicas if r.model == model
        )

    # ------------------------------------------------------------------ discovery

    def add_discovered(self, info: ReplicaInfo) -> bool:
        """Route to a replica a publisher registered (``server.discover_replicas``); a
        re-registration updates it. Statically configured names are left alone. Returns
        whether the replica is now routable; a registration that is refused also withdraws
        an earlier one of the same name (its old address must not stay routable)."""
        if info.replica in self._static_names:
            return False
        ranks = tuple(info.dp_ranks)
        url = _normal_url(info.url)
        owner = next((r.name for r in self.registry.replicas() if _normal_url(r.url) == url), None)
        # the same URL rule as configured replicas (the proxy speaks plain http to the root)
        problem = replica_url_problem(info.url)
        if problem is not None or url is None:
            problem = problem or f"url {info.url!r} is not a plain http://host:port URL"
        elif info.model not in self.engines:
            problem = (
                f"model {info.model!r} is not configured (add [models.{info.model or 'NAME'}] "
                "to route to it)"
            )
        elif ranks != tuple(range(len(ranks))):
            problem = f"dp ranks {ranks} are not 0..N-1"
        elif owner is not None and owner != info.replica:
            problem = (
                f"{info.url} is already routed to as {owner!r} (give a configured replica "
                "the publisher's replica name, or set server.discover_replicas = false)"
            )
        if problem is not None:
            _log.warning("not routing to registered replica %s: %s", info.replica, problem)
            self.remove_discovered(info.replica)
            return False
        model = self.settings.model(info.model)  # configured: its engine exists since start-up
        if info.block_size != model.routing.block_size:
            _log.warning(
                "replica %s publishes %d-token blocks, the router hashes model %s in %d-token "
                "blocks: its cache will not match (publisher --block-size)",
                info.replica,
                info.block_size,
                info.model,
                model.routing.block_size,
            )
        old = self.registry.find(info.replica)
        previous = self.registry.get(info.replica)
        settings = ReplicaSettings(
            url=info.url,
            model=info.model,
            name=info.replica,
            rack=info.rack or None,
            region=info.region or None,
            dp_ranks=len(ranks),
        )
        if settings == previous:
            # the same registration again (a re-bootstrap after a Redis outage re-announces
            # the whole fleet): the model's key tuple, and the routing caches keyed by it,
            # stay as they are
            return True
        self.registry.upsert(settings)
        new = self.registry.find(info.replica)
        self._forget_keys([k for k in old if k not in new], previous)
        for key in new:
            self.load.add_replica(key)
            self.index.add_replica(key)
            if key in self.drained:
                self.load.set_draining(key, True)
        return True

    def is_static(self, name: str) -> bool:
        """Configured in ``[[replicas]]`` (not discovered from the registry)."""
        return name in self._static_names

    def remove_discovered(self, name: str) -> None:
        """Stop routing to a registered replica (deregistered, or its lease expired)."""
        if name in self._static_names:
            return
        previous = self.registry.get(name)
        self._forget_keys(self.registry.remove(name), previous)

    def _forget_keys(self, keys: Sequence[ReplicaKey], previous: ReplicaSettings | None) -> None:
        for key in keys:
            self.load.remove_replica(key)
            self.engine_prefix_cache.pop(key, None)
            self.unhealthy_until.pop(key, None)
            if previous is not None:
                self.metrics.forget_replica(previous.model, key)

    def set_draining(self, key: ReplicaKey, draining: bool) -> None:
        """Admin drain / undrain, remembered across a discovered replica leaving and coming
        back (a publisher restart during a rolling update must not undo a drain)."""
        self.load.set_draining(key, draining)
        if draining:
            self.drained.add(key)
        else:
            self.drained.discard(key)

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

    def restore_health(self, now: float) -> None:
        if not self.unhealthy_until:
            return
        for key, until in list(self.unhealthy_until.items()):
            if now >= until:
                del self.unhealthy_until[key]
                self.load.set_health(key, True)

    def mark_unhealthy(self, key: ReplicaKey, now: float) -> None:
        if self.registry.endpoint(key) is None:
            return  # removed meanwhile (a discovered replica left): nothing to mark
        self.unhealthy_until[key] = now + self.settings.server.unhealthy_cooldown_s
        self.load.set_health(key, False)

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
        engine = self.engines[model]
        self.restore_health(now)
        request = RouteRequest(
            request_id=request_id,
            model=model,
            prompt_tokens=max(prompt.prompt_tokens, 1),
            block_hashes=prompt.block_hashes,
            block_size=prompt.block_size,
            session_id=session_id,
            max_output_tokens=max_output_tokens,
        )
        t0 = time.perf_counter()
        keys = self.registry.keys_for(model) if replicas is None else replicas
        candidates = engine.candidates(request, keys, now)
        t1 = time.perf_counter()
        decision = engine.choose(request, candidates, now, self.rng)
        t2 = time.perf_counter()
        approximate_ttl, exact_ttl = self.speculative_ttl[model]
        engine.dispatched(request, decision, now, exact_ttl if prompt.exact else approximate_ttl)
        best = engine.best_usable_tokens(request, candidates)
        routed = Routed(request, decision, prompt, t1 - t0, t2 - t1, best)
        # formatted only when asked for (recent_decisions): nothing built per request
        self.decisions.append(
            (time.time(), request_id, model, request.prompt_tokens, prompt.exact, decision)
        )
        return routed

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

    def snapshot(self) -> StateSnapshot:
        now = _loop_time()
        gauges = []
        for ep in self.registry.endpoints():
            v = self.load.view(ep.key, now)
            gauges.append(
                ReplicaGauge(
                    str(ep.key),
                    ep.model,
                    v.in_flight,
                    v.queued_prefill_tokens,
                    v.healthy,
                    v.draining,
                    ep.rack or "",
                    ep.region or "",
                )
            )
        stats = self.index.stats()
        return StateSnapshot(
            replicas=tuple(gauges),
            index_entries={
                "kv": stats.kv_entries,
                "state": stats.state_entries,
                "speculative": stats.speculative_entries,
            },
            index_replicas=stats.replicas,
            tokenizer_modes={
                m: ("exact" if p.exact else "approximate") for m, p in self.processors.items()
            },
            prompt_cache_bytes={
                m: p.tokenizer.stats().bytes
                for m, p in self.processors.items()
                if p.tokenizer is not None
            },
            event_lag_s=dict(self.event_lag_s),
            body_memo=(self.body_memo.hits, self.body_memo.misses, self.body_memo.size_bytes),
            layouts=tuple(self.layouts.reports()),
            engine_prefix_cache={
                str(key): (endpoint.model, queries, hits)
                for key, (queries, hits) in self.engine_prefix_cache.items()
                if (endpoint := self.registry.endpoint(key)) is not None
            },
        )


def _normal_url(url: str) -> str | None:
    """``http://host:port`` of a replica URL, lower-case with the default port filled in (so
    ``HTTP://H:80/`` and ``http://h`` compare equal); None if it is not a plain http URL (the
    proxy's client speaks http only and sends requests to the root: no path, query or
    fragment)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme.lower() != "http" or not parts.hostname:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    return f"http://{parts.hostname.lower()}:{port or 80}"


def _loop_time() -> float:
    import asyncio

    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
