"""Switches and the gateway through real pods: what the controller's and the gateway's
cluster tests prove with bare processes beside the node agent, here with the DaemonSet's
driver and lease controller, the gateway Deployment and engine pods on the real kubelet.

One stage serves the module: in its own namespace, two engines started through rota's
start gate, one sleeping at level 1 and one at level 2. The driver's inspection API is
sampled from before their start to the end of the module: no sample may show both above
their resident memory.

- :func:`test_handoffs_between_levels_through_both_gateway_replicas`
- :func:`test_an_engine_that_crashes_in_its_sleep_is_restarted_by_the_kubelet_and_serves`
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from controller.lease.visible_state import LABEL_STATE
from e2e.harness.deploy import NAMESPACE, is_ready
from e2e.harness.objects import create_namespace
from e2e.harness.rota_node import RotaOnNodes, gated_engine_docs, watched_engines
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven
from e2e.harness.waiting import eventually, eventually_async
from rota.api import naming
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, needs_root]

LEVELS = {"lvl1": ("org/pods-level1", 1), "lvl2": ("org/pods-level2", 2)}
HANDOFFS = 8


@dataclass
class Stage:
    rota: RotaOnNodes
    namespace: str
    engines: dict[str, Engine]
    monitor: AwakeMonitor
    urls: dict[str, str] = field(default_factory=dict)

    def lease(self) -> tuple[str, str, str]:
        """The GPU Lease: holder, holder model and state."""
        lease = client.CoordinationV1Api(self.rota.api).read_namespaced_lease(
            naming.gpu_lease_name(self.rota.node().name, "gpu-0"), NAMESPACE,
            _request_timeout=10)
        notes = lease.metadata.annotations or {}
        return (lease.spec.holder_identity or "", notes.get(naming.HOLDER_MODEL, ""),
                notes.get(naming.STATE, ""))

    def pod(self, name: str) -> client.V1Pod:
        return client.CoreV1Api(self.rota.api).read_namespaced_pod(
            name, self.namespace, _request_timeout=10)

    async def sim_state(self, session: aiohttp.ClientSession, name: str) -> dict[str, Any]:
        async with session.get(f"{self.urls[name]}/sim/state",
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            return dict(await resp.json())


@pytest.fixture(scope="module")
def stage(kube_api: client.ApiClient, rota_node: RotaOnNodes) -> Iterator[Stage]:
    namespace = f"switch-{uuid.uuid4().hex[:6]}"
    create_namespace(kube_api, namespace)
    docs = {name: gated_engine_docs(name, model=model, resident="1Gi", awake="40Gi",
                                    sleep_level=level)
            for name, (model, level) in LEVELS.items()}
    specs = {name: EngineSpec(name, model, resident="1Gi", awake="40Gi")
             for name, (model, _) in LEVELS.items()}
    try:
        with watched_engines(rota_node, namespace, docs, specs) as watched:
            yield Stage(rota_node, namespace, watched.engines, watched.monitor, watched.urls)
    finally:
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(kube_api).delete_namespace(namespace, _request_timeout=10)


def _events(stage: Stage, pod: str) -> set[str]:
    """The reasons of the Events on an engine pod."""
    found = client.CoreV1Api(stage.rota.api).list_namespaced_event(
        stage.namespace, field_selector=f"involvedObject.name={pod}", _request_timeout=10)
    return {e.reason for e in found.items}


async def _answer(session: aiohttp.ClientSession, gateway: str, model: str) -> str:
    return await eventually_async(functools.partial(ask_seven, session, gateway, model),
                                  timeout=180, max_interval=3.0,
                                  what=f"an answer from {model} through {gateway}")


async def test_handoffs_between_levels_through_both_gateway_replicas(stage: Stage) -> None:
    """Requests alternate between a level-1 and a level-2 engine through both gateway
    replicas: each is answered by its model, which then holds the GPU's Lease while the
    other sleeps at its own level; kubectl shows it (the ``gpu.rota.dev/state`` labels,
    ``SwitchedIn``/``SwitchedOut`` Events); the GPU never showed two engines awake."""
    gateways = stage.rota.gateway_urls()
    names = list(LEVELS)
    async with aiohttp.ClientSession() as session:
        for i in range(HANDOFFS):
            name, other = names[i % 2], names[(i + 1) % 2]
            model = LEVELS[name][0]
            answer = await _answer(session, gateways[i % len(gateways)], model)
            assert answer.strip() == "7"
            holder, holder_model, state = await asyncio.to_thread(stage.lease)
            assert (holder, holder_model, state) == (f"{stage.namespace}/{name}", model,
                                                    naming.STATE_AWAKE)
            asleep = await stage.sim_state(session, other)
            assert asleep["sleeping"] is True, asleep
            assert asleep["level"] == LEVELS[other][1], asleep
            assert (await stage.sim_state(session, name))["sleeping"] is False
            await asyncio.to_thread(stage.monitor.wait_next)

    def labels() -> dict[str, str] | None:
        found = {n: (stage.pod(n).metadata.labels or {}).get(LABEL_STATE, "") for n in names}
        return found if found == {names[1]: "awake", names[0]: "asleep"} else None

    eventually(labels, timeout=30, what="the engine pods' gpu.rota.dev/state labels")
    for name in names:
        reasons = eventually(lambda n=name: (r if {"SwitchedIn", "SwitchedOut"} <= (  # type: ignore[misc]
            r := _events(stage, n)) else None), timeout=30, what=f"Events on {name}")
        assert reasons is not None
    assert stage.monitor.samples > 0
    assert not stage.monitor.violations, stage.monitor.violations[:10]


def _restarts(pod: client.V1Pod) -> int:
    return sum(c.restart_count for c in pod.status.container_statuses or [])


async def test_an_engine_that_crashes_in_its_sleep_is_restarted_by_the_kubelet_and_serves(
        stage: Stage) -> None:
    """The holder is told to crash when it is put to sleep; a request for the other model
    makes the controller switch. The switch fails with the engine gone, the kubelet
    restarts its container (restart count 1), which comes back through the start gate;
    both models are answered again through the gateway, and no sample showed two engines
    awake."""
    gateway = stage.rota.gateway_url()
    async with aiohttp.ClientSession() as session:
        await _answer(session, gateway, LEVELS["lvl1"][0])
        assert (await asyncio.to_thread(stage.lease))[1] == LEVELS["lvl1"][0]
        restarts = _restarts(stage.pod("lvl1"))
        async with session.post(f"{stage.urls['lvl1']}/sim/faults",
                                json={"crash_on_sleep": True},
                                timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
        assert (await _answer(session, gateway, LEVELS["lvl2"][0])).strip() == "7"

        def restarted() -> client.V1Pod | None:
            pod = stage.pod("lvl1")
            return pod if _restarts(pod) > restarts and is_ready(pod) else None

        await asyncio.to_thread(eventually, restarted, timeout=240, max_interval=2.0,
                                what="the kubelet restarting the crashed engine's container")
        state = await stage.sim_state(session, "lvl1")
        assert not state["dead"], state
        assert (await _answer(session, gateway, LEVELS["lvl1"][0])).strip() == "7"
        assert (await _answer(session, gateway, LEVELS["lvl2"][0])).strip() == "7"
    assert not stage.monitor.violations, stage.monitor.violations[:10]

