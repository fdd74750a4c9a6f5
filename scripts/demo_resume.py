"""Resumable training for scripts/train_demo.py: the work folder, atomic checkpoints, RNG states.

The work folder (default `<out>.partial`, or `--work DIR`) holds one run in progress:

    run.json                    what the run is: sizes, seed, corpus digest. A command whose
                                own differ is refused (ResumeRefused), never mixed in.
    tokenizer/  streams.pt      the tokenizer stage's outputs (the tokenizer, the token streams)
    <loop>.pt                   one per training loop (target, dflash, draft_pretrain,
                                draft_distill): model, optimizer, next step, every RNG state,
                                metrics per step; once the loop is done: `done`, model, metrics
    continuations/part-NNNNN.pt one batch of greedy continuations with the target's features;
    continuations/done.json     written when all are there

Every file is written under a temporary name, synced and renamed into place, so a kill at
any moment leaves the last checkpoint whole; leftovers of a cut write are deleted at start.
A loop writes its checkpoint every `CheckpointPolicy` interval and when it finishes, so a
rerun of the same command loads finished stages and continues the interrupted one from its
last checkpoint: same batches, same optimizer state, same result as an uninterrupted run
(bitwise with the same threads, tests/test_demo.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from demo_training import log

TMP_MARK = ".tmp-"  # in the names of files and folders being written
LOG_EVERY = 50


class ResumeRefused(RuntimeError):
    """The work folder holds a run with other settings than the command's."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a loop writes its checkpoint: every `every_steps` steps if set, else every `every_seconds`."""

    every_seconds: float = 300.0
    every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.every_seconds <= 0 or (self.every_steps is not None and self.every_steps < 1):
            raise ValueError("checkpoint intervals must be positive")

    def due(self, steps_since: int, seconds_since: float) -> bool:
        if self.every_steps is not None:
            return steps_since >= self.every_steps
        return seconds_since >= self.every_seconds


@dataclass(frozen=True)
class PausePoint:
    """For tests: after this step of this stage, say so and wait to be killed."""

    stage: str
    step: int

    @classmethod
    def parse(cls, text: str) -> PausePoint:
        stage, _, step = text.partition(":")
        if not stage or not step.isdigit() or int(step) < 1:
            raise ValueError(f"expected STAGE:STEP (STEP ≥ 1), not {text!r}")
        return cls(stage, int(step))

    def check(self, stage: str, step: int) -> None:
        if (stage, step) == (self.stage, self.step):
            log(f"paused after {stage} step {step}")
            while True:
                time.sleep(3600)


# ---------------------------------------------------------------------------------------
# Files


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write: Callable[[object], None]) -> None:
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


def atomic_save(obj, path: Path) -> None:
    """torch.save `obj` to `path`: all of it or, after any failure or kill, the file as it was."""
    _write_atomically(path, lambda f: torch.save(obj, f))


def atomic_write_json(value, path: Path) -> None:
    _write_atomically(path, lambda f: f.write((json.dumps(value, indent=2) + "\n").encode()))


def load_checkpoint(path: Path, mmap: bool = False) -> dict | None:
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def publish_dir(build: Callable[[Path], None], final: Path) -> None:
    """`build(tmp)` fills a temporary folder, renamed to `final` (which must not exist) when done."""
    tmp = final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    tmp.rename(final)
    _sync_dir(final.parent)


class WorkDir:
    """The work folder of one run; refuses a run whose identity differs from the folder's."""

    def __init__(self, root: Path, identity: dict, restart: bool = False) -> None:
        self.root = root
        if restart and root.exists():
            log(f"--restart: deleting {root}")
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        self._remove_cut_writes()
        self._claim(json.loads(json.dumps(identity)))  # as JSON reads it back: tuples are lists

    def file(self, name: str) -> Path:
        return self.root / name

    def _remove_cut_writes(self) -> None:
        for path in sorted(self.root.rglob(f"*{TMP_MARK}*"), reverse=True):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def _claim(self, identity: dict) -> None:
        run_file = self.file("run.json")
        if not run_file.is_file():
            atomic_write_json(identity, run_file)
            return
        recorded = json.loads(run_file.read_text())
        differences = describe_differences(recorded, identity)
        if differences:
            raise ResumeRefused(
                f"{self.root} holds a run with other settings than this command's: {'; '.join(differences)}. "
                "Rerun it with its own settings to continue it, pass --restart to delete it, "
                "or --work DIR to train elsewhere.")
        log(f"continuing the run in {self.root}")


def describe_differences(recorded: dict, wanted: dict, prefix: str = "") -> list[str]:
    """'key: X in the work folder, Y in this command' for every leaf that differs."""
    lines = []
    for key in sorted(set(recorded) | set(wanted)):
        old, new = recorded.get(key, "(absent)"), wanted.get(key, "(absent)")
        if isinstance(old, dict) and isinstance(new, dict):
            lines += describe_differences(old, new, f"{prefix}{key}.")
        elif old != new:
            lines.append(f"{prefix}{key}: {old} in the work folder, {new} in this command")
    return lines


# ---------------------------------------------------------------------------------------
# RNG states


def rng_state(generators: dict[str, torch.Generator]) -> dict:
    """torch's global generator, Python's `random`, and the loop's own generators (numpy's is unused)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "generators": {name: g.get_state() for name, g in generators.items()}}


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if set(state["generators"]) != set(generators):
        raise ResumeRefused(f"checkpoint generators {sorted(state['generators'])} ≠ {sorted(generators)}")
    for name, g in generators.items():
        g.set_state(state["generators"][name])


# ---------------------------------------------------------------------------------------
# A resumable training loop


@dataclass
class Loop:
    """`steps` calls of `step(i)`, each a whole training step that returns its metrics (loss, …);
    `evaluate()` (no RNG, model left as found) `evaluations` times, evenly spread, the last at the end."""

    name: str
    steps: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[int], dict[str, float]]
    generators: dict[str, torch.Generator]
    evaluate: Callable[[], dict[str, float]] | None = None
    evaluations: int = 0

    def evaluates_after(self, done_steps: int) -> bool:
        if self.evaluate is None or self.evaluations < 1:
            return False
        every = max(1, self.steps // self.evaluations)
        return done_steps == self.steps or (done_steps % every == 0 and self.steps - done_steps >= every)


@dataclass
class LoopResult:
    metrics: dict[str, list[float]]  # per step
    seconds: float  # training time kept in the result, over all sessions
    resumed_from: list[int] = field(default_factory=list)  # the step each later session started at
    evaluations: list[dict[str, float]] = field(default_factory=list)  # {"step": …, metric: …} each

    def tail_mean(self, metric: str, n: int = LOG_EVERY) -> float:
        values = self.metrics[metric][-n:]
        return sum(values) / len(values)

    def curve(self, metric: str, every: int = LOG_EVERY) -> list[float]:
        values = self.metrics[metric]
        return [round(sum(values[i:i + every]) / len(values[i:i + every]), 4) for i in range(0, len(values), every)]


def _loop_state(loop: Loop, step: int, result: LoopResult, done: bool) -> dict:
    state = {"step": step, "done": done, "model": loop.model.state_dict(), "metrics": result.metrics,
             "seconds": result.seconds, "resumed_from": result.resumed_from, "evaluations": result.evaluations}
    if not done:
        state |= {"optimizer": loop.optimizer.state_dict(), "rng": rng_state(loop.generators)}
    return state


def run_loop(loop: Loop, work: WorkDir, policy: CheckpointPolicy, pause: PausePoint | None = None) -> LoopResult:
    """Run `loop` to its end, from its checkpoint in `work` if there is one; leave the model trained."""
    path = work.file(f"{loop.name}.pt")
    state = load_checkpoint(path)
    start, result = 0, LoopResult({}, 0.0)
    if state is not None:
        loop.model.load_state_dict(state["model"])
        result = LoopResult(state["metrics"], state["seconds"], state["resumed_from"], state["evaluations"])
        if state["done"]:
            log(f"{loop.name}: done in an earlier session, loaded from {path}")
            return result
        loop.optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"], loop.generators)
        start = state["step"]
        result.resumed_from.append(start)
        log(f"{loop.name}: resuming at step {start + 1}/{loop.steps} from {path}")
    loop.model.train()
    kept_seconds, session_start = result.seconds, time.monotonic()
    last_save, last_saved_step = session_start, start
    for step in range(start, loop.steps):
        for name, value in loop.step(step).items():
            result.metrics.setdefault(name, []).append(value)
        done_steps = step + 1
        now = time.monotonic()
        if step % LOG_EVERY == 0 or done_steps == loop.steps:
            rate = (done_steps - start) / (now - session_start)
            shown = " ".join(f"{name} {sum(v[-LOG_EVERY:]) / len(v[-LOG_EVERY:]):.3f}"
                             for name, v in result.metrics.items())
            log(f"{loop.name} step {done_steps}/{loop.steps} {shown} ({rate:.2f} steps/s)")
        if loop.evaluates_after(done_steps):
            values = loop.evaluate()
            result.evaluations.append({"step": done_steps, **values})
            log(f"{loop.name} after step {done_steps}: " + " ".join(f"{k} {v:.3f}" for k, v in values.items()))
        result.seconds = kept_seconds + time.monotonic() - session_start
        if done_steps < loop.steps and policy.due(done_steps - last_saved_step, now - last_save):
            atomic_save(_loop_state(loop, done_steps, result, False), path)
            last_save, last_saved_step = time.monotonic(), done_steps
        if pause is not None:
            pause.check(loop.name, done_steps)
    loop.model.eval()
    atomic_save(_loop_state(loop, loop.steps, result, True), path)
    return result
