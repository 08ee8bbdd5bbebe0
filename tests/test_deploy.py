"""deploy/: every manifest parses, built-in kinds validate against the Kubernetes schemas
(kubernetes-validate, offline), the kustomize build works when kubectl is present, and the
pieces agree with each other (selectors, ports, probes, commands)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


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
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]
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

    from router.core.load import LoadTracker
    from router.service.config import build_settings
    from router.service.peer_sum import PeerSum
    from router.service.pod_exchange import ExchangeSettings, PodExchange, _ExchangeCollector
    from router.service.saturation import LoopLag
    from router.service.state import RouterState

    state = RouterState(
        build_settings({"replicas": [{"url": "http://127.0.0.1:9", "model": "m", "name": "a"}]})
    )
    load = LoadTracker()
    ex = PodExchange(ExchangeSettings("stream", "k", "p", 0.005, 1.0), None, load, PeerSum(load),
                     lambda: 0.0)  # fmt: skip
    state.metrics.registry.register(_ExchangeCollector(ex))
    state.metrics.registry.register(LoopLag())
    text = state.metrics.render().decode()
    return set(re.findall(r"^# TYPE (kvrouter_\w+) \w+$", text, flags=re.M))


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

    from router.service.config import build_settings
    from router.service.state import RouterState

    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"])
    used = {m for e in exprs for m in re.findall(r"kvrouter_[a-z_]+", e)}
    assert len(used) >= 10
    state = RouterState(
        build_settings({"replicas": [{"url": "http://127.0.0.1:9", "model": "m", "name": "a"}]})
    )
    text = state.metrics.render().decode()
    families = set(re.findall(r"^# TYPE (kvrouter_\w+) \w+$", text, flags=re.M))
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
