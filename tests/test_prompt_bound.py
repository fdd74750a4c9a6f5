"""The byte bound on text that can fit the model (target_service/prompt_bound.py): it must
never refuse a text that would fit, so its argument is checked here against the real
tokenizers — texts longer than the bound always tokenize past the model length — and
its NFC factor against the Unicode data; pipelines it cannot reason about get no bound.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from target_service.prompt_bound import NORMALIZER_SHRINK, text_byte_bound
from tests.tiny_models import make_tokenizer

REPO = Path(__file__).resolve().parents[1]
SMALL_MODEL_LEN = 6  # so that a few hundred bytes already pass the bound


def with_normalizer(tokenizer_dir: Path, normalizer: dict | None, out_dir: Path, **edits):
    from transformers import AutoTokenizer

    out_dir.mkdir()
    for f in tokenizer_dir.iterdir():
        (out_dir / f.name).write_bytes(f.read_bytes())
    pipeline = json.loads((out_dir / "tokenizer.json").read_text())
    pipeline["normalizer"] = normalizer
    for key, value in edits.items():
        pipeline[key] = value
    (out_dir / "tokenizer.json").write_text(json.dumps(pipeline))
    return AutoTokenizer.from_pretrained(out_dir)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The demo tokenizer (its longest token is 45 bytes of whitespace), the tests' tiny
    one, and the demo one behind an NFC normalizer (as Qwen's tokenizers are)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("bound")
    demo = AutoTokenizer.from_pretrained(REPO / "demo" / "tokenizer")
    tiny = make_tokenizer(root / "tiny")
    nfc = with_normalizer(REPO / "demo" / "tokenizer", {"type": "NFC"}, root / "nfc")
    return {"demo": demo, "tiny": tiny, "nfc": nfc}


def vocabulary_text(tokenizer) -> st.SearchStrategy[str]:
    """Texts made of the tokenizer's own tokens (its longest ones often), special tokens,
    whitespace runs, and code points NFC shrinks the most."""
    vocab = sorted(tokenizer.get_vocab(), key=len)
    pieces = [tokenizer.convert_tokens_to_string([t]) for t in vocab[-64:] + vocab[::37]]
    shrinking = ["\u1fef", "\u0390", "\u1100\u1161\u11a8", "e\u0301", "\u212b"]  # NFD/NFC shrinks these
    unit = st.one_of(st.sampled_from(pieces), st.sampled_from(tokenizer.all_special_tokens),
                     st.sampled_from(shrinking), st.text(max_size=4), st.sampled_from([" " * 40, "\n" * 12, "\t"]))
    return st.builds(lambda parts, n: "".join(parts) * n, st.lists(unit, min_size=1, max_size=60),
                     st.integers(1, 200))


# 300 generated texts a tokenizer, a second or two each: the NFC-normalized demo tokenizer (the
# byte bound and the NFC factor at once) runs in make test-fast, the other two in make test.
@pytest.mark.parametrize("name", [pytest.param("demo", marks=pytest.mark.slow),
                                  pytest.param("tiny", marks=pytest.mark.slow), "nfc"])
def test_a_text_past_the_bound_never_fits(tokenizers, name):
    tokenizer = tokenizers[name]
    bound = text_byte_bound(tokenizer, SMALL_MODEL_LEN)
    assert bound is not None
    seen_past = []

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=vocabulary_text(tokenizer))
    def check(text: str) -> None:
        if len(text.encode()) > bound:
            seen_past.append(text)
            assert len(tokenizer.encode(text)) >= SMALL_MODEL_LEN, (bound, text)

    check()
    assert len(seen_past) > 30, "the strategy must produce texts past the bound"


def test_the_bound_is_the_longest_token_times_the_room_for_a_prompt(tokenizers):
    demo = tokenizers["demo"]
    longest = max(len(token) for token in demo.get_vocab())  # byte-level: one character a byte
    assert text_byte_bound(demo, 512) == longest * 511
    assert text_byte_bound(tokenizers["nfc"], 512) == NORMALIZER_SHRINK["NFC"] * longest * 511
    # the longest token, repeated, fills the model exactly: the bound cannot be much lower
    token = max(demo.get_vocab(), key=len)
    text = demo.convert_tokens_to_string([token]) * (SMALL_MODEL_LEN - 1)
    assert len(text.encode()) == text_byte_bound(demo, SMALL_MODEL_LEN)


def test_pipelines_without_a_provable_bound_get_none(tokenizers, tmp_path):
    demo_dir = REPO / "demo" / "tokenizer"
    nfkc = with_normalizer(demo_dir, {"type": "NFKC"}, tmp_path / "nfkc")  # shrinks without limit (e.g. U+FDFA)
    assert text_byte_bound(nfkc, 512) is None
    pipeline = json.loads((demo_dir / "tokenizer.json").read_text())
    greedy_special = [dict(t, lstrip=True) for t in pipeline["added_tokens"]]  # swallows any run of spaces
    assert text_byte_bound(with_normalizer(demo_dir, None, tmp_path / "lstrip", added_tokens=greedy_special),
                           512) is None
    dropping = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, pipeline["pre_tokenizer"]]}
    assert text_byte_bound(with_normalizer(demo_dir, None, tmp_path / "ws", pre_tokenizer=dropping), 512) is None


def test_nfc_shrinks_utf8_at_most_ninefold():
    """The factor in prompt_bound.py: decomposing a code point shrinks it at most 3x, and
    composing a decomposed sequence into one code point at most 3x."""
    decompose = compose = 1.0
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        size, decomposed = len(c.encode()), len(unicodedata.normalize("NFD", c).encode())
        decompose = max(decompose, size / decomposed)
        if unicodedata.normalize("NFC", c) == c:
            compose = max(compose, decomposed / size)
    assert decompose <= 3 and compose <= 3 and decompose * compose <= NORMALIZER_SHRINK["NFC"]
