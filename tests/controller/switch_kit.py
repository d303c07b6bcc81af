"""What unit tests of the switch protocol share: claimants for running simulators, a device
port that reads the simulators' memory as NVML would, and a Switcher on in-memory ports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from controller.claimants import Claimant
from controller.lease.device import GpuProcess, GpuSnapshot
from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.lease.engines.registry import make_adapter
from controller.lease.settings import StepTimeouts
from controller.lease.switch import Limits, Ports, Switcher
from e2e.harness.ports import MemoryLeasePort
from rota.api import naming
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config
from rota.api.gpu_lease import GpuLease
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSim, EngineSimFactory

GPU_TOTAL = 141 * ENGINE_SIM_GIB
NODE = "node-a"


def claimant_of(sim: EngineSim, name: str) -> Claimant:
    """What ``claimants_from`` would build for the simulator's claim and pod."""
    settings = sim.settings
    config = parse_engine_config({
        "apiVersion": API_VERSION, "kind": KIND, "model": settings.model,
        "awakeMemory": settings.awake_memory_bytes, "sleepLevel": 1,
        "enginePort": sim.server.port, "adapter": "vllm"})
    return Claimant(
        claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node=NODE,
        device="gpu-0", share_id=None, config=config, model=settings.model,
        port=int(sim.server.port or 0), sleep_level=1,
        resident_bytes=settings.resident_memory_bytes, pod_name=f"pod-{name}",
        pod_uid=f"pod-uid-{name}", pod_ip="127.0.0.1", pod_ready=True, pod_deleting=False)


@dataclass
class SimDevice:
    """The GPU as NVML shows it: each simulator's memory, under its claim."""

    sims: dict[str, EngineSim]
    """Claim uid to simulator."""
    on_read: list[Callable[[], object]] = field(default_factory=list)
    """Called at every read (a test's hook into the moment of step 4)."""
    reads: int = 0

    async def snapshot(self, device: str) -> GpuSnapshot:
        self.reads += 1
        for hook in self.on_read:
            hook()
        processes = tuple(GpuProcess(pid=1000 + i, used_bytes=sim.engine.memory.used_bytes,
                                     claim_uid=uid, pod_uid=f"pod-{uid}")
                          for i, (uid, sim) in enumerate(sorted(self.sims.items())))
        used = sum(p.used_bytes for p in processes)
        return GpuSnapshot(uuid="GPU-test", device=device, total_bytes=GPU_TOTAL,
                           used_bytes=used, free_bytes=GPU_TOTAL - used, processes=processes)


@dataclass
class Kit:
    switcher: Switcher
    lease: MemoryLeasePort
    device: SimDevice
    claimants: list[Claimant]

    def holding(self, holder: Claimant | None) -> GpuLease:
        """Make the in-memory Lease say ``holder`` is awake (or nobody); the current copy."""
        current = self.lease.current
        if holder is None:
            self.lease.current = current.with_(state=naming.STATE_IDLE)
        else:
            self.lease.current = current.with_(
                holder=holder.ref, holder_model=holder.model, holder_claim_uid=holder.claim_uid,
                state=naming.STATE_AWAKE)
        return self.lease.current


def make_kit(session: aiohttp.ClientSession, sims: Sequence[tuple[str, EngineSim]], *,
             timeouts: StepTimeouts | None = None, engine_timeouts: Timeouts | None = None,
             guard: Callable[[], None] = lambda: None) -> Kit:
    claimants = [claimant_of(sim, name) for name, sim in sims]
    engine_timeouts = engine_timeouts or Timeouts()

    def engine(claimant: Claimant) -> EngineAdapter:
        endpoint = EngineEndpoint(base_url=claimant.endpoint or "", model=claimant.model,
                                  claim=claimant.ref)
        return make_adapter(claimant.config, endpoint, session, engine_timeouts)

    lease = MemoryLeasePort(GpuLease(name=naming.gpu_lease_name(NODE, "gpu-0"), node=NODE,
                                     device="gpu-0"))
    device = SimDevice({c.claim_uid: sim for c, (_, sim) in zip(claimants, sims, strict=True)})
    switcher = Switcher(ports=Ports(lease=lease, device=device, engine=engine, guard=guard),
                        limits=Limits(tolerance_bytes=512 * 2**20,
                                      unknown_limit_bytes=512 * 2**20,
                                      timeouts=timeouts or StepTimeouts()),
                        identity="controller-test")
    return Kit(switcher, lease, device, claimants)


async def a_awake_b_asleep(engine_sim_factory: EngineSimFactory,
                           session: aiohttp.ClientSession) -> tuple[Kit, EngineSim, EngineSim]:
    """Two simulators, ``m/a`` and ``m/b``, on one kit; B put to sleep (A stays awake and
    the Lease is left for the test to set with :meth:`Kit.holding`)."""
    a = await engine_sim_factory(model="m/a")
    b = await engine_sim_factory(model="m/b")
    kit = make_kit(session, [("a", a), ("b", b)])
    await kit.switcher.ports.engine(kit.claimants[1]).sleep(1)
    return kit, a, b
