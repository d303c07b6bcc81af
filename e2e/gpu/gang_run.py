"""The switch benchmark with an engine that spans GPUs (``--tensor-parallel N``).

On N GPUs, engine A is a TP=N simulator (one worker process per GPU, each holding its
shard) and B0..B(N-1) are TP=1 simulators, Bi on the i-th GPU. They take turns through the
controller's own gang path, as a GPU worker runs it (``controller/lease/gpu.py``): the domain's
locks (:class:`~controller.lease.gpu_locks.GpuLocks`), the holders from the Leases
(:func:`~controller.lease.gang.holders_of`), the set
(:func:`~controller.lease.gang.gang_set`) and one
:class:`~controller.lease.gang.GangSwitch` per switch over one in-memory Lease port per GPU.

- start-up reconciliation: every Bi holds its GPU, A is put to sleep first (its first sleep
  is reported on its own);
- odd handoffs, B* -> A: one gang switch; every Bi drains and sleeps at once, every GPU is
  read, A wakes and answers the correctness request;
- even handoffs, A -> B*: one gang switch to B0 (A sleeps, B0 wakes, the other GPUs go
  ``idle``), then each other Bi is woken on its idle GPU by its GPU's one-GPU switch, one
  after the other (A's claim joins the GPUs into one domain, so the controller runs them
  so too).

Per handoff it reports the gang switch's time and its steps (the holders' sleeps in
parallel, the read of each GPU, the wake, the probe), and the Leases afterwards. All along,
:class:`~e2e.gpu.one_awake.OneAwakeSampler` reads every GPU through the inspection service
and counts instants with two engines awake on one GPU (0 expected).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from controller.claimants import Claimant
from controller.lease.device import DeviceReader, GpuSnapshot
from controller.lease.engines.base import EngineAdapter
from controller.lease.gang import GangResult, GangSwitch, gang_set, holders_of
from controller.lease.gpu_locks import GpuLocks
from controller.lease.switch import Ports, Switcher, SwitchResult
from driver.inspection import InspectionService
from driver.nvml.api import NvmlBackend
from e2e.bench.stats import summary_s
from e2e.gpu.context import NODE
from e2e.gpu.instrument import AdapterCall, BenchAdapter
from e2e.gpu.one_awake import OneAwakeSampler
from e2e.gpu.simulators import Sim, wait_listening
from e2e.gpu.switch_ports import claimant, engines, view, view_line, wait_attributed
from e2e.gpu.switch_run import IDENTITY, Run, engine_timeouts, limits, remaining, say
from e2e.gpu.switch_summary import common, values
from e2e.harness.ports import MemoryLeasePort, ReaderDevice
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.engine_connections import engine_connector
from rota.kit.sockets import UnixServer

__all__ = ["gang_summary", "run_gang_protocol"]

LOCK_WAIT_S = 5.0
"""Bound on taking the domain's locks (nothing else holds them in this benchmark)."""


@dataclass
class TimedDevice:
    """The switch's device port, timing every read of a GPU."""

    inner: ReaderDevice
    reads: list[tuple[str, float, float]] = field(default_factory=list)
    """(GPU, start, seconds) of every read."""

    async def snapshot(self, device: str) -> GpuSnapshot:
        began = time.monotonic()
        try:
            return await self.inner.snapshot(device)
        finally:
            self.reads.append((device, began, time.monotonic() - began))

    def since(self, start: float) -> dict[str, float]:
        """Seconds spent reading each GPU since ``start``."""
        per_gpu: dict[str, float] = {}
        for gpu, began, seconds in self.reads:
            if began >= start:
                per_gpu[gpu] = round(per_gpu.get(gpu, 0.0) + seconds, 6)
        return per_gpu


@dataclass
class Node:
    """The benchmark's controller side: claimants, Lease ports, switchers, instruments."""

    a: Claimant
    bs: list[Claimant]
    ports: dict[str, MemoryLeasePort]
    switchers: dict[str, Switcher]
    device: TimedDevice
    calls: list[AdapterCall]
    engine: Any
    locks: GpuLocks = field(default_factory=GpuLocks)

    @property
    def claimants(self) -> list[Claimant]:
        return [self.a, *self.bs]

    def leases(self) -> dict[str, GpuLease]:
        return {gpu: port.current for gpu, port in self.ports.items()}

    def holders(self, keys: Mapping[str, str]) -> dict[str, str]:
        """Each GPU's Lease holder, as the engine key (empty: nobody)."""
        return {gpu: keys.get(lease.holder, lease.holder) if lease.holder else ""
                for gpu, lease in self.leases().items()}


async def run_gang_protocol(run: Run, args: argparse.Namespace, backend: NvmlBackend,
                            socket: Path, deadline: float) -> None:
    """The inspection service over every GPU of the run on ``socket``, then the handoffs."""
    # The simulators run in no pod: each names a simulated one (its claim uid).
    service = InspectionService(backend=backend, gpus=list(run.gpus), proc_root=Path("/proc"),
                                pods_from_environment=True)
    server = UnixServer(socket, [service.handler()])
    await server.start()
    reader = DeviceReader(socket, timeout_s=10.0)
    watch_reader = DeviceReader(socket, timeout_s=10.0)
    try:
        async with aiohttp.ClientSession(connector=engine_connector()) as session:
            await _gang_handoffs(run, args, TimedDevice(ReaderDevice(reader)), watch_reader,
                                 session, deadline)
    finally:
        await reader.close()
        await watch_reader.close()
        await server.stop(1.0)


def _node(run: Run, args: argparse.Namespace, device: TimedDevice,
          session: aiohttp.ClientSession) -> Node:
    a, *bs = run.sims
    plain = engines(session, engine_timeouts(args))
    calls: list[AdapterCall] = []

    def engine(c: Claimant) -> EngineAdapter:
        return BenchAdapter(plain(c), engine=c.ref, calls=calls)

    ports = {g.name: MemoryLeasePort(GpuLease(name=naming.gpu_lease_name(NODE, g.name),
                                              node=NODE, device=g.name, gpu_uuid=g.uuid))
             for g in run.gpus}
    switchers = {gpu: Switcher(ports=Ports(lease=port, device=device, engine=engine,
                                           guard=lambda: None),
                               limits=limits(args), identity=IDENTITY)
                 for gpu, port in ports.items()}
    return Node(a=claimant(a, run.gpus, args.context_allowance),
                bs=[claimant(b, [g], args.context_allowance)
                    for b, g in zip(bs, run.gpus, strict=True)],
                ports=ports, switchers=switchers, device=device, calls=calls, engine=engine)


async def _gang_handoffs(run: Run, args: argparse.Namespace, device: TimedDevice,
                         watch_reader: DeviceReader, session: aiohttp.ClientSession,
                         deadline: float) -> None:
    a, *bs = run.sims
    run.stage = "waiting for the simulators to allocate memory and listen"
    start_deadline = min(deadline, time.monotonic() + args.start_timeout_s)
    await asyncio.gather(*(wait_listening(s, session, start_deadline) for s in run.sims))
    say("simulators listening: " + ", ".join(f"{s.label} on port {s.port}" for s in run.sims))
    placed = {g.name: [a, b] for g, b in zip(run.gpus, bs, strict=True)}
    snapshots = await wait_attributed(device.inner, run.gpus, placed,
                                      min(deadline, time.monotonic() + 30.0))
    run.phases["all_initialised"] = _views(snapshots, placed)
    node = _node(run, args, device, session)
    keys = {c.ref: s.key for c, s in zip(node.claimants, run.sims, strict=True)}

    # Start-up reconciliation: every Bi holds its GPU, A (awake on all of them) sleeps first.
    run.stage = "reconciliation (putting A to sleep)"
    for b in node.bs:
        port = node.ports[b.gpu]
        await port.write(Switcher.serving(port.current, b, controller=IDENTITY))
    outcome = await asyncio.wait_for(node.engine(node.a).sleep(1), args.sleep_timeout_s + 15)
    node.switchers[node.a.gpu].record_sleep(node.a, outcome.sleep_s)
    run.first_sleep_s["a"] = round(outcome.sleep_s, 4)
    say(f"A (TP={a.tp}) put to sleep by reconciliation (its first level-1 sleep): "
        f"{outcome.sleep_s:.3f} s")
    run.phases["b_awake_a_asleep"] = _views(await _read_all(device.inner, run), placed)

    sampler = OneAwakeSampler(watch_reader, node.claimants, args.resident_tolerance,
                              interval_s=args.sample_interval_s)
    stop = asyncio.Event()
    watching = asyncio.create_task(sampler.run(stop), name="one-awake-sampler")
    try:
        slept = {"a"}
        for index in range(1, args.handoffs + 1):
            to_a = bool(index % 2)
            run.stage = f"handoff {index} ({'B*->A' if to_a else 'A->B*'})"
            entry = await asyncio.wait_for(_handoff(node, index, to_a, keys, slept, run),
                                           remaining(deadline, f"handoff {index}"))
            run.handoffs.append(entry)
            if not entry["ok"]:
                break
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(watching, timeout=15.0)
        run.invariant = sampler.report()
        run.lease_writes = sum(p.writes for p in node.ports.values())
    say(f"one-awake invariant: {sampler.samples} samples of every GPU through the inspection "
        f"service, {sampler.violations} violations")


async def _read_all(device: ReaderDevice, run: Run) -> dict[str, GpuSnapshot]:
    return {g.name: await device.snapshot(g.name) for g in run.gpus}


def _views(snapshots: Mapping[str, GpuSnapshot], placed: Mapping[str, Sequence[Sim]]
           ) -> dict[str, Any]:
    return {gpu: view(snapshot, placed[gpu]) for gpu, snapshot in snapshots.items()}


async def _gang_switch(node: Node, target: Claimant) -> GangResult:
    """One gang switch to ``target``, as a GPU worker makes it."""
    leases = node.leases()
    holders = holders_of(target, leases, node.claimants)
    gpus = gang_set(target, holders, leases)
    async with node.locks.hold(gpus, timeout_s=LOCK_WAIT_S):
        gang = GangSwitch(node.switchers[target.gpu], {g: node.ports[g] for g in gpus})
        return await gang.switch({g: leases[g] for g in gpus}, holders=holders, target=target,
                                 claimants=[c for c in node.claimants if set(c.gpus) & set(gpus)])


async def _single_switch(node: Node, target: Claimant) -> SwitchResult:
    """``target`` woken on its idle GPU by that GPU's one-GPU switch, under the domain's
    locks (every GPU A spans)."""
    async with node.locks.hold(node.a.gpus, timeout_s=LOCK_WAIT_S):
        port = node.ports[target.gpu]
        return await node.switchers[target.gpu].switch(port.current, holder=None,
                                                       target=target,
                                                       claimants=node.claimants)


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def _sleeps(calls: Sequence[AdapterCall]) -> tuple[float | None, dict[str, float]]:
    """The holders' sleeps of one switch: the wall time from the first sleep call's start
    to the last confirmation's end, and each sleep call's own time."""
    sleeps = [c for c in calls if c.name.startswith("sleep_l")]
    ends = [c.ended for c in calls if c.name.startswith(("sleep_l", "confirm_asleep"))]
    if not sleeps:
        return None, {}
    wall = max(ends) - min(c.started for c in sleeps)
    return round(wall, 5), {c.engine: round(c.ended - c.started, 5) for c in sleeps}


async def _handoff(node: Node, index: int, to_a: bool, keys: Mapping[str, str],
                   slept: set[str], run: Run) -> dict[str, Any]:
    began = time.monotonic()
    first_call = len(node.calls)
    target = node.a if to_a else node.bs[0]
    result = await _gang_switch(node, target)
    t = result.timings
    sleep_wall, by_ref = _sleeps(node.calls[first_call:])
    sleep_calls = {keys.get(ref, ref): seconds for ref, seconds in by_ref.items()}
    from_keys = [keys[h.ref] for h in result.holders]
    first = any(k not in slept for k in from_keys)
    for k in from_keys:
        if k not in slept and k in sleep_calls:
            run.first_sleep_s[k] = sleep_calls[k]
    slept.update(from_keys)
    entry: dict[str, Any] = {
        "index": index, "direction": "to_a" if to_a else "to_b", "from": from_keys,
        "to": [keys[target.ref]], "ok": result.ok, "first_sleep": first,
        "gang_switch_s": _r(t.get("total")), "gang_set": sorted(result.leases),
        "sleep_all_s": sleep_wall, "sleep_call_s": sleep_calls,
        "drain_s": _r(t.get("drain")), "inspect_s": _r(t.get("inspect")),
        "inspect_by_gpu_s": node.device.since(began), "wake_call_s": _r(t.get("wake_call")),
        "probe_ttft_s": _r(t.get("probe_ttft")),
        "handoff_to_first_token_s": _r(t.get("handoff_to_first_token")),
        "recovery_to_first_token_s": _r(t.get("recovery_to_first_token")),
        "fence_s": _r(t.get("fence")), "lease_s": _r(t.get("lease")), "follow_up": []}
    if not result.ok:
        return _failed(run, entry, result.reason, result.message)
    for b in ([] if to_a else node.bs[1:]):
        began_one = time.monotonic()
        one = await _single_switch(node, b)
        entry["follow_up"].append({
            "to": keys[b.ref], "ok": one.ok, "total_s": _r(one.timings.get("total")),
            "inspect_by_gpu_s": node.device.since(began_one),
            "wake_call_s": _r(one.timings.get("wake_call")),
            "probe_ttft_s": _r(one.timings.get("probe_ttft"))})
        entry["to"].append(keys[b.ref])
        if not one.ok:
            return _failed(run, entry, one.reason, one.message)
    entry["handoff_total_s"] = round(time.monotonic() - began, 5)
    entry["leases"] = node.holders(keys)
    expected = ({g: "a" for g in node.a.gpus} if to_a
                else {b.gpu: keys[b.ref] for b in node.bs})
    if entry["leases"] != expected:
        return _failed(run, entry, "lease_mismatch",
                       f"Leases name {entry['leases']}, expected {expected}")
    placed = {g.name: [run.sims[0], s] for g, s in zip(run.gpus, run.sims[1:], strict=True)}
    views = _views(await _read_all(node.device.inner, run), placed)
    entry["nvml"] = {g: {k: v for k, v in v_.items() if k != "processes"}
                     for g, v_ in views.items()}
    say(f"handoff {index:2d} {','.join(from_keys).upper()}->{','.join(entry['to']).upper()}: "
        f"gang switch {entry['gang_switch_s']:.3f} s (sleep of {len(from_keys)} in parallel "
        f"{sleep_wall or 0:.3f} s, reads "
        + ", ".join(f"{g} {s * 1e3:.1f} ms" for g, s in entry["inspect_by_gpu_s"].items())
        + f", wake {entry['wake_call_s'] or 0:.3f} s, probe {entry['probe_ttft_s'] or 0:.3f} s)"
        f"{' (first sleep)' if first else ''}, handoff {entry['handoff_total_s']:.3f} s; "
        f"{run.gpus[0].name} {view_line(views[run.gpus[0].name], placed[run.gpus[0].name])}")
    return entry


def _failed(run: Run, entry: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    entry["ok"] = False
    run.failures.append({"index": entry["index"], "reason": reason, "message": message})
    say(f"handoff {entry['index']:2d} FAILED: {reason}: {message}")
    return entry


def _per_gpu_reads(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    by_gpu: dict[str, list[float]] = {}
    for e in entries:
        for gpu, seconds in e["inspect_by_gpu_s"].items():
            by_gpu.setdefault(gpu, []).append(seconds)
    return {gpu: summary_s(v) for gpu, v in by_gpu.items()}


def _block(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [e for e in entries if e["ok"]]
    steady = [e for e in ok if not e["first_sleep"]]
    return {
        "gang_switch": summary_s(values("gang_switch_s", steady)),
        "handoff_total": summary_s(values("handoff_total_s", steady)),
        "sleep_all_parallel": summary_s(values("sleep_all_s", steady)),
        "inspect_all_gpus": summary_s(values("inspect_s", ok)),
        "inspect_per_gpu": summary_s([s for e in ok for s in e["inspect_by_gpu_s"].values()]),
        "wake_call": summary_s(values("wake_call_s", ok)),
        "probe_ttft": summary_s(values("probe_ttft_s", ok)),
        "handoff_to_first_token": summary_s(values("handoff_to_first_token_s", steady)),
        "follow_up_switch": summary_s([f["total_s"] for e in ok for f in e["follow_up"]
                                       if f["total_s"] is not None]),
    }


def gang_summary(run: Run, args: argparse.Namespace, started: float, error: str | None
                 ) -> dict[str, Any]:
    """The JSON line of a ``--tensor-parallel`` run."""
    ok_handoffs = [h for h in run.handoffs if h["ok"]]
    violations = run.invariant.get("violations")
    return common(run, args, started, error, ok=len(ok_handoffs) == args.handoffs
                  and violations == 0, gang=True) | {
        "tensor_parallel": args.tensor_parallel,
        "gpus": [{"name": g.name, "uuid": g.uuid, "index": g.index} for g in run.gpus],
        "handoffs_ok": len(ok_handoffs),
        "timings_s": _block(run.handoffs),
        "timings_by_direction_s": {d: _block([h for h in run.handoffs if h["direction"] == d])
                                   for d in ("to_a", "to_b")},
        "inspect_by_gpu_s": _per_gpu_reads(ok_handoffs),
        "invariant": run.invariant,
        "double_awake_violations": violations,
        "handoffs": run.handoffs,
        "wall_s": round(time.monotonic() - started, 2),
    }
