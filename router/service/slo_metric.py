"""The misses of the SLO metric, ``kvrouter_slo_requests`` (docs/metrics.md "SLO attainment
and goodput"): every request the router took for a model counts once, by its prompt's SLO
tier, its service class and its result: an answer by what it met (router.service.answer_relay
``count_slo``, on the hot path), a request that got no whole answer as ``failed`` here
(:func:`count_unanswered`, :func:`count_refused`), so goodput (``met`` over all results)
counts failures as misses, as the simulator's and the live replay's goodput do
(router.core.slo). The forwarder, the disaggregated flow and gRPC Report all count here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from router.core.admission import CLASS_NAMES
from router.core.errors import KVRouterError, Overloaded
from router.service.state import RouterState
from router.tokenize.keying import ProcessedPrompt


def count_unanswered(
    state: RouterState, model: str, prompt_tokens: int, service_class: str, status: int
) -> None:
    """Count a request that got no whole answer (``status``: what its client got: shed by
    admission or no replica could take it, a replica's error or a stream it broke, a gRPC
    ``FAILED`` Report) in ``kvrouter_slo_requests`` as ``failed``: a miss in goodput's
    denominator, as the simulator and the live replay count a request rejected or failed
    (router.core.slo). A client's error (4xx but 429) is not judged."""
    if 400 <= status < 500 and status != 429:
        return
    tier = state.slos[model].tier(prompt_tokens)
    state.metrics.model(model).slo(tier.label, "failed", service_class).inc()


def count_refused(
    state: RouterState,
    exc: KVRouterError,
    model: str,
    prompt: ProcessedPrompt,
    body_tier: object,
    headers: Iterable[tuple[bytes, bytes]],
    status: int,
) -> None:
    """:func:`count_unanswered` for a request refused before any replica took it (shed by
    admission, no replica: router.service.errors ``refused_load``), in its class: the one
    admission judged it in, else the one it would have had (``Admission.service_class``)."""
    klass = "default"
    if isinstance(exc, Overloaded):
        klass = exc.klass
    elif state.admission is not None:
        with contextlib.suppress(KVRouterError):
            klass = CLASS_NAMES[state.admission.service_class(body_tier, headers)]
    count_unanswered(state, model, max(prompt.prompt_tokens, 1), klass, status)
