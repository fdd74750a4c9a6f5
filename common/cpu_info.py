"""What CPU a figure was measured on: model name, the flags that decide our kernels, caches.

Speed on a CPU depends on which of these a machine has (AMX multiplies bfloat16 tiles,
AVX512-BF16 has bfloat16 dot products, the cache sizes decide when weights stream from
memory), so every benchmark names them beside its figures.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

FLAGS_OF_INTEREST = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    cores: int
    flags: tuple[str, ...]  # those of FLAGS_OF_INTEREST the CPU reports
    caches: dict[str, str]  # {"L1d": "48K", "L2": "2048K", "L3": ...} per instance, as sysfs names them

    def describe(self) -> str:
        """One line for a benchmark's header."""
        flags = ", ".join(self.flags) or "none of " + "/".join(FLAGS_OF_INTEREST)
        caches = ", ".join(f"{level} {size}" for level, size in self.caches.items())
        return f"{self.model}, {self.cores} cores ({flags}; {caches or 'cache sizes unknown'})"


def read_cpu_info(cpuinfo: Path = Path("/proc/cpuinfo"), cache_dir: Path = CACHE_SYSFS) -> CpuInfo:
    """This machine's CPU, from /proc/cpuinfo and sysfs (the platform's name where those are absent)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in (platform.processor(), platform.machine()):
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return CpuInfo(model, os.cpu_count() or 1, tuple(f for f in FLAGS_OF_INTEREST if f in flags),
                   _cache_sizes(cache_dir))


def _cache_sizes(cache_dir: Path) -> dict[str, str]:
    sizes: dict[str, str] = {}
    for index in sorted(cache_dir.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            sizes[f"L{level}" + ("d" if kind == "Data" else "")] = size
    return sizes
