"""An awake set on the real node: the DaemonSet's lease controller with ``--awake-set``
(``ROTA_AWAKE_SET=true``, as an admin turns it on), three engine pods started through
rota's start gate on the fake H200, each 60Gi awake and 1Gi resident: any two fit the GPU
awake together, no three do.

Models A, B and C are asked for in turn through the gateway. After A and B, both are awake
and the GPU's Lease names both (its awake set); after C, exactly one of A and B has been
put to sleep, C is awake, and the Lease names the two awake. At each step the engines'
own state and NVML (the driver's inspection API) agree with the Lease: each engine the
Lease names awake holds more than its resident memory and no more than its awake budget,
each other one no more than its resident memory, and the GPU's memory in use stays under
its total. The GPU is sampled throughout by an awake-set monitor: no sample may show the
memory in use over the total, or more engines awake than fit.

Engines the Lease names awake before the first request (a start may leave one awake) are
taken as A (and B), so that each step's expectation holds whatever the start left; the
test says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from controller.lease.device import DeviceReader, GpuSnapshot
from e2e.harness.deploy import CONTROLLER, is_ready
from e2e.harness.objects import create_namespace, read_gpu_lease
from e2e.harness.rota_node import RotaOnNodes, gated_engine_docs
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven
from e2e.harness.waiting import WaitTimeout, eventually, eventually_async
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from rota.api.quantity import format_bytes, parse_quantity
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, pytest.mark.sampled,
              needs_root]

MODELS = {"set-a": "org/set-a", "set-b": "org/set-b", "set-c": "org/set-c"}
RESIDENT, AWAKE = "1Gi", "60Gi"
TOLERANCE = 256 * 2**20
"""How far an engine's footprint may read above its budget (the monitor's tolerance)."""
AWAKE_SET_ENV = "ROTA_AWAKE_SET"


def _with_awake_set(daemonset: dict[str, Any]) -> dict[str, Any]:
    """The controller DaemonSet with ``ROTA_AWAKE_SET=true`` (replacing any value)."""
    out = copy.deepcopy(daemonset)
    container = next(c for c in out["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "controller")
    container["env"] = [e for e in container.get("env", []) if e["name"] != AWAKE_SET_ENV]
    container["env"].append({"name": AWAKE_SET_ENV, "value": "true"})
    return out


def _awake_set_on(pod: client.V1Pod) -> bool:
    container = next(c for c in pod.spec.containers if c.name == "controller")
    return any(e.name == AWAKE_SET_ENV and e.value == "true" for e in container.env or [])


def _only_controller(rota: RotaOnNodes, awake_set: bool) -> client.V1Pod | None:
    """The node's one controller pod, when it is Ready, alone (the rollout's old pod gone)
    and in the mode asked for."""
    pods = rota.deployment.controller_pods(rota.node().name)
    if len(pods) == 1 and is_ready(pods[0]) and _awake_set_on(pods[0]) == awake_set \
            and pods[0].metadata.deletion_timestamp is None:
        return pods[0]
    return None


@contextlib.contextmanager
def awake_set_controller(rota: RotaOnNodes) -> Iterator[None]:
    """The node's lease controller in awake-set mode (a rolling update of its DaemonSet),
    and back to what it was afterwards."""
    before = rota.deployment.daemonset(CONTROLLER)
    rota.deployment.applier.apply([_with_awake_set(before)])
    try:
        eventually(lambda: _only_controller(rota, True), timeout=300, max_interval=2.0,
                   what="the lease controller rolled to --awake-set")
        rota.wait_ready()
        yield
    finally:
        rota.deployment.applier.apply([before])
        eventually(lambda: _only_controller(rota, False), timeout=600, max_interval=2.0,
                   what="the lease controller rolled back to one awake")
        rota.wait_ready()


@dataclass
class Stage:
    rota: RotaOnNodes
    namespace: str
    engines: dict[str, Engine]
    monitor: AwakeMonitor
    urls: dict[str, str]
    """Host URLs of the engines' own port (relayed to their pods), by name."""

    def lease(self) -> GpuLease:
        return read_gpu_lease(self.rota.api, self.rota.node().name, "gpu-0")

    def ref(self, name: str) -> str:
        return naming.claim_ref(self.namespace, name)

    async def awake_engines(self, session: aiohttp.ClientSession) -> set[str]:
        """The engines that say they are awake (the simulator's ``/sim/state``)."""
        awake = set()
        for name, url in self.urls.items():
            async with session.get(f"{url}/sim/state",
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                resp.raise_for_status()
                if not (await resp.json())["sleeping"]:
                    awake.add(name)
        return awake

    async def gpu(self) -> GpuSnapshot:
        reader = DeviceReader(self.rota.inspection_socket())
        try:
            snapshots = await reader.read()
        finally:
            await reader.close()
        return next(s for s in snapshots.values() if s.device == "gpu-0")


def _ready_ip(api: client.ApiClient, namespace: str, name: str) -> str | None:
    pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace, _request_timeout=10)
    return str(pod.status.pod_ip) if is_ready(pod) else None


@pytest.fixture(scope="module")
def stage(kube_api: client.ApiClient, rota_node: RotaOnNodes) -> Iterator[Stage]:
    namespace = f"awake-set-{uuid.uuid4().hex[:6]}"
    with awake_set_controller(rota_node):
        create_namespace(kube_api, namespace)
        monitor: AwakeMonitor | None = None
        try:
            docs = {name: gated_engine_docs(name, model=model, resident=RESIDENT, awake=AWAKE)
                    for name, model in MODELS.items()}
            engines: dict[str, Engine] = {}
            for name, (claim, _) in docs.items():
                rota_node.deploy_engines(namespace, docs=[claim], wait=False)
                uid = client.ResourceV1Api(kube_api).read_namespaced_resource_claim(
                    name, namespace, _request_timeout=10).metadata.uid
                engines[name] = Engine(EngineSpec(name, MODELS[name], resident=RESIDENT,
                                                  awake=AWAKE), namespace, claim_uid=uid)
            monitor = AwakeMonitor(rota_node.inspection_socket(), list(engines.values()),
                                   interval_s=0.02, awake_set=True)
            monitor.__enter__()
            for _, pod in docs.values():
                rota_node.deploy_engines(namespace, docs=[pod], wait=False)
            urls = {}
            for name, engine in engines.items():
                ip = eventually(functools.partial(_ready_ip, kube_api, namespace, name),
                                timeout=300, max_interval=2.0,
                                what=f"engine {name} admitted and Ready")
                assert ip is not None
                engine.pod_ip = ip
                urls[name] = rota_node.url(ip, 8000)
            yield Stage(rota_node, namespace, engines, monitor, urls)
        finally:
            if monitor is not None:
                monitor.__exit__(None, None, None)
            with contextlib.suppress(client.ApiException):
                client.CoreV1Api(kube_api).delete_namespace(namespace, _request_timeout=10)


def _settled(stage: Stage) -> GpuLease | None:
    """The GPU's Lease once no switch is under way and it names none but this test's
    engines awake (an engine of an earlier test, its namespace going away, may still be)."""
    lease = stage.lease()
    ours = {stage.ref(n) for n in MODELS}
    if lease.state in (naming.LeaseState.AWAKE, naming.LeaseState.IDLE) and all(
            m.claim in ours for m in lease.awake_set):
        return lease
    return None


async def _agree(stage: Stage, session: aiohttp.ClientSession, expected: set[str]
                 ) -> str | None:
    """None when the Lease names exactly ``expected`` awake (no switch under way), those
    engines and no other say they are awake, and NVML shows each of them between its
    resident memory and its awake budget, every other one at its resident memory, and the
    GPU's memory in use within its total; else what disagrees."""
    lease = await asyncio.to_thread(stage.lease)
    named = {m.claim for m in lease.awake_set}
    if lease.state != naming.LeaseState.AWAKE or named != {stage.ref(n) for n in expected}:
        return f"lease {lease.state} names {sorted(named)}, holder {lease.holder or '-'}"
    awake = await stage.awake_engines(session)
    if awake != expected:
        return f"engines awake {sorted(awake)}"
    gpu = await stage.gpu()
    held = {name: gpu.used_by(e.claim_uid) for name, e in stage.engines.items()}
    resident, budget = parse_quantity(RESIDENT), parse_quantity(AWAKE)
    for name, used in held.items():
        fine = (resident + TOLERANCE < used <= budget + TOLERANCE if name in expected
                else used <= resident + TOLERANCE)
        if not fine:
            return f"NVML: {name} holds {format_bytes(used)}"
    if gpu.used_bytes > gpu.total_bytes:
        return f"NVML: {format_bytes(gpu.used_bytes)} in use of {format_bytes(gpu.total_bytes)}"
    return None


async def _ask(stage: Stage, session: aiohttp.ClientSession, name: str) -> None:
    answer = await eventually_async(
        functools.partial(ask_seven, session, stage.rota.gateway_url(), MODELS[name]),
        timeout=180, max_interval=3.0, what=f"an answer from {MODELS[name]}")
    assert answer.strip() == "7"


async def _until_agreed(stage: Stage, session: aiohttp.ClientSession,
                        *options: set[str]) -> set[str]:
    """Wait (briefly: the answer came once the switch was done) until the Lease, the
    engines and NVML agree on one of ``options``, and return it; fail with the last
    disagreement."""
    last: dict[str, str | None] = {}

    async def agreed() -> set[str]:
        for expected in options:
            last[str(sorted(expected))] = problem = await _agree(stage, session, expected)
            if problem is None:
                return expected
        return set()  # none yet (false: asked again)

    try:
        return await eventually_async(
            agreed, timeout=30, max_interval=1.0,
            what=f"the Lease, the engines and NVML agreeing on one of {options}")
    except WaitTimeout as exc:
        raise AssertionError(f"awake should be one of {list(last)}: {last}") from exc


async def test_two_engines_stay_awake_together_and_a_third_displaces_exactly_one(
        stage: Stage) -> None:
    start = await asyncio.to_thread(eventually, lambda: _settled(stage), timeout=120,
                                     max_interval=2.0, what="the GPU settled after the starts")
    assert start is not None
    by_ref = {stage.ref(n): n for n in MODELS}
    first = [by_ref[m.claim] for m in start.awake_set]
    assert len(first) <= 2, start
    a, b, c = first + sorted(set(MODELS) - set(first))
    print(f"\nawake after the starts: {first or 'none'}; A={a}, B={b}, C={c}")

    async with aiohttp.ClientSession() as session:
        await _ask(stage, session, a)
        await _until_agreed(stage, session, {a, *first})
        await asyncio.to_thread(stage.monitor.wait_next)

        await _ask(stage, session, b)
        await _until_agreed(stage, session, {a, b})
        await asyncio.to_thread(stage.monitor.wait_next)

        await _ask(stage, session, c)
        after = await _until_agreed(stage, session, {a, c}, {b, c})
        print(f"{c} displaced {({a, b} - after).pop()}; {(after - {c}).pop()} stayed awake")
        await asyncio.to_thread(stage.monitor.wait_next)

    monitor = stage.monitor
    assert monitor.samples > 0
    assert not monitor.violations, monitor.violations[:10]  # memory over the GPU's total
    assert not monitor.crowded, monitor.crowded[:10]  # more awake than fit
    assert monitor.above_resident.get(2, 0) > 0, monitor.above_resident  # a set was awake
