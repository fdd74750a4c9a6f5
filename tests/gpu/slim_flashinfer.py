#!/usr/bin/env python
"""Slim flashinfer-python's wheel to the sources its attention JIT compiles, and repack it.

The wheel (62 MB) carries `flashinfer/data/{csrc,include,cutlass,cccl,spdlog}` (332 MB
unpacked) for every kernel family FlashInfer has. The modules splitspec loads are built
from a few files that flashinfer-python 0.7.x's generators read or copy:
  flashinfer/jit/attention/modules.py  gen_customize_batch_prefill_module, FA2 branch
      (batch_prefill_customize_config.jinja, batch_prefill_{paged,ragged}_kernel_inst.jinja,
      batch_prefill.cu, batch_prefill_jit_binding.cu, batch_prefill_paged{.cu,_jit_binding.cu,.cuh})
      and gen_customize_batch_decode_module (batch_decode*.{cu,jinja})
  flashinfer/jit/page.py               gen_page_module (page.cu, flashinfer_page_binding.cu)
plus every header those include, found on the include path FlashInfer compiles with
(flashinfer/jit/env.py and cpp_ext.get_system_includes). This keeps that closure, every
top-level header and template of csrc, and all of include/, spdlog/ and cccl/ (see
KEEP_WHOLE); it drops the rest of csrc/ and cutlass/ (the FA2 kernels include no CUTLASS),
and writes a valid wheel: same name and metadata, a RECORD with every file's sha256 and
size.

    python tests/gpu/slim_flashinfer.py flashinfer_python-0.7.2.post1-py3-none-any.whl OUT_DIR

`--compile-check DIR` (with the slim flashinfer importable, a CUDA toolkit and
FLASHINFER_CUDA_ARCH_LIST set) runs FlashInfer's own compile commands for those modules:
every source preprocessed, two compiled whole (COMPILED). prepare.sh does this where nvcc
exists, so a missing header shows up here rather than on the GPU. (Preprocessing alone
is not enough: a vendored CCCL header missing from the copy is silently taken from the
toolkit's own, other, CCCL version, and only the compile fails.)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import posixpath
import re
import sys
import zipfile
from pathlib import Path

DATA = "flashinfer/data/"
ROOT_SOURCES = (
    "batch_prefill_customize_config.jinja", "batch_prefill_paged_kernel_inst.jinja",
    "batch_prefill_ragged_kernel_inst.jinja", "batch_prefill.cu", "batch_prefill_jit_binding.cu",
    "batch_prefill_paged.cu", "batch_prefill_paged_jit_binding.cu", "batch_prefill_paged.cuh",
    "batch_decode_customize_config.jinja", "batch_decode_kernel_inst.jinja", "batch_decode.cu",
    "batch_decode_jit_binding.cu", "page.cu", "flashinfer_page_binding.cu",
)
INCLUDE_DIRS = ("csrc", "include", "cutlass/include", "cutlass/tools/util/include", "spdlog/include",
                "cccl/cub", "cccl/libcudacxx/include", "cccl/thrust")
# Kept whole. cccl/ above all: it comes first on nvcc's include path, ahead of the CUDA
# toolkit's own CCCL, so a vendored header the textual closure misses (reached through a
# macro or __has_include) would silently be taken from the toolkit's other CCCL version.
KEEP_WHOLE = ("include/", "spdlog/", "cccl/")
KEEP_CSRC_TOP = re.compile(r"^csrc/[^/]+\.(h|cuh|hpp|inc|jinja)$")
INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.M)


def include_closure(read, names: set[str], roots: list[str]) -> set[str]:
    """Paths (relative to data/) reached from `roots` through #include lines, each looked up
    beside the including file, then on the include path; `read(path)` gives a file's bytes."""
    seen: set[str] = set()
    todo = [r for r in roots if r in names]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        here = posixpath.dirname(path)
        for included in INCLUDE.findall(read(path)):
            name = included.decode(errors="replace")
            for folder in (here, *INCLUDE_DIRS):
                candidate = posixpath.normpath(posixpath.join(folder, name))
                if candidate in names:
                    todo.append(candidate)
                    break
    return seen


def kept_data(zf: zipfile.ZipFile) -> set[str]:
    """The data/ files the slim wheel keeps (relative to data/)."""
    names = {n[len(DATA):] for n in zf.namelist() if n.startswith(DATA) and not n.endswith("/")}
    closure = include_closure(lambda p: zf.read(DATA + p), names, [f"csrc/{r}" for r in ROOT_SOURCES])
    missing = [r for r in ROOT_SOURCES if f"csrc/{r}" not in names]
    if missing:
        raise SystemExit(f"the wheel lacks sources FlashInfer's attention JIT reads: {', '.join(missing)}; "
                         "is this the flashinfer-python version splitspec expects?")
    return closure | {n for n in names if n.startswith(KEEP_WHOLE) or KEEP_CSRC_TOP.match(n)}


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim_wheel(source: Path, out_dir: Path) -> Path:
    """Write the slim copy of `source` into `out_dir` (same file name); its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    with zipfile.ZipFile(source) as zf:
        keep = kept_data(zf)
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for info in zf.infolist():
                name = info.filename
                if name.endswith("/") or name == record:
                    continue
                if name.startswith(DATA) and name[len(DATA):] not in keep:
                    continue
                data = zf.read(info)
                copy = zipfile.ZipInfo(name, date_time=info.date_time)
                copy.external_attr = info.external_attr
                copy.compress_type = zipfile.ZIP_DEFLATED
                out.writestr(copy, data)
                lines.append(record_line(name, data))
            lines.append(f"{record},,")
            out.writestr(zipfile.ZipInfo(record, date_time=(2020, 1, 1, 0, 0, 0)), "\n".join(lines) + "\n")
    return target


def verify_wheel(path: Path) -> int:
    """Check every RECORD entry against the archive (as an installer would); the file count."""
    with zipfile.ZipFile(path) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        entries = [line.rsplit(",", 2) for line in zf.read(record).decode().splitlines() if line]
        files = {n for n in zf.namelist() if not n.endswith("/")}
        listed = {name for name, _, _ in entries}
        if listed != files:
            raise ValueError(f"RECORD and archive differ: {sorted(listed ^ files)[:5]}")
        for name, digest, size in entries:
            if name == record:
                continue
            data = zf.read(name)
            if record_line(name, data) != f"{name},{digest},{size}":
                raise ValueError(f"RECORD entry of {name} does not match its bytes")
    return len(entries)


# Compiled whole by --compile-check (the rest only preprocessed): the page module's kernel
# and one FA2 prefill kernel, which between them include every kind of header kept.
COMPILED = ("page.cu", "batch_prefill_paged_kernel_mask_1.cu")


def compile_check(out_dir: Path) -> int:
    """Run FlashInfer's own compile commands for the modules splitspec loads against the
    installed (slim) flashinfer: every source preprocessed (`-E`), COMPILED ones compiled
    into `out_dir`. The number of sources that failed."""
    import shlex
    import subprocess

    import torch
    from flashinfer.jit.attention import modules
    from flashinfer.jit.page import gen_page_module

    specs = [gen_page_module()]
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for head_dim in (64, 128):
            specs.append(modules._gen_batch_prefill_primary_module(
                "fa2", torch.bfloat16, kv_dtype, torch.bfloat16, torch.int32, head_dim, head_dim, 0, False, False,
                False))
    failed, compiled = 0, set()
    for spec in specs:
        for entry in spec.get_compile_commands():
            name = Path(entry["file"]).name
            command = shlex.split(entry["command"])
            if name in COMPILED and name not in compiled:
                compiled.add(name)
                command[command.index("-o") + 1] = str(out_dir / f"{name}.o")
            else:
                command = ["-E" if part == "-c" else part for part in command]
                command[command.index("-o") + 1] = "/dev/null"
            run = subprocess.run(command, capture_output=True, text=True, check=False)
            if run.returncode:
                failed += 1
                print(f"{spec.name}: {name} fails:\n{run.stderr[-2000:]}", file=sys.stderr)
    print(f"FlashInfer's compile commands for {len(specs)} modules against the slim wheel "
          f"({', '.join(sorted(compiled))} compiled, the rest preprocessed): "
          f"{'all fine' if not failed else f'{failed} failed'}")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", type=Path, nargs="?")
    p.add_argument("out_dir", type=Path, nargs="?")
    p.add_argument("--compile-check", type=Path, metavar="TMP_DIR",
                   help="check the installed (slim) flashinfer instead, compiling into TMP_DIR")
    args = p.parse_args(argv)
    if args.compile_check:
        return 1 if compile_check(args.compile_check) else 0
    if args.wheel is None or args.out_dir is None:
        p.error("give the wheel and the output folder")
    slim = slim_wheel(args.wheel, args.out_dir)
    count = verify_wheel(slim)
    print(f"{slim}: {slim.stat().st_size / 2**20:.1f} MiB, {count} files (was "
          f"{args.wheel.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
