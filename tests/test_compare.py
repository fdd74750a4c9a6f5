"""The comparison script runs end to end (tiny models, few tokens): it cannot rot silently."""

from __future__ import annotations

import pytest

from bench import compare
from tests.tiny_models import make_bench_models

pytestmark = pytest.mark.slow


def test_compare_runs_every_row(tmp_path, capsys):
    models = make_bench_models(tmp_path / "models")
    assert compare.main(["--models", str(models), "--prompts", "2", "--new-tokens", "6", "--concurrency", "1",
                         "--k", "4", "--repeat", "1", "--reference-repeat", "1"]) == 0
    out = capsys.readouterr().out
    for row in range(1, 10):
        assert f"\n| {row} | " in out
    assert "row 7 / row 8 step time" in out and "Targets:" in out
    assert "row 9 (the split asking no drafts) / row 4 step time" in out
    assert "CPU linear kernels row 4's target chose at load" in out and "->" in out
    assert "verify step / row 4 decode step" in out and "row 4 / row 1 tokens/s at concurrency 1" in out
    # rows 7 and 8 break the split's cost down from both processes' Propose histograms
    assert "| in drafter ms |" in out and "the split adds" in out
    row7 = next(line for line in out.splitlines() if line.startswith("| 7 | "))
    verify_ms, propose_ms, drafter_ms = (float(cell) for cell in row7.split("|")[9:12])
    assert 0 < drafter_ms < propose_ms and verify_ms > 0


def test_propose_rtt_times_a_live_drafter(capsys):
    from bench import propose_rtt

    assert propose_rtt.main(["--calls", "5", "--gaps-ms", "0,2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms |" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["0 ms", "2 ms"]
    for row in rows:
        median, p90 = (int(cell) for cell in row.split("|")[2:4])
        assert 0 < median <= p90


def test_pearl_bound_reads_full_acceptance_from_the_engines_counters(tmp_path, capsys):
    """A draft model identical to the target accepts every draft: the bound script must see
    all K accepted on every drafted step (and DFlash's bound is zero by construction)."""
    from transformers import AutoTokenizer

    from bench import pearl_bound

    models = make_bench_models(tmp_path / "models")
    tok = AutoTokenizer.from_pretrained(models / "target")
    # 13 tokens = the prefill's 1 + 3 steps of 3 drafts + 1: no step near the end asks fewer
    same = pearl_bound.measure(models, "draft_model", [tok.encode("def f(x):")] * 2, 13, 3)
    assert same["drafted steps"] > 0 and same["all K accepted"] == 1.0
    assert same["accepted per drafted step"] == pytest.approx(3.0)
    assert 0 < same["bound"] <= 1
    assert pearl_bound.main(["--models", str(models), "--prompts", "2", "--new-tokens", "13", "-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "| draft_model | 3.00 | 100.0% |" in out and "| dflash |" in out and "0 (needs the verify's" in out


def test_a_concurrency_above_the_prompt_count_gets_distinct_prompts_while_there_are_any():
    """A repeated prompt would be a prefix-cache hit for target-only but not for DFlash: every row
    of a run must do the same work."""
    held_out = [[i, i + 100] for i in range(16)]
    batches = compare.batches_for(held_out, 8, (1, 8, 16))
    assert batches[1] == batches[8] == held_out[:8]
    assert batches[16] == held_out and len({tuple(p) for p in batches[16]}) == 16
    short = compare.batches_for(held_out[:8], 8, (16,))  # only 8 exist: repeated, as before
    assert short[16] == held_out[:8] * 2


def test_rows_take_turns_in_both_orders_and_are_judged_against_row_4_of_the_same_round(monkeypatch):
    """Each row's "vs 4" is the median of its ratio to row 4's run in the same round, whatever the
    machine's speed did between rounds, and no row always runs first."""
    order: list[int] = []
    speed_of_round = [1.0, 0.5, 0.8]  # this VM's drift: every row in a round runs at that speed
    row_speed = {4: 100.0, 5: 90.0, 9: 100.0}

    def measure_once(core, row, name, prompts, new_tokens, concurrency, drafter_metrics=None, speculate=True):
        order.append(row)
        tokens_per_s = row_speed[row] * speed_of_round[(len(order) - 1) // len(row_speed)]
        return compare.Result(row, name, concurrency, tokens=100, seconds=100 / tokens_per_s, steps=50)

    monkeypatch.setattr(compare, "measure_once", measure_once)
    rows = [compare.EngineRow(row, f"row {row}", core=None) for row in row_speed]
    results = {r.row: r for r in compare.measure_interleaved(rows, [[1]], 4, 1, repeat=3)}
    assert order == [4, 5, 9, 9, 5, 4, 4, 5, 9]
    assert results[5].vs_row4 == pytest.approx(0.9) and results[9].vs_row4 == pytest.approx(1.0)
    assert results[5].step_vs_row4 == pytest.approx(1 / 0.9) and results[4].vs_row4 == pytest.approx(1.0)
    slowest = next(line for line in compare.targets(list(results.values())) if "slowest speculative" in line)
    assert "row 5" in slowest and ": 0.90 (MISSED" in slowest
