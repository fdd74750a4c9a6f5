"""The EAGLE-3 drafter (draft_service/eagle3_model.py) on the shared pool.

Per sequence and step, the target hands over the hidden states entering its layers
`aux_layer_ids` for each new context token, through the staging rows DFlash reads too
(the target captures after layer i - 1 for EAGLE-3's id i). Context position p's draft
K/V pairs those features with token p + 1, so the newest context position (the last
token's predecessor) is rewritten by every proposal, as the query of its first step:
  num_context      context positions whose K/V is written for good (all but the newest)
  held_rows        feature rows of positions num_context .. context_len - 1
A proposal of k drafts runs one forward over the held rows (the last row's output is draft
1), then k - 1 single-row steps, each on its own draft token and the pre-norm output of the
step before. Those steps' K/V (positions last .. last + k - 2) is scratch: the target's
features of the accepted tokens replace it next time.
"""

from __future__ import annotations

import logging

import torch

from common.attention_metadata import AttentionMetadata
from common.cpu_linear import pack_cpu_linears
from common.kv_layout import CacheConfig, LayerSpec
from common.weights import load_config, resolve_model_path
from draft_service.drafters.base import DraftSequence, FeatureDrafter, ProposeItem, TargetInfo
from draft_service.eagle3_model import Eagle3DraftModel, default_aux_layer_ids, read_eagle3_config

log = logging.getLogger(__name__)


class Eagle3Drafter(FeatureDrafter):
    kind = "eagle3"

    def __init__(self, model: Eagle3DraftModel, cache_config: CacheConfig,
                 num_speculative_tokens: int, model_id: str = "",
                 attention_backend: str = "auto", embed_fingerprint: str = "",
                 target_num_layers: int | None = None) -> None:
        super().__init__(cache_config, model, num_speculative_tokens, attention_backend, model_id=model_id)
        self.vocab_size = model.config.vocab_size
        self.target_hidden_size = model.config.target_hidden_size
        self.embed_fingerprint = embed_fingerprint  # of the target's embedding it borrows ("" when its own)
        configured = model.config.aux_layer_ids
        # Known now when the checkpoint names them or the target's depth is known; else at Negotiate.
        self.aux_layer_ids: tuple[int, ...] | None = (
            configured if configured is not None or target_num_layers is None
            else default_aux_layer_ids(target_num_layers))

    @classmethod
    def load(cls, path: str, target_path: str | None, cache_config: CacheConfig, dtype: torch.dtype,
             device: str, k: int, attention_backend: str = "auto") -> Eagle3Drafter:
        """The target's checkpoint is read for its embedding when the head has none, and for
        its depth (the default aux layers); only those."""
        embed, fingerprint, depth = None, "", None
        if target_path:
            depth = int(load_config(resolve_model_path(target_path)).num_hidden_layers)
        if target_path and not _has_own_embedding(path):
            from draft_service.target_heads import load_target_heads

            heads = load_target_heads(target_path, dtype, device)
            embed, fingerprint = heads.model.embed_tokens, heads.fingerprint()
        model = Eagle3DraftModel.from_pretrained(path, dtype, device, embed=embed)
        pack_cpu_linears(model, log)
        return cls(model, cache_config, k, model_id=str(path), attention_backend=attention_backend,
                   embed_fingerprint=fingerprint, target_num_layers=depth)

    # -- handshake ------------------------------------------------------------------------

    def layer_specs(self) -> list[LayerSpec]:
        return self.model.kv_layer_specs()

    def target_layer_ids(self) -> list[int]:
        """The target layers after which the features are captured: EAGLE-3 id i is the state
        entering layer i, our capture of layer i - 1."""
        if self.aux_layer_ids is None:
            raise ValueError("the EAGLE-3 aux layers are resolved at Negotiate (the target's depth)")
        return [i - 1 for i in self.aux_layer_ids]

    def check_target(self, target: TargetInfo) -> None:
        super().check_target(target)
        self.aux_layer_ids = self._aux_layer_ids(target)

    def _aux_layer_ids(self, target: TargetInfo) -> tuple[int, ...]:
        return tuple(self.model.config.aux_layer_ids or default_aux_layer_ids(target.num_layers))

    def layers_lacking(self, target: TargetInfo) -> str | None:
        ids = self._aux_layer_ids(target)
        if all(1 <= i < target.num_layers for i in ids):
            return None
        return f"eagle_aux_hidden_state_layer_ids {list(ids)} need ids in 1..num_layers - 1"

    # -- drafting -------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> dict[int, list[int]]:
        self._hold(items)
        counts = [(seq, k) for seq, k in self._draft_counts(items) if self._rows_cover_context(seq)]
        if not counts:
            return {}
        seqs = [seq for seq, _ in counts]
        prenorm = self._first_step(seqs)  # [B, hidden]
        tokens = self.model.greedy_target_ids(prenorm)  # [B]
        drafts = [[token] for token in tokens.tolist()]
        for step in range(1, max(k for _, k in counts)):
            active = [b for b, (_, k) in enumerate(counts) if k > step]
            index = torch.tensor(active, dtype=torch.long, device=self.device)
            prenorm = self._draft_step([seqs[b] for b in active], tokens[index], prenorm[index], step)
            tokens = self.model.greedy_target_ids(prenorm)  # [len(active)]
            for b, token in zip(active, tokens.tolist()):
                drafts[b].append(token)
        return {seq.seq_id: seq_drafts[:k] for (seq, k), seq_drafts in zip(counts, drafts)}

    @staticmethod
    def _rows_cover_context(seq: DraftSequence) -> bool:
        """Every context position has its K/V written or its feature row held (and there is one)."""
        return seq.num_context + seq.held_count == seq.context_len >= 1

    def _holds_too_many(self, seq: DraftSequence) -> bool:
        """The newest row stays held (the next proposal's query): too many beyond it."""
        return seq.held_count > self.max_held_rows and self._rows_cover_context(seq)

    def _first_step(self, seqs: list[DraftSequence]) -> torch.Tensor:
        """Every held row through the head, its last row the query of draft 1; the pre-norm
        output of each sequence's last row [B, hidden]. All but that row are written for good."""
        out, last_rows = self._forward_rows(seqs, keep_last=True)
        return out[last_rows]

    def _write_context(self, seqs: list[DraftSequence]) -> None:
        """Context K/V of the held rows of sequences drafting no more, all but the newest."""
        if seqs:
            self._forward_rows(seqs, keep_last=False)

    def _forward_rows(self, seqs: list[DraftSequence], keep_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the held rows of `seqs` (with keep_last=False, all but each one's
        newest); positions num_context .., tokens one ahead. The newest row stays held. The
        pre-norm outputs [T, hidden] and each sequence's last row in them [B]."""
        rows, ids, positions, query_lens = [], [], [], []
        for seq in seqs:
            held = torch.cat(seq.held_rows) if len(seq.held_rows) > 1 else seq.held_rows[0]  # [n, width]
            count = held.shape[0] if keep_last else held.shape[0] - 1
            start = seq.num_context
            rows.append(held[:count])
            ids.extend(seq.token_ids[start + 1 : start + count + 1])
            positions.extend(range(start, start + count))
            query_lens.append(count)
            seq.held_rows = [held[count - 1 :]] if keep_last else [held[count:]]
            seq.num_context = start + count - 1 if keep_last else start + count
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=[seq.num_context + (1 if keep_last else 0) for seq in seqs],
            page_tables=[seq.page_table for seq in seqs],
            page_size=self.layout.page_size,
            device=self.device,
        )
        features = torch.cat(rows).to(self.device)  # [T, width]
        out = self._run(ids, self.model.project_features(features), positions, meta)
        return out, meta.query_start_loc[1:].long() - 1

    def _draft_step(self, seqs: list[DraftSequence], tokens: torch.Tensor, prenorm: torch.Tensor,
                    step: int) -> torch.Tensor:
        """Draft `step` (0-based) of each sequence, fed at position last - 1 + step with the
        previous step's pre-norm output; this step's pre-norm output [B, hidden]."""
        positions = [seq.last_position - 1 + step for seq in seqs]
        meta = AttentionMetadata.build(query_lens=[1] * len(seqs), seq_lens=[p + 1 for p in positions],
                                       page_tables=[seq.page_table for seq in seqs],
                                       page_size=self.layout.page_size, device=self.device)
        return self._run(tokens, prenorm, positions, meta)

    def _run(self, ids, hidden: torch.Tensor, positions: list[int], meta: AttentionMetadata,
             kv_caches: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        self._backend.plan(meta)
        input_ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        caches = self._kv_caches if kv_caches is None else kv_caches
        return self.model(input_ids, hidden, pos, meta, caches, self._backend)  # [T, hidden]

    def _warmup(self, kv_caches: dict[int, torch.Tensor], page_table: list[int], ctx: int) -> None:
        """The first step over a scratch context, then one single-row draft step."""
        page_size = self.layout.page_size
        meta = AttentionMetadata.build(query_lens=[ctx], seq_lens=[ctx], page_tables=[page_table],
                                       page_size=page_size, device=self.device)
        features = torch.zeros(ctx, self.feature_width, dtype=self.model.dtype,
                               device=self.device)  # [ctx, width]
        out = self._run([0] * ctx, self.model.project_features(features), list(range(ctx)), meta, kv_caches)
        token = self.model.greedy_target_ids(out[-1:])  # [1]
        meta = AttentionMetadata.build(query_lens=[1], seq_lens=[ctx + 1], page_tables=[page_table],
                                       page_size=page_size, device=self.device)
        self._run(token, out[-1:], [ctx], meta, kv_caches)


def _has_own_embedding(path: str) -> bool:
    from safetensors import safe_open

    from common.weights import safetensors_files
    from draft_service.eagle3_model import EMBED_NAME

    folder = resolve_model_path(path)
    read_eagle3_config(folder)  # not an EAGLE-3 head: say so before reading the target
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if EMBED_NAME in f.keys():
                return True
    return False
