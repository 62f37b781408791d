"""The deployment artifacts in deploy/, checked offline: every Kubernetes manifest against the bundled
OpenAPI schemas of a pinned Kubernetes version (kubernetes-validate, strict: unknown fields are errors),
the properties a rollout depends on (probes, graceful termination, the autoscaler's metric, selectors
that select), and the Dockerfiles' essentials. Nothing here builds an image or needs a network."""

from __future__ import annotations

import ast
import json
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE_DIR = ROOT / "deploy" / "kubernetes"
DOCKER_DIR = ROOT / "deploy" / "docker"
KUBERNETES_VERSION = "1.33.0"
KUSTOMIZATION = "kustomization.yaml"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
SERVER_ABORT_GRACE_S_NAME = "ABORT_GRACE_S"


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE_DIR.glob("*.yaml") if p.name != KUSTOMIZATION)


def load_resources() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


RESOURCES = load_resources()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in RESOURCES if r["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    matches = [r for r in of_kind(kind) if r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} named {name}, found {len(matches)}"
    return matches[0]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def source_default(path: Path, flag: str) -> Any:
    """The `default=` of the argparse option `flag` in a module's source (importing the CLI takes seconds)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            if node.args[0].value == flag:
                return next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "default")
    raise AssertionError(f"{flag} not found in {path}")


def source_constant(path: Path, name: str) -> Any:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def replica() -> dict[str, Any]:
    return named("Deployment", "llmserve-replica")


def replica_container() -> dict[str, Any]:
    (container,) = replica()["spec"]["template"]["spec"]["containers"]
    return container


# --- schemas and the kustomization -------------------------------------------------------------------


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_manifest_validates_strictly_against_the_pinned_kubernetes_schemas(resource: dict[str, Any]) -> None:
    validated = kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    assert validated == "1.33"


def test_the_strict_validator_rejects_an_unknown_field_and_a_wrong_type() -> None:
    bad = json.loads(json.dumps(replica()))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = json.loads(json.dumps(replica()))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(kubernetes_validate.ValidationError, match="integer"):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest_and_only_existing_ones() -> None:
    kustomization = yaml.safe_load((KUBE_DIR / KUSTOMIZATION).read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]
    namespaces = of_kind("Namespace")
    assert [n["metadata"]["name"] for n in namespaces] == [kustomization["namespace"]]


def test_resource_names_are_unique_per_kind() -> None:
    keys = [(r["kind"], r["metadata"]["name"]) for r in RESOURCES]
    assert len(keys) == len(set(keys))


# --- workloads, services, references -----------------------------------------------------------------


def test_every_workload_selector_matches_its_pod_template_labels() -> None:
    workloads = [r for r in RESOURCES if r["kind"] in WORKLOAD_KINDS]
    assert {w["kind"] for w in workloads} == set(WORKLOAD_KINDS)
    for workload in workloads:
        assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload)), workload["metadata"]


def test_no_two_workloads_share_pods() -> None:
    workloads = [r for r in RESOURCES if r["kind"] in WORKLOAD_KINDS]
    for a in workloads:
        for b in workloads:
            if a is not b:
                assert not selects(a["spec"]["selector"]["matchLabels"], pod_labels(b))


def test_every_service_selects_a_workloads_pods_on_a_port_they_expose() -> None:
    workloads = [r for r in RESOURCES if r["kind"] in WORKLOAD_KINDS]
    for service in of_kind("Service"):
        targets = [w for w in workloads if selects(service["spec"]["selector"], pod_labels(w))]
        assert len(targets) == 1, f"Service {service['metadata']['name']} selects {len(targets)} workloads"
        exposed = {p.get("name") for c in containers(targets[0]) for p in c.get("ports", [])}
        exposed |= {p["containerPort"] for c in containers(targets[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in exposed, service["metadata"]["name"]


def test_every_statefulset_is_governed_by_a_headless_service() -> None:
    for statefulset in of_kind("StatefulSet"):
        service = named("Service", statefulset["spec"]["serviceName"])
        assert service["spec"].get("clusterIP") == "None"
        assert selects(service["spec"]["selector"], pod_labels(statefulset))


def test_images_are_pinned_by_tag() -> None:
    for workload in (r for r in RESOURCES if r["kind"] in WORKLOAD_KINDS):
        for container in containers(workload):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag and tag not in ("", "latest"), image


def test_every_secret_configmap_and_claim_referenced_exists() -> None:
    secrets = {s["metadata"]["name"]: {**s.get("data", {}), **s.get("stringData", {})} for s in of_kind("Secret")}
    config_maps = {c["metadata"]["name"] for c in of_kind("ConfigMap")}
    claims = {c["metadata"]["name"] for c in of_kind("PersistentVolumeClaim")}
    for workload in (r for r in RESOURCES if r["kind"] in WORKLOAD_KINDS):
        for container in containers(workload):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims


def test_env_references_in_args_are_defined() -> None:
    for workload in (r for r in RESOURCES if r["kind"] in WORKLOAD_KINDS):
        for container in containers(workload):
            defined = {env["name"] for env in container.get("env", [])}
            for arg in container.get("args", []) + container.get("command", []):
                for variable in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert variable in defined, f"{container['name']}: $({variable}) is not in env"


# --- the replicas --------------------------------------------------------------------------------------


def test_replicas_run_the_server_without_the_platform_on_the_exposed_port() -> None:
    container = replica_container()
    args = container["args"]
    assert args[0] == "serve" and "--no-platform" in args
    assert flag_value(args, "--host") == "0.0.0.0"
    port = int(flag_value(args, "--port") or 8000)
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_replica_probes_ask_health_on_the_server_port(probe: str) -> None:
    check = replica_container()[probe]["httpGet"]
    assert check["path"] == "/health"
    assert check["port"] in ("http", 8000)


def test_startup_probe_allows_minutes_for_the_model_to_load() -> None:
    startup = replica_container()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    liveness = replica_container()["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 30  # an engine-core restart is not a kill


def test_termination_grace_covers_the_pre_stop_and_the_servers_shutdown() -> None:
    container = replica_container()
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pre_stop_s >= 5  # time for the endpoint's removal to reach kube-proxy and the gateways
    shutdown_s = float(
        flag_value(container["args"], "--shutdown-timeout")
        or source_default(ROOT / "llmserve" / "cli.py", "--shutdown-timeout")
    )
    abort_grace_s = source_constant(ROOT / "llmserve" / "server" / "graceful.py", SERVER_ABORT_GRACE_S_NAME)
    grace_s = replica()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > 30
    assert grace_s > pre_stop_s + shutdown_s + abort_grace_s


def test_replica_resources_model_volume_and_rollout() -> None:
    container = replica_container()
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert flag_value(container["args"], "--model") == "$(LLMSERVE_MODEL)"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert env["LLMSERVE_MODEL"].startswith(mounts["models"]["mountPath"] + "/")
    assert mounts["models"]["readOnly"] is True
    strategy = replica()["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0
    assert "replicas" not in replica()["spec"]  # the autoscaler owns the count


def test_a_headless_service_lists_each_replica() -> None:
    headless = [
        s for s in of_kind("Service")
        if s["spec"].get("clusterIP") == "None" and selects(s["spec"]["selector"], pod_labels(replica()))
    ]
    assert len(headless) == 1
    assert not headless[0]["spec"].get("publishNotReadyAddresses", False)


# --- the autoscaler ------------------------------------------------------------------------------------


def test_hpa_scales_the_replicas_on_queue_depth() -> None:
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", replica()["metadata"]["name"])
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    # The adapter's name for the server's series: the custom metrics API has no ':' in names.
    exported = "vllm:num_requests_waiting"
    assert f'"{exported}"' in (ROOT / "llmserve" / "server" / "metrics.py").read_text()
    assert metric["pods"]["metric"]["name"] == exported.replace(":", "_")
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= float(metric["pods"]["target"]["averageValue"]) <= 32
    scale_down = hpa["spec"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 120
    assert "num_requests_waiting" in (KUBE_DIR / "replica-hpa.yaml").read_text().split("apiVersion")[0]


# --- the gateway ---------------------------------------------------------------------------------------


def test_gateway_runs_the_gateway_command_with_a_pools_config() -> None:
    from llmserve.cli import build_parser
    from llmserve.gateway.discovery import replica_url
    from llmserve.gateway.serve import parse_pools

    gateway = named("Deployment", "llmserve-gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "gateway"
    parsed = build_parser().parse_args(args)  # the real command line takes these arguments
    assert (parsed.port, parsed.host, parsed.policy) == (8000, "0.0.0.0", "prefix")
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    # The platform's state is shared by every gateway: keys, usage, conversations in PostgreSQL, limits in Redis.
    database = re.fullmatch(r"postgresql\+psycopg://\w+:\$\(POSTGRES_PASSWORD\)@([a-z0-9-]+):5432/\w+", parsed.database_url)
    redis_url = re.fullmatch(r"redis://([a-z0-9-]+):6379/0", parsed.redis_url)
    assert database and redis_url and {database.group(1), redis_url.group(1)} <= set(services)
    assert not parsed.no_platform
    config_path = Path(flag_value(args, "--config"))
    assert config_path == Path("/etc/llmserve/gateway.yaml")
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config = yaml.safe_load(named("ConfigMap", volume["configMap"]["name"])["data"][config_path.name])
    headless = {s["metadata"]["name"] for s in of_kind("Service") if s["spec"].get("clusterIP") == "None"}
    assert config["pools"] and set(config) == {"pools"}
    with tempfile.TemporaryDirectory() as tmp:  # the gateway reads the config as mounted
        path = Path(tmp) / config_path.name
        path.write_text(named("ConfigMap", volume["configMap"]["name"])["data"][config_path.name])
        assert parse_pools([], str(path)) == config["pools"]
    for model, urls in config["pools"].items():
        assert urls, model
        for url in urls:  # dns+: one backend per pod address behind the headless name
            match = re.fullmatch(r"dns\+http://([a-z0-9-]+):(\d+)", url)
            assert match and match.group(1) in headless, url
            assert replica_url(url, "10.1.2.3") == f"http://10.1.2.3:{match.group(2)}"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"


# --- the Dockerfiles -----------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            logical.append(current.strip())
            current = ""
    assert not current, f"{path} ends inside a continuation"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in logical]


def exec_form(arguments: str) -> list[str]:
    return json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_essentials(name: str) -> None:
    instructions = dockerfile_instructions(DOCKER_DIR / name)
    stages: set[str] = set()
    for instruction, arguments in instructions:
        if instruction == "FROM":
            words = arguments.split()
            image = words[0]
            if image not in stages:
                _, _, tag = image.rpartition(":")
                assert ":" in image and tag != "latest", f"{name}: base image {image} is not pinned by a tag"
            if len(words) == 3 and words[1].upper() == "AS":
                stages.add(words[2])
    final_stage = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    final = instructions[final_stage:]
    users = [arguments.split(":")[0] for instruction, arguments in final if instruction == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name}: the final stage must run as a non-root USER"
    assert any(i == "EXPOSE" and "8000" in a.split() for i, a in final)
    (healthcheck,) = [a for i, a in final if i == "HEALTHCHECK"]
    assert "CMD" in healthcheck and "http://127.0.0.1:8000/health" in healthcheck
    entrypoint = [exec_form(a) for i, a in final if i == "ENTRYPOINT"][-1]
    command = [exec_form(a) for i, a in final if i == "CMD"][-1]
    assert (entrypoint + command)[:3] == ["llmserve", "serve", "--no-platform"]
    assert flag_value(command, "--host") == "0.0.0.0"
    runs = " ".join(a for i, a in instructions if i == "RUN")
    assert "pip install torch==2.13.0" in runs


def test_cpu_image_takes_torch_from_the_cpu_index_and_cuda_image_from_pypi() -> None:
    cpu_runs = " ".join(a for i, a in dockerfile_instructions(DOCKER_DIR / "Dockerfile") if i == "RUN")
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu_runs
    cuda = dockerfile_instructions(DOCKER_DIR / "Dockerfile.cuda")
    assert all(a.startswith("nvidia/cuda:") for i, a in cuda if i == "FROM" and not a.startswith("build"))
    assert "--index-url" not in " ".join(a for i, a in cuda if i == "RUN")


def test_dockerignore_keeps_the_context_small() -> None:
    entries = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "**/__pycache__", "bench_out"} <= entries
    assert not {"llmserve", "pyproject.toml", "README.md"} & entries  # the images are built from these
