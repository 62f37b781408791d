"""The prefill/decode overlay (deploy/kubernetes/disaggregated), rendered as kustomize renders it: the base's
resources, the overlay's own, and its JSON 6902 patches applied to their targets. Checked offline as the base
is (strictly against the pinned Kubernetes schemas), and for what disaggregation depends on: both kinds of
replica run the KV side channel on a port their pods expose, the prefill pods are the decode pods under another
label, each Service selects one of them, and the gateway's config names the prefill replicas as it parses it."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_manifests import (
    KUBE_DIR,
    KUBERNETES_VERSION,
    KUSTOMIZATION,
    RESOURCES,
    WORKLOAD_KINDS,
    pod_labels,
    selects,
)

OVERLAY = KUBE_DIR / "disaggregated"
KUSTOMIZE = yaml.safe_load((OVERLAY / KUSTOMIZATION).read_text())


def render() -> tuple[list[dict[str, Any]], set[tuple[str, str]]]:
    """The overlay's resources, and the (kind, name) of those it adds or patches."""
    resources: list[dict[str, Any]] = []
    changed: set[tuple[str, str]] = set()
    for entry in KUSTOMIZE["resources"]:
        if entry == "..":
            resources += copy.deepcopy(RESOURCES)
            continue
        own = [doc for doc in yaml.safe_load_all((OVERLAY / entry).read_text()) if doc]
        resources += own
        changed |= {(r["kind"], r["metadata"]["name"]) for r in own}
    for patch in KUSTOMIZE["patches"]:
        target = patch["target"]
        (index,) = [i for i, r in enumerate(resources)
                    if (r["kind"], r["metadata"]["name"]) == (target["kind"], target["name"])]
        ops = yaml.safe_load((OVERLAY / patch["path"]).read_text())
        resources[index] = jsonpatch.apply_patch(resources[index], ops)
        changed.add((target["kind"], target["name"]))
    return resources, changed


RENDERED, CHANGED = render()


def named(kind: str, name: str) -> dict[str, Any]:
    (match,) = [r for r in RENDERED if (r["kind"], r["metadata"]["name"]) == (kind, name)]
    return match


def container(name: str) -> dict[str, Any]:
    (only,) = named("Deployment", name)["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("key", sorted(CHANGED), ids=lambda key: "/".join(key))
def test_what_the_overlay_adds_or_patches_validates_strictly(key: tuple[str, str]) -> None:
    assert kubernetes_validate.validate(named(*key), KUBERNETES_VERSION, strict=True) == "1.33"


def test_the_overlay_lists_every_file_of_its_own_keeps_the_base_namespace_and_names_no_kind_twice() -> None:
    listed = {entry for entry in KUSTOMIZE["resources"] if entry != ".."} | {p["path"] for p in KUSTOMIZE["patches"]}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml") if p.name != KUSTOMIZATION}
    assert ".." in KUSTOMIZE["resources"]
    assert KUSTOMIZE["namespace"] == yaml.safe_load((KUBE_DIR / KUSTOMIZATION).read_text())["namespace"]
    keys = [(r["kind"], r["metadata"]["name"]) for r in RENDERED]
    assert len(keys) == len(set(keys))


def test_prefill_pods_are_the_decode_pods_under_another_component_label() -> None:
    prefill, decode = named("Deployment", "llmserve-prefill"), named("Deployment", "llmserve-replica")
    assert prefill["spec"]["template"]["spec"] == decode["spec"]["template"]["spec"]
    prefill_labels, decode_labels = dict(pod_labels(prefill)), dict(pod_labels(decode))
    assert (prefill_labels.pop("app.kubernetes.io/component"), decode_labels.pop("app.kubernetes.io/component")) == (
        "prefill", "replica")
    assert prefill_labels == decode_labels


@pytest.mark.parametrize("deployment", ["llmserve-prefill", "llmserve-replica"])
def test_both_kinds_of_replica_run_the_kv_side_channel_on_a_port_their_pods_expose(deployment: str) -> None:
    from llmserve.cli import build_parser
    from llmserve.config import EngineConfig, engine_config_kwargs

    serving = container(deployment)
    args = build_parser().parse_args(serving["args"])  # the real command line takes these arguments
    config = EngineConfig(**{**engine_config_kwargs(args), "model": "m"})
    config.validate()
    assert config.kv_transfer and config.enable_prefix_caching and config.kv_transfer_port > 0
    assert {"name": "kv-transfer", "containerPort": config.kv_transfer_port, "protocol": "TCP"} in serving["ports"]


def test_every_service_selects_one_workloads_pods_and_the_prefill_one_its_kv_port() -> None:
    workloads = [r for r in RENDERED if r["kind"] in WORKLOAD_KINDS]
    for service in (r for r in RENDERED if r["kind"] == "Service"):
        targets = [w["metadata"]["name"] for w in workloads if selects(service["spec"]["selector"], pod_labels(w))]
        assert len(targets) == 1, (service["metadata"]["name"], targets)
    prefill_service = named("Service", "llmserve-prefill-headless")
    assert prefill_service["spec"]["clusterIP"] == "None"
    assert selects(prefill_service["spec"]["selector"], pod_labels(named("Deployment", "llmserve-prefill")))
    ports = {port["name"]: port for port in prefill_service["spec"]["ports"]}
    assert ports["kv-transfer"]["targetPort"] == "kv-transfer" and ports["http"]["targetPort"] == "http"


def test_the_gateway_parses_the_prefill_replicas_of_the_pool_from_the_patched_config() -> None:
    from llmserve.gateway.serve import parse_pools, parse_prefill_pools

    text = named("ConfigMap", "llmserve-gateway")["data"]["gateway.yaml"]
    base_text = next(r for r in RESOURCES if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "llmserve-gateway")
    with tempfile.TemporaryDirectory() as tmp:  # the gateway reads the config as mounted
        path, base = Path(tmp) / "gateway.yaml", Path(tmp) / "base.yaml"
        path.write_text(text)
        base.write_text(base_text["data"]["gateway.yaml"])
        pools = parse_pools([], str(path))
        assert pools == parse_pools([], str(base))  # the decode replicas are the base's pool
        prefill = parse_prefill_pools([], str(path), pools)
    headless = {r["metadata"]["name"] for r in RENDERED if r["kind"] == "Service" and r["spec"].get("clusterIP") == "None"}
    assert prefill == {"default": ["dns+http://llmserve-prefill-headless:8000"]}
    assert "llmserve-prefill-headless" in headless
