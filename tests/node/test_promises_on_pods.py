"""rota's central promises, proven with every part a real pod on the real node: the driver
and the lease controller of the DaemonSet, the gateway Deployment, and engines running the
engine simulator behind rota's start gate (``rota-engine-gate``).

One stage serves the three tests (a module fixture): in a namespace the admin binds to
model ``org/pods-a``, two engines whose awake budgets (80 GiB each) do not fit the fake H200
together, serving ``org/pods-a`` and ``org/pods-b``; in a second namespace, a twin engine
serving the same name ``org/pods-a``. The gateway's model binding (its ConfigMap, re-read
by every replica) binds ``org/pods-a`` to the first namespace only. The driver's inspection
API is sampled from before the first engine starts to the end of the module: no sample may
show two of these engines holding more than their resident memory.

- :func:`test_a_model_is_served_only_from_the_namespace_bound_to_it`
- :func:`test_engines_that_do_not_fit_awake_together_start_and_serve_in_turns`
- :func:`test_killing_the_controller_pod_mid_switch_leaves_no_request_unanswered`
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes import client

from controller.lease.device import DeviceReader
from e2e.chaos.load import Record, client_loop
from e2e.chaos.tally import Answer
from e2e.harness.deploy import MODEL_BINDING, NAMESPACE, is_ready
from e2e.harness.objects import create_namespace
from e2e.harness.rota_node import RotaOnNodes, gated_engine_docs
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven
from e2e.harness.waiting import eventually, eventually_async
from rota.api import naming
from rota.api.quantity import parse_quantity
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, needs_root]

MODEL_A, MODEL_B = "org/pods-a", "org/pods-b"
BIG_AWAKE = "80Gi"
"""Two of these awake do not fit the fake H200 (140.4 GiB)."""
BINDING_FILE = "binding.yaml"
KILLS = 3


@dataclass
class Stage:
    """The engines of the module and what reaches them."""

    rota: RotaOnNodes
    bound: str
    """The namespace bound to ``org/pods-a`` (and serving ``org/pods-b`` as any)."""
    other: str
    """The namespace whose twin also serves ``org/pods-a``; never bound to it."""
    engines: dict[str, Engine]
    """``big-a``, ``big-b`` (bound namespace) and ``twin`` (other namespace)."""
    urls: dict[str, str] = field(default_factory=dict)
    """Host URL of each engine's port 8000 (relayed to its pod address)."""
    monitor: AwakeMonitor | None = None

    @property
    def api(self) -> client.ApiClient:
        return self.rota.api

    def awake_monitor(self) -> AwakeMonitor:
        assert self.monitor is not None
        return self.monitor

    def holder(self) -> tuple[str, str, str]:
        """The GPU Lease: holder, holder model and state."""
        lease = client.CoordinationV1Api(self.api).read_namespaced_lease(
            _gpu_lease(self.rota), NAMESPACE, _request_timeout=10)
        notes = lease.metadata.annotations or {}
        return (lease.spec.holder_identity or "", notes.get(naming.HOLDER_MODEL, ""),
                notes.get(naming.STATE, ""))

    async def sim_state(self, session: aiohttp.ClientSession, name: str) -> dict[str, Any]:
        async with session.get(f"{self.urls[name]}/sim/state",
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            return dict(await resp.json())


def _gpu_lease(rota: RotaOnNodes) -> str:
    return naming.gpu_lease_name(rota.node().name, "gpu-0")


def _binding(api: client.ApiClient) -> dict[str, Any]:
    cm = client.CoreV1Api(api).read_namespaced_config_map(MODEL_BINDING, NAMESPACE,
                                                          _request_timeout=10)
    return dict(yaml.safe_load(cm.data[BINDING_FILE]) or {})


def _set_binding(api: client.ApiClient, binding: dict[str, Any]) -> None:
    client.CoreV1Api(api).patch_namespaced_config_map(
        MODEL_BINDING, NAMESPACE, {"data": {BINDING_FILE: yaml.safe_dump(binding)}},
        _request_timeout=10)


def _loaded_binding(rota: RotaOnNodes, bound: str) -> bool:
    """Every Ready gateway replica logged that it loaded a binding of ``org/pods-a`` to
    ``bound`` (the kubelet refreshes the ConfigMap's file, the gateway re-reads it)."""
    pods = [p for p in rota.deployment.gateway_pods() if is_ready(p)]
    return bool(pods) and all(
        any("model binding loaded" in line and MODEL_A in line and bound in line
            for line in rota.logs(pod, "gateway").splitlines())
        for pod in pods)


def _ready_pod(core: client.CoreV1Api, engine: Engine) -> client.V1Pod | None:
    pod = core.read_namespaced_pod(engine.spec.name, engine.namespace, _request_timeout=10)
    return pod if is_ready(pod) else None


@pytest.fixture(scope="module")
def stage(kube_api: client.ApiClient, rota_node: RotaOnNodes) -> Iterator[Stage]:
    suffix = uuid.uuid4().hex[:6]
    bound, other = f"pods-{suffix}", f"pods-x-{suffix}"
    before = _binding(kube_api)
    # The admin binds org/pods-a to one namespace; every other model stays as deployed.
    binding = copy.deepcopy(before)
    binding["models"] = {**(binding.get("models") or {}), MODEL_A: [bound]}
    _set_binding(kube_api, binding)
    docs = {
        "big-a": (bound, gated_engine_docs("big-a", model=MODEL_A, resident="2Gi",
                                           awake=BIG_AWAKE)),
        "big-b": (bound, gated_engine_docs("big-b", model=MODEL_B, resident="2Gi",
                                           awake=BIG_AWAKE)),
        "twin": (other, gated_engine_docs("twin", model=MODEL_A, resident="1Gi", awake="20Gi")),
    }
    core = client.CoreV1Api(kube_api)
    monitor: AwakeMonitor | None = None
    try:
        engines: dict[str, Engine] = {}
        for name, (ns, (claim, _)) in docs.items():
            create_namespace(kube_api, ns)
            rota_node.deploy_engines(ns, docs=[claim], wait=False)
            params = claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]
            resident = claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"][
                "requests"]["memory"]
            uid = client.ResourceV1Api(kube_api).read_namespaced_resource_claim(
                name, ns, _request_timeout=10).metadata.uid
            engines[name] = Engine(EngineSpec(name, params["model"], resident=resident,
                                              awake=params["awakeMemory"]), ns, claim_uid=uid)
        monitor = AwakeMonitor(rota_node.inspection_socket(), list(engines.values()),
                               interval_s=0.02)
        monitor.__enter__()
        for ns, (_, pod_doc) in docs.values():
            rota_node.deploy_engines(ns, docs=[pod_doc], wait=False)
        found = Stage(rota_node, bound, other, engines, monitor=monitor)
        for name, engine in engines.items():
            ready = eventually(functools.partial(_ready_pod, core, engine), timeout=300,
                               max_interval=2.0, what=f"engine {name} admitted and Ready")
            assert ready is not None
            engine.pod_ip = str(ready.status.pod_ip)
            found.urls[name] = rota_node.url(engine.pod_ip, 8000)
        eventually(lambda: _loaded_binding(rota_node, bound), timeout=240, max_interval=3.0,
                   what=f"every gateway replica bound {MODEL_A} to {bound}")
        yield found
    finally:
        if monitor is not None:
            monitor.__exit__(None, None, None)
        _set_binding(kube_api, before)
        for ns in (bound, other):
            with contextlib.suppress(client.ApiException):
                core.delete_namespace(ns, _request_timeout=10)


async def _activate(stage: Stage, model: str, claim: str) -> int:
    """Ask the node's controller pod, as a gateway would, to wake ``claim``."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{stage.rota.controller_url()}/v1/activate", json={"model": model, "claim": claim},
            headers={"Authorization": f"Bearer {stage.rota.deployment.token}"},
            timeout=aiohttp.ClientTimeout(total=120)) as resp:
        return resp.status


def _point_lease_at(stage: Stage, url: str) -> None:
    """Write ``holder-endpoint`` into the GPU Lease, as anyone who may write Leases can."""
    client.CoordinationV1Api(stage.api).patch_namespaced_lease(
        _gpu_lease(stage.rota), NAMESPACE,
        {"metadata": {"annotations": {naming.HOLDER_ENDPOINT: url}}}, _request_timeout=10)


async def test_a_model_is_served_only_from_the_namespace_bound_to_it(stage: Stage) -> None:
    """Two namespaces serve ``org/pods-a``; the admin bound it to one. With the other
    namespace's twin the awake holder of the GPU, and the GPU Lease's ``holder-endpoint``
    annotation naming the twin's address, every request for ``org/pods-a`` through either
    gateway replica is answered by the bound engine (the controller switches to it); the
    twin never receives one."""
    twin = f"{stage.other}/twin"
    # The twin really serves the same model name at its pod address.
    async with aiohttp.ClientSession() as session, session.get(
            f"{stage.urls['twin']}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        assert (await resp.json())["data"][0]["id"] == MODEL_A
    status = await eventually_async(
        lambda: _wakes(stage, MODEL_A, twin), timeout=180, max_interval=3.0,
        what="the controller pod waking the twin")
    assert status == 200
    assert stage.holder()[:2] == (twin, MODEL_A)
    # The engines' counts of generations include the controller's correctness probe after
    # each wake (the activation answered once the twin's probe passed): counted from here,
    # every generation the twin starts is a request routed to it, or a probe after a wake
    # that only a request routed to it could have asked for.
    async with aiohttp.ClientSession() as session:
        start = {name: (await stage.sim_state(session, name))["generations_started"]
                 for name in stage.engines}

    gateways = stage.rota.gateway_urls()
    asked = 0
    refused: list[str] = []
    async with aiohttp.ClientSession() as session:
        for gateway in gateways:
            for _ in range(3):
                _point_lease_at(stage, f"http://{stage.engines['twin'].pod_ip}:8000")
                answer = await _ask(session, gateway, MODEL_A, refused)
                assert answer.strip() == "7"
                asked += 1
        after = {name: (await stage.sim_state(session, name))["generations_started"]
                 for name in stage.engines}
    assert asked >= 6
    assert after["twin"] == start["twin"], \
        "a request for the bound model reached the other namespace's engine"
    assert after["big-a"] - start["big-a"] >= asked
    print(f"\nrefused with Retry-After before an answer: {refused}")
    assert stage.holder()[:2] == (f"{stage.bound}/big-a", MODEL_A)


async def _ask(session: aiohttp.ClientSession, gateway: str, model: str,
               refused: list[str], *, attempts: int = 30) -> str:
    """The correctness question through the gateway, as a well-behaved client asks it: a
    429 or 503 with Retry-After is asked again after a pause (its status and body are kept
    in ``refused``); anything else but a 200 fails the test."""
    for _ in range(attempts):
        async with session.post(f"{gateway}/v1/chat/completions", json={
                "model": model, "max_tokens": 4, "stream": False,
                "messages": [{"role": "user", "content": "What is 3 + 4?"}]},
                timeout=aiohttp.ClientTimeout(total=240)) as resp:
            body = await resp.text()
            if resp.status == 200:
                return str(json.loads(body)["choices"][0]["message"]["content"])
            what = f"{resp.status} {dict(resp.headers)}: {body[:500]}"
            assert resp.status in (429, 503), what
            retry_after = resp.headers.get("Retry-After", "")
            assert retry_after, what
            refused.append(f"{resp.status} {body[:300]}")
        await asyncio.sleep(min(float(retry_after), 5.0))
    raise AssertionError(f"{model}: refused {attempts} times: {refused[-3:]}")


async def _wakes(stage: Stage, model: str, claim: str) -> int | None:
    """200 once the controller woke ``claim``; None (ask again) on any other answer."""
    status = await _activate(stage, model, claim)
    return status if status == 200 else None


async def test_engines_that_do_not_fit_awake_together_start_and_serve_in_turns(
        stage: Stage) -> None:
    """Start-up admission through real pods: two engines whose awake budgets do not fit
    the GPU together (80 GiB each on the 140.4 GiB fake H200, whose memory runs out as
    CUDA's does) both started through the start gate, are Ready without a restart, and
    serve in turns through the gateway; no sample of the GPU, from before their start to
    now, showed two engines above their resident memory."""
    monitor = stage.awake_monitor()
    big = [stage.engines["big-a"], stage.engines["big-b"]]
    total = await asyncio.to_thread(_gpu_total, stage)
    assert sum(parse_quantity(e.spec.awake) for e in big) > total  # the premise
    core = client.CoreV1Api(stage.api)
    for engine in stage.engines.values():
        pod = core.read_namespaced_pod(engine.spec.name, engine.namespace, _request_timeout=10)
        assert is_ready(pod)
        assert sum(c.restart_count for c in pod.status.container_statuses or []) == 0, \
            f"{engine.spec.name} restarted: {pod.status.container_statuses}"
    gateway = stage.rota.gateway_url()
    async with aiohttp.ClientSession() as session:
        for name in ("big-a", "big-b"):
            state = await stage.sim_state(session, name)
            assert state["awake_memory_bytes"] == parse_quantity(BIG_AWAKE)
        for i in range(6):
            model = (MODEL_B, MODEL_A)[i % 2]
            answer = await eventually_async(functools.partial(ask_seven, session, gateway,
                                                              model), timeout=120, max_interval=3.0,
                                            what=f"an answer from {model} through the gateway")
            assert answer.strip() == "7"
            assert stage.holder()[1] == model
            await asyncio.to_thread(monitor.wait_next)
    assert monitor.samples > 0
    assert not monitor.violations, monitor.violations[:10]


def _gpu_total(stage: Stage) -> int:
    """The GPU's memory, as the driver's inspection API reports it."""

    async def read() -> int:
        reader = DeviceReader(stage.rota.inspection_socket(), timeout_s=10)
        try:
            (gpu,) = (await reader.read()).values()
        finally:
            await reader.close()
        return gpu.total_bytes

    return asyncio.run(read())


@dataclass
class Clients:
    """What the clients got, in order: (monotonic time, model, kind, detail)."""

    answers: list[tuple[float, str, str, str]] = field(default_factory=list)

    def ok_since(self, when: float, model: str) -> int:
        return sum(1 for t, m, kind, _ in self.answers
                   if t >= when and m == model and kind == Answer.OK)

    def both_since(self, when: float) -> bool:
        return all(self.ok_since(when, m) for m in (MODEL_A, MODEL_B))

    def count(self, kind: str) -> int:
        return sum(1 for _, _, k, _ in self.answers if k == kind)


def _recorded(clients: Clients) -> Record:
    return lambda model, kind, detail: clients.answers.append(
        (time.monotonic(), model, kind, detail))


async def test_killing_the_controller_pod_mid_switch_leaves_no_request_unanswered(
        stage: Stage) -> None:
    """While two clients alternate between the models through the gateway, the node's
    controller pod is deleted with grace period 0 three times, each while the GPU Lease
    shows a switch in progress. Every request is answered 200 with a complete answer or
    refused with 429/503 and Retry-After; after each kill both models are answered again
    (the DaemonSet's new pod takes over); the GPU never showed two engines awake."""
    monitor = stage.awake_monitor()
    sampled = monitor.samples
    core = client.CoreV1Api(stage.api)
    gateways = stage.rota.gateway_urls()
    clients = Clients()
    stop = asyncio.Event()
    killed: list[str] = []
    async with aiohttp.ClientSession() as session:
        # A client's timeout is longer than the gateway's own bound on a request
        # (max_wait_s, 180 s): a client timeout is an answer the gateway failed to give.
        loops = [asyncio.create_task(client_loop(session, gateways, [MODEL_A, MODEL_B],
                                                 _recorded(clients), stop,
                                                 rng=random.Random(seed), timeout_s=240))
                 for seed in (1, 2)]
        try:
            for _ in range(KILLS):
                pod = await asyncio.to_thread(
                    eventually, stage.rota.controller_pod, timeout=180, max_interval=1.0,
                    what="a Ready controller pod")

                def switching() -> str:
                    state = stage.holder()[2]
                    return state if state in (naming.STATE_SWITCHING,
                                              naming.STATE_STARTING) else ""

                state = await asyncio.to_thread(eventually, switching, timeout=120,
                                                interval=0.02, max_interval=0.05,
                                                what="a switch in progress")
                await asyncio.to_thread(core.delete_namespaced_pod, pod.metadata.name,
                                        NAMESPACE, grace_period_seconds=0,
                                        _request_timeout=10)
                killed.append(f"{pod.metadata.name} while {state}")
                when = time.monotonic()
                await eventually_async(
                    _now(functools.partial(clients.both_since, when)),
                    timeout=240, max_interval=1.0,
                    what="both models answered after the controller pod was killed")
                assert all(loop.done() is False for loop in loops)
        finally:
            stop.set()
            await asyncio.gather(*loops)
    await asyncio.to_thread(stage.rota.wait_ready)
    unanswered = [a for a in clients.answers if a[2] == Answer.UNANSWERED]
    refusals = sorted({a[3] for a in clients.answers if a[2] == Answer.REFUSED})
    print(f"\nkilled: {killed}; answers: ok {clients.count(Answer.OK)}, refused "
          f"{clients.count(Answer.REFUSED)} {refusals}, unanswered {len(unanswered)}")
    assert len(killed) == KILLS
    assert not unanswered, unanswered[:10]
    assert clients.count(Answer.OK) >= 2 * KILLS
    assert monitor.samples > sampled
    assert not monitor.violations, monitor.violations[:10]


def _now(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()
    return run
