#!/usr/bin/env bash
# The whole GPU-side run, from the repository root on the GPU machine (with .whl/ carried):
#   1. an offline install of the wheels tests/gpu/prepare.sh collected, into a private
#      folder (pip --no-index --no-deps --target): the image's torch, CUDA and the rest
#      stay as they are; the project itself runs from this checkout (PYTHONPATH);
#   2. tests/gpu/run_gpu_checks.py: each section in its own process with its own time
#      limit, the report rewritten after every section to $OUT/gpu_report.json, all of it
#      within 8 minutes of a cold start (SPLITSPEC_GPU_TOTAL_S, default 480).
#
#   bash tests/gpu/run.sh [run_gpu_checks.py options]
#   bash tests/gpu/run.sh --dry-run     here, on a CPU: no install, the same orchestration,
#                                       time limits and report, every section skipped
# OUT defaults to ./gpu-out; PYTHON to python3 (the image's, which holds torch).
set -euo pipefail
started=$SECONDS
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=${SPLITSPEC_WHEEL_DIR:-.whl}
SITE=${SPLITSPEC_GPU_SITE:-/tmp/splitspec-site}
TOTAL_S=${SPLITSPEC_GPU_TOTAL_S:-480}
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"

dry=()
if [[ "${1:-}" == "--dry-run" ]]; then
  dry=(--dry-run)
  shift
fi
if (( ${#dry[@]} )); then
  echo "dry run: no install ($(compgen -G "$WHEELS/*.whl" | wc -l) wheel(s) in $WHEELS/)" >&2
else
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "no wheels in $WHEELS/: run tests/gpu/prepare.sh where the registries are reachable, and carry $WHEELS" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
  echo "installed $(compgen -G "$WHEELS/*.whl" | wc -l) wheel(s) into $SITE in $((SECONDS - started)) s" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$(command -v "$PY")"):$PATH"  # the interpreter's bin: FlashInfer runs `ninja` from PATH
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False  # CUDA IPC shares plain cudaMalloc blocks only
# what is left of the whole run's time, less 15 s for start-up and the last report
budget=$((TOTAL_S - (SECONDS - started) - 15))
exec "$PY" tests/gpu/run_gpu_checks.py "${dry[@]}" --budget-s "$budget" --out "$OUT/gpu_report.json" "$@"
