"""Faults on a real node that need its processes: an engine that crashes and is restarted,
a vanished pod, the activation API's own input and credentials. The faults of the switch
itself (a failed switch keeps one owner, a hung wake) run on the in-memory node:
tests/controller/test_faults_in_memory.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import Engine, activate, ask_seven, set_faults
from e2e.harness.waiting import eventually_async
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
