#!/usr/bin/env bash
# Build an OCI registry and its client from the Go module proxy, at a pinned version, for
# the tests that install rota from a registry (e2e/release/registry.py): go-containerregistry's
# ``crane``, whose ``crane registry serve --address --disk`` is the registry (the package
# ``cmd/registry`` serves the same registry but only in memory, on a fixed host), and whose
# ``crane push`` pushes an OCI image layout to it.
#
# Cache: ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/tools/ggcr<v>/bin, printed on
# the last line of stdout (e2e/toolchain/go-tools.sh, shared with e2e/toolchain/build-chart-tools.sh).
set -euo pipefail

GGCR_VERSION="${ROTA_GGCR_VERSION:-0.22.1}"
TOOL_LOG=build-registry
TOOL_KEY="ggcr${GGCR_VERSION}"
WANT=(crane)
# shellcheck source=e2e/toolchain/go-tools.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-tools.sh"

go_tools_begin
module="github.com/google/go-containerregistry@v${GGCR_VERSION}"
if [[ ! -x "$BIN/crane" ]]; then
  build crane "$module" github.com/google/go-containerregistry/cmd/crane \
    "-X github.com/google/go-containerregistry/cmd/crane/cmd.Version=v${GGCR_VERSION}"
fi
"$BIN/crane" version >&2
go_tools_end
