"""The gateway's watches against an in-process stand-in of the Kubernetes API that refuses
the pods of some namespaces (403), as the chart's RBAC does outside ``engineNamespaces``
(review R4): one claim in such a namespace must not keep every gateway replica unready.
And a watch that fails (an API server restarting) resumes from where it was, without a
new list of the fleet.

The stand-in speaks the little of the API that :class:`KubeSource` uses (lists of claims,
Leases and pods, and watches that stay open), over real HTTP, to the real ``kubernetes``
client; nothing is mocked inside the gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes import client

from controller.gateway import kube_source
from controller.gateway.binding import ModelBinding
from controller.gateway.kube_source import KubeSource
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.routing import Action, RoutingState
from controller.gateway.settings import GatewaySettings
from e2e.harness.waiting import eventually_async
from rota.kit.aio import wait_any
from tests.gateway.conftest import claim_obj, pod_obj

pytestmark = pytest.mark.gateway

DEADLINE = 30.0
GOOD, ELSEWHERE = "inference", "elsewhere"
MODEL_GOOD, MODEL_ELSE = "org/good", "org/else"
FORBIDDEN_METRIC = "rota_gateway_forbidden_namespaces"


@dataclass
class FakeApi:
    """Claims, Leases and pods as lists, watches that send nothing, and 403s."""

    claims: list[dict[str, Any]] = field(default_factory=list)
    pods: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    forbidden: set[str] = field(default_factory=set)
    """Namespaces whose pods may not be listed or watched; ``"claims"``: claims neither."""
    refusals: Counter[str] = field(default_factory=Counter)
    lists: Counter[str] = field(default_factory=Counter)
    """List requests answered, by resource ("claims", "leases", a pod namespace)."""
    watches: Counter[str] = field(default_factory=Counter)
    """Watch requests answered (opened or failed), by resource."""
    failing_watches: Counter[str] = field(default_factory=Counter)
    """The next this many watch requests of each resource are answered 500 (an API server
    in trouble)."""
    resource_versions: Counter[str] = field(default_factory=Counter)
    """Watch requests by the resourceVersion they asked to start from."""
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    kick: asyncio.Event = field(default_factory=asyncio.Event)

    def end_watches(self) -> None:
        """End every open watch now (the client then watches again, or lists)."""
        self.kick.set()
        self.kick = asyncio.Event()

    @staticmethod
    def _refuse(what: str) -> web.Response:
        return web.json_response({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"{what} is forbidden: User \"system:serviceaccount:rota-system:"
                       "rota-gateway\" cannot list resource", "reason": "Forbidden",
            "code": 403}, status=403)

    async def _answer(self, request: web.Request, items: list[dict[str, Any]],
                      what: str) -> web.StreamResponse:
        if "watch" not in request.query:
            self.lists[what] += 1
            return web.json_response({"kind": "List", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": "1"}, "items": items})
        self.watches[what] += 1
        self.resource_versions[request.query.get("resourceVersion", "")] += 1
        if self.failing_watches[what] > 0:
            self.failing_watches[what] -= 1
            return web.json_response({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "etcdserver: leader changed", "reason": "InternalError",
                "code": 500}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await wait_any(self.closing, self.kick,
                       timeout_s=float(request.query.get("timeoutSeconds", "60")))
        return response

    async def claims_handler(self, request: web.Request) -> web.StreamResponse:
        if "claims" in self.forbidden:
            self.refusals["claims"] += 1
            return self._refuse("resourceclaims.resource.k8s.io")
        return await self._answer(request, self.claims, "claims")

    async def leases_handler(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, [], "leases")

    async def pods_handler(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        if namespace in self.forbidden:
            self.refusals[namespace] += 1
            return self._refuse("pods")
        return await self._answer(request, self.pods.get(namespace, []), namespace)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/resource.k8s.io/v1/resourceclaims", self.claims_handler)
        app.router.add_get("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                           self.leases_handler)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self.pods_handler)
        return app


@dataclass
class Running:
    api: FakeApi
    state: RoutingState
    metrics: GatewayMetrics

    @property
    def forbidden_gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value(FORBIDDEN_METRIC)


def _claims_and_pods() -> FakeApi:
    fake = FakeApi()
    fake.claims = [claim_obj("engine-good", model=MODEL_GOOD, port=8000, pod_uid="uid-pg",
                             namespace=GOOD),
                   claim_obj("engine-else", model=MODEL_ELSE, port=8000, pod_uid="uid-pe",
                             namespace=ELSEWHERE)]
    fake.pods = {GOOD: [pod_obj("pod-engine-good", uid="uid-pg", ip="10.9.0.5",
                                namespace=GOOD)],
                 ELSEWHERE: [pod_obj("pod-engine-else", uid="uid-pe", ip="10.9.0.6",
                                     namespace=ELSEWHERE)]}
    return fake


Start = Callable[[FakeApi], Awaitable[Running]]
"""Starts a KubeSource against a FakeApi."""


@pytest.fixture
def fast_forbidden_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short pauses between lists of a forbidden namespace, so the test sees several."""
    monkeypatch.setattr(kube_source, "_FORBIDDEN_BACKOFF_S", 0.05, raising=False)
    monkeypatch.setattr(kube_source, "_FORBIDDEN_BACKOFF_MAX_S", 0.2, raising=False)


@pytest.fixture
async def running(fast_forbidden_retries: None) -> AsyncIterator[Start]:
    """Start a KubeSource against a FakeApi (the binding: every namespace, ``*``)."""
    started: list[tuple[asyncio.Task[None], FakeApi, TestServer, client.ApiClient]] = []

    async def start(fake: FakeApi) -> Running:
        server = TestServer(fake.app(), host="127.0.0.1")
        await server.start_server()
        cfg = client.Configuration()
        cfg.host = str(server.make_url("")).rstrip("/")
        api = client.ApiClient(cfg)
        settings = GatewaySettings(controller_namespace="rota-system", watch_timeout_s=60,
                                   resync_s=300)
        state = RoutingState(binding=ModelBinding(namespaces=("*",)))
        metrics = GatewayMetrics(dict)
        task = asyncio.create_task(KubeSource(settings, api=api, metrics=metrics).run(state))
        started.append((task, fake, server, api))
        return Running(fake, state, metrics)

    yield start
    for task, fake, server, api in started:
        task.cancel()  # stops every watch thread at its next step
        await asyncio.gather(task, return_exceptions=True)
        fake.closing.set()  # ends the watches they are blocked in
        await server.close()
        await asyncio.to_thread(api.close)


async def _until(state: RoutingState, check: Callable[[], bool], what: str) -> None:
    """Wait for changes of the routing state until ``check`` holds (bounded)."""
    try:
        async with asyncio.timeout(DEADLINE):
            while not check():
                await state.wait_changed(state.version, DEADLINE)
    except TimeoutError:
        raise AssertionError(f"{what}: not seen within {DEADLINE}s") from None


async def _refused_at_least(fake: FakeApi, what: str, times: int) -> None:
    async def enough() -> bool:
        return fake.refusals[what] >= times
    await eventually_async(enough, timeout=DEADLINE, what=f"{times} refused lists of {what}")


def _forbidden_warnings(caplog: pytest.LogCaptureFixture, namespace: str) -> int:
    return sum(1 for r in caplog.records
               if r.levelno == logging.WARNING and getattr(r, "namespace", None) == namespace
               and "may not list" in r.getMessage())


async def test_a_namespace_whose_pods_may_not_be_listed_holds_nobody_up(
        running: Start, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="controller.gateway.kube_source")
    fake = _claims_and_pods()
    fake.forbidden = {ELSEWHERE}
    run: Running = await running(fake)
    state = run.state

    # Today: never synced, /readyz 503 for every tenant, retried forever.
    await _until(state, lambda: state.synced, "synced without the forbidden namespace")
    # The other namespace is served (its pod is known: only a controller is missing) ...
    assert state.decide(MODEL_GOOD).reason == "no_controller"
    # ... the forbidden one's claimant is never sent a request nor woken.
    decision = state.decide(MODEL_ELSE)
    assert decision.action is Action.UNAVAILABLE
    assert decision.reason == "no_serving_engine"
    assert run.forbidden_gauge == 1

    # Tried again in the background, logged once.
    await _refused_at_least(fake, ELSEWHERE, 3)
    assert _forbidden_warnings(caplog, ELSEWHERE) == 1
    assert run.forbidden_gauge == 1

    # The admin grants pod reads there: the next try lists it, and it is served.
    fake.forbidden.clear()
    await _until(state, lambda: state.decide(MODEL_ELSE).reason == "no_controller",
                 "the namespace listed after its RBAC changed")
    assert run.forbidden_gauge == 0
    assert _forbidden_warnings(caplog, ELSEWHERE) == 1


async def test_pods_of_a_namespace_that_becomes_forbidden_are_no_longer_served(
        running: Start) -> None:
    fake = _claims_and_pods()
    run: Running = await running(fake)
    state = run.state
    await _until(state, lambda: state.synced, "the first lists")
    assert state.decide(MODEL_ELSE).reason == "no_controller"

    # RBAC taken away: the next watch is refused; what the gateway knew is dropped.
    fake.forbidden = {ELSEWHERE}
    fake.end_watches()
    await _until(state, lambda: state.decide(MODEL_ELSE).reason == "no_serving_engine",
                 "the forbidden namespace's pods dropped")
    assert state.decide(MODEL_GOOD).reason == "no_controller"
    assert run.forbidden_gauge == 1


async def test_claims_that_may_not_be_listed_are_not_skipped(
        running: Start) -> None:
    # Without claims the gateway knows nothing: it must stay unready, not sync empty.
    fake = _claims_and_pods()
    fake.forbidden = {"claims"}
    run: Running = await running(fake)
    await _refused_at_least(fake, "claims", 2)
    assert not run.state.synced
    assert run.forbidden_gauge == 0


async def test_a_failed_watch_resumes_from_its_version_without_a_new_list(
        running: Start) -> None:
    """An API server that fails the watches (a restart, an etcd leader change) costs one
    watch request per stream, not a list of every claim (each failed watch listed again
    on the old code)."""
    fake = _claims_and_pods()
    run: Running = await running(fake)
    await _until(run.state, lambda: run.state.synced, "the first lists")
    streams = ["claims", "leases", GOOD, ELSEWHERE]

    async def watching(counts: Counter[str]) -> bool:
        return all(fake.watches[s] > counts[s] for s in streams)
    await eventually_async(lambda: watching(Counter()), timeout=DEADLINE,
                           what="every stream watching")
    lists = Counter(fake.lists)
    watches = Counter(fake.watches)
    fake.failing_watches = Counter({s: 2 for s in streams})
    fake.end_watches()
    # Each stream's watch fails twice, then it watches again.
    await eventually_async(lambda: watching(watches + Counter({s: 2 for s in streams})),
                           timeout=DEADLINE, what="every stream watching again")
    assert sum(fake.failing_watches.values()) == 0
    assert fake.lists == lists, "a failed watch resumes: no stream lists again"
    assert fake.resource_versions[""] == 0, "every watch starts from a version it saw"
    assert run.state.decide(MODEL_GOOD).reason == "no_controller"
