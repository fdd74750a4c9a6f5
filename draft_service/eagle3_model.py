"""EAGLE-3 draft heads over the shared paged KV pool, from either checkpoint layout in use.

Layouts (`read_eagle3_config` tells them apart by their config):
- SpecForge / original EAGLE (`LlamaForCausalLMEagle3`): a Llama config at the top level
  plus `draft_vocab_size` and, optionally, `eagle_config.eagle_aux_hidden_state_layer_ids`;
  tensors `midlayer.*` (the one decoder layer), `fc`, `norm`, `lm_head`, `d2t` / `t2d`.
- vLLM `speculators` (`Eagle3Speculator`, `speculators_model_type: eagle3`): the decoder
  layers' config in `transformer_layer_config` (llama or qwen3), the EAGLE-3 fields beside
  it; tensors `layers.{i}.*`, `fc`, `norm`, `lm_head`, `d2t` / `t2d`, and `input_norm`
  (`norm_before_fc`) or `fc_norm.{j}` (`fc_norm`).
Either may carry `embed_tokens.weight` (over the target's whole vocabulary); without it the
head borrows the target's embedding.

What it computes (speculators' `Eagle3DraftModel`, vLLM's `Eagle3LlamaForCausalLM`):
- features: the target's hidden states entering layers `aux_layer_ids` (vLLM's numbering:
  id i is HF `hidden_states[i]`, the residual stream after target layer i - 1),
  concatenated, normed where the config says so, through `fc` → g [T, hidden].
- a row at position p pairs the embedding of token p + 1 with a hidden state: g_p for a
  context row, or the head's own pre-norm output of the row before for a draft step.
  Layer 0 takes `cat(input_layernorm(embed), hidden_norm(h))` (2 x hidden) and keeps h as
  its residual (`hidden_norm(h)` with `norm_before_residual`); layers 1.. are plain decoder
  layers. `lm_head(norm(x))` scores the reduced draft vocabulary; a draft id d is target
  id d + d2t[d].
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.attention_backends import AttentionBackend
from common.attention_metadata import AttentionMetadata
from common.qwen3 import (
    MLP,
    Attention,
    DecoderLayer,
    ModelArgs,
    RMSNorm,
    RotaryEmbedding,
    StackedLinear,
    checkpoint_layout,
    stack_checkpoint_parts,
)
from common.row_argmax import argmax_last
from common.weights import iter_safetensors, resolve_model_path
from draft_service.feature_head import FeatureHead, strict_state

SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Qwen3ForCausalLMEagle3")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
LAYER_MODEL_TYPES = ("llama", "qwen3")
NUM_DEFAULT_AUX_LAYERS = 3
# Tensors a checkpoint may carry that drafting never reads: the target-to-draft map, the
# verifier's copies speculators keeps for training, rotary caches.
IGNORED_TENSOR = re.compile(r"^(t2d|verifier_norm\.weight|verifier_lm_head\.weight)$|\.rotary_emb\.inv_freq$")
EMBED_NAME = "embed_tokens.weight"
D2T_NAME = "d2t"


class Eagle3ConfigError(ValueError):
    """The checkpoint is not an EAGLE-3 head this module can run (the message names the field)."""


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice when the checkpoint names none: low, middle and high (vLLM's, SpecForge's)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 head is, read from either layout's config.json."""

    layout: str  # "specforge" | "speculators"
    layer_config: object  # the transformers config of its decoder layers (llama or qwen3)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: default_aux_layer_ids of the target's depth
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("specforge", "speculators"):
            raise Eagle3ConfigError(f"layout must be specforge or speculators, got {self.layout!r}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise Eagle3ConfigError(f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), "
                                    f"got {self.draft_vocab_size}")
        if self.target_hidden_size <= 0:
            raise Eagle3ConfigError(f"target_hidden_size must be positive, got {self.target_hidden_size}")
        ids = self.aux_layer_ids
        if ids is not None and (not ids or any(i < 1 for i in ids)):
            raise Eagle3ConfigError(f"eagle_aux_hidden_state_layer_ids must be target layer ids >= 1 "
                                    f"(id i is the state entering layer i), got {list(ids)}")
        if self.norm_before_fc and self.fc_norm:
            raise Eagle3ConfigError("norm_before_fc and fc_norm are mutually exclusive")

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary: what the embedding covers and draft ids map into."""
        return int(self.layer_config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.layer_config.hidden_size)

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids is not None else NUM_DEFAULT_AUX_LAYERS

    @property
    def num_layers(self) -> int:
        return int(self.layer_config.num_hidden_layers)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


# ---------------------------------------------------------------------------------------
# Config reading


def eagle3_layout(raw: Mapping) -> str | None:
    """"specforge" or "speculators" when a config.json describes an EAGLE-3 head, else None."""
    architectures = list(raw.get("architectures") or [])
    speculators = any(a in SPECULATORS_ARCHITECTURES for a in architectures)
    if raw.get("speculators_model_type") == "eagle3" or speculators:
        return "speculators"
    if any(a in SPECFORGE_ARCHITECTURES for a in architectures):
        return "specforge"
    return None


def read_eagle3_config(folder: str | Path) -> Eagle3Config:
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Eagle3ConfigError(f"{path}: cannot read the config ({exc})") from exc
    layout = eagle3_layout(raw)
    if layout == "speculators":
        return _speculators_config(raw)
    if layout == "specforge":
        return _specforge_config(raw)
    raise Eagle3ConfigError(
        f"{path}: not an EAGLE-3 head: architectures {raw.get('architectures')} name neither "
        f"{', '.join(SPECFORGE_ARCHITECTURES + SPECULATORS_ARCHITECTURES)} nor speculators_model_type eagle3"
    )


def _layer_config(fields: Mapping, where: str):
    """A transformers config of the decoder layers; llama or qwen3 only."""
    from transformers import AutoConfig

    model_type = fields.get("model_type", "llama")
    if model_type not in LAYER_MODEL_TYPES:
        raise Eagle3ConfigError(f"{where}model_type {model_type!r} is not supported (expected "
                                f"{' or '.join(LAYER_MODEL_TYPES)})")
    layer_types = list(fields.get("layer_types") or [])
    if any(t != "full_attention" for t in layer_types):
        raise Eagle3ConfigError(f"{where}layer_types {layer_types}: only full_attention is supported")
    values = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    return AutoConfig.for_model(model_type, **values)


def _aux_ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise Eagle3ConfigError(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {value!r}")
    return tuple(value)


def _flag(raw: Mapping, name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise Eagle3ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _speculators_config(raw: Mapping) -> Eagle3Config:
    if _flag(raw, "norm_output"):
        raise Eagle3ConfigError("norm_output (EAGLE 3.1: normed states fed back across steps) "
                                "is not supported")
    fields = raw.get("transformer_layer_config")
    if not isinstance(fields, dict):
        raise Eagle3ConfigError("speculators config lacks transformer_layer_config")
    layer_config = _layer_config(fields, "transformer_layer_config.")
    draft_vocab = raw.get("draft_vocab_size", layer_config.vocab_size)
    return Eagle3Config(
        layout="speculators",
        layer_config=layer_config,
        draft_vocab_size=int(draft_vocab),
        target_hidden_size=int(raw.get("target_hidden_size") or layer_config.hidden_size),
        aux_layer_ids=_aux_ids(raw.get("eagle_aux_hidden_state_layer_ids")),
        norm_before_residual=_flag(raw, "norm_before_residual"),
        norm_before_fc=_flag(raw, "norm_before_fc"),
        fc_norm=_flag(raw, "fc_norm"),
    )


def _specforge_config(raw: Mapping) -> Eagle3Config:
    for name in ("norm_output", "norm_before_fc", "fc_norm"):
        if _flag(raw, name):
            raise Eagle3ConfigError(f"{name} in a SpecForge-layout config is not supported (convert it to "
                                    "the speculators layout, whose config carries it)")
    eagle = raw.get("eagle_config") or {}
    layer_config = _layer_config(raw, "")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    return Eagle3Config(
        layout="specforge",
        layer_config=layer_config,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer_config.vocab_size),
        target_hidden_size=int(raw.get("target_hidden_size") or layer_config.hidden_size),
        aux_layer_ids=_aux_ids(ids),
        norm_before_residual=_flag(raw, "norm_before_residual"),
    )


# ---------------------------------------------------------------------------------------
# Modules (attribute names follow the speculators layout's tensor names)


class Eagle3FirstLayer(nn.Module):
    """Layer 0: attention over `cat(input_layernorm(embed), hidden_norm(h))`, residual h."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        parts = dict(zip(("q_proj", "k_proj", "v_proj"), self.self_attn.qkv_sizes))
        self.self_attn.qkv_proj = StackedLinear(2 * args.hidden_size, parts, bias=args.qkv_bias)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, embeds, hidden, cos, sin, kv_cache, backend, spec) -> torch.Tensor:  # [T, hidden]
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)  # [T, 2 * hidden]
        x = residual + self.self_attn(x, cos, sin, kv_cache, backend, spec)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3DraftModel(FeatureHead):
    """An EAGLE-3 head; `embed_tokens` is its own when the checkpoint has one, else borrowed."""

    def __init__(self, config: Eagle3Config, own_embedding: bool) -> None:
        super().__init__()
        self.config = config
        self.args = ModelArgs.from_config(config.layer_config)
        hidden, eps = self.args.hidden_size, self.args.rms_norm_eps
        feature_width = config.num_aux_layers * config.target_hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        if config.norm_before_fc:
            self.input_norm = RMSNorm(feature_width, eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, eps)
                                         for _ in range(config.num_aux_layers))
        self.fc = nn.Linear(feature_width, hidden, bias=False)
        first = Eagle3FirstLayer(self.args, config.norm_before_residual)
        rest = (DecoderLayer(self.args) for _ in range(1, self.args.num_layers))
        self.layers = nn.ModuleList([first, *rest])
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.layer_config, self.args.head_dim)
        # target id of each draft id: d + d2t[d] (the identity without a reduced vocabulary)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size),  # [Vd]
                             persistent=False)
        self.borrowed_embed: nn.Module | None = None

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype, device: torch.device | str,
                        embed: nn.Module | None = None) -> Eagle3DraftModel:
        """Build from either layout; `embed` (the target's embedding) when the checkpoint has
        none. Strict about tensor names and shapes, and about `d2t`."""
        folder = resolve_model_path(str(path))
        config = read_eagle3_config(folder)
        tensors = dict(_renamed_tensors(folder, config.layout))
        own_embedding = EMBED_NAME in tensors
        if not own_embedding:
            _check_borrowed_embedding(folder, config, embed)
        with torch.device("meta"):
            model = cls(config, own_embedding)
        expected, stacked = checkpoint_layout(model)
        d2t = tensors.pop(D2T_NAME, None)
        state = strict_state(folder, tensors.items(), expected, dtype, device, ignored=IGNORED_TENSOR,
                             model="EAGLE-3 head")
        model.load_state_dict(stack_checkpoint_parts(state, stacked), strict=False, assign=True)
        model.draft_to_target = _draft_to_target(folder, config, d2t).to(device)
        if not own_embedding:
            model.borrowed_embed = embed
        return model.to(device).eval().requires_grad_(False)

    # -- facts --------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    # -- forward ------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] → [T, hidden]
        table = self.borrowed_embed if self.borrowed_embed is not None else self.embed_tokens
        return table(input_ids).to(self.dtype)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:  # [T, n * target hidden] → [T, H]
        features = features.to(self.dtype)
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        elif self.config.fc_norm:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long: token p + 1 of each row at position p
        hidden: torch.Tensor,  # [T, hidden]: projected features, or the previous row's pre-norm output
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],  # index = draft layer
        backend: AttentionBackend,  # planned for `meta`
    ) -> torch.Tensor:  # [T, hidden] pre-norm
        if input_ids.shape[0] != meta.num_tokens or hidden.shape != (meta.num_tokens, self.hidden_size):
            raise ValueError(f"forward: {input_ids.shape[0]} ids and hidden {tuple(hidden.shape)} for "
                             f"{meta.num_tokens} tokens of width {self.hidden_size}")
        layout = backend.layout
        cos, sin = self.rotary(positions, self.dtype)  # [T, D] each
        embeds = self.embed(input_ids)  # [T, hidden]
        x = self.layers[0](embeds, hidden, cos, sin, kv_caches[0], backend, layout.layer("draft", 0))
        for i in range(1, len(self.layers)):
            x = self.layers[i](x, cos, sin, kv_caches[i], backend, layout.layer("draft", i))
        return x

    def greedy_target_ids(self, prenorm: torch.Tensor) -> torch.Tensor:  # [N, hidden] → [N] target ids
        logits = self.lm_head(self.norm(prenorm)).float()  # [N, draft vocab]
        return self.draft_to_target[argmax_last(logits)]


# ---------------------------------------------------------------------------------------
# Weights


def _renamed_tensors(folder: Path, layout: str):
    """(name in the speculators layout, tensor) for every checkpoint tensor (SpecForge's
    `midlayer.` is `layers.0.`)."""
    for name, tensor in iter_safetensors(folder):
        if layout == "specforge" and name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        yield name, tensor


def _check_borrowed_embedding(folder: Path, config: Eagle3Config, embed: nn.Module | None) -> None:
    if embed is None:
        raise Eagle3ConfigError(f"{folder}: the head has no {EMBED_NAME}; pass the target's checkpoint "
                                "(--target-model) to borrow its embedding")
    rows, width = embed.weight.shape
    if rows != config.vocab_size:
        raise Eagle3ConfigError(f"{folder}: vocab_size {config.vocab_size} of the head, the target's "
                                f"embedding has {rows} rows")
    if width != config.hidden_size:
        raise Eagle3ConfigError(f"{folder}: hidden_size {config.hidden_size} of the head, the target's "
                                f"embedding is {width} wide (a head of another width needs its own "
                                f"{EMBED_NAME})")


def _draft_to_target(folder: Path, config: Eagle3Config, d2t: torch.Tensor | None) -> torch.Tensor:
    """[draft vocab] long: the target id of each draft id, from the `d2t` offsets."""
    ids = torch.arange(config.draft_vocab_size)
    if d2t is None:
        if config.reduced_vocab:
            raise Eagle3ConfigError(f"{folder}: d2t is missing: draft_vocab_size {config.draft_vocab_size} < "
                                    f"vocab_size {config.vocab_size} needs the draft-to-target offsets")
        return ids
    if d2t.shape != (config.draft_vocab_size,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        wanted = f"({config.draft_vocab_size},) (draft_vocab_size)"
        raise Eagle3ConfigError(f"{folder}: d2t must be integer offsets of shape {wanted}, "
                                f"got {d2t.dtype} {tuple(d2t.shape)}")
    target = ids + d2t.long()
    if int(target.min()) < 0 or int(target.max()) >= config.vocab_size:
        span = f"{int(target.min())}..{int(target.max())}"
        raise Eagle3ConfigError(f"{folder}: d2t maps draft ids to target ids outside "
                                f"[0, {config.vocab_size}) (vocab_size): {span}")
    if target.unique().numel() != target.numel():
        raise Eagle3ConfigError(f"{folder}: d2t maps two draft ids to one target id")
    return target
