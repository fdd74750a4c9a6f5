"""`splitspec info` prints short aligned tables, not protobuf text."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.procs import REPO_ROOT, served_target
from tests.tiny_models import make_qwen3


def test_info_shows_the_kv_layout_as_a_table(tmp_path):
    model = make_qwen3(tmp_path / "model")
    with served_target(model, tmp_path / "target.log", "--num-pages", "64") as target:
        run = subprocess.run([sys.executable, "-m", "splitspec.cli", "info", "--target", target.address],
                             capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "kv_layout {" not in out and "page_size:" not in out  # no protobuf text format
    for section in ("model", "server", "drafter", "kv layout"):
        assert f"\n{section}\n" in f"\n{out}"
    assert "Qwen3ForCausalLM" in out and "pages free  64 / 64" in out and "status  none" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"  target +\d", line)]
    assert [row[1] for row in rows] == ["0", "1"]  # one row per layer of the 2-layer model
    assert all(row[2:4] == ["2", "16"] for row in rows)  # kv heads, head dim


def test_generate_usage_line_reports_the_acceptance_length():
    from splitspec.cli import format_usage
    from splitspec.v1 import generation_pb2 as pb

    complete = pb.Complete(finish_reason=pb.FINISH_REASON_LENGTH)
    complete.usage.prompt_tokens, complete.usage.completion_tokens = 5, 64
    complete.usage.num_drafts, complete.usage.draft_tokens, complete.usage.accepted_tokens = 10, 80, 35
    line = format_usage(complete)
    assert "finish_reason=length" in line and "acceptance=0.44" in line and "acceptance_length=4.50" in line
    complete.usage.num_drafts = complete.usage.draft_tokens = complete.usage.accepted_tokens = 0
    assert "acceptance" not in format_usage(complete)
