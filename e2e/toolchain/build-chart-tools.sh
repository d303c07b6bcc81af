#!/usr/bin/env bash
# Build the tools the chart's tests use from the Go module proxy, at pinned versions:
# helm (lint, template) and promtool (check and unit-test the alert rules).
#
# The binaries land in a cache outside the repository, keyed by version, and are reused
# when present:   ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/tools/helm<v>-promtool<v>/bin
# Prints that bin directory on its last line of stdout. Progress goes to stderr. The
# prologue (cache, lock, one wrapper module per tool) is e2e/toolchain/go-tools.sh's.
#
# Prometheus tags its Go module v0.<minor*100+patch>: v0.316.0 is Prometheus 3.16.0.
set -euo pipefail

HELM_VERSION="${ROTA_HELM_VERSION:-3.22.0}"
PROMETHEUS_MODULE_VERSION="${ROTA_PROMETHEUS_MODULE_VERSION:-0.316.0}"
TOOL_LOG=build-chart-tools
TOOL_KEY="helm${HELM_VERSION}-promtool${PROMETHEUS_MODULE_VERSION}"
WANT=(helm promtool)
# shellcheck source=e2e/toolchain/go-tools.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-tools.sh"

go_tools_begin
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
go_tools_end
