"""A real node's namespaces: one mount and one network namespace, held by a small shell
process, entered by every process of the node.

The holder (``unshare --mount --net --propagation private``) sets the namespaces up and
then waits. Inside them, and only there:

- ``/run``, ``/var/lib`` and ``/var/log`` are the node's own directories (so the kubelet's
  ``/var/lib/kubelet``, containerd's state, the CDI directory ``/var/run/cdi`` and the pod
  logs are the node's), and a tmpfs is at ``/run/containerd/s``, where containerd 2 always
  puts its shims' sockets, and one at ``/var/lib/containerd``: unpacking an image creates
  thousands of files, which takes seconds in memory and can take half a minute on a
  busy disk;
- the kernel settings the kubelet insists on (``vm.overcommit_memory`` and friends) read
  as it wants: files holding those values are bind-mounted over the ``/proc/sys`` entries,
  so the kubelet, started with ``protectKernelDefaults``, finds nothing to write (without
  them it would refuse to start rather than change the machine);
- ``lo`` is up and the node's address sits on a veth (the kubelet refuses a loopback node
  address; the kernel may lack the ``dummy`` link type);
- the ``kubernetes`` Service address is rewritten to the node's relay to the apiserver
  (there is no kube-proxy: one DNAT rule stands in for it, for that Service alone).

Every mount, link and rule goes away with the namespaces when the node's last process
ends. The holder is started with a parent-death signal: when the process that started the
node dies, the holder freezes and kills every process of the node's cgroups and removes
them, so a crashed test run leaves no process behind.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster.processes import ManagedProcess, wait_gone

KERNEL_SETTINGS: Mapping[str, str] = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
"""What the kubelet (1.37) checks in /proc/sys, and the values it wants."""

HOLDER_SCRIPT = r"""
set -eu
n=$ROTA_NODE_DIR
mount --bind "$n/run" /run
mkdir -p /run/containerd/s
mount -t tmpfs -o mode=0711 tmpfs /run/containerd/s
mount --bind "$n/var-lib" /var/lib
mkdir -p /var/lib/containerd
mount -t tmpfs -o "mode=0711,size=$ROTA_CONTAINERD_TMPFS" tmpfs /var/lib/containerd
mount --bind "$n/var-log" /var/log
for entry in $ROTA_SYSCTLS; do
  key=${entry%%=*}
  file="$n/sysctl/$(printf %s "$key" | tr / .)"
  printf '%s\n' "${entry#*=}" > "$file"
  mount --bind "$file" "/proc/sys/$key"
done
ip link set lo up
ip link add rota0 type veth peer name rota1
ip addr add "$ROTA_NODE_IP/24" dev rota0
ip link set rota0 up
ip link set rota1 up
for chain in PREROUTING OUTPUT; do
  iptables -w 5 -t nat -A "$chain" -d "$ROTA_SERVICE_IP" -p tcp --dport 443 \
    -j DNAT --to-destination "$ROTA_NODE_IP:$ROTA_API_PORT"
done

kill_node() {
  for round in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(cat $(find $ROTA_CGROUP_DIRS -name cgroup.procs 2>/dev/null) 2>/dev/null || true)
    [ -n "$pids" ] || break
    [ -z "$ROTA_FREEZER" ] || echo FROZEN > "$ROTA_FREEZER/freezer.state" 2>/dev/null || true
    kill -9 $pids 2>/dev/null || true
    [ -z "$ROTA_FREEZER" ] || echo THAWED > "$ROTA_FREEZER/freezer.state" 2>/dev/null || true
    sleep 0.2
  done
  for dir in $ROTA_CGROUP_DIRS; do
    [ -d "$dir" ] && find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}
stop() {
  trap - TERM INT HUP
  [ -z "${sleeper:-}" ] || kill "$sleeper" 2>/dev/null || true
  if [ "${1:-}" = crash ]; then kill_node; fi
  exit 0
}
trap 'stop crash' TERM
trap 'stop' INT HUP
touch "$n/holder.ready"
while :; do
  sleep 3600 &
  sleeper=$!
  wait "$sleeper" || true
done
"""


@dataclass
class NodeNamespace:
    """The holder process of one node's namespaces."""

    node_dir: Path
    node_ip: str
    service_ip: str
    api_port: int
    cgroup_dirs: Sequence[Path]
    freezer: Path | None
    containerd_tmpfs: str = "4g"
    """Size limit of containerd's root (images unpacked, containers' writable layers)."""
    holder: ManagedProcess | None = None

    @property
    def ready_file(self) -> Path:
        return self.node_dir / "holder.ready"

    def start(self, *, die_with_parent: bool) -> ManagedProcess:
        for name in ("run", "var-lib", "var-log", "sysctl"):
            (self.node_dir / name).mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "ROTA_NODE_DIR": str(self.node_dir), "ROTA_NODE_IP": self.node_ip,
            "ROTA_SERVICE_IP": self.service_ip, "ROTA_API_PORT": str(self.api_port),
            "ROTA_SYSCTLS": " ".join(f"{k}={v}" for k, v in KERNEL_SETTINGS.items()),
            "ROTA_CGROUP_DIRS": " ".join(str(d) for d in self.cgroup_dirs),
            "ROTA_FREEZER": str(self.freezer or ""),
            "ROTA_CONTAINERD_TMPFS": self.containerd_tmpfs,
        }
        self.holder = ManagedProcess(
            name="node-namespaces",
            argv=["unshare", "--mount", "--net", "--propagation", "private", "--",
                  "sh", "-c", HOLDER_SCRIPT],
            log_path=self.node_dir / "logs" / "namespaces.log", env=env,
            exe=shutil.which("sh") or "sh", death_signal="TERM")
        self.holder.start(die_with_parent=die_with_parent)
        return self.holder

    @property
    def pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    def enter(self, argv: Sequence[str], *, network: bool = True) -> list[str]:
        """``argv`` run inside the node's mount (and network) namespace."""
        flags = ["--mount", "--net"] if network else ["--mount"]
        return ["nsenter", f"--target={self.pid}", *flags, "--", *argv]

    def path(self, inside: str) -> Path:
        """A path of the node's mount namespace as the host reaches it."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the holder (the namespaces go when their last process does)."""
        if self.holder is None or not self.holder.alive():
            return
        assert self.holder.popen is not None
        self.holder.popen.send_signal(signal.SIGINT)
        wait_gone(self.holder, timeout_s)
