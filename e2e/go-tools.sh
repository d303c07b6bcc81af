# Sourced by the scripts that build tools from the Go module proxy into rota's tool cache
# (e2e/build-chart-tools.sh, e2e/build-registry.sh); not run by itself.
#
# The caller sets TOOL_LOG (its name in the log), TOOL_KEY (the cache entry, naming every
# pinned version) and WANT (the binaries), then calls go_tools_begin, build for each missing
# binary, and go_tools_end. The binaries land in
#   ${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}/tools/$TOOL_KEY/bin
# and are reused when present; go_tools_end prints that bin directory as the last line of
# stdout. Progress goes to stderr.
#
# Each tool is built in a small wrapper module of its own (``go mod init`` + ``go get`` of
# the command's module at its tag + ``go build``), so no two tools share resolved versions.

CACHE_ROOT="${ROTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rota}"
OUT="$CACHE_ROOT/tools/$TOOL_KEY"
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

go_tools_end() {
  touch "$OUT/.complete"
  log "built in $(( $(date +%s) - TOOLS_START )) s: $BIN"
  echo "$BIN"
}
