#!/usr/bin/env bash
# Build the Kubernetes binaries rota's local cluster runs from the Go module proxy, at pinned
# versions: the control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager),
# what a real node needs (kubelet; containerd with ctr and the runc shim), and kubectl.
#
# The binaries land in a cache outside the repository, keyed by version, and are reused
# when present:   ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/k8s/<k8s>-etcd<etcd>/bin
# Prints that bin directory on its last line of stdout. Progress goes to stderr.
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
CACHE_ROOT="${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}"
OUT="$CACHE_ROOT/k8s/v${K8S_VERSION}-etcd${ETCD_VERSION}-containerd${CONTAINERD_VERSION}"
BIN="$OUT/bin"
KUBE=(kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl)
CONTAINERD=(containerd containerd-shim-runc-v2 ctr)
WANT=(etcd "${KUBE[@]}" "${CONTAINERD[@]}")

log() { printf '[build-k8s] %s\n' "$*" >&2; }

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

command -v go >/dev/null || { log "go is required (>= 1.26)"; exit 1; }
mkdir -p "$OUT"
# One builder at a time per cache entry (parallel test sessions share the cache).
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$BIN"; exit 0; fi

export GOFLAGS="${GOFLAGS:-} -mod=mod"
export CGO_ENABLED=0
# Kubernetes 1.37 needs Go 1.26. An older local Go fetches that toolchain from the module
# proxy (it is served there like any module); a new enough one is used as it is.
go_minor=$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
if [[ -n "$go_minor" && "$go_minor" -lt 26 ]]; then
  export GOTOOLCHAIN="${ROTA_GO_TOOLCHAIN:-go1.26.8}"
  log "local $(go env GOVERSION) is too old; using $GOTOOLCHAIN from the module proxy"
else
  export GOTOOLCHAIN=local
fi
start=$(date +%s)
mkdir -p "$BIN"

build_etcd() {
  local w="$OUT/src-etcd"
  rm -rf "$w"; mkdir -p "$w"; cd "$w"
  go mod init rota.local/etcdbin >/dev/null 2>&1
  log "resolving go.etcd.io/etcd/server/v3@v${ETCD_VERSION}"
  go get "go.etcd.io/etcd/server/v3@v${ETCD_VERSION}" >&2
  log "building etcd"
  go build -trimpath -buildvcs=false -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
}

build_kube() {
  local w="$OUT/src-kube" staging minor
  staging="0.${K8S_VERSION#*.}"
  minor="${staging#0.}"; minor="${minor%%.*}"
  rm -rf "$w"; mkdir -p "$w"; cd "$w"
  go mod init rota.local/kubebin >/dev/null 2>&1
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
}

build_containerd() {
  local w="$OUT/src-containerd" m="github.com/containerd/containerd/v2" c pkgs=()
  rm -rf "$w"; mkdir -p "$w"; cd "$w"
  go mod init rota.local/containerdbin >/dev/null 2>&1
  for c in "${CONTAINERD[@]}"; do pkgs+=("$m/cmd/$c"); done
  log "resolving $m@v${CONTAINERD_VERSION}"
  go get "${pkgs[@]/%/@v${CONTAINERD_VERSION}}" >&2
  log "building ${CONTAINERD[*]}"
  go build -trimpath -buildvcs=false -tags "no_btrfs netgo osusergo" \
    -ldflags "-s -w -X $m/version.Version=v${CONTAINERD_VERSION}" -o "$BIN/" "${pkgs[@]}"
}

[[ -x "$BIN/etcd" ]] || build_etcd
missing() { local b; for b in "$@"; do [[ -x "$BIN/$b" ]] || return 0; done; return 1; }
if missing "${KUBE[@]}"; then build_kube; fi
if missing "${CONTAINERD[@]}"; then build_containerd; fi
rm -rf "$OUT/src-etcd" "$OUT/src-kube" "$OUT/src-containerd"
touch "$OUT/.complete"
log "built in $(( $(date +%s) - start )) s: $BIN"
echo "$BIN"
