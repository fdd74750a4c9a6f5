"""Side by side on the same demo models and held-out prompts, in one invocation:

  1. transformers `generate` (target only)
  2. transformers assisted generation with the draft_model drafter (`assistant_model`)
  3. the `dflash` package's `dflash_generate`
  4. splitspec, target only
  5. splitspec + ngram            (drafter in a second process; Propose over the pool's shm channel)
  6. splitspec + draft_model      (drafter in a second process; Propose over the pool's shm channel)
  7. splitspec + dflash           (drafter in a second process; Propose over the pool's shm channel)
  8. splitspec + dflash, one process (the drafter called directly: 7 vs 8 is the split's cost)
  9. row 7's engine with no drafts asked (concurrency 1): what an idle drafter process costs
 10. splitspec + eagle3           (drafter in a second process), when the models folder has an
     EAGLE-3 head in eagle3/ (the demo recipe trains none)

Rows 4-8 drive the engine in this process (no client RPC), so every row measures
decoding, not the client. Usage:
  .venv/bin/python bench/compare.py [--models demo] [--prompts 8] [--new-tokens 64] [--write-readme]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TypeVar

import torch
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.pools import pool_folder  # noqa: E402
from common.compiled_forward import CompileConfig  # noqa: E402
from common.cpu_info import read_cpu_info  # noqa: E402
from common.cpu_linear import describe_kernels  # noqa: E402
from common.kv_layout import CacheConfig  # noqa: E402
from draft_service.drafters import DrafterConfig  # noqa: E402
from draft_service.local import LocalDrafterStub  # noqa: E402
from splitspec.heldout import held_out_prompts  # noqa: E402
from splitspec.net import free_port  # noqa: E402
from target_service.api_types import EngineRequest, SpeculationParams, StopParams  # noqa: E402
from target_service.config import EngineConfig  # noqa: E402
from target_service.draft_policy import SPECULATIVE_POLICIES  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402
from target_service.engine_core import EngineCore  # noqa: E402

T = TypeVar("T")
README_BEGIN = "<!-- compare:begin -->"
README_END = "<!-- compare:end -->"


@dataclass
class Result:
    row: int
    name: str
    concurrency: int
    tokens: int
    seconds: float
    steps: int = 0  # target forwards (engine rows)
    drafts: int = 0
    accepted: int = 0
    note: str = ""
    propose_ms: float | None = None  # mean Propose round trip, seen by the target
    drafter_ms: float | None = None  # mean time the drafter spent inside Propose
    mean_k: float | None = None  # drafts per sequence the speculative policy asked for, mean over decisions
    zero_k_share: float | None = None  # share of those decisions that asked for none
    verify_ms: float | None = None  # mean forward of a step that checked drafts
    decode_ms: float | None = None  # mean forward of a step of one new token per sequence
    vs_row4: float | None = None  # tokens/s / row 4's, the median over the rounds of each round's ratio
    step_vs_row4: float | None = None  # step time / row 4's, likewise

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float | None:
        return 1e3 * self.seconds / self.steps if self.steps else None

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def requests_for(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts, repeated until there are enough to keep `concurrency` requests in flight."""
    repeats = -(-concurrency // len(prompts))
    return (prompts * repeats)[: max(len(prompts), concurrency)]


def batches_for(held_out: list[list[int]], count: int, levels: Iterable[int]) -> dict[int, list[list[int]]]:
    """Per concurrency, the requests of a run: the first `count` held-out prompts, or as many
    distinct ones as the concurrency keeps in flight. A repeated prompt would be a prefix-cache
    hit for some rows and not others (DFlash needs the hidden states of a prompt its drafter has
    not written), and the rows would no longer do the same work."""
    return {c: requests_for(held_out[: max(count, c)], c) for c in levels}


class HistogramMean:
    """Mean of a Prometheus histogram over an interval: (sum, count) deltas."""

    def __init__(self, read: Callable[[], tuple[float, float]]) -> None:
        self._read = read
        self._start = read()

    def ms(self) -> float | None:
        total, count = (now - then for now, then in zip(self._read(), self._start, strict=True))
        return 1e3 * total / count if count else None

    @staticmethod
    def of(histogram) -> HistogramMean:
        """From a prometheus_client Histogram in this process."""
        def read() -> tuple[float, float]:
            samples = {m.name: m.value for family in histogram.collect() for m in family.samples}
            return _sum_count(samples)
        return HistogramMean(read)

    @staticmethod
    def scraped(url: str, name: str) -> HistogramMean:
        """From another process's /metrics endpoint."""
        def read() -> tuple[float, float]:
            with urllib.request.urlopen(url, timeout=10) as reply:
                text = reply.read().decode()
            samples = {m.name: m.value for family in text_string_to_metric_families(text) if family.name == name
                       for m in family.samples}
            return _sum_count(samples)
        return HistogramMean(read)


def _sum_count(samples: dict[str, float]) -> tuple[float, float]:
    total = next(v for k, v in samples.items() if k.endswith("_sum"))
    count = next(v for k, v in samples.items() if k.endswith("_count"))
    return total, count


# ---------------------------------------------------------------- reference implementations


def run_transformers(target, prompts: list[list[int]], new_tokens: int, concurrency: int, pad_id: int) -> float:
    """Greedy `generate`; batches of `concurrency` left-padded prompts."""
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start


def run_assisted(target, draft, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    for p in prompts:  # assisted generation is batch 1 only
        target.generate(torch.tensor([p]), assistant_model=draft, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def run_dflash_generate(target, dflash, prompts: list[list[int]], new_tokens: int) -> float:
    from dflash.model import dflash_generate

    start = time.perf_counter()
    for p in prompts:  # batch 1 only
        dflash_generate(dflash, target, torch.tensor([p]), max_new_tokens=new_tokens, stop_token_ids=None)
    return time.perf_counter() - start


# ---------------------------------------------------------------- splitspec rows


def run_engine(core: EngineCore, prompts: list[list[int]], new_tokens: int, concurrency: int,
               speculate: bool = True, outputs: dict[int, list[int]] | None = None) -> tuple[int, float, int, int, int]:
    """Keep `concurrency` requests in flight; (tokens, seconds, steps, drafts, accepted). With
    `outputs`, each prompt's generated tokens are collected there, by the prompt's index."""
    pending = list(enumerate(prompts))
    in_flight: dict[str, int] = {}
    tokens = steps = drafts = accepted = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i, ids = pending.pop(0)
            rid = f"c{concurrency}-{i}-{time.monotonic_ns()}"
            core.add(EngineRequest(rid, tuple(ids), stop=StopParams(max_tokens=new_tokens, ignore_eos=True),
                                   speculation=SpeculationParams(disable=not speculate)))
            in_flight[rid] = i
        steps += 1
        for out in core.step():
            tokens += len(out.token_ids)
            if outputs is not None:
                outputs.setdefault(in_flight[out.request_id], []).extend(out.token_ids)
            if out.finish_reason is not None:
                del in_flight[out.request_id]
                drafts += out.usage.num_drafts
                accepted += out.usage.accepted_tokens
    return tokens, time.perf_counter() - start, steps, drafts, accepted


class DrafterProcess:
    def __init__(self, kind: str, models: Path, token: str, log: Path, shm_dir: str,
                 compile_steps: bool = False, extra_args: list[str] | None = None) -> None:
        port, metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        model = [] if kind == "ngram" else ["--model", str(models / kind)]
        cmd = [sys.executable, "-m", "draft_service.cli", "--kind", kind, *model, "--target-model",
               str(models / "target"), "--port", str(port), "--metrics-port", str(metrics_port),
               "--shm-dir", shm_dir, "--log-level", "warning", "--compile" if compile_steps else "--no-compile",
               *(extra_args or [])]
        env = {**os.environ, "SPLITSPEC_INTERNAL_TOKEN": token}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def engine_config(models: Path, shm_dir: str, k: int, drafter: str | None = None, token: str | None = None,
                  policy: str = "adaptive", compile_steps: bool = False):
    return EngineConfig(model=str(models / "target"), cache=CacheConfig(shm_dir=shm_dir), max_num_seqs=16,
                        drafter=drafter, internal_token=token, num_speculative_tokens=k,
                        drafter_timeout_s=60.0, drafter_startup_wait_s=300.0, speculative_policy=policy,
                        compile=CompileConfig(enabled=compile_steps))


def in_process_engine(models: Path, shm_dir: str, k: int, kind: str = "dflash", policy: str = "adaptive",
                      dtype: str | None = None, compile_steps: bool = False) -> EngineCore:
    """The demo target with the demo drafter of `kind` called in this process (no second one)."""
    drafter = LocalDrafterStub(DrafterConfig(kind=kind, model=str(models / kind), target_model=str(models / "target"),
                                             shm_dir=shm_dir, compile=compile_steps))
    config = engine_config(models, shm_dir, k, "in-process", "unused", policy, compile_steps)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    return build_engine_core(config, drafter_stub=drafter)


def load_held_out(models: Path, num_prompts: int):
    """(the demo tokenizer, the first `num_prompts` held-out prompts as its token ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models / "target")
    return tokenizer, [tokenizer.encode(text) for text in held_out_prompts(num_prompts)]


def median_of(runs: list[T], key: Callable[[T], float] = lambda x: x) -> T:
    """The run of median duration: a shared machine's stalls land in the tails."""
    return sorted(runs, key=key)[len(runs) // 2]


def median_seconds(run: Callable[[], float], repeat: int) -> float:
    return median_of([run() for _ in range(repeat)])


def measure_once(core: EngineCore, row: int, name: str, prompts: list[list[int]], new_tokens: int,
                 concurrency: int, drafter_metrics: str | None = None, speculate: bool = True) -> Result:
    """One run of an engine row; with a drafter, the mean Propose round trip and, for a
    drafter process, the part spent inside the drafter (the rest is transport).

    Every run starts with an empty prefix cache, as vLLM's throughput benchmark does: the runs
    repeat the same prompts, which would be cache hits for target-only from its second run on
    but not for DFlash, whose drafter needs the hidden states of a prompt it has not written
    (target_service/speculation.py). Every row prefills every prompt; what caching saves is
    bench/prefix_cache.py's to measure."""
    core.page_manager.reset_prefix_cache()
    propose = HistogramMean.of(core.metrics.propose_latency)
    inside = (HistogramMean.scraped(drafter_metrics, "splitspec_draft_propose_latency_seconds")
              if drafter_metrics else None)
    chosen = ChosenK(core)
    verify, decode = forward_mean(core, "verify"), forward_mean(core, "decode")
    n, s, steps, d, a = run_engine(core, requests_for(prompts, concurrency), new_tokens, concurrency, speculate)
    mean_k, zero_share, probe_share = chosen.summary()
    return Result(row, name, concurrency, n, s, steps, d, a, propose_ms=propose.ms(),
                  drafter_ms=inside.ms() if inside else None, mean_k=mean_k, zero_k_share=zero_share,
                  verify_ms=verify.ms(), decode_ms=decode.ms(), note=_chosen_note(mean_k, zero_share, probe_share))


@dataclass
class EngineRow:
    row: int
    name: str
    core: EngineCore
    drafter_metrics: str | None = None  # a drafter process's /metrics
    speculate: bool = True
    levels: tuple[int, ...] | None = None  # the concurrencies it runs at (None: all)


def measure_interleaved(rows: list[EngineRow], prompts: list[list[int]], new_tokens: int, concurrency: int,
                        repeat: int) -> list[Result]:
    """Each row's median of `repeat` runs, the rows taking turns, in order and then in reverse
    (row 4, 5, ..., 8, then 8, ..., 4): a drift of this machine's speed over the minutes of a run
    lands on every row alike, and no row always runs first. Against row 4, a row's ratio is the
    median of its ratio to row 4's run of the same round: this VM's speed moves between rounds
    more than between the runs of one round (docs/performance.md#run-to-run-spread-of-the-comparison)."""
    rows = [r for r in rows if r.levels is None or concurrency in r.levels]
    runs: dict[int, list[Result]] = {r.row: [] for r in rows}
    for i in range(repeat):
        for r in rows if i % 2 == 0 else rows[::-1]:
            runs[r.row].append(measure_once(r.core, r.row, r.name, prompts, new_tokens, concurrency,
                                            r.drafter_metrics, r.speculate))
    medians = [median_of(found, key=lambda res: res.seconds) for found in runs.values()]
    if 4 in runs:
        for found, median in zip(runs.values(), medians, strict=True):
            median.vs_row4, median.step_vs_row4 = paired_ratios(found, runs[4])
    return medians


def paired_ratios(runs: list[Result], baseline: list[Result]) -> tuple[float, float | None]:
    """(tokens/s, step time) of each run over the baseline's run of the same round, medians."""
    speed = median_of([run.tokens_per_s / base.tokens_per_s for run, base in zip(runs, baseline, strict=True)])
    steps = [run.step_ms / base.step_ms for run, base in zip(runs, baseline, strict=True)
             if run.step_ms and base.step_ms]
    return speed, median_of(steps) if steps else None


def forward_mean(core: EngineCore, kind: str) -> HistogramMean:
    """Mean forward time of the engine's steps of one kind (verify, decode, prefill)."""
    def read() -> tuple[float, float]:
        registry = core.metrics.registry  # read each time: warmup swaps the metrics object
        labels = {"kind": kind}
        return tuple(registry.get_sample_value(f"splitspec_model_forward_duration_seconds_{part}", labels) or 0.0
                     for part in ("sum", "count"))
    return HistogramMean(read)


class ChosenK:
    """What the speculative policy decided over an interval, from the engine's own metrics."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._start = self._read()

    NAMES = ("splitspec_spec_decode_num_drafts_chosen_count", "splitspec_spec_decode_num_drafts_chosen_sum",
             "splitspec_spec_decode_policy_zero_draft_steps_total", "splitspec_spec_decode_policy_probes_total")

    def _read(self) -> tuple[float, ...]:
        registry = self._core.metrics.registry  # read each time: warmup swaps the metrics object
        return tuple(registry.get_sample_value(name) or 0.0 for name in self.NAMES)

    def summary(self) -> tuple[float | None, float | None, float | None]:
        """Mean k, the share of steps asking no drafts, the share of steps that probe."""
        count, total, zero, probes = (now - then for now, then in zip(self._read(), self._start, strict=True))
        return (total / count, zero / count, probes / count) if count else (None, None, None)


def _chosen_note(mean_k: float | None, zero_share: float | None, probe_share: float | None) -> str:
    if mean_k is None:
        return ""
    return (f"policy: mean k {mean_k:.2f}, no drafts in {100 * zero_share:.0f}% of steps, "
            f"probes in {100 * probe_share:.0f}%")


def splitspec_rows(models: Path, batches: dict[int, list[list[int]]], new_tokens: int, levels: tuple[int, ...], k: int,
                   repeat: int, tmp: str, policy: str = "adaptive",
                   compile_steps: bool = False) -> tuple[list[Result], list[str]]:
    """Rows 4-9, every engine (and drafter process) up at once and measured in turns; and the
    CPU linear kernels row 4's target chose at load (common/cpu_linear.py)."""
    token = secrets.token_hex(16)
    rows: list[EngineRow] = []
    drafters: list[DrafterProcess] = []
    try:
        core = build_engine_core(engine_config(models, tmp, k, compile_steps=compile_steps))
        core.warmup()
        rows.append(EngineRow(4, "splitspec, target only", core))
        kernels = [f"forward: {forward_description(core)}", *describe_kernels(core.model)]
        for row, kind in ((5, "ngram"), (6, "draft_model"), (7, "dflash")):
            drafter = DrafterProcess(kind, models, token, Path(tmp) / f"{kind}.log", tmp, compile_steps)
            drafters.append(drafter)
            core = build_engine_core(engine_config(models, tmp, k, drafter.address, token, policy, compile_steps))
            rows.append(EngineRow(row, f"splitspec + {kind} (2 processes)", core, drafter.metrics_url))
            if not core.link.ready:
                raise RuntimeError(f"{kind} drafter did not handshake: {core.link.detail}")
            core.warmup()
        rows.append(EngineRow(9, "splitspec + dflash (2 processes), no drafts asked", core, speculate=False, levels=(1,)))
        if (models / "eagle3" / "config.json").is_file():
            drafter = DrafterProcess("eagle3", models, token, Path(tmp) / "eagle3.log", tmp, compile_steps)
            drafters.append(drafter)
            core = build_engine_core(engine_config(models, tmp, k, drafter.address, token, policy, compile_steps))
            rows.append(EngineRow(10, "splitspec + eagle3 (2 processes)", core, drafter.metrics_url))
            if not core.link.ready:
                raise RuntimeError(f"eagle3 drafter did not handshake: {core.link.detail}")
            core.warmup()
        core = in_process_engine(models, tmp, k, "dflash", policy, compile_steps=compile_steps)
        core.warmup()
        rows.append(EngineRow(8, "splitspec + dflash (1 process)", core))
        results = []
        for c in sorted({*levels, 16}):
            measured = rows if c in levels else rows[:1]  # row 4 at 16 always: the ratios' baseline
            results += measure_interleaved(measured, batches[c], new_tokens, c, repeat)
        return results, kernels
    finally:
        for core in {id(r.core): r.core for r in rows}.values():  # row 9 is row 7's engine
            core.close()
        for drafter in drafters:
            drafter.stop()


def forward_description(core: EngineCore) -> str:
    """How row 4's target computes a step: its dtype, and the native, compiled or eager forward."""
    runner = core.runner
    if runner.native_forward is not None:
        kind = "one native call per step"
    elif runner.forward.buckets():
        kind = "compiled (--compile)"
    else:
        kind = "eager"
    return f"{core.model_info.dtype}, {kind}"


def reference_rows(models: Path, prompts: list[list[int]], batches: dict[int, list[list[int]]], new_tokens: int,
                   levels: tuple[int, ...], repeat: int, tokenizer) -> list[Result]:
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(models / "draft_model", dtype=torch.float32).eval()
    dflash = DFlashDraftModel.from_pretrained(models / "dflash", dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results = []
    with torch.inference_mode():
        # batch 1 only: one run stands for every concurrency level
        one = len(prompts) * new_tokens
        assisted = median_seconds(lambda: run_assisted(target, draft, prompts, new_tokens), repeat)
        dflash_seconds = median_seconds(lambda: run_dflash_generate(target, dflash, prompts, new_tokens), repeat)
        for c in levels:
            batch = batches[c]
            seconds = median_seconds(lambda: run_transformers(target, batch, new_tokens, c, pad), repeat)  # noqa: B023
            results.append(Result(1, "transformers generate", c, len(batch) * new_tokens, seconds,
                                  note="" if c == 1 else "left-padded batches"))
            results.append(Result(2, "transformers assisted (draft_model)", c, one, assisted, note="batch 1 only"))
            results.append(Result(3, "dflash_generate", c, one, dflash_seconds, note="batch 1 only"))
    return results


# ---------------------------------------------------------------- report


def table(results: list[Result], args: argparse.Namespace, kernels: list[str] = ()) -> str:
    base = {(r.row, r.concurrency): r.tokens_per_s for r in results}
    lines = [
        f"Measured {date.today()} on {read_cpu_info().describe()}, torch {torch.__version__}, "
        f"{'--threads ' + str(args.threads) + ' (not the default)' if args.threads else 'default threads'} "
        f"({torch.get_num_threads()} torch threads in the engines), "
        f"{'--compile' if args.compile else 'default forward'}"
        f"{' (row 4: ' + kernels[0].removeprefix('forward: ') + ')' if kernels else ''}; "
        f"demo models, {args.prompts} held-out prompts (as many distinct ones as a higher concurrency keeps in "
        f"flight; every run from an empty prefix cache), {args.new_tokens} new tokens each, greedy, K={args.k} "
        f"({args.speculative_policy} policy); "
        f"rows 4-10 each the median of {args.repeat} runs, the rows taking turns (in order, then in reverse), "
        f"their \"vs 4\" the median of each round's ratio to row 4's run; rows 1-3 medians of "
        f"{args.reference_repeat} runs.",
        "",
        "| # | run | concurrency | tok/s | vs 1 | vs 4 | accept len | step ms | verify ms | propose ms "
        "| in drafter ms | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: (r.concurrency, r.row)):
        one, four = base.get((1, r.concurrency)), base.get((4, r.concurrency))
        vs_four = _fmt(r.vs_row4, ".2f") if r.vs_row4 is not None else _ratio(r.tokens_per_s, four)
        lines.append(f"| {r.row} | {r.name} | {r.concurrency} | {r.tokens_per_s:.1f} | {_ratio(r.tokens_per_s, one)} "
                     f"| {vs_four} | {_fmt(r.acceptance_length, '.2f')} "
                     f"| {_fmt(r.step_ms, '.1f')} | {_fmt(r.verify_ms, '.1f')} | {_fmt(r.propose_ms, '.2f')} "
                     f"| {_fmt(r.drafter_ms, '.2f')} "
                     f"| {r.note} |")
    if kernels[1:]:
        lines += ["", "CPU linear kernels row 4's target chose at load, by shape and row count: "
                  + "; ".join(f"`{k}`" for k in kernels[1:])]
    return "\n".join(lines) + "\n"


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def targets(results: list[Result]) -> list[str]:
    """The speed goals (docs/performance.md#targets), each checked against this run's rows."""
    by = {(r.row, r.concurrency): r for r in results}
    out = ["Targets:"]

    def check(label: str, value: float | None, goal: float, higher: bool = True) -> None:
        if value is None:
            out.append(f"- {label}: not measured")
            return
        met = value >= goal if higher else value <= goal
        out.append(f"- {label}: {value:.2f} ({'met' if met else 'MISSED'}; goal {'≥' if higher else '≤'} {goal})")

    r = lambda row, c=1: by.get((row, c))  # noqa: E731
    if r(7) and r(4):
        check("row 7 / row 4 tokens/s at concurrency 1", _vs_row4(r(7), r(4)), 1.5)
        if r(8):
            check("row 8 / row 4 tokens/s at concurrency 1", _vs_row4(r(8), r(4)), 1.5)
        decode = r(4).decode_ms
        if r(7).verify_ms is not None and decode:
            check("row 7 verify step / row 4 decode step at concurrency 1", r(7).verify_ms / decode, 1.3,
                  higher=False)
        if r(7).drafter_ms is not None and decode:
            check("time inside the drafter per Propose / row 4 decode step at concurrency 1",
                  r(7).drafter_ms / decode, 0.35, higher=False)
    if r(9) and r(4):
        step_ratio = r(9).step_vs_row4 if r(9).step_vs_row4 is not None else r(9).step_ms / r(4).step_ms
        check("row 9 (the split asking no drafts) / row 4 step time at concurrency 1", step_ratio, 1.02, higher=False)
    if r(7) and r(8):
        check("row 7 / row 8 step time at concurrency 1", r(7).step_ms / r(8).step_ms, 1.05, higher=False)
        out.extend(split_cost(r(7), r(8)))
    if r(4) and r(1):
        check("row 4 / row 1 tokens/s at concurrency 1", r(4).tokens_per_s / r(1).tokens_per_s, 1.0)
    if r(4, 8) and r(1, 8):
        check("row 4 / row 1 tokens/s at concurrency 8", r(4, 8).tokens_per_s / r(1, 8).tokens_per_s, 1.3)
    for c in sorted({res.concurrency for res in results}):
        speculative = [res for res in results if res.concurrency == c and 5 <= res.row <= 8]
        if speculative and r(4, c):
            worst = min(speculative, key=lambda res: _vs_row4(res, r(4, c)))
            check(f"slowest speculative row (row {worst.row}) / row 4 tokens/s at concurrency {c}",
                  _vs_row4(worst, r(4, c)), 0.98)
    return out


def _vs_row4(result: Result, row4: Result) -> float:
    """The paired ratio where the rows took turns with row 4, else the ratio of their medians."""
    return result.vs_row4 if result.vs_row4 is not None else result.tokens_per_s / row4.tokens_per_s


def split_cost(split: Result, joined: Result) -> list[str]:
    """Where the split's extra step time goes, from the Propose means of rows 7 and 8."""
    if None in (split.propose_ms, split.drafter_ms, joined.propose_ms):
        return []
    extra = split.step_ms - joined.step_ms
    transport = split.propose_ms - split.drafter_ms
    drafter = split.drafter_ms - joined.propose_ms
    rest = extra - transport - drafter
    return [f"  - the split adds {extra:.2f} ms per step: Propose transport (round trip − time in the drafter) "
            f"{transport:.2f} ms, drafting in its own process {drafter:+.2f} ms, the rest of the step {rest:+.2f} ms"]


def write_readme(text: str, command: str) -> None:
    readme = REPO / "README.md"
    content = readme.read_text()
    block = f"{README_BEGIN}\n`{command}`\n\n{text}{README_END}"
    if README_BEGIN in content:
        head, rest = content.split(README_BEGIN, 1)
        content = head + block + rest.split(README_END, 1)[1]
    else:
        content += f"\n{block}\n"
    readme.write_text(content)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=REPO / "demo", help="folder with target/, draft_model/, dflash/")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=8, help="draft tokens per step")
    parser.add_argument("--speculative-policy", default="adaptive", choices=SPECULATIVE_POLICIES,
                        help="how many drafts each step asks for (fixed: always K)")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--repeat", type=int, default=9,
                        help="runs of each splitspec row (rows 4-10), taking turns; the table shows medians")
    parser.add_argument("--reference-repeat", type=int, default=3,
                        help="runs of each reference row (rows 1-3: transformers and dflash_generate)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--compile", action="store_true",
                        help="rows 4-8 with the compiled forward (every bucket compiled at warmup)")
    parser.add_argument("--write-readme", action="store_true", help="replace the table in README.md")
    args = parser.parse_args(argv)
    for name in ("repeat", "reference_repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = tuple(int(c) for c in args.concurrency.split(","))
    measured_levels = sorted({*levels, 16})  # row 4 at 16 always
    tokenizer, held_out = load_held_out(args.models, max(args.prompts, *measured_levels))
    prompts, batches = held_out[: args.prompts], batches_for(held_out, args.prompts, measured_levels)
    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        results = reference_rows(args.models, prompts, batches, args.new_tokens, levels, args.reference_repeat,
                                 tokenizer)
        rows, kernels = splitspec_rows(args.models, batches, args.new_tokens, levels, args.k, args.repeat, tmp,
                                       args.speculative_policy, args.compile)
    results += rows
    text = table(results, args, kernels)
    print(text)
    print("\n".join(targets(results)))  # the goals' verdicts: on the terminal, not in the README
    if args.write_readme:
        command = ".venv/bin/python bench/compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_readme(text, command.replace(" --write-readme", "").strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
