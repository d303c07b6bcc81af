"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager as plain processes.

Nodes are either real (a kubelet and containerd in namespaces of their own, see
:mod:`e2e.cluster.realnode`) or static objects created by
:func:`e2e.cluster.nodes.create_node`, which the node agent serves. To keep static Node
objects schedulable, the ``TaintNodesByCondition`` admission plugin is disabled (it would
taint every new Node ``not-ready``) and the node-lifecycle controller is not run (it would
taint Nodes without heartbeats). Authorization is the Node authorizer and RBAC, with
``NodeRestriction`` and ``ServiceAccount`` admission: kubelets act as ``system:node:<name>``
and pods get projected, node-bound service-account tokens. A pod created right after its
namespace must wait for the namespace's ``default`` ServiceAccount
(:func:`e2e.harness.objects.create_namespace` does).

The apiserver reaches a kubelet by the Node's ``Hostname`` address. It runs in a mount
namespace of its own where ``/etc/hosts`` is the cluster's file, so real nodes' names
resolve to 127.0.0.1 (where each kubelet's relay listens) for the apiserver alone
(:meth:`LocalCluster.add_host`).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from e2e.cluster import binaries, pki
from e2e.cluster.processes import ManagedProcess, stop_pid

log = logging.getLogger(__name__)

STATE_FILE = "cluster.json"


class ClusterStartError(RuntimeError):
    """A component did not become ready in time; the message carries its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ClusterOptions:
    """What a cluster is started with."""

    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    """Applied to kube-apiserver, kube-scheduler and kube-controller-manager alike."""
    enable_admission_plugins: Sequence[str] = ("NodeRestriction",)
    """Added to the apiserver's default set."""
    disable_admission_plugins: Sequence[str] = ("TaintNodesByCondition",)
    authorization_modes: Sequence[str] = ("Node", "RBAC")
    start_timeout_s: float = 90.0
    """The apiserver alone can take 60 s on two busy cores."""
    run_scheduler: bool = True
    run_controller_manager: bool = True
    audit_policy_file: Path | None = None
    """An audit policy for kube-apiserver (``--audit-policy-file``); None: no audit."""
    audit_log_path: Path | None = None
    """Where the audit log goes (JSON lines, never rotated); needs ``audit_policy_file``."""


def _gates_flag(gates: Mapping[str, bool]) -> list[str]:
    if not gates:
        return []
    value = ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(gates.items()))
    return [f"--feature-gates={value}"]


def _audit_flags(options: ClusterOptions) -> list[str]:
    if options.audit_policy_file is None:
        return []
    if options.audit_log_path is None:
        raise ValueError("an audit policy needs audit_log_path")
    return [f"--audit-policy-file={options.audit_policy_file}",
            f"--audit-log-path={options.audit_log_path}", "--audit-log-format=json",
            # In MB; 0 would be lumberjack's default of 100 MB, rotated.
            "--audit-log-maxsize=1000000", "--audit-log-mode=batch",
            "--audit-log-batch-max-wait=1s"]


class LocalCluster:
    """Starts and stops one local control plane. Use as a context manager or call
    :meth:`start` and :meth:`stop`."""

    def __init__(self, workdir: Path | None = None, options: ClusterOptions | None = None,
                 *, bin_dir: Path | None = None) -> None:
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="rota-cluster-"))
        self.options = options or ClusterOptions()
        self._bin_dir = bin_dir
        self.processes: dict[str, ManagedProcess] = {}
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.hosts_file = self.workdir / "hosts"
        self.server = ""
        self.ports: dict[str, int] = {}
        self._pki: pki.Pki | None = None
        self._node_indexes = 0
        self._real_nodes: list[str] = []

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def pki(self) -> pki.Pki:
        assert self._pki is not None, "the cluster is not started"
        return self._pki

    @property
    def api_port(self) -> int:
        return self.ports["apiserver"]

    def api_client(self, *, server: str | None = None) -> Any:
        """A new admin client of the kubernetes package (close it after use). ``server``
        (``https://127.0.0.1:<port>``) reaches the API server through something in front of
        it, a relay or a counting proxy, with the same credentials and CA."""
        from kubernetes import config

        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        if server is not None:
            api.configuration.host = server
        return api

    def allocate_node_index(self) -> int:
        """A small number unique among this cluster's real nodes (their addresses)."""
        self._node_indexes += 1
        return self._node_indexes

    def add_host(self, name: str, address: str = "127.0.0.1") -> None:
        """Make ``name`` resolve to ``address`` for the apiserver (how it finds a real
        node's kubelet). The file is changed in place: the apiserver's mount pins it."""
        with self.hosts_file.open("a") as hosts:
            hosts.write(f"{address} {name}\n")

    def start(self, *, die_with_parent: bool = True) -> None:
        started = time.monotonic()
        bin_dir = self._bin_dir or binaries.locate()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._pki = pki.generate(self.workdir / "pki")
        self.ports = {name: free_port() for name in
                      ("etcd", "etcd_peer", "apiserver", "scheduler", "controller_manager")}
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        pki.write_kubeconfig(self.kubeconfig, server=self.server, pki=self._pki)
        self.hosts_file.write_text("127.0.0.1 localhost\n::1 localhost\n")
        try:
            self._start_etcd(bin_dir, die_with_parent)
            self._start_apiserver(bin_dir, die_with_parent)
            if self.options.run_scheduler:
                self._start_scheduler(bin_dir, die_with_parent)
            if self.options.run_controller_manager:
                self._start_controller_manager(bin_dir, die_with_parent)
            self._wait_components()
        except BaseException:
            self.stop()
            raise
        self._write_state()
        log.info("cluster ready", extra={"server": self.server, "workdir": str(self.workdir),
                                         "seconds": round(time.monotonic() - started, 2)})

    def stop(self) -> None:
        # Reverse start order: controllers first, etcd last.
        for proc in reversed(list(self.processes.values())):
            proc.stop()
        self.processes.clear()

    def cleanup(self) -> None:
        """Stop and, when the working directory was ours, delete it."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- components ----------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], die_with_parent: bool, *, exe: str = ""
               ) -> ManagedProcess:
        proc = ManagedProcess(name=name, argv=argv, log_path=self.log_dir / f"{name}.log",
                              exe=exe)
        proc.start(die_with_parent=die_with_parent)
        self.processes[name] = proc
        return proc

    def _start_etcd(self, bin_dir: Path, dwp: bool) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        self._spawn("etcd", [
            str(bin_dir / "etcd"), "--name=n0", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=n0={peer}", "--unsafe-no-fsync=true",
            "--listen-metrics-urls=", "--log-level=warn",
            "--quota-backend-bytes=2147483648", "--auto-compaction-retention=1",
        ], dwp)
        self._wait_http(f"{client}/health", "etcd", tls=False)

    def restart_apiserver(self, *, wait: bool = True) -> None:
        """Stop kube-apiserver and start it again on the same port with the same flags
        (etcd keeps the state): what clients see of an API server restart. Call from the
        thread that started the cluster (see :meth:`ManagedProcess.start`); with ``wait``
        False, :meth:`wait_apiserver` waits for it to be ready."""
        self.processes["kube-apiserver"].stop()
        self._start_apiserver(self._bin_dir or binaries.locate(), True, wait=wait)
        self._write_state()

    def wait_apiserver(self) -> None:
        """Until kube-apiserver answers ``/readyz`` (bounded by the start timeout)."""
        self._wait_http(f"{self.server}/readyz", "kube-apiserver", tls=True, client_cert=True)

    def _start_apiserver(self, bin_dir: Path, dwp: bool, *, wait: bool = True) -> None:
        assert self._pki is not None
        p = self._pki
        port = self.ports["apiserver"]
        # Its own mount namespace, where /etc/hosts is the cluster's file (see the module
        # docstring); nothing else changes for it.
        argv = [
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts_file),
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--tls-cert-file={p.serving_cert}", f"--tls-private-key-file={p.serving_key}",
            f"--client-ca-file={p.ca_cert}",
            f"--service-account-issuer=https://127.0.0.1:{port}",
            f"--service-account-key-file={p.sa_public}",
            f"--service-account-signing-key-file={p.sa_private}",
            "--service-cluster-ip-range=10.0.0.0/24",
            f"--authorization-mode={','.join(self.options.authorization_modes)}",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={p.kubelet_client_cert}",
            f"--kubelet-client-key={p.kubelet_client_key}",
            "--kubelet-preferred-address-types=Hostname,InternalIP",
            "--enable-priority-and-fairness=false",
            "--max-requests-inflight=0", "--max-mutating-requests-inflight=0",
            "--profiling=false", "-v=1",
        ]
        if self.options.disable_admission_plugins:
            argv.append("--disable-admission-plugins="
                        + ",".join(self.options.disable_admission_plugins))
        if self.options.enable_admission_plugins:
            argv.append("--enable-admission-plugins="
                        + ",".join(self.options.enable_admission_plugins))
        argv += _gates_flag(self.options.feature_gates)
        argv += _audit_flags(self.options)
        self._spawn("kube-apiserver", argv, dwp, exe=str(bin_dir / "kube-apiserver"))
        if wait:
            self.wait_apiserver()

    def _start_scheduler(self, bin_dir: Path, dwp: bool) -> None:
        port = self.ports["scheduler"]
        self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            f"--cert-dir={self.workdir / 'scheduler-certs'}", "-v=2",
            *_gates_flag(self.options.feature_gates),
        ], dwp)

    def _start_controller_manager(self, bin_dir: Path, dwp: bool) -> None:
        assert self._pki is not None
        port = self.ports["controller_manager"]
        self._spawn("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'kcm-certs'}",
            f"--service-account-private-key-file={self._pki.sa_private}",
            f"--root-ca-file={self._pki.ca_cert}",
            "--controllers=*,-node-lifecycle-controller",
            "--use-service-account-credentials=false",
            "--kube-api-qps=200", "--kube-api-burst=400", "-v=1",
            *_gates_flag(self.options.feature_gates),
        ], dwp)

    def _wait_components(self) -> None:
        for name, key in (("kube-scheduler", "scheduler"),
                          ("kube-controller-manager", "controller_manager")):
            if name in self.processes:
                self._wait_http(f"https://127.0.0.1:{self.ports[key]}/healthz", name, tls=True)

    # -- readiness -----------------------------------------------------------------

    def ssl_context(self, *, client_cert: bool) -> ssl.SSLContext:
        assert self._pki is not None
        ctx = ssl.create_default_context(cafile=str(self._pki.ca_cert))
        if client_cert:
            ctx.load_cert_chain(str(self._pki.admin_cert), str(self._pki.admin_key))
        return ctx

    def _wait_http(self, url: str, name: str, *, tls: bool, client_cert: bool = False) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        if tls and client_cert:
            ctx: ssl.SSLContext | None = self.ssl_context(client_cert=True)
        elif tls:
            # Scheduler and controller-manager serve self-signed certificates.
            ctx = ssl._create_unverified_context()
        else:
            ctx = None
        last = ""
        delay = 0.05
        while time.monotonic() < deadline:
            proc = self.processes[name]
            if not proc.alive():
                raise ClusterStartError(f"{name} exited during start:\n{proc.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = repr(exc)
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        raise ClusterStartError(
            f"{name} not ready at {url} within {self.options.start_timeout_s:.0f}s "
            f"(last: {last}):\n{self.processes[name].log_tail()}"
        )

    # -- state file for the CLI ----------------------------------------------------

    def record_real_node(self, record_id: str) -> None:
        """Note a real node in the state file, so ``rota-cluster down`` stops it too."""
        self._real_nodes.append(record_id)
        self._write_state()

    def _write_state(self) -> None:
        state: dict[str, Any] = {
            "real_nodes": list(self._real_nodes),
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "logs": str(self.log_dir),
            "processes": {
                name: {"pid": proc.pid, "exe": Path(proc.exe).name}
                for name, proc in self.processes.items()
            },
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2))

    def resident_memory_bytes(self) -> dict[str, int]:
        """RSS of each component, read from /proc."""
        out: dict[str, int] = {}
        for name, proc in self.processes.items():
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) * 1024
            except OSError:
                continue
        return out


def stop_from_state(workdir: Path) -> list[str]:
    """Stop a cluster that ``rota-cluster up`` left running, by the pids it recorded: its
    real nodes first (every process in their cgroups), then the control plane."""
    from e2e.cluster import leftovers

    path = workdir / STATE_FILE
    state = json.loads(path.read_text())
    stopped = []
    for record_id in state.get("real_nodes", []):
        record = leftovers.load(record_id)
        if record is not None:
            leftovers.remove(record)
            stopped.append(f"node {record.name}")
    order = ["kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd"]
    procs: dict[str, dict[str, Any]] = state.get("processes", {})
    for name in sorted(procs, key=lambda n: order.index(n) if n in order else -1):
        info = procs[name]
        stop_pid(int(info["pid"]), expected_exe=str(info["exe"]))
        stopped.append(name)
    path.unlink()
    return stopped
