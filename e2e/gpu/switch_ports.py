"""What the switch benchmark gives the controller's :class:`~controller.lease.switch.Switcher`:
claimants built by hand (as ``claimants_from`` builds them from a claim, its opaque config
and its pod), the real engine adapters on the simulators, and the NVML view of a GPU as
the driver's inspection service reports it (in MiB per engine)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from controller.claimants import Claimant
from controller.lease.device import GpuSnapshot
from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.lease.engines.registry import make_adapter
from driver.devices import GpuDevice
from e2e.gpu.context import NAMESPACE, NODE, BenchError, mib
from e2e.gpu.simulators import Sim
from e2e.harness.ports import ReaderDevice
from e2e.harness.waiting import WaitTimeout, eventually_async
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config

__all__ = ["claimant", "engines", "view", "view_line", "wait_attributed"]


def _mib(n: int) -> float:
    value = mib(n)
    return 0.0 if value is None else value


def claimant(sim: Sim, gpus: Sequence[GpuDevice], allowance: int) -> Claimant:
    """What ``claimants_from`` would build from ``sim``'s claim: one result per GPU of
    ``gpus``, the awake budget and resident footprint per GPU (the engine's shard, plus
    ``allowance`` for the CUDA context the simulator's knobs do not count)."""
    awake = sim.shard(sim.awake) + allowance
    resident = sim.shard(sim.resident) + allowance
    config = parse_engine_config({
        "apiVersion": API_VERSION, "kind": KIND, "model": sim.model,
        "awakeMemory": awake, "sleepLevel": 1, "enginePort": sim.port, "adapter": "vllm"})
    on_gpus = tuple((g.name, resident) for g in gpus) if len(gpus) > 1 else ()
    return Claimant(
        claim_uid=sim.claim_uid, namespace=NAMESPACE, claim_name=f"claim-{sim.key}",
        node=NODE, device=gpus[0].name, share_id=None, config=config, model=sim.model,
        port=sim.port, sleep_level=1, resident_bytes=resident,
        pod_name=f"engine-{sim.key}", pod_uid=sim.claim_uid, pod_ip="127.0.0.1", pod_ready=True,
        pod_deleting=False, resident_on_gpu=on_gpus)


def engines(session: aiohttp.ClientSession, timeouts: Timeouts
            ) -> Callable[[Claimant], EngineAdapter]:
    """The engine port: the adapter the claim's config names, on the benchmark's session."""
    def engine(c: Claimant) -> EngineAdapter:
        if c.endpoint is None:
            raise BenchError(f"{c.ref} has no endpoint")
        endpoint = EngineEndpoint(base_url=c.endpoint, model=c.model, claim=c.ref,
                                  pod=f"{c.namespace}/{c.pod_name}")
        return make_adapter(c.config, endpoint, session, timeouts)

    return engine


def view(snapshot: GpuSnapshot, sims: Sequence[Sim]) -> dict[str, Any]:
    """The NVML view of one GPU at one moment, in MiB: each engine, the rest, the card."""
    ours = {s.claim_uid for s in sims}
    result: dict[str, Any] = {f"{s.key}_mib": _mib(snapshot.used_by(s.claim_uid))
                              for s in sims}
    result |= {
        "other_processes_mib": _mib(sum(p.used_bytes for p in snapshot.processes
                                        if p.claim_uid not in ours)),
        "used_mib": _mib(snapshot.used_bytes), "free_mib": _mib(snapshot.free_bytes),
        "total_mib": _mib(snapshot.total_bytes),
        "processes": [{"pid": p.pid, "mib": _mib(p.used_bytes),
                       "engine": next((s.key for s in sims if s.claim_uid == p.claim_uid),
                                      None)} for p in snapshot.processes],
    }
    return result


def view_line(snapshot_view: dict[str, Any], sims: Sequence[Sim]) -> str:
    engines_part = ", ".join(f"{s.label} {snapshot_view[f'{s.key}_mib']:.0f} MiB"
                             for s in sims if f"{s.key}_mib" in snapshot_view)
    return (f"NVML: {engines_part}, others {snapshot_view['other_processes_mib']:.0f} MiB; "
            f"card used {snapshot_view['used_mib']:.0f} MiB, "
            f"free {snapshot_view['free_mib']:.0f} MiB")


async def wait_attributed(device: ReaderDevice, gpus: Sequence[GpuDevice],
                          placed: Mapping[str, Sequence[Sim]], deadline: float
                          ) -> dict[str, GpuSnapshot]:
    """Until NVML shows, on each GPU of ``gpus``, every simulator ``placed`` there (by GPU
    name) attributed to its claim and holding its awake shard; the snapshots then."""
    seen: dict[str, GpuSnapshot] = {}

    async def attributed() -> bool:
        for gpu in gpus:
            seen[gpu.name] = await device.snapshot(gpu.name)
        return all(seen[g.name].used_by(s.claim_uid) >= s.shard(s.awake)
                   for g in gpus for s in placed.get(g.name, ()))

    try:
        await eventually_async(attributed, timeout=max(0.0, deadline - time.monotonic()),
                               interval=0.1, max_interval=0.2,
                               what="every simulator's memory attributed on NVML")
    except WaitTimeout:
        found = "; ".join(
            f"{name}: " + (", ".join(f"pid {p.pid} {_mib(p.used_bytes)} MiB claim "
                                     f"{p.claim_uid or '(none)'}" for p in snap.processes)
                           or "none") for name, snap in seen.items())
        ours = ", ".join(f"{s.label} pid {s.proc.pid if s.proc else '?'} claim {s.claim_uid}"
                         for group in placed.values() for s in group)
        raise BenchError(
            "NVML does not show every simulator with its awake memory, attributed to its "
            f"claim. NVML processes: {found or 'none'}; simulators: {ours}. If the pids "
            "differ, NVML reports pids of another pid namespace and the inspection service "
            "cannot read their ROTA_CLAIM_UID from /proc.") from None
    return seen
