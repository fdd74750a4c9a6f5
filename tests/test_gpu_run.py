"""The GPU run's machinery, on the CPU (defect 5 of issue 12 and the run that must fit).

tests/gpu/run.sh --dry-run runs here for real: the orchestration, each section in its own
process group with its time limit, the report rewritten after every section, the temp
folder removed. The sections' CPU-runnable parts run on models of the kernels: the
parity and step-time harnesses, the Propose round trip against a real drafter process,
the IPC check between two unrelated processes on shm pools, FlashInfer's module list,
ninja's log, the wheel slimmer (on a synthetic wheel, RECORD checked), the speedup formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.flashinfer_reference import ReferenceKernels
from tests.gpu import run_gpu_checks as script
from tests.gpu import slim_flashinfer
from tests.gpu.ipc_check import run_ipc_check
from tests.procs import REPO_ROOT

ORDERS = ["NHD", "HND"]


# ---------------------------------------------------------------------------------------
# run.sh and the orchestration


def run_sh(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    run = subprocess.run(["bash", "tests/gpu/run.sh", "--dry-run", *args], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    report = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert [json.loads(line) for line in run.stdout.splitlines()] == [report], run.stdout  # one JSON line
    assert not list((tmp_path / "tmp").iterdir()), "the run left its temp folder behind"
    return run, report


def test_run_sh_dry_run_orchestrates_every_section_and_writes_the_report(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: a dry run reports 'dry run' instead of 'no CUDA'")
    run, report = run_sh(tmp_path)
    assert run.returncode == 0, run.stderr
    assert "dry run: no install" in run.stderr
    assert report["dry_run"] is True and report["ok"] is True and report["failed"] == []
    assert list(report["sections"]) == list(script.SECTIONS)
    for name, section in report["sections"].items():
        assert "no CUDA device" in section["skipped"], (name, section)
        assert 0 < section["elapsed_s"] < section["limit_s"] <= script.SECTION_LIMIT_S[name]
    env = report["sections"]["env"]
    assert env["torch"].startswith(f"torch {torch.__version__}") and env["ipc_allocator"] == "ok"
    assert 0 < report["budget_s"] <= 480 - 15 and report["elapsed_s"] < report["budget_s"]


def test_run_sh_enforces_a_sections_time_limit(tmp_path):
    """A section past its limit is killed (its process group) and reported with its log's tail;
    the run goes on with the next section, and the dry run fails."""
    run, report = run_sh(tmp_path, "--sections", "env,ipc,parity", "--limits", "ipc=0.3")
    assert run.returncode == 1
    assert report["failed"] == ["ipc"] and report["ok"] is False
    ipc = report["sections"]["ipc"]
    assert ipc["error"] == "timed out after 0 s (the section's limit); killed" and ipc["limit_s"] == 0.3
    assert "log_tail" in ipc and ipc["elapsed_s"] < 10
    assert "no CUDA device" in report["sections"]["parity"]["skipped"]  # the run went on


def test_a_killed_section_takes_what_it_started_along(tmp_path):
    pid_file = tmp_path / "child.pid"
    command = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"]
    run = script.run_process(command, 1.0, tmp_path / "log")
    assert run["timed_out"] and run["elapsed_s"] < 10
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the section's own child outlived the time limit"
    quick = script.run_process(["bash", "-c", "echo fine; exit 3"], 10.0, tmp_path / "log2")
    assert quick == {"exit_code": 3, "timed_out": False, "elapsed_s": quick["elapsed_s"]}
    assert (tmp_path / "log2").read_text() == "fine\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(") ")[-1][0] != "Z"


def test_the_report_is_rewritten_after_every_section(tmp_path, monkeypatch):
    seen = []

    def fake_section(name, args, argv, workdir, limit, prior, env):
        seen.append((name, sorted(json.loads(args.out.read_text())["sections"]) if args.out.exists() else None,
                     env.get("FLASHINFER_CUDA_ARCH_LIST")))
        if name == "env":
            return {"ok": True, "capability": [9, 0], "elapsed_s": 0.1}
        if name == "ipc":
            return {"ok": False, "error": "boom", "elapsed_s": 0.1}
        return {"ok": True, "elapsed_s": 0.1}

    monkeypatch.setattr(script, "run_section_process", fake_section)
    args = script.parse_args(["--out", str(tmp_path / "r.json"), "--sections", "env,jit,ipc"])
    report = script.orchestrate(args, [])
    assert [name for name, _, _ in seen] == ["env", "jit", "ipc"]
    assert seen[1][1] == ["env", "ipc", "jit"]  # the env section's result was on disk before jit started
    assert seen[1][2] == seen[2][2] == "9.0a"  # compile for the GPU the env section found
    assert report["failed"] == ["ipc"] and report["arch_env"]["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(report, default=str))


def test_arguments_limits_and_the_architecture():
    help_text = subprocess.run([sys.executable, "tests/gpu/run_gpu_checks.py", "--help"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=60, check=False)
    assert help_text.returncode == 0 and "--dry-run" in help_text.stdout and "--limits" in help_text.stdout
    args = script.parse_args([])
    assert args.sections == script.SECTIONS and args.budget_s <= 480
    assert (args.num_speculative_tokens, args.target_layers, args.draft_layers, args.hidden_size,
            args.vocab_size, args.kv_dtype) == (8, 36, 5, 4096, 151936, "fp8_e4m3")
    assert sum(script.SECTION_LIMIT_S.values()) <= 480
    assert script.parse_args(["--sections", "step_times,env"]).sections == ("env", "step_times")
    assert script.parse_args(["--limits", "jit=240,ipc=5"]).limits == {"jit": 240.0, "ipc": 5.0}
    for bad in (["--sections", "env,gpu"], ["--iters", "0"], ["--limits", "gpu=3"], ["--limits", "jit=-1"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)
    assert script.arch_env({"capability": [9, 0]}) == {"FLASHINFER_CUDA_ARCH_LIST": "9.0a",
                                                       "TORCH_CUDA_ARCH_LIST": "9.0a"}
    assert script.arch_env({"capability": [8, 9]})["FLASHINFER_CUDA_ARCH_LIST"] == "8.9"
    assert script.arch_env({"skipped": "no CUDA"}) == {}
    argv = ["--out", "x.json", "--sections=env", "--limits", "jit=1", "--budget-s", "9", "--dry-run", "-k", "4"]
    assert script.section_argv(argv) == ["--dry-run", "-k", "4"]


def test_sections_report_their_verdicts():
    def broken():
        raise ValueError("boom")

    def failed_by_pytest():
        pytest.fail("a service exited")

    def no_gpu():
        raise script.SkipSection("no CUDA device")

    assert script.run_section_here("env", lambda: {"headline": "fine"}) == {"headline": "fine", "ok": True}
    assert script.run_section_here("ipc", broken)["error"] == "ValueError: boom"
    assert "a service exited" in script.run_section_here("parity", failed_by_pytest)["error"]
    assert script.run_section_here("jit", no_gpu) == {"ok": False, "skipped": "no CUDA device"}
    budget = script.Budget(100.0)
    sections = {"env": {"ok": True, "headline": "fine"}, "jit": {"ok": False, "skipped": "no CUDA device"}}
    real = script.assemble_report(sections, script.parse_args(["--sections", "env,jit"]), budget)
    assert real["ok"] is False and real["failed"] == ["jit"]
    dry = script.assemble_report(sections, script.parse_args(["--sections", "env,jit", "--dry-run"]), budget)
    assert dry["ok"] is True and dry["summary"] == ["env: ok - fine", "jit: skipped - no CUDA device"]
    partial = script.assemble_report({"env": {"ok": True}}, script.parse_args(["--sections", "env,jit"]), budget)
    assert partial["ok"] is False and partial["sections"]["jit"] == {"ok": False, "skipped": "not run yet"}


def test_projected_speedup_formula_and_the_demo_acceptance_length():
    projection = script.project_speedup(t_decode_ms=10.0, t_verify_ms=12.0, t_draft_ms=3.0, t_rtt_ms=1.0)
    assert projection["step_ms"] == {"split": 16.0, "in_process": 15.0, "decode": 10.0}
    assert projection["speedup"] == {"3": 1.875, "5": 3.125, "7": 4.375}
    assert projection["speedup_in_process"] == {"3": 2.0, "5": 3.333, "7": 4.667}
    assert projection["break_even_tau"] == 1.6 and projection["rtt_share_of_step"] == 0.0625
    assert script.project_speedup(10.0, 12.0, 3.0, 1.0, (2.5,))["speedup"] == {"2.5": 1.562}
    for bad in ({"t_decode_ms": 0.0}, {"t_rtt_ms": -1.0}, {"t_verify_ms": float("nan")}):
        values = {"t_decode_ms": 10.0, "t_verify_ms": 12.0, "t_draft_ms": 3.0, "t_rtt_ms": 1.0, **bad}
        with pytest.raises(ValueError):
            script.project_speedup(**values)
    measured = {"sections": {"split_stack": {"ok": True, "acceptance_length": 3.4}}}
    assert script.demo_acceptance_length(measured) == (3.4, "split_stack section of this run")
    assert script.demo_acceptance_length({})[0] == script.DEMO_ACCEPTANCE_LENGTH
    failed = {"sections": {"split_stack": {"ok": False, "acceptance_length": 9.0}}}
    assert script.demo_acceptance_length(failed)[0] == script.DEMO_ACCEPTANCE_LENGTH


# ---------------------------------------------------------------------------------------
# The sections' CPU-runnable parts


def test_the_jit_section_compiles_what_the_later_sections_load():
    args = script.parse_args([])
    assert script.jit_problems(args) == [("bfloat16", "bfloat16", 128), ("bfloat16", "fp8_e4m3", 64),
                                         ("bfloat16", "fp8_e4m3", 128)]  # parity; demo pair (head 64); step times
    assert json.loads((args.demo_target / "config.json").read_text())["head_dim"] == 64


def test_ninja_log_gives_seconds_per_module(tmp_path):
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n0\t30000\t1\t/c/page/page.cuda.o\tab\n0\t20000\t1\t/c/page/binding.cuda.o\tcd\n"
                   "31000\t40000\t1\t/c/page/page.so\tef\n5000\t95000\t1\tbatch_prefill_x/k0.cuda.o\t01\n")
    seconds = script._ninja_seconds(script._ninja_entries(log))
    assert seconds == {"page": {"compile_cpu_s": 59.0, "wall_s": 40.0},
                       "batch_prefill_x": {"compile_cpu_s": 90.0, "wall_s": 90.0}}
    assert script._ninja_entries(tmp_path / "none") == []


def test_the_ipc_check_runs_between_two_processes_on_shm_pools(shm_dir):
    report = run_ipc_check(torch.device("cpu"), shm_dir, pool_mib=1, timeout_s=60)
    assert report["ok"], report
    assert report["peer_device"] == "cpu" and report["peer_exit_code"] == 0
    assert report["memory"] == "not measured: the pools are shm files"


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_gpu_parity_check_runs_on_the_model_of_the_kernels(order, kv_dtype):
    case = script.parity_case(torch.device("cpu"), order, kv_dtype, kernels=ReferenceKernels())
    assert case["ok"], case
    assert list(case["steps"]) == ["prefill", "verify_k_plus_1", "non_causal_block", "decode", "mixed"]
    assert case["steps"]["decode"]["wrapper"] == "decode" and case["plans"] == 5
    assert all(step["pages_equal"] for step in case["steps"].values())


def test_gpu_step_times_run_on_a_small_model_here():
    args = script.parse_args(["--target-layers", "3", "--draft-layers", "2", "--hidden-size", "128",
                              "--intermediate-size", "256", "--vocab-size", "300", "--context-len", "40",
                              "-k", "3", "--tau", "2", "--iters", "2", "--warmup", "1", "--batch", "2"])
    result = script.step_times(args, torch.device("cpu"), kernels=ReferenceKernels())
    times = result["times"]
    assert set(times) == {"decode_1", "verify_k_plus_1", "draft_step"}
    assert all(t["n"] == 2 and t["median_ms"] > 0 for t in times.values())
    assert len(result["shape"]["target_layer_ids"]) == 2 and result["shape"]["kv_dtype"] == "fp8_e4m3"


def test_gpu_propose_round_trip_against_a_real_ngram_drafter(tmp_path):
    args = script.parse_args(["--context-len", "64", "-k", "4", "--tau", "3", "--iters", "3", "--warmup", "1",
                              "--batch", "2"])
    server = script.start_ngram_drafter(tmp_path)
    try:
        timing = script.measure_propose_rtt(args, server, torch.device("cpu"))
    finally:
        server.stop()
    assert timing["n"] == 6 and timing["median_ms"] > 0 and timing["bytes_per_call"] > 0, server.log()


@pytest.mark.slow
def test_gpu_split_stack_harness_runs_on_the_cpu(tmp_path):
    """The split-stack check's own machinery (demo pair, processes, comparison) with the
    torch backend in float32 on the CPU, where it must find the outputs identical."""
    from transformers import AutoTokenizer

    from tests.tiny_models import PROMPTS

    args = script.parse_args(["--device", "cpu", "--max-tokens", "8"])
    tok = AutoTokenizer.from_pretrained(args.demo_target)
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    result = script.split_config(args, tmp_path / "run", args.demo_target, args.demo_drafter, prompts, "float32",
                                 "torch", "float32", "float32", True)
    assert result["ok"], result
    assert result["identical"] == 3 and result["draft_tokens"] > 0 and result["acceptance_length"] >= 1


def test_gpu_split_stack_near_tie_judge():
    """A bf16 divergence counts as a near-tie only when the float32 target almost ties the two tokens."""
    from transformers import AutoModelForCausalLM

    target = script.DEMO_DIR / "target"
    prefix = [5, 17, 33, 2]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    worst = int(logits.argmin())
    divergences = [script._first_divergence(0, prefix, [top2[0], 1], [worst, 1]),
                   {"prompt": 1, "position": 0, "plain": top2[0], "speculative": top2[0], "prefix": prefix}]
    script._judge_near_ties(target, divergences)
    assert divergences[0]["position"] == 0 and divergences[0]["near_tie"] is False
    assert divergences[0]["logit_gap"] > 0 and "prefix" not in divergences[0]
    assert divergences[1]["near_tie"] is True


# ---------------------------------------------------------------------------------------
# prepare.sh's wheel slimmer, on a synthetic flashinfer wheel


def _fake_flashinfer_wheel(path: Path) -> None:
    data = "flashinfer/data/"
    files = {f"{data}csrc/{name}": b"// root\n" for name in slim_flashinfer.ROOT_SOURCES}
    files[f"{data}csrc/batch_prefill.cu"] = b'#include "batch_prefill_config.inc"\n#include <cub/cub.cuh>\n'
    files[f"{data}csrc/page.cu"] = b'  #  include "helpers/page_impl.cuh"\n#include <flashinfer/page.cuh>\n'
    files.update({
        f"{data}csrc/helpers/page_impl.cuh": b'#include "../tvm_ffi_utils.h"\n',  # beside the includer
        f"{data}csrc/tvm_ffi_utils.h": b"// kept\n",
        f"{data}csrc/fused_moe/moe.cu": b'#include <cutlass/cutlass.h>\n',  # another family: dropped
        f"{data}csrc/gemm.cu": b"// dropped\n",
        f"{data}cccl/cub/cub/cub.cuh": b'#include "util.cuh"\n',
        f"{data}cccl/cub/cub/util.cuh": b"// reached through cub.cuh\n",
        f"{data}cccl/cub/cub/unused.cuh": b"// never included, kept: cccl/ goes whole\n",
        f"{data}cutlass/include/cutlass/unused.h": b"// never included\n",
        f"{data}cutlass/include/cutlass/cutlass.h": b"// only moe.cu wants it\n",
        f"{data}include/flashinfer/page.cuh": b"// include/ is kept whole\n",
        f"{data}include/flashinfer/other.cuh": b"// kept: include/ whole\n",
        "flashinfer/__init__.py": b"__version__ = '0.7.2.post1'\n",
        "flashinfer_python-0.7.2.post1.dist-info/METADATA": b"Name: flashinfer-python\nVersion: 0.7.2.post1\n",
        "flashinfer_python-0.7.2.post1.dist-info/RECORD": b"stale,,\n",
    })
    with zipfile.ZipFile(path, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)


def test_the_slim_wheel_keeps_the_include_closure_and_a_valid_record(tmp_path):
    source = tmp_path / "in" / "flashinfer_python-0.7.2.post1-py3-none-any.whl"
    source.parent.mkdir()
    _fake_flashinfer_wheel(source)
    slim = slim_flashinfer.slim_wheel(source, tmp_path / "out")
    assert slim.name == source.name
    with zipfile.ZipFile(slim) as zf:
        names = set(zf.namelist())
    data = "flashinfer/data/"
    for kept in ("csrc/page.cu", "csrc/helpers/page_impl.cuh", "csrc/tvm_ffi_utils.h", "cccl/cub/cub/cub.cuh",
                 "cccl/cub/cub/util.cuh", "cccl/cub/cub/unused.cuh", "include/flashinfer/page.cuh",
                 "include/flashinfer/other.cuh"):
        assert data + kept in names, kept
    with zipfile.ZipFile(source) as zf:  # the closure itself: through cub.cuh to util.cuh, not unused.cuh
        inside = {n[len(data):] for n in zf.namelist() if n.startswith(data)}
        closure = slim_flashinfer.include_closure(lambda path: zf.read(data + path), inside, ["csrc/batch_prefill.cu"])
    assert closure == {"csrc/batch_prefill.cu", "cccl/cub/cub/cub.cuh", "cccl/cub/cub/util.cuh"}
    for dropped in ("csrc/fused_moe/moe.cu", "csrc/gemm.cu", "cutlass/include/cutlass/cutlass.h",
                    "cutlass/include/cutlass/unused.h"):
        assert data + dropped not in names, dropped
    assert "flashinfer/__init__.py" in names
    assert slim_flashinfer.verify_wheel(slim) == len(names)
    tampered = tmp_path / "tampered.whl"
    with zipfile.ZipFile(slim) as zf, zipfile.ZipFile(tampered, "w") as out:
        for info in zf.infolist():
            content = zf.read(info)
            out.writestr(info, b"changed\n" if info.filename == "flashinfer/__init__.py" else content)
    with pytest.raises(ValueError, match="flashinfer/__init__.py does not match"):
        slim_flashinfer.verify_wheel(tampered)


def test_a_wheel_without_the_attention_sources_is_refused(tmp_path):
    source = tmp_path / "flashinfer_python-9-py3-none-any.whl"
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr("flashinfer/data/csrc/page.cu", b"")
        zf.writestr("flashinfer_python-9.dist-info/RECORD", b"")
    with pytest.raises(SystemExit, match="lacks sources FlashInfer's attention JIT reads"):
        slim_flashinfer.slim_wheel(source, tmp_path / "out")


def test_prepare_and_run_scripts_are_valid_bash():
    for script_path in ("tests/gpu/prepare.sh", "tests/gpu/run.sh"):
        check = subprocess.run(["bash", "-n", script_path], cwd=REPO_ROOT, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        assert os.access(REPO_ROOT / script_path, os.X_OK)
    assert "/.whl/" in (REPO_ROOT / ".gitignore").read_text().split()
