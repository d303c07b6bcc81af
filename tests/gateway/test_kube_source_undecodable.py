"""Review F5: one ResourceClaim whose opaque parameters nest ~1,100 levels (2.2 KB, within
the API's 10 KiB limit) must not stop the gateway. Decoding a whole list page at once made
every list fail (RecursionError), so the routing state never synced (``/readyz`` 503,
every request ``not_ready``); in a watch, the same event was replayed for ever. Anyone who
may create a claim in any namespace could do it.

The stand-in of the API server (:class:`ClaimStreamFake`) serves list pages and watch
streams as the API server does: bytes it does not re-encode (so it can hold what Python
cannot encode either), and a watch from a resourceVersion replays every event after it.
It speaks to the real ``kubernetes`` client over real HTTP; nothing inside the gateway is
mocked.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes import client

from controller.gateway.binding import ModelBinding
from controller.gateway.kube_source import KubeSource
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.routing import RoutingState
from controller.gateway.settings import GatewaySettings
from rota.kit.aio import wait_any
from tests.gateway.conftest import claim_obj, pod_obj

pytestmark = pytest.mark.gateway

DEADLINE = 30.0
GOOD, ELSEWHERE, TENANT = "inference", "elsewhere", "tenant"
MODEL_GOOD, MODEL_ELSE, MODEL_DEEP = "org/good", "org/else", "org/deep"
DEPTH = 1_100
"""As deep as the review's claim: past Python's recursion limit, 2.2 KB of brackets."""
LISTED_AT = 10
"""The resourceVersion of every list; the n-th watch event (from 1) has ``LISTED_AT + n``."""
UNDECODABLE = "rota_gateway_undecodable_objects_total"
RESTARTS = "rota_gateway_watch_restarts_total"


def claim_text(name: str, *, model: str, namespace: str, version: int = LISTED_AT,
               depth: int = 0) -> str:
    """A claim as the API server sends it; with ``depth``, its opaque parameters are
    replaced by arrays nested that deep (built as text: Python's encoder recurses too)."""
    claim = claim_obj(name, model=model, port=8000, pod_uid=f"uid-pod-{name}",
                      namespace=namespace)
    claim["metadata"]["resourceVersion"] = str(version)
    if not depth:
        return json.dumps(claim)
    claim["spec"]["devices"]["config"][0]["opaque"]["parameters"] = "DEEP"
    return json.dumps(claim).replace('"DEEP"', "[" * depth + "]" * depth)


@dataclass
class ClaimStreamFake:
    """Claims listed and watched (a watch replays every event after its version), Leases
    and pods listed, their watches silent. As unkind as the real server: whatever bytes a
    client created are served back as they are."""

    claims: list[str] = field(default_factory=list)
    """The claims of a list, as JSON text."""
    events: list[str] = field(default_factory=list)
    """Watch events of claims, as JSON lines; the n-th (from 1) at ``LISTED_AT + n``."""
    pods: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    lists: Counter[str] = field(default_factory=Counter)
    watches: Counter[str] = field(default_factory=Counter)
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    grew: asyncio.Event = field(default_factory=asyncio.Event)

    def add_event(self, kind: str, obj_text: str) -> None:
        """A claim write: sent to every open watch, and to every later one from before."""
        self.events.append(f'{{"type": "{kind}", "object": {obj_text}}}')
        self.grew.set()
        self.grew = asyncio.Event()

    @staticmethod
    def _list(items: list[str]) -> web.Response:
        body = ('{"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "'
                f'{LISTED_AT}"}}, "items": [{", ".join(items)}]}}')
        return web.Response(body=body.encode(), content_type="application/json")

    async def _stream(self, request: web.Request, events: list[str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        sent = max(0, int(request.query.get("resourceVersion") or LISTED_AT) - LISTED_AT)
        timeout = float(request.query.get("timeoutSeconds", "60"))
        while not self.closing.is_set():
            while sent < len(events):
                await response.write(events[sent].encode() + b"\n")
                sent += 1
            if not await wait_any(self.closing, self.grew, timeout_s=timeout):
                break
        return response

    async def claims_handler(self, request: web.Request) -> web.StreamResponse:
        if "watch" not in request.query:
            self.lists["claims"] += 1
            return self._list(self.claims)
        self.watches["claims"] += 1
        return await self._stream(request, self.events)

    async def leases_handler(self, request: web.Request) -> web.StreamResponse:
        if "watch" not in request.query:
            return self._list([])
        return await self._stream(request, [])

    async def pods_handler(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        if "watch" not in request.query:
            return self._list([json.dumps(p) for p in self.pods.get(namespace, [])])
        return await self._stream(request, [])

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/resource.k8s.io/v1/resourceclaims", self.claims_handler)
        app.router.add_get("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                           self.leases_handler)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self.pods_handler)
        return app


@dataclass
class Running:
    api: ClaimStreamFake
    state: RoutingState
    metrics: GatewayMetrics

    def count(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(
            name, {"resource": "resourceclaims"}) or 0.0


Start = Callable[[ClaimStreamFake], Awaitable[Running]]


@pytest.fixture
async def running() -> AsyncIterator[Start]:
    """Start a KubeSource against a ClaimStreamFake (binding: every namespace)."""
    started: list[tuple[asyncio.Task[None], ClaimStreamFake, TestServer, client.ApiClient]] = []

    async def start(fake: ClaimStreamFake) -> Running:
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
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake.closing.set()
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


def _pods() -> dict[str, list[dict[str, Any]]]:
    """The pod of each engine (``engine-<model>``) that :func:`claim_text` reserves for."""
    return {ns: [pod_obj(f"pod-{name}", uid=f"uid-pod-{name}", ip=ip, namespace=ns)]
            for ns, name, ip in ((GOOD, "engine-good", "10.9.0.5"),
                                 (ELSEWHERE, "engine-else", "10.9.0.6"),
                                 (TENANT, "engine-deep", "10.9.0.7"))}


def _skip_reports(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING
            and getattr(r, "name", None) == "rota.kit.listwatch"
            and r.__dict__.get("uid") == f"uid-{name}"]


async def test_a_deeply_nested_claim_in_a_list_is_skipped_and_the_rest_syncs(
        running: Start, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rota.kit.listwatch")
    fake = ClaimStreamFake(pods=_pods(), claims=[
        claim_text("engine-good", model=MODEL_GOOD, namespace=GOOD),
        claim_text("engine-deep", model=MODEL_DEEP, namespace=TENANT, depth=DEPTH),
        claim_text("engine-else", model=MODEL_ELSE, namespace=ELSEWHERE)])
    run = await running(fake)
    state = run.state

    # Old code: never synced (the page failed in json.loads), listed again for ever.
    await _until(state, lambda: state.synced, "synced despite the deep claim")
    assert state.decide(MODEL_GOOD).reason == "no_controller"
    assert state.decide(MODEL_ELSE).reason == "no_controller"
    assert not state.knows(MODEL_DEEP)
    assert run.count(UNDECODABLE) == 1
    assert run.count(RESTARTS) == 0, "the list succeeded the first time"
    (report,) = _skip_reports(caplog, "engine-deep")
    assert report.__dict__["namespace"] == TENANT
    assert report.__dict__["object"] == "engine-deep"
    assert report.__dict__["resource"] == "resourceclaims/all"
    assert "deeper" in report.__dict__["reason"]


async def test_a_deeply_nested_claim_in_a_watch_is_passed_and_the_stream_goes_on(
        running: Start, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rota.kit.listwatch")
    fake = ClaimStreamFake(pods=_pods(), claims=[
        claim_text("engine-good", model=MODEL_GOOD, namespace=GOOD)])
    run = await running(fake)
    state = run.state
    await _until(state, lambda: state.synced, "the first lists")

    fake.add_event("ADDED", claim_text("engine-deep", model=MODEL_DEEP, namespace=TENANT,
                                       version=LISTED_AT + 1, depth=DEPTH))
    fake.add_event("ADDED", claim_text("engine-else", model=MODEL_ELSE, namespace=ELSEWHERE,
                                       version=LISTED_AT + 2))
    # Old code: the deep event failed the watch, which resumed before it: replayed for
    # ever, and the claim after it never arrived.
    await _until(state, lambda: state.decide(MODEL_ELSE).reason == "no_controller",
                 "the claim written after the deep one")
    assert not state.knows(MODEL_DEEP)
    assert state.decide(MODEL_GOOD).reason == "no_controller"
    assert run.count(UNDECODABLE) == 1
    assert run.count(RESTARTS) == 0, "the watch went on past the deep event"
    assert fake.lists["claims"] == 1
    assert len(_skip_reports(caplog, "engine-deep")) == 1
