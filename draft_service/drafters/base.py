"""The drafter interface and the per-sequence bookkeeping every drafter shares.

A target sends, per sequence and per step, only what is new (`Update`, the plain mirror
of `splitspec.v1.SequenceUpdate`): the context tokens whose target KV now exists, the
newest sampled token, and pages appended to the page table. `Drafter.update` folds
that into a `DraftSequence`; a sequence whose update does not continue where the
drafter left off is out of sync and is dropped (it finishes without speculation).

Token positions of a `DraftSequence` with n = len(token_ids):
  0 .. n-2   context tokens (the target's KV and hidden states exist)
  n-1        the last sampled token (the first token of the next verify block)
  0 .. num_context-1   tokens whose draft-layer KV in the pool is written and valid
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

import splitspec.contract as defaults
from common.attention_backends import select_backend
from common.kv_layout import ORDERS, CacheConfig, KVLayout, LayerSpec
from common.kv_pool import PagePool
from common.pool_transport import TorchBuild, sync_for_handoff

KINDS = ("dflash", "eagle3", "draft_model", "ngram")
DEFAULT_NUM_SPECULATIVE_TOKENS = defaults.NUM_SPECULATIVE_TOKENS
WARMUP_CONTEXT = 3  # context tokens of the scratch sequence a warm-up drafts for

log = logging.getLogger(__name__)


def check_num_speculative_tokens(k: int, limit: int | None = None) -> None:
    """The one rule for a drafter's K: at least 1, and at most `limit` where the model caps it."""
    if limit is not None and not 1 <= k <= limit:
        raise ValueError(f"num_speculative_tokens must be in 1..{limit} (DFlash block_size - 1), got {k}")
    if k <= 0:
        raise ValueError(f"num_speculative_tokens must be positive, got {k}")


class IncompatibleTargetError(Exception):
    """The target cannot be served by this drafter (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class TargetInfo:
    """What the target says it is (`splitspec.v1.TargetFacts`, minus the layout wishes)."""

    architecture: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    num_layers: int = 0
    fingerprint: str = ""
    kv_dtype: str = ""  # a key of common.kv_layout.KV_DTYPES, "" when unspecified
    device_type: str = "cpu"
    max_model_len: int = 0
    torch_build: TorchBuild = TorchBuild("")  # what the target runs; CUDA IPC needs the drafter's


def mismatch(name: str, target, drafter) -> str:
    """One incompatibility, naming both values: "vocab_size: target 512, drafter 600"."""
    return f"{name}: target {target}, drafter {drafter}"


def raise_mismatches(problems: list[str]) -> None:
    if problems:
        raise IncompatibleTargetError("; ".join(problems))


@dataclass(frozen=True)
class Update:
    """What is new for one sequence since the previous Propose (see drafter.proto)."""

    seq_id: int
    context_start: int
    context_token_ids: tuple[int, ...]
    last_token_id: int
    new_pages: tuple[int, ...] = ()
    staging_row: int = 0
    num_speculative_tokens: int = 0
    cached_context_tokens: int = 0  # with context_start 0: leading tokens whose draft KV is already in the pages

    @property
    def num_staged_rows(self) -> int:
        """Staging rows the update brings: one per context token the drafter has no KV for."""
        return len(self.context_token_ids) - self.cached_context_tokens


@dataclass
class DraftSequence:
    seq_id: int
    token_ids: list[int]  # context tokens, then the last token
    page_table: list[int]
    num_context: int = 0  # tokens whose draft-layer KV is written
    # Tokens whose draft KV was written, as scratch, at positions num_context, +1, ...
    # (a draft LM's own drafts); the prefix the target accepts stays valid.
    scratch_token_ids: list[int] = field(default_factory=list)
    # Hidden-state rows received for positions num_context .. whose KV is not written yet
    # (DFlash writes a sequence's context only when it drafts): each [n, width], in order.
    held_rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def held_count(self) -> int:
        """Rows held for positions num_context, num_context + 1, ..."""
        return sum(rows.shape[0] for rows in self.held_rows)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return len(self.token_ids) - 1

    @property
    def last_position(self) -> int:
        return len(self.token_ids) - 1

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def capacity(self, page_size: int) -> int:
        """Token slots the page table covers."""
        return len(self.page_table) * page_size

    def extend(self, update: Update) -> None:
        """Append an in-sync update (context_start == context_len)."""
        old_last = self.last_position
        if not update.context_token_ids and update.last_token_id != self.last_token_id:
            self.num_context = min(self.num_context, old_last)  # that position's KV is stale now
        self.token_ids[-1:] = [*update.context_token_ids, update.last_token_id]
        self.page_table.extend(update.new_pages)
        self._keep_accepted_scratch()

    def _keep_accepted_scratch(self) -> None:
        """Scratch KV whose token the target accepted at that position is valid context KV."""
        for token in self.scratch_token_ids:
            if self.num_context >= self.num_tokens or self.token_ids[self.num_context] != token:
                break
            self.num_context += 1
        self.scratch_token_ids = []


# One entry of a Propose batch: the sequence, its new context rows of the staging buffer
# (copied out, [n, width], or None) and the number of drafts wanted (0: record only).
ProposeItem = tuple[DraftSequence, "torch.Tensor | None", int]


class Drafter:
    """Base of every drafter: sequence bookkeeping plus the hooks a kind implements.

    Subclasses set `kind` and implement `propose`; the ones with layers in the pool derive
    from `PooledDrafter` and override `layer_specs`. K is checked here, once.
    """

    kind: str = ""
    model_id: str = ""
    vocab_size: int | None = None  # None: token ids are not checked against a vocabulary
    feature_width: int = 0  # staging row width the drafter reads (0: no staging)

    def __init__(self, cache_config: CacheConfig, device: torch.device | str = "cpu",
                 num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, *,
                 max_speculative_tokens: int | None = None) -> None:
        check_num_speculative_tokens(num_speculative_tokens, max_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.sequences: dict[int, DraftSequence] = {}
        self.pool: PagePool | None = None

    def draft_room(self, seq: DraftSequence) -> int:
        """The most drafts whose KV slots lie in `seq`'s pages (no bound: this drafter writes no KV)."""
        return self.num_speculative_tokens

    # -- facts for the handshake ----------------------------------------------------------

    def layer_specs(self) -> list[LayerSpec]:
        """The draft layers this drafter needs in the pool (owner "draft", offsets unset)."""
        return []

    def target_layer_ids(self) -> list[int]:
        """Target layers whose hidden states the drafter reads from the staging buffer."""
        return []

    def supported_orders(self) -> tuple[str, ...]:
        return ORDERS

    def check_target(self, target: TargetInfo) -> None:
        """Raise IncompatibleTargetError naming both values of every mismatch: the vocabulary
        (where the drafter has one), then what `target_mismatches` finds."""
        problems = []
        if self.vocab_size is not None and target.vocab_size != self.vocab_size:
            problems.append(mismatch("vocab_size", target.vocab_size, self.vocab_size))
        raise_mismatches(problems + self.target_mismatches(target))

    def target_mismatches(self, target: TargetInfo) -> list[str]:
        """The kind's own incompatibilities with `target` besides the vocabulary, each a `mismatch`."""
        return []

    @property
    def needs_pool(self) -> bool:
        return bool(self.layer_specs()) or self.feature_width > 0

    # -- the pool ---------------------------------------------------------------------------

    def bind(self, pool: PagePool | None, layout: KVLayout) -> None:
        """Use `pool` laid out as `layout` from now on; every copy of the cache config sees it."""
        self.unbind()
        self._bind(pool, layout)
        self.pool = pool
        self.cache_config.resolve_layout(layout)

    def unbind(self) -> None:
        """Drop the pool views and every sequence (a new target or handshake epoch)."""
        self.cache_config.layout_state.clear()
        self.sequences.clear()
        self.pool = None
        self._unbind()

    def _bind(self, pool: PagePool | None, layout: KVLayout) -> None:
        pass

    def _unbind(self) -> None:
        pass

    def warmup(self) -> float:
        """Pay the one-time costs of drafting (kernel compiles) now; the seconds it took.
        The server calls it at Attach, after `bind`. Nothing to warm by default."""
        return 0.0

    def compile_ahead(self) -> None:
        """Compile what the drafter's compiled forward (`--compile`) needs, at load, before the
        server reports SERVING: an Attach has a deadline, and compiling takes seconds a bucket.
        Nothing to compile by default."""

    # -- sequences --------------------------------------------------------------------------

    def update(self, update: Update) -> DraftSequence | None:
        """Fold an update into the sequence; None (and dropped) when it is out of sync."""
        if update.context_start == 0:
            tokens = [*update.context_token_ids, update.last_token_id]
            seq = DraftSequence(update.seq_id, tokens, list(update.new_pages),
                                num_context=update.cached_context_tokens)
            self.sequences[update.seq_id] = seq
            return seq
        seq = self.sequences.get(update.seq_id)
        in_sync = (
            seq is not None
            and update.context_start == seq.context_len
            and (not update.context_token_ids or update.context_token_ids[0] == seq.last_token_id)
        )
        if not in_sync:
            self.forget(update.seq_id)
            return None
        seq.extend(update)
        return seq

    def forget(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)

    def written_context(self, seq_ids) -> dict[int, int]:
        """For a drafter with layers in the pool: per known sequence, its leading context
        tokens whose draft KV is written (what the target's prefix cache may reuse)."""
        if not self.layer_specs():
            return {}
        return {seq_id: min(seq.num_context, seq.context_len)
                for seq_id in seq_ids if (seq := self.sequences.get(seq_id)) is not None}

    def forget_all(self) -> None:
        self.sequences.clear()

    # -- drafting ---------------------------------------------------------------------------

    def propose(self, items: list[ProposeItem]) -> dict[int, list[int]]:
        """Record every item's new context and return greedy drafts for those with k > 0."""
        raise NotImplementedError

    @property
    def layout(self) -> KVLayout:
        """The bound layout; LayoutNotResolvedError before Attach."""
        return self.cache_config.layout


class PooledDrafter(Drafter):
    """A drafter with its own layers in the pool, run by the selected attention backend on
    views of their regions (`_kv_caches`, by draft layer index) while bound."""

    # KV slots a proposal of k drafts writes past positions last .. last + k - 1
    # (DFlash's block [last token, mask x k] writes one more than a draft LM does).
    extra_kv_slots = 0

    def __init__(self, cache_config: CacheConfig, model: torch.nn.Module, num_speculative_tokens: int,
                 attention_backend: str = "auto", *, model_id: str = "",
                 max_speculative_tokens: int | None = None) -> None:
        params = next(model.parameters())
        super().__init__(cache_config, params.device, num_speculative_tokens,
                         max_speculative_tokens=max_speculative_tokens)
        self.model = model
        self.model_id = model_id
        self._backend = None  # an AttentionBackend over the bound layout
        self._kv_caches: dict[int, torch.Tensor] = {}
        self.attention_backend = attention_backend  # --attention-backend
        self.model_dtype = params.dtype

    def backend_class(self, kv_dtype: torch.dtype | None = None) -> type:
        head_dims = tuple(sorted({spec.head_dim for spec in self.layer_specs()}))
        return select_backend(self.attention_backend, self.device, head_dims=head_dims,
                              model_dtype=self.model_dtype, kv_dtype=kv_dtype)

    def supported_orders(self) -> tuple[str, ...]:
        return self.backend_class().supported_orders(self.device)

    def _bind(self, pool: PagePool | None, layout: KVLayout) -> None:
        if pool is None:
            raise ValueError(f"the {self.kind} drafter needs the KV pool")
        self._kv_caches = {spec.index: pool.region(layout.layer("draft", spec.index)) for spec in self.layer_specs()}
        self._backend = self.backend_class(layout.torch_dtype)(layout)

    def _unbind(self) -> None:
        self._kv_caches = {}
        self._backend = None

    @torch.inference_mode()
    def warmup(self) -> float:
        """Run every attention kernel a Propose uses, once, on scratch pages of the bound
        layout's format outside the pool (the target's pages are not touched), so their
        one-time costs — FlashInfer compiles a kernel on its first use, for minutes — are
        paid at Attach rather than inside the first Propose (a 2 s deadline, on the event
        loop). The seconds it took."""
        started = time.monotonic()
        layout = self.layout  # LayoutNotResolvedError before bind
        tokens = WARMUP_CONTEXT + self.num_speculative_tokens + self.extra_kv_slots + 1
        num_pages = -(-tokens // layout.page_size)
        caches = {
            spec.index: torch.zeros((num_pages, *layout.region_shape(spec)[1:]), dtype=layout.torch_dtype,
                                    device=self.device)  # [scratch pages, 2, <page shape>]
            for spec in (layout.layer("draft", s.index) for s in self.layer_specs())
        }
        self._warmup(caches, list(range(num_pages)), WARMUP_CONTEXT)
        sync_for_handoff(self.device)
        seconds = time.monotonic() - started
        log.info("warmed the %s attention backend in %.2f s (scratch pages, %s, page %d, %s)",
                 self._backend.name, seconds, layout.kv_dtype, layout.page_size, layout.order)
        return seconds

    def _warmup(self, kv_caches: dict[int, torch.Tensor], page_table: list[int], ctx: int) -> None:
        """One scratch sequence of `ctx` context tokens in `page_table`, through every kind of
        attention step the drafter runs."""
        raise NotImplementedError

    def draft_room(self, seq: DraftSequence) -> int:
        """The most drafts whose every KV slot (`extra_kv_slots` included) lies in `seq`'s pages."""
        return seq.capacity(self.layout.page_size) - seq.last_position - self.extra_kv_slots

    def _draft_counts(self, items: list[ProposeItem]) -> list[tuple[DraftSequence, int]]:
        """(sequence, k) for the items that want drafts (k already bounded by the host: `draft_room`)."""
        return [(seq, k) for seq, _rows, k in items if k > 0]


class FeatureDrafter(PooledDrafter):
    """A pooled drafter that reads the target's hidden states (DFlash, EAGLE-3): each
    sequence's staging rows are copied out and held (`DraftSequence.held_rows`) until it
    drafts, when they go through the same forward as its drafting; a sequence that drafts
    nothing has its context K/V written once it holds `max_held_rows`."""

    # Rows a sequence may hold before its context K/V is written even though it drafts no
    # more (bounds the drafter's memory: 256 rows of 3 target layers x 256 floats are 768 KB).
    max_held_rows = 256
    # What the target must be: its hidden size (that of the features), and the fingerprint of
    # the embedding and lm_head the drafter borrows from it ("" when it has its own).
    target_hidden_size: int
    embed_fingerprint: str = ""

    def __init__(self, cache_config: CacheConfig, model: torch.nn.Module, num_speculative_tokens: int,
                 attention_backend: str = "auto", *, model_id: str = "",
                 max_speculative_tokens: int | None = None) -> None:
        super().__init__(cache_config, model, num_speculative_tokens, attention_backend, model_id=model_id,
                         max_speculative_tokens=max_speculative_tokens)
        self.feature_width = model.feature_width

    def target_mismatches(self, target: TargetInfo) -> list[str]:
        problems = []
        if target.hidden_size != self.target_hidden_size:
            problems.append(mismatch("hidden_size", target.hidden_size, self.target_hidden_size))
        if self.embed_fingerprint and target.fingerprint != self.embed_fingerprint:
            problems.append(mismatch("fingerprint of embedding/lm_head", target.fingerprint or "(none)",
                                     self.embed_fingerprint))
        if (needs := self.layers_lacking(target)) is not None:
            problems.append(mismatch("num_layers", target.num_layers, needs))
        return problems

    def layers_lacking(self, target: TargetInfo) -> str | None:
        """What the drafter needs of the target's layers that `target` lacks; None when it has them."""
        raise NotImplementedError

    def _hold(self, items: list[ProposeItem]) -> None:
        """Hold every item's new rows; the sequences drafting nothing now that hold too many
        (`_holds_too_many`) have their context K/V written."""
        drafting = {seq.seq_id for seq, _, k in items if k > 0}
        for seq, rows, _ in items:
            if rows is not None and rows.shape[0] > 0:
                seq.held_rows.append(rows)
        self._write_context([seq for seq, _, _ in items
                             if seq.seq_id not in drafting and self._holds_too_many(seq)])

    def _holds_too_many(self, seq: DraftSequence) -> bool:
        return seq.held_count >= self.max_held_rows

    def _write_context(self, seqs: list[DraftSequence]) -> None:
        """Write the context K/V of the rows `seqs` hold (batched), without drafting."""
        raise NotImplementedError
