"""The DFlash block drafter (draft_service/dflash_model.py) on the shared pool.

Per sequence and step, the target hands over the hidden states of its new context
tokens (layers `target_layer_ids`, concatenated) in rows of the staging buffer; the
server copies them out first thing, and `propose` writes their context K/V into the
draft layers' pages once. The query block `[last token, mask x K]` then drafts K tokens.

The drafter borrows the target's embedding and lm_head: only those two tensors are read
from the target checkpoint (`draft_service/target_heads.py`), never the whole target.
"""

from __future__ import annotations

import itertools
import logging

import torch

from common.attention_metadata import AttentionMetadata, slot_of
from common.compiled_forward import CompileConfig
from common.cpu_linear import pack_cpu_linears
from common.kv_layout import CacheConfig, LayerSpec
from common.native_linear import tile_kernel_name
from common.qwen3 import Qwen3ForCausalLM
from draft_service.dflash_model import DFlashDraftModel, NewContext, TargetHeads
from draft_service.drafters.base import DraftSequence, FeatureDrafter, ProposeItem, TargetInfo
from draft_service.target_heads import load_target_heads

log = logging.getLogger(__name__)


class DFlashDrafter(FeatureDrafter):
    kind = "dflash"
    extra_kv_slots = 1  # the block [last token, mask x k] spans positions last .. last + k

    def __init__(
        self,
        model: DFlashDraftModel,
        heads: Qwen3ForCausalLM,
        cache_config: CacheConfig,
        num_speculative_tokens: int | None = None,  # None: the model's block_size - 1, also its cap
        model_id: str = "",
        attention_backend: str = "auto",
        compile: bool = False,
    ) -> None:
        limit = model.num_speculative_tokens
        super().__init__(cache_config, model, limit if num_speculative_tokens is None else num_speculative_tokens,
                         attention_backend, model_id=model_id, max_speculative_tokens=limit)
        self.heads = heads
        self.vocab_size = heads.vocab_size
        self.target_hidden_size = model.hidden_size
        self.embed_fingerprint = heads.fingerprint()
        if compile:
            model.use_compiled(self.compile_config(), heads.model.embed_tokens.weight)
        elif model.dtype == torch.bfloat16 and (problem := model.use_native(heads.model.embed_tokens.weight)):
            log.info("DFlash block: torch forward (the native one cannot run: %s)", problem)
        elif model.native_block is not None:
            log.info("DFlash block: one native call per Propose (products on %s)", tile_kernel_name())

    def compile_config(self) -> CompileConfig:
        """Buckets for DFlash's steps, in rows: 1, 2, 4 and 8 blocks of K+1 (a step's blocks, and
        its new context rows, padded up to the next); larger steps run eagerly."""
        block = self.model.num_speculative_tokens + 1
        return CompileConfig(enabled=True, sizes=(block, 2 * block, 4 * block, 8 * block))

    @classmethod
    def load(cls, path: str, target_path: str, cache_config: CacheConfig, dtype: torch.dtype, device: str,
             k: int | None, attention_backend: str = "auto", compile: bool = False) -> DFlashDrafter:
        """`k` above the model's cap (block_size - 1) is lowered to it, with a warning."""
        heads = load_target_heads(target_path, dtype, device)
        pack_cpu_linears(heads, log)  # before TargetHeads takes its lm_head
        target = TargetHeads(embed=heads.embed, lm_head=heads.lm_head)
        model = DFlashDraftModel.from_pretrained(path, target, dtype, device)
        pack_cpu_linears(model, log, whole_forward_on_tiles=dtype == torch.bfloat16 and not compile)  # use_native
        limit = model.num_speculative_tokens
        if k is not None and k > limit:
            log.warning("--num-speculative-tokens %d exceeds DFlash block_size - 1; using %d", k, limit)
            k = limit
        return cls(model, heads, cache_config, k, model_id=str(path), attention_backend=attention_backend,
                   compile=compile)

    # -- handshake ------------------------------------------------------------------------

    def layer_specs(self) -> list[LayerSpec]:
        return self.model.kv_layer_specs()

    def target_layer_ids(self) -> list[int]:
        return self.model.target_layer_ids

    def layers_lacking(self, target: TargetInfo) -> str | None:
        ids = self.model.target_layer_ids
        return f"needs layers {ids}" if max(ids) >= target.num_layers else None

    # -- drafting -------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> dict[int, list[int]]:
        """Context K/V is written lazily: a sequence's rows are held until it drafts (or holds
        `max_held_rows`), so steps that send context without asking for drafts cost a copy; a
        drafting sequence's held rows go through the same forward as its block."""
        self._hold(items)
        # Block slots p .. p + block lie in the sequence's pages; p >= 1 context token, every
        # one of them written or held.
        wanted = [(seq, k, self._block_for(seq, k)) for seq, k in self._draft_counts(items)
                  if seq.num_context + seq.held_count == seq.context_len >= 1]
        drafts: dict[int, list[int]] = {}
        by_block = sorted(wanted, key=lambda item: item[2])
        for block, group in itertools.groupby(by_block, key=lambda item: item[2]):  # one forward per block size
            group = list(group)
            seqs = [seq for seq, _, _ in group]
            proposal = self.model.propose_greedy(
                [seq.last_token_id for seq in seqs],
                [seq.context_len for seq in seqs],
                [seq.page_table for seq in seqs],
                self._kv_caches,
                self._backend,
                num_tokens=block,
                new_context=self._take_held_rows(seqs),
                num_drafts=max(k for _, k, _ in group),  # the head's rows: only the drafts asked
            )
            for (seq, k, _), tokens in zip(group, proposal):
                drafts[seq.seq_id] = tokens[:k]
        return drafts

    def compile_ahead(self) -> None:
        """With the compiled forward: every bucket, blocks and context rows. None is left to compile
        in the background when first needed: a compile thread would take the cores from the target."""
        if self.model.compiled_block is not None:
            buckets = self.model.compiled_block.buckets()
            self.model.prepare_compiled(buckets, buckets)

    def _block_for(self, seq: DraftSequence, k: int) -> int:
        """The masks of the block that drafts `k` tokens: as many as the model was trained with
        whenever the sequence's pages hold them, the first k drafts kept: a block of fewer masks
        drafts worse than the first k of a whole one, and the extra masks cost a few rows of one
        forward (figures: docs/performance.md#the-adaptive-policys-rules)."""
        return max(k, min(self.model.num_speculative_tokens, self.draft_room(seq)))

    def _take_held_rows(self, seqs: list[DraftSequence]) -> NewContext | None:
        """The held rows of these sequences, with their positions and KV slots; they count as
        written context from here on (the forward they are handed to writes them)."""
        page_size = self.layout.page_size
        features: list[torch.Tensor] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in seqs:
            count = seq.held_count
            new = range(seq.num_context, seq.num_context + count)
            positions.extend(new)
            slots.extend(slot_of(seq.page_table, pos, page_size) for pos in new)
            features.extend(seq.held_rows)
            seq.num_context += count
            seq.held_rows = []
        if not features:
            return None
        return NewContext(
            features=(torch.cat(features) if len(features) > 1 else features[0]).to(self.device),  # [Tc, width]
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),  # [Tc]
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),  # [Tc]
        )

    def _warmup(self, kv_caches: dict[int, torch.Tensor], page_table: list[int], ctx: int) -> None:
        """The context write and one block of K drafts (DFlash's non-causal attention)."""
        meta = AttentionMetadata.build(query_lens=[ctx], seq_lens=[ctx], page_tables=[page_table],
                                       page_size=self.layout.page_size, device=self.device)
        features = torch.zeros(ctx, self.feature_width, dtype=self.model.dtype, device=self.device)  # [ctx, width]
        positions = torch.arange(ctx, device=self.device)  # [ctx]
        self.model.write_context(features, positions, meta, kv_caches, self._backend)
        self.model.propose_greedy([0], [ctx], [page_table], kv_caches, self._backend,
                                  num_tokens=self.num_speculative_tokens)

    def _write_context(self, seqs: list[DraftSequence]) -> None:
        """Positions num_context .. of each sequence: every row it holds."""
        if not seqs:
            return
        pending = [(seq, torch.cat(seq.held_rows) if len(seq.held_rows) > 1 else seq.held_rows[0]) for seq in seqs]
        for seq in seqs:
            seq.held_rows = []
        query_lens = [rows.shape[0] for _, rows in pending]
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=[seq.num_context + n for (seq, _), n in zip(pending, query_lens)],
            page_tables=[seq.page_table for seq, _ in pending],
            page_size=self.layout.page_size,
            device=self.device,
        )
        features = torch.cat([rows for _, rows in pending]).to(self.device)  # [T, n * hidden]
        positions = torch.cat(
            [torch.arange(seq.num_context, seq.num_context + n) for (seq, _), n in zip(pending, query_lens)]
        ).to(self.device)  # [T]: a sequence's new rows start where its written context ends
        self.model.write_context(features, positions, meta, self._kv_caches, self._backend)
        for (seq, _), n in zip(pending, query_lens):
            seq.num_context += n
