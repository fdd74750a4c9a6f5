"""`splitspec-draft`: run the drafter (splitspec.v1.Drafter) next to a splitspec-target."""

from __future__ import annotations

import argparse
import sys

from common.attention_backends import BACKEND_CHOICES
from common.cli import add_metrics_args, add_threads_arg, run_service
from common.dtypes import DTYPE_CHOICES
from common.kv_layout import CACHE_DTYPE_CHOICES
from draft_service.drafters import KINDS, DrafterConfig
from splitspec.cli_args import DEFAULT_SHM_DIR, HelpFormatter, add_log_level, parse_bytes, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitspec-draft",
        description="Serve draft tokens to a splitspec-target over gRPC, reading and writing its shared KV pool.",
        formatter_class=HelpFormatter,
    )
    model = p.add_argument_group("drafter")
    model.add_argument("--model", default=None,
                       help="draft checkpoint folder or Hugging Face id (from the local cache); not needed for ngram")
    model.add_argument("--target-model", default=None,
                       help="the target's checkpoint: DFlash reads its embedding and lm_head, an EAGLE-3 head "
                            "without its own embedding that embedding (only those tensors) and its depth")
    model.add_argument("--kind", default="auto", choices=("auto", *KINDS),
                       help="auto: DFlashDraftModel → dflash, LlamaForCausalLMEagle3 or Eagle3Speculator → eagle3, "
                            "*ForCausalLM → draft_model, no --model → ngram")
    model.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                       help="most draft tokens per step (default 8; DFlash: block_size - 1, also its cap)")
    model.add_argument("--device", default="cpu", help="torch device; must be the target's (cpu, cuda, cuda:1)")
    model.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="compute dtype (auto: the checkpoint's on GPU; on a CPU bfloat16 where its products run "
                            "natively: AMX, AVX512-BF16, or AVX2 with FMA on the tile kernel; else float32)")
    model.add_argument("--kv-cache-dtype", default="auto", choices=CACHE_DTYPE_CHOICES,
                       help="required KV page dtype (auto: whatever the target's pool uses)")
    model.add_argument("--ngram-min", type=positive_int, default=1, help="shortest n-gram to match")
    model.add_argument("--ngram-max", type=positive_int, default=4, help="longest n-gram to match")
    add_threads_arg(model, "1 on a CPU, where the target owns the cores; torch's on a GPU")
    model.add_argument("--compile", action=argparse.BooleanOptionalAction, default=DrafterConfig.compile,
                       help="the model drafter's steps (DFlash, draft model) through the compiled forward (common/compiled_forward.py)")

    model.add_argument("--shm-dir", default=DEFAULT_SHM_DIR,
                       help="the target's --shm-dir: the only folder the drafter maps a CPU pool file from")
    model.add_argument("--attention-backend", default="auto", choices=BACKEND_CHOICES,
                       help="attention kernels (auto: native C on a CPU where they build, FlashInfer on CUDA "
                            "where it fits the model, else torch)")
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on, or unix:///path/to.sock for a Unix domain socket")
    srv.add_argument("--port", type=int, default=50061, help="port to listen on (0: any free port, logged)")
    srv.add_argument("--internal-token-file", default=None,
                     help="file holding the shared token (default: $SPLITSPEC_INTERNAL_TOKEN)")
    srv.add_argument("--max-message-bytes", type=parse_bytes, default="64MiB", help="gRPC message size limit")
    srv.add_argument("--shutdown-grace-s", type=float, default=5.0, help="on SIGTERM, seconds in-flight calls get")
    add_metrics_args(srv, default_port=9401)
    add_log_level(srv)
    return p


def serve_config(args: argparse.Namespace):
    from common.auth import load_internal_token
    from draft_service.drafters import DrafterConfig
    from draft_service.server import DraftServeConfig

    drafter = DrafterConfig(
        kind=args.kind,
        model=args.model,
        target_model=args.target_model,
        num_speculative_tokens=args.num_speculative_tokens,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        attention_backend=args.attention_backend,
        shm_dir=args.shm_dir,
        compile=args.compile,
    )
    return DraftServeConfig(
        drafter=drafter,
        token=load_internal_token(args.internal_token_file),
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        shutdown_grace_s=args.shutdown_grace_s,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        threads=args.threads,
    )


def main(argv: list[str] | None = None) -> int:
    return run_service(build_parser(), serve_config, "draft_service.server", argv)


if __name__ == "__main__":
    sys.exit(main())
