#!/usr/bin/env bash
# Build kwok (Kubernetes WithOut Kubelet) from the Go module proxy, at a pinned version, for
# the scale harness (e2e/scale): one kwok process keeps N fake Nodes alive (their Lease
# heartbeat and status) and moves the pods bound to them to Running and Ready, as the
# Stage objects the harness writes say, without any kubelet.
#
# Cache: ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/tools/kwok<v>/bin, printed on
# the last line of stdout (e2e/toolchain/go-tools.sh, shared with e2e/toolchain/build-chart-tools.sh).
set -euo pipefail

KWOK_VERSION="${ROTA_KWOK_VERSION:-0.8.0}"
TOOL_LOG=build-kwok
TOOL_KEY="kwok${KWOK_VERSION}"
WANT=(kwok)
# shellcheck source=e2e/toolchain/go-tools.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-tools.sh"

go_tools_begin
if [[ ! -x "$BIN/kwok" ]]; then
  build kwok "sigs.k8s.io/kwok@v${KWOK_VERSION}" sigs.k8s.io/kwok/cmd/kwok \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=v${KWOK_VERSION}"
fi
"$BIN/kwok" --version >&2 || true
go_tools_end
