#!/usr/bin/env python
"""Generate the Python and gRPC stubs for every .proto under protos/.

The stubs are committed: run this after editing a .proto

    .venv/bin/python scripts/gen_protos.py

`protos/splitspec/v1/x.proto` becomes `<out>/splitspec/v1/x_pb2.py`, `x_pb2.pyi` and
`x_pb2_grpc.py`, importable as `from splitspec.v1 import x_pb2`. tests/test_protos_fresh.py
regenerates into a temporary `--out` and fails when the committed stubs are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under proto_root, relative to it, in a stable order."""
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def expected_outputs(protos: list[Path]) -> list[Path]:
    """The generated files (relative to --out) for the given protos."""
    return [p.with_suffix("").with_name(p.stem + suffix) for p in protos for suffix in GENERATED_SUFFIXES]


def generated_files(out: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generated stubs that exist under out, relative to it (including stale ones)."""
    dirs = {out / p.parent for p in proto_files(proto_root)}
    found = [f for d in dirs if d.is_dir() for f in d.iterdir() if f.name.endswith(GENERATED_SUFFIXES)]
    return sorted(f.relative_to(out) for f in found)


def run_protoc(out: Path, proto_root: Path = PROTO_ROOT) -> None:
    from grpc_tools import protoc

    protos = proto_files(proto_root)
    if not protos:
        raise SystemExit(f"no .proto files under {proto_root}")
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}: {' '.join(args)}")


def remove_orphans(out: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Delete generated stubs whose .proto no longer exists."""
    keep = set(expected_outputs(proto_files(proto_root)))
    orphans = [f for f in generated_files(out, proto_root) if f not in keep]
    for f in orphans:
        (out / f).unlink()
    return orphans


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="directory the package path (splitspec/v1/...) is written under (default: the repo root)",
    )
    parser.add_argument("--protos", type=Path, default=PROTO_ROOT, help="root of the .proto tree")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run_protoc(args.out, args.protos)
    for orphan in remove_orphans(args.out, args.protos):
        print(f"removed stale {orphan}", file=sys.stderr)
    for f in expected_outputs(proto_files(args.protos)):
        print(args.out / f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
