#!/usr/bin/env bash
# Run HERE (where the package registries are reachable), before a GPU run: every wheel the
# GPU machine needs goes into one git-ignored folder (.whl/, carried by the device tool),
# then the total that will travel (tracked + untracked files + that folder) is printed; it
# fails at 64 MiB or more.
#
# The GPU machine's image (python 3.12, torch 2.11 + CUDA 13, nvcc, ninja, transformers,
# safetensors, tokenizers, prometheus-client, pytest, jinja2, requests, ...) lacks:
#   flashinfer-python 0.7.2.post1  slimmed to the sources its attention JIT compiles
#                                  (tests/gpu/slim_flashinfer.py: 59 -> ~19 MiB)
#   apache-tvm-ffi                 flashinfer's only import-time dependency missing there
#   grpcio-health-checking, grpcio-reflection   our services serve both
#   grpcio, protobuf               the versions the generated stubs were made with (they
#                                  check grpcio >= GRPC_GENERATED_VERSION and the protobuf
#                                  runtime at import), taken from this checkout's venv
# Where nvcc exists here, FlashInfer's own compile commands for the modules we load run
# against the slim copy (every source preprocessed, two compiled: about a minute).
#
#   tests/gpu/prepare.sh            PYTHON=.venv/bin/python by default; SPLITSPEC_WHEEL_DIR=.whl
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DEST=${SPLITSPEC_WHEEL_DIR:-.whl}
FLASHINFER=flashinfer-python==0.7.2.post1
TVM_FFI=apache-tvm-ffi==0.1.15.post2
LIMIT=$((64 * 1024 * 1024))

GRPC=$("$PY" -c 'import grpc; print(grpc.__version__)')
PROTOBUF=$("$PY" -c 'import google.protobuf; print(google.protobuf.__version__)')
TMP=$(mktemp -d "${TMPDIR:-/tmp}/splitspec-prepare-XXXXXX")
trap 'rm -rf "$TMP"' EXIT

gpu_download() {  # wheels for the GPU machine: CPython 3.12, manylinux x86_64
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@"
}

rm -rf "$DEST"
mkdir -p "$DEST"
gpu_download -d "$DEST" "grpcio==$GRPC" "grpcio-health-checking==$GRPC" "grpcio-reflection==$GRPC" \
  "protobuf==$PROTOBUF" "$TVM_FFI"
gpu_download -d "$TMP/full" "$FLASHINFER"
"$PY" tests/gpu/slim_flashinfer.py "$TMP"/full/flashinfer_python-*.whl "$DEST"

NVCC=$(command -v nvcc || true)
if [[ -n "$NVCC" || -n "${CUDA_HOME:-}" ]]; then
  # flashinfer and what `import flashinfer` needs, for this machine's python, in a throwaway folder
  "$PY" -m pip install -q --no-warn-conflicts --no-compile --no-deps --target "$TMP/site" \
    "$DEST"/flashinfer_python-*.whl "$TVM_FFI" jinja2 markupsafe requests urllib3 idna certifi charset-normalizer \
    click einops tabulate tqdm nvidia-ml-py ninja numpy packaging typing-extensions
  FLASHINFER_WORKSPACE_BASE="$TMP/workspace" FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONPATH="$TMP/site" \
    "$PY" tests/gpu/slim_flashinfer.py --compile-check "$TMP"
else
  echo "no nvcc here: the slim flashinfer's includes are checked on the GPU machine (the jit section)"
fi

"$PY" - "$DEST" "$LIMIT" <<'PYEOF'
import subprocess, sys
from pathlib import Path
dest, limit = Path(sys.argv[1]), int(sys.argv[2])
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
files = [Path(name.decode()) for name in listed if name and Path(name.decode()).is_file()]
tree = sum(f.stat().st_size for f in files)
demo = sum(f.stat().st_size for f in files if f.parts[0] == "demo")
wheels = sorted(dest.glob("*.whl"))
carried = sum(w.stat().st_size for w in wheels)
for w in wheels:
    print(f"  {w.stat().st_size / 2**20:6.1f} MiB  {w.name}")
total = tree + carried
print(f"travels: {tree / 2**20:.1f} MiB of tracked and untracked files (demo checkpoints {demo / 2**20:.1f} MiB) "
      f"+ {carried / 2**20:.1f} MiB of wheels in {dest}/ = {total / 2**20:.1f} MiB (limit {limit / 2**20:.0f} MiB)")
sys.exit(0 if total < limit else f"too much travels: {total / 2**20:.1f} MiB >= {limit / 2**20:.0f} MiB")
PYEOF
