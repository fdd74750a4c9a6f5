"""z-lab's DFlash block-diffusion drafter, run over the shared paged KV pool.

Reference: `dflash.model` (PyPI `dflash`): `DFlashDraftModel`, `Qwen3DFlashAttention`,
`dflash_generate`. What it computes, per draft layer:

- context: the target's hidden states after layers `target_layer_ids`, concatenated
  ([T, n * hidden]), go through `fc` and `hidden_norm`; every draft layer projects that
  one tensor with its own k_proj / v_proj (+ k_norm, RoPE at the context positions).
  The context K/V depend only on the target's features, never on a layer's input, so
  `write_context` computes them once per new context token and writes them to the
  draft layers' pages, where every later proposal reads them.
- proposal: the query block `[last token, mask x K]` at positions p..p+K (p = number of
  context tokens) is embedded with the target's embedding, run through the Qwen3
  decoder layers with its own K/V written at slots p..p+K (overwritten next time; no
  rollback) and NON-causal attention over context + the whole block; the last K rows go
  through the final norm and the target's lm_head.

The checkpoint has no embedding and no lm_head: the target lends its own (`TargetHeads`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.attention import write_kv_to_pages
from common.attention_backends import AttentionBackend
from common.attention_metadata import AttentionMetadata, check_table_holds
from common.compiled_forward import CompileConfig, CompiledForward, CompiledRows, DecoderStack, rms_norm, rope
from common.kv_layout import KVLayout
from common.qwen3 import (
    DecoderLayer,
    ModelArgs,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    checkpoint_layout,
    rope_tables,
    stack_checkpoint_parts,
)
from common.row_argmax import argmax_last
from common.weights import iter_safetensors, load_config, resolve_model_path
from draft_service.feature_head import FeatureHead, strict_state

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# Config keys and tensor names only DFlash2 (dynamic convolutions + candidate selector) has.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_TENSOR = re.compile(r"(^|\.)(candidate_selector|attention_conv|mlp_conv)\.")
IGNORED_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
DEFAULT_BLOCK_SIZE = 16  # the reference's default when the config names none


class DFlashConfigError(ValueError):
    """The checkpoint is not a DFlash drafter this module can run."""


@dataclass(frozen=True)
class TargetHeads:
    """The target's token embedding and output head, which the drafter borrows."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # [N] ids → [N, hidden]
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # [N, hidden] → [N, vocab]; no final norm


@dataclass(frozen=True)
class DFlashConfig:
    """The DFlash-specific fields of a checkpoint config (the rest is plain Qwen3)."""

    block_size: int  # 1 anchor token + up to block_size - 1 draft tokens
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    causal: bool = False  # the block attends to itself non-causally unless the config says so

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise DFlashConfigError(f"DFlash block_size must be at least 2, got {self.block_size}")
        if self.mask_token_id < 0:
            raise DFlashConfigError(f"DFlash mask_token_id must be a token id, got {self.mask_token_id}")
        if not self.target_layer_ids or any(i < 0 for i in self.target_layer_ids):
            raise DFlashConfigError(
                f"DFlash target_layer_ids must be non-negative layer ids, got {self.target_layer_ids}"
            )

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_hf_config(cls, config) -> DFlashConfig:
        _reject_unsupported(config)
        mask_token_id = _draft_value(config, "mask_token_id")
        if mask_token_id is None:
            raise DFlashConfigError("DFlash config has no dflash_config.mask_token_id")
        softcap = _draft_value(config, "final_logit_softcapping")
        return cls(
            block_size=int(_draft_value(config, "block_size", DEFAULT_BLOCK_SIZE)),
            mask_token_id=int(mask_token_id),
            target_layer_ids=_target_layer_ids(config),
            input_embedding_scale=float(_draft_value(config, "input_embedding_scale", 1.0)),
            output_multiplier=float(_draft_value(config, "output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            causal=bool(getattr(config, "is_causal", None) or False),
        )


@dataclass(frozen=True)
class NewContext:
    """Context rows not yet written, drafted over in the same forward as the block (their
    K/V share each layer's k/v products with the block's and land in the pages on the way)."""

    features: torch.Tensor  # [Tc, n * hidden] the target's feature rows, any sequence order
    positions: torch.Tensor  # [Tc] long
    slot_mapping: torch.Tensor  # [Tc] int64: page * page_size + offset of each row's K/V


@dataclass
class DraftProposal:
    token_ids: torch.Tensor  # [B, n] long, greedy: the first n drafts of the block
    logits: torch.Tensor  # [B, n, V] float32, after output_multiplier and softcapping


# ---------------------------------------------------------------------------------------
# Config reading, mirroring the reference's lookups.


def _draft_value(config, name: str, default=None):
    """`dflash_config[name]`, else the top-level config field, else `default` (as the reference)."""
    section = getattr(config, "dflash_config", None) or {}
    return section.get(name, getattr(config, name, default))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default choice of target layers, spread over the stack."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _target_layer_ids(config) -> tuple[int, ...]:
    ids = _draft_value(config, "target_layer_ids")
    if ids is not None:
        return tuple(int(i) for i in ids)
    num_target_layers = getattr(config, "num_target_layers", None)
    if num_target_layers is None:
        raise DFlashConfigError(
            "DFlash config names neither dflash_config.target_layer_ids nor num_target_layers"
        )
    return tuple(build_target_layer_ids(int(num_target_layers), config.num_hidden_layers))


def _reject_unsupported(config) -> None:
    architectures = list(getattr(config, "architectures", None) or [])
    section = getattr(config, "dflash_config", None) or {}
    if DFLASH2_ARCHITECTURE in architectures or any(key in section for key in DFLASH2_KEYS):
        raise DFlashConfigError(
            "DFlash2 checkpoints (dynamic convolutions and a candidate selector) are not supported; "
            f"expected architectures [{ARCHITECTURE!r}], got {architectures}"
        )
    if ARCHITECTURE not in architectures:
        raise DFlashConfigError(
            f"not a DFlash checkpoint: expected architectures [{ARCHITECTURE!r}], got {architectures}"
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    if any(t != "full_attention" for t in layer_types):
        raise DFlashConfigError(
            f"DFlash layers other than full_attention are not supported, got layer_types {layer_types}"
        )


def _refuse_dflash2(folder: Path, unexpected: list[str]) -> None:
    if any(DFLASH2_TENSOR.search(name) for name in unexpected):
        raise DFlashConfigError(f"{folder}: DFlash2 tensors (candidate_selector / *_conv) are not supported")


# ---------------------------------------------------------------------------------------
# Small tensor helpers.


def context_kv(
    attn: nn.Module,  # a common.qwen3.Attention
    context: torch.Tensor,  # [T, hidden] fc + hidden_norm of the target features
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, Hkv, D], [T, Hkv, D])
    """One layer's K/V of context tokens: k_proj → k_norm → RoPE, and v_proj (cos/sin from RotaryEmbedding)."""
    _, k, v = attn.project(context)  # [T, Hkv, D] each (q too: one stacked product costs less than two)
    return apply_rope(attn.k_norm(k), cos, sin), v


def block_token_ids(last_token_ids: torch.Tensor, num_tokens: int, mask_token_id: int) -> torch.Tensor:
    """[B] → [B, K + 1]: each row is [last token, mask x K]."""
    masks = last_token_ids.new_full((last_token_ids.shape[0], num_tokens), mask_token_id)  # [B, K]
    return torch.cat([last_token_ids[:, None], masks], dim=1)


def block_positions(context_lens: Sequence[int], num_tokens: int, device: torch.device) -> torch.Tensor:
    """[B * (K + 1)] long: p, p + 1, ..., p + K for each sequence (p = its context length)."""
    starts = torch.tensor(list(context_lens), dtype=torch.long, device=device)  # [B]
    offsets = torch.arange(num_tokens + 1, dtype=torch.long, device=device)  # [K + 1]
    return (starts[:, None] + offsets[None, :]).reshape(-1)


def block_metadata(
    context_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    num_tokens: int,
    page_size: int,
    device: torch.device,
    causal: bool = False,
) -> AttentionMetadata:
    """Each sequence queries its K + 1 block rows over its context plus the whole block."""
    return AttentionMetadata.build(
        query_lens=[num_tokens + 1] * len(context_lens),
        seq_lens=[p + num_tokens + 1 for p in context_lens],
        page_tables=[list(t) for t in page_tables],
        page_size=page_size,
        device=device,
        causal=causal,
    )


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


@dataclass(frozen=True)
class ContextRows:
    """Every draft layer's context K/V of T context rows, as one row-wise function of the
    target's features and the weights (what `write_context` computes), for CompiledRows:
    (features, positions, fc, hidden_norm, inv_freq, then per layer k/v weight and k_norm)
    → (k_0, v_0, k_1, v_1, ...), each [T, Hkv, D]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_scaling: float

    def __call__(self, features, positions, fc, hidden_norm, inv_freq, *layers):
        context = rms_norm(F.linear(features.to(fc.dtype), fc), hidden_norm, self.eps)  # [T, hidden]
        cos, sin = rope_tables(positions, inv_freq, self.rope_scaling, context.dtype)  # [T, D] each
        out = []
        tokens, shape = context.shape[0], (context.shape[0], self.num_kv_heads, self.head_dim)
        for kv_weight, k_norm in zip(layers[0::2], layers[1::2], strict=True):
            k, v = F.linear(context, kv_weight).view(tokens, 2, -1).unbind(1)  # [T, Hkv * D] each
            out += [rope(rms_norm(k.reshape(shape), k_norm, self.eps), cos, sin), v.reshape(shape).contiguous()]
        return tuple(out)


# ---------------------------------------------------------------------------------------


class DFlashDraftModel(FeatureHead):
    """The DFlash drafter; module names follow the checkpoint's tensor names. A feature row is
    the target's hidden states after layers `target_layer_ids`."""

    def __init__(self, config, target: TargetHeads) -> None:
        super().__init__()
        self.config = config
        self.dflash = DFlashConfig.from_hf_config(config)
        self.args = ModelArgs.from_config(config)
        if not self.args.qk_norm:
            raise DFlashConfigError(
                f"DFlash drafters are Qwen3 models (q/k norms), got model_type {self.args.model_type!r}"
            )
        self.target = target  # a plain dataclass: not registered as a submodule
        hidden = self.args.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(self.args) for _ in range(self.args.num_layers))
        self.norm = RMSNorm(hidden, self.args.rms_norm_eps)
        self.fc = nn.Linear(len(self.dflash.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, self.args.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.args.head_dim)
        self.compiled_block: CompiledForward | None = None  # set by use_compiled
        self.native_block = None  # common.native_forward.NativeForward, set by use_native
        self.native_draft_block = None  # its DraftBlockArgs where a whole Propose runs natively (use_native)
        self.compiled_context: CompiledRows | None = None

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, target: TargetHeads, dtype: torch.dtype, device: torch.device | str
    ) -> DFlashDraftModel:
        """Build from a z-lab checkpoint folder (or cached HF id); strict about tensor names."""
        folder = resolve_model_path(str(path))
        device = torch.device(device)
        config = load_config(folder)
        with torch.device("meta"):
            model = cls(config, target)
        expected, stacked = checkpoint_layout(model)
        expected = {name: shape for name, shape in expected.items() if not IGNORED_TENSOR.search(name)}
        state = strict_state(folder, iter_safetensors(folder), expected, dtype, device, ignored=IGNORED_TENSOR,
                             model="DFlash model", refuse=lambda unexpected: _refuse_dflash2(folder, unexpected))
        state = stack_checkpoint_parts(state, stacked)
        model.load_state_dict(state, strict=False, assign=True)
        return model.to(device).eval().requires_grad_(False)

    # -- facts for the handshake and the layout -------------------------------------------

    @property
    def target_layer_ids(self) -> list[int]:
        """Target layers whose output hidden state (HF `hidden_states[i + 1]`) is a feature."""
        return list(self.dflash.target_layer_ids)

    @property
    def num_speculative_tokens(self) -> int:
        return self.dflash.num_speculative_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def check_target(self, num_layers: int, hidden_size: int) -> None:
        """Raise DFlashConfigError unless the target can feed this drafter."""
        if hidden_size != self.hidden_size:
            raise DFlashConfigError(
                f"DFlash drafter hidden size {self.hidden_size} != target hidden size {hidden_size}"
            )
        if max(self.dflash.target_layer_ids) >= num_layers:
            raise DFlashConfigError(
                f"DFlash target_layer_ids {self.target_layer_ids} exceed the target's {num_layers} layers"
            )

    # -- the compiled forward -------------------------------------------------------------

    def use_compiled(self, config: CompileConfig, embed: torch.Tensor) -> None:
        """Run proposals through compiled code (common/compiled_forward.py): the block through
        the draft layers per token-count bucket, and new context rows' K/V per row bucket.
        `embed` is the target's embedding weight [V, hidden]."""
        if any(layer.self_attn.qkv_proj.bias is not None for layer in self.layers):
            raise DFlashConfigError("the compiled DFlash forward has no k/v projection biases")
        # weights frozen into the graphs, so that Inductor packs them (DFlash has two layers: two graphs
        # a bucket either way); the plain bfloat16 products are twice as slow as packed ones
        self.compiled_block = CompiledForward(self.decoder_stack(embed), config, "dflash block", frozen_weights=True)
        args = self.args
        rows = ContextRows(args.num_layers, args.num_kv_heads, args.head_dim, args.rms_norm_eps,
                           self.rotary.attention_scaling)
        q_size = args.num_heads * args.head_dim
        weights = [self.fc.weight, self.hidden_norm.weight, self.rotary.inv_freq]
        for layer in self.layers:
            weights += [layer.self_attn.qkv_proj.weight[q_size:], layer.self_attn.k_norm.weight]
        self.compiled_context = CompiledRows(rows, weights, config, "dflash context", frozen_weights=True)

    def use_native(self, embed: torch.Tensor) -> str | None:
        """Run the block through the draft layers in one native call (common/native_forward.py)
        where its products run tile-packed (AMX, AVX512-BF16 or AVX2), and new context rows' K/V in another
        (`NativeForward.context_kv`); why not, or None. A step runs them where the pool's pages
        and the attention backend allow (`NativeForward.runs` / `writes`), else eagerly."""
        from common.native_attention import NativeCpuAttentionBackend
        from common.native_forward import NativeForward, native_forward_problem
        from common.native_linear import TiledLinear

        stack = self.decoder_stack(embed)
        problem = native_forward_problem(stack, torch.bfloat16, NativeCpuAttentionBackend, batch_invariant=False)
        if problem is None and not isinstance(self.fc, TiledLinear):
            problem = "its fc does not run tile-packed"
        if problem is None:
            self.native_block = NativeForward(stack)
            self.native_draft_block = self._native_draft_block()
        return problem

    def _native_draft_block(self):
        """The block's arguments for a whole `Propose` in one native call (`propose_greedy`), or None
        where the head's logits are reshaped first (a multiplier or softcap can tie two logits that
        differ, which would change the argmax's choice), or the head does not run tile-packed."""
        from common.native_linear import TiledLinear

        head = self.target.lm_head
        if (self.dflash.output_multiplier != 1.0 or self.dflash.final_logit_softcapping is not None
                or not isinstance(head, TiledLinear)):
            return None
        return self.native_block.draft_block(head, self.dflash.mask_token_id, self.dflash.causal)

    def decoder_stack(self, embed: torch.Tensor) -> DecoderStack:
        return DecoderStack(self.args, embed, self.rotary, self.layers, self.norm.weight, self.forward_block,
                            lambda backend, i: backend.layout.layer("draft", i), self.dflash.input_embedding_scale)

    def forward_block(
        self,
        input_ids: torch.Tensor,  # [T] long: the blocks, token-flat
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,  # planned on the backend already
        kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],  # index = draft layer
        backend: AttentionBackend,
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The blocks through the draft layers, eagerly: final-normed hidden states [T, hidden]
        (CompiledForward's signature; nothing is captured)."""
        hidden = self.target.embed(input_ids).to(self.dtype) * self.dflash.input_embedding_scale  # [T, hidden]
        cos, sin = self.rotary(positions, hidden.dtype)  # [T, D] each
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv_caches[i], backend, backend.layout.layer("draft", i))
        return self.norm(hidden), {}

    def prepare_compiled(self, block_tokens: Sequence[int], context_rows: Sequence[int]) -> None:
        """Compile these buckets now (the drafter's warmup), so that no `Propose` runs them eagerly."""
        if self.compiled_block is None or self.compiled_context is None:
            return
        self.compiled_block.prepare(block_tokens)
        features = torch.zeros(1, self.feature_width, dtype=self.dtype, device=self.fc.weight.device)
        positions = torch.zeros(1, dtype=torch.long, device=self.fc.weight.device)
        self.compiled_context.prepare_like([features, positions], context_rows)

    # -- context ------------------------------------------------------------------------

    @torch.inference_mode()
    def write_context(
        self,
        features: torch.Tensor,  # [T, n * hidden] new context tokens, token-flat in meta's order
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,  # queries = the new tokens; seq_lens = context length after them
        kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],  # index = draft layer
        backend: AttentionBackend,
    ) -> None:
        """Write the context K/V of T new tokens into every draft layer's pages, once.

        Nothing attends here: `backend` only lends its `layout` (order, page size, scales)."""
        if features.shape != (meta.num_tokens, self.feature_width) or positions.shape != (meta.num_tokens,):
            raise ValueError(
                f"write_context: features {tuple(features.shape)} and positions {tuple(positions.shape)} "
                f"for {meta.num_tokens} tokens of width {self.feature_width}"
            )
        if self.compiled_context is not None:
            self._write_new_context(NewContext(features, positions, meta.slot_mapping), kv_caches, backend.layout)
            return
        self._write_context_rows(NewContext(features, positions, meta.slot_mapping), kv_caches, backend.layout, backend)

    def _write_context_rows(self, new_context: NewContext, kv_caches, layout: KVLayout, backend=None) -> None:
        """New context rows' K/V into every draft layer's pages: in one native call where the block
        runs natively (and `backend` lends the pages' geometry), else eagerly."""
        native = self.native_block
        if native is not None and backend is not None and native.writes(backend, kv_caches):
            native.context_kv(new_context.features, self.fc, self.hidden_norm.weight, new_context.positions,
                              new_context.slot_mapping, kv_caches, backend)
            return
        context = self.project_context(new_context.features)  # [Tc, hidden]
        cos, sin = self.rotary(new_context.positions, context.dtype)  # [Tc, D] each
        for i, layer in enumerate(self.layers):
            k, v = context_kv(layer.self_attn, context, cos, sin)  # [Tc, Hkv, D] each
            self._write_kv(i, k, v, new_context.slot_mapping, kv_caches, layout)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:  # [T, n * hidden] → [T, hidden]
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    @staticmethod
    def _write_kv(i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                  kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], layout: KVLayout) -> None:
        spec = layout.layer("draft", i)
        write_kv_to_pages(kv_caches[i], k, v, slots, order=layout.order, page_size=layout.page_size,
                          k_scale=spec.k_scale, v_scale=spec.v_scale)

    # -- proposal -----------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        last_token_ids: torch.Tensor,  # [B] long: each sequence's newest token, at position p
        context_lens: Sequence[int],  # [B] p: context tokens already written (= last token's position)
        page_tables: Sequence[Sequence[int]],  # [B] page ids covering p + K + 1 slots
        kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],  # index = draft layer
        backend: AttentionBackend,
        num_tokens: int | None = None,  # K; defaults to block_size - 1
        new_context: NewContext | None = None,  # rows before position p not written yet
        num_drafts: int | None = None,  # the first n ≤ K drafts wanted; defaults to K
    ) -> DraftProposal:
        """Greedy draft tokens [B, n] and their logits [B, n, V], batched over sequences: the first
        n of a block of K masks (the head runs over those n rows only; the block is K + 1 rows).

        With `new_context`, those rows' K/V are computed and written in this same forward
        (what `write_context` would do first, in one pass less over the layers)."""
        k_draft = self.num_speculative_tokens if num_tokens is None else num_tokens
        kept = k_draft if num_drafts is None else num_drafts
        self._check_propose_args(tuple(last_token_ids.shape), context_lens, page_tables, k_draft, kept)
        layout: KVLayout = backend.layout
        device = last_token_ids.device
        meta = block_metadata(context_lens, page_tables, k_draft, layout.page_size, device, self.dflash.causal)
        backend.plan(meta)
        ids = block_token_ids(last_token_ids.long(), k_draft, self.dflash.mask_token_id).reshape(-1)  # [T]
        positions = block_positions(context_lens, k_draft, device)  # [T], T = B * (K + 1)
        if self.compiled_block is not None:
            if new_context is not None:
                self._write_new_context(new_context, kv_caches, layout)
            hidden, _ = self.compiled_block(ids, positions, meta, kv_caches, backend)  # [T, hidden], normed
        elif self.native_block is not None and self.native_block.runs(backend, kv_caches):
            context = None if new_context is None else self.native_block.context_rows(
                new_context.features, self.fc, self.hidden_norm.weight, new_context.positions,
                new_context.slot_mapping)  # written inside the block's forward, one pass over the weights
            hidden, _ = self.native_block(ids, positions, meta, kv_caches, backend,
                                          context=context)  # [T, hidden] float32, normed
            hidden = hidden.to(self.dtype)
        elif new_context is None:
            hidden, _ = self.forward_block(ids, positions, meta, kv_caches, backend)
        else:
            hidden = self._forward_block_with_context(ids, positions, new_context, kv_caches, backend)
        drafts = hidden.view(len(context_lens), k_draft + 1, -1)[:, 1:1 + kept]  # [B, n, hidden]
        logits = self.compute_logits(drafts.reshape(-1, drafts.shape[-1]))  # [B * n, V]
        logits = logits.view(len(context_lens), kept, -1)  # [B, n, V]
        return DraftProposal(token_ids=argmax_last(logits), logits=logits)

    @torch.inference_mode()
    def propose_greedy(
        self,
        last_token_ids: Sequence[int],  # [B] each sequence's newest token, at position p
        context_lens: Sequence[int],  # [B] p
        page_tables: Sequence[Sequence[int]],  # [B] page ids covering p + K + 1 slots
        kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
        backend: AttentionBackend,
        num_tokens: int,  # K
        new_context: NewContext | None = None,
        num_drafts: int | None = None,
    ) -> list[list[int]]:
        """`propose`'s draft tokens [B][n], without its logits: block, layers, head and argmax in one
        native call where they can run so (the same tokens, bit for bit), else through `propose`."""
        native, block = self.native_block, self.native_draft_block
        kept = num_tokens if num_drafts is None else num_drafts
        if block is None or not native.writes(backend, kv_caches):
            return self.propose(torch.tensor(list(last_token_ids), dtype=torch.long, device=self.fc.weight.device),
                                context_lens, page_tables, kv_caches, backend, num_tokens=num_tokens,
                                new_context=new_context, num_drafts=num_drafts).token_ids.tolist()
        self._check_propose_args((len(last_token_ids),), context_lens, page_tables, num_tokens, kept)
        for p, table in zip(context_lens, page_tables):  # what block_metadata checks on the planned path
            check_table_holds(table, backend.layout.page_size, p + num_tokens + 1)
        context = None if new_context is None else native.context_rows(
            new_context.features, self.fc, self.hidden_norm.weight, new_context.positions, new_context.slot_mapping)
        return native.propose(block, last_token_ids, context_lens, page_tables, num_tokens, kept, kv_caches, backend,
                              context=context)

    def _forward_block_with_context(self, ids: torch.Tensor, positions: torch.Tensor, new_context: NewContext,
                                    kv_caches, backend: AttentionBackend) -> torch.Tensor:  # [T, hidden], normed
        """`forward_block` whose k/v products also take the new context rows, eagerly."""
        hidden = self.target.embed(ids).to(self.dtype) * self.dflash.input_embedding_scale  # [T, hidden]
        context = self.project_context(new_context.features)  # [Tc, hidden]
        cos, sin = self.rotary(torch.cat([new_context.positions, positions]), hidden.dtype)  # [Tc + T, D]
        for i, layer in enumerate(self.layers):
            hidden = self._layer_with_context(i, layer, hidden, context, cos, sin, new_context.slot_mapping,
                                              kv_caches, backend)  # [T, hidden]
        return self.norm(hidden)

    def _write_new_context(self, new_context: NewContext, kv_caches, layout: KVLayout) -> None:
        """The new context rows' K/V, compiled per row bucket, written to every draft layer's pages."""
        kv = self.compiled_context(new_context.features, new_context.positions)  # (k_0, v_0, k_1, ...)
        for i in range(len(self.layers)):
            self._write_kv(i, kv[2 * i], kv[2 * i + 1], new_context.slot_mapping, kv_caches, layout)

    def _layer_with_context(
        self,
        i: int,
        layer: DecoderLayer,
        hidden: torch.Tensor,  # [T, hidden] the block rows
        context: torch.Tensor,  # [Tc, hidden] projected new context rows
        cos: torch.Tensor,  # [Tc + T, D]: the context rows' first
        sin: torch.Tensor,  # [Tc + T, D]
        context_slots: torch.Tensor,  # [Tc]
        kv_caches: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        """`DecoderLayer.forward` for the block, whose k/v products also take the new context
        rows (one product each instead of two); their K/V are written before the block attends."""
        attn, num_context, tokens = layer.self_attn, context.shape[0], hidden.shape[0]
        x = layer.input_layernorm(hidden)  # [T, hidden]
        q, k, v = attn.project(torch.cat([context, x]))  # [Tc + T, Hq | Hkv, D]: q of the context unused
        q = apply_rope(attn.q_norm(q[num_context:]), cos[num_context:], sin[num_context:])  # [T, Hq, D]
        k = apply_rope(attn.k_norm(k), cos, sin)  # [Tc + T, Hkv, D]
        self._write_kv(i, k[:num_context], v[:num_context], context_slots, kv_caches, backend.layout)
        spec = backend.layout.layer("draft", i)
        out = backend.forward(q, k[num_context:], v[num_context:], kv_caches[i], spec, attn.scale)  # [T, Hq, D]
        hidden = hidden + attn.o_proj(out.reshape(tokens, attn.num_heads * attn.head_dim))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] → [N, V] float32
        logits = self.target.lm_head(hidden).float()
        if self.dflash.output_multiplier != 1.0:  # a full pass over [N, V] otherwise
            logits = logits * self.dflash.output_multiplier
        return softcap(logits, self.dflash.final_logit_softcapping)

    def _check_propose_args(
        self,
        last_tokens_shape: tuple[int, ...],
        context_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        k_draft: int,
        kept: int,
    ) -> None:
        if not 1 <= k_draft <= self.num_speculative_tokens:
            raise ValueError(
                f"propose: num_tokens must be in 1..{self.num_speculative_tokens}, got {k_draft}"
            )
        if not 1 <= kept <= k_draft:
            raise ValueError(f"propose: {kept} drafts from a block of {k_draft} masks")
        if last_tokens_shape != (len(context_lens),) or len(page_tables) != len(context_lens):
            raise ValueError(
                f"propose: {last_tokens_shape} last tokens, {len(context_lens)} context lengths "
                f"and {len(page_tables)} page tables must agree"
            )
        if any(p < 1 for p in context_lens):
            raise ValueError(
                f"propose: every sequence needs at least one context token, got {list(context_lens)}"
            )

