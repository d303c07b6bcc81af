#!/usr/bin/env bash
# Build the Kubernetes binaries rota's local cluster runs from the Go module proxy, at pinned
# versions: the control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager),
# what a real node needs (kubelet; containerd with ctr and the runc shim), and kubectl.
#
# The binaries land in a cache outside the repository, keyed by version, and are reused
# when present:   ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/k8s/<k8s>-etcd<etcd>/bin
# Prints that bin directory on its last line of stdout. Progress goes to stderr. The
# prologue (cache, lock, Go, one wrapper module per build) is e2e/toolchain/go-tools.sh's.
#
# Why a wrapper module: k8s.io/kubernetes requires its staging modules at v0.0.0 and
# replaces them with ./staging paths, which only work inside its own repository. A small
# module of ours requires k8s.io/kubernetes and replaces every staging module with its
# published v0.<minor>.<patch> tag. etcd's server module has replace lines as well, so it is
# built from a wrapper module of its own (kept apart so the two never share resolved versions).
set -euo pipefail

K8S_VERSION="${ROTA_K8S_VERSION:-1.37.2}"
ETCD_VERSION="${ROTA_ETCD_VERSION:-3.7.3}"
CONTAINERD_VERSION="${ROTA_CONTAINERD_VERSION:-2.4.2}"
KUBE=(kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl)
CONTAINERD=(containerd containerd-shim-runc-v2 ctr)
TOOL_LOG=build-k8s
TOOL_SHELF=k8s
TOOL_KEY="v${K8S_VERSION}-etcd${ETCD_VERSION}-containerd${CONTAINERD_VERSION}"
WANT=(etcd "${KUBE[@]}" "${CONTAINERD[@]}")
# shellcheck source=e2e/toolchain/go-tools.sh
source "$(dirname "${BASH_SOURCE[0]}")/go-tools.sh"

go_tools_begin
# Kubernetes 1.37 needs Go 1.26.
go_toolchain 26 "${ROTA_GO_TOOLCHAIN:-go1.26.8}"

build_kube() {
  local staging minor
  staging="0.${K8S_VERSION#*.}"
  minor="${staging#0.}"; minor="${minor%%.*}"
  go_wrapper kube
  log "downloading k8s.io/kubernetes@v${K8S_VERSION}"
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@v${K8S_VERSION}" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  local m
  for m in $(sed -n 's|^[[:space:]]*\(k8s.io/[^ ]*\) => \./staging/src/.*|\1|p' "$gomod"); do
    go mod edit "-replace=$m=$m@v$staging"
  done
  go mod edit "-require=k8s.io/kubernetes@v${K8S_VERSION}"
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  log "resolving dependencies"
  go mod tidy -e >&2 || true
  local c pkgs=()
  for c in "${KUBE[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
  go get "${pkgs[@]/%/@v${K8S_VERSION}}" >&2
  local ldf="-s -w" p now
  now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf="$ldf -X $p.gitVersion=v${K8S_VERSION} -X $p.gitMajor=1 -X $p.gitMinor=${minor}"
    ldf="$ldf -X $p.gitTreeState=clean -X $p.buildDate=${now}"
  done
  log "building ${KUBE[*]} (this is the slow part; one build shares the compiled packages)"
  go build -trimpath -buildvcs=false -tags selinux,notest,grpcnotrace -ldflags "$ldf" -o "$BIN/" \
    "${pkgs[@]}"
  go_wrapper_done kube
}

build_containerd() {
  local m="github.com/containerd/containerd/v2" c pkgs=()
  go_wrapper containerd
  for c in "${CONTAINERD[@]}"; do pkgs+=("$m/cmd/$c"); done
  log "resolving $m@v${CONTAINERD_VERSION}"
  go get "${pkgs[@]/%/@v${CONTAINERD_VERSION}}" >&2
  log "building ${CONTAINERD[*]}"
  go build -trimpath -buildvcs=false -tags "no_btrfs netgo osusergo" \
    -ldflags "-s -w -X $m/version.Version=v${CONTAINERD_VERSION}" -o "$BIN/" "${pkgs[@]}"
  go_wrapper_done containerd
}

missing() { local b; for b in "$@"; do [[ -x "$BIN/$b" ]] || return 0; done; return 1; }
if missing etcd; then
  build etcd "go.etcd.io/etcd/server/v3@v${ETCD_VERSION}" go.etcd.io/etcd/server/v3
fi
if missing "${KUBE[@]}"; then build_kube; fi
if missing "${CONTAINERD[@]}"; then build_containerd; fi
go_tools_end
