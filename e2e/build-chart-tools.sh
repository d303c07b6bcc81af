#!/usr/bin/env bash
# Build the tools the chart's tests use from the Go module proxy, at pinned versions:
# helm (lint, template) and promtool (check and unit-test the alert rules).
#
# The binaries land in a cache outside the repository, keyed by version, and are reused
# when present:   ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/tools/helm<v>-promtool<v>/bin
# Prints that bin directory on its last line of stdout. Progress goes to stderr.
#
# Each tool is built in a small wrapper module of its own (``go mod init`` + ``go get`` of
# the command's module at its tag + ``go build``), so the two never share resolved versions.
# Prometheus tags its Go module v0.<minor*100+patch>: v0.316.0 is Prometheus 3.16.0.
set -euo pipefail

HELM_VERSION="${ROTA_HELM_VERSION:-3.22.0}"
PROMETHEUS_MODULE_VERSION="${ROTA_PROMETHEUS_MODULE_VERSION:-0.316.0}"
CACHE_ROOT="${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}"
OUT="$CACHE_ROOT/tools/helm${HELM_VERSION}-promtool${PROMETHEUS_MODULE_VERSION}"
BIN="$OUT/bin"
WANT=(helm promtool)

log() { printf '[build-chart-tools] %s\n' "$*" >&2; }

have_all() {
  local b
  for b in "${WANT[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
  [[ -f "$OUT/.complete" ]]
}

if have_all; then
  log "cached: $BIN"
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { log "go is required (>= 1.24)"; exit 1; }
mkdir -p "$OUT"
# One builder at a time per cache entry (parallel test sessions share the cache).
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$BIN"; exit 0; fi

export GOFLAGS="${GOFLAGS:-} -mod=mod"
export CGO_ENABLED=0
# Both tools declare the Go they need in their go.mod; an older local Go fetches that
# toolchain from the module proxy by itself (GOTOOLCHAIN=auto).
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
start=$(date +%s)
mkdir -p "$BIN"

# build NAME MODULE@VERSION PACKAGE [LDFLAGS]
build() {
  local name=$1 module=$2 package=$3 ldflags=${4:-}
  local w="$OUT/src-$name"
  rm -rf "$w"; mkdir -p "$w"; cd "$w"
  go mod init "rota.local/${name}bin" >/dev/null 2>&1
  log "resolving $module"
  go get "$package@${module#*@}" >&2
  log "building $name"
  go build -trimpath -buildvcs=false -ldflags "-s -w $ldflags" -o "$BIN/$name" "$package"
  cd "$OUT"; rm -rf "$w"
}

if [[ ! -x "$BIN/helm" ]]; then
  build helm "helm.sh/helm/v3@v${HELM_VERSION}" helm.sh/helm/v3/cmd/helm \
    "-X helm.sh/helm/v3/internal/version.version=v${HELM_VERSION}"
fi
if [[ ! -x "$BIN/promtool" ]]; then
  p=github.com/prometheus/common/version
  build promtool "github.com/prometheus/prometheus@v${PROMETHEUS_MODULE_VERSION}" \
    github.com/prometheus/prometheus/cmd/promtool "-X $p.Version=${PROMETHEUS_MODULE_VERSION}"
fi
"$BIN/helm" version --short >&2
"$BIN/promtool" --version >&2 | head -n 1 >&2 || true
touch "$OUT/.complete"
log "built in $(( $(date +%s) - start )) s: $BIN"
echo "$BIN"
