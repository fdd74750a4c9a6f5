"""The demo's held-out set: standard-library modules the demo models never trained on.

The training script keeps these out of its corpus; the evaluation and `splitspec bench`
draw prompts from them, so acceptance and speed are measured on unseen code.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HELD_OUT = ("textwrap", "shlex", "fractions", "statistics", "calendar", "heapq", "colorsys", "graphlib")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_files() -> list[Path]:
    """The held-out modules of the running interpreter, in HELD_OUT order."""
    root = stdlib_dir()
    return [root / f"{name}.py" for name in HELD_OUT if (root / f"{name}.py").is_file()]


def held_out_prompts(num_prompts: int, prompt_chars: int = 400) -> list[str]:
    """Code up to and through `def` lines spread over the held-out modules, round-robin."""
    per_file = []
    for path in held_out_files():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        per_file.append([_prefix_through(lines, i, prompt_chars) for i, line in enumerate(lines)
                         if line.lstrip().startswith("def ") and i >= 5])
    prompts: list[str] = []
    depth = 0
    while len(prompts) < num_prompts and any(depth < len(p) for p in per_file):
        prompts.extend(p[depth] for p in per_file if depth < len(p))
        depth += 1
    return prompts[:num_prompts]


def _prefix_through(lines: list[str], index: int, max_chars: int) -> str:
    start, size = index, len(lines[index])
    while start > 0 and size + len(lines[start - 1]) <= max_chars:
        start -= 1
        size += len(lines[start])
    return "".join(lines[start : index + 1])
