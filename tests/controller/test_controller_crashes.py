"""The controller killed (SIGKILL) at random moments of switches, and two controller
instances for one node at once: never two engines awake, and every activation is either
completed or answered with an error."""

from __future__ import annotations

import asyncio
import functools
import random
import signal

import aiohttp
import pytest

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import AwakeMonitor, Engine, activate, ask_seven
from e2e.harness.waiting import eventually_async
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.controller, pytest.mark.slow]

KILLS = 30
"""Each kill lands during a switch: a restarted controller first waits out its own
controller Lease and serves again (seconds), so the count is kept modest."""


async def _serves(session: aiohttp.ClientSession, url: str, model: str) -> bool:
    try:
        status, body = await activate(session, url, model, timeout_s=30)
    except (aiohttp.ClientError, TimeoutError):
        return False
    return status == 200 and await ask_seven(session, body["endpoint"], model) == "7"


async def _answers(session: aiohttp.ClientSession, url: str, model: str) -> int | None:
    """The activation API's status for `model`, or None while nothing listens at `url`."""
    try:
        status, _ = await activate(session, url, model, timeout_s=30)
    except (aiohttp.ClientError, TimeoutError):
        return None
    return status


@pytest.mark.sampled
async def test_sigkill_during_switches(engine_node: GpuNode, two_engines: list[Engine]) -> None:
    rng = random.Random(1129)
    node = engine_node
    controller = node.start_controller()
    url = node.controller_url()
    outcomes = {"completed": 0, "error": 0}
    async with aiohttp.ClientSession() as session:
        await eventually_async(lambda: _serves(session, url, MODEL_A.model), timeout=60,
                               what="controller serving")
        with AwakeMonitor(node.dirs.inspect_socket, two_engines) as monitor:
            for kill in range(KILLS):
                target = (MODEL_B, MODEL_A)[kill % 2].model
                request = asyncio.create_task(activate(session, url, target, timeout_s=30))
                await asyncio.sleep(rng.uniform(0.0, 0.15))  # the random moment of the kill
                assert controller.popen is not None
                controller.popen.send_signal(signal.SIGKILL)
                await asyncio.to_thread(controller.popen.wait, 10)
                try:
                    status, _ = await request
                    outcomes["completed" if status == 200 else "error"] += 1
                except (aiohttp.ClientError, TimeoutError):
                    outcomes["error"] += 1
                controller = node.start_controller()
                await asyncio.to_thread(monitor.wait_next)
                # The next kill must land in a switch, not in this controller's start: wait
                # until it leads and serves the model just asked for; the next iteration
                # asks for the other one.
                await eventually_async(functools.partial(_serves, session, url, target),
                                       timeout=60, what=f"{target} serving after kill {kill}")
            for model in (MODEL_B.model, MODEL_A.model):
                await eventually_async(functools.partial(_serves, session, url, model),
                                       timeout=60, what=f"{model} serving after the kills")
    assert sum(outcomes.values()) == KILLS
    assert outcomes["completed"] > 0, outcomes
    assert monitor.samples >= KILLS
    assert monitor.violations == []


async def test_two_controllers_for_one_node(engine_node: GpuNode,
                                            two_engines: list[Engine]) -> None:
    node = engine_node
    first = node.start_controller(identity="c1")
    node.start_controller(identity="c2")
    urls = [node.controller_url("c1"), node.controller_url("c2")]
    async with aiohttp.ClientSession() as session:
        async def someone_serves() -> bool:
            results = await asyncio.gather(*(_serves(session, u, MODEL_A.model) for u in urls))
            return any(results)

        async def both_answer() -> bool:
            # The second instance listens only after its start-up (imports, its first API
            # call); on a loaded machine the first may serve well before it.
            statuses = await asyncio.gather(*(_answers(session, u, MODEL_A.model) for u in urls))
            return sorted(s or 0 for s in statuses) == [200, 409]

        await eventually_async(someone_serves, timeout=60, what="one controller serving")
        await eventually_async(both_answer, timeout=60, what="the standby answering")
        with AwakeMonitor(node.dirs.inspect_socket, two_engines) as monitor:
            statuses: list[int] = []
            for i in range(10):
                model = (MODEL_B, MODEL_A)[i % 2].model
                answers = await asyncio.gather(*(activate(session, u, model) for u in urls))
                statuses += [s for s, _ in answers]
                assert sorted(s for s, _ in answers) == [200, 409], answers
                assert any(b.get("error", {}).get("type") == "not_leader" for _, b in answers)
            # The leader dies; the other takes over once its lease expires, reconciles,
            # and serves.
            answers = [await activate(session, u, MODEL_A.model) for u in urls]
            leader = next(i for i, (status, _) in enumerate(answers) if status == 200)
            victim, survivor = (first, urls[1]) if leader == 0 else (
                node.controllers["c2"][0], urls[0])
            assert victim.popen is not None
            victim.popen.send_signal(signal.SIGKILL)
            await eventually_async(lambda: _serves(session, survivor, MODEL_B.model),
                                   timeout=60, what="the standby took over")
    assert monitor.violations == []
