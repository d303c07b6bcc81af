# Sourced by the scripts that build binaries from the Go module proxy into rota's cache
# (e2e/toolchain/build-k8s.sh, e2e/toolchain/build-chart-tools.sh, e2e/toolchain/build-registry.sh, e2e/toolchain/build-kwok.sh);
# not run by itself.
#
# The caller sets TOOL_LOG (its name in the log), TOOL_KEY (the cache entry, naming every
# pinned version), WANT (the binaries) and, optionally, TOOL_SHELF (the cache's folder for
# the entry, ``tools`` unless set), then calls go_tools_begin, builds each missing binary
# (build, or its own steps in a go_wrapper module), and calls go_tools_end. The binaries
# land in
#   ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/$TOOL_SHELF/$TOOL_KEY/bin
# and are reused when present; go_tools_begin (cached) and go_tools_end (built) print that
# bin directory as the last line of stdout. Progress goes to stderr.
#
# Each tool is built in a small wrapper module of its own (``go mod init`` + ``go get`` of
# the command's module at its tag + ``go build``), so no two tools share resolved versions.

CACHE_ROOT="${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}"
OUT="$CACHE_ROOT/${TOOL_SHELF:-tools}/$TOOL_KEY"
BIN="$OUT/bin"

log() { printf '[%s] %s\n' "$TOOL_LOG" "$*" >&2; }

have_all() {
  local b
  for b in "${WANT[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
  [[ -f "$OUT/.complete" ]]
}

# Exits with the cached bin directory on stdout when every binary is there; otherwise
# takes the cache entry's lock (parallel test sessions share the cache) and sets Go up.
go_tools_begin() {
  if have_all; then
    log "cached: $BIN"
    echo "$BIN"
    exit 0
  fi
  command -v go >/dev/null || { log "go is required (>= 1.24)"; exit 1; }
  mkdir -p "$OUT"
  exec 9>"$OUT/.lock"
  flock 9
  if have_all; then echo "$BIN"; exit 0; fi
  export GOFLAGS="${GOFLAGS:-} -mod=mod"
  export CGO_ENABLED=0
  # Each tool declares the Go it needs in its go.mod; an older local Go fetches that
  # toolchain from the module proxy by itself (GOTOOLCHAIN=auto).
  export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
  TOOLS_START=$(date +%s)
  mkdir -p "$BIN"
}

# go_toolchain MINOR TOOLCHAIN: for a build that needs Go 1.MINOR whatever its wrapper
# module declares. An older local Go fetches TOOLCHAIN from the module proxy (it is served
# there like any module); a new enough one is used as it is.
go_toolchain() {
  local need=$1 fallback=$2 local_minor
  local_minor=$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
  if [[ -n "$local_minor" && "$local_minor" -lt "$need" ]]; then
    export GOTOOLCHAIN="$fallback"
    log "local $(go env GOVERSION) is too old; using $GOTOOLCHAIN from the module proxy"
  else
    export GOTOOLCHAIN=local
  fi
}

# go_wrapper NAME: a fresh wrapper module $OUT/src-NAME (rota.local/NAMEbin), made the
# current directory; go_wrapper_done NAME removes it.
go_wrapper() {
  local w="$OUT/src-$1"
  rm -rf "$w"; mkdir -p "$w"; cd "$w"
  go mod init "rota.local/${1}bin" >/dev/null 2>&1
}

go_wrapper_done() {
  cd "$OUT"; rm -rf "$OUT/src-$1"
}

# build NAME MODULE@VERSION PACKAGE [LDFLAGS]
build() {
  local name=$1 module=$2 package=$3 ldflags=${4:-}
  go_wrapper "$name"
  log "resolving $module"
  go get "$package@${module#*@}" >&2
  log "building $name"
  go build -trimpath -buildvcs=false -ldflags "-s -w $ldflags" -o "$BIN/$name" "$package"
  go_wrapper_done "$name"
}

go_tools_end() {
  touch "$OUT/.complete"
  log "built in $(( $(date +%s) - TOOLS_START )) s: $BIN"
  echo "$BIN"
}
