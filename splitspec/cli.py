"""`splitspec`: the command-line client and tools (generate, info, health, up, bench)."""

from __future__ import annotations

import argparse
import os
import sys
import grpc

from splitspec.channel import open_channel
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET_ENV = "SPLITSPEC_TARGET"
EXIT_RPC_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _default_target() -> str:
    return os.environ.get(DEFAULT_TARGET_ENV, "127.0.0.1:50051")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=_default_target(),
                   help=f"host:port or unix:PATH (default: ${DEFAULT_TARGET_ENV} or %(default)s)")
    p.add_argument("--timeout", type=float, default=None, help="RPC deadline in seconds (default: none)")
    _add_tls_ca(p)


def _add_tls_ca(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect over TLS, trusting the CA certificates in PEM (a target run with --tls-cert)")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion to stdout")
    _add_target(p)
    p.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=None, help="completion token limit (else the server's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="0 is off (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], help="stop token id (repeats)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--no-speculation", action="store_true", help="decode without the drafter")
    p.add_argument("--request-id", default="", help="request id (default: assigned by the server)")
    p.set_defaults(func=cmd_generate)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="print model and server info")
    _add_target(p)
    p.set_defaults(func=cmd_info)


def _add_health(sub) -> None:
    p = sub.add_parser("health", help="exit 0 when a service's grpc.health.v1 status is SERVING (for healthchecks)")
    p.add_argument("address", help="host:port or unix:///path of a splitspec-target or splitspec-draft")
    p.add_argument("--service", default="", help="health service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="RPC deadline in seconds")
    _add_tls_ca(p)
    p.set_defaults(func=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(args.address, args.tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_RPC_ERROR
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_RPC_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec", description="splitspec client and tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_info(sub)
    _add_health(sub)
    from splitspec import bench, up

    up.add_parser(sub)
    bench.add_parser(sub)
    return parser


def _prompt_input(args: argparse.Namespace, request: pb.GenerateRequest) -> None:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.chat:
        request.text = text
        return
    if args.system is not None:
        request.chat.messages.add(role="system", content=args.system)
    request.chat.messages.add(role="user", content=text)


def generate_request(args: argparse.Namespace) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=args.request_id)
    _prompt_input(args, request)
    request.sampling.temperature = args.temperature
    request.sampling.top_k = args.top_k
    if args.top_p is not None:
        request.sampling.top_p = args.top_p
    if args.seed is not None:
        request.sampling.seed = args.seed
    if args.max_tokens is not None:
        request.stop.max_tokens = args.max_tokens
    request.stop.stop.extend(args.stop)
    request.stop.stop_token_ids.extend(args.stop_token_id)
    request.stop.ignore_eos = args.ignore_eos
    request.speculation.disable = args.no_speculation
    return request


def format_usage(complete: pb.Complete) -> str:
    u = complete.usage
    reason = pb.FinishReason.Name(complete.finish_reason).removeprefix("FINISH_REASON_").lower()
    line = (f"finish_reason={reason} prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_tokens}"
            f" completion_tokens={u.completion_tokens} num_drafts={u.num_drafts} draft_tokens={u.draft_tokens} accepted_tokens={u.accepted_tokens}")
    if u.draft_tokens:
        line += f" acceptance={u.accepted_tokens / u.draft_tokens:.2f}"
    if u.num_drafts:  # tokens per drafted step, the bonus token included (vLLM's "mean acceptance length")
        line += f" acceptance_length={(u.accepted_tokens + u.num_drafts) / u.num_drafts:.2f}"
    return line


def _stream(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float | None):
    """Write chunks to stdout as they arrive; the Complete, or None if the stream had none."""
    call = stub.Generate(request, timeout=timeout)
    try:
        for response in call:
            if response.HasField("chunk"):
                sys.stdout.write(response.chunk.text)
                sys.stdout.flush()
            elif response.HasField("complete"):
                return response.complete
    except KeyboardInterrupt:
        call.cancel()
        raise
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    with open_channel(args.target, args.tls_ca) as channel:
        complete = _stream(pb_grpc.GenerationStub(channel), generate_request(args), args.timeout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if complete is None:
        print("error: the stream ended without a Complete message", file=sys.stderr)
        return EXIT_RPC_ERROR
    print(format_usage(complete), file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with open_channel(args.target, args.tls_ca) as channel:
        stub = pb_grpc.GenerationStub(channel)
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
        server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=args.timeout)
    print(format_info(model, server))
    return 0


def _enum_name(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix) if value in enum.values() else str(value)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _rows(pairs: list[tuple[str, object]]) -> list[str]:
    width = max(len(key) for key, _ in pairs)
    return [f"  {key:<{width}}  {value}" for key, value in pairs]


def format_info(model: pb.ModelInfo, server: pb.ServerInfo) -> str:
    """Model, server, drafter and KV layout as short aligned tables (one row per layer)."""
    drafter = server.drafter
    lines = ["model", *_rows([
        ("id", model.model_id), ("architecture", model.architecture), ("dtype", model.dtype),
        ("layers", model.num_layers), ("hidden size", model.hidden_size), ("vocab size", model.vocab_size),
        ("max model len", model.max_model_len), ("eos token ids", ", ".join(map(str, model.eos_token_ids)) or "-"),
    ])]
    lines += ["server", *_rows([
        ("running", server.running), ("waiting", server.waiting),
        ("pages free", f"{server.free_pages} / {server.num_pages}"),
    ])]
    lines += ["prefix cache", *_rows(_prefix_cache_rows(server.prefix_cache))]
    status = _enum_name(pb.DrafterState.Status, drafter.status, "STATUS_").lower()
    drafter_rows = [("status", status)]
    if drafter.status != pb.DrafterState.STATUS_NONE:
        drafter_rows += [("address", drafter.address or "-"), ("kind", drafter.kind or "-"),
                         ("K", drafter.num_speculative_tokens), ("epoch", drafter.epoch),
                         ("propose over", drafter.propose_transport or "-")]
    if drafter.detail:
        drafter_rows.append(("detail", drafter.detail))
    lines += ["drafter", *_rows(drafter_rows)]
    lines += _layout_lines(server)
    return "\n".join(lines)


def _prefix_cache_rows(cache: pb.PrefixCacheState) -> list[tuple[str, object]]:
    if not cache.enabled:
        return [("status", "off (--no-prefix-caching)")]
    rate = f"{cache.hit_tokens / cache.query_tokens:.1%}" if cache.query_tokens else "-"
    return [("status", "on"), ("cached pages", f"{cache.cached_pages} ({cache.evictable_pages} evictable)"),
            ("hit rate", f"{rate} of {cache.query_tokens} prompt tokens"), ("evictions", cache.evictions)]


def _layout_lines(server: pb.ServerInfo) -> list[str]:
    if not server.HasField("kv_layout"):
        return ["kv layout", "  not resolved yet"]
    from splitspec.v1 import kv_layout_pb2 as kv

    layout = server.kv_layout
    lines = ["kv layout", *_rows([
        ("order", _enum_name(kv.PageOrder, layout.order, "PAGE_ORDER_")),
        ("dtype", _enum_name(kv.KVDtype, layout.kv_dtype, "KV_DTYPE_").lower()),
        ("page size", f"{layout.page_size} tokens"), ("pages", layout.num_pages),
        ("pool size", _mib(layout.total_bytes)), ("epoch", layout.epoch), ("target id", layout.target_id),
    ])]
    if layout.HasField("staging"):
        staging = layout.staging
        lines += _rows([("staging", f"{staging.rows} rows x {staging.width} "
                         f"({_enum_name(kv.KVDtype, staging.dtype, 'KV_DTYPE_').lower()}), "
                         f"hidden states of layers {', '.join(map(str, staging.layer_ids))}")])
    header = ("owner", "layer", "kv heads", "head dim", "offset", "k scale", "v scale")
    table = [header] + [(_enum_name(kv.LayerOwner, spec.owner, "LAYER_OWNER_").lower(), str(spec.index),
                         str(spec.num_kv_heads), str(spec.head_dim), _mib(spec.offset), f"{spec.k_scale:g}",
                         f"{spec.v_scale:g}") for spec in layout.layers]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))) for row in table]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except ValueError as exc:  # a value protobuf cannot hold, e.g. a negative seed
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
