#!/usr/bin/env bash
# What the tests need beyond the venv, set up the way CI does (`make test` and .ci/run call this):
#   prometheus, docker-compose: Debian's packages, for tests/test_observability.py (they skip without them)
#   kubectl: its embedded kustomize renders deploy/k8s for tests/test_k8s.py (they fail without it)
# As root with apt-get, missing packages are installed; otherwise this says loudly what will not run.
set -uo pipefail

missing=()
for tool in prometheus docker-compose; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})) && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "test setup: installing ${missing[*]} (Debian's packages) for tests/test_observability.py"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  missing=()
  for tool in prometheus docker-compose; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
fi

warn() {
  printf '\n%s\n' "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
  printf '!!! %s\n' "$@" >&2
  printf '%s\n\n' "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
}
if ((${#missing[@]})); then
  warn "NOT INSTALLED: ${missing[*]}" \
       "the Prometheus and docker-compose tests in tests/test_observability.py will SKIP." \
       "Install them (as .ci/run does): sudo apt-get install prometheus docker-compose"
fi
if ! command -v kubectl >/dev/null && ! command -v kustomize >/dev/null; then
  warn "NOT INSTALLED: kubectl (or kustomize)" \
       "tests/test_k8s.py renders deploy/k8s with it and will FAIL without it (kubectl >= 1.21)."
fi
exit 0
