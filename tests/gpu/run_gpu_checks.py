#!/usr/bin/env python
"""GPU checks of issue 7 in one run: prints ONE JSON report on stdout (progress on stderr).

Sections (each has its own verdict; the report's `ok` needs all of them):
  env          torch/CUDA/device, FlashInfer import, allocator settings, preferred page order
  ipc          CUDA IPC between two processes: the drafter process maps the target's pool by
               UUID, reads the canary and a target page, writes a draft page, and still reads
               them after the target let go of its own reference (tests/test_pool_transport.py);
               mapping in the exporting process fails with a clear message
  parity       FlashInfer backend vs torch backend on one layer (32 q heads, 8 KV heads, dim
               128, page 16): prefill, K+1 verify, non-causal block, decode, mixed; NHD and
               HND; bf16 and fp8 e4m3 pages (scaled); pages must be bit-identical and outputs
               as close to a float32 reference as the torch backend's
  split_stack  real target and DFlash drafter processes on the GPU (tiny checkpoints built
               like tests/tiny_models.py and tests/test_dflash_parity.py, head_dim 128 so that
               FlashInfer runs them), greedy outputs with speculation vs without, per config:
               torch backend float32 (must be identical) and FlashInfer bf16 / fp8 KV
               (identical, or every divergence is a near-tie of the float32 target)
  step_times   random-weight Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads,
               dim 128, vocab 151936, bf16) and a 5-layer DFlash-shaped drafter, FlashInfer,
               fp8 KV: verify at K+1 tokens vs 1-token decode, draft step, Propose round trip
               (gRPC to a real drafter process), and the projected speedup at acceptance
               lengths 3, 5 and 7:  speedup(tau) = tau * t_decode / (t_verify + t_draft + t_rtt)

Usage: python tests/gpu/run_gpu_checks.py [--budget-s 470] [--sections a,b] [--out report.json]
Exit status 0 when every section passed. Runs on a CPU too (every section then fails fast
with "no CUDA device"), which is how its CPU-runnable parts are tested.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SECTIONS = ("env", "ipc", "parity", "split_stack", "step_times")
ACCEPTANCE_LENGTHS = (3, 5, 7)
DEFAULT_BUDGET_S = 470.0  # the issue allows 8 minutes; a little slack for start-up
# Seconds a section needs at least to be worth starting.
MIN_SECTION_S = {"env": 1.0, "ipc": 20.0, "parity": 30.0, "split_stack": 60.0, "step_times": 60.0}


# ---------------------------------------------------------------------------------------
# CPU-runnable pieces: arguments, budget, the projection, the report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_gpu_checks.py",
        description="GPU checks for the FlashInfer backend and CUDA IPC page sharing; one JSON report on stdout.",
    )
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget for all sections")
    p.add_argument("--sections", type=_sections, default=SECTIONS, metavar="LIST",
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    p.add_argument("--workdir", type=Path, default=None, help="checkpoints and logs (default: a temp dir)")
    p.add_argument("--device", default="cuda:0", help="the GPU to use")
    g = p.add_argument_group("step times (defaults: Qwen3-8B with a 5-layer DFlash drafter)")
    g.add_argument("--num-speculative-tokens", "-k", type=_positive, default=15, help="K (DFlash b16: 15)")
    g.add_argument("--context-len", type=_positive, default=1024, help="tokens already in the KV cache")
    g.add_argument("--batch", type=_positive, default=1, help="sequences per step")
    g.add_argument("--kv-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "bfloat16"), help="KV page dtype")
    g.add_argument("--iters", type=_positive, default=20, help="timed iterations per measurement")
    g.add_argument("--warmup", type=_positive, default=3, help="untimed iterations first")
    g.add_argument("--target-layers", type=_positive, default=36)
    g.add_argument("--draft-layers", type=_positive, default=5)
    g.add_argument("--hidden-size", type=_positive, default=4096)
    g.add_argument("--intermediate-size", type=_positive, default=12288)
    g.add_argument("--vocab-size", type=_positive, default=151936)
    g.add_argument("--tau", type=_positive, default=5, help="context tokens the drafter writes per draft step")
    s = p.add_argument_group("split stack")
    s.add_argument("--demo-target", type=Path, default=None, help="a trained demo target (default: a tiny random one)")
    s.add_argument("--demo-drafter", type=Path, default=None, help="its DFlash drafter (with --demo-target)")
    s.add_argument("--max-tokens", type=_positive, default=24, help="tokens generated per prompt")
    s.add_argument("--prompts", type=_positive, default=20, help="prompts per config (of tests/tiny_models.PROMPTS)")
    args = p.parse_args(argv)
    if (args.demo_target is None) != (args.demo_drafter is None):
        p.error("--demo-target and --demo-drafter go together")
    return args


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections must be some of {','.join(SECTIONS)}, got {text!r}")
    return tuple(n for n in SECTIONS if n in names)  # always in the canonical order


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


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

    def check(self, what: str, need_s: float = 0.0) -> None:
        """Raise OutOfTime unless `need_s` seconds are left for `what`."""
        if self.remaining() < need_s:
            raise OutOfTime(f"{what}: {self.remaining():.0f} s left of {self.total_s:.0f} s, needs {need_s:.0f} s")


class OutOfTime(RuntimeError):
    """The budget ran out; the section reports what it finished."""


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


def run_section(name: str, fn: Callable[[], dict], budget: Budget) -> dict:
    """Run one section: its dict plus ok/elapsed; a failure becomes an error entry."""
    start = time.monotonic()
    try:
        budget.check(name, MIN_SECTION_S.get(name, 0.0))
        result = fn()
        result.setdefault("ok", True)
    except OutOfTime as exc:
        result = {"ok": False, "skipped": str(exc)}
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - pytest.fail in tests.procs raises BaseException
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000],
                  "traceback": traceback.format_exc(limit=12)[-4000:]}
    result["elapsed_s"] = round(time.monotonic() - start, 2)
    _log(f"[{name}] {'ok' if result['ok'] else 'FAILED'} in {result['elapsed_s']} s")
    return result


def assemble_report(sections: dict[str, dict], args: argparse.Namespace, budget: Budget) -> dict:
    wanted = list(args.sections)
    for name in wanted:
        sections.setdefault(name, {"ok": False, "skipped": "not run"})
    failed = [n for n in wanted if not sections[n].get("ok")]
    return {
        "report": "splitspec issue 7 GPU checks",
        "ok": not failed,
        "failed": failed,
        "elapsed_s": round(budget.elapsed(), 2),
        "budget_s": budget.total_s,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sections": {n: sections[n] for n in wanted},
        "summary": summarize(sections),
    }


def summarize(sections: dict[str, dict]) -> list[str]:
    """One line per section, for a closing note."""
    lines = []
    for name, s in sections.items():
        verdict = "ok" if s.get("ok") else ("skipped" if "skipped" in s else "FAILED")
        detail = s.get("headline") or s.get("error") or s.get("skipped") or ""
        lines.append(f"{name}: {verdict}" + (f" - {detail}"[:300] if detail else ""))
    return lines


def claim_stdout():
    """Send everything else written to stdout (Python or C++, ours or a library's, JIT compiler
    output) to stderr, and return a file on the real stdout for the one JSON report."""
    sys.stdout.flush()
    report_fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(report_fd, "w")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report_out = claim_stdout()
    budget = Budget(args.budget_s)
    workdir = args.workdir
    if workdir is None:
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="splitspec-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runners = {
        "env": lambda: check_env(args),
        "ipc": lambda: check_ipc(args),
        "parity": lambda: check_parity(args, budget),
        "split_stack": lambda: check_split_stack(args, budget, workdir),
        "step_times": lambda: check_step_times(args, budget, workdir),
    }
    sections: dict[str, dict] = {}
    for name in args.sections:
        _log(f"[{name}] starting, {budget.remaining():.0f} s left")
        sections[name] = run_section(name, runners[name], budget)
    report = assemble_report(sections, args, budget)
    text = json.dumps(report, default=str)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    report_out.write(text + "\n")
    report_out.flush()
    return 0 if report["ok"] else 1


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# GPU helpers


def require_cuda(args: argparse.Namespace):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda})")
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
    import shutil

    import torch

    from common.flashinfer_backend import FlashInferAttentionBackend, flashinfer_import_error
    from common.pool_transport import TransportError, check_ipc_allocator

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "nvcc": shutil.which("nvcc") or "",
            "cuda_home": os.environ.get("CUDA_HOME", "")}
    try:
        check_ipc_allocator()
        info["ipc_allocator"] = "ok"
    except TransportError as exc:
        info["ipc_allocator"] = str(exc)
    error = flashinfer_import_error()
    info["flashinfer"] = error or __import__("flashinfer").__version__
    if not torch.cuda.is_available():
        return {**info, "ok": False, "error": "no CUDA device"}
    device = torch.device(args.device)
    props = torch.cuda.get_device_properties(device)
    info.update(device=props.name, capability=list(torch.cuda.get_device_capability(device)),
                memory_gib=round(props.total_memory / 2**30, 1), uuid=str(props.uuid),
                preferred_order=FlashInferAttentionBackend.preferred_order(device))
    info["ok"] = error is None and info["ipc_allocator"] == "ok"
    info["headline"] = f"{props.name} sm{props.major}{props.minor}, torch {torch.__version__}, flashinfer {info['flashinfer']}"
    return info


# ---------------------------------------------------------------------------------------
# ipc


def check_ipc(args: argparse.Namespace) -> dict:
    import torch

    from common.kv_pool import PagePool
    from common.pool_transport import TransportError, export_pool, map_pool
    from tests.ipc_check import ipc_layout, two_process_ipc_check

    device = require_cuda(args)
    report = two_process_ipc_check(device)
    checks = {
        "canary_read_by_drafter": report["canary_ok"],
        "target_page_read_by_drafter": report["target_page_sum"] == report["page_values"],
        "draft_page_seen_by_target": report["draft_page_written"],
        "alive_after_target_let_go": report["canary_ok_after_target_let_go"]
        and report["target_page_sum_after"] == report["page_values"],
        "drafter_exit_0": report["drafter_exit_code"] == 0,
    }
    pool = PagePool.create(ipc_layout(), device)
    try:
        map_pool(pool.layout, export_pool(pool))
        checks["same_process_error"] = False
        report["same_process_error"] = "mapping in the exporting process did not fail"
    except TransportError as exc:
        checks["same_process_error"] = "this very process" in str(exc)
        report["same_process_error"] = str(exc)
    del pool
    torch.cuda.synchronize()
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["headline"] = ", ".join(f"{k}={v}" for k, v in checks.items())
    return report


# ---------------------------------------------------------------------------------------
# parity


PARITY_HEADS = (32, 8, 128)  # q heads, KV heads, head dim (Qwen3-8B)
PARITY_PAGE = 16
PARITY_SEQS = (300, 77, 16, 1)  # prompt lengths; then +16 verify, +16 block, +1 decode, mixed
PARITY_STEPS = (
    ("prefill", True, lambda n: n),
    ("verify_k_plus_1", True, lambda n: 16),
    ("non_causal_block", False, lambda n: 16),
    ("decode", True, lambda n: 1),
    ("mixed", True, lambda n: (1, 16, 40, 1)),
)


def check_parity(args: argparse.Namespace, budget: Budget) -> dict:
    device = require_cuda(args)
    results = {}
    for order in ("NHD", "HND"):
        for kv_dtype in ("bfloat16", "fp8_e4m3"):
            budget.check(f"parity {order} {kv_dtype}", 5.0)
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


TINY_HEAD_DIM = 128  # FlashInfer kernels exist for head_dim 64, 128, 256
SPLIT_CONFIGS = (
    # name, target --dtype, --attention-backend, --kv-cache-dtype, drafter --dtype, exact
    ("torch_float32", "float32", "torch", "float32", "float32", True),
    ("flashinfer_bf16", "bfloat16", "flashinfer", "bfloat16", "bfloat16", False),
    ("flashinfer_fp8", "bfloat16", "flashinfer", "fp8_e4m3", "bfloat16", False),
)
NEAR_TIE = 0.05  # a divergence is a near-tie when the two tokens' float32 logits differ by < 5% of their std


def make_demo_pair(workdir: Path) -> tuple[Path, Path]:
    """A tiny target (4 layers) and a DFlash drafter for it, head_dim 128, saved like the tests do."""
    from transformers import AutoTokenizer, Qwen3Config

    from tests.tiny_models import REFERENCE_DFLASH_K as K
    from tests.tiny_models import TARGET_LAYER_IDS, TARGET_LAYERS, make_qwen3

    target = workdir / "demo-target"
    drafter = workdir / "demo-dflash"
    if not (target / "config.json").exists():
        make_qwen3(target, num_hidden_layers=TARGET_LAYERS, hidden_size=128, intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=TINY_HEAD_DIM)
    if not (drafter / "config.json").exists():
        import torch
        from dflash.model import DFlashDraftModel as ReferenceDraft

        tok = AutoTokenizer.from_pretrained(target)
        config = Qwen3Config(
            vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=TINY_HEAD_DIM, max_position_embeddings=512,
            rope_theta=10000.0, tie_word_embeddings=False, num_target_layers=TARGET_LAYERS,
            dflash_config={"mask_token_id": tok.mask_token_id, "target_layer_ids": TARGET_LAYER_IDS,
                           "block_size": K + 1},
        )
        torch.manual_seed(0)
        model = ReferenceDraft(config).eval()
        with torch.no_grad():  # as make_reference_dflash: the context and the block matter
            for name, param in model.named_parameters():
                if name.endswith("proj.weight") or name == "fc.weight":
                    param.mul_(8.0)
            model.norm.weight.mul_(4.0)
        model.save_pretrained(drafter, safe_serialization=True)
    return target, drafter


def check_split_stack(args: argparse.Namespace, budget: Budget, workdir: Path) -> dict:
    require_cuda(args)
    from transformers import AutoTokenizer

    from tests.tiny_models import PROMPTS

    if args.demo_target is not None:
        target_dir, drafter_dir = args.demo_target, args.demo_drafter
    else:
        target_dir, drafter_dir = make_demo_pair(workdir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok.encode(p) for p in (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]]
    configs = {}
    for name, dtype, backend, kv_dtype, draft_dtype, exact in SPLIT_CONFIGS:
        budget.check(f"split stack {name}", 40.0)
        configs[name] = split_config(args, workdir / name, target_dir, drafter_dir, prompts, dtype, backend,
                                      kv_dtype, draft_dtype, exact)
    ok = all(c["ok"] for c in configs.values())
    return {"ok": ok, "configs": configs, "target": str(target_dir), "drafter": str(drafter_dir),
            "headline": "; ".join(f"{n}: {c['identical']}/{c['prompts']} identical, accepted "
                                  f"{c['accepted_tokens']}/{c['draft_tokens']}" for n, c in configs.items())}


def split_config(args, root: Path, target_dir: Path, drafter_dir: Path, prompts: list[list[int]], dtype: str,
                  backend: str, kv_dtype: str, draft_dtype: str, exact: bool) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from splitspec.v1 import generation_pb2 as pb
    from tests.procs import Service, server_info, stream_tokens

    root.mkdir(parents=True, exist_ok=True)
    drafter = Service("draft_service.cli", [
        "--kind", "dflash", "--model", str(drafter_dir), "--target-model", str(target_dir), "--device", args.device,
        "--dtype", draft_dtype, "--port", "0", "--num-speculative-tokens", "4",
    ], root / "drafter.log")
    target = None
    try:
        drafter.wait_serving(120)
        target = Service("target_service.cli", [
            "--model", str(target_dir), "--device", args.device, "--dtype", dtype, "--attention-backend", backend,
            "--kv-cache-dtype", kv_dtype, "--num-pages", "512", "--page-size", "16",
            "--max-num-batched-tokens", "256", "--port", "0", "--drafter", drafter.address,
            "--num-speculative-tokens", "4",
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
        if divergences and not exact:
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


def check_step_times(args: argparse.Namespace, budget: Budget, workdir: Path) -> dict:
    import torch

    device = require_cuda(args)
    rtt_server = start_ngram_drafter(workdir)  # starts while the model is built
    try:
        result = step_times(args, budget, device)
        budget.check("Propose round trip", 10.0)
        result["propose_rtt"] = measure_propose_rtt(args, rtt_server, device)
    finally:
        rtt_server.stop()
        torch.cuda.empty_cache()
    t = result["times"]
    result["projection"] = project_speedup(t["decode_1"]["median_ms"], t["verify_k_plus_1"]["median_ms"],
                                           t["draft_step"]["median_ms"], result["propose_rtt"]["median_ms"])
    s = result["projection"]["speedup"]
    result["headline"] = (f"decode {t['decode_1']['median_ms']} ms, verify(K+1={args.num_speculative_tokens + 1}) "
                          f"{t['verify_k_plus_1']['median_ms']} ms, draft {t['draft_step']['median_ms']} ms, "
                          f"Propose rtt {result['propose_rtt']['median_ms']} ms; projected speedup "
                          + ", ".join(f"tau={k}: {v}x" for k, v in s.items()))
    return result


def step_times(args: argparse.Namespace, budget: Budget, device, kernels=None) -> dict:
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
    budget.check("step times after building the models", 30.0)

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
        return _time_steps(args, budget, device, kernels, target, draft, layout, pool, layer_ids, built_s)
    finally:
        pool.close()


def _time_steps(args, budget: Budget, device, kernels, target, draft, layout, pool, layer_ids, built_s) -> dict:
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
            budget.check(f"timing {name}", 10.0)
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
