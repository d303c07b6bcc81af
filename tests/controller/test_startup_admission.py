"""Start-up admission on the local cluster: engines that start through rota's start gate
never initialise beside an awake engine; each start is a switch into the newcomer.

- Two engines whose awake budgets do not fit the GPU together both come up and serve in
  turns; neither user-driven handoff pays an engine's first (slow) sleep.
- A "reboot" (every engine and the controller restarted at once) converges to one awake
  engine.
- A newcomer that fails to start gives the GPU back to the old holder.

The awake monitor samples the GPU from before the first engine starts to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.objects import claim, create_claim, engine_config, engine_pod
from e2e.harness.scenario import (
    AwakeMonitor,
    Engine,
    EngineSpec,
    activate,
    ask_seven,
    deploy,
    set_faults,
    sim_state,
)
from e2e.harness.waiting import eventually_async

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

FIRST_SLEEP = "--first-sleep-seconds=0.5"
# 100 Gi + 100 Gi awake > the 141 GB H200: only one may be awake (or initialise) at once.
BIG_A = EngineSpec("big-a", "org/big-a", resident="2Gi", awake="100Gi", gated=True,
                   args=(FIRST_SLEEP,))
BIG_B = EngineSpec("big-b", "org/big-b", resident="2Gi", awake="100Gi", gated=True,
                   args=(FIRST_SLEEP,))
MID_C = EngineSpec("mid-c", "org/mid-c", resident="1Gi", awake="60Gi", gated=True,
                   args=(FIRST_SLEEP,))


async def _serves(session: aiohttp.ClientSession, url: str, model: str) -> bool:
    try:
        status, body = await activate(session, url, model, timeout_s=60)
    except (aiohttp.ClientError, TimeoutError):
        return False
    return status == 200 and await ask_seven(session, body["endpoint"], model) == "7"


def _claims_first(api: client.ApiClient, namespace: str, specs: list[EngineSpec]
                  ) -> list[Engine]:
    """Create the claims only (their uids are what the monitor needs)."""
    engines = []
    for spec in specs:
        config = engine_config(model=spec.model, awake=spec.awake)
        created = create_claim(api, namespace, claim(spec.name, memory=spec.resident,
                                                     config=config))
        engines.append(Engine(spec, namespace, claim_uid=created["metadata"]["uid"]))
    return engines


def _pods(api: client.ApiClient, node: str, engines: list[Engine]) -> None:
    core = client.CoreV1Api(api)
    for engine in engines:
        core.create_namespaced_pod(engine.namespace, engine_pod(
            engine.spec.name, node=node, claim_name=engine.spec.name,
            args=list(engine.spec.args), gated=engine.spec.gated))


async def _ready(api: client.ApiClient, engines: list[Engine]) -> None:
    core = client.CoreV1Api(api)

    async def all_ready() -> bool:
        for engine in engines:
            pod = core.read_namespaced_pod(engine.spec.name, engine.namespace)
            ready = any(c.type == "Ready" and c.status == "True"
                        for c in pod.status.conditions or [])
            if not ready:
                return False
            engine.pod_ip = pod.status.pod_ip
        return True

    await eventually_async(all_ready, timeout=120, what="every engine admitted and ready")


def _first_sleeps(state: dict[str, Any]) -> list[bool]:
    return [bool(s.get("first")) for s in state["sleeps"]]


async def test_engines_that_do_not_fit_awake_together_start_and_serve_in_turns(
        engine_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    node = engine_node
    node.start_controller()
    url = node.controller_url()
    engines = _claims_first(kube_api, namespace, [BIG_A, BIG_B])
    with AwakeMonitor(node.dirs.inspect_socket, engines) as monitor:
        _pods(kube_api, node.name, engines)
        await _ready(kube_api, engines)
        async with aiohttp.ClientSession() as session:
            # A pod is Ready once its engine answers /health; its admission goes on with
            # the probe and the first sleep, so wait for that before the handoffs.
            async def every_engine_slept() -> bool:
                states = [await sim_state(session, e) for e in engines]
                return all(s["sleeps"] for s in states)

            await eventually_async(every_engine_slept, timeout=60,
                                   what="every engine's admission done (its first sleep)")
            admitted = [await sim_state(session, e) for e in engines]
            # Each engine had its first, slow sleep during its admission.
            for state in admitted:
                assert _first_sleeps(state)[:1] == [True], state["sleeps"]
            for i in range(6):
                target = (BIG_B, BIG_A)[i % 2]
                assert await _serves(session, url, target.model), f"{target.model} serves"
                await asyncio.to_thread(monitor.wait_next)
            after = [await sim_state(session, e) for e in engines]
    # No user-driven handoff paid a first sleep.
    for state in after:
        assert _first_sleeps(state)[0] is True
        assert not any(_first_sleeps(state)[1:]), state["sleeps"]
    assert monitor.violations == []


async def test_a_reboot_converges_to_one_awake_engine(
        engine_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    node = engine_node
    controller = node.start_controller()
    url = node.controller_url()
    engines = _claims_first(kube_api, namespace, [BIG_A, BIG_B, MID_C])
    with AwakeMonitor(node.dirs.inspect_socket, engines) as monitor:
        _pods(kube_api, node.name, engines)
        await _ready(kube_api, engines)
        async with aiohttp.ClientSession() as session:
            # Every engine crashes at once and the controller with them; the node agent
            # restarts the engines (through their gates) and a new controller comes up.
            assert controller.popen is not None
            controller.popen.send_signal(signal.SIGKILL)
            await asyncio.gather(*(set_faults(session, e, crash_now=True) for e in engines))
            await asyncio.to_thread(controller.popen.wait, 30)
            node.start_controller()

            async def one_awake() -> bool:
                states = []
                for engine in engines:
                    try:
                        states.append(await sim_state(session, engine))
                    except (aiohttp.ClientError, TimeoutError):
                        return False
                return sum(1 for s in states if not s["sleeping"]) == 1 and all(
                    s["sleep_count"] >= 1 for s in states)

            await eventually_async(one_awake, timeout=120,
                                   what="every engine back, one of them awake")
            for spec in (MID_C, BIG_A, BIG_B, MID_C):
                await eventually_async(lambda m=spec.model: _serves(session, url, m),  # type: ignore[misc]
                                       timeout=60, what=f"{spec.model} serving")
                await asyncio.to_thread(monitor.wait_next)
    assert monitor.violations == []


async def test_a_newcomer_that_fails_to_start_gives_the_gpu_back(
        engine_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    node = engine_node
    node.start_controller(extra=['--timeouts={"start_s": 30}'])
    url = node.controller_url()
    (a,) = deploy(kube_api, namespace, node.name, [BIG_A])
    broken = _claims_first(kube_api, namespace, [EngineSpec(
        "broken-b", "org/broken-b", resident="2Gi", awake="100Gi", gated=True,
        args=("--crash-now",))])
    async with aiohttp.ClientSession() as session:
        await eventually_async(lambda: _serves(session, url, BIG_A.model), timeout=60,
                               what="A serving")
        with AwakeMonitor(node.dirs.inspect_socket, [a, *broken]) as monitor:
            _pods(kube_api, node.name, broken)

            async def b_tried() -> bool:
                text = (node.dirs.logs / "controller-controller-0.log").read_text()
                return "start_failed" in text

            await eventually_async(b_tried, timeout=60, what="B's start failed")
            await eventually_async(lambda: _serves(session, url, BIG_A.model), timeout=60,
                                   what="A woken back and serving")
            await asyncio.to_thread(monitor.wait_next)
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(kube_api).delete_namespaced_pod("broken-b", namespace)
    assert monitor.violations == []
