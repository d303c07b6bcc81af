"""socat relays between the host's loopback and a node's network namespace.

A relay is two socat processes joined by a unix socket in the node's directory, which
both namespaces see: one listens on TCP in one namespace and connects to the socket, the
other listens on the socket and connects on TCP in the other namespace. Three kinds:

- **to the apiserver** (kubelet and pods -> apiserver): the node side listens on the
  apiserver's port on every node address (the kubelet dials ``127.0.0.1:<port>``, pods
  dial the ``kubernetes`` Service address, rewritten to ``<node ip>:<port>``); the host
  side connects to the apiserver on the host's loopback;
- **to the kubelet** (apiserver -> kubelet, for logs, exec and port-forward): the host side
  listens on ``127.0.0.1:<kubelet port>``, which the apiserver dials for this node;
- **forwards** (the host -> a pod address and port inside the node), for tests and the
  demo, as ``kubectl port-forward`` would be used;
- **to a host port** (the node -> a server on the host's loopback, an OCI registry): the
  node side listens on ``127.0.0.1:<port>``, so the same address names it on both sides.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from e2e.cluster.local import free_port
from e2e.cluster.processes import ManagedProcess
from e2e.harness.waiting import eventually

JOIN_CGROUP = 'for f in $ROTA_JOIN; do echo $$ > "$f"; done; exec "$@"'
"""A shell prefix that moves itself into the cgroups named by ``$ROTA_JOIN`` (cgroup.procs
files), then execs its arguments: a process is in the node's cgroups before it starts."""


def joined(argv: Sequence[str]) -> list[str]:
    return ["sh", "-c", JOIN_CGROUP, "sh", *argv]


@dataclass
class Relays:
    """Starts and tracks one node's relays."""

    directory: Path
    enter: Callable[[Sequence[str]], list[str]]
    """Wraps an argv to run inside the node's namespaces."""
    env: dict[str, str]
    """Environment of every relay (``ROTA_JOIN`` included)."""
    die_with_parent: bool = True
    processes: list[ManagedProcess] = field(default_factory=list)
    forwards: dict[tuple[str, int], int] = field(default_factory=dict)

    def _spawn(self, name: str, argv: Sequence[str], *, inside: bool) -> ManagedProcess:
        command = joined(["socat", *argv])
        proc = ManagedProcess(name=name, argv=self.enter(command) if inside else command,
                              log_path=self.directory / f"{name}.log", env=self.env,
                              exe="socat")
        proc.start(die_with_parent=self.die_with_parent)
        self.processes.append(proc)
        return proc

    def _pair(self, name: str, *, listen_inside: bool, listen_tcp: str, connect_tcp: str,
              ready: Callable[[], bool]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sock = self.directory / f"{name}.sock"
        self._spawn(f"{name}-socket", [f"UNIX-LISTEN:{sock},fork,unlink-early", connect_tcp],
                    inside=not listen_inside)
        eventually(sock.exists, timeout=10, what=f"relay socket {sock.name}")
        self._spawn(f"{name}-tcp", [listen_tcp, f"UNIX-CONNECT:{sock}"], inside=listen_inside)
        eventually(ready, timeout=10, what=f"relay {name} listening")

    def to_apiserver(self, api_port: int, listening: Callable[[int], bool]) -> None:
        self._pair("apiserver", listen_inside=True,
                   listen_tcp=f"TCP-LISTEN:{api_port},fork,reuseaddr",
                   connect_tcp=f"TCP:127.0.0.1:{api_port}",
                   ready=lambda: listening(api_port))

    def to_kubelet(self, kubelet_port: int) -> None:
        self._pair("kubelet", listen_inside=False,
                   listen_tcp=f"TCP-LISTEN:{kubelet_port},bind=127.0.0.1,fork,reuseaddr",
                   connect_tcp=f"TCP:127.0.0.1:{kubelet_port}",
                   ready=lambda: _host_listening(kubelet_port))

    def to_host(self, port: int, listening: Callable[[int], bool]) -> None:
        """The node's ``127.0.0.1:<port>`` reaches the host's ``127.0.0.1:<port>``."""
        self._pair(f"host-{port}", listen_inside=True,
                   listen_tcp=f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr",
                   connect_tcp=f"TCP:127.0.0.1:{port}",
                   ready=lambda: listening(port))

    def forward(self, address: str, port: int) -> int:
        """A host loopback port that reaches ``address:port`` inside the node."""
        key = (address, port)
        if key not in self.forwards:
            local = free_port()
            self._pair(f"fwd-{address}-{port}", listen_inside=False,
                       listen_tcp=f"TCP-LISTEN:{local},bind=127.0.0.1,fork,reuseaddr",
                       connect_tcp=f"TCP:{address}:{port}",
                       ready=lambda: _host_listening(local))
            self.forwards[key] = local
        return self.forwards[key]

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop(timeout_s=5)
        self.processes.clear()
        self.forwards.clear()


def _host_listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0
