"""Metrics through a real Prometheus, the dashboard's PromQL, and the compose files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from splitspec.v1 import generation_pb2 as pb
from tests.procs import (
    REPO_ROOT,
    TOKEN,
    Service,
    family_of,
    free_port,
    scrape_metrics,
    server_info,
    stream_tokens,
)
from tests.tiny_models import PROMPTS, make_qwen3

pytestmark = pytest.mark.slow
PROMETHEUS = shutil.which("prometheus")
COMPOSE = shutil.which("docker-compose")
BIN = Path(sys.executable).parent
METRIC_NAME = re.compile(r"\b(splitspec_[a-z0-9_]+)")


def _http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def exported_families(metrics_text: str) -> set[str]:
    return {line.split()[2] for line in metrics_text.splitlines() if line.startswith("# TYPE ")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A target and an ngram drafter with metrics endpoints on loopback, and a gateway."""
    tmp = tmp_path_factory.mktemp("obs")
    model = make_qwen3(tmp / "model")
    ports = {"target_metrics": free_port(), "draft_metrics": free_port(), "gateway": free_port()}
    drafter = Service("draft_service.cli", ["--kind", "ngram", "--port", "0", "--metrics-port",
                                            str(ports["draft_metrics"])], tmp / "drafter.log")
    target = gateway = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(tmp),
                                                "--num-pages", "256", "--drafter", drafter.address,
                                                "--speculative-policy", "fixed",
                                                "--metrics-port", str(ports["target_metrics"])], tmp / "target.log")
        target.wait_serving()
        gateway = Service("splitspec.gateway.cli", ["--target", target.address, "--port", str(ports["gateway"])],
                          tmp / "gateway.log", metrics_flag=False)
        gateway.wait_listening()
        yield {"target": target.address, "tmp": tmp, **ports}
    finally:
        if gateway is not None:
            gateway.stop()
        if target is not None:
            target.stop()
        drafter.kill()


def _prometheus_config(tmp: Path, target_port: int, draft_port: int, gateway_port: int) -> Path:
    """The repo's scrape config, its jobs pointed at loopback."""
    config = yaml.safe_load((REPO_ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    ports = {"splitspec-target": target_port, "splitspec-draft": draft_port, "splitspec-gateway": gateway_port}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(ports), "the repo's scrape config names other jobs than the three services"
    for name, port in ports.items():
        jobs[name]["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _query(base: str, promql: str) -> float | None:
    reply = json.loads(_http_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    result = reply["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _gateway_completion(port: int, prompt: str) -> dict:
    """One OpenAI completion through the gateway; its usage."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 20, "ignore_eos": True, "temperature": 0})
    models = json.loads(_http_get(f"http://127.0.0.1:{port}/v1/models"))
    body = body.replace('"m"', json.dumps(models["data"][0]["id"]))
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["usage"]


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is installed by .ci/run")
def test_prometheus_reads_what_the_responses_report(stack):
    tmp = stack["tmp"]
    config = _prometheus_config(tmp, stack["target_metrics"], stack["draft_metrics"], stack["gateway"])
    port = free_port()
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
    base = f"http://127.0.0.1:{port}"
    try:
        requests = [pb.GenerateRequest(text=p, stop=pb.StopParams(max_tokens=20, ignore_eos=True))
                    for p in PROMPTS[:12]]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda r: stream_tokens(stack["target"], r), requests))
        usage = _gateway_completion(stack["gateway"], PROMPTS[0])  # one more, through the gateway
        drafted = sum(c.usage.draft_tokens for _, c in results) + usage["speculation"]["draft_tokens"]
        accepted = sum(c.usage.accepted_tokens for _, c in results) + usage["speculation"]["accepted_tokens"]
        assert drafted > 0
        want = {
            "sum(splitspec_spec_decode_num_accepted_tokens_total) / sum(splitspec_spec_decode_num_draft_tokens_total)":
                accepted / drafted,
            "sum(splitspec_time_to_first_token_seconds_count)": len(requests) + 1,
            "sum(splitspec_requests_finished_total)": len(requests) + 1,
            "sum(splitspec_generation_tokens_total)": sum(len(t) for t, _ in results) + usage["completion_tokens"],
            "sum(splitspec_spec_decode_num_drafts_total)":
                sum(c.usage.num_drafts for _, c in results) + usage["speculation"]["num_drafts"],
            "splitspec_drafter_up": 1,
            'up{job="splitspec-draft"}': 1,
            'up{job="splitspec-gateway"}': 1,
            "sum(splitspec_gateway_generation_tokens_total)": usage["completion_tokens"],
            'sum(splitspec_gateway_requests_total{endpoint="/v1/completions",status="200"})': 1,
        }
        deadline = time.monotonic() + 60
        got = {}
        while time.monotonic() < deadline:
            try:
                got = {q: _query(base, q) for q in want}
            except OSError:
                got = {}
            if all(got.get(q) is not None and abs(got[q] - v) < 1e-9 for q, v in want.items()):
                break
            time.sleep(0.5)
        assert got == pytest.approx(want), (tmp / "prometheus.log").read_text()[-2000:]
    finally:
        prometheus.terminate()
        prometheus.wait(30)


def test_dashboard_names_only_exported_metrics(stack):
    exported = exported_families(_http_get(f"http://127.0.0.1:{stack['target_metrics']}/metrics"))
    exported |= exported_families(_http_get(f"http://127.0.0.1:{stack['draft_metrics']}/metrics"))
    dashboard = json.loads((REPO_ROOT / "deploy/grafana/dashboards/splitspec.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 15
    used = {family_of(name) for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used and used <= {family_of(name) for name in exported}, used - exported


def test_docs_document_every_exported_metric(stack):
    """Every family the services export is in docs/metrics.md, the page the README links for them."""
    exported = exported_families(_http_get(f"http://127.0.0.1:{stack['target_metrics']}/metrics"))
    exported |= exported_families(_http_get(f"http://127.0.0.1:{stack['draft_metrics']}/metrics"))
    documented = (REPO_ROOT / "docs" / "metrics.md").read_text()
    assert "docs/metrics.md" in (REPO_ROOT / "README.md").read_text()
    ours = {family_of(name) for name in exported if name.startswith("splitspec_")}
    missing = sorted(name for name in ours if name not in documented)
    assert not missing, f"docs/metrics.md does not document {missing}"


def _is_traffic(sample: str) -> bool:
    """Samples that count requests, tokens or speculation (a handshake is not traffic)."""
    name = sample.split("{", 1)[0]
    return name.endswith(("_total", "_count", "_sum")) and name != "splitspec_drafter_handshakes_total"


def test_warmup_traffic_never_reaches_served_metrics(tmp_path, shm_dir):
    """The target warms up (a prefill and decodes, speculated: the drafter is attached)
    before it reports SERVING. Scraped at that moment, every served counter and histogram
    is still zero, while the drafter's own metrics show that warmup did propose."""
    model = make_qwen3(tmp_path / "model")
    target_metrics, draft_metrics = free_port(), free_port()
    drafter = Service("draft_service.cli", ["--kind", "ngram", "--port", "0", "--metrics-port", str(draft_metrics)],
                      tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(shm_dir),
                                                "--drafter", drafter.address, "--metrics-port", str(target_metrics)],
                         tmp_path / "target.log")
        target.wait_serving()
        served = scrape_metrics(target_metrics)
        assert scrape_metrics(draft_metrics)["splitspec_draft_propose_latency_seconds_count"] >= 1  # warmup proposed
        assert served["splitspec_drafter_up"] == 1
        assert served['splitspec_drafter_handshakes_total{result="ok"}'] == 1
        traffic = {name: value for name, value in served.items() if _is_traffic(name)}
        assert "splitspec_drafter_propose_latency_seconds_count" in traffic and len(traffic) >= 15
        assert {name: value for name, value in traffic.items() if value} == {}
        assert served["splitspec_kv_cache_free_pages"] == served["splitspec_kv_cache_pages"]
        assert target.stop() == 0, target.log()
    finally:
        if target is not None:
            target.kill()
        drafter.stop()


# ---------------------------------------------------------------- docker-compose


def _compose_config(*files: str) -> dict:
    args = [COMPOSE, *[a for f in files for a in ("-f", f)], "config"]
    out = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={"SPLITSPEC_INTERNAL_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.skipif(COMPOSE is None, reason="Debian's docker-compose package is installed by .ci/run")
def test_compose_files_validate():
    gpu = _compose_config("docker-compose.yml")
    assert set(gpu["services"]) == {"target", "draft", "gateway", "prometheus", "grafana"}
    for name in ("target", "draft"):
        service = gpu["services"][name]
        assert service["ipc"] == "host" and service["pid"] == "host"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert gpu["services"]["draft"]["deploy"] == gpu["services"]["target"]["deploy"]  # the same GPU
    assert gpu["services"]["target"]["depends_on"]["draft"]["condition"] == "service_healthy"
    command = " ".join(gpu["services"]["target"]["command"])
    for default in ("Qwen/Qwen3-8B", "--kv-cache-dtype=fp8", "--num-speculative-tokens=8", "flashinfer"):
        assert default in command
    assert "z-lab/Qwen3-8B-DFlash-b16" in " ".join(gpu["services"]["draft"]["command"])
    cpu = _compose_config("docker-compose.cpu.yml")
    assert set(cpu["services"]) == {"target", "draft", "gateway", "prometheus", "grafana"}
    assert "deploy" not in cpu["services"]["target"]
    for config in (gpu, cpu):
        gateway = config["services"]["gateway"]
        assert "deploy" not in gateway and gateway["depends_on"]["target"]["condition"] == "service_healthy"
        assert "--target=target:50051" in gateway["command"]


def _loopback(argv: list[str], swaps: dict[str, str]) -> list[str]:
    """The compose command with container addresses and paths swapped for loopback ones."""
    out = []
    for arg in argv:
        for old, new in swaps.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return out


@pytest.mark.skipif(COMPOSE is None, reason="Debian's docker-compose package is installed by .ci/run")
def test_cpu_compose_services_run_as_configured(tmp_path):
    """Run target and draft with exactly the CPU variant's commands and environment, on
    loopback: only the container's addresses, ports and /app paths are swapped."""
    services = _compose_config("docker-compose.cpu.yml")["services"]
    ports = {"50051": str(free_port()), "9400": str(free_port()), "9401": str(free_port()), "8000": str(free_port())}
    swaps = {"unix:///run/splitspec/": f"unix://{tmp_path}/", "/app/": f"{REPO_ROOT}/", "0.0.0.0": "127.0.0.1",
             "--port=50051": f"--port={ports['50051']}", "--metrics-port=9400": f"--metrics-port={ports['9400']}",
             "--metrics-port=9401": f"--metrics-port={ports['9401']}", "target:50051": f"127.0.0.1:{ports['50051']}",
             "--port=8000": f"--port={ports['8000']}", "localhost:8000": f"localhost:{ports['8000']}"}
    procs = {}
    try:
        for name in ("draft", "target", "gateway"):  # the compose order: each depends on the one before
            service = services[name]
            argv = _loopback(service["command"], swaps)
            argv[0] = str(BIN / argv[0])
            env = {"PATH": f"{BIN}:/usr/bin:/bin", **service.get("environment", {})}
            if name != "gateway":  # /dev/shm is the containers'; keep the test's own (both services)
                argv.append(f"--shm-dir={tmp_path}")
            log = (tmp_path / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            health = _loopback(service["healthcheck"]["test"][1:], {**swaps, "localhost:50051":
                                                                     f"localhost:{ports['50051']}"})
            health[0] = str(BIN / health[0])
            _wait_healthy(health, procs[name], tmp_path / f"{name}.log")
        info = server_info(f"127.0.0.1:{ports['50051']}")
        assert info.drafter.status == pb.DrafterState.STATUS_READY, info
        assert info.drafter.kind == "dflash"
        for port in (ports["9400"], ports["9401"], ports["8000"]):
            assert "splitspec_" in _http_get(f"http://127.0.0.1:{port}/metrics")
        models = json.loads(_http_get(f"http://127.0.0.1:{ports['8000']}/v1/models"))
        assert [m["id"] for m in models["data"]] == ["splitspec-demo"]
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)


def _wait_healthy(command: list[str], proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{command} exited:\n{log.read_text()}")
        if subprocess.run(command, capture_output=True, timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"not healthy within {timeout} s: {command}\n{log.read_text()}")
