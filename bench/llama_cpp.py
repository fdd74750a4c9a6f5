"""llama.cpp on the demo target beside splitspec's target-only row, in one run.

What a CPU user would run instead of us: llama.cpp (as bundled in llama-cpp-python, built
for this CPU by `scripts/setup_llama_cpp.sh`), on the demo target converted by llama.cpp's
own `convert_hf_to_gguf.py` to F32 and BF16. Both engines decode the same held-out prompts
greedily (token ids from the demo tokenizer, no BOS), `--new-tokens` each, keeping
`--concurrency` sequences in flight: llama.cpp through its batch API (one `llama_decode` per
step over every sequence in flight, a finished sequence's slot refilled with the next prompt),
splitspec through the engine as `bench/compare.py` drives it, with the same threads. The rows
take turns; each figure is the median of `--repeat` runs. The outputs are compared token for
token (llama.cpp F32 against splitspec float32, BF16 against splitspec's bfloat16 default where
that is the default). Usage:
  scripts/setup_llama_cpp.sh && .venv/bin/python bench/llama_cpp.py [--concurrency 1,8] [--repeat 3]

The demo tokenizer's pre-tokenizer hash is unknown to the converter; it is a GPT-2-style
byte-level BPE, and the conversion maps it to llama.cpp's `gpt-2` pre-tokenizer.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.compare import engine_config, forward_description, load_held_out, run_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from common.cpu_info import read_cpu_info  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402

CONVERT = """
import sys
converter, packages = sys.argv[1], sys.argv[2]
sys.path[:0] = [converter, converter + "/gguf-py", packages]
import conversion.base as base
owner = next(c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c))
known = owner.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # the demo tokenizer: GPT-2-style byte-level BPE
        return "gpt-2"
owner.get_vocab_base_pre = pre_tokenizer
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert(target: Path, llama_cpp: Path, outtype: str, out_dir: Path) -> Path:
    """The target as GGUF of `outtype` (f32 | bf16), by llama.cpp's converter in its own process."""
    out = out_dir / f"target-{outtype}.gguf"
    done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp / "converter"), str(llama_cpp / "python"),
                           str(target), "--outfile", str(out),
                           "--outtype", outtype], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{done.stderr[-2000:]}")
    return out


@dataclass
class Slot:
    """One sequence in flight in llama.cpp's batch: its prompt's index, tokens and next position."""

    index: int
    pending: list[int]  # tokens not yet decoded (the prompt, then each new token)
    position: int = 0
    generated: int = 0


class LlamaCpp:
    """Greedy batched decoding through llama.cpp's C API (llama-cpp-python's ctypes bindings)."""

    def __init__(self, lib, gguf: Path, threads: int, max_sequences: int, context_per_sequence: int) -> None:
        self.lib = lib
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx = max_sequences * context_per_sequence
        params.n_batch = params.n_ubatch = max(512, max_sequences * context_per_sequence)
        params.n_seq_max = max_sequences
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.max_sequences = max_sequences
        self.batch = lib.llama_batch_init(params.n_batch, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], new_tokens: int, concurrency: int
                 ) -> tuple[dict[int, list[int]], float]:
        """({prompt index: generated ids}, seconds), `concurrency` sequences in flight."""
        lib, memory = self.lib, self.lib.llama_get_memory(self.ctx)
        lib.llama_memory_clear(memory, True)
        waiting = list(enumerate(prompts))
        slots: dict[int, Slot] = {}
        outputs: dict[int, list[int]] = {}
        start = time.perf_counter()
        while waiting or slots:
            for seq in range(min(concurrency, self.max_sequences)):
                if seq not in slots and waiting:
                    index, ids = waiting.pop(0)
                    lib.llama_memory_seq_rm(memory, seq, -1, -1)
                    slots[seq] = Slot(index, list(ids))
            last_rows = self._fill_batch(slots)
            if lib.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            for seq, row in last_rows.items():
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, row), shape=(self.vocab,))
                token = int(logits.argmax())
                slot = slots[seq]
                outputs.setdefault(slot.index, []).append(token)
                slot.generated += 1
                slot.pending = [token]
                if slot.generated == new_tokens:
                    del slots[seq]
        return outputs, time.perf_counter() - start

    def _fill_batch(self, slots: dict[int, Slot]) -> dict[int, int]:
        """Every slot's pending tokens into the batch; {sequence: its last row (logits asked)}."""
        batch, row, last_rows = self.batch, 0, {}
        for seq, slot in slots.items():
            for i, token in enumerate(slot.pending):
                batch.token[row], batch.pos[row] = token, slot.position + i
                batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq
                batch.logits[row] = i == len(slot.pending) - 1
                row += 1
            slot.position += len(slot.pending)
            last_rows[seq] = row - 1
        batch.n_tokens = row
        return last_rows


def splitspec_row(models: Path, prompts: list[list[int]], new_tokens: int, concurrency: int, repeat: int,
                  shm_dir: str, compile_steps: bool,
                  dtype: str | None = None) -> tuple[str, str, float, dict[int, list[int]]]:
    """(its dtype, how it computes, tokens/s, outputs) of splitspec target-only with its defaults
    (bench/compare.py's row 4), or in `dtype`."""
    config = engine_config(models, shm_dir, k=8, compile_steps=compile_steps)
    core = build_engine_core(config if dtype is None else dataclasses.replace(config, dtype=dtype))
    try:
        core.warmup()
        described = forward_description(core)
        outputs: dict[int, list[int]] = {}
        rates = []
        for _ in range(repeat):
            outputs = {}
            tokens, seconds, *_ = run_engine(core, prompts, new_tokens, concurrency, speculate=False, outputs=outputs)
            rates.append(tokens / seconds)
        return core.model_info.dtype, described, statistics.median(rates), outputs
    finally:
        core.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, default=REPO / ".llama-cpp",
                        help="what scripts/setup_llama_cpp.sh built (python/ and converter/)")
    parser.add_argument("--models", type=Path, default=REPO / "demo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="threads for both engines (default: torch's)")
    parser.add_argument("--types", default="f32,bf16", help="GGUF types to convert the target to")
    parser.add_argument("--compile", action="store_true", help="a row of splitspec with --compile too")
    args = parser.parse_args(argv)
    if not (args.llama_cpp / "python" / "llama_cpp").is_dir():
        print(f"no llama.cpp in {args.llama_cpp}: run scripts/setup_llama_cpp.sh first", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    sys.path.insert(0, str(args.llama_cpp / "python"))
    lib = importlib.import_module("llama_cpp.llama_cpp")
    quiet = lib.llama_log_callback(lambda level, text, user_data: None)  # held: llama.cpp keeps the pointer
    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    _, prompts = load_held_out(args.models, args.prompts)
    levels = [int(c) for c in args.concurrency.split(",")]
    context = max(len(p) for p in prompts) + args.new_tokens + 16
    rows: list[tuple[str, int, float]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        ggufs = {t: convert(args.models / "target", args.llama_cpp, t, Path(tmp))
                 for t in args.types.split(",")}
        for concurrency in levels:
            default_dtype, described, ours, default_outputs = splitspec_row(
                args.models, prompts, args.new_tokens, concurrency, args.repeat, tmp, False)
            rows.append((f"splitspec target only (defaults: {described})", concurrency, ours))
            outputs_by_dtype = {default_dtype: default_outputs}
            if default_dtype != "float32" or args.compile:
                _, described, rate, outputs_by_dtype["float32"] = splitspec_row(
                    args.models, prompts, args.new_tokens, concurrency, args.repeat, tmp, args.compile, "float32")
                rows.append((f"splitspec target only ({described})", concurrency, rate))
            for outtype, gguf in ggufs.items():
                engine = LlamaCpp(lib, gguf, threads, concurrency, context)
                try:
                    engine.generate(prompts[:1], 4, 1)  # warm up
                    runs = [engine.generate(prompts, args.new_tokens, concurrency) for _ in range(args.repeat)]
                finally:
                    engine.close()
                rate = statistics.median(sum(map(len, out.values())) / seconds for out, seconds in runs)
                rows.append((f"llama.cpp {outtype.upper()}", concurrency, rate))
                ours_dtype = {"f32": "float32", "bf16": "bfloat16"}.get(outtype)
                if ours_dtype in outputs_by_dtype:  # the same dtype on both sides: compared token for token
                    splitspec_outputs = outputs_by_dtype[ours_dtype]
                    same = sum(runs[0][0][i] == splitspec_outputs[i] for i in splitspec_outputs)
                    notes.append(f"concurrency {concurrency}: llama.cpp {outtype.upper()} and splitspec {ours_dtype} "
                                 f"greedy outputs identical for {same}/{len(splitspec_outputs)} prompts")
    print(f"Measured on {read_cpu_info().describe()}, torch {torch.__version__}, {threads} threads for both "
          f"engines; demo target, {args.prompts} held-out prompts, {args.new_tokens} new tokens each, greedy; "
          f"median of {args.repeat} runs.\n")
    print("| engine | concurrency | tok/s | splitspec / this |\n|---|---:|---:|---:|")
    ours_at = {c: rate for name, c, rate in rows if name.startswith("splitspec target only (defaults")}
    for name, concurrency, rate in rows:
        print(f"| {name} | {concurrency} | {rate:.1f} | {ours_at[concurrency] / rate:.2f} |")
    print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
