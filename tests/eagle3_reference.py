"""The EAGLE-3 reference for tests: vLLM `speculators`' own model definitions, run greedily,
and tiny EAGLE-3 checkpoints of our own sizes saved from them in both layouts in use.

`speculators` (installed with --no-deps) imports its training stack (datasets, openai, ...)
from its package `__init__`s; only its model definitions are loaded here, from their own
files, with the package folders registered bare so those `__init__`s do not run.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

SPECULATORS_VERSION = "0.9.0"


def speculators_module(name: str):
    """`speculators.<name>` loaded without running the package `__init__`s above it."""
    if "speculators" in sys.modules:
        root = Path(sys.modules["speculators"].__path__[0])
    else:
        spec = importlib.util.find_spec("speculators")
        if spec is None:
            import pytest

            pytest.skip("the speculators reference is not installed (pip install --no-deps speculators)")
        root = Path(spec.submodule_search_locations[0])
    parts = ["speculators", *name.split(".")]
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(root.joinpath(*parts[1:depth]))]
            sys.modules[package] = module
    return importlib.import_module(".".join(parts))


@dataclass(frozen=True)
class HeadShape:
    """An EAGLE-3 head's own sizes (odd on purpose: none is the target's but the hidden size)."""

    layer_type: str = "llama"  # llama | qwen3
    num_layers: int = 1
    intermediate_size: int = 88
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 20
    draft_vocab_size: int = 203
    aux_layer_ids: tuple[int, ...] | None = (1, 3, 4)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    own_embedding: bool = False
    extra: dict = field(default_factory=dict)  # more speculators config fields, verbatim


def layer_config(shape: HeadShape, target_config):
    """The head's decoder-layer config: the target's vocabulary, hidden size and rope."""
    from transformers import LlamaConfig, Qwen3Config

    cls = LlamaConfig if shape.layer_type == "llama" else Qwen3Config
    rope = dict(getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    config = cls(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_parameters=rope,
    )
    config._attn_implementation = "eager"
    return config


class ReferenceEagle3(nn.Module):
    """speculators' `Eagle3DraftModel` modules (its __init__, minus training state), run as an
    inference loop in `drafts`."""

    def __init__(self, shape: HeadShape, config, num_aux: int = 3) -> None:
        super().__init__()
        definitions = speculators_module("models.eagle3.model_definitions").model_classes[config.model_type]
        flatten = speculators_module("models.utils").flatten_rope_parameters
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.shape = shape
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([
            definitions.first_layer_class(config, layer_idx=0, norm_before_residual=shape.norm_before_residual),
            *(definitions.decoder_layer_class(config, i) for i in range(1, config.num_hidden_layers)),
        ])
        rotary_config = copy.copy(flatten(config))
        rotary_config.hidden_size *= 2  # as Eagle3DraftModel builds it
        self.rotary_emb = definitions.rotary_emb_class(rotary_config)
        self.norm = definitions.norm_class(hidden, eps=eps)
        self.input_norm = definitions.norm_class(num_aux * hidden, eps=eps) if shape.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(definitions.norm_class(hidden, eps=eps) for _ in range(num_aux))
                        if shape.fc_norm else None)
        self.lm_head = nn.Linear(hidden, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))

    def randomize(self, seed: int, target_vocab: int) -> None:
        """Random weights wide enough that greedy choices are not near-ties, norms away from 1,
        and a reduced vocabulary: a sorted random subset of the target's ids."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
                    param.copy_(0.5 + torch.rand(param.shape, generator=generator))
                elif name == "embed_tokens.weight":
                    param.copy_(torch.randn(param.shape, generator=generator))
                else:
                    bound = 2.0 / param.shape[-1] ** 0.5
                    param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound * 4)
            self.lm_head.weight.mul_(4.0)
            chosen = torch.randperm(target_vocab, generator=generator)[: self.shape.draft_vocab_size].sort().values
            self.d2t.copy_(chosen - torch.arange(self.shape.draft_vocab_size))

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [1, n, num_aux * hidden] → [1, n, hidden]
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    @torch.no_grad()
    def drafts(self, features: torch.Tensor, next_tokens: list[int], k: int, embed: nn.Module | None = None) -> list[int]:
        """k greedy target ids after context rows `features` [n, width] (positions 0..n-1),
        row p paired with next_tokens[p] (token p + 1), as speculators' TTT loop runs a step:
        the first over every row, then one row per step on its own draft and hidden state."""
        from transformers import DynamicCache

        embed = embed or self.embed_tokens
        cache = DynamicCache()
        hidden = self.project(features[None].float())  # [1, n, hidden]
        ids = torch.tensor([next_tokens])  # [1, n]
        positions = torch.arange(len(next_tokens))[None] + 1  # speculators' shifted positions
        drafts: list[int] = []
        for _ in range(k):
            q, past = ids.shape[1], cache.get_seq_length()
            mask = torch.full((q, past + q), float("-inf")).triu(past + 1)[None, None]  # [1, 1, q, kv] causal
            x = torch.cat([embed(ids), hidden], dim=-1)  # [1, q, 2 * hidden]
            position_embeddings = self.rotary_emb(x, positions)
            cache_position = torch.arange(past, past + q)
            for layer in self.layers:
                x = layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                          cache_position=cache_position, position_embeddings=position_embeddings)
            draft = int(self.lm_head(self.norm(x[:, -1])).argmax(-1))
            token = draft + int(self.d2t[draft])
            drafts.append(token)
            hidden, ids, positions = x[:, -1:], torch.tensor([[token]]), positions[:, -1:] + 1
        return drafts


def build_reference(shape: HeadShape, target_dir: Path, seed: int = 0) -> ReferenceEagle3:
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_dir)
    num_aux = len(shape.aux_layer_ids) if shape.aux_layer_ids else 3
    reference = ReferenceEagle3(shape, layer_config(shape, target_config), num_aux).eval()
    reference.randomize(seed, target_config.vocab_size)
    return reference


def tensors_of(reference: ReferenceEagle3) -> dict[str, torch.Tensor]:
    """The speculators layout's tensors: the reference's state, t2d beside d2t, the embedding
    only when the head has its own."""
    state = {name: t.detach().clone().contiguous() for name, t in reference.state_dict().items()}
    if not reference.shape.own_embedding:
        del state["embed_tokens.weight"]
    target = torch.arange(reference.shape.draft_vocab_size) + reference.d2t
    t2d = torch.zeros(reference.config.vocab_size, dtype=torch.bool)
    t2d[target] = True
    state["t2d"] = t2d
    return state


def save_speculators(reference: ReferenceEagle3, out_dir: Path, verifier: Path, **overrides) -> Path:
    """An `Eagle3Speculator` checkpoint as speculators saves one (config fields per
    `Eagle3SpeculatorConfig`)."""
    shape = reference.shape
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": reference.config.to_diff_dict(),
        "draft_vocab_size": shape.draft_vocab_size,
        "norm_before_residual": shape.norm_before_residual,
        "norm_before_fc": shape.norm_before_fc,
        "fc_norm": shape.fc_norm,
        "norm_output": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(shape.aux_layer_ids) if shape.aux_layer_ids else None,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
        },
        **shape.extra,
        **overrides,
    }
    config["transformer_layer_config"].pop("_attn_implementation_autoset", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors_of(reference), str(out_dir / "model.safetensors"))
    return out_dir


def save_specforge(reference: ReferenceEagle3, out_dir: Path, **overrides) -> Path:
    """The original / SpecForge layout: a Llama config with the EAGLE-3 fields on top, the one
    decoder layer as `midlayer.*` (the speculators converter's inverse)."""
    shape = reference.shape
    if shape.num_layers != 1 or shape.layer_type != "llama" or shape.norm_before_fc or shape.fc_norm:
        raise ValueError("the SpecForge layout holds one llama layer and no input norms")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = reference.config.to_dict()
    for key in ("_attn_implementation_autoset", "_attn_implementation"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=shape.draft_vocab_size)
    if shape.aux_layer_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(shape.aux_layer_ids),
                                  "use_aux_hidden_state": True}
    if shape.norm_before_residual:
        config["norm_before_residual"] = True
    config.update(overrides)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {(f"midlayer.{name.removeprefix('layers.0.')}" if name.startswith("layers.0.") else name): t
               for name, t in tensors_of(reference).items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
