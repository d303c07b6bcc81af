"""Stopping and restarting the lease controller mid-switch, on the local cluster.

- SIGTERM during a switch: no new work, every waiter answered, the switch in flight
  finishes within the grace period, and the controller Lease is released only then.
- SIGTERM during a wake that hangs, then a second instance with the same identity: the
  new instance does not take over at once, treats the engines of the unfinished switch as
  possibly awake, and never wakes another engine beside one whose wake may still land.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import (
    AwakeMonitor,
    EngineSpec,
    activate,
    ask_seven,
    deploy,
    set_faults,
    sim_state,
)
from e2e.harness.waiting import eventually_async
from rota.api import naming

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

A = EngineSpec("engine-a", "org/model-a", resident="2Gi", awake="60Gi")
SLOW_B = EngineSpec("engine-b", "org/model-b", resident="1Gi", awake="20Gi",
                    args=("--wake-level1-seconds=3",))


async def _serves(session: aiohttp.ClientSession, url: str, model: str) -> bool:
    try:
        status, body = await activate(session, url, model, timeout_s=30)
    except (aiohttp.ClientError, TimeoutError):
        return False
    return status == 200 and await ask_seven(session, body["endpoint"], model) == "7"


async def _answer(session: aiohttp.ClientSession, url: str, model: str
                  ) -> tuple[int, dict[str, Any]] | str:
    """The activation's answer, or the name of the error that took its place."""
    try:
        return await activate(session, url, model, timeout_s=60)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__


def _controller_holder(api: client.ApiClient, node: str) -> str:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(
        naming.controller_lease_name(node), "rota-system")
    return str(lease.spec.holder_identity or "")


async def test_sigterm_lets_the_switch_finish_and_answers_every_waiter(
        engine_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    node = engine_node
    a, _ = deploy(kube_api, namespace, node.name, [A, SLOW_B])
    controller = node.start_controller(extra=["--shutdown-grace-s=20"])
    url = node.controller_url()
    async with aiohttp.ClientSession() as session:
        await eventually_async(lambda: _serves(session, url, A.model), timeout=60,
                               what="model A serving")
        switch = asyncio.create_task(_answer(session, url, SLOW_B.model))

        async def under_way() -> bool:  # A slept; B's three-second wake runs
            return (await sim_state(session, a))["sleeping"] is True

        await eventually_async(under_way, timeout=30, what="the switch to B under way")
        waiters = [asyncio.create_task(_answer(session, url, A.model)) for _ in range(4)]
        await asyncio.sleep(0)  # the requests leave before the signal
        assert controller.popen is not None
        controller.popen.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(switch, *waiters)
        code = await asyncio.to_thread(controller.popen.wait, 60)
    first, rest = answers[0], answers[1:]
    assert isinstance(first, tuple), f"the switch in flight got no answer: {first}"
    assert first[0] == 200, first
    for answer in rest:
        assert isinstance(answer, tuple), f"a waiter got no answer: {answer}"
        assert answer[0] in (200, 409, 503), answer
    assert code == 0
    assert _controller_holder(kube_api, node.name) == "", "released after the switch"


async def test_sigterm_in_a_hung_wake_and_a_restart_with_the_same_identity(
        engine_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    node = engine_node
    a, b = deploy(kube_api, namespace, node.name, [A, SLOW_B])
    short = ['--timeouts={"wake_s": 60, "sleep_s": 2, "probe_s": 5, "drain_s": 2}',
             "--shutdown-grace-s=1"]
    controller = node.start_controller(extra=short)
    url = node.controller_url()
    async with aiohttp.ClientSession() as session:
        await eventually_async(lambda: _serves(session, url, A.model), timeout=60,
                               what="model A serving")
        with AwakeMonitor(node.dirs.inspect_socket, [a, b]) as monitor:
            await set_faults(session, b, wake_hangs=True)
            hung = asyncio.create_task(_answer(session, url, SLOW_B.model))

            async def hanging() -> bool:
                return bool((await sim_state(session, b))["wake_hanging"])

            await eventually_async(hanging, timeout=30, what="B's wake hanging")
            assert controller.popen is not None
            controller.popen.send_signal(signal.SIGTERM)
            await hung
            await asyncio.to_thread(controller.popen.wait, 120)
            # The same identity again (a container restart keeps the pod name).
            node.start_controller(extra=short)
            # Whatever it answers, it must not wake A while B's wake may still land.
            await eventually_async(lambda: _leads(session, url), timeout=60,
                                   what="the restarted instance leading")
            await _answer(session, url, A.model)
            await set_faults(session, b, wake_hangs=False)

            async def b_settled() -> bool:
                state = await sim_state(session, b)
                return not state["wake_hanging"] and bool(state["wakes"])

            await eventually_async(b_settled, timeout=60, what="B's wake landed")
            await asyncio.to_thread(monitor.wait_next)
            for model in (A.model, SLOW_B.model, A.model):
                await eventually_async(lambda m=model: _serves(session, url, m),  # type: ignore[misc]
                                       timeout=90, what=f"{model} serving again")
    assert monitor.violations == []


async def _leads(session: aiohttp.ClientSession, url: str) -> bool:
    answer = await _answer(session, url, "no/such-model")
    return isinstance(answer, tuple) and answer[0] == 404
