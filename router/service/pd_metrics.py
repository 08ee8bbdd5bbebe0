"""What an operator sees of prefill/decode disaggregation: every replica's role and each
disaggregated model's counters (``disagg.ModelDisagg``: the plans' reasons, prefill
fallbacks, bytes moved by link, released transfers), as Prometheus metrics
(:class:`PdCollector`, ``kvrouter_replica_role`` and ``kvrouter_pd_*``) and as the JSON of
``GET /admin/pd`` (:func:`admin_view`, with each model's settings and pools).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.core.disagg import Link
from router.service.state import RouterState


class PdCollector(Collector):
    """Prometheus view of the roles and the disaggregation counters."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    def collect(self) -> Iterable[Any]:
        role = GaugeMetricFamily(
            "kvrouter_replica_role",
            "1 per replica key with its prefill/decode role (prefill, decode, both)",
            labels=["replica", "model", "role"],
        )
        for ep in self.state.registry.endpoints():
            role.add_metric([str(ep.key), ep.model, ep.role], 1.0)
        plans = CounterMetricFamily(
            "kvrouter_pd_decisions",
            "Disaggregation decisions by reason (remote: always, remote_pays; local: off, "
            "few_uncached, local_hit, cheaper_local, same_replica, no_prefill_replica, "
            "beam_search, parallel_sampling, batch_prompts, prompt_logprobs, messages_api, "
            "responses_api, invalid_body)",
            labels=["model", "reason"],
        )
        fallbacks = CounterMetricFamily(
            "kvrouter_pd_prefill_fallbacks",
            "Prefill legs that failed, so the decode replica prefilled locally, by cause",
            labels=["model", "cause"],
        )
        moved = CounterMetricFamily(
            "kvrouter_pd_transfer_bytes",
            "KV and recurrent-state bytes pulled by the decode replica that got the transfer "
            "and answered, by link (nvlink, network, region; predicted from the model's "
            "transfer sizes)",
            labels=["model", "link"],
        )
        releases = CounterMetricFamily(
            "kvrouter_pd_transfer_releases",
            "Prefill legs whose transfer then reached no decode replica (none left, every "
            "one refused the connection, or the client left first), by how their blocks "
            "were handed back (released: a decode-capable replica refused the transfer, so "
            "vLLM frees them at once; unreleased: none did, they wait for the KV lease)",
            labels=["model", "outcome"],
        )
        for name, md in self.state.disagg.items():
            for outcome, n in md.releases.items():
                releases.add_metric([name, outcome], n)
            for reason, n in md.decisions.items():
                plans.add_metric([name, reason], n)
            for cause, n in md.fallbacks.items():
                fallbacks.add_metric([name, cause], n)
            for link in Link:
                if link is not Link.SAME:
                    moved.add_metric([name, link.value], md.bytes_by_link.get(link.value, 0.0))
        yield from (role, plans, fallbacks, moved, releases)


def admin_view(state: RouterState) -> dict[str, Any]:
    """``GET /admin/pd``: per model the settings, the decisions, fallbacks and bytes."""
    out: dict[str, Any] = {}
    for name, md in state.disagg.items():
        k = md.pd.knobs
        pools = md.pd.pools(state.registry.keys_for(name))
        out[name] = {
            "mode": k.mode,
            "knobs": {
                "min_uncached_tokens": k.min_uncached_tokens,
                "max_local_hit": k.max_local_hit,
                "w_interference": k.w_interference,
                "rack_penalty_s": k.rack_penalty_s,
                "region_penalty_s": k.region_penalty_s,
            },
            "prefill": [str(r) for r in pools[0]],
            "decode": [str(r) for r in pools[1]],
            "decisions": dict(md.decisions),
            "fallbacks": dict(md.fallbacks),
            "transfer_releases": dict(md.releases),
            "transfer_bytes": dict(md.bytes_by_link),
        }
    return out
