"""What a campaign runs on: the local cluster, GPU nodes (driver and node agent as real
processes, a fake H200 each, whose memory runs out), engine simulators deployed as pods
through claims, a lease controller per node reaching the API server through a
:class:`~e2e.chaos.proxy.FlakyRelay`, and gateways.

Two modes: one engine awake per GPU (the default), or an awake set
(:meth:`RigOptions.for_awake_set`: controllers started with ``--awake-set``, three engines
per GPU whose awake budgets let any two be awake together, never three)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.chaos.proxy import FlakyRelay
from e2e.chaos.tally import AWAKE_SET, ONE_AWAKE
from e2e.cluster import LocalCluster, pki
from e2e.cluster.local import free_port
from e2e.cluster.processes import ManagedProcess
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import MANIFESTS, apply_manifest
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, deploy

__all__ = ["NodeRig", "Rig", "RigOptions", "slow_starters"]

GIB = 2**30
FAST_ENGINE = ("--later-sleep-seconds", "0.01", "--first-sleep-seconds", "0.05",
               "--wake-level1-seconds", "0.01", "--ttft-seconds", "0.002")
SLOW_START = "--start-seconds"


@dataclass(frozen=True)
class RigOptions:
    nodes: int = 2
    engines_per_gpu: int = 2
    awake: str = "80Gi"
    """Each engine's awake budget: 80Gi twice does not fit an H200 awake together, so
    every start and every switch depends on rota's ordering."""
    resident: str = "2Gi"
    slow_start_s: float = 12.0
    """The last engine of each GPU is a slow starter: it shows no GPU process and answers
    nothing for this long at start (a real vLLM's imports and model load), far beyond the
    election Lease below. 0: none."""
    slow_awake: str = "40Gi"
    """The slow starter's awake budget: it fits beside another awake engine, so an engine
    woken beside it shows as two awake rather than as an out-of-memory start."""
    gateways: int = 2
    controller_args: tuple[str, ...] = (
        "--min-residency-s=0", "--resync-s=2", "--election-lease-s=4",
        # The simulators answer in milliseconds: bounds far above that, far below the
        # defaults sized for real engines, so a hung call costs seconds, not minutes.
        '--timeouts={"drain_s": 2, "sleep_s": 10, "wake_s": 10, "probe_s": 5, '
        '"inspect_s": 2, "lease_s": 5}')
    gateway_args: tuple[str, ...] = ("--max-wait-s=45", "--stream-keepalive-s=5")
    awake_set: bool = False
    """Start the lease controllers with ``--awake-set``: several engines of a GPU may be
    awake at once where their awake budgets fit it together."""
    engine_gpu_limit: str = ""
    """The GPU size the engine simulators' own capacity check assumes ("": the fake GPU's,
    so that an allocation that does not fit fails as on a real GPU). Set far above it in
    awake-set mode: a set the controller overcommits then shows as memory in use over the
    GPU's total, which the campaign's monitor counts, instead of as a wake that ran out of
    memory, which it would count only as a failed switch."""

    @classmethod
    def for_awake_set(cls, **changes: Any) -> RigOptions:
        """The awake-set mode: three engines per GPU, 60Gi awake each (the slow starter
        40Gi): any two fit an H200 awake together (with the third at its resident
        budget), no three do, so every third model asked for displaces one."""
        return replace(cls(awake_set=True, engines_per_gpu=3, awake="60Gi",
                           slow_awake="40Gi", engine_gpu_limit="1024Gi"), **changes)

    @property
    def mode(self) -> str:
        """:data:`~e2e.chaos.tally.AWAKE_SET` or :data:`~e2e.chaos.tally.ONE_AWAKE`."""
        return AWAKE_SET if self.awake_set else ONE_AWAKE


@dataclass
class NodeRig:
    node: GpuNode
    relay: FlakyRelay
    kubeconfig: Path
    engines: list[Engine] = field(default_factory=list)
    controllers: list[ManagedProcess] = field(default_factory=list)
    monitor: AwakeMonitor | None = None

    def start_controller(self, options: RigOptions, *, identity: str = "controller-0"
                         ) -> ManagedProcess:
        proc = self.node.start_controller(identity=identity, extra=[
            *options.controller_args, *(["--awake-set=true"] if options.awake_set else []),
            f"--kubeconfig={self.kubeconfig}", f"--listen=127.0.0.1:{free_port()}"])
        self.controllers.append(proc)
        return proc

    def signal_controller(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to one live controller; False when none runs."""
        for proc in self.controllers:
            if proc.alive() and proc.popen is not None:
                proc.popen.send_signal(sig)
                return True
        return False

    def reap(self) -> None:
        self.controllers = [p for p in self.controllers if p.alive()]


def slow_starters(node: NodeRig) -> list[Engine]:
    """The node's engines that start slowly (see :attr:`RigOptions.slow_start_s`)."""
    return [e for e in node.engines
            if any(str(a).startswith(SLOW_START) for a in e.spec.args)]


def _relay_kubeconfig(cluster: LocalCluster, relay: FlakyRelay, path: Path) -> Path:
    """The cluster's admin kubeconfig, reaching the API server through ``relay``."""
    pki.write_kubeconfig(path, server=f"https://127.0.0.1:{relay.port}", pki=cluster.pki)
    return path


@dataclass
class Rig:
    cluster: LocalCluster
    api: client.ApiClient
    namespace: str
    options: RigOptions
    nodes: list[NodeRig] = field(default_factory=list)
    gateways: list[str] = field(default_factory=list)

    @property
    def engines(self) -> list[Engine]:
        return [e for n in self.nodes for e in n.engines]

    def models_by_gpu(self) -> list[list[str]]:
        return [[e.spec.model for e in n.engines] for n in self.nodes]

    async def add_node(self, index: int) -> NodeRig:
        node = GpuNode(cluster=self.cluster, api=self.api, name=f"chaos-{index}-"
                       f"{uuid.uuid4().hex[:6]}")
        node.start_driver()
        node.start_agent()
        relay = FlakyRelay("127.0.0.1", self.cluster.api_port)
        await relay.start()
        rig = NodeRig(node, relay, _relay_kubeconfig(self.cluster, relay,
                                                      node.dirs.root / "relay.kubeconfig"))
        self.nodes.append(rig)
        return rig

    def deploy_engines(self, rig: NodeRig, index: int) -> None:
        specs = [self._spec(index, k) for k in range(self.options.engines_per_gpu)]
        rig.engines = deploy(self.api, self.namespace, rig.node.name, specs, timeout=180)

    def _spec(self, index: int, k: int) -> EngineSpec:
        slow = (self.options.slow_start_s > 0 and self.options.engines_per_gpu > 1
                and k == self.options.engines_per_gpu - 1)
        args = (*FAST_ENGINE, f"{SLOW_START}={self.options.slow_start_s}") if slow \
            else FAST_ENGINE
        if self.options.engine_gpu_limit:
            args = (*args, f"--gpu-memory-bytes={self.options.engine_gpu_limit}")
        return EngineSpec(f"e{index}-{k}", f"chaos/gpu{index}-m{k}",
                          resident=self.options.resident,
                          awake=self.options.slow_awake if slow else self.options.awake,
                          args=args, gated=True)

    def start_gateways(self) -> None:
        assert self.nodes, "gateways need a node to keep their logs"
        for k in range(self.options.gateways):
            self.gateways.append(self.nodes[0].node.start_gateway(
                f"gateway-{k}", extra=[f"--serving-namespaces={self.namespace}",
                                       *self.options.gateway_args]))

    async def close(self, keep_logs: Path | None = None) -> None:
        """Stop everything; ``keep_logs``: first copy every node's logs into
        ``keep_logs/<node>`` (the nodes' own folders are removed)."""
        for rig in self.nodes:
            if rig.monitor is not None:
                rig.monitor.__exit__(None, None, None)
            await rig.relay.close()
            for proc in rig.controllers:
                proc.stop()
            if keep_logs is not None:
                shutil.copytree(rig.node.dirs.logs, keep_logs / rig.node.name,
                                dirs_exist_ok=True)
            rig.node.close()


@contextlib.contextmanager
def namespace_for(api: client.ApiClient) -> Iterator[str]:
    apply_manifest(api, MANIFESTS / "deviceclass.yaml")
    core = client.CoreV1Api(api)
    name = f"chaos-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(name)
