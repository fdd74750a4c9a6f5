"""What the stages of the demo training share: the corpus (with the held-out modules kept
out), the run sizes and seed, and the training-step helpers.

scripts/train_demo.py runs the stages (with demo_drafters.py and demo_resume.py);
scripts/eval_demo.py and tests/test_demo.py read the corpus rules from here.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Top-level stdlib modules never trained on: the held-out set of scripts/eval_demo.py.
from splitspec.heldout import HELD_OUT  # (one list for training, eval and bench)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "demo"

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
                 "__pycache__"}
MAX_FILE_BYTES = 300_000  # generated tables and data blobs are not code worth learning
CORPORA = ("stdlib", "stdlib+packages")  # what the LMs train on; the tokenizer always learns the stdlib alone
PACKAGES_STDLIB_SHARE = 0.2  # with the packages: the share of training windows still cut from the stdlib
PRECISIONS = ("bf16", "fp32")  # bf16: autocast forward, fp32 weights and optimizer
ADAMW_IMPLS = ("for-loop", "foreach", "fused")  # torch.optim.AdamW's implementations (same math)
ADAMW_IMPL = "foreach"  # the three are within 2% of each other here (bench/train_steps.py)


@dataclass
class Sizes:
    """Every size, step count and data choice of one run (the full run or the smoke run)."""

    vocab_size: int
    # target
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    target_steps: int
    target_batch: int
    target_lr: float
    # greedy continuations of the target (training data of both drafters)
    gen_prompt_lens: tuple[int, ...]
    gen_prompts_per_len: int
    gen_total_len: int
    gen_batch: int
    # dflash
    dflash_layers: int
    dflash_intermediate: int
    dflash_heads: int
    dflash_kv_heads: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    dflash_steps: int
    dflash_batch: int
    dflash_anchors: int
    dflash_lr: float
    # draft_model
    draft_hidden: int
    draft_layers: int
    draft_intermediate: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_pretrain_steps: int
    draft_distill_steps: int
    draft_batch: int
    draft_distill_batch: int
    draft_lr: float
    # the target's anneal (0 steps: none): windows of whole top-level-style functions, each beginning
    # at a `def` as a user's prompt does, mixed with corpus windows, at a low learning rate
    anneal_steps: int = 0
    anneal_batch: int = 8
    anneal_length: int = 512  # tokens a window
    anneal_lr: float = 3e-4
    anneal_function_share: float = 0.5
    dflash_loss_gamma: float = 4.0  # block position k (1-based) weighs exp(-(k - 1) / gamma)
    corpus: str = "stdlib"  # one of CORPORA
    stdlib_share: float = 1.0  # with packages: the share of training windows cut from the stdlib
    precision: str = "bf16"  # one of PRECISIONS, for every training step
    heldout_evals: int = 1  # held-out perplexity of the target this many times during its training (0: never)
    max_files: int | None = None  # smoke: train on the first stdlib files only
    threads: int = 2  # not part of what the run is: a resumed run may use other threads

    def __post_init__(self) -> None:
        self.gen_prompt_lens = tuple(self.gen_prompt_lens)
        self.target_layer_ids = tuple(self.target_layer_ids)
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {CORPORA}, not {self.corpus!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")
        if not 0.0 < self.stdlib_share <= 1.0:
            raise ValueError(f"stdlib_share must be in (0, 1], not {self.stdlib_share}")
        if self.corpus == "stdlib" and self.stdlib_share != 1.0:
            raise ValueError("stdlib_share < 1 needs corpus 'stdlib+packages'")
        if not self.target_layer_ids or max(self.target_layer_ids) >= self.layers or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must name layers of the {self.layers}")
        if max(self.gen_prompt_lens) >= self.gen_total_len or self.gen_total_len > self.context:
            raise ValueError("prompts must be shorter than gen_total_len, and gen_total_len fit the context")
        if self.anneal_steps < 0 or self.anneal_batch < 1 or self.anneal_lr <= 0 or not (
                0.0 <= self.anneal_function_share <= 1.0) or not 2 <= self.anneal_length <= self.context:
            raise ValueError("anneal_steps must be ≥ 0, anneal_batch ≥ 1, anneal_lr > 0, anneal_function_share "
                             "in [0, 1] and anneal_length in [2, context]")
        if self.threads < 1 or self.dflash_loss_gamma <= 0 or self.heldout_evals < 0:
            raise ValueError("threads must be ≥ 1, dflash_loss_gamma > 0 and heldout_evals ≥ 0")
        if self.dflash_layers < 1 or self.draft_layers < 1:
            raise ValueError(f"the drafters need a layer at least, got dflash_layers {self.dflash_layers} and "
                             f"draft_layers {self.draft_layers}")
        for heads, kv_heads in ((self.heads, self.kv_heads), (self.dflash_heads, self.dflash_kv_heads),
                                (self.draft_heads, self.draft_kv_heads)):
            if heads % kv_heads:
                raise ValueError(f"{heads} attention heads do not share {kv_heads} key/value heads evenly")


# The recipe, from scripts/scaling_probe.py (its report: docs/scaling_probe.json). At the probe's
# compute (~1.6e14 FLOPs) the smaller shape won (256x6, 5.5M multiplied weights: held-out
# perplexity 73 against 107 for 384x6, 10.4M), so the compute-optimal size there is at most ~5.5M; it grows as C^0.5 (Hoffmann et al. 2022), and this run spends ~28 times the probe's
# compute, which bounds its optimum by ~29M. The size budget of what travels to a GPU machine (64 MiB,
# tests/gpu/prepare.sh) caps the target near 10M in bf16, so the target keeps its 384x6 shape (10.4M
# parameters, 20.9 MB) and the compute goes to tokens: 7,500 steps x 4 x 2,048 = 61M tokens, about
# one pass over the corpus (5x the previous target's), in 2,048-token windows so that the target
# serves 2,048-token contexts. The draft model's distillation steps grow with its data (3 passes
# over the 30,720 continuations); its pretraining keeps 4,096 tokens a step (2 windows of 2,048).
# bench/train_steps.py's figures on 2 idle cores (Intel Xeon with AMX): target ~4,600 tokens/s at
# 2,048 (~3.7 h); the continuations, DFlash and the draft model ~3 h more. Resumable.
# The anneal (300 steps of 8 x 512 tokens, half of them windows that begin at a function's `def`)
# came from a probe on the third pair's target (AMD EPYC, 2 cores, 2026-12-03; 8 x 512-token windows a
# step, functions from 6,000 of the files). The same steps over 2 x 2,048-token windows (the same
# tokens a step, every file's functions) left `def factorial(n):` with a runaway expression at 64
# tokens (2 of the 3 prompts parsed; held-out perplexity 11.67 over 2,048-token windows). Before it, `def is_prime(n):` got a body indented 8 spaces, as a method's (most `def`s of the
# corpus are methods'); after 100 steps at 5e-4 all three code prompts of scripts/eval_demo.py wrote a
# 4-space body with an if and a return, and parsed. With one-line functions kept, greedy decoding
# answered every `def` with one runaway nested call; with docstrings kept, with a docstring that
# did not end within 64 tokens. Held-out perplexity over 512-token windows went 14.21 → 14.75 in 300
# steps (all three prompts still parsing).
# The drafters' data and steps are twice the third pair's (61,440 continuations, 32,000 DFlash
# steps, 8,000 + 12,000 draft-model steps): held out, that pair's DFlash accepted 4.66 drafts per
# teacher-forced block against 5.68 on its own continuations, a generalization gap that more of
# the target's continuations close (docs/performance.md#what-limits-its-acceptance).
FULL = Sizes(
    vocab_size=4096, hidden=384, layers=6, intermediate=896, heads=6, kv_heads=3, head_dim=64, context=2048,
    target_steps=7_500, target_batch=4, target_lr=2e-3,
    gen_prompt_lens=(8, 16, 32, 48, 64, 96, 128, 160), gen_prompts_per_len=7680, gen_total_len=288, gen_batch=192,
    dflash_layers=2, dflash_intermediate=448, dflash_heads=6, dflash_kv_heads=3, target_layer_ids=(1, 3, 5),
    block_size=9, dflash_steps=32_000, dflash_batch=8, dflash_anchors=16, dflash_lr=1.5e-3,
    draft_hidden=192, draft_layers=2, draft_intermediate=448, draft_heads=3, draft_kv_heads=1, draft_head_dim=64,
    draft_pretrain_steps=8000, draft_distill_steps=12_000, draft_batch=2, draft_distill_batch=16,
    draft_lr=2e-3, corpus="stdlib+packages", stdlib_share=PACKAGES_STDLIB_SHARE, heldout_evals=10,
    anneal_steps=300, anneal_batch=8, anneal_length=512, anneal_lr=5e-4, anneal_function_share=0.5,
)
SMOKE = Sizes(
    vocab_size=320, hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16, context=128,
    target_steps=30, target_batch=4, target_lr=3e-3,
    gen_prompt_lens=(8, 16), gen_prompts_per_len=8, gen_total_len=48, gen_batch=4,
    dflash_layers=1, dflash_intermediate=128, dflash_heads=4, dflash_kv_heads=2, target_layer_ids=(0, 1),
    block_size=9, dflash_steps=20, dflash_batch=4, dflash_anchors=4, dflash_lr=3e-3,
    draft_hidden=32, draft_layers=1, draft_intermediate=64, draft_heads=2, draft_kv_heads=1, draft_head_dim=16,
    draft_pretrain_steps=10, draft_distill_steps=10, draft_batch=4, draft_distill_batch=4, draft_lr=3e-3,
    anneal_steps=8, anneal_batch=4, anneal_length=64, max_files=40,
)
SEED = 1234


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------
# Corpus


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_dir() -> Path:
    """The running interpreter's (the venv's) site-packages."""
    return Path(sysconfig.get_paths()["purelib"])


def _is_excluded(relative: Path) -> bool:
    return any(part in EXCLUDED_DIRS for part in relative.parts[:-1])


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the running interpreter's standard library."""
    root = stdlib_dir()
    held_names = {f"{name}.py" for name in HELD_OUT}
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _is_excluded(relative) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        (held if len(relative.parts) == 1 and relative.name in held_names else train).append(path)
    return train, held


def names_a_held_out_module(relative: Path) -> bool:
    """Whether any module or package on the file's import path is named like a held-out module
    (`x/heapq.py`, `x/statistics/__init__.py`, `x/calendar/util.py`)."""
    return any(part in HELD_OUT for part in (*relative.parts[:-1], relative.stem))


def package_files(seen: set[str]) -> list[Path]:
    """The venv's site-packages `.py` files by the stdlib's rules (no tests, ≤ MAX_FILE_BYTES), none
    named like a held-out module, none whose bytes equal a file in `seen` (sha256 digests: the stdlib's
    files, held-out ones included) or an earlier package file; `seen` grows with the files taken."""
    root = site_packages_dir()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _is_excluded(relative) or names_a_held_out_module(relative) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            files.append(path)
    return files


def held_out_files() -> list[Path]:
    """The held-out modules in HELD_OUT order (scripts/eval_demo.py reads these)."""
    by_name = {p.stem: p for p in corpus_files()[1]}
    return [by_name[name] for name in HELD_OUT if name in by_name]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass
class Source:
    """One part of the training text: the stdlib, or the venv's packages."""

    name: str
    root: Path
    files: list[Path]
    texts: list[str] = field(repr=False)

    @property
    def megabytes(self) -> float:
        return sum(len(t.encode("utf-8")) for t in self.texts) / 1e6

    def digest(self) -> str:
        """sha256 of the file names (relative to the root) and texts, in order."""
        h = hashlib.sha256()
        for path, text in zip(self.files, self.texts):
            h.update(str(path.relative_to(self.root)).encode() + b"\0" + text.encode("utf-8") + b"\0")
        return h.hexdigest()

    def distributions(self) -> dict[str, dict]:
        """{distribution: {version, files, megabytes}} of the packages the files come from."""
        from importlib import metadata

        owners = metadata.packages_distributions()
        counts: dict[str, dict] = {}
        for path, text in zip(self.files, self.texts):
            top = path.relative_to(self.root).parts[0].removesuffix(".py")
            for dist in sorted(set(owners.get(top, [f"({top})"]))):
                entry = counts.setdefault(dist, {"files": 0, "megabytes": 0.0})
                entry["files"] += 1
                entry["megabytes"] += len(text.encode("utf-8")) / 1e6
        for dist, entry in counts.items():
            entry["megabytes"] = round(entry["megabytes"], 3)
            try:
                entry["version"] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                entry["version"] = None
        return dict(sorted(counts.items()))


def load_corpus(corpus: str, max_files: int | None = None) -> tuple[list[Source], list[Path]]:
    """([stdlib, packages if asked], held-out files), deduplicated by content across both."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}")
    train, held = corpus_files()
    if max_files is not None:
        train = train[:max_files]
    sources = [Source("stdlib", stdlib_dir(), train, [read_text(p) for p in train])]
    if corpus == "stdlib+packages":
        seen = {hashlib.sha256(p.read_bytes()).hexdigest() for p in (*corpus_files()[0], *held)}
        files = package_files(seen)
        if max_files is not None:
            files = files[:max_files]
        sources.append(Source("site-packages", site_packages_dir(), files, [read_text(p) for p in files]))
    return sources, held


# ---------------------------------------------------------------------------------------
# Tokenizer


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All files as one stream of ids, each file followed by EOS."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def whole_functions(texts: list[str], shortest: int = 60, longest: int = 1200, widest: int = 79) -> list[str]:
    """The functions a prompt such as `def is_prime(n):` asks for, in file order: every undecorated
    `def` of `texts` that is not a method (its first argument is not self or cls), returns a value
    and has some control flow (an if, for, while or try among its statements; one-line bodies teach a
    small model to answer any `def` with one runaway expression), dedented to column 0 and without its
    docstring (a bare `def` line is then followed by code, not by the corpus's long docstrings):
    `shortest`..`longest` characters, no line wider than `widest`."""
    import ast
    import textwrap

    found = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.end_lineno is None:
                continue
            first = node.args.posonlyargs + node.args.args
            if first and first[0].arg in ("self", "cls"):
                continue
            if not any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node)):
                continue
            if not any(isinstance(n, (ast.If, ast.For, ast.While, ast.Try)) for n in node.body):
                continue
            body = node.body
            docstring = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                         and isinstance(body[0].value.value, str))
            if docstring and (len(body) == 1 or body[0].lineno == node.lineno or body[0].end_lineno >= body[1].lineno):
                continue  # nothing but a docstring, or code on its last line
            kept = lines[node.lineno - 1:body[0].lineno - 1] + lines[body[0].end_lineno:node.end_lineno] \
                if docstring else lines[node.lineno - 1:node.end_lineno]
            source = textwrap.dedent("".join(kept))
            if (shortest <= len(source) <= longest and source.startswith("def ")
                    and max(len(line) for line in source.splitlines()) <= widest):
                found.append(source)
    return found


def aligned_windows(stream: torch.Tensor, starts: torch.Tensor, batch: int, length: int,
                    generator: torch.Generator) -> torch.Tensor:
    """[B, length] windows of `stream` that each begin at one of `starts` (< numel - length)."""
    picks = starts[torch.randint(0, starts.numel(), (batch,), generator=generator)]
    return torch.stack([stream[s:s + length] for s in picks.tolist()])


def random_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])  # [B, length]


def mixed_windows(streams: list[torch.Tensor], shares: list[float], batch: int, length: int,
                  generator: torch.Generator) -> torch.Tensor:
    """[B, length] windows, each from stream i with probability shares[i]."""
    if len(streams) == 1:
        return random_windows(streams[0], batch, length, generator)
    bounds = torch.tensor(shares, dtype=torch.float64).cumsum(0)[:-1]
    picks = torch.searchsorted(bounds, torch.rand(batch, dtype=torch.float64, generator=generator), right=True)
    rows = []
    for i in picks.tolist():
        start = int(torch.randint(0, streams[i].numel() - length, (1,), generator=generator))
        rows.append(streams[i][start:start + length])
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------
# Training steps


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_steps(total: int) -> int:
    """Linear warmup: 50 steps, 2% of a long run, 10% of a short one."""
    return max(1, min(total // 10, max(50, total // 50)))


def make_optimizer(params, lr: float, impl: str = ADAMW_IMPL) -> torch.optim.Optimizer:
    if impl not in ADAMW_IMPLS:
        raise ValueError(f"AdamW implementation must be one of {ADAMW_IMPLS}")
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=impl == "foreach",
                             fused=True if impl == "fused" else None)


def optimizer_step(opt: torch.optim.Optimizer, params, loss: torch.Tensor, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in params if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class StepOptions:
    """How a training step computes: autocast precision and torch.compile (bench/train_steps.py)."""

    precision: str = "bf16"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}")

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def wrap(self, model: torch.nn.Module) -> Callable:
        """The callable that runs `model`: compiled or not, it shares `model`'s parameters (one static
        graph per input shape: a loop has one or two)."""
        return torch.compile(model, dynamic=False) if self.compile else model


def keep_temp_files_in(folder: Path) -> None:
    """Point this process's temporary files at `folder`: torch.compile's kernel cache and its ~150 MB of
    precompiled headers (which ignore TORCHINDUCTOR_CACHE_DIR) then stay with the run instead of /tmp."""
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(folder.resolve())  # absolute: Inductor's compiler runs in folders of its own


def lm_forward(model, options: StepOptions) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(ids [B, T], labels [B, T] with -100 where ignored) → the mean next-token loss."""
    forward = options.wrap(model)

    def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with options.autocast():
            return forward(input_ids=ids, labels=labels).loss

    return loss_of


@torch.no_grad()
def perplexity(model, documents: list[list[int]], window: int) -> tuple[float, int]:
    """(perplexity, tokens scored) of a causal LM over `documents` (token ids, each ending in EOS), cut
    into non-overlapping windows of `window` tokens; the figure of scripts/eval_demo.py."""
    total_nll, total_tokens = 0.0, 0
    for ids in documents:
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start:start + window + 1])[None]
            if chunk.shape[1] < 2:
                continue
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            total_nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            total_tokens += chunk.shape[1] - 1
    return math.exp(total_nll / total_tokens), total_tokens


def heldout_documents(tokenizer) -> list[list[int]]:
    """The held-out modules as token ids, each followed by EOS."""
    return [tokenizer(read_text(path)).input_ids + [tokenizer.eos_token_id] for path in held_out_files()]


def qwen3_config(sizes_vocab: int, tokenizer, *, hidden, layers, intermediate, heads, kv_heads, head_dim,
                 max_positions):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=sizes_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


def save_lm(model, tokenizer, out_dir: Path) -> None:
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
