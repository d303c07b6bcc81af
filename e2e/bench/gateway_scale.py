"""Benchmark of the gateway against a large synthetic fleet: what an event and a request cost.

    python -m e2e.bench.gateway_scale [--nodes 0,10,100,1000] [--seconds 10] [--clients 16]
                                      [--switches-per-gpu-hour 60] [--latency-requests 200]

For every N, a gateway process (the real app of :mod:`controller.gateway`, real aiohttp,
on 127.0.0.1) is fed a world of N nodes x G = 8 GPUs x E = 4 engines: ResourceClaims as the
scheduler allocates them for rota's driver (a share of one GPU, with managed fields and the
controller's device conditions), their Running pods, one GPU Lease per GPU and one
controller Lease per node, written by the same contracts the real processes write with
(:class:`rota.api.gpu_lease.GpuLease`,
:class:`rota.api.controller_lease.ControllerLease`,
:mod:`rota.api.naming`). One more node holds the warm model: one engine, awake, served by
an engine simulator on loopback. While measured, the gateway process keeps feeding its
routing state as its watches would: every controller renews its Lease every 5 s, and each
GPU but the warm one switches ``--switches-per-gpu-hour`` times an hour (two GPU Lease
writes, and the controller's visible state: a label on each engine's pod and a condition on
each claim).

Measured, per N:

- update cost per event (µs), by kind, in the gateway process before the load: one event
  applied, then one routing decision for the warm model (so that a state that defers its
  work to the next read pays it here too), less the decision alone;
- requests per second: ``--clients`` clients sending non-streamed chat requests for the
  warm model for ``--seconds``;
- added p99 latency on the warm model: streamed requests one at a time, alternately to the
  engine directly and through the gateway; the difference of the p99 times to first token;
- the gateway process's RSS (after the world is loaded, and at the end) and its CPU time
  per request under load.

The clients and the simulator run in this process, the gateway in a child process, so that
the gateway has an event loop to itself. Prints a line per N and a JSON object last. No
targets are asserted; the issue's are: at N = 1000, requests/s >= 80 % of N = 0's, added p99
<= 5 ms, RSS <= 256 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from controller.gateway import keys
from controller.gateway.app import make_app
from controller.gateway.routing import RoutingState
from controller.gateway.settings import GatewaySettings
from e2e.bench.gateway import stream_once
from e2e.bench.stats import percentile
from e2e.engine_simulator import Settings as SimSettings
from e2e.engine_simulator import create_app as create_sim
from e2e.harness.objects import DRIVER, claim, engine_config, engine_pod
from rota.api import naming
from rota.api.controller_lease import ControllerLease
from rota.api.gpu_lease import GpuLease, lease_body, micro_time

GPUS = 8
ENGINES = 4
NAMESPACE = "engines"
LEASE_NAMESPACE = "rota-system"
WARM_NODE = "warm-node"
WARM_MODEL = "bench/warm"
RENEW_S = 5.0
LEASE_S = 15.0
COST_BUDGET_S = 3.0
"""Longest the update cost of one kind of event is measured for (a slow state stops early)."""
COST_EVENTS = 300
START_TIMEOUT_S = 600.0
EPOCH = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def node_name(index: int) -> str:
    return f"gpu-node-{index:04d}"


def claim_name(node: str, gpu: int, engine: int) -> str:
    return f"{node}-g{gpu}-e{engine}"


def model_of(node: str, gpu: int, engine: int) -> str:
    return f"bench/{node}-g{gpu}-e{engine}"


def pod_ip(node: int, gpu: int, engine: int) -> str:
    return f"10.{node // 250}.{node % 250}.{gpu * ENGINES + engine + 1}"


def _managed_fields(manager: str, subresource: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "manager": manager, "operation": "Update", "apiVersion": "resource.k8s.io/v1",
        "time": "2026-12-01T00:00:00Z", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:status": {"f:allocation": {".": {}, "f:devices": {
            ".": {}, "f:results": {}}, "f:nodeSelector": {}}, "f:reservedFor": {}}}}
    if subresource:
        entry["subresource"] = subresource
    return entry


def claim_object(node: str, gpu: int, engine: int, *, model: str, port: int = 8000,
                 version: int = 1, ready: bool = True) -> dict[str, Any]:
    """A claim for one share of ``gpu-<gpu>`` of ``node`` as the API server returns it once
    the scheduler allocated it and the pod runs (the controller's conditions included)."""
    name = claim_name(node, gpu, engine)
    body = claim(name, memory="10Gi", config=engine_config(model=model, awake="20Gi",
                                                           port=port))
    body["metadata"] |= {
        "namespace": NAMESPACE, "uid": f"uid-{name}", "resourceVersion": str(version),
        "creationTimestamp": "2026-12-01T00:00:00Z",
        "managedFields": [_managed_fields("kube-scheduler", "status"),
                          _managed_fields("rota-controller", "status")]}
    device = f"gpu-{gpu}"
    body["status"] = {
        "allocation": {
            "devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": node, "device": device,
                "shareID": f"{gpu:02x}{engine:02x}0000-0000-4000-8000-000000000000",
                "consumedCapacity": {"memory": "10Gi"}}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{
                "key": "metadata.name", "operator": "In", "values": [node]}]}]}},
        "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": f"pod-uid-{name}"}],
        "devices": [{"driver": DRIVER, "pool": node, "device": device, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False",
             "reason": "Awake" if ready else "Asleep", "lastTransitionTime": micro_time(EPOCH),
             "message": "rota: engine state"}]}]}
    return body


def pod_object(node: str, gpu: int, engine: int, *, ip: str, state: str = "asleep"
               ) -> dict[str, Any]:
    """The engine's pod, Running and Ready, with the label the controller keeps on it."""
    name = claim_name(node, gpu, engine)
    body = engine_pod(f"pod-{name}", node=node, claim_name=name,
                      labels={"app": name, f"{naming.DOMAIN}/state": state})
    body["metadata"] |= {"namespace": NAMESPACE, "uid": f"pod-uid-{name}",
                         "resourceVersion": "1"}
    body["spec"]["nodeName"] = node
    body["status"] = {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "192.0.2.1",
        "conditions": [{"type": t, "status": "True"} for t in
                       ("PodReadyToStartContainers", "Initialized", "Ready",
                        "ContainersReady", "PodScheduled")],
        "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0,
                               "image": "rota/engine-simulator:latest",
                               "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}}}]}
    return body


def gpu_lease_object(lease: GpuLease, version: int) -> dict[str, Any]:
    body = lease_body(lease, LEASE_NAMESPACE, labels_node=lease.node,
                      labels_device=lease.device)
    body["metadata"]["resourceVersion"] = str(version)
    return body


def held_lease(node: str, gpu: int, engine: int, *, model: str, fence: int = 1) -> GpuLease:
    """The GPU Lease of ``gpu-<gpu>`` with ``engine``'s claimant awake on it."""
    device = f"gpu-{gpu}"
    name = claim_name(node, gpu, engine)
    return GpuLease(name=naming.gpu_lease_name(node, device), node=node, device=device,
                    fence=fence).serving(holder=naming.claim_ref(NAMESPACE, name), model=model,
                                         claim_uid=f"uid-{name}", gang="",
                                         controller=f"rota-controller-{node}")


def controller_lease_object(node: str, renewal: int) -> dict[str, Any]:
    """``node``'s controller Lease at its ``renewal``-th renewal, as its election writes it."""
    return ControllerLease(
        name=naming.controller_lease_name(node), node=node, node_label=node,
        holder=f"rota-controller-{node}", instance=f"instance-{node}",
        activation_url="http://192.0.2.9:8085", renew_time=EPOCH + dt.timedelta(
            seconds=RENEW_S * renewal), acquire_time=EPOCH, duration_s=LEASE_S,
        resource_version=str(renewal)).body(LEASE_NAMESPACE)


@dataclass
class World:
    """The synthetic fleet: what a gateway would list (made on demand, never all held
    at once), and what changes next."""

    nodes: int
    engine_port: int
    holders: dict[tuple[str, int], int] = field(default_factory=dict)
    """(node, gpu) -> the engine awake there."""
    fences: dict[tuple[str, int], int] = field(default_factory=dict)
    renewals: dict[str, int] = field(default_factory=dict)
    version: itertools.count[int] = field(default_factory=lambda: itertools.count(10))

    @classmethod
    def build(cls, nodes: int, engine_port: int) -> World:
        world = cls(nodes, engine_port)
        for index in range(nodes):
            node = node_name(index)
            for gpu in range(GPUS):
                world.holders[(node, gpu)] = 0
                world.fences[(node, gpu)] = 1
            world.renewals[node] = 1
        world.renewals[WARM_NODE] = 1
        return world

    def claims(self) -> Iterator[dict[str, Any]]:
        for index in range(self.nodes):
            node = node_name(index)
            for gpu in range(GPUS):
                for engine in range(ENGINES):
                    yield claim_object(node, gpu, engine, model=model_of(node, gpu, engine),
                                       ready=engine == 0)
        yield claim_object(WARM_NODE, 0, 0, model=WARM_MODEL, port=self.engine_port)

    def pods(self) -> Iterator[dict[str, Any]]:
        for index in range(self.nodes):
            node = node_name(index)
            for gpu in range(GPUS):
                for engine in range(ENGINES):
                    yield pod_object(node, gpu, engine, ip=pod_ip(index, gpu, engine),
                                     state="awake" if engine == 0 else "asleep")
        yield pod_object(WARM_NODE, 0, 0, ip="127.0.0.1", state="awake")

    def leases(self) -> Iterator[dict[str, Any]]:
        for index in range(self.nodes):
            node = node_name(index)
            for gpu in range(GPUS):
                yield gpu_lease_object(held_lease(node, gpu, 0, model=model_of(node, gpu, 0)),
                                       1)
            yield controller_lease_object(node, 1)
        yield gpu_lease_object(held_lease(WARM_NODE, 0, 0, model=WARM_MODEL), 1)
        yield controller_lease_object(WARM_NODE, 1)


    def renewal(self, node: str) -> dict[str, Any]:
        self.renewals[node] += 1
        return controller_lease_object(node, self.renewals[node])

    def switch(self, node: str, gpu: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """The watch events of one switch on ``node``/``gpu`` to its next engine, in the
        order the controller writes them."""
        old, new = self.holders[(node, gpu)], (self.holders[(node, gpu)] + 1) % ENGINES
        fence = self.fences[(node, gpu)]
        before = held_lease(node, gpu, old, model=model_of(node, gpu, old), fence=fence)
        opening = before.opening(naming.LeaseState.SWITCHING,
                                 controller=f"rota-controller-{node}",
                                 target_model=model_of(node, gpu, new),
                                 draining_model=model_of(node, gpu, old))
        yield "lease", gpu_lease_object(opening, next(self.version))
        after = held_lease(node, gpu, new, model=model_of(node, gpu, new), fence=fence + 1)
        yield "lease", gpu_lease_object(after, next(self.version))
        index = int(node.rsplit("-", 1)[1])
        for engine, state in ((old, "asleep"), (new, "awake")):
            yield "pod", pod_object(node, gpu, engine, ip=pod_ip(index, gpu, engine),
                                    state=state)
            yield "claim", claim_object(node, gpu, engine, model=model_of(node, gpu, engine),
                                        version=next(self.version), ready=state == "awake")
        self.holders[(node, gpu)] = new
        self.fences[(node, gpu)] = fence + 1


class WorldSource:
    """Lists the world into the state once, as a fresh gateway's first lists would, and
    keeps nothing of it (a :class:`~controller.gateway.routing.RoutingSource`)."""

    def __init__(self, world: World) -> None:
        self._world = world

    async def run(self, state: RoutingState) -> None:
        state.replace("claim", self._world.claims())
        state.replace("pod", self._world.pods())
        state.replace("lease", self._world.leases())
        state.mark_synced()


# -- the gateway process ---------------------------------------------------------------


def rss_mib() -> float:
    """This process's resident set size (MiB), as procfs reports it."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _cost_us(state: RoutingState, events: Iterator[tuple[str, dict[str, Any]]]) -> float:
    """Mean µs of one event plus the warm model's decision, less the decision alone."""
    baseline = time.perf_counter()
    for _ in range(200):
        state.decide(WARM_MODEL)
    decide_s = (time.perf_counter() - baseline) / 200
    count, spent = 0, 0.0
    started = time.perf_counter()
    for kind, obj in events:
        t0 = time.perf_counter()
        state.apply(kind, "MODIFIED", obj)  # type: ignore[arg-type]
        state.decide(WARM_MODEL)
        spent += time.perf_counter() - t0
        count += 1
        if count >= COST_EVENTS or time.perf_counter() - started > COST_BUDGET_S:
            break
    return round(max(0.0, spent / max(1, count) - decide_s) * 1e6, 1)


def _switching_gpus(world: World) -> list[tuple[str, int]]:
    return [(node_name(i), g) for i in range(world.nodes) for g in range(GPUS)]


def update_costs(state: RoutingState, world: World) -> dict[str, float]:
    nodes = [node_name(i) for i in range(world.nodes)] + [WARM_NODE]
    gpus = _switching_gpus(world)

    def renewals() -> Iterator[tuple[str, dict[str, Any]]]:
        for node in itertools.cycle(nodes):
            yield "lease", world.renewal(node)

    def switches(kinds: set[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        for node, gpu in itertools.cycle(gpus):
            for kind, obj in world.switch(node, gpu):
                if kind in kinds:
                    yield kind, obj

    costs = {"controller_renewal": _cost_us(state, renewals())}
    if gpus:
        costs["gpu_lease"] = _cost_us(state, switches({"lease"}))
        costs["pod_label"] = _cost_us(state, switches({"pod"}))
        costs["claim_status"] = _cost_us(state, switches({"claim"}))
    return costs


async def feed(state: RoutingState, world: World, switches_per_gpu_hour: float,
               fed: list[int]) -> None:
    """Controller renewals and switches at their rates, applied as the watches would."""
    nodes = [node_name(i) for i in range(world.nodes)] + [WARM_NODE]
    gpus = _switching_gpus(world)
    renew_rate = len(nodes) / RENEW_S
    switch_rate = len(gpus) * switches_per_gpu_hour / 3600.0
    loop = asyncio.get_running_loop()
    start = loop.time()
    renewed = switched = 0
    order = itertools.cycle(nodes)
    rng = random.Random(22)
    tick = asyncio.Event()  # never set: an interruptible pause between ticks
    while True:
        elapsed = loop.time() - start
        while renewed < renew_rate * elapsed:
            state.apply("lease", "MODIFIED", world.renewal(next(order)))
            renewed += 1
            fed[0] += 1
        while gpus and switched < switch_rate * elapsed:
            node, gpu = rng.choice(gpus)
            for kind, obj in world.switch(node, gpu):
                state.apply(kind, "MODIFIED", obj)  # type: ignore[arg-type]
                fed[0] += 1
            switched += 1
        try:
            async with asyncio.timeout(0.02):
                await tick.wait()
        except TimeoutError:
            pass


async def serve(nodes: int, engine_port: int, switches_per_gpu_hour: float) -> None:
    """The gateway process: load the world, measure update costs, serve while feeding."""
    started = time.perf_counter()
    world = World.build(nodes, engine_port)
    source = WorldSource(world)
    settings = GatewaySettings.model_validate({
        "host": "127.0.0.1", "port": 0, "serving_namespaces": [NAMESPACE],
        "max_wait_s": 30.0})
    app = make_app(settings, routing_source=source)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state = app[keys.STATE]
    ready = asyncio.Event()

    async def synced() -> None:
        while not state.synced:
            await state.wait_changed(state.version, START_TIMEOUT_S)
        ready.set()

    await asyncio.wait_for(synced(), START_TIMEOUT_S)
    gc.collect()
    load_s = time.perf_counter() - started
    rss_loaded = rss_mib()
    costs = update_costs(state, world)
    fed = [0]
    feeder = asyncio.create_task(feed(state, world, switches_per_gpu_hour, fed))
    port = runner.addresses[0][1]
    print(json.dumps({"port": port, "load_s": round(load_s, 2), "rss_loaded_mib": rss_loaded,
                      "update_us": costs}), flush=True)
    cpu0 = time.process_time()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)
    cpu = time.process_time() - cpu0
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    print(json.dumps({"cpu_s": round(cpu, 3), "events_fed": fed[0], "rss_end_mib": rss_mib()}),
          flush=True)
    await runner.cleanup()


# -- the clients -----------------------------------------------------------------------


def _chat(model: str, *, stream: bool) -> dict[str, Any]:
    return {"model": model, "stream": stream, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": "What is 3 + 4?"}]}


async def throughput(url: str, clients: int, seconds: float) -> dict[str, Any]:
    """Non-streamed requests from ``clients`` clients for ``seconds``: how many answered."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    latencies: list[float] = []
    failed = unfinished = 0
    body = _chat(WARM_MODEL, stream=False)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failed, unfinished
        while (left := until - loop.time()) > 0:
            t0 = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=left)) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except TimeoutError:
                unfinished += 1  # still waiting when the time was up
                continue
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                failed += 1

    started = loop.time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    wall = loop.time() - started
    ms = sorted(x * 1e3 for x in latencies)
    return {"requests": len(ms), "failed": failed, "unfinished": unfinished,
            "requests_per_s": round(len(ms) / wall, 1),
            "p50_ms": round(percentile(ms, 0.5), 2) if ms else None,
            "p99_ms": round(percentile(ms, 0.99), 2) if ms else None}


async def added_latency(direct: str, gateway: str, requests: int, limit_s: float
                        ) -> dict[str, Any]:
    """Streamed requests one at a time, alternating direct and through the gateway."""
    body = _chat(WARM_MODEL, stream=True)
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    loop = asyncio.get_running_loop()
    until = loop.time() + limit_s
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            if loop.time() > until:
                break
            for side, url in (("direct", direct), ("gateway", gateway)):
                try:
                    ttft, _ = await asyncio.wait_for(stream_once(session, url, body),
                                                     max(0.1, until - loop.time()))
                except (TimeoutError, RuntimeError, aiohttp.ClientError):
                    continue
                times[side].append(ttft * 1e3)
    if not times["direct"] or not times["gateway"]:
        return {"n": len(times["gateway"]), "added_p99_ms": None, "added_p50_ms": None}
    return {"n": len(times["gateway"]),
            "direct_p99_ms": round(percentile(times["direct"], 0.99), 3),
            "gateway_p99_ms": round(percentile(times["gateway"], 0.99), 3),
            "added_p50_ms": round(percentile(times["gateway"], 0.5)
                                  - percentile(times["direct"], 0.5), 3),
            "added_p99_ms": round(percentile(times["gateway"], 0.99)
                                  - percentile(times["direct"], 0.99), 3)}


async def measure(nodes: int, *, engine_url: str, engine_port: int, seconds: float,
                  clients: int, switches_per_gpu_hour: float, latency_requests: int
                  ) -> dict[str, Any]:
    """One N: start the gateway process, load it, stop it; its figures."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "e2e.bench.gateway_scale", "--serve", str(nodes),
        "--engine-port", str(engine_port),
        "--switches-per-gpu-hour", str(switches_per_gpu_hour),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        first = json.loads(await asyncio.wait_for(child.stdout.readline(), START_TIMEOUT_S))
        url = f"http://127.0.0.1:{first['port']}"
        load = await throughput(url, clients, seconds)
        latency = await added_latency(engine_url, url, latency_requests, seconds)
        child.stdin.write(b"done\n")
        await child.stdin.drain()
        last = json.loads(await asyncio.wait_for(child.stdout.readline(), 60))
    finally:
        if child.returncode is None:
            child.stdin.close()
        await asyncio.wait_for(child.wait(), 60)
    answered = load["requests"] + latency["n"]
    return {"nodes": nodes, "gpus": nodes * GPUS, "claims": nodes * GPUS * ENGINES + 1,
            "load_s": first["load_s"], "update_us": first["update_us"],
            "throughput": load, "latency": latency,
            "rss_loaded_mib": first["rss_loaded_mib"], "rss_end_mib": last["rss_end_mib"],
            "events_fed": last["events_fed"],
            "cpu_ms_per_request": round(last["cpu_s"] * 1e3 / answered, 3) if answered else None}


async def run(node_counts: list[int], *, seconds: float = 10.0, clients: int = 16,
              switches_per_gpu_hour: float = 60.0, latency_requests: int = 200
              ) -> dict[str, Any]:
    """Every N in turn against one engine simulator; the result object."""
    sim = create_sim(SimSettings.model_validate({
        "model": WARM_MODEL, "dev_mode": True, "shutdown_grace_seconds": 0.0}),
        exit_process=lambda code: None)
    runner = web.AppRunner(sim, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = int(runner.addresses[0][1])
    rows = []
    try:
        for nodes in node_counts:
            row = await measure(nodes, engine_url=f"http://127.0.0.1:{port}", engine_port=port,
                                seconds=seconds, clients=clients,
                                switches_per_gpu_hour=switches_per_gpu_hour,
                                latency_requests=latency_requests)
            print(_line(row), flush=True)
            rows.append(row)
    finally:
        await runner.cleanup()
    return {"gpus_per_node": GPUS, "engines_per_gpu": ENGINES, "seconds": seconds,
            "clients": clients, "switches_per_gpu_hour": switches_per_gpu_hour,
            "renew_s": RENEW_S, "cpu_count": os.cpu_count(), "results": rows}


def _line(row: dict[str, Any]) -> str:
    costs = ", ".join(f"{k} {v} µs" for k, v in row["update_us"].items())
    load, latency = row["throughput"], row["latency"]
    return (f"N={row['nodes']}: {row['claims']} claims, loaded in {row['load_s']} s; "
            f"per event: {costs}; {load['requests_per_s']} requests/s "
            f"({load['failed']} failed, p99 {load['p99_ms']} ms); "
            f"added p99 {latency['added_p99_ms']} ms; RSS {row['rss_loaded_mib']} -> "
            f"{row['rss_end_mib']} MiB; {row['cpu_ms_per_request']} ms CPU per request")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.gateway_scale",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="0,10,100,1000",
                        help="comma-separated node counts (0,10,100,1000)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="load duration per N, and the latency phase's limit (10)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (16)")
    parser.add_argument("--switches-per-gpu-hour", type=float, default=60.0,
                        help="switches per GPU per hour while measured (60)")
    parser.add_argument("--latency-requests", type=int, default=200,
                        help="streamed requests per side for the added latency (200)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engine-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        asyncio.run(serve(args.serve, args.engine_port, args.switches_per_gpu_hour))
        return 0
    counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    result = asyncio.run(run(counts, seconds=args.seconds, clients=args.clients,
                             switches_per_gpu_hour=args.switches_per_gpu_hour,
                             latency_requests=args.latency_requests))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
