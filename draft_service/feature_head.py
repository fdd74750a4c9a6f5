"""What the two drafter models that read the target's hidden states (DFlash, EAGLE-3) share:
decoder layers of `args` whose K/V lives in the pool's draft layers, and `fc`, which projects
a context token's feature row (the target's hidden states it reads, concatenated) to the
hidden size; and how their checkpoints are read (`strict_state`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from common.kv_layout import LayerSpec
from common.qwen3 import ModelArgs, WeightLoadError


class FeatureHead(nn.Module):
    args: ModelArgs
    fc: nn.Linear

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def feature_width(self) -> int:
        """Width of one context token's feature row: the target's hidden states it reads, concatenated."""
        return self.fc.in_features

    def kv_layer_specs(self) -> list[LayerSpec]:
        heads, head_dim = self.args.num_kv_heads, self.args.head_dim
        return [LayerSpec("draft", i, heads, head_dim) for i in range(self.args.num_layers)]


def strict_state(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], expected: Mapping[str, torch.Size],
                 dtype: torch.dtype, device: torch.device | str, *, ignored: re.Pattern, model: str,
                 refuse: Callable[[list[str]], None] = lambda unexpected: None) -> dict[str, torch.Tensor]:
    """Every expected tensor of `tensors` ((name, tensor) pairs), cast and moved. Strict: a
    tensor of another shape, a missing one, or one neither expected nor `ignored` is a
    WeightLoadError naming `model`; `refuse` sees the unexpected names first (to raise what
    kind of checkpoint they betray)."""
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name in expected:
            if tensor.shape != expected[name]:
                raise WeightLoadError(f"{folder}: {model} tensor {name} has shape {tuple(tensor.shape)}, "
                                      f"the config implies {tuple(expected[name])}")
            state[name] = tensor.to(device=device, dtype=dtype)
        elif not ignored.search(name):
            unexpected.append(name)
    refuse(unexpected)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        raise WeightLoadError(f"{folder}: checkpoint does not match the {model}: {_describe(missing, unexpected)}")
    return state


def _describe(missing: list[str], unexpected: list[str], limit: int = 8) -> str:
    parts = []
    for label, names in (("missing", sorted(missing)), ("unexpected", sorted(unexpected))):
        if names:
            more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
            parts.append(f"{len(names)} {label} tensor(s): {', '.join(names[:limit])}{more}")
    return "; ".join(parts)
