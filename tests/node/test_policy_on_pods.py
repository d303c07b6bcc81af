"""The switch policy through real pods: a GPU's home model comes back by itself.

Two engines on the real node's GPU, started through rota's start gate: ``home`` (its claim
says ``home: true``) and ``away``. A request for ``away`` through the gateway switches the
GPU to it; then nobody asks anything, and after the node's home delay (the controller's
``--home-idle-s``) the controller wakes ``home`` again, with no request: its Lease names it,
``away`` sleeps, and the driver's inspection API never showed both awake. The policy's
rules are proven in memory (``tests/controller/test_policy*.py``); this is the same rule
driven by the real controller's idle check, its Lease writes and the kubelet's pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
from kubernetes import client

from controller.api import naming
from e2e.deploy import NAMESPACE, is_ready
from e2e.objects import create_namespace
from e2e.rota_node import RotaOnNodes, gated_engine_docs
from e2e.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven
from e2e.waiting import eventually, eventually_async
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, pytest.mark.sampled,
              needs_root]

MODELS = {"home": "org/policy-home", "away": "org/policy-away"}


def _holder(api: client.ApiClient, node: str) -> tuple[str, str]:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(
        naming.gpu_lease_name(node, "gpu-0"), NAMESPACE, _request_timeout=10)
    return (lease.spec.holder_identity or "",
            (lease.metadata.annotations or {}).get(naming.STATE, ""))


def _ready_ip(api: client.ApiClient, namespace: str, name: str) -> str | None:
    pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace, _request_timeout=10)
    return str(pod.status.pod_ip) if is_ready(pod) else None


@pytest.fixture
def two_engines(kube_api: client.ApiClient, rota_node: RotaOnNodes
                ) -> Iterator[tuple[str, AwakeMonitor]]:
    namespace = f"policy-{uuid.uuid4().hex[:6]}"
    create_namespace(kube_api, namespace)
    monitor: AwakeMonitor | None = None
    try:
        docs = {name: gated_engine_docs(name, model=model, resident="1Gi", awake="40Gi")
                for name, model in MODELS.items()}
        docs["home"][0]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["home"] = True
        engines = []
        for name, (claim, _) in docs.items():
            rota_node.deploy_engines(namespace, docs=[claim], wait=False)
            uid = client.ResourceV1Api(kube_api).read_namespaced_resource_claim(
                name, namespace, _request_timeout=10).metadata.uid
            engines.append(Engine(EngineSpec(name, MODELS[name], resident="1Gi",
                                             awake="40Gi"), namespace, claim_uid=uid))
        monitor = AwakeMonitor(rota_node.inspection_socket(), engines, interval_s=0.02)
        monitor.__enter__()
        for _, pod in docs.values():
            rota_node.deploy_engines(namespace, docs=[pod], wait=False)
        for engine in engines:
            ip = eventually(functools.partial(_ready_ip, kube_api, namespace, engine.spec.name),
                            timeout=300, max_interval=2.0, what=f"engine {engine.spec.name}")
            assert ip is not None
            engine.pod_ip = ip
        yield namespace, monitor
    finally:
        if monitor is not None:
            monitor.__exit__(None, None, None)
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(kube_api).delete_namespace(namespace, _request_timeout=10)


async def test_the_home_model_comes_back_to_an_idle_gpu_without_a_request(
        rota_node: RotaOnNodes, two_engines: tuple[str, AwakeMonitor]) -> None:
    namespace, monitor = two_engines
    node = rota_node.node().name
    async with aiohttp.ClientSession() as session:
        answer = await eventually_async(
            functools.partial(ask_seven, session, rota_node.gateway_url(), MODELS["away"]),
            timeout=180, max_interval=3.0, what="an answer from the away model")
    assert answer.strip() == "7"
    assert await asyncio.to_thread(_holder, rota_node.api, node) == (
        f"{namespace}/away", naming.STATE_AWAKE)

    def home_back() -> tuple[str, str] | None:
        found = _holder(rota_node.api, node)
        return found if found == (f"{namespace}/home", naming.STATE_AWAKE) else None

    # The home delay is the controller's --home-idle-s (60 s by default), plus one idle
    # check and a switch.
    assert await asyncio.to_thread(eventually, home_back, timeout=240, max_interval=2.0,
                                   what="the home model back on the idle GPU") is not None
    await asyncio.to_thread(monitor.wait_next)
    assert monitor.samples > 0
    assert not monitor.violations, monitor.violations[:10]
