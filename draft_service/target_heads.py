"""The target's embedding and lm_head, read alone from its checkpoint, for drafters that
borrow them (DFlash both; an EAGLE-3 head without its own embedding the embedding)."""

from __future__ import annotations

import torch
from torch import nn

from common.qwen3 import Qwen3ForCausalLM
from common.weights import load_config, resolve_model_path, safetensors_files

EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


def _read_tensors(folder, names: set[str]) -> dict[str, torch.Tensor]:
    """Just the named tensors, from whichever safetensors file holds them (lazy reads)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names.intersection(f.keys()) - found.keys():
                found[name] = f.get_tensor(name)
    return found


def load_target_heads(path: str, dtype: torch.dtype, device: torch.device | str) -> Qwen3ForCausalLM:
    """A target model whose embedding and lm_head are real and whose layers stay on "meta".

    Built as `Qwen3ForCausalLM` so that `fingerprint()`, `embed()` and `compute_logits()`
    are the target's own code; tied embeddings share one tensor, as in the target.
    """
    folder = resolve_model_path(path)
    config = load_config(folder)
    with torch.device("meta"):
        heads = Qwen3ForCausalLM(config)
    tied = heads.args.tie_word_embeddings
    wanted = {EMBED_NAME} if tied else {EMBED_NAME, LM_HEAD_NAME}
    tensors = _read_tensors(folder, wanted)
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ValueError(f"target checkpoint {folder} lacks {', '.join(missing)}")
    embed = nn.Parameter(tensors[EMBED_NAME].to(device=device, dtype=dtype), requires_grad=False)
    heads.model.embed_tokens.weight = embed
    if tied:
        heads.lm_head.weight = embed
    else:
        heads.lm_head.weight = nn.Parameter(tensors[LM_HEAD_NAME].to(device=device, dtype=dtype), requires_grad=False)
    expected = (heads.args.vocab_size, heads.args.hidden_size)
    for name, weight in (("embedding", heads.model.embed_tokens.weight), ("lm_head", heads.lm_head.weight)):
        if tuple(weight.shape) != expected:
            shape = tuple(weight.shape)
            raise ValueError(f"target checkpoint {folder}: {name} has shape {shape}, the config implies {expected}")
    return heads.eval()
