"""One DFlash `Propose` forward, eager against compiled, on the demo drafter, in one process.

What the drafter process does per drafting step at concurrency 1: the rows the target
accepted since the last step (context K/V written in the same call) and one block of
`[last token, mask x K]`, then the K draft tokens. Both variants run over the same pages,
taking turns call by call, so that load from other processes falls on both alike; the
table gives the least and the median of each. Usage:
  .venv/bin/python bench/dflash_step.py [--models demo] [--calls 200] [--new-rows 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.pools import pool_folder  # noqa: E402
from common.attention_backends import select_backend  # noqa: E402
from common.attention_metadata import AttentionMetadata, slot_of  # noqa: E402
from common.cpu_info import read_cpu_info  # noqa: E402
from common.kv_layout import CacheConfig, build_layout  # noqa: E402
from common.kv_pool import PagePool  # noqa: E402
from draft_service.dflash_model import NewContext  # noqa: E402
from draft_service.drafters import cpu_drafter_dtype  # noqa: E402
from draft_service.drafters.dflash import DFlashDrafter  # noqa: E402

PAGE_SIZE = 16
PROMPT = 96  # context rows written before the timed calls


def load(models: Path, compile_steps: bool) -> DFlashDrafter:
    return DFlashDrafter.load(str(models / "dflash"), str(models / "target"), CacheConfig(), cpu_drafter_dtype(),
                              "cpu", None, compile=compile_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=REPO / "demo")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--new-rows", type=int, default=3, help="context rows each call writes (accepted + 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the drafter process's default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    drafters = {"eager": load(args.models, False), "compiled": load(args.models, True)}
    model = drafters["eager"].model
    k, width = model.num_speculative_tokens, model.feature_width
    total = PROMPT + args.calls * args.new_rows + k + 2
    num_pages = -(-total // PAGE_SIZE)
    layout = build_layout(order="NHD", page_size=PAGE_SIZE, kv_dtype=str(model.dtype).removeprefix("torch."),
                          num_pages=num_pages, layers=model.kv_layer_specs())
    backend_cls = select_backend("auto", torch.device("cpu"), kv_dtype=layout.torch_dtype)  # as the drafter
    started = time.perf_counter()
    drafters["compiled"].model.prepare_compiled([k + 1], [args.new_rows])
    print(f"compiled the block and context buckets in {time.perf_counter() - started:.1f} s")
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(total, width, generator=generator).to(model.dtype)  # [total, width]
    table = list(range(num_pages))
    seconds: dict[str, list[float]] = {name: [] for name in drafters}
    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        pools = {}
        for name in drafters:  # one pool file per folder
            Path(tmp, name).mkdir()
            pools[name] = PagePool.create(layout, torch.device("cpu"), shm_dir=Path(tmp, name))
        try:
            for name, drafter in drafters.items():
                backend, caches = backend_cls(layout), pools[name].kv_caches("draft")
                meta = AttentionMetadata.build(query_lens=[PROMPT], seq_lens=[PROMPT], page_tables=[table],
                                               page_size=PAGE_SIZE, device=torch.device("cpu"))
                drafter.model.write_context(features[:PROMPT], torch.arange(PROMPT), meta, caches, backend)
            backends = {name: backend_cls(layout) for name in drafters}
            for call in range(args.calls):
                start, end = PROMPT + call * args.new_rows, PROMPT + (call + 1) * args.new_rows
                new = NewContext(features[start:end], torch.arange(start, end),
                                 torch.tensor([slot_of(table, p, PAGE_SIZE) for p in range(start, end)]))
                for name, drafter in drafters.items():
                    began = time.perf_counter()
                    drafter.model.propose(torch.tensor([7]), [end], [table], pools[name].kv_caches("draft"),
                                          backends[name], new_context=new)
                    seconds[name].append(time.perf_counter() - began)
        finally:
            for pool in pools.values():
                pool.close()
    print(f"{read_cpu_info().describe()}; torch {torch.__version__}, {args.threads} thread(s), {model.dtype}; "
          f"a block of {k} drafts with {args.new_rows} new context rows, {args.calls} calls each")
    print("| forward | least ms | median ms |\n|---|---:|---:|")
    for name, values in seconds.items():
        print(f"| {name} | {min(values) * 1e3:.3f} | {statistics.median(values) * 1e3:.3f} |")
    ratio = statistics.median(seconds["compiled"]) / statistics.median(seconds["eager"])
    print(f"compiled / eager (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
