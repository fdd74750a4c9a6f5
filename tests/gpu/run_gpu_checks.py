#!/usr/bin/env python
"""The GPU checks of issue 12, one section per subprocess: a JSON report written after every section.

Sections, in order (each its own verdict, its own time limit; the report's `ok` needs all):
  env          versions (python, torch, CUDA, flashinfer, grpcio, protobuf), nvcc, the device,
               allocator settings, FlashInfer's facts (common/flashinfer_probe.py)
  jit          compiles every FlashInfer module the later sections load, once, up front and
               concurrently, as the services load them (JitSpec.build_and_load), for the
               GPU's architecture only (FLASHINFER_CUDA_ARCH_LIST / TORCH_CUDA_ARCH_LIST from
               torch.cuda.get_device_capability: 9.0a on an H200); seconds per module, and
               per file from ninja's log. The kernel family is pinned: FlashInfer's FA2
  ipc          CUDA IPC between two unrelated processes (tests/gpu/ipc_check.py): map, canary,
               a page the target wrote, a draft page the target reads, alive after the target
               let go, and re-attach cycles after which torch.cuda.mem_get_info shows the old
               pools' memory returned
  parity       FlashInfer backend vs torch backend on one layer (32 q heads, 8 KV heads, dim
               128, page 16): causal prefill with context, K+1 verify, DFlash's non-causal
               block, decode, a mixed batch; NHD and HND; bf16 and fp8 e4m3 pages with scales
               0.5 / 2.0; appended pages bit-identical, outputs as close to a float32 reference
               as the torch backend's
  split_stack  real target and DFlash drafter processes on the GPU with the bundled demo pair
               (demo/target, demo/dflash): torch backend in float32 (output must be identical)
               and FlashInfer with fp8 KV (identical, or every divergence a near-tie of the
               float32 target); attaches over CUDA IPC, drafts, acceptance length
  step_times   random-weight Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, dim
               128, vocab 151936, bf16) and a 5-layer DFlash-shaped drafter, FlashInfer, fp8
               KV: decode, K+1 verify, drafter step, Propose round trip (gRPC to a real drafter
               process), and the speedup they imply at the demo pair's acceptance length
               (measured by split_stack, else the README's) and at 3, 5, 7:
               speedup(tau) = tau * t_decode / (t_verify + t_draft + t_rtt)

Usage: python tests/gpu/run_gpu_checks.py [--budget-s 450] [--sections a,b] [--out report.json]
       [--dry-run]   (tests/gpu/run.sh runs it on the GPU machine)
The report goes to --out (default: $OUT/gpu_report.json when $OUT is set) after every
section, and as one JSON line on stdout at the end. A section runs in its own process
group and is killed at its time limit (a FlashInfer compile cannot be interrupted from
inside); its log's tail goes into the report. --dry-run (or no CUDA device) runs the whole
orchestration, each section reporting "skipped: no CUDA device" (or "dry run"); exit status
0 when every section passed, or, in a dry run, when every section ran or was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from splitspec.cli_args import positive_int  # noqa: E402

SECTIONS = ("env", "jit", "ipc", "parity", "split_stack", "step_times")
# Seconds each section may take at most (run.sh's whole run must fit 8 minutes from a
# cold start), and at least for it to be worth starting.
SECTION_LIMIT_S = {"env": 30.0, "jit": 200.0, "ipc": 45.0, "parity": 45.0, "split_stack": 90.0,
                   "step_times": 70.0}
MIN_SECTION_S = {"env": 5.0, "jit": 30.0, "ipc": 10.0, "parity": 10.0, "split_stack": 30.0, "step_times": 20.0}
DEFAULT_BUDGET_S = 450.0
ACCEPTANCE_LENGTHS = (3, 5, 7)
DEMO_DIR = REPO_ROOT / "demo"
DEMO_ACCEPTANCE_LENGTH = 2.81  # README: the demo DFlash drafter on the held-out modules, K=8
LOG_TAIL_CHARS = 3000
KILL_GRACE_S = 5.0


# ---------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_gpu_checks.py",
        description="GPU checks for CUDA IPC page sharing and the FlashInfer backend; a JSON report.",
    )
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget for all sections")
    p.add_argument("--sections", type=_sections, default=SECTIONS, metavar="LIST",
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--limits", type=_limits, default={}, metavar="NAME=S,...",
                   help="override sections' time limits in seconds (e.g. jit=240)")
    p.add_argument("--out", type=Path, default=_default_out(), help="the report, rewritten after every section "
                   "(default: $OUT/gpu_report.json when $OUT is set)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="checkpoints and logs, kept (default: a temp dir, removed at the end)")
    p.add_argument("--device", default="cuda:0", help="the GPU to use")
    p.add_argument("--dry-run", action="store_true",
                   help="run the orchestration and the report, no GPU work (each section reports skipped)")
    p.add_argument("--run-section", choices=SECTIONS, help=argparse.SUPPRESS)  # one section, in its subprocess
    p.add_argument("--section-out", type=Path, help=argparse.SUPPRESS)  # where that section writes its result
    p.add_argument("--prior", type=Path, help=argparse.SUPPRESS)  # the report so far (earlier sections)
    g = p.add_argument_group("step times (defaults: Qwen3-8B with a 5-layer DFlash drafter)")
    g.add_argument("--num-speculative-tokens", "-k", type=positive_int, default=8, help="K (the demo pair's: 8)")
    g.add_argument("--context-len", type=positive_int, default=1024, help="tokens already in the KV cache")
    g.add_argument("--batch", type=positive_int, default=1, help="sequences per step")
    g.add_argument("--kv-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "bfloat16"), help="KV page dtype")
    g.add_argument("--iters", type=positive_int, default=20, help="timed iterations per measurement")
    g.add_argument("--warmup", type=positive_int, default=3, help="untimed iterations first")
    g.add_argument("--target-layers", type=positive_int, default=36)
    g.add_argument("--draft-layers", type=positive_int, default=5)
    g.add_argument("--hidden-size", type=positive_int, default=4096)
    g.add_argument("--intermediate-size", type=positive_int, default=12288)
    g.add_argument("--vocab-size", type=positive_int, default=151936)
    g.add_argument("--tau", type=positive_int, default=3, help="context tokens the drafter writes per draft step")
    s = p.add_argument_group("split stack")
    s.add_argument("--demo-target", type=Path, default=DEMO_DIR / "target", help="target checkpoint")
    s.add_argument("--demo-drafter", type=Path, default=DEMO_DIR / "dflash", help="its DFlash drafter")
    s.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per prompt")
    s.add_argument("--prompts", type=positive_int, default=16, help="prompts per config (of tests/tiny_models.PROMPTS)")
    s.add_argument("--ipc-pool-mib", type=float, default=1024.0, help="size of each pool of the IPC check")
    return p.parse_args(argv)


def _default_out() -> Path | None:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_report.json" if out else None


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections must be some of {','.join(SECTIONS)}, got {text!r}")
    return tuple(n for n in SECTIONS if n in names)  # always in the canonical order


def _limits(text: str) -> dict[str, float]:
    limits = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or name not in SECTIONS or seconds <= 0:
            raise argparse.ArgumentTypeError(f"limits are NAME=SECONDS with NAME one of {','.join(SECTIONS)}, "
                                             f"got {item!r}")
        limits[name] = seconds
    return limits


# ---------------------------------------------------------------------------------------
# Budget, sections as subprocesses, the report (all CPU-runnable)


@dataclass
class Budget:
    total_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return max(0.0, self.total_s - self.elapsed())


class SkipSection(Exception):
    """The section cannot do its GPU work here (no CUDA device, a dry run)."""


def project_speedup(t_decode_ms: float, t_verify_ms: float, t_draft_ms: float, t_rtt_ms: float,
                    acceptance_lengths=ACCEPTANCE_LENGTHS) -> dict:
    """Speculative steps emit tau tokens (accepted drafts + the bonus) per verify; plain
    decoding emits one per decode step. Per emitted token: split = (verify + draft + Propose
    round trip) / tau, baseline = decode. Also the in-process figure (no round trip) and
    the break-even tau."""
    for name, value in (("t_decode_ms", t_decode_ms), ("t_verify_ms", t_verify_ms), ("t_draft_ms", t_draft_ms),
                        ("t_rtt_ms", t_rtt_ms)):
        if not value >= 0:  # also NaN
            raise ValueError(f"{name} must be a non-negative number, got {value}")
    if t_decode_ms <= 0:
        raise ValueError("t_decode_ms must be positive")
    split_step = t_verify_ms + t_draft_ms + t_rtt_ms
    in_process_step = t_verify_ms + t_draft_ms
    return {
        "formula": "speedup(tau) = tau * t_decode / (t_verify + t_draft + t_rtt)",
        "step_ms": {"split": round(split_step, 3), "in_process": round(in_process_step, 3),
                    "decode": round(t_decode_ms, 3)},
        "speedup": {str(tau): round(tau * t_decode_ms / split_step, 3) for tau in acceptance_lengths},
        "speedup_in_process": {str(tau): round(tau * t_decode_ms / in_process_step, 3) for tau in acceptance_lengths},
        "break_even_tau": round(split_step / t_decode_ms, 3),
        "rtt_share_of_step": round(t_rtt_ms / split_step, 4) if split_step else 0.0,
    }


def section_limit(name: str, args: argparse.Namespace, budget: Budget) -> float:
    """This section's time limit: its own, cut to what is left of the whole budget."""
    return min(args.limits.get(name, SECTION_LIMIT_S[name]), budget.remaining())


def run_process(command: list[str], limit_s: float, log_path: Path, env: dict[str, str] | None = None) -> dict:
    """Run `command` in its own process group with its output in `log_path`; past `limit_s`
    the whole group (services it started included) gets SIGTERM, then SIGKILL."""
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            code = proc.returncode
        finally:
            _kill_group(proc, leftovers_only=True)
    return {"exit_code": code, "timed_out": timed_out, "elapsed_s": round(time.monotonic() - started, 2)}


def _kill_group(proc: subprocess.Popen, leftovers_only: bool = False) -> None:
    """SIGTERM the process group (after the leader exited: whatever it left running), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    if not leftovers_only:
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    time.sleep(0.2 if leftovers_only else 0.0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_section_process(name: str, args: argparse.Namespace, argv: list[str], workdir: Path, limit_s: float,
                        prior: Path, env: dict[str, str]) -> dict:
    """One section in its subprocess; its result, or what went wrong with it."""
    result_path = workdir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--run-section", name,
               "--section-out", str(result_path), "--prior", str(prior), "--workdir", str(workdir)]
    log_path = workdir / f"{name}.log"
    run = run_process(command, limit_s, log_path, env)
    if run["timed_out"]:
        result = {"ok": False, "error": f"timed out after {limit_s:.0f} s (the section's limit); killed"}
    elif result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        result = {"ok": False, "error": f"the section's process exited with {run['exit_code']} and no result"}
    result["elapsed_s"] = run["elapsed_s"]
    result["limit_s"] = round(limit_s, 1)
    if not result.get("ok") and "skipped" not in result:
        result["log_tail"] = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return result


def run_section_here(name: str, fn: Callable[[], dict]) -> dict:
    """Inside the section's process: its dict plus ok; a failure becomes an error entry."""
    try:
        result = fn()
        result.setdefault("ok", True)
    except SkipSection as exc:
        result = {"ok": False, "skipped": str(exc)}
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - pytest.fail in tests.procs raises BaseException
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000],
                  "traceback": traceback.format_exc(limit=12)[-4000:]}
    return result


def assemble_report(sections: dict[str, dict], args: argparse.Namespace, budget: Budget,
                    env: dict[str, str] | None = None) -> dict:
    wanted = list(args.sections)
    shown = {n: sections.get(n, {"ok": False, "skipped": "not run yet"}) for n in wanted}
    failed = [n for n in wanted if not shown[n].get("ok")]
    if args.dry_run:  # a dry run passes when every section ran or was skipped for want of a GPU
        failed = [n for n in wanted if not shown[n].get("ok") and "skipped" not in shown[n]]
    return {
        "report": "splitspec issue 12 GPU checks",
        "dry_run": args.dry_run,
        "ok": not failed and (args.dry_run or len(sections) == len(wanted)),
        "failed": failed,
        "elapsed_s": round(budget.elapsed(), 2),
        "budget_s": budget.total_s,
        "arch_env": env or {},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("run_section", "section_out", "prior")},
        "sections": shown,
        "summary": summarize(shown),
    }


def summarize(sections: dict[str, dict]) -> list[str]:
    """One line per section, for a closing note."""
    lines = []
    for name, s in sections.items():
        verdict = "ok" if s.get("ok") else ("skipped" if "skipped" in s else "FAILED")
        detail = s.get("headline") or s.get("error") or s.get("skipped") or ""
        lines.append(f"{name}: {verdict}" + (f" - {detail}"[:300] if detail else ""))
    return lines


def write_report(path: Path | None, report: dict) -> None:
    """Replace the report file whole (a reader never sees half of one)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, default=str))
    partial.replace(path)


def arch_env(env_result: dict) -> dict[str, str]:
    """The architecture lists for the GPU the env section found: compile for it alone."""
    capability = env_result.get("capability")
    if not capability:
        return {}
    major, minor = capability
    arch = f"{major}.{minor}{'a' if major >= 9 else ''}"  # Hopper and later: the arch-specific 'a' target
    return {"FLASHINFER_CUDA_ARCH_LIST": arch, "TORCH_CUDA_ARCH_LIST": arch}


def section_argv(argv: list[str]) -> list[str]:
    """The command line a section's process gets: the run's own, minus what the orchestrator owns."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        flag = item.split("=", 1)[0]
        if flag in ("--out", "--workdir", "--sections", "--limits", "--budget-s"):
            skip = "=" not in item
            continue
        out.append(item)
    return out


def claim_stdout():
    """Send everything else written to stdout (Python or C++, ours or a library's, JIT compiler
    output) to stderr, and return a file on the real stdout for the one JSON report."""
    sys.stdout.flush()
    report_fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(report_fd, "w")


def orchestrate(args: argparse.Namespace, argv: list[str]) -> dict:
    """Every wanted section in its subprocess, in order; the report, also written after each."""
    budget = Budget(args.budget_s)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="splitspec-gpu-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    prior = workdir / "report-so-far.json"
    sections: dict[str, dict] = {}
    arch: dict[str, str] = {}
    try:
        for name in args.sections:
            limit = section_limit(name, args, budget)
            if budget.remaining() < MIN_SECTION_S[name]:
                result = {"ok": False, "error": f"out of time: {budget.remaining():.0f} s left of "
                                                f"{budget.total_s:.0f} s, the section needs {MIN_SECTION_S[name]:.0f} s"}
            else:
                _log(f"[{name}] starting, limit {limit:.0f} s, {budget.remaining():.0f} s left")
                write_report(prior, assemble_report(sections, args, budget, arch))
                env = {**os.environ, **arch}
                result = run_section_process(name, args, section_argv(argv), workdir, limit, prior, env)
            sections[name] = result
            if name == "env":
                arch = arch_env(result)
            verdict = "ok" if result.get("ok") else ("skipped" if "skipped" in result else "FAILED")
            _log(f"[{name}] {verdict} in {result.get('elapsed_s', 0)} s")
            write_report(args.out, assemble_report(sections, args, budget, arch))
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report = assemble_report(sections, args, budget, arch)
    write_report(args.out, report)
    return report


def run_one_section(args: argparse.Namespace) -> int:
    """Inside a section's process: run it, write its result."""
    prior = json.loads(args.prior.read_text()) if args.prior and args.prior.is_file() else {}
    runners = {
        "env": lambda: check_env(args),
        "jit": lambda: check_jit(args),
        "ipc": lambda: check_ipc(args),
        "parity": lambda: check_parity(args),
        "split_stack": lambda: check_split_stack(args),
        "step_times": lambda: check_step_times(args, prior),
    }
    result = run_section_here(args.run_section, runners[args.run_section])
    args.section_out.write_text(json.dumps(result, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.run_section:
        return run_one_section(args)
    report_out = claim_stdout()
    report = orchestrate(args, argv)
    report_out.write(json.dumps(report, default=str) + "\n")
    report_out.flush()
    return 0 if report["ok"] else 1


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# GPU helpers


def require_cuda(args: argparse.Namespace):
    """The GPU; SkipSection on a machine without one or in a dry run."""
    import torch

    if not torch.cuda.is_available():
        raise SkipSection(f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    if args.dry_run:
        raise SkipSection("dry run")
    return torch.device(args.device)


def sync(device) -> None:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], iters: int, warmup: int, device=None) -> dict:
    """Wall time per call with the device synchronized around each call (ms)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {"median_ms": round(statistics.median(samples), 3), "p10_ms": round(samples[len(samples) // 10], 3),
            "p90_ms": round(samples[min(len(samples) - 1, (len(samples) * 9) // 10)], 3), "n": len(samples)}


# ---------------------------------------------------------------------------------------
# env


def check_env(args: argparse.Namespace) -> dict:
    import importlib.metadata
    import platform

    import torch

    from common.flashinfer_backend import FlashInferAttentionBackend, flashinfer_import_error
    from common.pool_transport import TorchBuild, TransportError, check_ipc_allocator

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return ""

    info = {"python": platform.python_version(), "torch": str(TorchBuild.here()),
            "cuda_available": torch.cuda.is_available(),
            "packages": {d: version(d) for d in ("flashinfer-python", "apache-tvm-ffi", "grpcio", "protobuf",
                                                 "transformers", "safetensors", "tokenizers", "ninja")},
            "nvcc": shutil.which("nvcc") or "", "nvcc_version": _nvcc_version(),
            "cuda_home": os.environ.get("CUDA_HOME", ""),
            "alloc_conf": {v: os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}}
    try:
        check_ipc_allocator()
        info["ipc_allocator"] = "ok"
    except TransportError as exc:
        info["ipc_allocator"] = str(exc)
    error = flashinfer_import_error()
    info["flashinfer"] = error or "imports"
    if not torch.cuda.is_available():
        return {**info, "ok": False, "skipped": f"no CUDA device (torch {torch.__version__})"}
    device = torch.device(args.device)
    props = torch.cuda.get_device_properties(device)
    info.update(device=props.name, capability=list(torch.cuda.get_device_capability(device)),
                memory_gib=round(props.total_memory / 2**30, 1), uuid=str(props.uuid),
                allocator_backend=torch.cuda.get_allocator_backend(),
                preferred_order=FlashInferAttentionBackend.preferred_order(device))
    info["arch_env"] = arch_env(info)
    if error is None:
        from common.flashinfer_probe import gather_facts, why_flashinfer_cannot_run

        facts = gather_facts((64, 128), torch.bfloat16, torch.float8_e4m3fn)
        info["flashinfer_facts"] = {"nvcc": facts.nvcc, "ninja": facts.ninja, "cuda_home": facts.cuda_home,
                                    "jit_dir": facts.jit_dir, "aot": sorted(facts.aot_modules),
                                    "jit_cached": sorted(facts.jit_cached_modules), "notes": list(facts.notes)}
        info["flashinfer_cannot_run"] = why_flashinfer_cannot_run(facts)
    info["ok"] = error is None and info["ipc_allocator"] == "ok" and not info.get("flashinfer_cannot_run")
    info["headline"] = (f"{props.name} sm{props.major}{props.minor}, {TorchBuild.here()}, "
                        f"flashinfer {info['packages']['flashinfer-python'] or error}, nvcc {info['nvcc_version']}")
    return info


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return ""
    run = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    return run.stdout.strip().splitlines()[-1] if run.returncode == 0 and run.stdout.strip() else ""


# ---------------------------------------------------------------------------------------
# jit: every FlashInfer module the later sections load, compiled once, up front


def jit_problems(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(query dtype, KV dtype, head dim) of every FlashInfer attention the later sections run."""
    demo_head_dim = json.loads((args.demo_target / "config.json").read_text()).get("head_dim", 128)
    wanted = {("bfloat16", kv, PARITY_HEADS[2]) for kv in PARITY_KV_DTYPES}  # parity
    wanted.add(("bfloat16", "fp8_e4m3", demo_head_dim))  # split stack: FlashInfer config (target and drafter)
    wanted.add(("bfloat16", args.kv_dtype, PARITY_HEADS[2]))  # step times
    return sorted(wanted)


def check_jit(args: argparse.Namespace) -> dict:
    """Build every module the later sections load, concurrently, the way the services will
    load them (`build_and_load`: ninja in each module's own folder, so the later loads find
    ninja's log there and rebuild nothing); then load each again to show it is cached."""
    import torch

    require_cuda(args)
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit import env as jit_env
    from flashinfer.jit.attention import modules
    from flashinfer.jit.page import gen_page_module

    from common.flashinfer_probe import KERNEL_FAMILY, needed_modules
    from common.kv_layout import KV_DTYPES

    specs = {"page": gen_page_module()}
    for q, kv, dim in jit_problems(args):
        q_dtype, kv_dtype = KV_DTYPES[q], KV_DTYPES[kv]
        # what flashinfer/prefill.py get_batch_prefill_module builds for the FA2 family
        spec = modules._gen_batch_prefill_primary_module(KERNEL_FAMILY, q_dtype, kv_dtype, q_dtype, torch.int32,
                                                          dim, dim, 0, False, False, False)
        if spec.name not in needed_modules((dim,), q_dtype, kv_dtype):
            raise RuntimeError(f"FlashInfer builds {spec.name}, which the probe does not expect")
        specs[spec.name] = spec
    # ninja's jobs shared out: every module at once would run cores x modules compilers
    os.environ["MAX_JOBS"] = str(max(2, (os.cpu_count() or 2) // len(specs)))

    def build(spec) -> float:
        begin = time.monotonic()
        spec.build_and_load()
        return round(time.monotonic() - begin, 2)

    started = time.monotonic()
    with ThreadPoolExecutor(len(specs)) as pool:
        seconds = dict(zip(specs, pool.map(build, specs.values())))
    compile_s = round(time.monotonic() - started, 2)
    result = {
        "arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST", ""), "kernel_family": KERNEL_FAMILY,
        "jit_dir": str(jit_env.FLASHINFER_JIT_DIR), "max_jobs_per_module": int(os.environ["MAX_JOBS"]),
        "compile_s": compile_s, "modules": {},
    }
    for name, spec in specs.items():
        files = _ninja_seconds(_ninja_entries(spec.build_dir / ".ninja_log")).get(name, {})
        result["modules"][name] = {"build_and_load_s": seconds[name], **files, "reload_s": build(spec)}
    slow_reload = [n for n, m in result["modules"].items() if m["reload_s"] > 5.0]
    result["ok"] = not slow_reload
    if slow_reload:
        result["error"] = f"loading again rebuilt {', '.join(slow_reload)}: the services would compile again"
    result["headline"] = (f"{len(specs)} modules built in {compile_s} s for {result['arch_list'] or 'all archs'} "
                          f"({KERNEL_FAMILY})")
    return result


def _ninja_entries(path: Path) -> list[list[str]]:
    """ninja's log: start ms, end ms, mtime, output, hash per built output."""
    if not path.is_file():
        return []
    return [line.split("\t") for line in path.read_text().splitlines() if line and not line.startswith("#")]


def _ninja_seconds(entries: list[list[str]]) -> dict[str, dict]:
    """Per module (the output's folder): compile seconds summed over its files, and their wall span."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for start, end, _mtime, output, *_ in entries:  # outputs are <jit dir>/<module>/<file>
        spans.setdefault(Path(output).parent.name, []).append((int(start), int(end)))
    return {name: {"compile_cpu_s": round(sum(e - s for s, e in ts) / 1000, 2),
                   "wall_s": round((max(e for _, e in ts) - min(s for s, _ in ts)) / 1000, 2)}
            for name, ts in spans.items()}


# ---------------------------------------------------------------------------------------
# ipc


def check_ipc(args: argparse.Namespace) -> dict:
    import torch

    from common.kv_pool import PagePool
    from common.pool_transport import TransportError, export_pool, map_pool
    from tests.gpu.ipc_check import pool_layout, run_ipc_check

    device = require_cuda(args)
    report = run_ipc_check(device, args.workdir, pool_mib=args.ipc_pool_mib)
    pool = PagePool.create(pool_layout(9, 16), device)
    try:
        map_pool(pool.layout, export_pool(pool))
        report["checks"]["same_process_error"] = False
        report["same_process_error"] = "mapping in the exporting process did not fail"
    except TransportError as exc:
        report["checks"]["same_process_error"] = "this very process" in str(exc)
        report["same_process_error"] = str(exc)
    del pool
    torch.cuda.synchronize()
    report["ok"] = all(report["checks"].values())
    return report


# ---------------------------------------------------------------------------------------
# parity


PARITY_HEADS = (32, 8, 128)  # q heads, KV heads, head dim (Qwen3-8B)
PARITY_KV_DTYPES = ("bfloat16", "fp8_e4m3")
PARITY_PAGE = 16
PARITY_SEQS = (300, 77, 16, 1)  # prompt lengths; then +16 verify, +16 block, +1 decode, mixed
PARITY_STEPS = (
    ("prefill", True, lambda n: n),
    ("verify_k_plus_1", True, lambda n: 16),
    ("non_causal_block", False, lambda n: 16),
    ("decode", True, lambda n: 1),
    ("mixed", True, lambda n: (1, 16, 40, 1)),
)


def check_parity(args: argparse.Namespace) -> dict:
    device = require_cuda(args)
    results = {}
    for order in ("NHD", "HND"):
        for kv_dtype in PARITY_KV_DTYPES:
            results[f"{order}/{kv_dtype}"] = parity_case(device, order, kv_dtype)
    ok = all(case["ok"] for case in results.values())
    worst = max(step["fi_vs_torch"] for case in results.values() for step in case["steps"].values())
    first_calls = {name: case["first_call_s"] for name, case in results.items()}
    return {"ok": ok, "cases": results, "first_call_s": first_calls,
            "headline": f"{sum(c['ok'] for c in results.values())}/{len(results)} cases ok, "
                        f"max |flashinfer - torch| {worst:.3g}"}


def parity_case(device, order: str, kv_dtype: str, kernels=None) -> dict:
    """One layer through both backends, step by step (`kernels`: a stand-in for flashinfer)."""
    import torch

    from common.attention import TorchAttentionBackend
    from common.attention_metadata import AttentionMetadata
    from common.flashinfer_backend import FlashInferAttentionBackend, build_plan_inputs
    from common.kv_layout import LayerSpec, build_layout
    from tests.flashinfer_reference import reference_attention

    q_heads, kv_heads, dim = PARITY_HEADS
    fp8 = kv_dtype.startswith("fp8")
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    max_len = max(PARITY_SEQS) + 16 + 16 + 1 + 40
    pages_per_seq = -(-max_len // PARITY_PAGE)
    num_pages = pages_per_seq * len(PARITY_SEQS) + 1
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(num_pages - 1, generator=gen).add(1).tolist()
    tables = [ids[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(len(PARITY_SEQS))]
    spec = LayerSpec("target", 0, kv_heads, dim, k_scale=scales[0], v_scale=scales[1])
    layout = build_layout(order=order, page_size=PARITY_PAGE, kv_dtype=kv_dtype, num_pages=num_pages, layers=[spec])
    spec = layout.layers[0]
    torch_cache = torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype, device=device)
    fi_cache = torch.zeros_like(torch_cache)
    torch_backend, fi_backend = TorchAttentionBackend(layout), FlashInferAttentionBackend(layout, kernels=kernels)
    scale = dim**-0.5
    lens = [0] * len(PARITY_SEQS)
    steps, first_call = {}, None
    atol = 1e-2
    for name, causal, grow in PARITY_STEPS:
        adds = grow(None) if name == "mixed" else [grow(n) for n in PARITY_SEQS]
        spans = [(lens[b], lens[b] + adds[b]) for b in range(len(lens))]
        meta = AttentionMetadata.build(query_lens=[e - s for s, e in spans], seq_lens=[e for _, e in spans],
                                       page_tables=tables, page_size=PARITY_PAGE, device=device, causal=causal)
        tokens = meta.num_tokens
        q = (torch.randn(tokens, q_heads, dim, generator=gen) * 0.25).to(device, torch.bfloat16)
        k = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, torch.bfloat16)
        v = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, torch.bfloat16)
        torch_backend.plan(meta)
        expected = torch_backend.forward(q, k, v, torch_cache, spec, scale)
        start = time.monotonic()
        fi_backend.plan(meta)
        got = fi_backend.forward(q, k, v, fi_cache, spec, scale)
        sync(device)
        if first_call is None:
            first_call = round(time.monotonic() - start, 2)  # includes FlashInfer's JIT compile, if any
        reference = reference_attention(q, torch_cache, build_plan_inputs(meta), order, sm_scale=scale,
                                        k_scale=scales[0] if fp8 else None, v_scale=scales[1] if fp8 else None,
                                        out_dtype=torch.float32)
        fi_err = (got.float() - reference).abs().max().item()
        torch_err = (expected.float() - reference).abs().max().item()
        pages_equal = torch.equal(torch_cache.view(torch.uint8), fi_cache.view(torch.uint8))
        steps[name] = {
            "tokens": tokens, "wrapper": "decode" if all(e - s == 1 for s, e in spans) else "prefill",
            "fi_vs_torch": round((got.float() - expected.float()).abs().max().item(), 5),
            "fi_vs_ref": round(fi_err, 5), "torch_vs_ref": round(torch_err, 5), "pages_equal": pages_equal,
            "ok": pages_equal and fi_err <= 2 * torch_err + atol and got.dtype == q.dtype,
        }
        lens = [e for _, e in spans]
    kernel_backends = sorted({str(getattr(w, "_backend", "?")) for w in fi_backend._wrappers.values()})
    return {"ok": all(s["ok"] for s in steps.values()), "steps": steps, "first_call_s": first_call,
            "flashinfer_kernels": kernel_backends, "plans": fi_backend.num_plans}


# ---------------------------------------------------------------------------------------
# split stack: real processes, tiny checkpoints


SPLIT_CONFIGS = (
    # name, target --dtype, --attention-backend, --kv-cache-dtype, drafter --dtype, exact
    ("torch_float32", "float32", "torch", "float32", "float32", True),
    ("flashinfer_fp8", "bfloat16", "flashinfer", "fp8_e4m3", "bfloat16", False),
)
NEAR_TIE = 0.05  # a divergence is a near-tie when the two tokens' float32 logits differ by < 5% of their std
SPLIT_K = 8  # the demo DFlash drafter's block size - 1


def check_split_stack(args: argparse.Namespace) -> dict:
    require_cuda(args)
    from transformers import AutoTokenizer

    from tests.tiny_models import PROMPTS

    target_dir, drafter_dir = args.demo_target, args.demo_drafter
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok.encode(p) for p in (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]]
    configs = {}
    for name, dtype, backend, kv_dtype, draft_dtype, exact in SPLIT_CONFIGS:
        configs[name] = split_config(args, args.workdir / name, target_dir, drafter_dir, prompts, dtype, backend,
                                     kv_dtype, draft_dtype, exact)
    ok = all(c["ok"] for c in configs.values())
    return {"ok": ok, "configs": configs, "target": str(target_dir), "drafter": str(drafter_dir),
            "acceptance_length": configs["flashinfer_fp8"]["acceptance_length"],
            "headline": "; ".join(f"{n}: {c['identical']}/{c['prompts']} identical, acceptance length "
                                  f"{c['acceptance_length']}" for n, c in configs.items())}


def split_config(args, root: Path, target_dir: Path, drafter_dir: Path, prompts: list[list[int]], dtype: str,
                  backend: str, kv_dtype: str, draft_dtype: str, exact: bool) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from splitspec.v1 import generation_pb2 as pb
    from tests.procs import Service, server_info, stream_tokens

    root.mkdir(parents=True, exist_ok=True)
    drafter = Service("draft_service.cli", [
        "--kind", "dflash", "--model", str(drafter_dir), "--target-model", str(target_dir), "--device", args.device,
        "--dtype", draft_dtype, "--port", "0", "--num-speculative-tokens", str(SPLIT_K),
    ], root / "drafter.log")
    target = None
    try:
        drafter.wait_serving(120)
        target = Service("target_service.cli", [
            "--model", str(target_dir), "--device", args.device, "--dtype", dtype, "--attention-backend", backend,
            "--kv-cache-dtype", kv_dtype, "--num-pages", "512", "--page-size", "16",
            "--max-num-batched-tokens", "256", "--port", "0", "--drafter", drafter.address,
            "--num-speculative-tokens", str(SPLIT_K),
        ], root / "target.log")
        address = target.wait_serving(180)
        info = server_info(address)

        def generate(ids: list[int], disable: bool):
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                         stop=pb.StopParams(max_tokens=args.max_tokens, ignore_eos=True),
                                         speculation=pb.SpeculationParams(disable=disable))
            return stream_tokens(address, request)

        with ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(lambda ids: generate(ids, True), prompts))
            spec = list(pool.map(lambda ids: generate(ids, False), prompts))
        result = {
            "prompts": len(prompts),
            "identical": sum(a[0] == b[0] for a, b in zip(plain, spec)),
            "draft_tokens": sum(c.usage.draft_tokens for _, c in spec),
            "accepted_tokens": sum(c.usage.accepted_tokens for _, c in spec),
            "num_drafts": sum(c.usage.num_drafts for _, c in spec),
            "kv_layout_order": info.kv_layout.order if info.HasField("kv_layout") else None,
            "drafter_state": str(info.drafter).replace("\n", " ")[:300],
        }
        result["acceptance_length"] = round(
            (result["accepted_tokens"] + result["num_drafts"]) / result["num_drafts"], 3) if result["num_drafts"] else 0
        divergences = [_first_divergence(i, prompts[i], a[0], b[0])
                       for i, (a, b) in enumerate(zip(plain, spec)) if a[0] != b[0]]
        if divergences:  # said for every config; an exact one fails on any divergence all the same
            _judge_near_ties(target_dir, divergences)
        result["divergences"] = divergences[:10]
        result["exit_codes"] = {"target": target.stop(), "drafter": drafter.stop()}
        speculated = result["draft_tokens"] > 0
        if exact:
            result["ok"] = speculated and result["identical"] == len(prompts)
        else:
            result["ok"] = speculated and all(d.get("near_tie") for d in divergences)
        result["ok"] = result["ok"] and result["exit_codes"] == {"target": 0, "drafter": 0}
        return result
    except BaseException as exc:
        logs = {"drafter_log": drafter.log()[-2000:], "target_log": target.log()[-2000:] if target else ""}
        raise RuntimeError(f"{type(exc).__name__}: {exc}\n{json.dumps(logs)}") from exc
    finally:
        if target is not None:
            target.stop()
        drafter.stop()


def _first_divergence(index: int, prompt: list[int], plain: list[int], spec: list[int]) -> dict:
    at = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    return {"prompt": index, "position": at, "plain": plain[at] if at < len(plain) else None,
            "speculative": spec[at] if at < len(spec) else None, "prefix": prompt + plain[:at]}


def _judge_near_ties(target_dir: Path, divergences: list[dict]) -> None:
    """Mark each divergence whose two tokens the float32 target nearly ties on (bf16 numerics,
    not a speculation bug); drop the prefix from the report."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for d in divergences:
        prefix = d.pop("prefix")
        if d["plain"] is None or d["speculative"] is None:
            d["near_tie"] = False
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1].float()
        gap = (logits[d["plain"]] - logits[d["speculative"]]).abs().item()
        d["logit_gap"] = round(gap, 4)
        d["logit_std"] = round(logits.std().item(), 4)
        d["near_tie"] = gap < NEAR_TIE * logits.std().item()


# ---------------------------------------------------------------------------------------
# step times: Qwen3-8B-shaped target, 5-layer DFlash-shaped drafter


def qwen3_shape_config(args: argparse.Namespace, num_layers: int, **extra):
    from transformers import Qwen3Config

    heads, kv_heads, dim = PARITY_HEADS
    return Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        **extra,
    )


def materialize_random(module, dtype, device, std: float = 0.02, seed: int = 0) -> None:
    """Give a model built on "meta" random weights on `device` (norm weights 1); keep its
    real buffers (rotary frequencies)."""
    import torch
    from torch import nn

    gen = torch.Generator(device=device).manual_seed(seed)
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            tensor = torch.empty(param.shape, dtype=dtype, device=device)
            if param.dim() == 1:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, std, generator=gen)
            mod._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[name] = buf.to(device)


def check_step_times(args: argparse.Namespace, prior: dict) -> dict:
    import torch

    device = require_cuda(args)
    rtt_server = start_ngram_drafter(args.workdir)  # starts while the model is built
    try:
        result = step_times(args, device)
        result["propose_rtt"] = measure_propose_rtt(args, rtt_server, device)
    finally:
        rtt_server.stop()
        torch.cuda.empty_cache()
    t = result["times"]
    demo_tau, source = demo_acceptance_length(prior)
    result["demo_acceptance_length"] = {"tau": demo_tau, "from": source}
    taus = (round(demo_tau, 2), *ACCEPTANCE_LENGTHS)
    result["projection"] = project_speedup(t["decode_1"]["median_ms"], t["verify_k_plus_1"]["median_ms"],
                                           t["draft_step"]["median_ms"], result["propose_rtt"]["median_ms"], taus)
    s = result["projection"]["speedup"]
    result["headline"] = (f"decode {t['decode_1']['median_ms']} ms, verify(K+1={args.num_speculative_tokens + 1}) "
                          f"{t['verify_k_plus_1']['median_ms']} ms, draft {t['draft_step']['median_ms']} ms, "
                          f"Propose rtt {result['propose_rtt']['median_ms']} ms; projected speedup "
                          + ", ".join(f"tau={k}: {v}x" for k, v in s.items()))
    return result


def demo_acceptance_length(prior: dict) -> tuple[float, str]:
    """The demo pair's acceptance length: measured by this run's split_stack section (FlashInfer,
    fp8 KV) when it passed, else the README's figure."""
    section = prior.get("sections", {}).get("split_stack", {})
    tau = section.get("acceptance_length") if section.get("ok") else None
    if tau:
        return float(tau), "split_stack section of this run"
    return DEMO_ACCEPTANCE_LENGTH, "README (demo pair, K=8, held-out modules, CPU)"


def step_times(args: argparse.Namespace, device, kernels=None) -> dict:
    """Build the two random models and time decode, verify and draft steps (`kernels`: a
    stand-in for flashinfer)."""
    import torch

    from common.flashinfer_backend import FlashInferAttentionBackend
    from common.kv_layout import StagingSpec, build_layout
    from common.kv_pool import PagePool
    from common.qwen3 import Qwen3ForCausalLM
    from draft_service.dflash_model import DFlashDraftModel, TargetHeads, build_target_layer_ids

    k, ctx, batch, tau = args.num_speculative_tokens, args.context_len, args.batch, args.tau
    dtype = torch.bfloat16
    start = time.monotonic()
    with torch.device("meta"):
        target = Qwen3ForCausalLM(qwen3_shape_config(args, args.target_layers))
    materialize_random(target, dtype, device)
    target.eval()
    layer_ids = build_target_layer_ids(args.target_layers, args.draft_layers)
    draft_config = qwen3_shape_config(
        args, args.draft_layers, num_target_layers=args.target_layers, architectures=["DFlashDraftModel"],
        dflash_config={"mask_token_id": args.vocab_size - 1, "target_layer_ids": layer_ids, "block_size": k + 1},
    )
    with torch.device("meta"):
        draft = DFlashDraftModel(draft_config, TargetHeads(embed=target.embed, lm_head=target.lm_head))
    materialize_random(draft, dtype, device, seed=1)
    draft.eval()
    built_s = round(time.monotonic() - start, 2)

    page = 16
    pages_per_seq = -(-(ctx + k + 1 + tau) // page)
    layout = build_layout(
        order=FlashInferAttentionBackend.preferred_order(device), page_size=page, kv_dtype=args.kv_dtype,
        num_pages=pages_per_seq * batch + 1, layers=target.kv_layer_specs() + draft.kv_layer_specs(),
        staging=StagingSpec(rows=max(batch * (k + 1), ctx), width=len(layer_ids) * args.hidden_size, dtype="bfloat16",
                            layer_ids=tuple(layer_ids)),
        target_id="steptimes", epoch=1,
    )
    pool = PagePool.create(layout, device)
    try:
        return _time_steps(args, device, kernels, target, draft, layout, pool, layer_ids, built_s)
    finally:
        pool.close()


def _time_steps(args, device, kernels, target, draft, layout, pool, layer_ids, built_s) -> dict:
    import torch

    from common.attention_metadata import AttentionMetadata
    from common.flashinfer_backend import FlashInferAttentionBackend

    k, ctx, batch, tau = args.num_speculative_tokens, args.context_len, args.batch, args.tau
    page, hidden = layout.page_size, args.hidden_size
    pages_per_seq = -(-(ctx + k + 1 + tau) // page)
    tables = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(batch)]
    target_caches = [pool.region(layout.layer("target", i)) for i in range(args.target_layers)]
    draft_caches = {i: pool.region(layout.layer("draft", i)) for i in range(args.draft_layers)}
    staging = pool.staging()
    target_backend = FlashInferAttentionBackend(layout, kernels=kernels)
    draft_backend = FlashInferAttentionBackend(layout, kernels=kernels)
    gen = torch.Generator(device=device).manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, args.vocab_size - 1, (n,), device=device, generator=gen)

    def meta(q_len: int, s_len: int) -> AttentionMetadata:
        return AttentionMetadata.build(query_lens=[q_len] * batch, seq_lens=[s_len] * batch, page_tables=tables,
                                       page_size=page, device=device)

    def positions(lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=device).repeat(batch)

    with torch.inference_mode():
        prefill_meta = meta(ctx, ctx)  # the context, once (prefill time reported too)
        start = time.monotonic()
        target_backend.plan(prefill_meta)
        target(ids(batch * ctx), positions(0, ctx), prefill_meta, target_caches, target_backend)
        sync(device)
        prefill_s = round(time.monotonic() - start, 3)
        verify_ids, decode_ids = ids(batch * (k + 1)), ids(batch)

        def decode_step():
            m = meta(1, ctx + 1)
            target_backend.plan(m)
            out, _ = target(decode_ids, positions(ctx, ctx + 1), m, target_caches, target_backend)
            return target.compute_logits(out).argmax(-1).tolist()

        def verify_step():
            m = meta(k + 1, ctx + k + 1)
            target_backend.plan(m)
            out, captured = target(verify_ids, positions(ctx, ctx + k + 1), m, target_caches, target_backend,
                                   capture_layers=layer_ids)
            staging[: m.num_tokens].copy_(torch.cat([captured[i] for i in layer_ids], dim=-1))
            return target.compute_logits(out).argmax(-1).tolist()

        last = torch.zeros(batch, dtype=torch.long, device=device)

        def draft_step():
            m = meta(tau, ctx)  # the tau context tokens accepted last step: positions ctx - tau .. ctx - 1
            draft.write_context(staging[: batch * tau], positions(ctx - tau, ctx), m, draft_caches, draft_backend)
            proposal = draft.propose(last, [ctx] * batch, tables, draft_caches, draft_backend, num_tokens=k)
            return proposal.token_ids.tolist()

        times = {}
        for name, fn in (("decode_1", decode_step), ("verify_k_plus_1", verify_step), ("draft_step", draft_step)):
            times[name] = time_ms(fn, args.iters, args.warmup, device)
    return {
        "shape": {"target_layers": args.target_layers, "draft_layers": args.draft_layers, "hidden": hidden,
                  "heads": list(PARITY_HEADS), "vocab": args.vocab_size, "dtype": "bfloat16",
                  "kv_dtype": args.kv_dtype, "order": layout.order, "page_size": page, "k": k,
                  "context_len": ctx, "batch": batch, "tau_written_per_draft_step": tau,
                  "target_layer_ids": layer_ids},
        "build_s": built_s, "prefill_s": prefill_s, "times": times,
        "verify_over_decode": round(times["verify_k_plus_1"]["median_ms"] / times["decode_1"]["median_ms"], 3),
        "gpu_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else 0,
    }


def start_ngram_drafter(workdir: Path):
    from tests.procs import Service

    return Service("draft_service.cli", ["--kind", "ngram", "--port", "0", "--num-speculative-tokens", "16"],
                   workdir / "ngram-drafter.log")


def _kv_layout_to_proto(layout):
    from common.layout_proto import kv_layout_to_proto

    return kv_layout_to_proto(layout)


def measure_propose_rtt(args: argparse.Namespace, server, device) -> dict:
    """Negotiate + Attach with an n-gram drafter process, then time Propose calls shaped like
    one speculative step of `batch` sequences: tau new context tokens each, K drafts asked.
    The target's side synchronizes its device before each call, as the engine does."""
    import grpc

    from common.auth import auth_metadata
    from common.kv_layout import LayerSpec, build_layout
    from common.pool_transport import sync_for_handoff
    from splitspec.v1 import drafter_pb2 as dpb
    from splitspec.v1 import drafter_pb2_grpc as dpb_grpc
    from splitspec.v1 import kv_layout_pb2 as kv_pb
    from tests.procs import TOKEN

    address = server.wait_serving(60)
    k, tau, ctx, page = args.num_speculative_tokens, args.tau, args.context_len, 16
    metadata = auth_metadata(TOKEN)
    target_id = "rtt" + os.urandom(6).hex()
    with grpc.insecure_channel(address) as channel:
        stub = dpb_grpc.DrafterStub(channel)
        facts = dpb.TargetFacts(
            architecture="Qwen3ForCausalLM", hidden_size=args.hidden_size, vocab_size=args.vocab_size,
            num_layers=args.target_layers, supported_orders=[kv_pb.PAGE_ORDER_NHD, kv_pb.PAGE_ORDER_HND],
            preferred_order=kv_pb.PAGE_ORDER_HND, kv_dtype=kv_pb.KV_DTYPE_BFLOAT16, page_size=page,
            max_num_seqs=max(8, args.batch), max_tokens_per_step=4096, device_type="cuda", max_model_len=40960,
        )
        stub.Negotiate(dpb.NegotiateRequest(target_id=target_id, target=facts, requested_order="auto"),
                       metadata=metadata, timeout=30)
        pages = -(-(ctx + 64 * (tau + k)) // page)
        layout = build_layout(order="HND", page_size=page, kv_dtype="bfloat16", num_pages=pages * args.batch + 1,
                              layers=[LayerSpec("target", 0, PARITY_HEADS[1], PARITY_HEADS[2])],
                              target_id=target_id, epoch=1)
        stub.Attach(dpb.AttachRequest(layout=_kv_layout_to_proto(layout)), metadata=metadata, timeout=30)
        rng = __import__("random").Random(0)
        seqs = [{"tokens": [], "pages": []} for _ in range(args.batch)]

        def update(seq_id: int, seq: dict, context: list[int], last: int) -> dpb.SequenceUpdate:
            """As the engine sends it: tokens whose target KV now exists, then the newest token."""
            start = 0 if not seq["tokens"] else len(seq["tokens"]) - 1
            seq["tokens"] = seq["tokens"][:start] + context + [last]
            need = -(-(len(seq["tokens"]) + k) // page)  # the verify block's slots too
            first = 1 + seq_id * pages
            fresh = list(range(first + len(seq["pages"]), first + need))
            seq["pages"] += fresh
            return dpb.SequenceUpdate(seq_id=seq_id, context_start=start, context_token_ids=context,
                                      new_pages=fresh, last_token_id=last, num_speculative_tokens=k)

        def propose(updates) -> int:
            sync_for_handoff(device)
            request = dpb.ProposeRequest(target_id=target_id, epoch=1, sequences=updates)
            reply = stub.Propose(request, metadata=metadata, timeout=10)
            return request.ByteSize() + reply.ByteSize()

        def tokens(n: int) -> list[int]:
            return [rng.randrange(1000) for _ in range(n)]

        propose([update(i, s, tokens(ctx - 1), 7) for i, s in enumerate(seqs)])  # the prompts, once
        sizes = []

        def step():  # tau tokens accepted since the last step: the old last token, tau - 1 drafts, a new one
            sizes.append(propose([update(i, s, [s["tokens"][-1], *tokens(tau - 1)], rng.randrange(1000))
                                  for i, s in enumerate(seqs)]))

        timing = time_ms(step, args.iters * 2, args.warmup, device)
    timing["bytes_per_call"] = int(statistics.median(sizes))
    timing["transport"] = f"gRPC over TCP loopback to {address}"
    return timing


if __name__ == "__main__":
    sys.exit(main())
