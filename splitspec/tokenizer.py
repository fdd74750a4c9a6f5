"""The byte-level BPE tokenizer of the demo pair and the tests' tiny checkpoints.

Qwen-style special tokens (EOS `<|endoftext|>`, the DFlash mask `<|mask|>`, chat markers)
and chat template, trained with `tokenizers` and saved so that
`AutoTokenizer.from_pretrained(out_dir)` loads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS = "<|endoftext|>"
MASK = "<|mask|>"
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>"]
SPECIAL_TOKENS = [EOS, *CHAT_MARKERS, MASK]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train on `texts`, save to `out_dir`; the `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        additional_special_tokens=CHAT_MARKERS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 30
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
