#!/usr/bin/env bash
# Build cosign from the Go module proxy, at a pinned version, for signing and verifying
# rota's release image and chart (e2e/release/artifacts.py's ``sign``, ``push`` and ``verify``, and the
# registry tests): ``cosign sign`` / ``cosign attest`` with a key file, ``cosign verify`` /
# ``cosign verify-attestation`` with its public key. Built only when something asks for it
# (make signing-tools, a release with a signing key, a registry test), never by make test
# by itself.
#
# Cache: ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/tools/cosign<v>/bin, printed on
# the last line of stdout (e2e/toolchain/go-tools.sh, shared with the other tool scripts).
set -euo pipefail

COSIGN_VERSION="${ROTA_COSIGN_VERSION:-2.6.5}"
TOOL_LOG=build-cosign
TOOL_KEY="cosign${COSIGN_VERSION}"
WANT=(cosign)
# shellcheck source=e2e/toolchain/go-tools.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-tools.sh"

go_tools_begin
if [[ ! -x "$BIN/cosign" ]]; then
  v=sigs.k8s.io/release-utils/version
  build cosign "github.com/sigstore/cosign/v2@v${COSIGN_VERSION}" \
    github.com/sigstore/cosign/v2/cmd/cosign "-X $v.gitVersion=v${COSIGN_VERSION}"
fi
"$BIN/cosign" version >&2 | head -n 3 >&2 || true
go_tools_end
