#!/usr/bin/env python
"""Store checkpoints' floating-point weights in bfloat16: half the bytes of float32.

    python scripts/demo_bf16.py demo            # every *.safetensors under demo/, in place

The bundled demo pair travels with every checkout (and to the GPU machine, where all that
is sent must stay under 64 MiB), so scripts/train_demo.py stores it this way. The loaders
cast on load (common/weights.py, common/qwen3.py, draft_service/dflash_model.py): on a CPU the services
still compute in float32, from the bf16 values; `--dtype auto` on a GPU picks bfloat16 from
config.json. transformers and the `dflash` package load the files as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def store_bf16(folder: Path) -> list[Path]:
    """Convert every *.safetensors under `folder` in place; set `dtype` in each config.json beside one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    converted = []
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if all(t.dtype == torch.bfloat16 or not t.is_floating_point() for t in tensors.values()):
            continue
        tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()}
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, str(partial), metadata=metadata)
        partial.replace(path)
        config = path.parent / "config.json"
        if config.is_file():
            values = json.loads(config.read_text())
            values["dtype"] = "bfloat16"
            config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
        converted.append(path)
    return converted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    for path in store_bf16(args.folder):
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
