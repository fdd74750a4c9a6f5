"""Incremental detokenization that never emits a broken UTF-8 character, and stop strings.

Follows the prefix/read-offset scheme used by vLLM and TGI: decode a short window of
tokens twice (with and without the newest ones) and emit only the stable difference;
a window that ends in U+FFFD is an incomplete byte sequence and waits for more tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # tokens before the read offset that give the decoder its context


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_ids: list[int]
    stop_strings: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    text: str = ""  # all stable text so far
    _emitted: int = 0  # chars of `text` already handed out

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._holdback = max((len(s) for s in self.stop_strings), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def find_stop(self) -> bool:
        """Truncate `text` before the first stop string; True if one was found."""
        hits = [i for s in self.stop_strings if (i := self.text.find(s, max(0, self._emitted - len(s)))) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take(self, final: bool) -> str:
        """Text not handed out yet; holds back a possible stop-string prefix unless final."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        chunk = self.text[self._emitted : end]
        self._emitted = end
        return chunk
