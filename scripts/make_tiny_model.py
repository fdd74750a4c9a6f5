"""Write a tiny random Qwen3 checkpoint (+ tokenizer) in Hugging Face format, if missing.

A stand-in until the trained demo pair lands: it exercises the whole stack, but its text
is noise. Usage: python scripts/make_tiny_model.py OUT_DIR
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import make_qwen3  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if (args.out_dir / "config.json").exists():
        return
    make_qwen3(args.out_dir, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
               num_hidden_layers=args.layers, head_dim=32)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
