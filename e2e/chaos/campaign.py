"""One campaign: bring the rig up, drive switches with client load while faults come and
go, then let everything settle and check that every GPU has one owner (in awake-set mode:
that the engines awake on each GPU are exactly the ones its Lease names)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client

from e2e.bench.stats import summary_ms
from e2e.chaos.evidence import unreachable_engine
from e2e.chaos.faults import CATALOGUE, Fault
from e2e.chaos.load import client_loop, into_tally
from e2e.chaos.observe import LeaseObserver, Transition
from e2e.chaos.rig import NodeRig, Rig, RigOptions, namespace_for
from e2e.chaos.tally import AWAKE_SET, Tally
from e2e.cluster import LocalCluster
from e2e.harness.objects import ROTA_NAMESPACE, read_gpu_lease
from e2e.harness.scenario import AwakeMonitor, sim_state
from rota.api import naming
from rota.api.gpu_lease import GpuLease

__all__ = ["CampaignOptions", "owner_problem", "run_campaign"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CampaignOptions:
    switches: int = 10_000
    """Stop once this many switches ended (successfully or not)."""
    max_seconds: float = 1800.0
    """...or after this long, whichever comes first."""
    seed: int = 1
    fault_every_s: float = 2.0
    """Mean pause between two injected faults (exponentially distributed)."""
    fault_hold_s: tuple[float, float] = (0.5, 6.0)
    """How long a fault stays before it is undone (uniform)."""
    clients_per_gpu: int = 2
    request_timeout_s: float = 120.0
    settle_s: float = 420.0
    """After the load stops: how long every GPU has to end up with one owner, every engine
    answering. At least the lease controller's longest start back-off after failed starts
    (300 s: an engine the campaign crashed at its start several times waits that long in its
    start gate before it listens again), plus a start and a reconciliation."""
    keep_logs: Path | None = None
    """Where to copy every process's log at the end (None: they are removed)."""
    rig: RigOptions = field(default_factory=RigOptions)
    faults: tuple[Fault, ...] = CATALOGUE


def _say(text: str) -> None:
    print(text, flush=True)  # the campaign's progress lines are its user interface


class _Faults:
    def __init__(self, rig: Rig, session: aiohttp.ClientSession, options: CampaignOptions,
                 rng: random.Random, tally: Tally) -> None:
        self.rig, self.session, self.options, self.rng, self.tally = (
            rig, session, options, rng, tally)
        self.undos: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        weights = [f.weight for f in self.options.faults]
        if not weights:
            await stop.wait()
            return
        while not stop.is_set():
            pause = self.rng.expovariate(1.0 / self.options.fault_every_s)
            try:
                await asyncio.wait_for(stop.wait(), pause)
                break
            except TimeoutError:
                pass
            fault = self.rng.choices(self.options.faults, weights)[0]
            node = self.rng.choice(self.rig.nodes)
            try:
                injected = await fault.inject(self.rig, node, self.rng, self.session)
            except Exception as exc:
                log.warning("fault injection failed", extra={"fault": fault.name,
                                                             "error": repr(exc)[:200]})
                continue
            if not injected.took_effect:
                self.tally.faults_missed[fault.name] += 1
                continue
            self.tally.faults[fault.name] += 1
            undo = injected.undo
            if undo is not None:
                hold = self.rng.uniform(*self.options.fault_hold_s)
                task = asyncio.create_task(self._later(hold, undo), name=f"undo {fault.name}")
                self.undos.add(task)
                task.add_done_callback(self.undos.discard)

    async def _later(self, delay: float, undo: Callable[[], Awaitable[None]]) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            await asyncio.shield(undo())

    async def undo_all(self) -> None:
        for task in list(self.undos):
            task.cancel()
        await asyncio.gather(*self.undos, return_exceptions=True)


def owner_problem(lease: GpuLease, awake: list[str], *, awake_set: bool) -> str | None:
    """None when a settled GPU has its true owner: the Lease's holder is the only engine
    awake, or nobody is awake and the Lease says idle. ``awake_set``: the engines awake
    (``awake``, claims as ``namespace/name``) are exactly the Lease's awake set, with no
    switch in progress or failed."""
    if awake_set:
        named = sorted(m.claim for m in lease.awake_set)
        if lease.state in (naming.LeaseState.AWAKE, naming.LeaseState.IDLE) \
                and sorted(awake) == named:
            return None
        return (f"lease {lease.state} names awake {named} (holder {lease.holder or '-'}"
                f"{'; last error ' + lease.last_error[:120] if lease.last_error else ''}); "
                f"awake {sorted(awake)}")
    if lease.state == naming.LeaseState.AWAKE and awake == [lease.holder]:
        return None
    if lease.state == naming.LeaseState.IDLE and not awake and not lease.holder:
        return None
    return f"lease {lease.state} holder {lease.holder or '-'}; awake {awake}"


async def _owner_problem(rig: Rig, node: NodeRig, session: aiohttp.ClientSession) -> str | None:
    """:func:`owner_problem` of the node's GPU, as its Lease and its engines say now."""
    try:
        lease = await asyncio.to_thread(read_gpu_lease, rig.api, node.node.name, "gpu-0",
                                        timeout_s=5)
        states = [await sim_state(session, e) for e in node.engines]
    except (client.ApiException, aiohttp.ClientError, TimeoutError) as exc:
        return f"{node.node.name}: an engine or the Lease cannot be read: {exc!r}"[:300]
    awake = [naming.claim_ref(e.namespace, e.spec.name)
             for e, s in zip(node.engines, states, strict=True) if not s.get("sleeping")]
    problem = owner_problem(lease, awake, awake_set=rig.options.awake_set)
    return None if problem is None else f"{node.node.name}: {problem}"


async def _settle(rig: Rig, session: aiohttp.ClientSession, deadline_s: float) -> list[str]:
    deadline = time.monotonic() + deadline_s
    problems: list[str] = []
    while True:
        problems = [p for node in rig.nodes
                    if (p := await _owner_problem(rig, node, session)) is not None]
        if not problems or time.monotonic() > deadline:
            return problems
        await asyncio.sleep(1.0)


async def run_campaign(cluster: LocalCluster, api: client.ApiClient,
                       options: CampaignOptions) -> Tally:
    rng = random.Random(options.seed)
    tally = Tally(mode=options.rig.mode)
    loop = asyncio.get_running_loop()

    def on_transition(found: Transition) -> None:
        loop.call_soon_threadsafe(lambda: tally.switch(ok=found.ok, reason=found.reason))

    with namespace_for(api) as namespace:
        rig = Rig(cluster, api, namespace, options.rig)
        observer = LeaseObserver(api, ROTA_NAMESPACE, on_transition)
        try:
            for index in range(options.rig.nodes):
                node = await rig.add_node(index)
                node.start_controller(options.rig)
            await asyncio.gather(*(asyncio.to_thread(rig.deploy_engines, node, index)
                                   for index, node in enumerate(rig.nodes)))
            await asyncio.to_thread(rig.start_gateways)
            for node in rig.nodes:
                node.monitor = AwakeMonitor(node.node.dirs.inspect_socket, node.engines,
                                            registry=node.node.dirs.procs,
                                            fixture=node.node.fixture_file,
                                            separate_process=True,
                                            awake_set=options.rig.awake_set)
                node.monitor.__enter__()
            observer.start()
            _say(f"rig up ({options.rig.mode}): {len(rig.nodes)} GPUs, "
                 f"{len(rig.engines)} engines, {len(rig.gateways)} gateways; target "
                 f"{options.switches} switches")
            tally = await _drive(rig, options, rng, tally)
            async with aiohttp.ClientSession() as session:
                tally.unowned_gpus = await _settle(rig, session, options.settle_s)
        finally:
            observer.stop()
            for node in rig.nodes:  # a monitor's counts are complete once it stopped
                if node.monitor is not None:
                    node.monitor.__exit__(None, None, None)
            gaps = [g for node in rig.nodes if node.monitor is not None
                    for g in node.monitor.gaps]
            tally.sample_gaps = summary_ms(gaps) if gaps else {}
            for node in rig.nodes:
                if node.monitor is not None:
                    _count_samples(tally, node.node.name, node.monitor)
            if not tally.clean():  # before the logs go: what the unreachable engines say
                tally.unreachable = await _unreachable(rig)
            await rig.close(options.keep_logs)
    return tally


def _count_samples(tally: Tally, node: str, monitor: AwakeMonitor) -> None:
    """Add what a node's monitor counted (once it stopped) to the tally."""
    tally.gpu_samples += monitor.samples
    tally.above_resident.update(monitor.above_resident)
    if monitor.peak_used_bytes > tally.peak_used_bytes:
        tally.peak_used_bytes = monitor.peak_used_bytes
        tally.peak_total_bytes = monitor.peak_total_bytes
    examples = [f"{node} {v}" for v in monitor.violations[:5]]
    if tally.mode == AWAKE_SET:
        tally.over_gpu += len(monitor.violations)
        tally.over_gpu_samples += examples
        tally.crowded += len(monitor.crowded)
        tally.crowded_samples += [f"{node} {c}" for c in monitor.crowded[:5]]
    else:
        tally.double_awake += len(monitor.violations)
        tally.double_awake_samples += examples


async def _unreachable(rig: Rig) -> list[dict[str, Any]]:
    """The evidence about every engine that does not answer now (see
    :mod:`e2e.chaos.evidence`)."""
    found = []
    async with aiohttp.ClientSession() as session:
        for node in rig.nodes:
            for engine in node.engines:
                try:
                    await sim_state(session, engine)
                except (aiohttp.ClientError, TimeoutError):
                    found.append(await asyncio.to_thread(
                        unreachable_engine, node.node.dirs.logs, node.node.dirs.start_gate,
                        engine))
    return found


async def _drive(rig: Rig, options: CampaignOptions, rng: random.Random, tally: Tally
                 ) -> Tally:
    stop = asyncio.Event()
    start = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        faults = _Faults(rig, session, options, rng, tally)
        clients = [asyncio.create_task(client_loop(session, rig.gateways, models,
                                                   into_tally(tally), stop,
                                                   rng=random.Random(rng.random()),
                                                   timeout_s=options.request_timeout_s))
                   for models in rig.models_by_gpu() for _ in range(options.clients_per_gpu)]
        injector = asyncio.create_task(faults.run(stop))
        last = 0.0
        try:
            while tally.switches < options.switches:
                elapsed = time.monotonic() - start
                if elapsed > options.max_seconds:
                    _say(f"time is up after {elapsed:.0f} s")
                    break
                if elapsed - last >= 30:
                    last = elapsed
                    _say(f"{elapsed:6.0f} s  switches {tally.switches}  failed "
                         f"{tally.failed_switches}  requests {sum(tally.answers.values())}  "
                         f"faults {sum(tally.faults.values())}")
                _keep_controllers_running(rig)
                await asyncio.sleep(0.5)
        finally:
            stop.set()
            await injector
            await faults.undo_all()
            await asyncio.gather(*clients)
            tally.seconds = time.monotonic() - start
            _keep_controllers_running(rig)
    return tally


def _keep_controllers_running(rig: Rig) -> None:
    """What the kubelet does for the controller's container (restartPolicy Always): a node
    whose controller exited (a SIGTERM or SIGKILL fault, a start that gave up on a stalled
    API server) gets a new one."""
    for node in rig.nodes:
        node.reap()
        if not node.controllers:
            node.start_controller(rig.options)
