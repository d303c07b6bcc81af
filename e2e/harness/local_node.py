"""One simulated GPU node of the local cluster: the rota driver and the node agent as
real processes, with their directories. Tests, the demo and the benchmarks build on it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from driver.nvml import fixture_path
from e2e.cluster import LocalCluster, create_node
from e2e.cluster.local import free_port
from e2e.cluster.processes import ManagedProcess
from e2e.harness.objects import MANIFESTS, apply_manifest, create_namespace
from e2e.harness.waiting import eventually


@dataclass
class NodeDirs:
    root: Path

    @property
    def registry(self) -> Path:
        return self.root / "reg"

    @property
    def plugin(self) -> Path:
        return self.root / "plugin"

    @property
    def cdi(self) -> Path:
        return self.root / "cdi"

    @property
    def procs(self) -> Path:
        return self.root / "nvml-procs"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def ledger(self) -> Path:
        return self.plugin / "ledger.json"

    @property
    def dra_socket(self) -> Path:
        return self.plugin / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry / "gpu.rota.dev-reg.sock"

    @property
    def inspect_socket(self) -> Path:
        return self.plugin / "inspect.sock"

    @property
    def start_gate(self) -> Path:
        """The start-gate directory (the controller's socket, mounted into engines)."""
        return self.root / "start"


@dataclass
class GpuNode:
    """A Node object plus a driver (and optionally a node agent) serving it."""

    cluster: LocalCluster
    api: client.ApiClient
    name: str
    fixture: str = "h200"
    sharing_mode: str = "shared"
    driver_args: list[str] = field(default_factory=list)
    dirs: NodeDirs = field(init=False)
    driver: ManagedProcess | None = None
    agent: ManagedProcess | None = None
    http_port: int = 0
    starts: int = 0
    controllers: dict[str, tuple[ManagedProcess, str]] = field(default_factory=dict)
    gateways: dict[str, tuple[ManagedProcess, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Short: unix socket paths must stay under 108 bytes.
        self.dirs = NodeDirs(Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp")))
        for d in (self.dirs.registry, self.dirs.plugin, self.dirs.cdi, self.dirs.procs,
                  self.dirs.logs, self.dirs.start_gate):
            d.mkdir(parents=True, exist_ok=True)
        create_node(self.api, self.name)

    @property
    def fixture_file(self) -> Path:
        return fixture_path(self.fixture) if "/" not in self.fixture else Path(self.fixture)

    def driver_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start_driver(self, *, wait: bool = True, extra: list[str] | None = None) -> None:
        self.http_port = free_port()
        self.starts += 1
        argv = [sys.executable, "-m", "driver",
                f"--node-name={self.name}", f"--kubeconfig={self.cluster.kubeconfig}",
                f"--plugin-registry-dir={self.dirs.registry}",
                f"--plugin-data-dir={self.dirs.plugin}", f"--cdi-root={self.dirs.cdi}",
                "--nvml-backend=fake", f"--fake-nvml-fixture={self.fixture_file}",
                f"--fake-nvml-proc-dir={self.dirs.procs}",
                f"--sharing-mode={self.sharing_mode}",
                f"--start-gate-dir={self.dirs.start_gate}",
                # Every address, as the chart has it; reached over IPv4 loopback.
                f"--http-address=[::]:{self.http_port}", "--slice-resync-s=5",
                *self.driver_args, *(extra or [])]
        self.driver = ManagedProcess(name="driver", argv=argv,
                                     log_path=self.dirs.logs / "driver.log",
                                     env=self.driver_env())
        self.driver.start()
        if wait:
            self.wait_driver_ready()

    def wait_driver_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            assert self.driver is not None
            assert self.driver.alive(), f"driver exited:\n{self.driver.log_tail()}"
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz",
                                        timeout=2) as resp:
                return resp.status == 200 and self.dirs.registration_socket.exists()

        eventually(ready, timeout=timeout, what=f"driver of {self.name} ready")

    def driver_metric(self, name: str) -> float:
        """The sum of every sample of one of the driver's Prometheus metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics",
                                    timeout=5) as resp:
            text = resp.read().decode()
        return sum(float(m.group(1)) for m in
                   re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def kill_driver(self) -> None:
        """SIGKILL, as a crash would: no clean-up runs."""
        if self.driver is not None and self.driver.popen is not None:
            self.driver.popen.send_signal(signal.SIGKILL)
            self.driver.popen.wait(timeout=10)

    def stop_driver(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    def start_agent(self, extra_env: Mapping[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "e2e.node_agent",
                f"--kubeconfig={self.cluster.kubeconfig}", f"--node={self.name}",
                f"--registry-dir={self.dirs.registry}", f"--cdi-root={self.dirs.cdi}",
                f"--log-dir={self.dirs.logs}",
                f"--env=ROTA_FAKE_NVML_PROC_DIR={self.dirs.procs}"]
        for key, value in (extra_env or {}).items():
            argv.append(f"--env={key}={value}")
        self.agent = ManagedProcess(name="node-agent", argv=argv,
                                    log_path=self.dirs.logs / "node-agent.log",
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.agent.start()

    def start_controller(self, *, identity: str = "controller-0",
                         extra: list[str] | None = None) -> ManagedProcess:
        """A lease controller for this node. Its activation API keeps one loopback port per
        identity across restarts, as a Service address would."""
        known = self.controllers.get(identity)
        port = int(known[1].rsplit(":", 1)[1]) if known else free_port()
        argv = [sys.executable, "-m", "controller", "lease", f"--node-name={self.name}",
                f"--kubeconfig={self.cluster.kubeconfig}", f"--identity={identity}",
                f"--inspect-socket={self.dirs.inspect_socket}",
                # Every address, as the chart has it; advertised and reached over IPv4.
                f"--listen=[::]:{port}", "--advertise-host=127.0.0.1",
                "--namespace=rota-system",
                f"--start-socket={self.dirs.start_gate / 'start.sock'}",
                "--election-lease-s=4", "--resync-s=2",
                # below ManagedProcess.stop's wait, so a test's clean stop stays clean
                "--shutdown-grace-s=10", *(extra or [])]
        proc = ManagedProcess(name=f"controller-{identity}", argv=argv,
                              log_path=self.dirs.logs / f"controller-{identity}.log",
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc.start()
        self.controllers[identity] = (proc, f"http://127.0.0.1:{port}")
        return proc

    def start_gateway(self, name: str = "gateway-0", *, token_file: Path | None = None,
                      extra: list[str] | None = None) -> str:
        """A gateway process for the whole cluster; returns its base URL."""
        port = free_port()
        argv = [sys.executable, "-m", "controller", "gateway", "--host=127.0.0.1",
                f"--port={port}", f"--kubeconfig={self.cluster.kubeconfig}",
                "--controller-namespace=rota-system", *(extra or [])]
        if token_file is not None:
            argv.append(f"--activation-token-file={token_file}")
        proc = ManagedProcess(name=name, argv=argv, log_path=self.dirs.logs / f"{name}.log",
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc.start()
        url = f"http://127.0.0.1:{port}"
        self.gateways[name] = (proc, url)

        def ready() -> bool:
            assert proc.alive(), proc.log_tail()
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)

        eventually(ready, timeout=60, what=f"{name} ready")
        return url

    def controller_url(self, identity: str = "controller-0") -> str:
        return self.controllers[identity][1]

    def ledger(self) -> dict[str, Any]:
        if not self.dirs.ledger.exists():
            return {}
        data: dict[str, Any] = json.loads(self.dirs.ledger.read_text())["data"]["claims"]
        return data

    def cdi_specs(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for path in self.dirs.cdi.glob("k8s.gpu.rota.dev-claim_*.json"):
            out[path.stem.split("_", 1)[1]] = json.loads(path.read_text())
        return out

    def close(self) -> None:
        for proc, _ in (*self.gateways.values(), *self.controllers.values()):
            proc.stop()
        if self.agent is not None:
            self.agent.stop()
        self.stop_driver()
        try:
            client.CoreV1Api(self.api).delete_node(self.name)
        except client.ApiException:
            pass
        subprocess.run(["rm", "-rf", str(self.dirs.root)], check=False)


@contextlib.contextmanager
def engine_node(cluster: LocalCluster, api: client.ApiClient, *, prefix: str,
                namespace: str | None = None) -> Iterator[tuple[GpuNode, str]]:
    """A fresh GPU node with its driver and node agent, and a namespace for engines (a
    new one unless given); both are removed on exit. For the demo and the benchmarks."""
    apply_manifest(api, MANIFESTS / "deviceclass.yaml")
    core = client.CoreV1Api(api)
    own_namespace = namespace is None
    namespace = namespace or f"{prefix}-{uuid.uuid4().hex[:8]}"
    if own_namespace:
        create_namespace(api, namespace)
    node = GpuNode(cluster=cluster, api=api, name=f"{prefix}-{uuid.uuid4().hex[:8]}")
    try:
        node.start_driver()
        node.start_agent()
        yield node, namespace
    finally:
        node.close()
        if own_namespace:
            with contextlib.suppress(client.ApiException):
                core.delete_namespace(namespace)

