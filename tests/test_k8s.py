"""deploy/k8s: the rendered overlays validate against the Kubernetes API schemas (offline,
the schemas `kubernetes-validate` ships), and every container command is one the
services' own argument parsers accept, with the settings that must agree between them."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.procs import REPO_ROOT

K8S = REPO_ROOT / "deploy/k8s"
KUBERNETES_VERSION = "1.34"  # the oldest we claim: resource.k8s.io/v1 (DRA) and the preStop sleep action are GA
OVERLAYS = ("gpu", "cpu")
KUSTOMIZE = shutil.which("kubectl") or shutil.which("kustomize")


def render(folder: Path) -> list[dict]:
    """`kubectl kustomize` (or `kustomize build`) of a folder, as a list of objects."""
    if KUSTOMIZE is None:
        pytest.fail("deploy/k8s is rendered with kustomize: install kubectl (it embeds kustomize) or kustomize")
    verb = ["kustomize"] if Path(KUSTOMIZE).name == "kubectl" else ["build"]
    run = subprocess.run([KUSTOMIZE, *verb, str(folder)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def by_kind(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def parsers() -> dict[str, argparse.ArgumentParser]:
    from draft_service.cli import build_parser as draft_parser
    from splitspec.cli import build_parser as client_parser
    from splitspec.gateway.cli import build_parser as gateway_parser
    from target_service.cli import build_parser as target_parser

    return {"splitspec-target": target_parser(), "splitspec-draft": draft_parser(),
            "splitspec-gateway": gateway_parser(), "splitspec": client_parser()}


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse a container's command line with its program's own parser (SystemExit = refused)."""
    program, *rest = argv
    parser = parsers().get(program)
    assert parser is not None, f"unknown program {program!r}"
    try:
        return parser.parse_args(rest)
    except SystemExit:
        pytest.fail(f"{program} refuses {rest}")


def command_lines(pod_spec: dict) -> list[tuple[str, list[str]]]:
    """(where, argv) of every container command and exec probe in a Pod spec."""
    lines = []
    for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        lines.append((container["name"], [*container.get("command", []), *container.get("args", [])]))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in container.get(probe, {}):
                lines.append((f"{container['name']}.{probe}", container[probe]["exec"]["command"]))
    return lines


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(K8S / "overlays" / request.param)


def test_kustomize_is_recent_enough():
    if KUSTOMIZE is None:
        pytest.fail("install kubectl (it embeds kustomize) or kustomize to render deploy/k8s")
    if Path(KUSTOMIZE).name != "kubectl":
        return
    out = subprocess.run([KUSTOMIZE, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"Kustomize Version: v(\d+)", out)
    assert match and int(match[1]) >= 4, f"the overlays use `patches:` (kustomize >= 4): {out}"


def test_every_manifest_validates_against_the_api_schemas(overlay):
    name, objects = overlay
    extra = [yaml.safe_load((K8S / "overlays/gpu/download-models.yaml").read_text())] if name == "gpu" else []
    assert {o["kind"] for o in objects} >= {"Deployment", "Service"}
    for obj in objects + extra:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_base_validates_too():
    for obj in render(K8S / "base"):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_bad_manifest(overlay):
    """The validation above can fail: a misspelled field and a wrong type are refused."""
    _, objects = overlay
    deployment = by_kind(objects, "Deployment", "splitspec")
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["shareProcessNamespaces"] = True
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "two"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_container_commands_parse_with_the_services_own_parsers(overlay):
    name, objects = overlay
    extra = [yaml.safe_load((K8S / "overlays/gpu/download-models.yaml").read_text())] if name == "gpu" else []
    seen = set()
    for obj in objects:
        if obj["kind"] == "Deployment":
            for where, argv in command_lines(obj["spec"]["template"]["spec"]):
                parse(argv)
                seen.add(argv[0])
    assert seen == {"splitspec-target", "splitspec-draft", "splitspec-gateway", "splitspec"}
    assert all(job["kind"] == "Job" and job["spec"]["template"]["spec"]["containers"][0]["command"][0] == "hf"
               for job in extra)


def test_the_model_pod_shares_what_the_split_needs(overlay):
    name, objects = overlay
    deployment = by_kind(objects, "Deployment", "splitspec")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True and not spec.get("hostIPC") and not spec.get("hostPID")
    containers = {c["name"]: c for c in spec["containers"]}
    target = parse([*containers["target"]["command"], *containers["target"]["args"]])
    draft = parse([*containers["draft"]["command"], *containers["draft"]["args"]])
    # the internal channel: the drafter's Unix socket, on an emptyDir both containers mount
    assert target.drafter == draft.host and draft.host.startswith("unix://")
    socket_dir = str(Path(draft.host.removeprefix("unix://")).parent)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in containers.values():
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts[socket_dir]]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"  # the CPU pool file; NCCL/CUDA IPC
        env = {e["name"]: e for e in container["env"]}
        assert env["SPLITSPEC_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "splitspec-internal",
                                                                                "key": "token"}
    assert target.shm_dir == "/dev/shm"
    # probes: the target's own gRPC health on its port; the drafter's through its socket
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert containers["target"][probe]["grpc"]["port"] == target.port
        assert parse(containers["draft"][probe]["exec"]["command"]).address == draft.host
    # shutdown: preStop, then the target's drain, within the grace period; the drafter outlives the drain
    grace = spec["terminationGracePeriodSeconds"]
    target_stop = containers["target"]["lifecycle"]["preStop"]["sleep"]["seconds"]
    draft_stop = containers["draft"]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert target_stop + target.shutdown_grace_s < grace
    assert draft_stop >= target_stop + target.shutdown_grace_s
    assert draft_stop + draft.shutdown_grace_s <= grace
    for container in containers.values():
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == target.metrics_port
    if name == "gpu":
        assert target.device == draft.device == "cuda"
        claims = spec["resourceClaims"]
        assert len(claims) == 1  # one claim for the Pod...
        template = by_kind(objects, "ResourceClaimTemplate", claims[0]["resourceClaimTemplateName"])
        requests = template["spec"]["spec"]["devices"]["requests"]
        assert len(requests) == 1 and requests[0]["exactly"]["count"] == 1
        for container in containers.values():  # ...that both containers use: the same GPU
            assert container["resources"]["claims"] == [{"name": claims[0]["name"]}]
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == by_kind(
            objects, "PersistentVolumeClaim", "splitspec-models")["metadata"]["name"]
    else:
        assert target.device == draft.device == "cpu" and "resourceClaims" not in spec
        assert target.model.startswith("/app/demo/")


def test_services_and_the_gateway_point_at_the_right_ports(overlay):
    name, objects = overlay
    model_pod = by_kind(objects, "Deployment", "splitspec")["spec"]["template"]
    gateway_pod = by_kind(objects, "Deployment", "splitspec-gateway")["spec"]["template"]
    target_service = by_kind(objects, "Service", "splitspec-target")
    gateway_service = by_kind(objects, "Service", "splitspec-gateway")
    assert target_service["spec"]["clusterIP"] == "None"  # headless: the gateway balances over every target
    for service, pod in ((target_service, model_pod), (gateway_service, gateway_pod)):
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    container = gateway_pod["spec"]["containers"][0]
    gateway = parse([*container["command"], *container["args"]])
    target_port = next(p["port"] for p in target_service["spec"]["ports"] if p["name"] == "grpc")
    assert gateway.target.startswith("dns:///splitspec-target.") and gateway.target.endswith(f":{target_port}")
    assert gateway.host == "0.0.0.0" and container["ports"][0]["containerPort"] == gateway.port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == gateway.port
    assert container[probe]["httpGet"]["path"] in ("/health", "/metrics")
    stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert stop + gateway.shutdown_grace_s < gateway_pod["spec"]["terminationGracePeriodSeconds"]
    if name == "cpu":
        assert gateway.served_model_name == "splitspec-demo"


@pytest.mark.parametrize("compose", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_commands_parse_with_the_services_own_parsers(compose):
    services = yaml.safe_load((REPO_ROOT / compose).read_text())["services"]
    for name in ("target", "draft", "gateway"):
        parse(services[name]["command"])
    for name in ("target", "draft"):
        parse(services[name]["healthcheck"]["test"][1:])
