"""Structured output: a grammar (JSON schema, any JSON object, a regex, a choice list) that
constrains what a sequence may emit, enforced on every verify row (llguidance).

`GrammarCompiler` turns a request's `StructuredOutputParams` into a `CompiledGrammar`, off the
event loop, after bounding what it is asked to compile, and caches a bounded number of them.
Each sequence gets its own matcher (`SequenceGrammar`), whose state always equals the
sequence's output tokens. The seam in the sampling path is `constrain_rows`: for a sequence
with drafts d1..dK, row i of its [K+1, V] verify logits is masked with what the grammar
allows after d1..di, found by advancing the matcher through the drafts and rolling it back.
A draft token the grammar forbids ends the draft there, as a mismatch would (the engine cuts
drafts there before the forward, `SequenceGrammar.valid_prefix`, so no row is computed for it). Greedy or sampled, each row then equals the row of target-only constrained
decoding at that position, so the accept rule (spec_decode.py) keeps the output lossless.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from target_service.api_types import InvalidRequestError, StructuredOutputKind, StructuredOutputParams

log = logging.getLogger(__name__)

BITS = 32  # tokens per word of a bitmask row


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost: checked before compiling (depth) or enforced by llguidance while
    it compiles and while it computes each mask (its fuel), so a hostile schema is refused, not run."""

    max_schema_depth: int = 32  # nesting of objects/arrays in a JSON schema document
    max_grammar_size: int = 200_000  # symbols in the compiled grammar's productions
    max_lexer_states: int = 100_000  # about 1-2 kB each
    # building the lexer: llguidance's default (1,000,000) let a regex of nested counted repetitions
    # spend 3-5 s on its first mask; this keeps that under ~0.3 s on a busy 2-core machine
    initial_lexer_fuel: int = 100_000
    step_lexer_fuel: int = 200_000  # ~15 ms per mask at most
    step_max_items: int = 50_000  # Earley items per mask
    max_items_in_row: int = 2_000
    cache_size: int = 128  # compiled grammars kept (least recently used dropped)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"GrammarLimits.{name} must be positive, got {value}")

    def parser_limits(self):
        import llguidance

        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size, verbose_errors=False)


class CompiledGrammar:
    """A compiled grammar: a template matcher that each sequence copies."""

    def __init__(self, template, eos_token_id: int) -> None:
        self._template = template  # llguidance.LLMatcher, never advanced
        self._eos = eos_token_id

    def new_sequence(self) -> SequenceGrammar:
        return SequenceGrammar(self._template.deep_copy(), self._eos)


class SequenceGrammar:
    """One sequence's grammar state: what it has emitted so far, and what may follow."""

    def __init__(self, matcher, eos_token_id: int) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self._eos = eos_token_id

    @property
    def terminated(self) -> bool:
        """Nothing but the end of the sequence may follow."""
        return self._matcher.is_stopped()

    @property
    def broken(self) -> bool:
        """The matcher failed (a forbidden token, a mask past its fuel) and vouches for nothing more."""
        return self._matcher.is_error()

    def valid_prefix(self, draft: list[int]) -> int:
        """How many of the draft's tokens the grammar takes in a row, from its current state (unchanged)."""
        return self._matcher.validate_tokens(draft)

    def accept(self, token: int) -> bool:
        """Advance by an emitted token; False when the grammar forbids it (the matcher is then broken)."""
        return self._matcher.consume_token(token)

    def error(self) -> str:
        return self._matcher.get_error()

    def fill_verify_masks(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> int:
        """Write the masks of rows row..row+n into `bitmask` [R, W] int32 and return n, the drafts the
        grammar allows in a row (n <= len(draft)): row + i holds what may follow draft[:i]. The
        matcher advances through those drafts and is rolled back, so its state is unchanged."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._matcher.is_error():  # e.g. a mask past its fuel: the row stays sampleable, accept() ends it
            bitmask[row] = 0
            bit = self._eos % BITS
            bitmask[row, self._eos // BITS] = 1 << bit if bit < BITS - 1 else -(1 << bit)  # int32's sign bit
            return 0
        advanced = 0
        for token in draft:
            if not _allowed(bitmask[row + advanced], token) or not self._matcher.consume_token(token):
                break
            advanced += 1
            fill_next_token_bitmask(self._matcher, bitmask, row + advanced)
        if advanced:
            self._matcher.rollback(advanced)
        return advanced


def _allowed(mask_row: torch.Tensor, token: int) -> bool:
    """Bit `token` of a bitmask row [W] int32."""
    return bool((int(mask_row[token // BITS]) >> (token % BITS)) & 1)


def constrain_rows(
    logits: torch.Tensor,  # [N, V] every sampling sequence's rows, in order (its K+1 verify rows, or 1)
    spans: list[tuple[int, int, list[int]]],  # per sampling sequence: its rows [lo, hi) and its draft
    grammars: list[SequenceGrammar | None],  # per sampling sequence, in the same order
) -> list[tuple[int, int, list[int]]]:
    """Mask, in place, each constrained sequence's rows to what its grammar allows there, and cut its
    draft at the first token the grammar forbids (that draft is rejected, as a mismatch is). Returns
    the spans to verify: a cut draft's span ends at the row that replaces the forbidden token."""
    if not any(g is not None for g in grammars):
        return spans
    words = (logits.shape[-1] + BITS - 1) // BITS
    bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32)  # [N, W]; all allowed by default
    constrained: list[int] = []  # rows whose mask was written
    verified = []
    for (lo, hi, draft), grammar in zip(spans, grammars, strict=True):
        if grammar is None:
            verified.append((lo, hi, draft))
            continue
        kept = grammar.fill_verify_masks(bitmask, lo, draft)
        constrained.extend(range(lo, lo + kept + 1))
        verified.append((lo, lo + kept + 1, draft[:kept]))
    rows = torch.tensor(constrained, dtype=torch.long)  # [R]
    allowed = _unpack(bitmask[rows], logits.shape[-1]).to(logits.device)  # [R, V] bool
    index = rows.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return verified


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bitmask → [R, V] bool (bit j of word w is token 32·w + j)."""
    shifts = torch.arange(BITS, dtype=torch.int32)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


class GrammarCompiler:
    """StructuredOutputParams → CompiledGrammar for one tokenizer and vocabulary. Thread-safe;
    compiles on the caller's thread (never the event loop's: llguidance releases the GIL)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 limits: GrammarLimits = GrammarLimits()) -> None:
        import llguidance.hf

        # the logits' width, which may exceed the tokenizer's (padded embeddings): those ids are never allowed
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(eos_token_ids) or None)
        self.limits = limits
        self._parser_limits = limits.parser_limits()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """The compiled grammar of `params`, from the cache when it was compiled before;
        InvalidRequestError naming the field when the grammar is invalid or too costly."""
        key = params.cache_key()
        with self._lock:
            if (found := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return found
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def _compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        import llguidance

        grammar = self._grammar_text(params)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._parser_limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the lexer is built lazily: pay for it here, not in the first step
        if matcher.is_error():
            raise InvalidRequestError(params.field_name, f"cannot be compiled: {_first_line(matcher.get_error())}")
        return CompiledGrammar(matcher, self._tokenizer.eos_token)

    def _grammar_text(self, params: StructuredOutputParams) -> str:
        import llguidance

        options = {"whitespace_flexible": not params.disable_any_whitespace}
        match params.kind:
            case StructuredOutputKind.JSON_SCHEMA:
                schema = _parse_schema(params.spec, params.field_name, self.limits.max_schema_depth)
                try:
                    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
                except ValueError as exc:
                    raise InvalidRequestError(params.field_name, f"is not a JSON schema: {exc}") from exc
            case StructuredOutputKind.JSON_OBJECT:
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
            case StructuredOutputKind.REGEX:
                return llguidance.LLMatcher.grammar_from_regex(params.spec)
            case StructuredOutputKind.CHOICE:
                # lark string literals take JSON's escapes: any choice text is matched literally
                alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choices)
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        raise InvalidRequestError(params.field_name, f"unknown kind {params.kind}")


def _parse_schema(text: str, field_name: str, max_depth: int) -> dict:
    """A JSON schema document, refused when it is not a JSON object or nests deeper than `max_depth`
    (checked on the parsed value without recursion, before the compiler recurses through it)."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(field_name, f"is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError(field_name, f"must be a JSON object (a schema), got {type(schema).__name__}")
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequestError(field_name, f"nests deeper than {max_depth} levels")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return schema


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return line[:300]
