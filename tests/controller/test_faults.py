"""Faults injected into the simulated engines during switches: the switch fails with a
distinct reason, one engine at most is ever awake, and the node returns to serving."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from kubernetes import client

from e2e.harness import GpuNode
from e2e.scenario import AwakeMonitor, Engine, activate, ask_seven, set_faults, sim_state
from e2e.waiting import eventually_async
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

SHORT = '--timeouts={"wake_s": 3, "sleep_s": 5, "probe_s": 5, "drain_s": 2}'


@pytest.fixture
async def serving(engine_node: GpuNode, two_engines: list[Engine]
                  ) -> AsyncIterator[tuple[GpuNode, list[Engine], aiohttp.ClientSession]]:
    """A controller serving model A, with short step timeouts."""
    engine_node.start_controller(extra=[SHORT])
    async with aiohttp.ClientSession() as session:
        url = engine_node.controller_url()

        async def a_serves() -> bool:
            status, _ = await activate(session, url, MODEL_A.model)
            return status == 200

        await eventually_async(a_serves, timeout=60, what="model A serving")
        yield engine_node, two_engines, session


async def _recovers(session: aiohttp.ClientSession, url: str) -> None:
    """After a clean-up of faults the node serves both models again."""
    for spec in (MODEL_B, MODEL_A):
        async def serves(model: str = spec.model) -> bool:
            status, body = await activate(session, url, model)
            return status == 200 and await ask_seven(session, body["endpoint"], model) == "7"

        await eventually_async(serves, timeout=60, what=f"{spec.model} serving again")


@pytest.mark.parametrize(("engine", "fault", "reason"), [
    ("b", "wake_fails", "gpu_oom"),
    ("a", "sleep_lies", "memory_not_returned"),
    ("a", "sleep_ignored", "lied"),
    ("b", "wake_ignored", "lied"),
])
async def test_a_failed_switch_keeps_one_owner_and_says_why(
        serving: tuple[GpuNode, list[Engine], aiohttp.ClientSession], engine: str,
        fault: str, reason: str) -> None:
    node, (a, b), session = serving
    url = node.controller_url()
    await set_faults(session, a if engine == "a" else b, **{fault: True})
    with AwakeMonitor(node.dirs.inspect_socket, [a, b]) as monitor:
        status, body = await activate(session, url, MODEL_B.model)
        assert status == 503, body
        assert body["error"]["type"] == reason, body
        # The old holder serves again; the target is asleep.
        status, back = await activate(session, url, MODEL_A.model)
        assert status == 200, back
        assert back["switched"] is False
        assert await ask_seven(session, a.url, MODEL_A.model) == "7"
        assert (await sim_state(session, b))["sleeping"] is True
    assert monitor.violations == []
    await set_faults(session, a if engine == "a" else b, **{fault: False})
    await _recovers(session, url)


async def test_a_hung_wake_keeps_every_other_engine_asleep_until_it_lands(
        serving: tuple[GpuNode, list[Engine], aiohttp.ClientSession]) -> None:
    node, (a, b), session = serving
    url = node.controller_url()
    await set_faults(session, b, wake_hangs=True)
    with AwakeMonitor(node.dirs.inspect_socket, [a, b]) as monitor:
        status, body = await activate(session, url, MODEL_B.model)
        assert status == 503, body
        # A wake without an answer may still complete: its outcome is unknown.
        assert body["error"]["type"] == "state_unknown", body
        # B's wake may still land (an engine does not stop a wake whose caller left):
        # waking A now could leave two engines awake.
        status, body = await activate(session, url, MODEL_A.model)
        assert status == 503, body
        assert body["error"]["type"] == "state_unknown", body
        assert (await sim_state(session, a))["sleeping"] is True
        await set_faults(session, b, wake_hangs=False)
        await _recovers(session, url)
    assert monitor.violations == []


async def test_an_engine_that_crashes_on_sleep_is_restarted_and_serves_again(
        serving: tuple[GpuNode, list[Engine], aiohttp.ClientSession]) -> None:
    node, (a, _), session = serving
    url = node.controller_url()
    await set_faults(session, a, crash_on_sleep=True)
    status, body = await activate(session, url, MODEL_B.model)
    assert status == 503
    assert body["error"]["type"] == "unreachable", body
    # The node agent restarts the crashed engine (it comes back awake, without the
    # fault); reconciliation sorts out who is awake, and both models serve again.
    await _recovers(session, url)


async def test_a_vanished_pod_is_a_clear_error(
        serving: tuple[GpuNode, list[Engine], aiohttp.ClientSession],
        kube_api: client.ApiClient) -> None:
    node, (_, b), session = serving
    client.CoreV1Api(kube_api).delete_namespaced_pod(b.spec.name, b.namespace)

    async def gone() -> bool:
        status, body = await activate(session, node.controller_url(), MODEL_B.model)
        return status == 404 and body["error"]["type"] == "unknown_model"

    await eventually_async(gone, timeout=60, what="activation of a deleted engine refused")
    status, body = await activate(session, node.controller_url(), MODEL_A.model)
    assert status == 200, body


async def test_the_activation_api_refuses_garbage(
        serving: tuple[GpuNode, list[Engine], aiohttp.ClientSession]) -> None:
    node, _, session = serving
    url = node.controller_url()
    for payload in (b"{not json", b'{"model": ""}', b'{"model": "x", "extra": 1}', b"[]"):
        async with session.post(f"{url}/v1/activate", data=payload) as resp:
            assert resp.status == 400, await resp.text()
            assert (await resp.json())["error"]["type"] == "invalid_request"
    status, body = await activate(session, url, "no/such-model")
    assert status == 404
    assert body["error"]["type"] == "unknown_model"


async def test_the_activation_token_rotates_without_a_restart(
        engine_node: GpuNode, two_engines: list[Engine]) -> None:
    token = engine_node.dirs.root / "token"
    token.write_text("old-token\n")
    engine_node.start_controller(extra=[f"--token-file={token}", "--token-reload-s=0.2"])
    url = engine_node.controller_url()
    async with aiohttp.ClientSession() as session:
        async def serves(secret: str) -> bool:
            status, _ = await activate(session, url, MODEL_A.model, token=secret)
            return status == 200

        await eventually_async(lambda: serves("old-token"), timeout=60, what="old token works")
        status, body = await activate(session, url, MODEL_A.model)
        assert status == 401, body
        # During a rotation both tokens are in the Secret, then only the new one.
        token.write_text("old-token\nnew-token\n")
        await eventually_async(lambda: serves("new-token"), timeout=30, what="new token works")
        token.write_text("new-token\n")

        async def old_refused() -> bool:
            status, _ = await activate(session, url, MODEL_A.model, token="old-token")
            return status == 401

        await eventually_async(old_refused, timeout=30, what="old token refused")
