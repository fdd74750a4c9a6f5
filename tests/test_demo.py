"""The bundled demo pair and `splitspec up`.

`scripts/train_demo.py --smoke` always runs (into a tmp dir). The other tests use the
bundled `demo/` when it is complete, else the smoke outputs: never a silent skip.
- training resumes: a smoke run SIGKILLed in the middle of every kind of stage and rerun
  gives bitwise the models and losses of an uninterrupted run, continuing each stage from
  its checkpoint; a work folder of other settings is refused;
- transformers loads the target and the tokenizer (EOS and the DFlash mask token);
- the `dflash` package loads the drafter, and `dflash_generate` reproduces the target's
  greedy output on held-out snippets;
- end to end through `splitspec up`'s own code path (two processes, handshake, shared
  pages): greedy tokens with speculation equal those without, Usage shows drafts, and
  the gateway answers the curl command it prints, and Ctrl-C stops all three cleanly.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitspec.v1 import generation_pb2 as pb
from tests.procs import REPO_ROOT, free_port, stream_tokens, wait_for_line

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import demo_drafters  # noqa: E402
import demo_resume  # noqa: E402
import demo_training  # noqa: E402
import train_demo  # noqa: E402

pytestmark = pytest.mark.slow
BUNDLED = REPO_ROOT / "demo"
PARTS = ("tokenizer", "target", "dflash", "draft_model")
MAX_BYTES = 30 * 10**6  # all demo files (the GPU run carries them in 64 MiB)
READY = re.compile(r"splitspec up: ready at (\S+)")
NEW_TOKENS = 24


def complete(folder: Path) -> bool:
    return all((folder / part / name).is_file()
               for part in PARTS for name in (("tokenizer.json",) if part == "tokenizer" else ("config.json",)))


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "demo"
    started = time.monotonic()
    run = subprocess.run([sys.executable, "scripts/train_demo.py", "--smoke", "--threads", "1", "--out", str(out)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    print(f"smoke training: {time.monotonic() - started:.1f} s")
    return out


@pytest.fixture(scope="module")
def demo_dir(smoke_dir) -> Path:
    """The bundled pair when it is there, else the smoke run's."""
    return BUNDLED if complete(BUNDLED) else smoke_dir


def held_out_snippets(tokenizer, count: int, max_tokens: int) -> list[str]:
    """The first `count` held-out modules' openings after the docstring, cut to max_tokens."""
    snippets = []
    for path in demo_training.held_out_files()[:count]:
        text = demo_training.read_text(path)
        start = text.find("\nimport ") + 1 or text.find("\ndef ") + 1
        ids = tokenizer(text[start:]).input_ids[:max_tokens]
        snippets.append(tokenizer.decode(ids))
    return snippets


def test_smoke_run_writes_every_part(smoke_dir):
    assert complete(smoke_dir)
    history = json.loads((smoke_dir / "training.json").read_text())
    assert history["held_out"] == list(demo_training.HELD_OUT)
    assert set(history["stage_seconds"]) == {"tokenizer", "target", "anneal", "continuations", "dflash", "draft_model"}
    assert not smoke_dir.with_name(smoke_dir.name + ".partial").exists()


# ---------------------------------------------------------------------------------------
# Resumable training

SMOKE_CMD = [sys.executable, "scripts/train_demo.py", "--smoke", "--threads", "1", "--checkpoint-steps", "4"]
LOOPS = ("target", "anneal", "dflash", "draft_pretrain", "draft_distill")


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    run = subprocess.run([*SMOKE_CMD, "--out", str(out), *extra], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def _kill_when_paused(out: Path, stage: str, step: int, log_path: Path) -> str:
    """Run the smoke training until it pauses after `step` of `stage`, then SIGKILL it."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*SMOKE_CMD, "--out", str(out), "--pause-after", f"{stage}:{step}"], cwd=REPO_ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while f"paused after {stage} step {step}" not in log_path.read_text():
            assert proc.poll() is None, f"training exited with {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    return log_path.read_text()


def _loop_results(work: Path) -> dict[str, dict]:
    """Each loop's final float32 weights and per-step metrics, from the work folder."""
    return {name: torch.load(work / f"{name}.pt", weights_only=True) for name in LOOPS}


def test_training_killed_mid_stage_resumes_to_the_same_result(tmp_path):
    reference = tmp_path / "reference"
    _train(reference / "demo", "--keep-work")

    out = tmp_path / "resumed" / "demo"
    work = out.with_name("demo.partial")
    # (stage, step it pauses after, step its checkpoint holds): killed between checkpoints
    kills = [("target", 14, 12), ("anneal", 6, 4), ("continuations", 2, 2), ("dflash", 10, 8),
             ("draft_distill", 7, 4)]
    for stage, step, saved in kills:
        log = _kill_when_paused(out, stage, step, tmp_path / f"{stage}.log")
        if stage == "continuations":
            assert sorted(p.name for p in (work / "continuations").glob("part-*.pt")) == \
                ["part-00000.pt", "part-00001.pt"], log
        else:
            checkpoint = torch.load(work / f"{stage}.pt", weights_only=True)
            assert (checkpoint["step"], checkpoint["done"]) == (saved, False), log
    rerun = _train(out, "--keep-work")

    history = json.loads((out / "training.json").read_text())
    assert history["resumed_from"] == {"target": [12], "anneal": [4], "continuations": [2], "dflash": [8],
                                       "draft_pretrain": [], "draft_distill": [4]}, rerun.stdout
    expected = _loop_results(reference / "demo.partial")
    got = _loop_results(work)
    for name in LOOPS:
        assert got[name]["metrics"] == expected[name]["metrics"], f"{name}: per-step losses differ"
        mismatched = [key for key, value in expected[name]["model"].items()
                      if not torch.equal(got[name]["model"][key], value)]
        assert not mismatched, f"{name}: float32 weights differ in {mismatched[:5]}"
    reference_history = json.loads((reference / "demo" / "training.json").read_text())
    for key in ("continuation_tokens", "dflash_train_accepted_per_block", "loss_curves", "train_tokens"):
        assert history[key] == reference_history[key], key
    assert all(f"{stage}: resuming at step {saved + 1}/" in rerun.stdout + "".join(
        (tmp_path / f"{s}.log").read_text() for s, _, _ in kills) for stage, _, saved in kills if stage in LOOPS)


def test_work_folder_of_other_settings_is_refused(tmp_path):
    out = tmp_path / "demo"
    _kill_when_paused(out, "target", 5, tmp_path / "smoke.log")
    run_file = out.with_name("demo.partial") / "run.json"
    recorded = run_file.read_text()
    refused = subprocess.run([sys.executable, "scripts/train_demo.py", "--threads", "1", "--out", str(out)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "other settings" in refused.stderr and "target_steps: 30 in the work folder, " in refused.stderr
    assert "--restart" in refused.stderr
    assert run_file.read_text() == recorded and (out.with_name("demo.partial") / "target.pt").is_file()


def test_a_run_whose_streams_are_saved_goes_on_when_the_corpus_files_change(tmp_path):
    """The corpus includes site-packages: installing a package must not orphan a run that has
    already tokenized its corpus, while a run that has not must still be refused."""
    identity = {"sizes": {"layers": 6}, "seed": 1, "corpus": {"stdlib": "a", "site-packages": "b"}}
    demo_resume.atomic_write_json(identity, tmp_path / "run.json")
    changed = {**identity, "corpus": {"stdlib": "a", "site-packages": "c"}}
    assert train_demo.tokenized_corpus_kept(tmp_path, changed) == changed  # no streams yet: refused below
    with pytest.raises(demo_resume.ResumeRefused, match="corpus.site-packages: b in the work folder, c"):
        demo_resume.WorkDir(tmp_path, changed)
    (tmp_path / "streams.pt").write_bytes(b"saved streams")
    assert train_demo.tokenized_corpus_kept(tmp_path, changed) == identity
    demo_resume.WorkDir(tmp_path, train_demo.tokenized_corpus_kept(tmp_path, changed))  # accepted
    other_sizes = {**changed, "sizes": {"layers": 8}}
    with pytest.raises(demo_resume.ResumeRefused, match="sizes.layers: 6 in the work folder, 8"):
        demo_resume.WorkDir(tmp_path, train_demo.tokenized_corpus_kept(tmp_path, other_sizes))


def _weights(folder: Path, part: str) -> bytes:
    return (folder / part / "model.safetensors").read_bytes()


def test_target_from_trains_the_same_drafters_for_that_target(smoke_dir, tmp_path):
    """`--target-from` keeps an earlier run's tokenizer and target byte for byte and trains only
    the drafters: with the same recipe and seeds, the very drafters the full run trained."""
    out = tmp_path / "drafters"
    run = subprocess.run([sys.executable, "scripts/train_demo.py", "--smoke", "--threads", "1", "--out", str(out),
                          "--target-from", str(smoke_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "training the drafters only" in run.stdout and "target step" not in run.stdout
    assert _weights(out, "target") == _weights(smoke_dir, "target")
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (smoke_dir / "tokenizer" / "tokenizer.json").read_bytes()
    for part in ("dflash", "draft_model"):
        assert _weights(out, part) == _weights(smoke_dir, part), part
    history, source = (json.loads((folder / "training.json").read_text()) for folder in (out, smoke_dir))
    assert history["target_from"]["sha256"]["target/model.safetensors"] == hashlib.sha256(
        _weights(smoke_dir, "target")).hexdigest()
    for key in ("target_final_loss", "target_heldout_perplexity"):
        assert history[key] == source[key], key
    assert history["loss_curves"]["target"] == source["loss_curves"]["target"]
    assert history["stage_seconds"]["target"] == source["stage_seconds"]["target"]
    assert history["anneal"] == source["anneal"]  # annealed by the earlier run: its record and time carried
    assert history["stage_seconds"]["anneal"] == source["stage_seconds"]["anneal"] > 0


def test_target_from_a_run_without_the_anneal_anneals_its_target_first(smoke_dir, tmp_path):
    """An earlier run's target whose record has no anneal (the recipe's last target stage) gets it
    before its drafters are trained; the output carries the annealed target, not the folder's."""
    earlier = tmp_path / "earlier"
    shutil.copytree(smoke_dir, earlier)
    history = json.loads((earlier / "training.json").read_text())
    assert history["anneal"]["steps"] == demo_training.SMOKE.anneal_steps and history["anneal"]["functions"] > 0
    del history["anneal"]
    (earlier / "training.json").write_text(json.dumps(history))
    out = tmp_path / "annealed"
    run = subprocess.run([sys.executable, "scripts/train_demo.py", "--smoke", "--threads", "1", "--out", str(out),
                          "--target-from", str(earlier)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "anneal step" in run.stdout and "target step" not in run.stdout
    assert _weights(out, "target") != _weights(earlier, "target")
    record = json.loads((out / "training.json").read_text())["anneal"]
    assert record["on_target_from"] and record["steps"] == demo_training.SMOKE.anneal_steps


def test_whole_functions_are_top_level_code_without_docstrings():
    source = (
        "def kept(n):\n"
        '    """Its docstring,\n    two lines."""\n'
        "    total = n + 1\n"
        "    if total > 2:\n        total -= 1\n"
        "    return total\n\n"
        "def one_line(n):\n    return n + 1\n\n"
        "def too_wide(n):\n    if n:\n        return '" + "x" * 80 + "'\n    return n\n\n"
        "class Box:\n"
        "    def method(self):\n        return 1\n\n"
        "    def nested_function(n, k):\n        if n:\n            return k\n        return n\n\n"
        "@decorated\ndef decorated(n):\n    return n\n\n"
        "def only_a_docstring(n):\n    \"\"\"Nothing else.\"\"\"\n\n"
        "def returns_nothing(n):\n    print(n)\n    return\n"
    )
    assert demo_training.whole_functions([source, "def broken(:\n"], shortest=10) == [
        "def kept(n):\n    total = n + 1\n    if total > 2:\n        total -= 1\n    return total\n",
        "def nested_function(n, k):\n    if n:\n        return k\n    return n\n",
    ]


def test_target_from_refuses_another_shape_or_an_incomplete_folder(smoke_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(smoke_dir, other)
    history = json.loads((other / "training.json").read_text())
    history["sizes"]["hidden"] += 1
    (other / "training.json").write_text(json.dumps(history))
    (other / "dflash").rename(tmp_path / "dflash")  # not read: only the tokenizer, target and record are
    cmd = [sys.executable, "scripts/train_demo.py", "--smoke", "--threads", "1", "--out", str(tmp_path / "out")]
    refused = subprocess.run([*cmd, "--target-from", str(other)], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    hidden = demo_training.SMOKE.hidden
    assert f"hidden: {hidden + 1} there, {hidden} in this recipe" in refused.stderr
    (other / "target" / "model.safetensors").unlink()
    refused = subprocess.run([*cmd, "--target-from", str(other)], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "missing target/model.safetensors" in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def _command_line(tmp_path: Path, **changes) -> argparse.Namespace:
    """train_demo.py's parsed arguments: the full recipe's defaults, bf16 named, `changes` on top."""
    defaults = {"smoke": False, "threads": 2, "corpus": None, "dflash_layers": None, "precision": "bf16",
                "out": tmp_path / "demo", "work": None, "restart": False}
    return argparse.Namespace(**(defaults | changes))


def test_the_command_line_deepens_only_dflash_and_refuses_a_drafter_without_layers(tmp_path):
    """`--dflash-layers` (to measure whether a third layer pays, with --target-from) changes that one
    size of the recipe; a drafter of no layers is refused before anything trains."""
    sizes = train_demo.sizes_for(_command_line(tmp_path, dflash_layers=3))
    assert sizes.dflash_layers == 3
    assert dataclasses.replace(sizes, dflash_layers=demo_training.FULL.dflash_layers) == \
        dataclasses.replace(demo_training.FULL, threads=2)
    assert train_demo.sizes_for(_command_line(tmp_path, smoke=True, threads=1)) == \
        dataclasses.replace(demo_training.SMOKE, threads=1)
    with pytest.raises(ValueError, match="dflash_layers 0"):
        train_demo.sizes_for(_command_line(tmp_path, smoke=True, threads=1, dflash_layers=0))


def test_precision_auto_follows_the_cpu_for_a_new_run_and_the_run_for_a_resume(tmp_path, monkeypatch):
    """bf16 autocast only where the CPU multiplies bfloat16 natively (elsewhere torch emulates it,
    ~20x slower a DFlash step on an AVX2-only EPYC); a work folder keeps the precision it was begun
    in whatever CPU resumes it, unless --restart starts it over."""
    from common import cpu_linear

    work = tmp_path / "work"
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(cpu_linear, "native_cpu_bf16", lambda native=native: native)
        assert train_demo.sizes_for(_command_line(tmp_path, precision="auto", work=work)).precision == expected
        assert train_demo.sizes_for(_command_line(tmp_path, precision="fp32", work=work)).precision == "fp32"
    work.mkdir()
    (work / "run.json").write_text(json.dumps({"sizes": {"precision": "bf16"}}))  # begun on a CPU with bf16
    assert train_demo.sizes_for(_command_line(tmp_path, precision="auto", work=work)).precision == "bf16"
    assert train_demo.sizes_for(_command_line(tmp_path, precision="auto", work=work, restart=True)).precision == "fp32"
    (work / "run.json").write_text("{not json")
    assert train_demo.sizes_for(_command_line(tmp_path, precision="auto", work=work)).precision == "fp32"


def test_checkpoint_write_cut_short_leaves_the_last_one(tmp_path):
    path = tmp_path / "loop.pt"
    demo_resume.atomic_save({"step": 4, "weights": torch.arange(10.0)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cut short")

    with pytest.raises(RuntimeError, match="cut short"):
        demo_resume.atomic_save({"step": 8, "weights": torch.ones(10**6), "then": Unpicklable()}, path)
    saved = demo_resume.load_checkpoint(path)
    assert saved["step"] == 4 and torch.equal(saved["weights"], torch.arange(10.0))
    assert [p.name for p in tmp_path.iterdir()] == ["loop.pt"]


def test_held_out_modules_stay_out_of_training():
    train, held = demo_training.corpus_files()
    assert {p.stem for p in held} == set(demo_training.HELD_OUT)  # all of them exist in this interpreter
    root = demo_training.stdlib_dir()
    assert not [p for p in train if p.parent == root and p.stem in demo_training.HELD_OUT]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_package_corpus_keeps_held_out_modules_out():
    stdlib, held = demo_training.corpus_files()
    stdlib_digests = {_sha256(p) for p in (*stdlib, *held)}
    root = demo_training.site_packages_dir()
    files = demo_training.package_files(set(stdlib_digests))
    named = [p for p in root.rglob("*.py") if demo_training.names_a_held_out_module(p.relative_to(root))]
    assert named, "this venv has no package file named like a held-out module: the rule below is untested"
    assert not set(named) & set(files), "a package module named like a held-out one is in the corpus"
    digests = [_sha256(p) for p in files]
    assert len(set(digests)) == len(digests), "identical package files are in the corpus twice"
    assert not set(digests) & stdlib_digests, "a package file identical to a stdlib file is in the corpus"
    assert all(p.stat().st_size <= demo_training.MAX_FILE_BYTES for p in files)
    assert not [p for p in files if {"test", "tests"} & set(p.relative_to(root).parts[:-1])]
    assert demo_training.names_a_held_out_module(Path("pkg/statistics/__init__.py"))
    assert not demo_training.names_a_held_out_module(Path("pkg/heapqueue.py"))


def test_smoke_run_with_packages_records_its_sources(tmp_path):
    out = tmp_path / "demo"
    _train(out, "--corpus", "stdlib+packages")
    history = json.loads((out / "training.json").read_text())
    sources = {entry["name"]: entry for entry in history["corpus"]}
    assert set(sources) == {"stdlib", "site-packages"}
    assert sources["stdlib"]["window_share"] == history["sizes"]["stdlib_share"] == demo_training.PACKAGES_STDLIB_SHARE
    assert all(entry["files"] > 0 and entry["megabytes"] > 0 and entry["tokens"] > 0 for entry in sources.values())
    assert history["train_tokens"] == sources["stdlib"]["tokens"] + sources["site-packages"]["tokens"]
    distributions = sources["site-packages"]["distributions"]
    assert distributions and all(entry["files"] > 0 for entry in distributions.values())


def test_demo_files_fit_the_budget(demo_dir):
    total = sum(f.stat().st_size for f in demo_dir.rglob("*") if f.is_file())
    assert 0 < total <= MAX_BYTES, f"{total / 1e6:.1f} MB of demo files"


def test_full_recipe_fits_the_budget(smoke_dir):
    """FULL's three models in bf16 plus the smoke run's non-weight files (tokenizer copies, configs)."""
    from dflash.model import DFlashDraftModel
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    sizes = demo_training.FULL
    tokenizer = AutoTokenizer.from_pretrained(smoke_dir / "tokenizer")
    draft = demo_training.qwen3_config(sizes.vocab_size, tokenizer, hidden=sizes.draft_hidden,
                                       layers=sizes.draft_layers, intermediate=sizes.draft_intermediate,
                                       heads=sizes.draft_heads, kv_heads=sizes.draft_kv_heads,
                                       head_dim=sizes.draft_head_dim, max_positions=sizes.context)
    with torch.device("meta"):  # shapes only
        models = [Qwen3ForCausalLM(train_demo.target_config(sizes, tokenizer)),
                  DFlashDraftModel(demo_drafters.dflash_config(sizes, tokenizer)), Qwen3ForCausalLM(draft)]
    weights = 2 * sum(p.numel() for model in models for p in model.parameters())
    other = sum(f.stat().st_size for f in smoke_dir.rglob("*") if f.is_file() and f.suffix != ".safetensors")
    assert weights + other <= MAX_BYTES - 200_000, f"{weights / 1e6:.2f} MB of weights + {other / 1e6:.2f} MB"


def test_transformers_loads_target_and_tokenizer(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for folder in (demo_dir / "tokenizer", demo_dir / "target", demo_dir / "draft_model"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.mask_token == "<|mask|>"
    code = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    assert tokenizer.decode(tokenizer(code).input_ids) == code  # byte-level: lossless
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "target").eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer(code, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    dflash = json.loads((demo_dir / "dflash" / "config.json").read_text())
    assert dflash["architectures"] == ["DFlashDraftModel"]
    assert dflash["dflash_config"]["mask_token_id"] == tokenizer.mask_token_id


def test_dflash_generate_reproduces_target_greedy(demo_dir, monkeypatch):
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs

    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(demo_dir / "target", dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(demo_dir / "dflash", dtype=torch.float32).eval()
    assert drafter.block_size == 9 and max(drafter.target_layer_ids) < target.config.num_hidden_layers
    accepted = []
    for snippet in held_out_snippets(tokenizer, 2, 32):
        ids = tokenizer(snippet, return_tensors="pt").input_ids
        expected = demo_drafters.greedy_continue(target, ids, ids.shape[1] + NEW_TOKENS)
        stats = dflash_generate(drafter, target, ids, NEW_TOKENS, None, return_stats=True)
        assert stats.output_ids.tolist() == expected.tolist(), snippet
        accepted += stats.acceptance_lengths
    assert max(accepted) > 1, "the drafter never had a draft token accepted"


def test_the_preallocated_cache_decodes_what_transformers_own_cache_does(demo_dir, monkeypatch):
    """The continuations' cache writes in place instead of concatenating: the same tokens and
    the same hidden-state bits as transformers' DynamicCache, and a step past its room is refused."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    target = AutoModelForCausalLM.from_pretrained(demo_dir / "target", dtype=torch.float32).eval()
    prompts = torch.randint(10, target.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    layer_ids = [0, target.config.num_hidden_layers - 1]
    ids, features = demo_drafters.greedy_continue_with_features(target, prompts, 20, layer_ids)
    monkeypatch.setattr(demo_drafters, "preallocated_cache", lambda model, capacity: DynamicCache(config=model.config))
    expected_ids, expected_features = demo_drafters.greedy_continue_with_features(target, prompts, 20, layer_ids)
    assert torch.equal(ids, expected_ids) and torch.equal(features, expected_features)

    layer = demo_drafters.PreallocatedLayer(4)
    keys = torch.randn(2, 1, 3, 8)
    first_keys, _ = layer.update(keys, keys.clone())
    assert torch.equal(first_keys, keys) and layer.get_seq_length() == 3
    with pytest.raises(ValueError, match="holds 4 positions; this step would fill 5"):
        layer.update(keys[:, :, :2], keys[:, :, :2])
    with pytest.raises(ValueError, match="at least 1"):
        demo_drafters.PreallocatedLayer(0)
    with pytest.raises(NotImplementedError, match="no crop"):
        layer.crop(1)
    layer.reset()  # empty again: the next update starts at position 0
    assert layer.get_seq_length() == 0
    assert torch.equal(layer.update(keys[:, :, :1], keys[:, :, :1])[0], keys[:, :, :1]) and layer.get_seq_length() == 1


# ---------------------------------------------------------------------------------------
# `splitspec up`


class Up:
    """`python -m splitspec.cli up ...` with its output in a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "splitspec.cli", "up", *args], cwd=REPO_ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, env={**_env(), "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> str:
        return wait_for_line(self.proc, self.log_path, READY, timeout)[1]

    def interrupt(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"splitspec up did not stop within {timeout} s:\n{self.log()}")


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("SPLITSPEC_INTERNAL_TOKEN", None)  # `up` generates one
    return env


def _greedy(address: str, prompt: str, disable: bool) -> tuple[list[int], pb.Complete]:
    request = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                                 speculation=pb.SpeculationParams(disable=disable))
    return stream_tokens(address, request, timeout=300)


def _serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False


def test_up_dflash_end_to_end_is_lossless(demo_dir, tmp_path):
    from transformers import AutoTokenizer

    port, draft_port, gateway_port = free_port(), free_port(), free_port()
    up = Up(["--drafter", "dflash", "--models", str(demo_dir), "--port", str(port), "--draft-port", str(draft_port),
             "--gateway-port", str(gateway_port), "--shm-dir", str(tmp_path), "--max-num-seqs", "4",
             # Every step drafts, so every step is checked. The adaptive default may rightly draft nothing on
             # these prompts: after the curl's fibonacci it learnt p1 0.43, p2 0.13, and one CI run saw 0 drafts.
             "--speculative-policy", "fixed"],
            tmp_path / "up.log")
    try:
        address = up.wait_ready()
        assert address == f"127.0.0.1:{port}"
        bin_dir = re.escape(os.path.relpath(Path(sys.executable).parent / "splitspec", REPO_ROOT))
        assert re.search(bin_dir + r" generate --target 127\.0\.0\.1:\d+ ", up.log())  # works when pasted
        _check_printed_curl(up.log(), gateway_port)
        tokenizer = AutoTokenizer.from_pretrained(demo_dir / "target")
        prompts = ["def fibonacci(n):", *held_out_snippets(tokenizer, 2, 48)]
        drafted = 0
        for prompt in prompts:
            plain, plain_done = _greedy(address, prompt, disable=True)
            spec, spec_done = _greedy(address, prompt, disable=False)
            assert spec == plain, f"speculation changed the greedy output for {prompt!r}"
            assert plain_done.usage.num_drafts == 0
            assert spec_done.usage.accepted_tokens <= spec_done.usage.draft_tokens
            drafted += spec_done.usage.num_drafts
        assert drafted > 0, f"nothing was speculated:\n{up.log()}"
        assert "[target] " in up.log() and "[draft] " in up.log()  # both logs are streamed
    finally:
        code = up.interrupt()
    assert code == 0, up.log()
    assert all(f"{name} stopped" in up.log() for name in ("gateway", "target", "draft"))
    assert not _serving(f"127.0.0.1:{port}") and not _serving(f"127.0.0.1:{draft_port}")
    assert not list(tmp_path.glob("splitspec*")), "the target left its shared-memory pool file behind"


def _check_printed_curl(log: str, gateway_port: int) -> None:
    """Run the curl command `splitspec up` printed (as pasted into a shell): an OpenAI completion."""
    line = next(line for line in log.splitlines() if line.strip().startswith("curl "))
    assert f"http://127.0.0.1:{gateway_port}/v1/completions" in line
    run = subprocess.run(["bash", "-c", line.strip()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    reply = json.loads(run.stdout)
    assert reply["model"] == "splitspec-demo" and reply["usage"]["completion_tokens"] > 0, reply


def test_up_explains_missing_models(tmp_path):
    run = subprocess.run([sys.executable, "-m", "splitspec.cli", "up", "--models", str(tmp_path / "none")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "train_demo.py" in run.stdout


def test_eval_demo_measures_through_a_real_stack(tmp_path):
    """scripts/eval_demo.py brings the stack up with `splitspec up`'s own arguments (it once
    built them by hand and broke when `up` gained a flag): a draft model that is the target
    drafts and is accepted, and the row adds up. (Not every draft: `up` runs drafters in
    bfloat16 on a CPU that has it, the target in float32.)"""

    import eval_demo

    from tests.tiny_models import make_pair

    models = tmp_path / "models"
    make_pair(models, draft_name="draft_model")
    row = eval_demo.measure(models, "draft_model", ["def f(x):\n    return", "class A:\n"], 9, 4, 2)
    assert row.requests == 2 and row.completion_tokens == 2 * 9
    assert row.num_drafts > 0 and 0 < row.accepted <= row.drafted <= row.num_drafts * 4
    assert row.acceptance_length == pytest.approx((2 * 8) / max(1, 2 * 8 - row.accepted))


def test_temp_files_kept_in_a_relative_work_folder_are_named_absolutely(tmp_path, monkeypatch):
    """`--work .train/work`: Inductor compiles in folders of its own, where a relative temp dir names nothing."""
    import tempfile

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    demo_training.keep_temp_files_in(Path("work") / "tmp")
    assert tempfile.tempdir == str(tmp_path / "work" / "tmp") and Path(tempfile.tempdir).is_dir()
