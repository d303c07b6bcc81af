"""A real Kubernetes node on this machine: kubelet, containerd, runc and bridge CNI, in
namespaces of its own, attached to a :class:`~e2e.cluster.local.LocalCluster`.

Start order: leftovers of crashed runs removed; the node's cgroups (under the caller's
cgroup) and namespaces (:mod:`e2e.cluster.node_namespace`); the relays to and from the
apiserver (:mod:`e2e.cluster.relays`); containerd, then the images imported into it (there
is no registry); the fake GPU's device nodes when asked for; the kubelet, which registers
the Node as ``system:node:<name>`` and is waited for until the Node is Ready. Stop is the
reverse, by pid, and then every process left in the node's cgroups (shims, containers) is
killed and the cgroups, the namespaces and the node's directory are removed.

Inside the node, paths are the usual ones (``/var/lib/kubelet``, ``/var/run/cdi``, ...);
:meth:`RealNode.path` gives the host path of one. The host reaches an address inside the
node through :meth:`RealNode.forward`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from e2e.cluster import node_config, pki
from e2e.cluster.leftovers import NodeRecord, owner, remove_leftovers, start_time
from e2e.cluster.local import LocalCluster, free_port
from e2e.cluster.node_cgroups import NodeCgroups
from e2e.cluster.node_namespace import NodeNamespace
from e2e.cluster.processes import ManagedProcess
from e2e.cluster.relays import Relays, joined
from e2e.harness.waiting import WaitTimeout, eventually
from e2e.images import BuiltImages

log = logging.getLogger(__name__)

FAKE_GPU_DEV_ROOT = "/var/lib/rota/fake-gpu/dev"
"""Where a node with a fake GPU has its device nodes (inside the node)."""
FAKE_GPU_DEVICES: Mapping[str, tuple[int, int]] = {
    "nvidia0": (195, 0), "nvidiactl": (195, 255), "nvidia-uvm": (510, 0),
}
"""The character devices of the fake GPU. ``nvidia-uvm-tools`` is missing on purpose, as
on many real GPU nodes: a CDI spec listing it would fail every container."""
GPU_LABELS: Mapping[str, str] = {"nvidia.com/gpu.present": "true"}


class NodeStartError(RuntimeError):
    """A part of the node did not come up; the message carries its log tail."""


@dataclass(frozen=True)
class RealNodeOptions:
    labels: Mapping[str, str] = field(default_factory=lambda: dict(GPU_LABELS))
    fake_gpu: bool = True
    """Create the fake GPU's device nodes under :data:`FAKE_GPU_DEV_ROOT`."""
    kubelet_config: Mapping[str, object] = field(default_factory=dict)
    """Extra KubeletConfiguration fields."""
    kubelet_verbosity: int = 1
    ready_timeout_s: float = 120.0
    registry_ports: Sequence[int] = ()
    """Plain-HTTP registries on the host's loopback the node pulls from: each is relayed to
    the node's ``127.0.0.1:<port>`` and named in containerd's registry hosts directory."""


@dataclass
class StartTimes:
    """Seconds from the start call to each step's end."""

    namespaces: float = 0.0
    containerd: float = 0.0
    images: float = 0.0
    kubelet_ready: float = 0.0


class RealNode:
    """One real node. Use :meth:`start` and :meth:`stop`, or as a context manager."""

    def __init__(self, cluster: LocalCluster, name: str, images: BuiltImages, *,
                 bin_dir: Path, options: RealNodeOptions | None = None,
                 index: int | None = None) -> None:
        self.cluster = cluster
        self.name = name
        self.images = images
        self.bin_dir = bin_dir
        self.options = options or RealNodeOptions()
        self.index = index if index is not None else cluster.allocate_node_index()
        self.id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.dir = cluster.workdir / "nodes" / str(self.index)  # short: socket paths
        self.node_ip = f"10.250.{self.index}.2"
        self.pod_cidr = f"10.88.{self.index}.0/24"
        self.kubelet_port = 0
        self.cgroups = NodeCgroups.for_node(self.id)
        self.namespace: NodeNamespace | None = None
        self.relays: Relays | None = None
        self.containerd: ManagedProcess | None = None
        self.kubelet: ManagedProcess | None = None
        self.record: NodeRecord | None = None
        self.times = StartTimes()
        self._die_with_parent = True
        self._links = Path(tempfile.gettempdir()) / f"rota-{self.id}"

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> RealNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def start(self, *, die_with_parent: bool = True) -> None:
        started = time.monotonic()
        self._die_with_parent = die_with_parent
        removed = remove_leftovers()
        if removed:
            log.warning("removed leftover nodes", extra={"nodes": removed})
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._start_namespaces()
            self.times.namespaces = time.monotonic() - started
            self._start_relays()
            self._start_containerd()
            self.times.containerd = time.monotonic() - started
            self._import_images()
            self.times.images = time.monotonic() - started
            if self.options.fake_gpu:
                self._make_fake_gpu()
            self.cluster.add_host(self.name)
            self._start_kubelet()
            self._wait_ready()
            self.times.kubelet_ready = time.monotonic() - started
        except BaseException:
            self.stop(delete_node=False)
            raise
        log.info("node ready", extra={"node": self.name, "seconds": round(
            self.times.kubelet_ready, 2)})

    def stop(self, *, delete_node: bool = True) -> None:
        for proc in (self.kubelet, self.containerd):
            if proc is not None:
                proc.stop(timeout_s=10)
        self.cgroups.kill()
        if self.relays is not None:
            self.relays.stop()
        if self.namespace is not None:
            self.namespace.stop()
        self.cgroups.remove()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self._links, ignore_errors=True)
        if self.record is not None:
            self.record.drop()
            self.record = None
        if delete_node:
            with contextlib.suppress(Exception):
                api = self.cluster.api_client()
                try:
                    client.CoreV1Api(api).delete_node(self.name, _request_timeout=10)
                finally:
                    api.close()

    # -- parts -------------------------------------------------------------------------

    def _start_namespaces(self) -> None:
        self.cgroups.create()
        freezer = next((d for d in self.cgroups.dirs() if (d / "freezer.state").exists()),
                       None)
        self.namespace = NodeNamespace(
            node_dir=self.dir, node_ip=self.node_ip, service_ip=pki.SERVICE_ADDRESS,
            api_port=self.cluster.api_port, cgroup_dirs=self.cgroups.dirs(), freezer=freezer)
        holder = self.namespace.start(die_with_parent=self._die_with_parent)
        who, since = owner()
        self.record = NodeRecord(
            id=self.id, name=self.name, node_dir=self.dir, cgroup_path=self.cgroups.path,
            cgroups_created=list(self.cgroups.created), holder_pid=holder.pid,
            holder_start=start_time(holder.pid) or 0,
            owner_pid=who if self._die_with_parent else None,
            owner_start=since if self._die_with_parent else None)
        self.record.save()

        def ready() -> bool:
            if not holder.alive():
                raise NodeStartError(f"the node's namespaces failed:\n{holder.log_tail()}")
            return self.namespace is not None and self.namespace.ready_file.exists()

        eventually(ready, timeout=20, what=f"namespaces of node {self.name}")

    @property
    def ns(self) -> NodeNamespace:
        assert self.namespace is not None, "the node is not started"
        return self.namespace

    def _env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
                "ROTA_JOIN": " ".join(str(d / "cgroup.procs")
                                      for d in self.cgroups.dirs("system")),
                "HOME": "/root"}

    def _spawn(self, name: str, argv: Sequence[str], exe: str) -> ManagedProcess:
        proc = ManagedProcess(name=name, argv=self.ns.enter(joined(argv)),
                              log_path=self.logs / f"{name}.log", env=self._env(), exe=exe)
        proc.start(die_with_parent=self._die_with_parent)
        return proc

    def listening_inside(self, port: int) -> bool:
        out = subprocess.run(self.ns.enter(["ss", "-Hltn", f"sport = :{port}"]),
                             capture_output=True, text=True, check=False, timeout=10).stdout
        return bool(out.strip())

    def _start_relays(self) -> None:
        self.kubelet_port = free_port()
        self.relays = Relays(directory=self.dir / "relay", enter=self.ns.enter,
                             env=self._env(), die_with_parent=self._die_with_parent)
        self.relays.to_apiserver(self.cluster.api_port, self.listening_inside)
        self.relays.to_kubelet(self.kubelet_port)
        for port in self.options.registry_ports:
            self.relays.to_host(port, self.listening_inside)

    def _start_containerd(self) -> None:
        cni_dir = self.dir / "cni"
        cni_dir.mkdir(parents=True, exist_ok=True)
        (cni_dir / "10-rota.conflist").write_text(node_config.cni_conflist(self.pod_cidr))
        runc = shutil.which("runc")
        if runc is None:
            raise NodeStartError("runc is not installed (run e2e/toolchain/setup-host.sh)")
        hosts = self.dir / "certs.d"
        for port in self.options.registry_ports:
            address = f"127.0.0.1:{port}"
            (hosts / address).mkdir(parents=True, exist_ok=True)
            (hosts / address / "hosts.toml").write_text(node_config.registry_hosts(address))
        conf = self.dir / "containerd.toml"
        conf.write_text(node_config.containerd_config(
            sandbox_image=self.images.pause, cni_conf_dir=cni_dir, runc=runc,
            registry_hosts_dir=hosts if self.options.registry_ports else None))
        binary = str(self.bin_dir / "containerd")
        self.containerd = self._spawn("containerd", [binary, f"--config={conf}"], binary)
        socket = self.ns.path(node_config.CONTAINERD_SOCKET)

        def up() -> bool:
            assert self.containerd is not None
            if not self.containerd.alive():
                raise NodeStartError(f"containerd exited:\n{self.containerd.log_tail()}")
            return socket.exists() and stat.S_ISSOCK(socket.stat().st_mode) and \
                self.ctr("version").returncode == 0

        eventually(up, timeout=30, what=f"containerd of node {self.name}")

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``ctr -n k8s.io <args>`` against the node's containerd."""
        argv = [str(self.bin_dir / "ctr"), f"--address={node_config.CONTAINERD_SOCKET}",
                "--namespace=k8s.io", *args]
        return subprocess.run(self.ns.enter(joined(argv)), capture_output=True, text=True,
                              check=False, timeout=timeout, env=self._env())

    def _import_images(self) -> None:
        result = self.ctr("images", "import", "--platform=linux/amd64",
                          "--local", "--discard-unpacked-layers",
                          str(self.images.archive), timeout=300)
        if result.returncode != 0:
            raise NodeStartError(f"importing {self.images.archive} failed:\n{result.stderr}")

    def _make_fake_gpu(self) -> None:
        dev = self.path(FAKE_GPU_DEV_ROOT)
        dev.mkdir(parents=True, exist_ok=True)
        for name, (major, minor) in FAKE_GPU_DEVICES.items():
            node = dev / name
            if not node.exists():
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))

    def _kubelet_argv(self) -> list[str]:
        node_pki = self.dir / "pki"
        cert, key = pki.issue_client_cert(self.cluster.pki, node_pki, "kubelet",
                                          common_name=f"system:node:{self.name}",
                                          organisation="system:nodes")
        kubeconfig = self.dir / "kubelet.kubeconfig"
        pki.write_kubeconfig(kubeconfig, server=f"https://127.0.0.1:{self.cluster.api_port}",
                             pki=self.cluster.pki, user=f"system:node:{self.name}",
                             client_cert=cert, client_key=key)
        conf = self.dir / "kubelet.yaml"
        conf.write_text(node_config.kubelet_config(
            cgroup_root=self.cgroups.path, port=self.kubelet_port,
            client_ca=self.cluster.pki.ca_cert, extra=self.options.kubelet_config))
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.options.labels.items()))
        binary = str(self.bin_dir / "kubelet")
        return [binary, f"--config={conf}", f"--kubeconfig={kubeconfig}",
                f"--node-ip={self.node_ip}", f"--hostname-override={self.name}",
                *([f"--node-labels={labels}"] if labels else []),
                f"--v={self.options.kubelet_verbosity}"]

    def _start_kubelet(self) -> None:
        argv = self._kubelet_argv()
        self.kubelet = self._spawn("kubelet", argv, argv[0])

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same configuration;
        containers keep running, as on a real node."""
        assert self.kubelet is not None
        self.kubelet.stop(timeout_s=15)
        proc = ManagedProcess(name="kubelet", argv=self.kubelet.argv,
                              log_path=self.logs / "kubelet.log", env=self._env(),
                              exe=self.kubelet.exe)
        proc.start(die_with_parent=self._die_with_parent)
        self.kubelet = proc

    def _wait_ready(self) -> None:
        api = self.cluster.api_client()
        core = client.CoreV1Api(api)

        def ready() -> bool:
            assert self.kubelet is not None
            if not self.kubelet.alive():
                raise NodeStartError(f"the kubelet exited:\n{self.kubelet.log_tail(60)}")
            node = core.read_node(self.name, _request_timeout=5)
            return any(c.type == "Ready" and c.status == "True"
                       for c in node.status.conditions or [])

        try:
            eventually(ready, timeout=self.options.ready_timeout_s,
                       what=f"node {self.name} Ready")
        except WaitTimeout as exc:
            assert self.kubelet is not None
            raise NodeStartError(f"{exc}\nkubelet log:\n{self.kubelet.log_tail(60)}") from exc
        finally:
            api.close()

    # -- access ------------------------------------------------------------------------

    def path(self, inside: str) -> Path:
        """The host path of a path inside the node (its mount namespace)."""
        inside = "/" + inside.lstrip("/")
        for prefix, local in (("/var/run/", "run/"), ("/run/", "run/"),
                              ("/var/lib/", "var-lib/"), ("/var/log/", "var-log/")):
            if inside.startswith(prefix):
                return self.dir / local / inside[len(prefix):]
        return self.ns.path(inside)

    def socket(self, inside: str) -> Path:
        """The host path of a unix socket inside the node, short enough to connect to
        (a symlink in a short directory when the real path is over the 107-byte limit)."""
        path = self.path(inside)
        if len(os.fsencode(path)) <= 107:
            return path
        self._links.mkdir(parents=True, exist_ok=True)
        link = self._links / f"{len(list(self._links.iterdir()))}.sock"
        link.symlink_to(path)
        return link

    def forward(self, address: str, port: int) -> str:
        """A URL on the host's loopback that reaches ``address:port`` inside the node."""
        assert self.relays is not None
        return f"http://127.0.0.1:{self.relays.forward(address, port)}"

    def resident_memory_bytes(self) -> dict[str, int]:
        """RSS of the node's processes by program name (kubelet, containerd, shims, pods)."""
        out: dict[str, int] = {}
        for pid in self.cgroups.pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            name = fields.get("Name", "?").strip()
            rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
            out[name] = out.get(name, 0) + rss
        return out
