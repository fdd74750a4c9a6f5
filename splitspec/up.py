"""`splitspec up`: the whole stack on one machine, on the bundled demo pair (CPU) or on your
own target and drafter folders (`--target-model`, `--draft-model`).

Starts the drafter and the target as two child processes (`python -m draft_service.cli`,
`python -m target_service.cli --drafter ...`), sharing a generated internal token unless
`SPLITSPEC_INTERNAL_TOKEN` is set; waits until both serve `grpc.health.v1` and the
target reports the drafter handshaken (`GetServerInfo`: drafter READY); then starts
`splitspec-gateway` (OpenAI-compatible HTTP) in front of the target and waits for its
/health; prints the addresses and examples; streams the logs with a `[target]`/`[draft]`/
`[gateway]` prefix; and on Ctrl-C or SIGTERM stops the gateway, the target, then the
drafter (SIGTERM, then SIGKILL after a grace).

Once up, it supervises: a service that exits is restarted on the same address after a
backoff (0.5 s, doubling to 10 s), with its last log lines printed, while the others keep
serving (the target serves without speculation while its drafter is away and
re-handshakes when it is back; the gateway answers 503 while its target is away and
reconnects). Only a crash loop (`--max-restarts` exits of one service within
`--restart-window-s`) stops the stack, with exit status 1.

The children run in their own process group, so a terminal's Ctrl-C reaches only this
process, which stops them in order; on Linux they also get SIGTERM if it dies.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

import splitspec.contract as defaults
from splitspec.cli_args import DEFAULT_SHM_DIR, PARENT_PID_ENV
from splitspec.contract import TOKEN_ENV
from splitspec.net import free_port

DRAFTERS = ("dflash", "eagle3", "draft_model", "ngram", "auto", "none")
DEFAULT_MODELS = Path(__file__).resolve().parents[1] / "demo"
READY_LINE = "splitspec up: ready at {address}"
GATEWAY_LINE = "OpenAI API at {url}"
EXIT_FAILED = 1


class UpError(RuntimeError):
    """The stack could not be brought up; the message says why."""


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="run the target and a drafter on the bundled demo pair (CPU)",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", default="dflash", choices=DRAFTERS,
                   help="drafter kind (auto: from --draft-model's config; none: no speculation)")
    p.add_argument("--models", type=Path, default=DEFAULT_MODELS,
                   help="folder with target/, dflash/, draft_model/, eagle3/ (scripts/train_demo.py writes the "
                        "first three)")
    p.add_argument("--target-model", type=Path, default=None,
                   help="your own target checkpoint folder (Qwen3, Llama, Qwen2), instead of --models/target")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="your own drafter checkpoint folder (DFlash, EAGLE-3 in either layout, a draft LM), "
                        "instead of --models/<drafter>")
    p.add_argument("--host", default="127.0.0.1", help="the target's public address (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=50051, help="the target's public port (0: any free port)")
    p.add_argument("--draft-port", type=int, default=50061, help="the drafter's port on 127.0.0.1 (0: any)")
    p.add_argument("--gateway-port", type=int, default=8000, help="the OpenAI HTTP port, on --host (0: any)")
    p.add_argument("--metrics-port", type=int, default=9400, help="the target's Prometheus port (0: any)")
    p.add_argument("--draft-metrics-port", type=int, default=9401, help="the drafter's Prometheus port (0: any)")
    p.add_argument("--no-gateway", action="store_true", help="do not start splitspec-gateway")
    p.add_argument("--served-model-name", default="splitspec-demo", help="the model name OpenAI clients pass")
    p.add_argument("--num-speculative-tokens", type=int, default=defaults.NUM_SPECULATIVE_TOKENS,
                   help="K: draft tokens per step")
    p.add_argument("--speculative-policy", default=defaults.SPECULATIVE_POLICY, choices=defaults.SPECULATIVE_POLICIES,
                   help="drafts per step: adaptive (0..K, what pays) or fixed (always K)")
    p.add_argument("--drafter-timeout-s", type=float, default=defaults.PROPOSE_TIMEOUT_S,
                   help="per-step Propose deadline")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences in a running batch (sizes the KV pool)")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV page dtype (auto: float32 on CPU; or fp8)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=defaults.ENABLE_PREFIX_CACHING,
                   help="the target reuses the KV of cached prompt pages (--no-prefix-caching: every prompt computed)")
    p.add_argument("--shm-dir", default=DEFAULT_SHM_DIR, help="where the shared KV pool file lives")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health and handshake")
    p.add_argument("--stop-timeout", type=float, default=20.0, help="seconds each service gets to stop on SIGTERM")
    p.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                   help="a service that exits more often than this within --restart-window-s stops the stack")
    p.add_argument("--restart-window-s", type=float, default=RestartPolicy.window_s, help="the window of --max-restarts")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=cmd_up)


@dataclass(frozen=True)
class RestartPolicy:
    """When a service that exited is started again, and when `up` gives up on it."""

    max_restarts: int = 5  # exits within window_s past which the stack stops
    window_s: float = 60.0
    first_backoff_s: float = 0.5  # doubled per exit within the window
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"--restart-window-s must be > 0, got {self.window_s}")
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(f"the restart backoff must be 0 < first <= max, got {self.first_backoff_s}, "
                             f"{self.max_backoff_s}")

    def backoff(self, recent_exits: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, recent_exits - 1))


# ---------------------------------------------------------------------------------------
# Child processes


@dataclass
class Child:
    """One service: its process, a thread copying its log lines to ours, and what it takes
    to start it again."""

    name: str
    module: str
    args: list[str]
    env: dict[str, str]
    out_lock: threading.Lock
    echo: bool = True
    proc: subprocess.Popen | None = None
    tail: list[str] = field(default_factory=list)
    exits: collections.deque = field(default_factory=collections.deque)  # monotonic times of recent exits
    restart_at: float | None = None  # set while it waits out its backoff
    pump: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, module: str, args: list[str], env: dict[str, str], out_lock: threading.Lock,
              echo: bool = True) -> Child:
        child = cls(name, module, args, env, out_lock, echo)
        child.spawn()
        return child

    def spawn(self) -> None:
        # Its own session (Ctrl-C reaches `up` alone, which stops each in order), and no
        # preexec_fn: with one, Python forks rather than spawns, and gRPC's fork handlers
        # (this process has used gRPC) crashed ~40% of such children before exec
        # (tests/test_up_children.py). Each service stops with `up` by itself (stop_with_parent).
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env | {PARENT_PID_ENV: str(os.getpid())}, start_new_session=True,
                                     text=True, errors="replace", bufsize=1)
        self.pump = threading.Thread(target=self._pump, args=(self.proc,), name=f"log-{self.name}", daemon=True)
        self.pump.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        prefix = f"[{self.name}] "
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.tail = (self.tail + [line])[-40:]
            if self.echo:
                with self.out_lock:
                    print(prefix + line, flush=True)

    def last_lines(self, count: int = 15) -> str:
        return "\n".join(f"  [{self.name}] {line}" for line in self.tail[-count:]) or "  (no output)"

    def tend(self, now: float, policy: RestartPolicy, say) -> None:
        """Notice an exit and schedule a restart, or restart once the backoff is over;
        UpError when the service is in a crash loop."""
        if self.restart_at is not None:
            self._restart_when_due(now, say)
        elif not self.running():
            self._schedule_restart(now, policy, say)

    def _restart_when_due(self, now: float, say) -> None:
        if now >= self.restart_at:
            self.restart_at = None
            self.spawn()
            say(f"splitspec up: {self.name} restarted (pid {self.proc.pid})")

    def _schedule_restart(self, now: float, policy: RestartPolicy, say) -> None:
        self.pump.join(timeout=2)  # its last lines, read to the end of its output
        self.exits.append(now)
        while self.exits and self.exits[0] < now - policy.window_s:
            self.exits.popleft()
        if len(self.exits) > policy.max_restarts:
            raise UpError(f"{self.name} exited {len(self.exits)} times within {policy.window_s:g} s (status "
                          f"{self.proc.returncode} last): a crash loop, giving up. Its last lines:\n"
                          f"{self.last_lines()}")
        delay = policy.backoff(len(self.exits))
        self.restart_at = now + delay
        say(f"splitspec up: {self.name} exited with status {self.proc.returncode}; restarting it in {delay:g} s. "
            f"Its last lines:\n{self.last_lines()}")

    def running(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.running():
            tail = "\n".join(self.tail[-15:])
            raise UpError(f"{self.name} exited with status {self.proc.returncode}:\n{tail}")

    def stop(self, timeout: float) -> int:
        if self.restart_at is not None:  # exited, its exit reported, waiting for its restart
            self.restart_at = None
            return 0
        return stop_process(self.proc, signal.SIGTERM, timeout)


def stop_process(proc: subprocess.Popen, sig: int, timeout: float) -> int:
    """Send `sig` (unless `proc` has exited); its exit status within `timeout` s, else once SIGKILLed."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---------------------------------------------------------------------------------------
# Readiness


def wait_serving(child: Child, address: str, deadline: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            child.check_alive()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise UpError(f"{child.name} at {address} was not SERVING in time")
            time.sleep(0.1)


def wait_handshake(target: Child, address: str, deadline: float):
    """Poll GetServerInfo until the drafter is READY (or NONE without one); its DrafterState."""
    from splitspec.v1 import generation_pb2 as pb
    from splitspec.v1 import generation_pb2_grpc as pb_grpc

    ready = (pb.DrafterState.STATUS_READY, pb.DrafterState.STATUS_NONE)
    state = None
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while True:
            target.check_alive()
            state = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).drafter
            if state.status in ready:
                return state
            if time.monotonic() > deadline:
                status = pb.DrafterState.Status.Name(state.status)
                raise UpError(f"the drafter is not handshaken ({status}: {state.detail or 'no detail'})")
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------
# The command


def model_dirs(models: Path, drafter: str, target_model: Path | None = None,
               draft_model: Path | None = None) -> tuple[Path, Path | None]:
    """(target folder, draft checkpoint folder or None): the folders given, else the demo
    folder's; a clear error when missing."""
    target = target_model or models / "target"
    draft = None
    if drafter in ("dflash", "eagle3", "draft_model", "auto"):
        draft = draft_model or models / drafter
    if drafter == "auto" and draft_model is None:
        raise UpError("--drafter auto tells the kind from --draft-model's config: pass --draft-model DIR")
    if drafter == "eagle3" and draft_model is None and not (draft / "config.json").is_file():
        raise UpError(f"no EAGLE-3 head in {draft} (the demo recipe trains none): pass --draft-model DIR")
    for folder, given in ((target, target_model), (draft, draft_model)):
        if folder is not None and not (folder / "config.json").is_file():
            hint = ("check the folder" if given is not None else
                    f"train the demo pair with `{command_path('python')} scripts/train_demo.py`, pass --models DIR, "
                    "or --target-model / --draft-model")
            raise UpError(f"no checkpoint in {folder}: {hint}")
    return target, draft


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not env.get(TOKEN_ENV, "").strip():
        env[TOKEN_ENV] = secrets.token_urlsafe(32)
    package_root = str(Path(__file__).resolve().parents[1])  # where splitspec, common, ... live
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def drafter_args(args: argparse.Namespace, target_dir: Path, draft_dir: Path | None, port: int) -> list[str]:
    model = ["--model", str(draft_dir)] if draft_dir is not None else []
    return ["--kind", args.drafter, *model, "--target-model", str(target_dir), "--host", "127.0.0.1",
            "--port", str(port), "--num-speculative-tokens", str(args.num_speculative_tokens),
            "--shm-dir", args.shm_dir, "--metrics-port", str(args.draft_metrics_port), "--log-level", args.log_level]


def target_args(args: argparse.Namespace, target_dir: Path, drafter_address: str | None, port: int) -> list[str]:
    drafter = ["--drafter", drafter_address, "--num-speculative-tokens", str(args.num_speculative_tokens),
               "--speculative-policy", args.speculative_policy,
               "--drafter-timeout-s", str(args.drafter_timeout_s)] if drafter_address else []
    return ["--model", str(target_dir), "--host", args.host, "--port", str(port), *drafter,
            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-dtype", args.kv_cache_dtype,
            "--prefix-caching" if args.prefix_caching else "--no-prefix-caching",
            "--shm-dir", args.shm_dir, "--metrics-port", str(args.metrics_port), "--shutdown-grace-s", "5",
            "--log-level", args.log_level]


def gateway_args(args: argparse.Namespace, target_address: str, port: int) -> list[str]:
    return ["--target", target_address, "--host", args.host, "--port", str(port), "--served-model-name",
            args.served_model_name, "--shutdown-grace-s", "5", "--log-level", args.log_level]


def wait_http_ok(child: Child, url: str, deadline: float) -> None:
    import urllib.error
    import urllib.request

    while True:
        child.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise UpError(f"{child.name} at {url} was not healthy in time")
        time.sleep(0.1)


def command_path(name: str) -> str:
    """How to run an installed command from here: the venv's own copy (relative to the
    current folder when inside it), so a pasted command works without activating the venv."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host


class Stack:
    """The running pair; `stop` ends the target first (it drains), then the drafter."""

    def __init__(self, echo: bool = True) -> None:
        self.children: list[Child] = []
        self.out_lock = threading.Lock()
        self.echo = echo  # False: keep the services' logs to themselves (scripts, tests)

    def start(self, name: str, module: str, args: list[str], env: dict[str, str]) -> Child:
        child = Child.start(name, module, args, env, self.out_lock, self.echo)
        self.children.append(child)
        return child

    def say(self, message: str) -> None:
        if not self.echo:
            return
        with self.out_lock:
            print(message, flush=True)

    def supervise(self, stop: threading.Event, policy: RestartPolicy) -> None:
        """Restart the services that exit until `stop` is set; UpError on a crash loop."""
        while not stop.wait(0.2):
            now = time.monotonic()
            for child in self.children:
                child.tend(now, policy, self.say)

    def stop(self, timeout: float) -> bool:
        clean = True
        for child in reversed(self.children):
            code = child.stop(timeout)
            clean &= code in (0, -signal.SIGTERM)
            self.say(f"splitspec up: {child.name} stopped (status {code})")
        return clean


def bring_up(args: argparse.Namespace, stack: Stack) -> str:
    """Start both services and wait until they are ready; the target's client address."""
    target_dir, draft_dir = model_dirs(args.models, args.drafter, args.target_model, args.draft_model)
    env = child_env()
    deadline = time.monotonic() + args.startup_timeout
    drafter_address = None
    if args.drafter != "none":
        port = args.draft_port or free_port("127.0.0.1")
        drafter_address = f"127.0.0.1:{port}"
        draft = stack.start("draft", "draft_service.cli", drafter_args(args, target_dir, draft_dir, port), env)
        wait_serving(draft, drafter_address, deadline)
    port = args.port or free_port(args.host)
    address = f"{_client_host(args.host)}:{port}"
    target = stack.start("target", "target_service.cli", target_args(args, target_dir, drafter_address, port), env)
    wait_serving(target, address, deadline)
    state = wait_handshake(target, address, deadline)
    drafter = f"drafter {state.kind} at {drafter_address}, K={state.num_speculative_tokens}" \
        if drafter_address else "no drafter"
    lines = [f"{READY_LINE.format(address=address)} ({drafter})",
             f"  try: {command_path('splitspec')} generate --target {address} \"def fibonacci(n):\""]
    if not args.no_gateway:
        port = args.gateway_port or free_port(args.host)
        base = f"http://{_client_host(args.host)}:{port}"
        gateway = stack.start("gateway", "splitspec.gateway.cli", gateway_args(args, address, port), env)
        wait_http_ok(gateway, f"{base}/health", deadline)
        body = json.dumps({"model": args.served_model_name, "prompt": "def fibonacci(n):", "max_tokens": 64})
        lines[0] += f"; {GATEWAY_LINE.format(url=base + '/v1')}"
        lines.append(f"       curl -s {base}/v1/completions -H 'Content-Type: application/json' -d '{body}'")
    lines.append("  Ctrl-C stops them all.")
    stack.say("\n".join(lines))
    return address


class Interrupted(Exception):
    """Ctrl-C or SIGTERM while the stack was still starting."""


def cmd_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    starting = True

    def on_signal(signum, frame) -> None:
        stop.set()
        if starting:
            raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack()
    code = 0
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
        bring_up(args, stack)
        starting = False
        stack.supervise(stop, policy)
    except ValueError as exc:
        stack.say(f"splitspec up: error: {exc}")
        code = EXIT_FAILED
    except Interrupted:
        pass
    except UpError as exc:
        stack.say(f"splitspec up: error: {exc}")
        code = EXIT_FAILED
    finally:
        starting = False
        stack.say("splitspec up: stopping")
        if not stack.stop(args.stop_timeout):
            code = EXIT_FAILED
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
