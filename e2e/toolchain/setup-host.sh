#!/usr/bin/env bash
# Install the Debian packages rota's local cluster and its real nodes need, and only those
# that are missing. Idempotent: a second run checks and installs nothing.
#
#   runc, containernetworking-plugins   the container runtime's runtime and CNI plugins
#   socat                               relays between the node's namespaces and the host
#   iproute2, iptables                  the node's veth, bridge and Service address
#   util-linux, mount                   unshare, nsenter, setpriv, flock, mount
#   gcc, libc6-dev                      the static pause program of the pause image
#   python3-venv                        the virtualenv of the test suite
#
# Needs root to install; without root it lists what is missing and fails. Prints nothing
# on stdout when all is there (progress goes to stderr).
set -euo pipefail

PACKAGES=(runc containernetworking-plugins socat iproute2 iptables util-linux mount gcc
  libc6-dev python3-venv)

log() { printf '[setup-host] %s\n' "$*" >&2; }

installed() {
  [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" == installed ]]
}

command -v dpkg-query >/dev/null || { log "not a Debian system: install ${PACKAGES[*]}"; exit 1; }
missing=()
for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
# python3-venv may be provided by the Python on PATH instead of Debian's.
if [[ " ${missing[*]} " == *" python3-venv "* ]] && python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
  read -r -a missing <<<"${missing[*]}"
fi
((${#missing[@]})) || exit 0

if [[ $(id -u) -ne 0 ]]; then
  log "missing packages (install them as root): ${missing[*]}"
  exit 1
fi
log "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >&2
apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
