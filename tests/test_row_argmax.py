"""common/row_argmax.py: the same indices torch.argmax gives, ties and NaN included."""

import pytest
import torch

from common.row_argmax import argmax_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_last_gives_torch_argmax(dtype):
    values = torch.randn(3, 9, 500, generator=torch.Generator().manual_seed(0)).to(dtype)
    values[0, 0, [7, 300]] = 50.0  # a tie: the first index wins
    values[1, 2, 123] = float("nan")  # a NaN counts as the largest
    values[2, 4] = float("-inf")  # a row of -inf: index 0
    got = argmax_last(values)
    assert got.dtype == torch.long and got.shape == (3, 9)
    assert torch.equal(got, values.argmax(dim=-1))
    assert got[0, 0] == 7 and got[1, 2] == 123 and got[2, 4] == 0
    assert torch.equal(argmax_last(values[:, ::2]), values[:, ::2].argmax(dim=-1))  # not contiguous
