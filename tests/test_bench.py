"""`splitspec bench` against a live stack: the report's fields agree with each other."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import REPO_ROOT, Service
from tests.tiny_models import make_qwen3

pytestmark = pytest.mark.slow


def test_bench_report_is_consistent(tmp_path):
    model = make_qwen3(tmp_path / "model")
    drafter = Service("draft_service.cli", ["--kind", "ngram", "--port", "0"], tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(tmp_path),
                                                "--num-pages", "256", "--drafter", drafter.address,
                                                "--speculative-policy", "fixed"],
                         tmp_path / "target.log")
        address = target.wait_serving()
        out = tmp_path / "report.json"
        cmd = [sys.executable, "-m", "splitspec.cli", "bench", "--target", address, "--num-requests", "6",
               "--concurrency", "1,3", "--max-tokens", "8", "--ignore-eos", "--no-progress", "--json", str(out),
               "--markdown", str(tmp_path / "table.md"), "--plot", str(tmp_path / "plot.png")]
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        if target is not None:
            target.stop()
        drafter.kill()
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["num_requests"] == 6 and level["failed"] == 0
        assert level["output_tokens"] == 6 * 8
        assert level["accepted_tokens"] <= level["draft_tokens"]
        assert level["num_drafts"] > 0
        assert level["mean_acceptance_length"] == pytest.approx(1 + level["accepted_tokens"] / level["num_drafts"])
        per_pos = level["acceptance_per_position"]
        assert all(0 <= p <= 1 for p in per_pos) and per_pos == sorted(per_pos, reverse=True)
        assert sum(per_pos) * level["num_drafts"] == pytest.approx(level["accepted_tokens"])
        ttft = level["ttft_s"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= level["e2e_s"]["p99"]
        assert level["output_tokens_per_s"] > 0
    table = (tmp_path / "table.md").read_text()
    assert "concurrency 1" in table and "concurrency 3" in table and table in done.stdout
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
