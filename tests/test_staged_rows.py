"""The hidden-state rows a target keeps for a drafter between Proposes (`StagedRows`): each
forward writes after the rows still held, and a Propose packs every update's rows in context
order from row 0, without copying rows that already lie there."""

from __future__ import annotations

import torch

from target_service.speculation import PendingUpdate, StagedRows

WIDTH = 4


def forward(staging: torch.Tensor, staged: StagedRows, rows_by_seq: dict[int, int], step: int) -> None:
    """A forward writing each sequence's rows from `staged.used` on (value: seq·1000 + step·10 + i), as the runner does."""
    row = staged.used
    for seq_id, count in rows_by_seq.items():
        for i in range(count):
            staging[row + i] = seq_id * 1000 + step * 10 + i
        staged.note_fresh(seq_id, row, count)
        row += count


def update(seq_id: int) -> PendingUpdate:
    return PendingUpdate(seq_id, 0, [], -1, 0)


def test_a_deferred_step_keeps_its_rows_in_place_and_the_next_forward_writes_after_them():
    staging = torch.zeros(16, WIDTH)
    staged = StagedRows()
    forward(staging, staged, {7: 3}, step=0)  # a prompt of 3
    staged.hold()  # no Propose this step
    assert staged.used == 3
    forward(staging, staged, {7: 1}, step=1)
    staged.hold()
    forward(staging, staged, {7: 1}, step=2)
    assert staged.rows_after_holding() == 5
    updates = {7: update(7)}
    before = staging.clone()
    staged.restage(staging, updates)
    assert updates[7].staging_row == 0
    assert torch.equal(staging, before)  # one sequence's rows already lie in context order: nothing moves
    assert staged.used == 0 and not staged.held and not staged.fresh


def test_interleaved_sequences_are_packed_each_in_context_order():
    staging = torch.zeros(16, WIDTH)
    staged = StagedRows()
    forward(staging, staged, {1: 2, 2: 3}, step=0)
    staged.hold()
    forward(staging, staged, {1: 1, 2: 1}, step=1)
    staged.hold()
    forward(staging, staged, {2: 1, 1: 1}, step=2)
    updates = {1: update(1), 2: update(2)}
    staged.restage(staging, updates)
    first, second = updates[1].staging_row, updates[2].staging_row
    assert (first, second) == (0, 4)
    assert staging[first : first + 4, 0].tolist() == [1000, 1001, 1010, 1020]
    assert staging[second : second + 5, 0].tolist() == [2000, 2001, 2002, 2010, 2020]


def test_a_dropped_sequence_is_not_packed_and_an_update_without_rows_keeps_its_row():
    staging = torch.zeros(16, WIDTH)
    staged = StagedRows()
    forward(staging, staged, {1: 2, 2: 2}, step=0)
    staged.hold()
    staged.drop(1)
    forward(staging, staged, {2: 1}, step=1)
    assert staged.rows_after_holding() == 5  # a dropped sequence's rows stay counted until the Propose
    updates = {2: update(2), 3: update(3)}
    staged.restage(staging, updates)
    assert updates[2].staging_row == 0 and updates[3].staging_row == -1
    assert staging[:3, 0].tolist() == [2000, 2001, 2010]
