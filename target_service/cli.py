"""`splitspec-target`: run the target model server."""

from __future__ import annotations

import argparse
import sys

import splitspec.contract as defaults
from common.attention_backends import BACKEND_CHOICES
from common.cli import add_metrics_args, add_threads_arg, run_service
from common.compiled_forward import CompileConfig
from common.dtypes import DTYPE_CHOICES
from common.kv_layout import CACHE_DTYPE_CHOICES, ORDERS, CacheConfig
from splitspec.cli_args import (
    DEFAULT_SHM_DIR,
    HelpFormatter,
    add_log_level,
    fraction,
    parse_bytes,
    positive_int,
)
from target_service.config import PROPOSE_TRANSPORTS
from target_service.draft_policy import SPECULATIVE_POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitspec-target",
        description="Serve a Qwen3-family model over gRPC (splitspec.v1.Generation) with a paged KV cache.",
        formatter_class=HelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument("--model", required=True,
                       help="local checkpoint folder or Hugging Face id (from the local cache)")
    model.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: the model's)")
    model.add_argument("--hf-cache-dir", default=None, help="Hugging Face cache to resolve ids from")
    model.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    model.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="compute dtype (auto: the checkpoint's on GPU, float32 on CPU)")
    model.add_argument("--max-model-len", type=positive_int, default=None,
                       help="prompt + completion token limit (default: from the model config)")
    model.add_argument("--attention-backend", default="auto", choices=BACKEND_CHOICES,
                       help="attention kernels (auto: native C on a CPU where they build, FlashInfer on CUDA "
                            "where it fits the model, else torch)")
    model.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    add_threads_arg(model, "torch's, one per core")
    model.add_argument("--compile", action=argparse.BooleanOptionalAction, default=CompileConfig.enabled,
                       help="run decode and verify steps through the compiled forward (common/compiled_forward.py)")
    model.add_argument("--native-forward", action=argparse.BooleanOptionalAction, default=True,
                       help="run every step of a bfloat16 target whose products run tile-packed (AMX, "
                            "AVX512-BF16 or AVX2) in one native call (common/native_forward.py); "
                            "--no-native-forward keeps the torch forward")
    model.add_argument("--compile-max-tokens", type=positive_int, default=CompileConfig.max_tokens, metavar="N",
                       help="the largest step, in tokens, that runs compiled; larger ones run eagerly")

    cache = p.add_argument_group("KV cache")
    cache.add_argument("--kv-cache-dtype", default="auto", choices=CACHE_DTYPE_CHOICES,
                       help="KV page dtype (auto: the model dtype; fp8 = fp8_e4m3)")
    cache.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (a power of two)")
    cache.add_argument("--kv-layout", default="auto", choices=("auto", *ORDERS),
                       help="page order (auto: the attention backend's preference)")
    budget = cache.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                        help="KV pool budget, e.g. 2GiB")
    budget.add_argument("--kv-cache-memory-fraction", type=fraction, default=0.5,
                        help="KV pool budget as a fraction of available memory "
                             "(free GPU memory; on a CPU, MemAvailable)")
    cache.add_argument("--num-pages", type=positive_int, default=None,
                       help="exact pool size in pages (overrides the budget)")
    cache.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.ENABLE_PREFIX_CACHING,
                       help="reuse the KV of full pages of prompts already computed (chained hashes, LRU eviction); "
                            "--no-prefix-caching computes every prompt from its first token")
    cache.add_argument("--shm-dir", default=DEFAULT_SHM_DIR, help="where the CPU pool's shared-memory file lives")

    sched = p.add_argument_group("scheduling")
    sched.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences in a running batch")
    sched.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                       help="token budget of one step (prefill is chunked to fit)")
    sched.add_argument("--max-waiting", type=positive_int, default=1024,
                       help="waiting requests before RESOURCE_EXHAUSTED")
    sched.add_argument("--default-max-tokens", type=positive_int, default=256,
                       help="max_tokens when a request leaves it unset (capped at the model length)")

    spec = p.add_argument_group("speculation")
    spec.add_argument("--drafter", default=None, metavar="ADDR",
                      help="splitspec-draft address (host:port or unix:PATH); without it, no speculation")
    spec.add_argument("--internal-token-file", default=None,
                      help="file with the internal channel's shared token (else $SPLITSPEC_INTERNAL_TOKEN)")
    spec.add_argument("--num-speculative-tokens", type=int, default=defaults.NUM_SPECULATIVE_TOKENS,
                      help="the server's K; requests may ask for fewer")
    spec.add_argument("--speculative-disable-by-batch-size", type=positive_int, default=None, metavar="N",
                      help="run without drafts while N or more sequences are running (default: always draft)")
    spec.add_argument("--speculative-policy", default=defaults.SPECULATIVE_POLICY, choices=SPECULATIVE_POLICIES,
                      help="adaptive: ask each step for the number of drafts (0..K) expected to emit the most "
                           "tokens per second, from measured acceptance and step costs; fixed: always K")
    spec.add_argument("--propose-transport", default="auto", choices=PROPOSE_TRANSPORTS,
                      help="auto: Propose over a channel in the KV pool's shm file where both services map it "
                           "(a CPU pool and a drafter that reads pages), else gRPC; grpc: always gRPC")
    spec.add_argument("--staging-rows", type=positive_int, default=None, metavar="N",
                      help="hidden-state rows a DFlash or EAGLE-3 drafter may be sent late (at least "
                           "--max-num-batched-tokens; default: 16 steps' tokens within 64 MiB)")
    spec.add_argument("--drafter-timeout-s", type=float, default=defaults.PROPOSE_TIMEOUT_S,
                      help="per-step Propose deadline")
    spec.add_argument("--drafter-startup-wait-s", type=float, default=30.0,
                      help="how long the first handshake may wait for the drafter")

    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    srv.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port, logged)")
    srv.add_argument("--max-message-bytes", type=parse_bytes, default="64MiB", help="gRPC message size limit")
    srv.add_argument("--tls-cert", default=None, metavar="PEM",
                     help="serve the public API over TLS with this certificate chain (with --tls-key)")
    srv.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    srv.add_argument("--shutdown-grace-s", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests get before they are aborted")
    add_metrics_args(srv, default_port=9400)
    add_log_level(srv)
    return p


def cache_config(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        kv_layout=args.kv_layout,
        memory_bytes=args.kv_cache_memory,
        memory_fraction=args.kv_cache_memory_fraction,
        num_pages=args.num_pages,
        shm_dir=args.shm_dir,
    )


def serve_config(args: argparse.Namespace):
    from common.auth import load_internal_token
    from target_service.config import EngineConfig
    from target_service.convert import RequestDefaults
    from target_service.server import ServeConfig, TLSConfig

    engine = EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
        attention_backend=args.attention_backend,
        native_forward=args.native_forward,
        cache=cache_config(args),
        enable_prefix_caching=args.prefix_caching,
        seed=args.seed,
        hf_cache_dir=args.hf_cache_dir,
        drafter=args.drafter,
        internal_token=load_internal_token(args.internal_token_file) if args.drafter else None,
        num_speculative_tokens=args.num_speculative_tokens,
        drafter_timeout_s=args.drafter_timeout_s,
        drafter_startup_wait_s=args.drafter_startup_wait_s,
        speculative_disable_batch_size=args.speculative_disable_by_batch_size,
        staging_rows=args.staging_rows,
        speculative_policy=args.speculative_policy,
        propose_transport=args.propose_transport,
        threads=args.threads,
        compile=CompileConfig(enabled=args.compile, exact_tokens=min(CompileConfig.exact_tokens,
                                                                      args.compile_max_tokens),
                              max_tokens=args.compile_max_tokens),
    )
    return ServeConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        shutdown_grace_s=args.shutdown_grace_s,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_message_bytes=args.max_message_bytes,
        defaults=RequestDefaults(max_tokens=args.default_max_tokens),
        tls=TLSConfig.from_files(args.tls_cert, args.tls_key),
    )


def main(argv: list[str] | None = None) -> int:
    return run_service(build_parser(), serve_config, "target_service.server", argv)


if __name__ == "__main__":
    sys.exit(main())
