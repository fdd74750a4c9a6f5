"""The committed stubs under splitspec/v1/ must match what protos/ generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIX = "python scripts/gen_protos.py"


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_protos():
    return _load_gen_protos()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, gen_protos) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    assert gen_protos.main(["--out", str(out)]) == 0
    return out


def test_every_stub_is_committed_and_current(gen_protos, fresh):
    expected = gen_protos.expected_outputs(gen_protos.proto_files())
    assert expected, "no .proto files found under protos/"
    stale = []
    for rel in expected:
        committed = REPO_ROOT / rel
        if not committed.exists():
            stale.append(f"{rel} is missing")
        elif committed.read_bytes() != (fresh / rel).read_bytes():
            stale.append(f"{rel} differs from what protos/ generates")
    assert not stale, "stale generated stubs:\n  " + "\n  ".join(stale) + f"\nregenerate them with: {FIX}"


def test_no_orphan_stubs(gen_protos):
    expected = set(gen_protos.expected_outputs(gen_protos.proto_files()))
    orphans = [str(f) for f in gen_protos.generated_files(REPO_ROOT) if f not in expected]
    assert not orphans, f"stubs without a .proto: {', '.join(orphans)}; remove them with: {FIX}"


def test_stubs_import_as_a_package():
    from splitspec.v1 import generation_pb2, generation_pb2_grpc, kv_layout_pb2

    assert generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name == "splitspec.v1.Generation"
    assert hasattr(generation_pb2_grpc, "GenerationStub")
    assert kv_layout_pb2.KVLayout.DESCRIPTOR.full_name == "splitspec.v1.KVLayout"
