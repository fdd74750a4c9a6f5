"""The drafters' training data and DFlash step for scripts/train_demo.py: the target's greedy
continuations with its hidden states, and DFlash's block-wise training batch and step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from demo_training import Sizes, StepOptions, lr_at, optimizer_step, warmup_steps
from transformers.cache_utils import Cache, DynamicLayer

# ---------------------------------------------------------------------------------------
# Greedy continuations of the target, with its hidden states


@dataclass
class Continuations:
    ids: torch.Tensor  # [N, T] prompt + greedy continuation
    prompt_lens: torch.Tensor  # [N]
    valid_lens: torch.Tensor  # [N]: tokens up to and including the first EOS of the continuation
    feature_parts: list[torch.Tensor]  # [n_i, T, len(target_layer_ids) * hidden] float16 each, rows in order

    def __post_init__(self) -> None:
        sizes = torch.tensor([p.shape[0] for p in self.feature_parts])
        if int(sizes.sum()) != self.ids.shape[0]:
            raise ValueError("feature rows ≠ continuation rows")
        self._ends = sizes.cumsum(0)  # [parts]: one past each part's last row
        self._starts = self._ends - sizes

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] → [B, T, F] float32: the target's hidden states of those rows."""
        parts = torch.searchsorted(self._ends, rows, right=True).tolist()
        return torch.stack([self.feature_parts[p][r - int(self._starts[p])] for p, r in zip(parts, rows.tolist())]
                           ).float()


def preallocated_cache(target, capacity: int):
    """A transformers KV cache whose layers hold `capacity` positions from the start (see
    `PreallocatedLayer`), one layer per decoder layer of `target`."""
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(target.config.num_hidden_layers)])


class PreallocatedLayer(DynamicLayer):
    """transformers' DynamicLayer, but its keys and values are views of buffers sized for the
    whole decode ([B, H, capacity, D]), each step's rows written in place. DynamicLayer
    concatenates, copying the whole cache every step: at 192 sequences × 288 tokens that copy
    was half of a continuation batch's time (py-spy of `train_demo.py`)."""

    is_croppable = False  # DynamicLayer's crop and batch edits reassign `keys`, leaving the buffers behind

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.get_seq_length()  # the filled part (0 before the first update): `keys` is a view of it
        end = start + key_states.shape[-2]
        if end > self.capacity:  # checked first: a refused step leaves the layer as it was
            raise ValueError(f"the cache holds {self.capacity} positions; this step would fill {end}")
        if not self.is_initialized:
            self.device = key_states.device
            batch, heads, _, dim = key_states.shape
            self._k = key_states.new_empty(batch, heads, self.capacity, dim)
            self._v = value_states.new_empty(batch, value_states.shape[1], self.capacity, value_states.shape[-1])
            self.is_initialized = True
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def _unsupported(self, *args, **kwargs) -> None:
        raise NotImplementedError("PreallocatedLayer decodes one batch straight through: no crop, reorder or "
                                  "batch edits")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, total_len: int) -> torch.Tensor:
    """[B, P] → [B, total_len]: the target's greedy continuation, decoded with a KV cache."""
    out = target(input_ids=prompts, cache=preallocated_cache(target, total_len), use_cache=True)
    cache, tokens = out.cache, [out.logits[:, -1].argmax(-1)]
    for _ in range(total_len - prompts.shape[1] - 1):
        out = target(input_ids=tokens[-1][:, None], cache=cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


@torch.no_grad()
def greedy_continue_with_features(target, prompts: torch.Tensor, total_len: int, layer_ids
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] → ([B, total_len] ids, [B, total_len, len(layer_ids) * hidden] float16 features): the
    greedy continuation and the target's hidden states after `layer_ids` at every position, taken
    from the decoding forwards themselves (as the served target hands them to the drafter)."""
    from dflash.model import extract_context_feature

    def step(ids, cache):
        out = target(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, list(layer_ids)).to(torch.float16)
        return out.logits[:, -1].argmax(-1), out.cache, features

    token, cache, features = step(prompts, preallocated_cache(target, total_len))
    tokens, feature_steps = [token], [features]
    for _ in range(total_len - prompts.shape[1]):  # the last forward only yields the last token's features
        token, cache, features = step(tokens[-1][:, None], cache)
        tokens.append(token)
        feature_steps.append(features)
    ids = torch.cat([prompts, torch.stack(tokens[:-1], dim=1)], dim=1)  # [B, total_len]
    return ids, torch.cat(feature_steps, dim=1)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    from dflash.model import extract_context_feature

    out = target(input_ids=ids, output_hidden_states=True)
    return extract_context_feature(out.hidden_states, list(layer_ids))  # [B, T, n * hidden]


def valid_lengths(ids: torch.Tensor, prompt_len: int, eos_id: int) -> torch.Tensor:
    """[B, T] → [B]: tokens through the first EOS of each continuation (all T if none)."""
    is_eos = ids[:, prompt_len:] == eos_id
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.tensor(ids.shape[1] - prompt_len))
    return prompt_len + first


# ---------------------------------------------------------------------------------------
# DFlash


def dflash_config(sizes: Sizes, tokenizer):
    from transformers import Qwen3Config

    mask_id = tokenizer.mask_token_id
    return Qwen3Config(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.dflash_intermediate,
        num_hidden_layers=sizes.dflash_layers,
        num_attention_heads=sizes.dflash_heads,
        num_key_value_heads=sizes.dflash_kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=sizes.context,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_target_layers=sizes.layers,
        block_size=sizes.block_size,
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": list(sizes.target_layer_ids),
                       "block_size": sizes.block_size},
        attn_implementation="sdpa",
    )


def dflash_batch(data: Continuations, rows: torch.Tensor, sizes: Sizes, mask_id: int, generator):
    """One training batch of `dflash_anchors` blocks per sequence.

    Block j of a row sits at positions a_j .. a_j + K (anchor a_j ≥ the prompt length, so
    all K labels are the target's greedy tokens); its queries see the context features of
    positions < a_j and the whole block (non-causal), exactly as in `dflash_generate`.
    """
    k = sizes.block_size - 1
    n = sizes.dflash_anchors
    ids = data.ids[rows]  # [B, T]
    T = ids.shape[1]
    batch = rows.numel()
    anchors = torch.empty(batch, n, dtype=torch.long)
    for b, row in enumerate(rows.tolist()):
        low, high = int(data.prompt_lens[row]), int(data.valid_lens[row]) - 1  # anchors in [low, high)
        span = torch.arange(low, max(high, low + 1))
        pick = torch.randint(0, span.numel(), (n,), generator=generator) if span.numel() < n else \
            torch.randperm(span.numel(), generator=generator)[:n]
        anchors[b] = span[pick]
    offsets = torch.arange(sizes.block_size)  # [K + 1]
    positions = anchors[:, :, None] + offsets  # [B, n, K + 1]
    block_ids = torch.full((batch, n, sizes.block_size), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    label_pos = positions[:, :, 1:]  # [B, n, K]
    labels = ids.gather(1, label_pos.clamp(max=T - 1).view(batch, -1)).view(batch, n, k)
    valid_lens = data.valid_lens[rows][:, None, None]
    labels = labels.masked_fill(label_pos >= valid_lens, -100)
    q = n * sizes.block_size
    ctx_visible = torch.arange(T)[None, None, :] < anchors.repeat_interleave(sizes.block_size, 1)[:, :, None]
    block_of_query = torch.arange(q) // sizes.block_size
    own_block = block_of_query[:, None] == block_of_query[None, :]  # [q, q]
    mask = torch.cat([ctx_visible, own_block[None].expand(batch, q, q)], dim=2)[:, None]  # [B, 1, q, T + q]
    position_ids = torch.cat([torch.arange(T)[None].expand(batch, T), positions.view(batch, q)], dim=1)
    return block_ids.view(batch, q), labels, mask, position_ids


def dflash_step_fn(model, target, data: Continuations, sizes: Sizes, mask_id: int, opt, params, generator,
                   options: StepOptions):
    """One DFlash training step: random anchors in the continuations, CE on the block's K predictions
    weighted exp(-(k - 1) / gamma) toward the early ones (the DFlash paper's recipe)."""
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.lm_head
    k = sizes.block_size - 1
    decay = torch.exp(-torch.arange(k, dtype=torch.float32) / sizes.dflash_loss_gamma)  # [K]
    forward = options.wrap(model)
    warmup = warmup_steps(sizes.dflash_steps)

    def step(i: int) -> dict[str, float]:
        rows = torch.randint(0, data.ids.shape[0], (sizes.dflash_batch,), generator=generator)
        block_ids, labels, mask, position_ids = dflash_batch(data, rows, sizes, mask_id, generator)
        target_hidden = data.features(rows)  # [B, T, n_layers * hidden]
        with options.autocast():
            hidden = forward(
                position_ids=position_ids,
                attention_mask=mask,
                noise_embedding=F.embedding(block_ids, embed),
                target_hidden=target_hidden,
            )  # [B, n * (K + 1), hidden]
            hidden = hidden.view(sizes.dflash_batch, sizes.dflash_anchors, sizes.block_size, -1)[:, :, 1:]
            logits = model.compute_logits(hidden, lm_head).float()  # [B, n, K, V]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view_as(labels)
        valid = (labels != -100).float()
        loss = (ce * valid * decay).sum() / (valid * decay).sum().clamp_min(1.0)
        optimizer_step(opt, params, loss, lr_at(i, sizes.dflash_steps, sizes.dflash_lr, warmup))
        with torch.no_grad():  # expected accepted length of greedy blocks (prefix of matches)
            hit = ((logits.argmax(-1) == labels) | (labels == -100)).long().cumprod(-1) * valid.long()
        return {"loss": loss.item(), "accepted": hit.sum(-1).float().mean().item()}

    return step
