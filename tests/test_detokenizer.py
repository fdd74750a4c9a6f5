import pytest

from target_service.detokenizer import IncrementalDetokenizer
from tests.tiny_models import make_tokenizer

TEXTS = [
    "def héllo(wörld):\n    return '日本語テキスト' + \"🙂🚀\"",
    "plain ascii text with spaces   and\ttabs\n",
    "ünïcödé — em dash, “quotes”, and ✓ marks",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_never_breaks_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 4  # multi-byte chars are split over several tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("prompt: "))
    chunks = []
    for token in ids:
        detok.add_token(token)
        chunks.append(detok.take(final=False))
    chunks.append(detok.take(final=True))
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_stop_string_truncates_and_is_never_emitted(tokenizer):
    text = "alpha beta STOP gamma"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[], stop_strings=("STOP", "zzz"))
    chunks, stopped = [], False
    for token in tokenizer.encode(text):
        detok.add_token(token)
        if detok.find_stop():
            stopped = True
            break
        chunks.append(detok.take(final=False))
    chunks.append(detok.take(final=True))
    assert stopped
    assert "".join(chunks) == "alpha beta "
    assert not any("S" in c for c in chunks)


def test_skips_special_tokens(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[])
    for token in tokenizer.encode("ok") + [tokenizer.eos_token_id]:
        detok.add_token(token)
    assert detok.take(final=True) == "ok"
