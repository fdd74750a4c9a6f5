"""The channels' security and limits through real processes.

- The drafter listens on loopback unless told otherwise; every internal call needs the
  shared token, compared in constant time.
- The public API serves TLS (`--tls-cert/--tls-key`) with a certificate this test makes;
  the `splitspec` client connects with `--tls-ca`; a plaintext client fails.
- gRPC message size limits hold on both servers: a too-large message is
  RESOURCE_EXHAUSTED and the server keeps serving.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import auth
from common.auth import auth_metadata
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import REPO_ROOT, TOKEN, Service, client_cmd, private_shm_dir, served_drafter
from tests.tiny_models import PROMPTS, make_qwen3

MiB = 1 << 20


# ---------------------------------------------------------------- a certificate of our own


def make_self_signed(out_dir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = out_dir / "cert.pem", out_dir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[Path, Path]:
    return make_self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_target(tmp_path_factory, tls_files):
    """A target serving TLS, with a 1 MiB message limit."""
    root = tmp_path_factory.mktemp("tls-target")
    model = make_qwen3(root / "model")
    cert, key = tls_files
    shm = private_shm_dir()
    proc = Service("target_service.cli", [
        "--model", str(model), "--port", "0", "--shm-dir", str(shm), "--num-pages", "64",
        "--tls-cert", str(cert), "--tls-key", str(key), "--max-message-bytes", "1MiB",
    ], root / "target.log")
    try:
        proc.wait_serving(credentials=grpc.ssl_channel_credentials(cert.read_bytes()))
        assert "(TLS)" in proc.log()
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        proc.kill()
        shutil.rmtree(shm, ignore_errors=True)


def tls_channel(address: str, cert: Path) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(cert.read_bytes()))


def request(text: str, max_tokens: int = 6) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True))


def complete_of(stub, msg) -> pb.Complete:
    return list(stub.Generate(msg, timeout=60))[-1].complete


# ---------------------------------------------------------------- TLS on the public API


def test_tls_clients_are_served_and_plaintext_ones_fail(tls_target, tls_files):
    cert, _ = tls_files
    with tls_channel(tls_target.address, cert) as channel:
        complete = complete_of(pb_grpc.GenerationStub(channel), request(PROMPTS[0]))
        assert complete.finish_reason == pb.FINISH_REASON_LENGTH and complete.usage.completion_tokens == 6
    with grpc.insecure_channel(tls_target.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            complete_of(pb_grpc.GenerationStub(channel), request(PROMPTS[0]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_the_client_cli_speaks_tls_with_tls_ca(tls_target, tls_files):
    cert, _ = tls_files

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*client_cmd(), *args], check=False, capture_output=True, text=True, timeout=60,
                              cwd=REPO_ROOT)

    done = run("generate", "--target", tls_target.address, "--tls-ca", str(cert), "--max-tokens", "4",
               "--ignore-eos", PROMPTS[1])
    assert done.returncode == 0 and "completion_tokens=4" in done.stderr, done.stderr
    done = run("health", tls_target.address, "--tls-ca", str(cert))
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    done = run("info", "--target", tls_target.address, "--tls-ca", str(cert))
    assert done.returncode == 0 and "Qwen3ForCausalLM" in done.stdout, done.stderr
    done = run("health", tls_target.address, "--timeout", "2")  # plaintext against TLS
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr
    done = run("generate", "--target", tls_target.address, "--tls-ca", "/no/such/ca.pem", "hi")
    assert done.returncode == 2 and "cannot read --tls-ca /no/such/ca.pem" in done.stderr


def test_the_gateway_reaches_a_tls_target_with_tls_ca(tls_target, tls_files, tmp_path):
    import httpx2

    cert, _ = tls_files
    gateways = []
    try:
        for extra in (["--tls-ca", str(cert)], []):  # with the CA, and plaintext against TLS
            gateway = Service("splitspec.gateway.cli", ["--target", tls_target.address, "--port", "0", *extra],
                              tmp_path / f"gateway{len(gateways)}.log", metrics_flag=False)
            gateways.append(gateway)
            gateway.wait_listening()
        good, plain = (f"http://{g.address}" for g in gateways)
        model = httpx2.get(f"{good}/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx2.post(f"{good}/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 4,
                                                            "ignore_eos": True}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text
        assert httpx2.get(f"{plain}/health", timeout=30).status_code == 503
    finally:
        for gateway in gateways:
            assert gateway.stop() == 0, gateway.log()
    bad = subprocess.run([*_gateway_cmd(), "--target", tls_target.address, "--tls-ca", "/no/such/ca.pem"],
                         capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert bad.returncode == 2 and "cannot read --tls-ca /no/such/ca.pem" in bad.stderr


def _gateway_cmd() -> list[str]:
    return [sys.executable, "-m", "splitspec.gateway.cli"]


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "KEY"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/no/such/cert.pem", "--tls-key", "KEY"], "cannot read --tls-cert /no/such/cert.pem"),
    (["--tls-cert", "CERT", "--tls-key", "/no/such/key.pem"], "cannot read --tls-key /no/such/key.pem"),
    (["--tls-cert", "KEY", "--tls-key", "KEY"], "not a PEM certificate"),
    (["--tls-cert", "CERT", "--tls-key", "CERT"], "not a PEM private key"),
])
def test_bad_tls_flags_are_usage_errors_naming_the_problem(tls_files, capsys, flags, message):
    from target_service.cli import main

    cert, key = tls_files
    args = [{"CERT": str(cert), "KEY": str(key)}.get(a, a) for a in flags]
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "never-loaded", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- message size limits


def test_a_message_over_the_limit_is_resource_exhausted_and_the_target_keeps_serving(tls_target, tls_files):
    cert, _ = tls_files
    with tls_channel(tls_target.address, cert) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            complete_of(stub, request("x" * (2 * MiB)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert complete_of(stub, request(PROMPTS[2])).finish_reason == pb.FINISH_REASON_LENGTH


# ---------------------------------------------------------------- the drafter's channel


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """An ngram drafter with default --host and a 1 MiB message limit."""
    with served_drafter(tmp_path_factory.mktemp("drafter") / "drafter.log", "--kind", "ngram",
                        "--max-message-bytes", "1MiB") as proc:
        yield proc


def _proc_net_address(hex_host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} addresses are 32-bit words in host (little-endian) order."""
    words = [bytes.fromhex(hex_host[i:i + 8])[::-1] for i in range(0, len(hex_host), 8)]
    return ipaddress.ip_address(b"".join(words))


def _listening_addresses(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses with a LISTEN socket on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # TCP_LISTEN
                found.append(_proc_net_address(host))
    return found


def _is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC may listen on ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def _outward_ipv4() -> str | None:
    """This host's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_drafter_binds_loopback_by_default(drafter):
    host, port = drafter.address.rsplit(":", 1)
    assert host == "127.0.0.1"
    addresses = _listening_addresses(int(port))
    assert addresses and all(_is_loopback(a) for a in addresses), addresses  # no 0.0.0.0, no ::
    outward = _outward_ipv4()
    if outward is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((outward, int(port)), timeout=5).close()


def test_every_internal_call_needs_the_token(drafter):
    with grpc.insecure_channel(drafter.address) as channel:
        stub = dpb_grpc.DrafterStub(channel)
        calls = [(stub.Negotiate, dpb.NegotiateRequest(target_id="t")), (stub.Attach, dpb.AttachRequest()),
                 (stub.Propose, dpb.ProposeRequest()), (stub.Release, dpb.ReleaseRequest())]
        for method, msg in calls:
            for metadata in (None, auth_metadata("wrong-token"), auth_metadata(TOKEN + "x"), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError) as err:
                    method(msg, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, err.value)
        # with the token, the same call reaches the drafter (and fails on its merits)
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(dpb.ProposeRequest(), metadata=auth_metadata(TOKEN), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_the_token_is_compared_in_constant_time(monkeypatch):
    compared = []

    def spy(a, b):
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.token_matches(auth_metadata("secret"), "secret")
    assert not auth.token_matches(auth_metadata("secreT"), "secret")
    assert compared == [(b"secret", b"secret"), (b"secreT", b"secret")]


def test_a_message_over_the_drafters_limit_is_resource_exhausted(drafter):
    with grpc.insecure_channel(drafter.address) as channel:
        big = dpb.NegotiateRequest(target_id="t", target=dpb.TargetFacts(fingerprint="f" * (2 * MiB)))
        with pytest.raises(grpc.RpcError) as err:
            dpb_grpc.DrafterStub(channel).Negotiate(big, metadata=auth_metadata(TOKEN), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_target_to_drafter_channel_sets_the_limits(monkeypatch):
    from target_service.drafter_link import DrafterLink, DrafterLinkConfig

    captured = {}
    real = grpc.insecure_channel

    def spy(address, options=None, **kw):
        captured.update(options or ())
        return real(address, options=options, **kw)

    monkeypatch.setattr(grpc, "insecure_channel", spy)
    DrafterLink(DrafterLinkConfig("127.0.0.1:1", "token", max_message_bytes=3 * MiB)).close()
    assert captured["grpc.max_send_message_length"] == captured["grpc.max_receive_message_length"] == 3 * MiB
