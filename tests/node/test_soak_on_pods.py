"""rota's control plane replaced under load, on the real node (the DaemonSet's lease
controller, the gateway Deployment, engine pods on the real kubelet).

- :func:`test_rollouts_and_a_restart_under_load_lose_no_request`: the soak of
  :mod:`e2e.campaigns.soak`, short: clients of three models through the gateway replicas while the
  controller DaemonSet is rolled, the gateway Deployment is rolled and the controller pod
  is deleted; every request answered, every answer well formed, never two engines awake.
- :func:`test_sigterm_during_a_slow_wake_lets_the_switch_finish`: the controller pod is
  deleted while it wakes an engine whose wake takes seconds: the pod's controller finishes
  that switch (the Lease names it as the one that made the target serve), the waiting
  client gets its answer, and the engine was woken once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from e2e.campaigns.soak import DISRUPTIONS, MODELS, SoakStage, soak, soak_stage
from e2e.harness.deploy import NAMESPACE, is_ready
from e2e.harness.rota_node import RotaOnNodes
from e2e.harness.scenario import stream_chat
from e2e.harness.waiting import eventually, eventually_async
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, pytest.mark.sampled,
              needs_root]

SLOW_WAKE_S = 8.0
"""The wake of ``soak-c``: long enough to delete the controller in the middle of it."""


@pytest.fixture(scope="module")
def stage(rota_node: RotaOnNodes) -> Iterator[SoakStage]:
    with soak_stage(rota_node, args={"soak-c": ("--wake-level1-seconds",
                                                str(SLOW_WAKE_S))}) as found:
        yield found


async def test_rollouts_and_a_restart_under_load_lose_no_request(stage: SoakStage) -> None:
    report = await soak(stage, seconds=20, clients=6, disrupt_every_s=8)
    lines = "\n".join(report.lines())
    print(lines)  # the soak's figures, shown when a check fails
    assert [w.name for w in report.windows] == list(DISRUPTIONS)
    assert all(w.ended for w in report.windows), lines
    assert report.malformed == [], lines
    assert report.failed == [], lines
    assert report.samples > 0
    assert report.violations == [], report.violations[:10]
    served = {o.model for o in report.outcomes}
    assert served == set(MODELS.values()), lines
    for window in report.windows:
        assert report.during(window), f"no request crossed {window.name}: {lines}"


def _lease(rota: RotaOnNodes) -> GpuLease:
    obj = client.CoordinationV1Api(rota.api).read_namespaced_lease(
        naming.gpu_lease_name(rota.node().name, "gpu-0"), NAMESPACE, _request_timeout=10)
    return GpuLease.from_object(rota.api.sanitize_for_serialization(obj))


async def _state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/sim/state", timeout=aiohttp.ClientTimeout(total=10)
                           ) as resp:
        resp.raise_for_status()
        return dict(await resp.json())


async def test_sigterm_during_a_slow_wake_lets_the_switch_finish(stage: SoakStage) -> None:
    rota = stage.rota
    gateway = rota.gateway_url()
    slow, quick = MODELS["soak-c"], MODELS["soak-a"]
    async with aiohttp.ClientSession() as session:
        first = await eventually_async(lambda: stream_chat(session, gateway, quick,
                                                           timeout_s=120),
                                       timeout=180, what=f"an answer from {quick}")
        assert first.content
        before = await _state(session, stage.urls["soak-c"])
        assert before["sleeping"], before
        asking = asyncio.create_task(stream_chat(session, gateway, slow, timeout_s=240))

        async def waking() -> dict[str, Any] | None:
            state = await _state(session, stage.urls["soak-c"])
            woke = state["memory_bytes"] > 2 * state["resident_memory_bytes"]
            return state if woke and state["wake_count"] == before["wake_count"] else None

        await eventually_async(waking, timeout=120, interval=0.05, what=f"{slow} waking")
        controller = rota.controller_pod()
        stopped_at = time.monotonic()
        client.CoreV1Api(rota.api).delete_namespaced_pod(
            controller.metadata.name, controller.metadata.namespace, _request_timeout=10)
        answer = await asyncio.wait_for(asking, 240)
        assert answer.content, "the waiting client got no answer"
        after = await _state(session, stage.urls["soak-c"])
    assert after["wake_count"] == before["wake_count"] + 1, after
    assert not after["sleeping"]
    lease = await asyncio.to_thread(_lease, rota)
    assert (lease.holder_model, lease.state) == (slow, naming.LeaseState.AWAKE), lease
    assert lease.controller == controller.metadata.name, (
        f"the switch was finished by {lease.controller}, not by the stopping controller "
        f"{controller.metadata.name}")
    # It finished the switch, then stopped: the DaemonSet's new pod takes the node over.
    replaced = eventually(lambda: next(
        (p for p in rota.deployment.controller_pods(rota.node().name)
         if p.metadata.uid != controller.metadata.uid and is_ready(p)), None),
        timeout=300, max_interval=1.0, what="a new controller pod Ready")
    assert replaced is not None
    assert time.monotonic() - stopped_at < 420, "the old pod outlived its grace period"
    assert stage.monitor.violations == [], stage.monitor.violations[:10]
