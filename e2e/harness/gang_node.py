"""An in-memory node with several GPUs, for the gang-switch tests and the gang chaos
campaign: real engine simulators over HTTP on loopback, one in-memory GPU Lease per GPU
(compare-and-swap as the API server does), a device port that reads each simulator's memory
as NVML shows a tensor-parallel engine (one worker process per GPU, each holding its
shard), and the controller's own GPU workers and locks.

:class:`OneAwakeWatch` checks the promise at every memory change of every simulator, not
by sampling: no instant with two engines awake on one GPU goes unseen. With the controller's
awake sets on, :class:`AwakeSetWatch` checks theirs instead: no instant with a GPU's
processes over its memory, none with more engines awake than their budgets fit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp.test_utils import TestServer

from controller.claimants import Claimant
from controller.lease.admission import StartLimits, StartSwitch
from controller.lease.device import GpuProcess, GpuSnapshot
from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.lease.engines.registry import make_adapter
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.gpu_locks import GpuLocks, domains
from controller.lease.metrics import SwitchMetrics
from controller.lease.settings import StepTimeouts
from controller.lease.switch import Limits, Ports, Switcher, SwitchObserver
from e2e.engine_simulator import Settings, create_app
from e2e.engine_simulator.engine import Engine as SimEngine
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.loopback import SimulatorServer
from e2e.engine_simulator.settings import Faults, FaultsPatch
from e2e.harness.ports import MemoryLeasePort
from e2e.harness.waiting import eventually_async
from rota.api import naming
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config
from rota.api.gpu_lease import GpuLease

GIB = 2**30


class RunningSim(Protocol):
    """An engine simulator serving on loopback (the tests' ``EngineSim`` is one)."""

    server: TestServer
    engine: SimEngine
    settings: Settings

    @property
    def base_url(self) -> str: ...

    async def faults(self, **changes: bool) -> Faults: ...

    async def stop(self) -> None: ...


SimFactory = Callable[..., Awaitable[RunningSim]]


@dataclass
class LoopbackSim:
    server: TestServer
    engine: SimEngine
    settings: Settings

    @property
    def base_url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def faults(self, **changes: bool) -> Faults:
        return await self.engine.set_faults(FaultsPatch.model_validate(changes))

    async def stop(self) -> None:
        await self.server.close()


async def start_sim(**overrides: Any) -> LoopbackSim:
    """A simulator as vLLM 0.26 behaves (sleep mode, dev routes), on 127.0.0.1."""
    values: dict[str, Any] = {"model": "sim/model", "awake_memory_bytes": 10 * GIB,
                              "resident_memory_bytes": GIB, "weights_bytes": 6 * GIB,
                              "shutdown_grace_seconds": 0.0, "dev_mode": True}
    settings = Settings.model_validate(values | overrides)
    app = create_app(settings, exit_process=lambda code: None)
    server = SimulatorServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return LoopbackSim(server, app[ENGINE_KEY], settings)

GPU_TOTAL = 141 * GIB
NODE = "node-a"
TOLERANCE = 512 * 1024**2


@dataclass
class Engine:
    """One engine on the node: its simulator and the GPUs it holds."""

    sim: RunningSim
    claimant: Claimant
    gone_from: set[str] = field(default_factory=set)
    """GPUs where its process exited (a tensor-parallel worker that died)."""
    base_url: str = ""

    def __post_init__(self) -> None:
        self.base_url = self.sim.base_url  # still its address once the server stops

    def shard(self) -> int:
        return self.sim.engine.memory.used_bytes // len(self.claimant.gpus)

    def awake_on(self, gpu: str) -> bool:
        """Holds more than its resident footprint on ``gpu``, as NVML would show."""
        return (gpu in self.claimant.gpus and gpu not in self.gone_from
                and self.shard() > self.claimant.resident_on(gpu) + TOLERANCE)


@dataclass
class OneAwakeWatch:
    engines: list[Engine]
    gpus: tuple[str, ...]
    violations: list[str] = field(default_factory=list)
    checks: int = 0

    def check(self) -> None:
        self.checks += 1
        for gpu in self.gpus:
            awake = [e.claimant.ref for e in self.engines if e.awake_on(gpu)]
            if len(awake) > 1:
                self.violations.append(f"{gpu}: {', '.join(awake)}")


@dataclass
class AwakeSetWatch(OneAwakeWatch):
    """The awake set's promise, at every memory change: a GPU's processes (engines and
    strangers) never hold more than its memory; the engines awake on it never more than
    their awake budgets, with every other engine's resident footprint, can fit; and a GPU
    with an engine that spans GPUs (where sets are off) never has two awake."""

    strangers: dict[str, int] = field(default_factory=dict)
    """The device's bytes of processes in no claimant's pod, per GPU (shared with it)."""
    together: int = 0
    """Checks that found two or more engines awake on some GPU (the sets that formed)."""
    peak_used: int = 0

    def check(self) -> None:
        self.checks += 1
        grouped = False
        for gpu in self.gpus:
            on = [e for e in self.engines if gpu in e.claimant.gpus and gpu not in e.gone_from]
            awake = [e for e in on if e.awake_on(gpu)]
            grouped = grouped or len(awake) > 1
            used = sum(e.shard() for e in on) + self.strangers.get(gpu, 0)
            self.peak_used = max(self.peak_used, used)
            names = ", ".join(e.claimant.ref for e in awake)
            if used > GPU_TOTAL:
                self.violations.append(f"{gpu}: {used} bytes in use of {GPU_TOTAL} ({names})")
            budgets = sum(e.claimant.config.awake_memory if e in awake
                          else e.claimant.resident_on(gpu) for e in on)
            if budgets > GPU_TOTAL:
                self.violations.append(f"{gpu}: awake {names}, budgets {budgets} bytes "
                                       f"over {GPU_TOTAL}")
            if len(awake) > 1 and any(e.claimant.spans_gpus for e in on):
                self.violations.append(f"{gpu}: {names} awake beside an engine that spans GPUs")
        self.together += grouped


class GangDevice:
    """The node's GPUs as NVML shows them: one process per engine and GPU."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.strangers: dict[str, int] = {}
        """Bytes held on a GPU by processes in no claimant's pod."""
        self.reads: list[str] = []
        self.on_read: list[Callable[[], object]] = []
        """Called at every read (a test's hook into the moment of a GPU check)."""

    async def snapshot(self, device: str) -> GpuSnapshot:
        self.reads.append(device)
        for hook in self.on_read:
            hook()
        processes = [GpuProcess(pid=1000 + 10 * i + int(device.rpartition("-")[2]),
                                used_bytes=e.shard(), claim_uid=e.claimant.claim_uid,
                                pod_uid=e.claimant.pod_uid or "")
                     for i, e in enumerate(self.engines)
                     if device in e.claimant.gpus and device not in e.gone_from]
        if self.strangers.get(device):
            processes.append(GpuProcess(pid=99, used_bytes=self.strangers[device],
                                        claim_uid="", pod_uid=""))
        used = sum(p.used_bytes for p in processes)
        return GpuSnapshot(uuid=f"GPU-{device}", device=device, total_bytes=GPU_TOTAL,
                           used_bytes=used, free_bytes=GPU_TOTAL - used,
                           processes=tuple(processes))


def gang_claimant(sim: RunningSim, name: str, gpus: Sequence[str]) -> Claimant:
    """What ``claimants_from`` builds for a claim with one result per GPU of ``gpus``."""
    settings = sim.settings
    per_gpu_awake = settings.awake_memory_bytes // len(gpus)
    per_gpu_resident = settings.resident_memory_bytes // len(gpus)
    config = parse_engine_config({
        "apiVersion": API_VERSION, "kind": KIND, "model": settings.model,
        "awakeMemory": per_gpu_awake, "sleepLevel": 1, "enginePort": sim.server.port,
        "adapter": "vllm"})
    return Claimant(
        claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node=NODE, device=gpus[0],
        share_id=None, config=config, model=settings.model, port=int(sim.server.port or 0),
        sleep_level=1, resident_bytes=per_gpu_resident, pod_name=f"pod-{name}",
        pod_uid=f"pod-uid-{name}", pod_ip="127.0.0.1", pod_ready=True, pod_deleting=False,
        resident_on_gpu=tuple((g, per_gpu_resident) for g in gpus))


@dataclass
class GangNode:
    """The workers of one node's GPUs on in-memory Leases."""

    engines: list[Engine]
    device: GangDevice
    leases: dict[str, MemoryLeasePort]
    workers: dict[str, GpuWorker]
    watch: OneAwakeWatch
    tasks: list[asyncio.Task[None]]
    stop: asyncio.Event
    locks: GpuLocks
    adapter: Callable[[Claimant], EngineAdapter]

    async def until(self, predicate: Callable[[], bool], *, within_s: float = 30.0,
                    what: str = "condition") -> None:
        """Look at the in-memory Leases (which nothing announces) until ``predicate``
        holds, within ``within_s``."""
        async def check() -> bool:
            return predicate()

        await eventually_async(check, timeout=within_s, interval=0.02, max_interval=0.1,
                               what=what)

    def start(self) -> None:
        """Open every worker (this instance leads the node) and run it."""
        for worker in self.workers.values():
            worker.open()
            self.tasks.append(asyncio.create_task(worker.run(self.stop)))

    def claimants(self) -> list[Claimant]:
        return [e.claimant for e in self.engines]

    def lease(self, gpu: str) -> GpuLease:
        return self.leases[gpu].current

    def holders(self) -> dict[str, str]:
        return {gpu: port.current.holder for gpu, port in self.leases.items()}

    def hold(self, engine: Engine) -> None:
        """Make every Lease of ``engine``'s GPUs name it awake (the state after a switch)."""
        for gpu in engine.claimant.gpus:
            port = self.leases[gpu]
            port.current = Switcher.serving(port.current, engine.claimant)

    async def activate(self, engine: Engine) -> Any:
        return await self.workers[engine.claimant.gpu].activate(engine.claimant)

    async def close(self) -> None:
        self.stop.set()
        for worker in self.workers.values():
            worker.close("stopping", "test over")
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _watched(engine: Engine, watch: OneAwakeWatch) -> None:
    memory = engine.sim.engine.memory
    apply = memory.apply

    async def apply_and_check(ops: Any) -> Any:
        try:
            return await apply(ops)
        finally:
            watch.check()

    memory.apply = apply_and_check  # type: ignore[method-assign]


async def gang_node(factory: SimFactory, session: aiohttp.ClientSession,
                    specs: Sequence[tuple[str, Sequence[str], int]], *, gpus: int,
                    awake: Sequence[str] = (), timeouts: StepTimeouts | None = None,
                    observer: SwitchObserver | None = None,
                    awake_set: bool = False) -> GangNode:
    """Simulators for ``specs`` (name, GPUs, awake GiB across all its GPUs; each starts
    asleep unless named in ``awake``, whose Leases then name it), and the node's workers,
    opened and running (``awake_set``: with the controller's ``--awake-set``)."""
    engines: list[Engine] = []
    for name, on, gib in specs:
        sim = await factory(model=f"m-{name}", awake_memory_bytes=gib * GIB,
                            resident_memory_bytes=len(on) * GIB,
                            weights_bytes=(gib // 2) * GIB)
        engines.append(Engine(sim, gang_claimant(sim, name, on)))
    names = tuple(f"gpu-{i}" for i in range(gpus))
    leases = {g: MemoryLeasePort(GpuLease(name=naming.gpu_lease_name(NODE, g), node=NODE,
                                          device=g)) for g in names}
    node = node_of(engines, session, leases, timeouts=timeouts, observer=observer,
                   awake_set=awake_set)
    for engine in engines:  # simulators start awake, as vLLM does
        if engine.claimant.claim_name not in awake:
            await node.adapter(engine.claimant).sleep(1)
        else:
            node.hold(engine)
    for engine in engines:
        _watched(engine, node.watch)
    node.watch.check()
    node.start()
    return node


def _seen(port: MemoryLeasePort) -> str | None:
    """The Lease's version as a node's Lease watch sees it (this one never lags)."""
    return port.current.resource_version


def _domain(joined: dict[str, tuple[str, ...]], gpu: str) -> tuple[str, ...]:
    return joined.get(gpu, (gpu,))


def node_of(engines: list[Engine], session: aiohttp.ClientSession,
            leases: dict[str, MemoryLeasePort], *, timeouts: StepTimeouts | None = None,
            observer: SwitchObserver | None = None, awake_set: bool = False) -> GangNode:
    """A controller instance's workers for ``engines`` on ``leases`` (not yet running);
    ``observer`` is told of every switch's measurements (default: the Prometheus series)."""
    names = tuple(leases)
    device = GangDevice(engines)
    watch = (AwakeSetWatch(engines, names, strangers=device.strangers) if awake_set
             else OneAwakeWatch(engines, names))
    engine_timeouts = (timeouts.engine_calls() if timeouts is not None
                       else Timeouts(sleep_s=10.0, wake_level1_s=10.0, wake_level2_s=10.0,
                                     probe_total_s=10.0))
    by_uid = {e.claimant.claim_uid: e for e in engines}

    def adapter(claimant: Claimant) -> EngineAdapter:
        return make_adapter(claimant.config, EngineEndpoint(
            base_url=by_uid[claimant.claim_uid].base_url, model=claimant.model, claim=claimant.ref,
            pod=f"ns/{claimant.pod_name}"), session, engine_timeouts)

    locks = GpuLocks()
    joined = domains(e.claimant for e in engines)
    workers: dict[str, GpuWorker] = {}
    for gpu in names:
        switcher = Switcher(
            ports=Ports(lease=leases[gpu], device=device, engine=adapter, guard=lambda: None,
                        observer=observer or SwitchMetrics()),
            limits=Limits(tolerance_bytes=TOLERANCE, unknown_limit_bytes=TOLERANCE,
                          timeouts=timeouts or StepTimeouts(), restore_wait_s=0.5),
            identity="controller-a")
        workers[gpu] = GpuWorker(
            gpu=gpu, lease_port=leases[gpu], switcher=switcher,  # type: ignore[arg-type]
            claimants=lambda: [e.claimant for e in engines], engine=adapter,
            policy=Policy(resync_s=3600.0, tolerance_bytes=TOLERANCE, awake_set=awake_set),
            clock=asyncio.get_running_loop().time, identity="controller-a",
            starter=StartSwitch(switcher, limits=StartLimits(start_s=10.0, grant_s=5.0),
                                claimant_of=lambda uid: by_uid[uid].claimant
                                if uid in by_uid else None),
            locks=locks, domain=functools.partial(_domain, joined, gpu),
            sibling=workers.__getitem__, lease_seen=functools.partial(_seen, leases[gpu]))
    return GangNode(engines, device, leases, workers, watch, [], asyncio.Event(), locks,
                    adapter)
