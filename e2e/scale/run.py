"""One run of the scale harness: the fleet up, the phases measured, everything stopped.

Order: the control plane with an audit log; kwok and N Nodes; the drivers (slices
published); claims and pods, allocated by kube-scheduler and made Running by kwok; the
lease controllers (watches synced, Lease held, every GPU reconciled); R gateway
processes; then each phase, bounded by two scrapes of the API server's ``/metrics`` and
of the gateways' ``/proc`` figures. The audit log is read once at the end and cut by the
phases' times.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.cluster import ClusterOptions, LocalCluster
from e2e.cluster.local import free_port
from e2e.cluster.processes import ManagedProcess
from e2e.scale import apimetrics, audit, fleet, kwok, world
from e2e.scale.report import Phase, ProcessSample, report
from rota.api import naming

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0
THREADS_PER_NODE = 12
"""Two processes per node, each with asyncio's default pool on two cores (cpu + 4)."""
LAG_TICK_S = 0.1


@dataclass(frozen=True)
class Options:
    nodes: int = 20
    gpus: int = 8
    engines: int = 4
    idle_s: float = 60.0
    switch_s: float = 60.0
    switches_per_gpu_hour: float = 60.0
    gateways: int = 2
    engine_s: float = 0.5
    """How long each engine call of a switch takes (drain and sleep, wake and probe)."""
    reconcile_s: float = 0.02
    """How long a reconciliation takes besides its Lease read (engines asked, GPU read)."""
    settle_s: float = 15.0
    """A pause after everything is up, before the first phase (start-up writes finish)."""
    restart_s: float = 0.0
    """After switching, a third phase of this length that begins with an API server restart
    (switching goes on); 0: none."""
    seed: int = 22
    workdir: Path | None = None
    """Kept when given; a temporary directory removed at the end otherwise."""


@dataclass
class Running:
    cluster: LocalCluster
    kubeconfig: Path
    processes: list[ManagedProcess] = field(default_factory=list)
    gateways: list[ManagedProcess] = field(default_factory=list)


def _gateway(kubeconfig: Path, workdir: Path, index: int) -> ManagedProcess:
    proc = ManagedProcess(name=f"gateway-{index}", argv=[
        sys.executable, "-m", "controller.gateway", "--host", "127.0.0.1",
        "--port", str(free_port()), "--kubeconfig", str(kubeconfig),
        "--controller-namespace", world.LEASE_NAMESPACE,
        "--serving-namespaces", world.NAMESPACE,
        "--shutdown-delay-s", "0", "--shutdown-grace-s", "1", "--log-level", "warning",
    ], log_path=workdir / "logs" / f"gateway-{index}.log")
    proc.start()
    return proc


def _dead(procs: list[ManagedProcess]) -> str | None:
    for proc in procs:
        if not proc.alive():
            return f"{proc.name} exited:\n{proc.log_tail()}"
    return None


def _harness_client(cluster: LocalCluster) -> client.ApiClient:
    api = cluster.api_client()
    api.user_agent = world.USER_AGENT
    return api


def _sample(procs: list[ManagedProcess]) -> list[ProcessSample]:
    return [ProcessSample.read(p.pid) for p in procs]


async def _loop_lag(stop: asyncio.Event) -> float:
    """The longest this process's event loop was late for a timer until ``stop``: when it
    is seconds, the emulated processes themselves lag (the harness is saturated)."""
    worst = 0.0
    while not stop.is_set():
        asked = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        worst = max(worst, time.monotonic() - asked - LAG_TICK_S)
    return worst


async def _phase(name: str, seconds: float, running: Running, gpus: list[fleet.GpuEmulation],
                 *, per_gpu_hour: float, rng: random.Random, restart: bool = False) -> Phase:
    """One phase; with ``restart`` it begins with an API server restart and its counters
    (which the restart zeroes) are read from when the API server is ready again."""
    ctx = running.cluster.ssl_context(client_cert=True)
    gw_before = _sample(running.gateways)
    switches_before = sum(g.switches for g in gpus)
    start = dt.datetime.now(dt.UTC)
    stop = asyncio.Event()
    driver = asyncio.create_task(fleet.drive_switches(gpus, per_gpu_hour=per_gpu_hour,
                                                      stop=stop, rng=rng),
                                 name=f"switches-{name}")
    lag = asyncio.create_task(_loop_lag(stop), name=f"loop-lag-{name}")
    harness_before = ProcessSample.read(os.getpid())
    if restart:
        # On this (the starting) thread, so that the new process dies with this one.
        running.cluster.restart_apiserver(wait=False)
        await asyncio.to_thread(running.cluster.wait_apiserver)
    before = await asyncio.to_thread(apimetrics.scrape, running.cluster.server, ctx)
    await asyncio.sleep(seconds)
    stop.set()
    await driver
    end = dt.datetime.now(dt.UTC)
    harness = (harness_before, ProcessSample.read(os.getpid()))
    after = await asyncio.to_thread(apimetrics.scrape, running.cluster.server, ctx)
    return Phase(name=name, start=start, end=end, loop_lag_s=await lag, harness=harness,
                 switches=sum(g.switches for g in gpus) - switches_before,
                 watch=apimetrics.watch_events(before, after),
                 latency=apimetrics.latency_p99(before, after),
                 gateways=list(zip(gw_before, _sample(running.gateways), strict=True)))


async def _measure(options: Options, running: Running, workdir: Path) -> dict[str, Any]:
    shape = world.Shape(options.nodes, options.gpus, options.engines)
    loop = asyncio.get_running_loop()
    # Each real process has threads of its own for its API calls; here they share one
    # pool, made large enough that no emulated process waits for another's thread.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=16 + THREADS_PER_NODE * shape.nodes))
    api = _harness_client(running.cluster)
    nodes = await asyncio.to_thread(world.create_nodes, api, shape)
    await asyncio.to_thread(world.prepare_cluster, api)
    stop = asyncio.Event()
    drivers = [fleet.DriverEmulation(n, world.gpus_of(n, shape.gpus),
                                     kubeconfig=running.kubeconfig, engines=shape.engines)
               for n in nodes]
    controllers = [fleet.ControllerEmulation(n, kubeconfig=running.kubeconfig,
                                             namespace=world.LEASE_NAMESPACE,
                                             engine_s=options.engine_s,
                                             reconcile_s=options.reconcile_s) for n in nodes]
    rng = random.Random(options.seed)
    async with asyncio.TaskGroup() as tasks:
        try:
            for d in drivers:
                tasks.create_task(d.run(stop), name=f"driver-{d.node}")
            for d in drivers:
                await d.publisher.synced.wait()
            started = time.monotonic()
            await asyncio.to_thread(world.create_engines, api, shape, nodes)
            await asyncio.to_thread(world.wait_running, api, shape, READY_TIMEOUT_S,
                                    functools.partial(_dead, running.processes))
            log.info("engines running", extra={"claims": shape.claims,
                                               "seconds": round(time.monotonic() - started)})
            by_node = await asyncio.to_thread(world.claimants_by_node, api)
            for d, c in zip(drivers, controllers, strict=True):
                d.ledger.prepared(by_node.get(d.node, []), d.gpus)
                d.prepared.set()
                c.follow(by_node.get(c.node, []))
                tasks.create_task(c.run(stop), name=f"controller-{c.node}")
            await asyncio.wait_for(asyncio.gather(*(c.ready() for c in controllers)),
                                   READY_TIMEOUT_S)
            running.gateways = [_gateway(running.kubeconfig, workdir, i)
                                for i in range(options.gateways)]
            await asyncio.sleep(options.settle_s)
            dead = _dead([*running.processes, *running.gateways])
            if dead:
                raise RuntimeError(dead)
            gpus = [g for c in controllers for g in c.gpus.values()]
            phases = [
                await _phase("idle", options.idle_s, running, gpus, per_gpu_hour=0, rng=rng),
                await _phase("switching", options.switch_s, running, gpus,
                             per_gpu_hour=options.switches_per_gpu_hour, rng=rng),
            ]
            if options.restart_s > 0:
                phases.append(await _phase("restart", options.restart_s, running, gpus,
                                           per_gpu_hour=options.switches_per_gpu_hour,
                                           rng=rng, restart=True))
            renewed = await asyncio.to_thread(_renewed_leases, api, nodes, phases[0].start)
        finally:
            stop.set()
            for gw in running.gateways:
                gw.stop()
    errors = sum(g.errors for c in controllers for g in c.gpus.values())
    losses = sum(max(0, c.election.term - 1) for c in controllers)
    await asyncio.sleep(2.0)  # the audit backend writes in batches of up to 1 s
    requests = list(audit.read(running.cluster.workdir / "audit.log"))
    return report(options=options, shape=shape, phases=phases, requests=requests,
                  renewed=renewed, gpu_errors=errors, lease_losses=losses,
                  lease_namespace=world.LEASE_NAMESPACE)


def _renewed_leases(api: client.ApiClient, nodes: list[str], since: dt.datetime
                    ) -> dict[str, bool]:
    """Whether each node's controller Lease was renewed after ``since``."""
    coordination = client.CoordinationV1Api(api)
    found: dict[str, bool] = {}
    for node in nodes:
        lease = coordination.read_namespaced_lease(naming.controller_lease_name(node),
                                                   world.LEASE_NAMESPACE)
        renew = lease.spec.renew_time
        found[node] = bool(lease.spec.holder_identity) and renew is not None and renew > since
    return found


def run(options: Options) -> dict[str, Any]:
    """Start everything, measure, stop everything; the report (see :mod:`e2e.scale.report`)."""
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="rota-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster_dir = workdir / "cluster"
    cluster_dir.mkdir(exist_ok=True)
    policy = cluster_dir / "audit-policy.yaml"
    policy.write_text(audit.POLICY)
    cluster = LocalCluster(cluster_dir, ClusterOptions(
        audit_policy_file=policy, audit_log_path=cluster_dir / "audit.log"))
    kwok_bin = kwok.locate()
    cluster.start()
    running = Running(cluster=cluster, kubeconfig=cluster.kubeconfig)
    try:
        running.processes.append(kwok.start(kubeconfig=cluster.kubeconfig, workdir=workdir,
                                            binary=kwok_bin))
        return asyncio.run(_measure(options, running, workdir))
    finally:
        for proc in [*running.gateways, *running.processes]:
            proc.stop()
        cluster.stop()
        if options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


__all__ = ["Options", "run"]
