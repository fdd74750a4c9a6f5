"""Building and loading the C kernels in `common/native/` (paged attention, bfloat16 products).

Each source is compiled at load by the machine's C compiler (`$CC`, else `cc`) with
`-march=native`, once per source, flags, compiler and CPU, into a cache directory
(`$SPLITSPEC_KERNEL_CACHE`, else `$XDG_CACHE_HOME/splitspec/kernels`) that only this user may
write: a library loaded from it runs as this process. Where no compiler works the kernels are
unavailable and their callers fall back to torch's, saying why.

The libraries run their OpenMP loops on torch's own libgomp (loaded first, so the library's
`libgomp.so.1` resolves to it, as Inductor's kernels do): one thread pool, never two
competing for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("native")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math", "-ffp-contract=fast")


class NativeKernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (the message says why)."""


def kernel_cache_dir() -> Path:
    configured = os.environ.get("SPLITSPEC_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitspec" / "kernels"


def _compiler() -> str:
    name = os.environ.get("CC") or "cc"
    path = shutil.which(name) or shutil.which("gcc")
    if path is None:
        raise NativeKernelUnavailable(f"no C compiler ({name!r} or 'gcc' on PATH)")
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build_key(compiler: str, source: bytes) -> str:
    """What the library depends on: the source and every source it may include (the folder's),
    the flags, the compiler (its resolved path and mtime stand for its version) and the CPU
    (`-march=native`)."""
    binary = Path(compiler).resolve()
    compiler_id = f"{binary}:{binary.stat().st_mtime_ns}"
    siblings = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.c"))]
    parts = [source, *siblings, " ".join(FLAGS).encode(), compiler_id.encode(), _cpu_flags().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def build_library(source_name: str, cache_dir: Path | None = None) -> Path:
    """The compiled library of `common/native/<source_name>.c` for this machine: from the cache,
    or compiled into it now."""
    source_path = SOURCE_DIR / f"{source_name}.c"
    compiler, source = _compiler(), source_path.read_bytes()
    cache_dir = cache_dir or kernel_cache_dir()
    target = cache_dir / f"{source_name}-{_build_key(compiler, source)}.so"
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(cache_dir, directory=True)
    if os.path.lexists(target):
        _check_private(target, directory=False)
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # a sibling: os.replace stays one filesystem
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(source_path), "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise NativeKernelUnavailable(f"{compiler} failed on {source_path.name}: {result.stderr.strip()[-500:]}")
        built.chmod(0o755)  # whatever the umask: a group-writable library would be refused next start
        os.replace(built, target)  # atomic: a process loading beside this one sees all of it or none
    log.info("native kernels %s compiled into %s", source_name, target)
    return target


def _check_private(path: Path, directory: bool) -> None:
    """Refuse a cache folder or library that another user could have written: not ours, writable
    by group or others, a link, or not the kind of file expected."""
    info = os.lstat(path)
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind_ok or info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NativeKernelUnavailable(f"{path} is not a {'folder' if directory else 'file'} of this user that only it "
                                      "can write; not loading kernels from it")


def load_library(source_name: str, cache_dir: Path | None = None) -> ctypes.CDLL:
    """Build (or find) and load one kernel library; NativeKernelUnavailable if either fails."""
    return _load(source_name, cache_dir or kernel_cache_dir())


@functools.cache
def _load(source_name: str, cache_dir: Path) -> ctypes.CDLL:
    """One load per library and cache folder in a process (a failure is not cached: it raises)."""
    torch.get_num_threads()  # torch's libgomp is loaded first, so the library's libgomp.so.1 is the same one
    try:
        return ctypes.CDLL(str(build_library(source_name, cache_dir)))
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelUnavailable(f"{type(exc).__name__}: {exc}") from exc
