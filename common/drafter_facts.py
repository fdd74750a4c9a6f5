"""What a drafter tells the target in Negotiate, as a value both sides use: the drafter's
host answers with it, the target's link reads it (common/layout_proto.py converts it)."""

from __future__ import annotations

from dataclasses import dataclass

from common.kv_layout import LayerSpec
from common.pool_transport import TorchBuild


@dataclass(frozen=True)
class DrafterFacts:
    kind: str  # dflash | draft_model | ngram ("unknown" when the drafter did not say)
    layers: tuple[LayerSpec, ...]  # the drafter's layers the pool must hold (offsets unset)
    target_layer_ids: tuple[int, ...]  # target layers whose hidden states it reads from the staging rows
    supported_orders: tuple[str, ...]
    num_speculative_tokens: int  # the drafter's K
    model_id: str
    torch_build: TorchBuild = TorchBuild("")  # the drafter's; CUDA IPC needs the target's

    @property
    def maps_pool(self) -> bool:
        """The drafter keeps layers or reads hidden states in the pool (an n-gram drafter does not)."""
        return bool(self.layers or self.target_layer_ids)
