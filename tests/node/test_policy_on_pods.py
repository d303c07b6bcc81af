"""The switch policy through real pods: the home model comes back by itself, a higher
priority preempts a busy holder, and keep-alive puts an idle holder to sleep.

Engines on the real node's GPU, started through rota's start gate. The policy's rules are
proven in memory (``tests/controller/test_policy*.py``); these are the same rules driven by
the real controller (its idle check, its Lease writes, its Events), the gateway and the
kubelet's pods, with the driver's inspection API sampled throughout: never two awake.

- Home: ``home`` (its claim says ``home: true``) and ``away``. A request for ``away``
  switches the GPU to it; then nobody asks anything, and after the node's home delay (the
  controller's ``--home-idle-s``) the controller wakes ``home`` again, with no request.
- Priority and keep-alive: ``low`` (priority 0) and ``high`` (priority 10, keep-alive 3 s).
  ``low`` streams a long answer; a request for ``high`` meanwhile is served by a switch the
  policy makes at once (``priority_preempt``, in both pods' Events), ``low``'s stream ends
  whole (its requests in flight finish within the drain deadline); then, with nobody
  asking, ``high`` is put to sleep after its keep-alive (``idle_sleep``) and the GPU is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.deploy import NAMESPACE, is_ready
from e2e.harness.objects import create_namespace
from e2e.harness.rota_node import RotaOnNodes, gated_engine_docs
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven, stream_chat
from e2e.harness.waiting import eventually, eventually_async
from rota.api import naming
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, pytest.mark.sampled,
              needs_root]

MODELS = {"home": "org/policy-home", "away": "org/policy-away", "low": "org/policy-low",
          "high": "org/policy-high"}


def _holder(api: client.ApiClient, node: str) -> tuple[str, str]:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(
        naming.gpu_lease_name(node, "gpu-0"), NAMESPACE, _request_timeout=10)
    return (lease.spec.holder_identity or "",
            (lease.metadata.annotations or {}).get(naming.STATE, ""))


def _ready_ip(api: client.ApiClient, namespace: str, name: str) -> str | None:
    pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace, _request_timeout=10)
    return str(pod.status.pod_ip) if is_ready(pod) else None


@contextlib.contextmanager
def _engines_on_gpu(kube_api: client.ApiClient, rota_node: RotaOnNodes,
                    engines: dict[str, dict[str, object]]
                    ) -> Iterator[tuple[str, AwakeMonitor]]:
    """Gated engines (name: EngineConfig parameters beyond the model) in a namespace of
    their own, Ready, with an awake monitor on the GPU."""
    namespace = f"policy-{uuid.uuid4().hex[:6]}"
    create_namespace(kube_api, namespace)
    monitor: AwakeMonitor | None = None
    try:
        docs = {name: gated_engine_docs(name, model=MODELS[name], resident="1Gi",
                                        awake="40Gi") for name in engines}
        for name, parameters in engines.items():
            docs[name][0]["spec"]["devices"]["config"][0]["opaque"]["parameters"].update(
                parameters)
        specs = []
        for name, (claim, _) in docs.items():
            rota_node.deploy_engines(namespace, docs=[claim], wait=False)
            uid = client.ResourceV1Api(kube_api).read_namespaced_resource_claim(
                name, namespace, _request_timeout=10).metadata.uid
            specs.append(Engine(EngineSpec(name, MODELS[name], resident="1Gi",
                                           awake="40Gi"), namespace, claim_uid=uid))
        monitor = AwakeMonitor(rota_node.inspection_socket(), specs, interval_s=0.02)
        monitor.__enter__()
        for _, pod in docs.values():
            rota_node.deploy_engines(namespace, docs=[pod], wait=False)
        for engine in specs:
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


@pytest.fixture
def two_engines(kube_api: client.ApiClient, rota_node: RotaOnNodes
                ) -> Iterator[tuple[str, AwakeMonitor]]:
    with _engines_on_gpu(kube_api, rota_node, {"home": {"home": True}, "away": {}}) as found:
        yield found


@pytest.fixture
def ranked_engines(kube_api: client.ApiClient, rota_node: RotaOnNodes
                   ) -> Iterator[tuple[str, AwakeMonitor]]:
    with _engines_on_gpu(kube_api, rota_node, {
            "low": {"priority": 0},
            "high": {"priority": 10, "keepAliveSeconds": 3}}) as found:
        yield found


def _notes(api: client.ApiClient, namespace: str, pod: str) -> list[str]:
    """``<reason>: <note>`` of each Event about ``pod`` (read as JSON: the client's models
    refuse the kubelet's own Events, which have no eventTime)."""
    resp = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod}", _request_timeout=10,
        _preload_content=False)
    return [f"{e.get('reason')}: {e.get('message')}"
            for e in json.loads(resp.data).get("items") or []]


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


async def test_a_higher_priority_preempts_a_busy_holder_and_keep_alive_ends(
        rota_node: RotaOnNodes, ranked_engines: tuple[str, AwakeMonitor]) -> None:
    namespace, monitor = ranked_engines
    node = rota_node.node().name
    url = rota_node.gateway_url()
    async with aiohttp.ClientSession() as session:
        await eventually_async(functools.partial(ask_seven, session, url, MODELS["low"]),
                               timeout=180, max_interval=3.0, what="an answer from low")
        # A long answer of low's (about 5 s at the simulator's 120 tokens/s) ...
        long = asyncio.create_task(stream_chat(session, url, MODELS["low"], max_tokens=600,
                                               ignore_eos=True, timeout_s=120))
        await eventually_async(
            functools.partial(_streaming, session, url, MODELS["low"]), timeout=30,
            what="low's long answer under way")
        # ... and high, asked meanwhile, is served by a switch made at once.
        high = await stream_chat(session, url, MODELS["high"], timeout_s=120)
        low = await long
    assert high.content.strip() == "7"
    assert len(low.content) >= 600, "low's answer in flight finished whole"
    await _noted(rota_node.api, namespace, "high", "SwitchedIn", "priority_preempt")
    await _noted(rota_node.api, namespace, "low", "SwitchedOut", "priority_preempt")

    def idle() -> tuple[str, str] | None:
        found = _holder(rota_node.api, node)
        return found if found == ("", naming.STATE_IDLE) else None

    # Nobody asks: high sleeps after its 3 s keep-alive (one idle check later).
    assert await asyncio.to_thread(eventually, idle, timeout=60, max_interval=1.0,
                                   what="the GPU idle after high's keep-alive") is not None
    await _noted(rota_node.api, namespace, "high", "SwitchedOut", "idle_sleep")
    await asyncio.to_thread(monitor.wait_next)
    assert monitor.samples > 0
    assert not monitor.violations, monitor.violations[:10]


async def _noted(api: client.ApiClient, namespace: str, pod: str, reason: str,
                 rule: str) -> None:
    """Wait (bounded) for an Event of ``reason`` about ``pod`` that names the policy's
    ``rule``: the controller writes its Events a moment after the switch."""
    def found() -> bool:
        return any(n.startswith(f"{reason}: ") and f"(policy: {rule})" in n
                   for n in _notes(api, namespace, pod))

    try:
        await asyncio.to_thread(eventually, found, timeout=30, max_interval=1.0,
                                what=f"a {reason} Event of {pod} naming {rule}")
    except Exception as exc:
        notes = "\n".join(await asyncio.to_thread(_notes, api, namespace, pod))
        raise AssertionError(f"{exc}; the Events of {pod}:\n{notes}") from None


async def _streaming(session: aiohttp.ClientSession, url: str, model: str) -> bool:
    """The gateway counts a request of ``model`` in flight to its engine."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        text = await resp.text()
    prefix = f'rota_gateway_requests_in_flight{{model_name="{model}"}} '
    return any(line.startswith(prefix) and float(line[len(prefix):]) >= 1
               for line in text.splitlines())
