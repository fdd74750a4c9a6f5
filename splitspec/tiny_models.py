"""Tiny checkpoints in the real Hugging Face formats, built locally (no hub access), for the
benchmarks and the tests (tests/tiny_models.py adds their reference drafters).

`make_tokenizer` trains a byte-level BPE on a few Python source files of the running
interpreter; `make_qwen3` saves a random `Qwen3ForCausalLM` beside it. `PROMPTS` are
short code snippets to feed them.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from splitspec.tokenizer import train_bpe_tokenizer


def _training_text() -> list[str]:
    import collections
    import dataclasses
    import json as json_module

    return [inspect.getsource(m) for m in (collections, dataclasses, json_module.decoder)]


def make_tokenizer(out_dir: Path, vocab_size: int = 512):
    """A byte-level BPE tokenizer that `AutoTokenizer.from_pretrained(out_dir)` loads."""
    return train_bpe_tokenizer(_training_text(), vocab_size, out_dir)


# The tiny decoder of every test and benchmark checkpoint (each family adds its own fields).
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None)


def qwen3_config(vocab_size: int, **overrides):
    """A tiny Qwen3 config; `overrides` replace (or add) fields."""
    from transformers import Qwen3Config

    fields = dict(vocab_size=vocab_size, **TINY_SHAPE, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
                  eos_token_id=0, pad_token_id=0)
    return Qwen3Config(**{**fields, **overrides})


def make_qwen3(out_dir: Path, *, seed: int = 0, tokenizer_vocab: int = 512, **overrides) -> Path:
    """Save a random Qwen3ForCausalLM (float32 safetensors) and its tokenizer to out_dir."""
    from transformers import Qwen3ForCausalLM

    tokenizer = make_tokenizer(out_dir, tokenizer_vocab)
    config = qwen3_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    # Random init gives near-uniform logits; widen them so greedy choices are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    generation_config = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))
    return out_dir


PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Point:\n    def __init__(self, x, y):",
    "for i in range(10):\n    print(i)",
    "# a comment about dataclasses",
    "return self._data[key]",
    "if __name__ == '__main__':",
    "with open(path) as f:\n",
    "x = [i * i for i in range(100)]",
    "raise ValueError('bad value')",
    "def __repr__(self):\n        return",
    "try:\n    import json\nexcept ImportError:",
    "lambda a, b: a + b",
    "async def fetch(session, url):",
    "while True:\n    line = input()",
    "from collections import OrderedDict",
    "self.assertEqual(result, expected)",
    "@property\ndef name(self):",
    "yield from iterable",
    "d = {'a': 1, 'b': 2}",
]
