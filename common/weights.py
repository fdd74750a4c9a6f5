"""Finding a checkpoint and reading its config and safetensors (no network access)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


class ModelNotFoundError(FileNotFoundError):
    """Neither a local folder nor a snapshot in the local Hugging Face cache."""


def resolve_model_path(name_or_path: str, cache_dir: str | None = None) -> Path:
    """A local checkpoint folder, or a Hugging Face id resolved from the local cache only."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ModelNotFoundError(f"model path {name_or_path!r} is a file; expected a checkpoint folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return Path(snapshot_download(name_or_path, cache_dir=cache_dir, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - hub raises several types; all mean "not here"
        where = cache_dir or HF_HUB_CACHE
        raise ModelNotFoundError(
            f"model {name_or_path!r} is not a local folder and not in the Hugging Face cache {where} "
            f"(looked for a local directory {str(local)!r} and a cached snapshot of repo {name_or_path!r}; "
            f"download it first, e.g. `hf download {name_or_path}`): {type(exc).__name__}: {exc}"
        ) from exc


def load_config(path: str | Path):
    """The checkpoint's transformers config (AutoConfig; no modeling code is imported)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's weight files: from the index json when present, else every *.safetensors."""
    folder = Path(path)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists weight files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def iter_safetensors(path: str | Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face tensor name, tensor) for every tensor of the checkpoint."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
