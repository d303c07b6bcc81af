"""The one-GPU switch protocol of ``python -m e2e.bench.gpu``, on two engine simulators.

The reference experiment (DESIGN.md): both engines start awake, the non-holder B is put to
sleep first as start-up reconciliation would (its first sleep is reported on its own, as
is A's, which happens in the first handoff), then N handoffs A<->B through
``Switcher.switch``, each ending with the streamed correctness request. Around one recovery
of A it measures output tokens/s. :class:`Run` records everything; it becomes the JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from controller.lease import reconcile
from controller.lease.device import DeviceReader
from controller.lease.engines.base import Timeouts
from controller.lease.settings import StepTimeouts
from controller.lease.switch import Limits, Ports, Switcher, SwitchResult
from driver.devices import GpuDevice
from driver.inspection import InspectionService
from driver.nvml.api import NvmlBackend
from e2e.gpu.context import NODE, BenchError
from e2e.gpu.load import output_throughput
from e2e.gpu.simulators import Sim, sim_state, wait_listening
from e2e.gpu.switch_ports import claimant, engines, view, view_line, wait_attributed
from e2e.harness.ports import MemoryLeasePort, ReaderDevice
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.kit.engine_connections import engine_connector
from rota.kit.sockets import UnixServer

__all__ = ["Run", "remaining", "run_protocol", "say", "step_timeouts"]

IDENTITY = "bench-gpu"


def say(text: str) -> None:
    """A human-readable line on stdout (the JSON summary comes last)."""
    print(text, flush=True)


def remaining(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``; raises :class:`BenchError` when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise BenchError(f"the run's deadline passed before {what}")
    return left


@dataclass
class Run:
    """Everything the run records; becomes the JSON line."""

    sims: list[Sim]
    gpu: GpuDevice | None = None
    gpus: list[GpuDevice] = field(default_factory=list)
    """Every GPU the run uses (the one of :attr:`gpu` for a one-GPU run)."""
    h2d: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, Any] = field(default_factory=dict)
    first_sleep_s: dict[str, float] = field(default_factory=dict)
    handoffs: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    throughput: dict[str, Any] = field(default_factory=dict)
    lease_writes: int = 0
    invariant: dict[str, Any] = field(default_factory=dict)
    stage: str = "starting"
    """What the run is doing now, for the error message of a deadline."""


def engine_timeouts(args: argparse.Namespace) -> Timeouts:
    return Timeouts(sleep_s=args.sleep_timeout_s, wake_level1_s=args.wake_timeout_s,
                    probe_total_s=args.probe_timeout_s,
                    probe_first_token_s=args.probe_timeout_s)


def step_timeouts(args: argparse.Namespace) -> StepTimeouts:
    """The switch's bounds per step, a margin above the adapter's own."""
    return StepTimeouts(sleep_s=args.sleep_timeout_s + 15, wake_s=args.wake_timeout_s + 15,
                        probe_s=args.probe_timeout_s + 5)


def limits(args: argparse.Namespace) -> Limits:
    return Limits(tolerance_bytes=args.resident_tolerance,
                  unknown_limit_bytes=args.unknown_limit, timeouts=step_timeouts(args))


async def throughput(sim: Sim, session: aiohttp.ClientSession, args: argparse.Namespace,
                     deadline: float) -> dict[str, Any]:
    return await output_throughput(
        session, f"http://127.0.0.1:{sim.port}", sim.model, concurrency=args.concurrency,
        rounds=args.rounds, max_tokens=args.max_tokens,
        timeout_s=remaining(deadline, "the throughput run"))


async def run_protocol(run: Run, args: argparse.Namespace, backend: NvmlBackend,
                       socket: Path, deadline: float) -> None:
    """The inspection service on ``socket``, then :func:`_handoffs`."""
    gpu = run.gpu
    if gpu is None:
        raise BenchError("no GPU chosen")
    # The simulators run in no pod: each names a simulated one (its claim uid).
    service = InspectionService(backend=backend, gpus=[gpu], proc_root=Path("/proc"),
                                pods_from_environment=True)
    server = UnixServer(socket, [service.handler()])
    await server.start()
    reader = DeviceReader(socket, timeout_s=10.0)
    try:
        async with aiohttp.ClientSession(connector=engine_connector()) as session:
            await _handoffs(run, args, ReaderDevice(reader), session, deadline)
    finally:
        await reader.close()
        await server.stop(1.0)


async def _handoffs(run: Run, args: argparse.Namespace, device: ReaderDevice,
                    session: aiohttp.ClientSession, deadline: float) -> None:
    gpu = run.gpu
    assert gpu is not None
    a, b = run.sims
    run.stage = "waiting for the simulators to allocate memory and listen"
    start_deadline = min(deadline, time.monotonic() + args.start_timeout_s)
    await asyncio.gather(*(wait_listening(s, session, start_deadline) for s in run.sims))
    say(f"simulators listening: A on port {a.port}, B on port {b.port}")
    snapshots = await wait_attributed(device, [gpu], {gpu.name: run.sims},
                                      min(deadline, time.monotonic() + 30.0))
    run.phases["both_initialised"] = view(snapshots[gpu.name], run.sims)
    say(f"phase both initialised (nothing asleep): "
        f"{view_line(run.phases['both_initialised'], run.sims)}")

    engine = engines(session, engine_timeouts(args))
    claimants = [claimant(s, [gpu], args.context_allowance) for s in run.sims]
    ca, cb = claimants
    port = MemoryLeasePort(GpuLease(name=naming.gpu_lease_name(NODE, gpu.name), node=NODE,
                                    device=gpu.name, gpu_uuid=gpu.uuid))
    switcher = Switcher(ports=Ports(lease=port, device=device, engine=engine,
                                    guard=lambda: None),
                        limits=limits(args), identity=IDENTITY)

    # Start-up reconciliation: A is the Lease holder, B must sleep first.
    run.stage = "reconciliation (putting B to sleep)"
    seen = {c.claim_uid: reconcile.Seen.ASLEEP if await engine(c).is_sleeping()
            else reconcile.Seen.AWAKE for c in claimants}
    plan = reconcile.plan(claimants, seen, ca.ref)
    if plan.keep is not ca or plan.put_to_sleep != (cb,):
        raise BenchError(f"unexpected reconciliation plan: keep "
                         f"{plan.keep.ref if plan.keep else None}, sleep "
                         f"{[c.ref for c in plan.put_to_sleep]}")
    await port.write(Switcher.serving(port.current, ca, controller=IDENTITY))
    outcome = await asyncio.wait_for(engine(cb).sleep(1), args.sleep_timeout_s + 15)
    run.first_sleep_s["b"] = round(outcome.sleep_s, 4)
    say(f"B put to sleep by reconciliation (its first level-1 sleep): "
        f"{outcome.sleep_s:.3f} s")
    run.phases["a_awake_b_asleep"] = view(await device.snapshot(gpu.name), run.sims)
    say(f"phase A awake / B asleep: {view_line(run.phases['a_awake_b_asleep'], run.sims)}")

    load = {"concurrency": args.concurrency, "rounds": args.rounds,
            "max_tokens": args.max_tokens}
    run.stage = "the throughput run before a recovery"
    before = await throughput(a, session, args, deadline)
    run.throughput = {"model": a.model, **load,
                      "tokens_per_second_knob": args.tokens_per_second,
                      "before": before, "after": None}
    say(f"throughput of A before a recovery: {before['tokens_per_s']} output tok/s "
        f"({args.concurrency} concurrent x {args.rounds} rounds)")

    slept = {"b"}
    for index in range(1, args.handoffs + 1):
        target, holder = (cb, ca) if index % 2 else (ca, cb)
        tsim, hsim = (b, a) if index % 2 else (a, b)
        run.stage = f"handoff {index} ({hsim.label}->{tsim.label})"
        result: SwitchResult = await asyncio.wait_for(
            switcher.switch(port.current, holder=holder, target=target, claimants=claimants),
            remaining(deadline, f"handoff {index}"))
        await _record(run, index, result, hsim, tsim, slept, device, session)
        if not result.ok:
            break
        if tsim is a and run.throughput["after"] is None:
            run.stage = "the throughput run after a recovery"
            after = await throughput(a, session, args, deadline)
            run.throughput["after"] = after | {"after_handoff": index}
            say(f"throughput of A after its recovery in handoff {index}: "
                f"{after['tokens_per_s']} output tok/s")
    run.lease_writes = port.writes


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def _sec(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


async def _record(run: Run, index: int, result: SwitchResult, hsim: Sim, tsim: Sim,
                  slept: set[str], device: ReaderDevice, session: aiohttp.ClientSession
                  ) -> None:
    assert run.gpu is not None
    t = result.timings
    sleep_s = t.get("first_sleep", t.get("later_sleep"))
    first = hsim.key not in slept
    slept.add(hsim.key)
    if first and sleep_s is not None:
        run.first_sleep_s[hsim.key] = round(sleep_s, 4)
    floor = tsim.weights / run.h2d["bytes_per_s"]
    wake = t.get("wake_call")
    copy_s = None
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, IndexError):
        copy_s = (await sim_state(tsim, session))["wakes"][-1]["copy_seconds"]
    seen = view(await device.snapshot(run.gpu.name), run.sims)
    entry: dict[str, Any] = {
        "index": index, "from": hsim.key, "to": tsim.key, "ok": result.ok,
        "handoff_to_first_token_s": _rounded(t.get("handoff_to_first_token")),
        "wake_call_s": _rounded(wake),
        "recovery_to_first_token_s": _rounded(t.get("recovery_to_first_token")),
        "probe_ttft_s": _rounded(t.get("probe_ttft")), "sleep_s": _rounded(sleep_s),
        "first_sleep": first, "drain_s": _rounded(t.get("drain")),
        "inspect_s": _rounded(t.get("inspect")), "total_s": _rounded(t.get("total")),
        "simulator_copy_s": _rounded(copy_s), "wake_floor_s": round(floor, 4),
        "wake_over_floor": round(wake / floor, 3) if wake is not None and floor > 0 else None,
        "nvml": {k: v for k, v in seen.items() if k != "processes"},
    }
    run.handoffs.append(entry)
    phase = f"{tsim.key}_awake_{hsim.key}_asleep"
    if result.ok and phase not in run.phases:
        run.phases[phase] = seen
    if not result.ok:
        run.failures.append({"index": index, "reason": result.reason,
                             "message": result.message, "holder_after": result.holder})
        say(f"handoff {index:2d} {hsim.label}->{tsim.label} FAILED: {result.reason}: "
            f"{result.message}")
        return
    say(f"handoff {index:2d} {hsim.label}->{tsim.label}: handoff to first token "
        f"{_sec(entry['handoff_to_first_token_s'])}, wake {_sec(wake)} (floor {floor:.3f} s, "
        f"x{entry['wake_over_floor']}), recovery {_sec(entry['recovery_to_first_token_s'])}, "
        f"sleep {_sec(sleep_s)}{' (first)' if first else ''}; {view_line(seen, run.sims)}")
