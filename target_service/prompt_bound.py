"""How many bytes of text can still fit the model, known before tokenizing the text.

Tokenizing is the expensive part of a text request (a 12 MB text took 12 s and
1.3 GB), so text that cannot fit `max_model_len` is refused on its byte length alone.
The bound must never refuse a prompt that would fit, so it is only given for tokenizers
whose pipeline we can reason about, and is `None` (no early refusal; the text is then
tokenized off the event loop and refused on its token count) for any other.

The argument, for a byte-level BPE (GPT-2 / Qwen style):
- every byte of the text the model sees ends up in exactly one token: the byte-level
  pre-tokenizer maps each byte to one character of a 256-character alphabet that the
  vocabulary holds in full, and the splitting pre-tokenizers allowed here drop nothing;
- a vocabulary token covers as many bytes as it has characters, an added (special)
  token as many as its content has, so no token covers more than L bytes, the longest;
- added tokens are matched on the raw text and must not swallow the whitespace around
  them (`lstrip`/`rstrip` would let one token cover any number of spaces);
- the normalizer may shrink the text before that: not at all without one; NFC by at
  most 9x in UTF-8 bytes (3x when decomposing a code point, e.g. U+1FEF → U+0060, then
  3x when composing, e.g. three 3-byte Hangul jamo → one 3-byte syllable; a stable bound,
  since Unicode adds no new canonical compositions).
So a text of B bytes becomes at least B / (shrink × L) tokens; a prompt needs at most
max_model_len - 1 of them (one token left to generate), and a text longer than
shrink × L × (max_model_len - 1) bytes cannot fit.
"""

from __future__ import annotations

import json

# UTF-8 bytes of the input per byte of the normalized text, at most (see above)
NORMALIZER_SHRINK = {None: 1, "NFC": 9}
LOSSLESS_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        shrink = 1
        for step in normalizer.get("normalizers", []):
            factor = _normalizer_shrink(step)
            if factor is None:
                return None
            shrink *= factor
        return shrink
    return NORMALIZER_SHRINK.get(normalizer.get("type"))


def _pre_tokenizer_steps(pre_tokenizer: dict | None) -> list[dict] | None:
    """The steps of a byte-level pre-tokenizer that drops nothing; None for any other."""
    if pre_tokenizer is None:
        return None
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    for step in steps:
        kind = step.get("type")
        if kind == "Split" and step.get("behavior") in LOSSLESS_SPLITS:
            continue
        if kind not in ("ByteLevel", "Digits"):
            return None
    return steps if any(step.get("type") == "ByteLevel" for step in steps) else None


def _longest_token_bytes(model: dict, added_tokens: list[dict]) -> int | None:
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
        return None
    if not set(ByteLevel.alphabet()) <= vocab.keys():
        return None  # a byte outside the vocabulary could be dropped
    if any(token.get("lstrip") or token.get("rstrip") for token in added_tokens):
        return None
    longest_added = max((len(token.get("content", "").encode()) for token in added_tokens), default=0)
    return max(max(len(token) for token in vocab), longest_added)


def text_byte_bound(tokenizer, max_model_len: int) -> int | None:
    """Bytes of UTF-8 text above which a prompt cannot fit `max_model_len` tokens with one
    left to generate, for this (Hugging Face fast) tokenizer; None when no such bound is
    provable for its pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or max_model_len < 1:
        return None
    pipeline = json.loads(backend.to_str())
    shrink = _normalizer_shrink(pipeline.get("normalizer"))
    if shrink is None or _pre_tokenizer_steps(pipeline.get("pre_tokenizer")) is None:
        return None
    longest = _longest_token_bytes(pipeline.get("model") or {}, pipeline.get("added_tokens") or [])
    if longest is None:
        return None
    return shrink * longest * (max_model_len - 1)
