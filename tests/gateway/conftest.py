"""Fixtures for the gateway: real engine simulators, a fake lease controller, the gateway.

Everything runs in-process on 127.0.0.1, port 0. The fake controller serves the real
activation API contract (``POST /v1/activate``; every error in the contract's shape, with
the status and Retry-After of the contract's table) and performs each switch for real: it
marks the GPU Lease ``switching`` (draining the holder), puts the old engine to sleep with
``mode=wait``, wakes the new one and records the new holder, publishing each Lease version
into the gateway's routing state as a watch would.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from controller.gateway import keys
from controller.gateway.app import make_app
from controller.gateway.routing import ObjectKind, RoutingState, StaticSource
from controller.gateway.settings import GatewaySettings
from e2e.engine_simulator import Settings as SimSettings
from e2e.engine_simulator import create_app as create_sim
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.harness.waiting import eventually_async
from rota.api import naming
from rota.api.activation import ErrorBody, refusal_of
from rota.api.gpu_lease import micro_time

MODEL_A = "sim/model-a"
MODEL_B = "sim/model-b"
NAMESPACE = "engines"
NODE = "node-1"
DEVICE = "gpu-0"
TOKEN = "activation-secret"
DEADLINE = 20.0
GIB = 2**30


# -- Kubernetes objects as the watches would deliver them ------------------------------


def claim_obj(name: str, *, model: str, port: int, pod_uid: str, namespace: str = NAMESPACE,
              node: str = NODE, device: str = DEVICE) -> dict[str, Any]:
    config = {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig", "model": model,
              "awakeMemory": "10Gi", "sleepLevel": 1, "enginePort": port}
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.rota.dev"}}],
            "config": [{"requests": ["gpu"],
                        "opaque": {"driver": "gpu.rota.dev", "parameters": config}}]}},
        "status": {
            "allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.rota.dev", "pool": node, "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": pod_uid}],
        },
    }


def pod_obj(name: str, *, uid: str, ip: str = "127.0.0.1", ready: bool = True,
            namespace: str = NAMESPACE) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def gpu_lease(*, holder: str | None, state: str, model: str | None = None,
              endpoint: str | None = None, target: str | None = None,
              draining: str | None = None, last_error: str | None = None,
              fence: int = 0, node: str = NODE, device: str = DEVICE,
              holder_uid: str | None = None,
              awake_with: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """A GPU Lease as the lease controller writes it. ``holder_uid`` defaults to the uid
    :func:`claim_obj` gives the holder's claim; ``endpoint`` is the deprecated
    ``holder-endpoint`` annotation, which the gateway must never route by;
    ``awake_with``: ``(claim ref, model)`` of each engine awake beside the holder (an
    awake set), with the uid :func:`claim_obj` gives its claim."""
    if holder and holder_uid is None:
        holder_uid = f"uid-{holder.partition('/')[2]}"
    members = json.dumps([{"claim": ref, "uid": f"uid-{ref.partition('/')[2]}", "model": m}
                          for ref, m in awake_with]) if awake_with else None
    notes = {naming.STATE: state, naming.HOLDER_MODEL: model, naming.HOLDER_ENDPOINT: endpoint,
             naming.HOLDER_CLAIM_UID: holder_uid, naming.TARGET_MODEL: target,
             naming.DRAINING_MODEL: draining, naming.LAST_ERROR: last_error,
             naming.AWAKE_WITH: members}
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": naming.gpu_lease_name(node, device), "namespace": "rota-system",
                     "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
                                naming.LABEL_KIND: naming.KIND_GPU,
                                naming.LABEL_NODE: node, naming.LABEL_DEVICE: device},
                     "annotations": {k: v for k, v in notes.items() if v}},
        "spec": {"holderIdentity": holder or "", "leaseTransitions": fence},
    }


def controller_lease(url: str, *, node: str = NODE, renewed_ago_s: float = 0.0,
                     duration_s: int = 3600) -> dict[str, Any]:
    """A node controller's Lease, renewed ``renewed_ago_s`` ago (expired when that is
    more than ``duration_s``)."""
    renewed = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=renewed_ago_s)
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": naming.controller_lease_name(node), "namespace": "rota-system",
                     "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
                                naming.LABEL_KIND: naming.KIND_CONTROLLER,
                                naming.LABEL_NODE: node},
                     "annotations": {naming.ACTIVATION_URL: url}},
        "spec": {"holderIdentity": "controller-0", "leaseDurationSeconds": duration_s,
                 "renewTime": micro_time(renewed)},
    }


# -- simulators ------------------------------------------------------------------------


@dataclass
class Sim:
    model: str
    client: TestClient[Any, Any]
    engine: Engine
    claim: str
    """``<namespace>/<claim name>``."""

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    @property
    def port(self) -> int:
        port = self.client.port
        assert port is not None
        return port

    async def faults(self, **changes: bool) -> None:
        async with self.client.post("/sim/faults", json=changes) as resp:
            assert resp.status == 200, await resp.text()

    async def idle(self) -> None:
        """Wait (bounded) until no generation runs or waits."""
        engine = self.engine
        async with asyncio.timeout(DEADLINE):
            await engine.wait_for(lambda: engine.running + engine.waiting == 0)


async def start_sim(model: str, claim: str, *, host: str = "127.0.0.1",
                    **overrides: Any) -> Sim:
    """An engine simulator serving ``model`` for the claimant ``claim`` on ``host``:0."""
    values: dict[str, Any] = {"model": model, "awake_memory_bytes": 10 * GIB,
                              "resident_memory_bytes": 1 * GIB, "shutdown_grace_seconds": 0.0,
                              "dev_mode": True}  # VLLM_SERVER_DEV_MODE=1
    app = create_sim(SimSettings.model_validate(values | overrides),
                     exit_process=lambda code: None)
    client: TestClient[Any, Any] = TestClient(TestServer(app, host=host, port=0))
    await client.start_server()
    return Sim(model, client, app[ENGINE_KEY], claim)


async def start_controller(sims: dict[str, Sim], states: list[RoutingState], *,
                           node: str = NODE, holder: Sim | None = None
                           ) -> tuple[FakeController, TestClient[Any, Any]]:
    """A fake lease controller for one GPU of ``node``, publishing into ``states``."""

    def publish(lease: dict[str, Any]) -> None:
        for state in states:
            state.apply("lease", "MODIFIED", lease)

    controller = FakeController(sims, publish, holder=holder, node=node)
    app = web.Application()
    app.router.add_post("/v1/activate", controller.activate)
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    return controller, client


# -- the fake lease controller ---------------------------------------------------------


@dataclass
class Failure:
    """The fake controller's next answers: the error code ``reason``. ``status`` is what
    the test expects the contract's table to send it with (checked here)."""

    status: int
    reason: str
    retry_after: int
    times: int = 1_000_000

    def __post_init__(self) -> None:
        assert refusal_of(self.reason).status == self.status, \
            f"{self.reason} is a {refusal_of(self.reason).status} by the contract's table"


def contract_error(code: str, message: str, *, retry_after: int | None = None
                   ) -> web.Response:
    """The activation API's answer for ``code``, as the controller sends it."""
    row = refusal_of(code)
    return web.json_response(ErrorBody.of(code, message).model_dump(), status=row.status,
                             headers=row.headers(retry_after) or None)


@dataclass
class FakeController:
    """One GPU shared by the simulators; serves the activation API and switches for real."""

    sims: dict[str, Sim]
    publish: Callable[[dict[str, Any]], None]
    holder: Sim | None = None
    switches: int = 0
    calls: int = 0
    max_awake: int = 0
    failure: Failure | None = None
    hold_switch: asyncio.Event | None = None
    """When set to an unset event, a switch stops after marking the Lease switching."""
    switching: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fence: int = 0
    node: str = NODE
    hold_answer: asyncio.Event | None = None
    """When set to an unset event, activation calls wait for it before anything else."""
    after_switch: Callable[[], None] | None = None
    """Called after a switch published its Lease, before the activation is answered."""

    def lease_now(self, **changes: Any) -> dict[str, Any]:
        holder = self.holder
        values: dict[str, Any] = {
            "holder": holder.claim if holder else None,
            "state": naming.STATE_AWAKE if holder else naming.STATE_IDLE,
            "model": holder.model if holder else None,
            "endpoint": holder.url if holder else None, "fence": self.fence,
            "node": self.node}
        return gpu_lease(**(values | changes))

    async def _awake_count(self) -> int:
        count = 0
        for sim in self.sims.values():
            async with sim.client.get("/is_sleeping") as resp:
                count += not (await resp.json())["is_sleeping"]
        return count

    async def _control(self, sim: Sim, path: str) -> None:
        async with sim.client.post(path) as resp:
            assert resp.status == 200, await resp.text()

    async def activate(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return contract_error("unauthorized", "no")
        body = await request.json()
        self.calls += 1
        if self.hold_answer is not None:
            await self.hold_answer.wait()
        sim = next((s for s in self.sims.values() if s.claim == body["claim"]), None)
        if sim is None or sim.model != body["model"]:
            return contract_error("unknown_model", body["model"])
        if self.failure is not None and self.failure.times > 0:
            self.failure.times -= 1
            return contract_error(self.failure.reason, "the switch failed",
                                  retry_after=self.failure.retry_after)
        async with self.lock:
            switched = self.holder is not sim
            if switched:
                await self._switch_to(sim)
        # An address in the answer (a deprecated field) must never be routed to.
        return web.json_response({"model": sim.model, "claim": sim.claim,
                                  "endpoint": "http://192.0.2.1:9", "switched": switched,
                                  "fence": self.fence})

    async def _switch_to(self, sim: Sim) -> None:
        old = self.holder
        self.fence += 1
        self.publish(self.lease_now(state=naming.STATE_SWITCHING, target=sim.model,
                                    draining=old.model if old else None))
        self.switching.set()
        if self.hold_switch is not None:
            await self.hold_switch.wait()
        if old is not None:
            await self._control(old, "/sleep?level=1&mode=wait")
        await self._control(sim, "/wake_up")
        self.max_awake = max(self.max_awake, await self._awake_count())
        self.holder = sim
        self.switches += 1
        self.publish(self.lease_now())
        if self.after_switch is not None:
            self.after_switch()


# -- the whole rig ---------------------------------------------------------------------


@dataclass
class Rig:
    gateway: TestClient[Any, Any]
    app: web.Application
    controller: FakeController
    a: Sim
    b: Sim
    replicas: list[TestClient[Any, Any]] = field(default_factory=list)
    """Every gateway replica (the first is :attr:`gateway`), all fed the same Leases."""
    states: list[RoutingState] = field(default_factory=list)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """What the fixture closes at the end; tests append what they start."""

    def apply(self, kind: ObjectKind, event: str, obj: dict[str, Any]) -> None:
        """A watch event seen by every replica."""
        for state in self.states:
            state.apply(kind, event, obj)

    @property
    def state(self) -> RoutingState:
        return self.app[keys.STATE]

    async def chat(self, model: str, prompt: str = "What is 3 + 4?",
                   **extra: Any) -> ClientResponse:
        payload = {"model": model, "messages": [{"role": "user", "content": prompt}]} | extra
        return await self.gateway.post("/v1/chat/completions", json=payload)

    async def answer(self, model: str) -> str:
        resp = await self.chat(model)
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["model"] == model
        return str(body["choices"][0]["message"]["content"])


RigFactory = Callable[..., Awaitable[Rig]]
PrepareHook = Callable[[web.Request, web.StreamResponse], Awaitable[None]]
"""An ``on_response_prepare`` handler: runs inside every answer's ``prepare()``."""


@pytest.fixture
async def make_rig(tmp_path: Path) -> AsyncIterator[RigFactory]:
    """Two simulators on one GPU (A awake, B asleep), a fake controller, the gateway
    (``on_prepare``: a hook each gateway replica runs inside every answer's prepare)."""
    closers: list[Callable[[], Awaitable[None]]] = []

    async def make(*, sim_a: dict[str, Any] | None = None, sim_b: dict[str, Any] | None = None,
                   api_keys: list[str] | None = None, token: str | None = TOKEN,
                   replicas: int = 1, on_prepare: PrepareHook | None = None,
                   **settings: Any) -> Rig:
        a = await start_sim(MODEL_A, f"{NAMESPACE}/claim-a", **(sim_a or {}))
        closers.append(a.client.close)
        b = await start_sim(MODEL_B, f"{NAMESPACE}/claim-b", **(sim_b or {}))
        closers.append(b.client.close)
        async with b.client.post("/sleep?level=1") as resp:
            assert resp.status == 200

        values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "max_wait_s": DEADLINE,
                                  "lost_gpu_grace_s": 5.0, "serving_namespaces": [NAMESPACE]}
        if token is not None:
            (tmp_path / "token").write_text(token + "\n")
            values["activation_token_file"] = tmp_path / "token"
        if api_keys is not None:
            (tmp_path / "keys").write_text("\n".join(api_keys) + "\n")
            values["api_keys_file"] = tmp_path / "keys"
        state_holder: list[RoutingState] = []
        controller, ctl = await start_controller({MODEL_A: a, MODEL_B: b}, state_holder,
                                                 holder=a)
        closers.append(ctl.close)

        source = StaticSource(
            claims=[claim_obj("claim-a", model=MODEL_A, port=a.port, pod_uid="pod-a"),
                    claim_obj("claim-b", model=MODEL_B, port=b.port, pod_uid="pod-b")],
            pods=[pod_obj("pod-claim-a", uid="pod-a"), pod_obj("pod-claim-b", uid="pod-b")],
            leases=[controller.lease_now(),
                    controller_lease(str(ctl.make_url("")).rstrip("/"))])
        apps, clients = [], []
        for _ in range(replicas):
            app = make_app(GatewaySettings.model_validate(values | settings),
                           routing_source=source)
            if on_prepare is not None:  # before the start, which freezes the signals
                app.on_response_prepare.append(on_prepare)
            state_holder.append(app[keys.STATE])
            gateway: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1",
                                                                  port=0))
            await gateway.start_server()
            closers.append(gateway.close)
            async with asyncio.timeout(DEADLINE):
                while not app[keys.STATE].synced:
                    await app[keys.STATE].wait_changed(app[keys.STATE].version, DEADLINE)
            apps.append(app)
            clients.append(gateway)
        rig = Rig(clients[0], apps[0], controller, a, b, clients)
        rig.states = state_holder
        rig.closers = closers
        return rig

    try:
        yield make
    finally:
        for close in reversed(closers):
            await close()


async def read_events(resp: ClientResponse) -> tuple[list[Any], int]:
    """Every SSE event's data (JSON or ``[DONE]``) and how many reads delivered them."""
    raw = bytearray()
    reads = 0
    async with asyncio.timeout(DEADLINE):
        while chunk := await resp.content.readany():
            raw += chunk
            reads += 1
    events: list[Any] = []
    for block in bytes(raw).decode().split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events, reads


def content_of(events: list[Any]) -> str:
    text = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                delta = choice.get("delta")
                text.append((delta.get("content") or "") if delta is not None
                            else choice.get("text", ""))
    return "".join(text)


async def eventually(check: Callable[[], bool], what: str) -> None:
    """Poll a cheap in-process condition until it holds (bounded)."""

    async def holds() -> bool:
        return check()

    await eventually_async(holds, timeout=DEADLINE, interval=0.005, what=what)
