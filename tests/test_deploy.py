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
CRD_KINDS = {"ServiceMonitor"}


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
