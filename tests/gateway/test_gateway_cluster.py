"""The gateway on the local cluster, with the real lease controller, driver, node agent
and two simulated engines: requests for either model are answered, switches happen
behind them, and engines' control paths stay out of reach."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import AwakeMonitor, Engine, deploy
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.gateway]

PACED = ("--tokens-per-second", "400")


@pytest.fixture
def two_engines(engine_node: GpuNode, kube_api: client.ApiClient, namespace: str
                ) -> list[Engine]:
    """Engines A and B that emit tokens over time, so streams arrive in pieces."""
    return deploy(kube_api, namespace, engine_node.name,
                  [dataclasses.replace(MODEL_A, args=PACED),
                   dataclasses.replace(MODEL_B, args=PACED)])

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def _bound(namespace: str) -> list[str]:
    """The model binding: the test's namespace serves its models."""
    return [f"--serving-namespaces={namespace}"]


def _token(node: GpuNode) -> Path:
    path = node.dirs.root / "activation-token"
    path.write_text("s3cret-activation-token\n")
    return path


async def _chat(session: aiohttp.ClientSession, url: str, model: str, *, stream: bool
                ) -> tuple[str, int]:
    """The answer's content and the number of network reads it arrived in."""
    body: dict[str, object] = {"model": model, "messages": QUESTION, "max_tokens": 8,
                               "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=120)) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            data = await resp.json()
            return str(data["choices"][0]["message"]["content"]), 1
        reads, text = 0, b""
        async for chunk in resp.content.iter_any():
            reads += 1
            text += chunk
    content = []
    for line in text.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices") or []:
                content.append(choice["delta"].get("content") or "")
    assert text.decode().rstrip().endswith("data: [DONE]")
    return "".join(content), reads


async def _switches(session: aiohttp.ClientSession, controller: str) -> float:
    async with session.get(f"{controller}/metrics") as resp:
        text = await resp.text()
    match = re.search(r'^rota_controller_switches_total\{outcome="ok"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_alternating_models_through_the_gateway(engine_node: GpuNode,
                                                      two_engines: list[Engine],
                                                      namespace: str) -> None:
    token = _token(engine_node)
    engine_node.start_controller(extra=[f"--token-file={token}"])
    url = engine_node.start_gateway(token_file=token, extra=_bound(namespace))
    controller = engine_node.controller_url()
    async with aiohttp.ClientSession() as session:
        for i in range(6):
            model = (MODEL_A, MODEL_B)[i % 2].model
            content, reads = await _chat(session, url, model, stream=True)
            assert content.startswith("7"), content
            assert reads > 1, "a streamed answer arrived in one piece"
            content, _ = await _chat(session, url, model, stream=False)
            assert content.startswith("7")
        assert await _switches(session, controller) >= 5
        # Engines' control paths are not reachable through the gateway.
        for path in ("/sleep?level=1", "/wake_up", "/collective_rpc", "/is_sleeping",
                     "/reset_prefix_cache", "/v1/omni/sleep"):
            async with session.post(f"{url}{path}", json={}) as resp:
                assert resp.status in (404, 405), (path, resp.status)
        async with session.post(f"{url}/v1/chat/completions", data=b"{oops") as resp:
            assert resp.status == 400


async def test_a_burst_over_two_models_is_coalesced(engine_node: GpuNode,
                                                    two_engines: list[Engine],
                                                    namespace: str) -> None:
    token = _token(engine_node)
    engine_node.start_controller(extra=[f"--token-file={token}", "--min-residency-s=1"])
    url = engine_node.start_gateway(token_file=token, extra=_bound(namespace))
    controller = engine_node.controller_url()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=128)) as session:
        assert (await _chat(session, url, MODEL_A.model, stream=False))[0].startswith("7")
        before = await _switches(session, controller)
        with AwakeMonitor(engine_node.dirs.inspect_socket, two_engines) as monitor:
            models = [(MODEL_A, MODEL_B)[i % 2].model for i in range(64)]
            answers = await asyncio.gather(*(_chat(session, url, m, stream=i % 3 == 0)
                                             for i, m in enumerate(models)))
        switches = await _switches(session, controller) - before
    assert all(content.startswith("7") for content, _ in answers)
    assert 1 <= switches <= 8, f"{switches} switches for 64 requests"
    assert monitor.violations == []


async def test_two_gateway_replicas_activate_different_models_at_once(
        engine_node: GpuNode, two_engines: list[Engine], namespace: str) -> None:
    token = _token(engine_node)
    engine_node.start_controller(extra=[f"--token-file={token}"])
    first = engine_node.start_gateway("gateway-0", token_file=token, extra=_bound(namespace))
    second = engine_node.start_gateway("gateway-1", token_file=token, extra=_bound(namespace))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        with AwakeMonitor(engine_node.dirs.inspect_socket, two_engines) as monitor:
            for _ in range(3):
                answers = await asyncio.gather(
                    *(_chat(session, first, MODEL_A.model, stream=True) for _ in range(4)),
                    *(_chat(session, second, MODEL_B.model, stream=True) for _ in range(4)))
                assert all(content.startswith("7") for content, _ in answers)
    assert monitor.violations == []
