"""Prompts tokenized so that text a client wrote never becomes a special token.

A tokenizer matches its special tokens (`<|im_end|>`, `<|endoftext|>`, ...) anywhere in the
text it is given. Rendering a chat template over the messages and tokenizing the result
(what most servers do) therefore reads a `<|im_end|>` typed in a user's message as the
template's own end of turn: the user can close their turn and write a system turn of
their own. Here the template is rendered around placeholders (a random nonce per
request, which no client can guess), the template's own text is tokenized with its special
tokens, and each message's content is tokenized as plain text, where `<|im_end|>` is the
bytes `<`, `|`, `im`, ... like any other text. A `text` prompt is plain text too, unless
the request sets `parse_special_tokens` (a client that wants special tokens can already
send token ids, so the opt-in gives nobody a new power).

Roles are not placeholders (templates compare them: `role == "user"`); a role that holds a
special token is refused. A template that transforms a message's content (Qwen3 drops the
`<think>` part of earlier assistant turns) sees the placeholder, so the content goes in as
sent.

The plain-text tokenizer is a copy of the backend with `encode_special_tokens` set, rather
than the `split_special_tokens` argument, which flips that flag on the shared backend and
would race with the other tokenizing thread.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from target_service.api_types import InvalidRequestError


@dataclass(frozen=True)
class ChatPieces:
    """A rendered chat before tokenizing: the template's text and the contents, in order."""

    pieces: tuple[tuple[str, bool], ...]  # (text, True when it is a message's content)

    def text_bytes(self) -> int:
        return sum(len(text.encode()) for text, _ in self.pieces)


@dataclass
class PromptTokenizer:
    """The model's tokenizer as prompts use it (one per server; safe across threads)."""

    tokenizer: object  # a Hugging Face fast tokenizer
    _plain: object = field(init=False, repr=False)
    _specials: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer

        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(self.tokenizer).__name__} is not a fast tokenizer: prompts need one, so that "
                             "text can be tokenized without reading special tokens in it")
        self._plain = Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._plain.no_truncation()  # as transformers calls it: a prompt is never cut short
        self._plain.no_padding()
        added = self.tokenizer.added_tokens_decoder.values()
        self._specials = tuple(sorted({t.content for t in added if t.special}, key=len, reverse=True))

    def text(self, text: str, parse_special_tokens: bool = False) -> tuple[int, ...]:
        """A text prompt's ids (with the tokenizer's BOS etc. as it adds them)."""
        if parse_special_tokens:
            return tuple(self.tokenizer.encode(text))
        return tuple(self._encode(text, add_special_tokens=True))

    def plain(self, text: str) -> list[int]:
        """Ids of text as plain text, nothing added."""
        return self._encode(text, add_special_tokens=False) if text else []

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it tokenizes (encode does not): the other
        # streams go on meanwhile, as with transformers' own call
        return self._plain.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def template_text(self, text: str) -> list[int]:
        """Ids of text the chat template wrote (its special tokens are special)."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def special_in(self, text: str) -> str | None:
        """The first special token written in `text`, or None."""
        return next((token for token in self._specials if token in text), None)

    def render_chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> ChatPieces:
        """(role, content) pairs rendered by the chat template around placeholders."""
        for i, (role, _) in enumerate(messages):
            if (token := self.special_in(role)) is not None:
                raise InvalidRequestError("input.chat.messages", f"message {i}'s role contains the special token "
                                          f"{token!r}")
        nonce = secrets.token_hex(12)
        rendered = self.tokenizer.apply_chat_template(
            [{"role": role, "content": f"\x00{nonce}:{i}\x00"} for i, (role, _) in enumerate(messages)],
            add_generation_prompt=add_generation_prompt, tokenize=False)
        split = re.split(f"\x00{nonce}:(\\d+)\x00", rendered)
        return ChatPieces(tuple((piece, False) if k % 2 == 0 else (messages[int(piece)][1], True)
                                for k, piece in enumerate(split)))

    def chat_ids(self, chat: ChatPieces) -> tuple[int, ...]:
        """The template's text with its special tokens, each content as plain text."""
        ids: list[int] = []
        for text, content in chat.pieces:
            ids.extend(self.plain(text) if content else self.template_text(text))
        return tuple(ids)
