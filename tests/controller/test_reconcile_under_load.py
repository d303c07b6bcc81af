"""Reconciliation is never starved by load: under a steady stream of activations that
rotate between three models (so some always wait in the GPU's queue), a fourth engine that
restarts awake beside the holder is put back to sleep, and the models serve again."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import EngineSpec, activate, ask_seven, deploy, set_faults, sim_state
from e2e.harness.waiting import eventually_async
from rota.kit.aio import wait_any

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

A = EngineSpec("engine-a", "org/model-a", resident="2Gi", awake="60Gi")
B = EngineSpec("engine-b", "org/model-b", resident="1Gi", awake="20Gi")
C = EngineSpec("engine-c", "org/model-c", resident="1Gi", awake="20Gi")
D = EngineSpec("engine-d", "org/model-d", resident="1Gi", awake="20Gi")
LOAD = (A.model, B.model, D.model)
IN_FLIGHT = 16
PACE_S = 0.005


async def test_an_engine_restarted_awake_under_load_is_put_to_sleep(
        engine_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    node = engine_node
    _, _, c, _ = deploy(kube_api, namespace, node.name, [A, B, C, D])
    node.start_controller()
    url = node.controller_url()
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        async def serves(model: str) -> bool:
            try:
                status, body = await activate(session, url, model, timeout_s=30)
            except (aiohttp.ClientError, TimeoutError):
                return False
            return status == 200 and await ask_seven(session, body["endpoint"], model) == "7"

        await eventually_async(lambda: serves(A.model), timeout=60, what="model A serving")
        await eventually_async(lambda: serves(C.model), timeout=60, what="model C serving")
        await eventually_async(lambda: serves(A.model), timeout=60, what="A again; C asleep")

        async def one(model: str) -> None:
            try:
                status, body = await activate(session, url, model, timeout_s=30)
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcomes[type(exc).__name__] += 1
                return
            if status != 200:
                outcomes[body["error"]["type"]] += 1
            else:
                outcomes["switched" if body["switched"] else "holder"] += 1

        async def load() -> None:
            """A new activation every few milliseconds, rotating, at most IN_FLIGHT at
            once: the GPU's queue is never empty."""
            in_flight: set[asyncio.Task[None]] = set()
            i = 0
            while not stop.is_set():
                if len(in_flight) < IN_FLIGHT:
                    task = asyncio.create_task(one(LOAD[i % len(LOAD)]))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    i += 1
                await wait_any(stop, timeout_s=PACE_S)
            await asyncio.gather(*in_flight)

        clients = [asyncio.create_task(load())]
        try:
            await eventually_async(lambda: _count(outcomes, "switched", 10), timeout=60,
                                   what="the load switching")
            # C restarts (a crash; the node agent starts it again) and comes up awake.
            await set_faults(session, c, crash_now=True)

            # It starts awake, as vLLM does; reconciliation may put it back to sleep
            # before a poll could see it awake, so its restart is what is awaited.
            def c_restarted() -> bool:
                pod = client.CoreV1Api(kube_api).read_namespaced_pod(c.spec.name, namespace)
                return any(s.restart_count >= 1 for s in pod.status.container_statuses or [])

            await eventually_async(lambda: asyncio.to_thread(c_restarted), timeout=60,
                                   what="C restarted")
            outcomes.clear()
            await eventually_async(lambda: _count(outcomes, "switched", 10), timeout=60,
                                   what="switches succeeding again under load")

            async def c_asleep() -> bool:
                return (await sim_state(session, c))["sleeping"] is True

            await eventually_async(c_asleep, timeout=30, what="C put back to sleep")
        finally:
            stop.set()
            await asyncio.gather(*clients)
        for model in LOAD:
            await eventually_async(lambda m=model: serves(m), timeout=30,  # type: ignore[misc]
                                   what=f"{model} serving")


async def _count(outcomes: Counter[str], key: str, at_least: int) -> bool:
    return outcomes[key] >= at_least
