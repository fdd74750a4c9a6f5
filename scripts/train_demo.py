"""Train the bundled demo models: a tokenizer, a Qwen3 target and two drafters for it.

    .venv/bin/python scripts/train_demo.py --scaling-probe docs/scaling_probe.json   # full run → demo/ (~7 h on 2 idle cores)
    .venv/bin/python scripts/train_demo.py --target-from demo --out demo-new   # the drafters only (~1.8 h)
    .venv/bin/python scripts/train_demo.py --smoke --out /tmp/demo-smoke   # tiny sizes, seconds (CI)

The full run is meant to take several sessions: stop it whenever (Ctrl-C, kill -9, a lost
machine) and rerun the same command to continue. Its log and `target.pt` in the work
folder show the target's held-out perplexity as it trains (`heldout_evals` times).

Resumable: the run keeps its state in a work folder (`<out>.partial`, or `--work DIR`) and
writes a checkpoint there every `--checkpoint-minutes` (default 5) and at the end of every
stage (scripts/demo_resume.py). Stop it at any moment (Ctrl-C, kill -9, a lost machine) and
rerun the same command: finished stages are loaded, the interrupted one continues from its
last checkpoint, and the result is the one an uninterrupted run gives. A work folder made
with other sizes, seed or corpus is refused (`--restart` deletes it). It is deleted once
the models are written to `--out` (`--keep-work` keeps it).

Everything is trained from the Python standard library source of the running
interpreter (test packages, codec tables and data blobs left out), with a FIXED list of
held-out modules (`HELD_OUT`) kept out of training for scripts/eval_demo.py. The full
run's LMs also read the `.py` files of the venv's installed packages by the same rules
(deduplicated, none named like a held-out module; 174 MB, 58.6M tokens with this venv),
with 20% of their training windows still cut from the stdlib (`--corpus stdlib` for the
stdlib alone). Seeds and step counts are fixed (not time-based), so a rerun with the same
interpreter, packages, torch and threads reproduces the same models.

Output, in the real Hugging Face formats (safetensors stored in bfloat16, scripts/demo_bf16.py; ≤ 30 MB):
- `tokenizer/`   byte-level BPE (`tokenizers`) learnt from the stdlib, EOS `<|endoftext|>`,
                 mask `<|mask|>` (reserved for DFlash), chat tokens; `AutoTokenizer` loads it.
- `target/`      `Qwen3ForCausalLM` + tokenizer files (`AutoModelForCausalLM` loads it).
- `dflash/`      a DFlash block drafter in z-lab's format, trained with the `dflash`
                 package's own `DFlashDraftModel` class: the block `[anchor, mask × 8]`
                 attends to the target's hidden states after `target_layer_ids` and
                 learns the target's own greedy continuation (loss on the 8 predictions,
                 weighted toward the early ones).
- `draft_model/` a 2-layer Qwen3 LM on the same tokenizer: pretrained on the corpus,
                 then distilled on the target's greedy continuations.
- `training.json` sizes, corpus sources, steps, loss curves, stage times and resumes of the run.

`--target-from DIR` keeps the tokenizer and target of an earlier run's output (copied to
`--out` byte for byte; `training.json` carries their record) and trains the drafters only:
a new drafter recipe does not retrain a target that took an hour. A target whose record has
no anneal while the recipe asks for one is annealed first (the target's last stage), and
`--out` carries the annealed target.

Stages: tokenizer → target (bf16 autocast where the CPU multiplies bfloat16 natively, else fp32:
`--precision auto`, and a resumed run keeps its own; fp32 weights; torch.compile'd unless
`--no-compile`) → the target's anneal (windows that begin at a whole function's `def`,
docstrings dropped, mixed with corpus windows, at a low learning rate: what a prompt such
as `def is_prime(n):` looks like) → greedy continuations of the target as served (its
weights rounded to bf16, computed in fp32) from the recipe's prompts cut out of the
training text, with the target's hidden states taken from the decoding forwards → DFlash →
draft_model. Step throughput of each stage: bench/train_steps.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from demo_bf16 import store_bf16  # the sibling modules: scripts/ is on the path when this runs
from demo_drafters import Continuations, dflash_config, dflash_step_fn, greedy_continue_with_features, valid_lengths
from demo_resume import (
    CheckpointPolicy,
    Loop,
    LoopResult,
    PausePoint,
    ResumeRefused,
    WorkDir,
    atomic_save,
    atomic_write_json,
    load_checkpoint,
    publish_dir,
    run_loop,
)
from demo_training import (
    CORPORA,
    DEFAULT_OUT,
    FULL,
    HELD_OUT,
    PACKAGES_STDLIB_SHARE,
    PRECISIONS,
    SEED,
    SMOKE,
    Sizes,
    Source,
    StepOptions,
    aligned_windows,
    heldout_documents,
    keep_temp_files_in,
    load_corpus,
    log,
    lm_forward,
    lr_at,
    make_optimizer,
    mixed_windows,
    optimizer_step,
    perplexity,
    qwen3_config,
    save_lm,
    stdlib_dir,
    token_stream,
    warmup_steps,
    whole_functions,
)

from splitspec.tokenizer import train_bpe_tokenizer


@dataclass
class Context:
    """What every stage of one run shares."""

    sizes: Sizes
    work: WorkDir
    policy: CheckpointPolicy
    options: StepOptions
    pause: PausePoint | None = None
    target_from: PretrainedTarget | None = None  # drafters only: the target and tokenizer of an earlier run


# ---------------------------------------------------------------------------------------
# An earlier run's target (`--target-from`): retrain the drafters only


TARGET_FIELDS = ("vocab_size", "hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim")


@dataclass(frozen=True)
class PretrainedTarget:
    """The tokenizer and target of an earlier run's output folder, and that run's record of them."""

    folder: Path
    history: dict  # its training.json

    @classmethod
    def open(cls, folder: Path, sizes: Sizes) -> PretrainedTarget:
        """Refuses a folder that is not a complete train_demo.py output, or whose target differs
        from `sizes` in shape (the drafters are sized for it, DFlash reads its layers)."""
        missing = [name for name in ("tokenizer/tokenizer.json", "target/config.json", "target/model.safetensors",
                                     "training.json") if not (folder / name).is_file()]
        if missing:
            raise ResumeRefused(f"--target-from {folder}: not a train_demo.py output, missing {', '.join(missing)}")
        history = json.loads((folder / "training.json").read_text())
        recorded = history.get("sizes", {})
        differences = [f"{name}: {recorded.get(name, '(absent)')} there, {getattr(sizes, name)} in this recipe"
                       for name in TARGET_FIELDS if recorded.get(name) != getattr(sizes, name)]
        if differences:
            raise ResumeRefused(f"--target-from {folder}: its target is not this recipe's: {'; '.join(differences)}")
        return cls(folder, history)

    def identity(self) -> dict:
        """What the drafters are trained for: the bytes of the target's weights and tokenizer."""
        return {name: file_sha256(self.folder / name) for name in ("target/model.safetensors",
                                                                   "tokenizer/tokenizer.json")}

    def load_model(self):
        """The target in float32 (its stored bf16 values, exactly)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.folder / "target", dtype=torch.float32)

    def record(self) -> dict:
        """The target's own training record, carried into this run's training.json."""
        h = self.history
        return {"target_from": h.get("target_from", {"run_seconds": h.get("total_seconds")})
                | {"sha256": self.identity()},
                "target_final_loss": h.get("target_final_loss"),
                "target_heldout_perplexity": h.get("target_heldout_perplexity"),
                "target_loss_curve": h.get("loss_curves", {}).get("target"),
                "target_seconds": h.get("stage_seconds", {}).get("target", 0.0),
                "target_resumed_from": h.get("resumed_from", {}).get("target", [])}


def file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Tokenizer and token streams


@dataclass
class Streams:
    """The training text as token ids, one stream per source (each file followed by EOS)."""

    names: list[str]
    streams: list[torch.Tensor]  # [n_i] int64
    shares: list[float]  # probability that a training window comes from each
    seconds: float

    def windows(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        return mixed_windows(self.streams, self.shares, batch, length, generator)  # [B, length]


def source_shares(sizes: Sizes, names: list[str]) -> list[float]:
    return [1.0] if len(names) == 1 else [sizes.stdlib_share, 1.0 - sizes.stdlib_share]


def tokenizer_stage(ctx: Context, sources: list[Source]):
    """The BPE tokenizer (learnt from the stdlib alone, so per-token perplexities stay comparable
    whatever else the LMs read) and every source as a token stream; loaded when done before."""
    from transformers import AutoTokenizer

    folder, streams_file = ctx.work.file("tokenizer"), ctx.work.file("streams.pt")
    started = time.monotonic()
    if not folder.is_dir() and ctx.target_from is not None:
        publish_dir(lambda tmp: shutil.copytree(ctx.target_from.folder / "tokenizer", tmp, dirs_exist_ok=True), folder)
    elif not folder.is_dir():
        stdlib = next(s for s in sources if s.name == "stdlib")
        publish_dir(lambda tmp: train_bpe_tokenizer(stdlib.texts, ctx.sizes.vocab_size, tmp), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)  # read back in every session alike
    saved = load_checkpoint(streams_file)
    if saved is None:
        streams = [token_stream(tokenizer, s.texts).to(torch.int32) for s in sources]
        saved = {"names": [s.name for s in sources], "streams": streams, "seconds": time.monotonic() - started}
        atomic_save(saved, streams_file)
    else:
        log(f"tokenizer: done in an earlier session, loaded from {ctx.work.root}")
    names = saved["names"]
    streams = Streams(names, [s.long() for s in saved["streams"]], source_shares(ctx.sizes, names), saved["seconds"])
    return tokenizer, streams


# ---------------------------------------------------------------------------------------
# The target


def target_config(sizes: Sizes, tokenizer):
    return qwen3_config(sizes.vocab_size, tokenizer, hidden=sizes.hidden, layers=sizes.layers,
                        intermediate=sizes.intermediate, heads=sizes.heads, kv_heads=sizes.kv_heads,
                        head_dim=sizes.head_dim, max_positions=sizes.context)


def lm_loop(ctx: Context, name: str, model, batches, steps: int, lr: float,
            generators: dict[str, torch.Generator], evaluate=None, evaluations: int = 0) -> LoopResult:
    """Next-token training of `model`; `batches(step)` → (ids [B, T], labels [B, T], -100 where ignored)."""
    params = list(model.parameters())
    opt = make_optimizer(params, lr)
    forward = lm_forward(model, ctx.options)
    warmup = warmup_steps(steps)

    def step(i: int) -> dict[str, float]:
        ids, labels = batches(i)
        loss = forward(ids, labels)
        optimizer_step(opt, params, loss, lr_at(i, steps, lr, warmup))
        return {"loss": loss.item()}

    return run_loop(Loop(name, steps, model, opt, step, generators, evaluate, evaluations), ctx.work, ctx.policy,
                    ctx.pause)


def target_stage(ctx: Context, streams: Streams, tokenizer):
    from transformers import Qwen3ForCausalLM

    sizes = ctx.sizes
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(target_config(sizes, tokenizer))
    generator = torch.Generator().manual_seed(SEED + 1)

    def batches(step):
        ids = streams.windows(sizes.target_batch, sizes.context, generator)
        return ids, ids

    documents = heldout_documents(tokenizer)

    def evaluate() -> dict[str, float]:  # the figure scripts/eval_demo.py gives, to watch a long run
        return {"heldout_perplexity": perplexity(served_copy(model), documents, sizes.context)[0]}

    result = lm_loop(ctx, "target", model, batches, sizes.target_steps, sizes.target_lr, {"windows": generator},
                     evaluate, sizes.heldout_evals)
    return model, result


@dataclass
class Functions:
    """The anneal's functions (`whole_functions` of the training files) as one token stream, each
    followed by a blank line, and where each begins."""

    stream: torch.Tensor  # [n] int64
    starts: torch.Tensor  # [count] int64, each < n - anneal_length
    count: int

    def windows(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        return aligned_windows(self.stream, self.starts, batch, length, generator)  # [B, length]


def functions_stage(ctx: Context, sources: list[Source], tokenizer) -> Functions:
    """The training files' functions, tokenized once and kept in the work folder (as the streams are:
    packages installed since change nothing)."""
    path = ctx.work.file("functions.pt")
    saved = load_checkpoint(path)
    if saved is None:
        functions = whole_functions([text for source in sources for text in source.texts])
        pieces = [tokenizer(f + "\n\n", add_special_tokens=False).input_ids for f in functions]
        starts = torch.tensor([0] + [len(p) for p in pieces[:-1]], dtype=torch.long).cumsum(0)
        saved = {"stream": torch.tensor([t for p in pieces for t in p], dtype=torch.int32), "starts": starts,
                 "count": len(functions)}
        atomic_save(saved, path)
    stream = saved["stream"].long()
    starts = saved["starts"][saved["starts"] < stream.numel() - ctx.sizes.anneal_length]
    if starts.numel() == 0:
        raise RuntimeError(f"the corpus holds too few functions for one anneal window of {ctx.sizes.anneal_length} "
                           "tokens")
    log(f"anneal: {saved['count']} functions, {stream.numel()} tokens")
    return Functions(stream, starts, saved["count"])


def anneal_stage(ctx: Context, target, functions: Functions, streams: Streams, tokenizer):
    """The target fine-tuned on windows that begin at a function's `def` (what a prompt such as
    `def is_prime(n):` looks like: nothing before it) mixed with corpus windows: the pretrained
    target reads a bare `def` as a method's (most of its corpus) and indents the body 8 spaces."""
    sizes = ctx.sizes
    generator = torch.Generator().manual_seed(SEED + 5)
    functions_per_batch = round(sizes.anneal_batch * sizes.anneal_function_share)

    def batches(step):
        ids = torch.cat([functions.windows(functions_per_batch, sizes.anneal_length, generator),
                         streams.windows(sizes.anneal_batch - functions_per_batch, sizes.anneal_length, generator)])
        return ids, ids

    documents = heldout_documents(tokenizer)

    def evaluate() -> dict[str, float]:
        return {"heldout_perplexity": perplexity(served_copy(target), documents, sizes.context)[0]}

    target.train()
    result = lm_loop(ctx, "anneal", target, batches, sizes.anneal_steps, sizes.anneal_lr, {"windows": generator},
                     evaluate, min(sizes.heldout_evals, 2))
    return target.eval(), result


def served_copy(model):
    """The target as the services run it on a CPU: weights stored in bf16, computed in fp32."""
    import copy

    served = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        for p in served.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return served


# ---------------------------------------------------------------------------------------
# Greedy continuations of the target, with its hidden states


def continuation_plan(streams: Streams, sizes: Sizes) -> list[torch.Tensor]:
    """The prompts, batch by batch ([b, prompt_len] each), the same in every session."""
    generator = torch.Generator().manual_seed(SEED + 2)
    batches = []
    for prompt_len in sizes.gen_prompt_lens:
        remaining = sizes.gen_prompts_per_len
        while remaining:
            batch = min(sizes.gen_batch, remaining)
            batches.append(streams.windows(batch, prompt_len, generator))
            remaining -= batch
    return batches


def continuations_stage(ctx: Context, target, streams: Streams, eos_id: int) -> tuple[Continuations, dict]:
    """Each batch of prompts → one part file; a rerun generates only the missing parts."""
    sizes = ctx.sizes
    folder = ctx.work.file("continuations")
    folder.mkdir(exist_ok=True)
    done_file = folder / "done.json"
    if not done_file.is_file():
        plan = continuation_plan(streams, sizes)
        first_of_session = True
        for i, prompts in enumerate(plan):
            part = folder / f"part-{i:05d}.pt"
            if part.is_file():
                continue
            started = time.monotonic()
            ids, features = greedy_continue_with_features(target, prompts, sizes.gen_total_len,
                                                          sizes.target_layer_ids)
            if not torch.isfinite(features).all():
                raise RuntimeError("target hidden states overflow float16")
            prompt_len = prompts.shape[1]
            atomic_save({"ids": ids, "prompt_lens": torch.full((ids.shape[0],), prompt_len),
                         "valid_lens": valid_lengths(ids, prompt_len, eos_id), "features": features,
                         "seconds": time.monotonic() - started, "resumed": first_of_session and i > 0}, part)
            first_of_session = False
            log(f"greedy continuations: batch {i + 1}/{len(plan)} (prompt length {prompt_len}) done")
            if ctx.pause is not None:
                ctx.pause.check("continuations", i + 1)
        atomic_write_json({"parts": len(plan)}, done_file)
    else:
        log("continuations: done in an earlier session, loaded")
    parts = [load_checkpoint(folder / f"part-{i:05d}.pt", mmap=True)
             for i in range(json.loads(done_file.read_text())["parts"])]
    data = Continuations(torch.cat([p["ids"] for p in parts]), torch.cat([p["prompt_lens"] for p in parts]),
                         torch.cat([p["valid_lens"] for p in parts]), [p["features"] for p in parts])
    summary = {"seconds": sum(p["seconds"] for p in parts),
               "resumed_from": [i for i, p in enumerate(parts) if p["resumed"]]}
    return data, summary


# ---------------------------------------------------------------------------------------
# DFlash


def dflash_stage(ctx: Context, target, data: Continuations, tokenizer):
    from dflash.model import DFlashDraftModel

    sizes = ctx.sizes
    torch.manual_seed(SEED + 3)
    model = DFlashDraftModel(dflash_config(sizes, tokenizer))
    params = list(model.parameters())
    opt = make_optimizer(params, sizes.dflash_lr)
    generator = torch.Generator().manual_seed(SEED + 4)
    step = dflash_step_fn(model, target, data, sizes, tokenizer.mask_token_id, opt, params, generator, ctx.options)
    result = run_loop(Loop("dflash", sizes.dflash_steps, model, opt, step, {"batches": generator}), ctx.work,
                      ctx.policy, ctx.pause)
    return model, result


# ---------------------------------------------------------------------------------------
# The draft model


def draft_model_stage(ctx: Context, streams: Streams, data: Continuations, tokenizer):
    """Pretrain on the corpus, then distill on the target's greedy continuations (labels: the
    target's greedy tokens through the first EOS, and the last prompt token)."""
    from transformers import Qwen3ForCausalLM

    sizes = ctx.sizes
    torch.manual_seed(SEED + 5)
    config = qwen3_config(sizes.vocab_size, tokenizer, hidden=sizes.draft_hidden, layers=sizes.draft_layers,
                          intermediate=sizes.draft_intermediate, heads=sizes.draft_heads,
                          kv_heads=sizes.draft_kv_heads, head_dim=sizes.draft_head_dim, max_positions=sizes.context)
    model = Qwen3ForCausalLM(config)
    corpus_generator = torch.Generator().manual_seed(SEED + 6)
    distill_generator = torch.Generator().manual_seed(SEED + 7)

    def corpus_batches(step):
        ids = streams.windows(sizes.draft_batch, sizes.context, corpus_generator)
        return ids, ids

    positions = torch.arange(data.ids.shape[1])[None]
    ignore = (positions < data.prompt_lens[:, None] - 1) | (positions >= data.valid_lens[:, None])
    distill_labels = data.ids.masked_fill(ignore, -100)

    def distill_batches(step):
        rows = torch.randint(0, data.ids.shape[0], (sizes.draft_distill_batch,), generator=distill_generator)
        return data.ids[rows], distill_labels[rows]

    pretrain = lm_loop(ctx, "draft_pretrain", model, corpus_batches, sizes.draft_pretrain_steps, sizes.draft_lr,
                       {"windows": corpus_generator})
    distill = lm_loop(ctx, "draft_distill", model, distill_batches, sizes.draft_distill_steps, sizes.draft_lr / 2,
                      {"rows": distill_generator})
    return model, pretrain, distill


# ---------------------------------------------------------------------------------------
# The run


def run_identity(sizes: Sizes, sources: list[Source], target_from: PretrainedTarget | None = None) -> dict:
    """What a work folder's run is: a rerun must match it to continue it."""
    recipe = {k: v for k, v in asdict(sizes).items()
              if k != "threads" and not (k.startswith("anneal_") and sizes.anneal_steps == 0)}  # as before anneals
    identity = {"sizes": recipe, "seed": SEED, "corpus": {s.name: s.digest() for s in sources}}
    if target_from is not None:
        identity["target_from"] = target_from.identity()
    return identity


def tokenized_corpus_kept(root: Path, identity: dict) -> dict:
    """`identity` with the work folder's recorded corpus once its token streams are saved: from
    then on the run reads the streams, not the files, so packages installed or removed since
    (the corpus includes site-packages) change nothing it trains on."""
    run_file, streams_file = root / "run.json", root / "streams.pt"
    if not (run_file.is_file() and streams_file.is_file()):
        return identity
    recorded = json.loads(run_file.read_text()).get("corpus")
    if recorded is not None and recorded != identity["corpus"]:
        log(f"corpus: the files differ from the run's ({', '.join(sorted(recorded))}), which was tokenized in an "
            f"earlier session; the run goes on with its saved token streams ({streams_file})")
        identity = {**identity, "corpus": recorded}
    return identity


def corpus_record(sources: list[Source], streams: Streams) -> list[dict]:
    record = []
    for source, stream in zip(sources, streams.streams):
        entry = {"name": source.name, "files": len(source.files), "megabytes": round(source.megabytes, 2),
                 "tokens": stream.numel(), "window_share": streams.shares[streams.names.index(source.name)]}
        if source.name == "site-packages":
            entry["distributions"] = source.distributions()
        record.append(entry)
    return record


def dir_megabytes(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def record_session(work: WorkDir, threads: int) -> list[dict]:
    """Append this session (when, on which CPU, with how many threads) to the work folder's list."""
    from common.cpu_info import read_cpu_info

    path = work.file("sessions.json")
    sessions = json.loads(path.read_text()) if path.is_file() else []
    sessions.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": read_cpu_info().describe(),
                     "threads": threads, "torch": torch.__version__})
    atomic_write_json(sessions, path)
    return sessions


def run(sizes: Sizes, out: Path, work_dir: Path | None = None, policy: CheckpointPolicy = CheckpointPolicy(),
        pause: PausePoint | None = None, restart: bool = False, keep_work: bool = False,
        compile_steps: bool = False, target_from: Path | None = None, scaling_probe: Path | None = None) -> dict:
    """Train everything, or (`target_from`: an earlier run's output) the drafters for its target.
    `scaling_probe`: scripts/scaling_probe.py's report that chose the sizes, kept in training.json."""
    torch.set_num_threads(sizes.threads)
    pretrained = PretrainedTarget.open(target_from, sizes) if target_from is not None else None
    probe = json.loads(scaling_probe.read_text()) if scaling_probe is not None else None
    sources, held = load_corpus(sizes.corpus, sizes.max_files)
    for source in sources:
        log(f"corpus: {source.name}: {len(source.files)} files, {source.megabytes:.2f} MB")
    root = work_dir or default_work_dir(out)
    identity = run_identity(sizes, sources, pretrained)
    work = WorkDir(root, identity if restart else tokenized_corpus_kept(root, identity), restart)
    sessions = record_session(work, sizes.threads)
    if compile_steps:  # compiled kernels live (across sessions) and go with the work folder
        keep_temp_files_in(work.file("tmp"))
    ctx = Context(sizes, work, policy, StepOptions(precision=sizes.precision, compile=compile_steps), pause,
                  pretrained)

    tokenizer, streams = tokenizer_stage(ctx, sources)
    log(f"token streams: {dict(zip(streams.names, (s.numel() for s in streams.streams)))}")
    if pretrained is None:
        target, target_run = target_stage(ctx, streams, tokenizer)
        target_record = {"target_final_loss": target_run.tail_mean("loss"),
                         "target_heldout_perplexity": target_run.evaluations,  # fp32-from-bf16, during training
                         "target_loss_curve": target_run.curve("loss"), "target_seconds": target_run.seconds,
                         "target_resumed_from": target_run.resumed_from}
    else:
        target, target_record = pretrained.load_model(), pretrained.record()
        log(f"target: {target_from}/target, trained by an earlier run; training the drafters only")
    anneal_run, functions = None, None
    earlier_anneal = None if pretrained is None else pretrained.history.get("anneal")  # an earlier run's
    if sizes.anneal_steps and earlier_anneal is None:  # the target's recipe finished: an earlier run's too
        functions = functions_stage(ctx, sources, tokenizer)
        target, anneal_run = anneal_stage(ctx, target, functions, streams, tokenizer)
    served = served_copy(target)
    data, continuations = continuations_stage(ctx, served, streams, tokenizer.eos_token_id)
    dflash, dflash_run = dflash_stage(ctx, served, data, tokenizer)
    draft, pretrain_run, distill_run = draft_model_stage(ctx, streams, data, tokenizer)

    stage_seconds = {"tokenizer": streams.seconds, "target": target_record.pop("target_seconds"),
                     "anneal": anneal_run.seconds if anneal_run is not None else float(
                         (earlier_anneal or {}).get("seconds", 0.0)),  # the target's time carried, as "target"
                     "continuations": continuations["seconds"], "dflash": dflash_run.seconds,
                     "draft_model": pretrain_run.seconds + distill_run.seconds}
    loops = {"dflash": dflash_run, "draft_pretrain": pretrain_run, "draft_distill": distill_run}
    anneal_record = earlier_anneal
    if anneal_run is not None:
        loops = {"anneal": anneal_run} | loops
        anneal_record = {"steps": sizes.anneal_steps, "final_loss": anneal_run.tail_mean("loss"),
                         "heldout_perplexity": anneal_run.evaluations, "functions": functions.count,
                         "function_tokens": int(functions.stream.numel()), "seconds": round(anneal_run.seconds, 1),
                         "on_target_from": pretrained is not None}
    history = {
        "sizes": asdict(sizes), "held_out": list(HELD_OUT), "python": sys.version.split()[0],
        "torch": torch.__version__, "seed": SEED, "compiled": compile_steps,
        "stage_seconds": {name: round(s, 1) for name, s in stage_seconds.items()},
        "resumed_from": {"continuations": continuations["resumed_from"],
                         "target": target_record.pop("target_resumed_from")}
                        | {name: r.resumed_from for name, r in loops.items()},
        "corpus": corpus_record(sources, streams),
        "train_files": sum(len(s.files) for s in sources),
        "train_megabytes": round(sum(s.megabytes for s in sources), 2),
        "train_tokens": sum(s.numel() for s in streams.streams),
        "held_out_files": [str(p.relative_to(stdlib_dir())) for p in held],
        **{k: v for k, v in target_record.items() if k != "target_loss_curve"},
        "continuations": int(data.ids.shape[0]),
        "continuation_tokens": int((data.valid_lens - data.prompt_lens).sum()),
        "anneal": anneal_record,
        "dflash_final_loss": dflash_run.tail_mean("loss"),
        "dflash_train_accepted_per_block": dflash_run.tail_mean("accepted"),
        "draft_pretrain_final_loss": pretrain_run.tail_mean("loss"),
        "draft_distill_final_loss": distill_run.tail_mean("loss"),
        "loss_curves": {"target": target_record["target_loss_curve"]} | {name: r.curve("loss")
                                                                          for name, r in loops.items()},
        "total_seconds": round(sum(stage_seconds.values()), 1),  # training time kept, over all sessions
        "sessions": sessions,  # each start or resume of the command: when, on which CPU
    }
    if probe is not None:
        history["scaling_probe"] = probe

    def write_outputs(folder: Path) -> None:
        shutil.copytree(work.file("tokenizer"), folder / "tokenizer")
        if pretrained is None or anneal_run is not None:
            save_lm(target, tokenizer, folder / "target")
        else:  # byte for byte what the drafters were trained for
            shutil.copytree(pretrained.folder / "target", folder / "target")
        dflash.save_pretrained(folder / "dflash", safe_serialization=True)
        save_lm(draft, tokenizer, folder / "draft_model")
        store_bf16(folder)  # trained in float32; stored in half the bytes (every checkout carries them)
        history["megabytes"] = round(dir_megabytes(folder), 2)
        (folder / "training.json").write_text(json.dumps(history, indent=2) + "\n")

    staged = out.with_name(out.name + ".new")
    shutil.rmtree(staged, ignore_errors=True)
    publish_dir(write_outputs, staged)
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)
    if not keep_work:
        shutil.rmtree(work.root)
    log(f"wrote {out} ({history['megabytes']} MB; {history['total_seconds']:.0f} s of training)")
    return history


def default_work_dir(out: Path) -> Path:
    """Where a run keeps its checkpoints unless --work names a folder: `<out>.partial`."""
    return out.with_name(out.name + ".partial")


def recorded_precision(work_root: Path) -> str | None:
    """The precision a work folder's run was begun in (its run.json), or None for a new run."""
    try:
        return json.loads((work_root / "run.json").read_text())["sizes"]["precision"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_precision(name: str, work_root: Path, restart: bool) -> str:
    """`--precision auto`: a run in progress keeps the precision it was begun in (a resume is
    bitwise the uninterrupted run, whatever CPU it lands on); a new one takes bfloat16 autocast
    where this CPU multiplies bfloat16 natively (AVX512-BF16, AMX) and float32 elsewhere, where
    torch emulates bfloat16 (on an AMD EPYC with AVX2 alone a DFlash step took 7.0 s in bf16
    autocast and 0.34 s in float32: bench/train_steps.py, docs/performance.md)."""
    if name != "auto":
        return name
    from common.cpu_linear import native_cpu_bf16

    recorded = None if restart else recorded_precision(work_root)
    if recorded is not None:
        return recorded
    return "bf16" if native_cpu_bf16() else "fp32"


def sizes_for(args: argparse.Namespace) -> Sizes:
    """The run's sizes: the full or smoke recipe with the command line's changes."""
    base = SMOKE if args.smoke else FULL
    work_root = args.work or default_work_dir(args.out)
    changes: dict = {"threads": args.threads,
                     "precision": resolve_precision(args.precision, work_root, args.restart)}
    if args.corpus is not None and args.corpus != base.corpus:
        changes |= {"corpus": args.corpus,
                    "stdlib_share": 1.0 if args.corpus == "stdlib" else PACKAGES_STDLIB_SHARE}
    if args.dflash_layers is not None:
        changes["dflash_layers"] = args.dflash_layers
    return dataclasses.replace(base, **changes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=None,
                        help="work folder with the checkpoints of the run (default: OUT.partial)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps (CI, seconds)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto",
                        help="training steps' precision (auto: a run in progress keeps its own; a new run bf16 "
                             "autocast where the CPU has native bfloat16, AVX512-BF16 or AMX, else fp32)")
    parser.add_argument("--corpus", choices=CORPORA, default=None,
                        help="the LMs' training text (default: the sizes' own, %s for the full run)" % FULL.corpus)
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0,
                        help="write a training loop's checkpoint this often (default: %(default)s)")
    parser.add_argument("--checkpoint-steps", type=int, default=None,
                        help="write it every this many steps instead (tests)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the training steps (default: on for the full run, off for --smoke)")
    parser.add_argument("--restart", action="store_true", help="delete the work folder first: start over")
    parser.add_argument("--keep-work", action="store_true", help="keep the work folder after writing --out")
    parser.add_argument("--target-from", type=Path, default=None, metavar="DIR",
                        help="train only the drafters (continuations, DFlash, draft model) for the tokenizer and "
                             "target of an earlier run's output DIR, such as demo/; they are copied to --out as they are")
    parser.add_argument("--scaling-probe", type=Path, default=None, metavar="JSON",
                        help="scripts/scaling_probe.py's report behind the sizes, kept in training.json")
    parser.add_argument("--dflash-layers", type=int, default=None, metavar="N",
                        help="DFlash drafter layers (default: the recipe's); with --target-from, to measure "
                             "whether another layer pays for itself in speed, not only acceptance")
    parser.add_argument("--pause-after", type=PausePoint.parse, default=None, help=argparse.SUPPRESS)  # tests
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = sizes_for(args)
    policy = CheckpointPolicy(every_seconds=args.checkpoint_minutes * 60, every_steps=args.checkpoint_steps)
    try:
        run(sizes, args.out, args.work, policy, args.pause_after, args.restart, args.keep_work,
            compile_steps=not args.smoke if args.compile is None else args.compile, target_from=args.target_from,
            scaling_probe=args.scaling_probe)
    except ResumeRefused as refused:
        print(f"train_demo.py: {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
