"""Tenants that cannot touch each other, on a real node: rota from the chart's manifests,
the real kubelet, containerd and runc, engine pods in two tenants' namespaces.

Tenant A serves its model behind rota's engine guard with no API key (its OpenAI surface
is open by its own choice; its control calls are not). Tenant B is the attacker, with
everything a tenant has: its own namespace and claim, its start token and control
credential (its claim's CDI environment), its pod IP, and an engine of its own that
records every credential header rota sends it. NetworkPolicy is not enforced on this
node's network (a plain bridge CNI, as on many clusters), so nothing but rota's own
checks stands between B and A.

From inside B's pod (:mod:`e2e.harness.tenant_probe`, through ``kubectl exec``), B tries to read,
sleep, wake and ``collective_rpc`` A's engine directly at its pod IP, through A's guard
with every credential it holds or has recorded, by every path trick (dot segments,
encoded separators, double slashes), on the engine's own port behind the guard, through
the node's start gate with A's claim uid, through the controller's activation API and
through the gateway's surface. Every attempt and its answer is printed; none succeeds,
A stays the GPU's holder, awake, never slept or woken by B, and no sample of the GPU
showed two engines awake.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from e2e.harness.deploy import NAMESPACE
from e2e.harness.objects import create_namespace
from e2e.harness.rota_node import (
    CONTROLLER_PORT,
    GATEWAY_PORT,
    QUICK_ENGINE_ARGS,
    RotaOnNodes,
    exec_in,
    gated_engine_docs,
    watched_engines,
)
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven
from e2e.harness.waiting import eventually_async
from rota.api import naming
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, pytest.mark.sampled,
              needs_root]

MODEL_A = "org/tenant-a"
MODEL_B = "org/tenant-b"
GUARDED_PORT = 8000
ENGINE_PORT_BEHIND_GUARD = 8001
CONTROL_HEADER = "X-Rota-Control-Token"


@dataclass
class Tenant:
    namespace: str
    name: str
    model: str
    engine: Engine


@dataclass
class Stage:
    rota: RotaOnNodes
    victim: Tenant
    attacker: Tenant
    monitor: AwakeMonitor


def _guarded(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine pod behind rota's engine guard (entrypoint mode): the guard on the pod's
    port, the start gate and the engine on loopback behind it."""
    container = docs[1]["spec"]["containers"][0]
    container["command"] = [
        "rota-engine-guard", "--port", str(GUARDED_PORT),
        "--upstream", f"http://127.0.0.1:{ENGINE_PORT_BEHIND_GUARD}", "--",
        "rota-engine-gate", "--", "python", "-m", "e2e.engine_simulator",
        "--host", "127.0.0.1", "--port", str(ENGINE_PORT_BEHIND_GUARD)]
    container["args"] = list(QUICK_ENGINE_ARGS)
    return docs


@pytest.fixture(scope="module")
def stage(kube_api: client.ApiClient, rota_node: RotaOnNodes) -> Iterator[Stage]:
    suffix = uuid.uuid4().hex[:6]
    names = {"victim": f"tenant-a-{suffix}", "attacker": f"tenant-b-{suffix}"}
    docs = {
        "victim": _guarded(gated_engine_docs("victim", model=MODEL_A, resident="1Gi",
                                             awake="40Gi")),
        "attacker": gated_engine_docs("attacker", model=MODEL_B, resident="1Gi",
                                      awake="40Gi"),
    }
    models = {"victim": MODEL_A, "attacker": MODEL_B}
    for namespace in names.values():
        create_namespace(kube_api, namespace)
    try:
        with contextlib.ExitStack() as stack:
            watched = {
                role: stack.enter_context(watched_engines(
                    rota_node, names[role], {role: docs[role]},
                    {role: EngineSpec(role, models[role], resident="1Gi", awake="40Gi")}))
                for role in ("victim", "attacker")}
            tenants = {role: Tenant(names[role], role, models[role], w.engines[role])
                       for role, w in watched.items()}
            monitor = AwakeMonitor(rota_node.inspection_socket(),
                                   [t.engine for t in tenants.values()], interval_s=0.02)
            with monitor:
                yield Stage(rota_node, tenants["victim"], tenants["attacker"], monitor)
    finally:
        for namespace in names.values():
            with contextlib.suppress(client.ApiException):
                client.CoreV1Api(kube_api).delete_namespace(namespace, _request_timeout=10)


def _probe(stage: Stage, tenant: Tenant, attempts: list[dict[str, Any]]
           ) -> list[dict[str, Any]]:
    """Run :mod:`e2e.harness.tenant_probe` in ``tenant``'s engine container."""
    out = exec_in(stage.rota.api, tenant.namespace, tenant.name,
                  ["python", "-m", "e2e.harness.tenant_probe", json.dumps(attempts)], timeout=120)
    results: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
    return results


def _victim_state(stage: Stage) -> dict[str, Any]:
    """The victim engine's own state, read on its loopback port from inside its pod."""
    [result] = _probe(stage, stage.victim, [{
        "name": "state", "method": "GET", "whole": True,
        "url": f"http://127.0.0.1:{ENGINE_PORT_BEHIND_GUARD}/sim/state"}])
    assert result["status"] == 200, result
    state: dict[str, Any] = json.loads(result["body"])
    return state


def _lease(stage: Stage) -> tuple[str, str]:
    lease = client.CoordinationV1Api(stage.rota.api).read_namespaced_lease(
        naming.gpu_lease_name(stage.rota.node().name, "gpu-0"), NAMESPACE,
        _request_timeout=10)
    notes = lease.metadata.annotations or {}
    return lease.spec.holder_identity or "", notes.get(naming.STATE, "")


def _credentials(recorded: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """Every credential tenant B holds or learned, as the headers it would send."""
    found: dict[str, dict[str, str]] = {
        "no credential": {},
        "B's control credential": {CONTROL_HEADER: "$ROTA_CONTROL_TOKEN"},
        "B's start token": {CONTROL_HEADER: "$ROTA_START_TOKEN"},
        "B's start token as bearer": {"Authorization": "Bearer $ROTA_START_TOKEN"},
    }
    for i, value in enumerate(recorded.get("x-rota-control-token", [])):
        found[f"control header rota sent B #{i}"] = {CONTROL_HEADER: value}
    for i, value in enumerate(recorded.get("authorization", [])):
        found[f"authorization rota sent B #{i}"] = {"Authorization": value}
    return found


CONTROL_CALLS = [("GET", "/is_sleeping", ""), ("POST", "/sleep?level=1", ""),
                 ("POST", "/wake_up", ""),
                 ("POST", "/collective_rpc", json.dumps({"method": "sleep"})),
                 ("POST", "/reset_prefix_cache", "")]
PATH_TRICKS = ["/v1/../sleep", "/v1/%2e%2e/sleep", "/v1/%2E%2E/wake_up", "/v1/..%2fsleep",
               "/v1/..%2Fwake_up", "//sleep", "/v1//../wake_up", "/./sleep",
               "/v1/./../wake_up", "/v1/omni/../../sleep", "/v1%2f..%2fsleep",
               "/v1/..\\sleep", "/%2e%2e/v1/../wake_up", "/sleep/", "/SLEEP", "/sleep;x=1"]


def _as_bearer(header: str, value: str) -> str:
    return value if header == "Authorization" else f"Bearer {value}"


def _attempts(stage: Stage, recorded: dict[str, list[str]]) -> list[dict[str, Any]]:
    victim = f"http://{stage.victim.engine.pod_ip}"
    guard = f"{victim}:{GUARDED_PORT}"
    attempts: list[dict[str, Any]] = []
    for label, headers in _credentials(recorded).items():
        for method, path, body in CONTROL_CALLS:
            attempts.append({"name": f"guard {method} {path} with {label}", "method": method,
                             "url": guard + path, "headers": headers, "body": body})
    for path in PATH_TRICKS:
        for label, headers in (("no credential", {}),
                               ("B's control credential", {CONTROL_HEADER:
                                                           "$ROTA_CONTROL_TOKEN"})):
            attempts.append({"name": f"guard POST {path} with {label}", "method": "POST",
                             "url": guard + path, "headers": headers})
    attempts.append({"name": "engine's own port POST /sleep", "method": "POST",
                     "url": f"{victim}:{ENGINE_PORT_BEHIND_GUARD}/sleep?level=1"})
    for label, token in (("B's start token", "$ROTA_START_TOKEN"),
                         ("B's control credential", "$ROTA_CONTROL_TOKEN"),
                         ("no token", ""),
                         *((f"control header rota sent B #{i}", v) for i, v in
                           enumerate(recorded.get("x-rota-control-token", [])))):
        attempts.append({"name": f"start gate for A's claim with {label}", "kind": "start",
                         "claim_uid": stage.victim.engine.claim_uid, "token": token})
    controller = stage.rota.controller_pod()
    activation = f"http://{controller.status.pod_ip}:{CONTROLLER_PORT}/v1/activate"
    for label, headers in _credentials(recorded).items():
        bearer = dict(("Authorization", _as_bearer(name, value))
                      for name, value in headers.items())
        attempts.append({"name": f"controller activation of A's model with {label}",
                         "method": "POST", "url": activation, "headers": bearer,
                         "body": json.dumps({"model": stage.victim.model,
                                             "claim_uid": stage.victim.engine.claim_uid})})
    gateway_pod = stage.rota.deployment.gateway_pods()[0]
    gateway = f"http://{gateway_pod.status.pod_ip}:{GATEWAY_PORT}"
    for path in ("/sleep?level=1", "/wake_up", "/collective_rpc", "/is_sleeping",
                 "/v1/../wake_up", "/v1/%2e%2e/sleep", "/v1/..%2fsleep"):
        attempts.append({"name": f"gateway POST {path}", "method": "POST",
                         "url": gateway + path,
                         "body": json.dumps({"model": stage.victim.model})})
    return attempts


def _print_table(results: list[dict[str, Any]]) -> None:
    width = max(len(r["name"]) for r in results)
    print(f"\n{'attempt by tenant B':<{width}}  status  answer")
    for r in results:
        answer = " ".join(str(r["body"]).split())[:70]
        print(f"{r['name']:<{width}}  {r['status']:>6}  {answer}")


def _refused(result: dict[str, Any]) -> bool:
    """An attempt was refused: a 4xx answer (a 5xx may come from the engine the attempt
    reached), never a start granted; or, on the engine's own port, no connection at all."""
    if result["name"].startswith("engine's own port"):
        return bool(result["status"] == 0)
    if not 400 <= result["status"] < 500:
        return False
    return '"granted": true' not in result["body"] and '"granted":true' not in result["body"]


async def _answer(session: aiohttp.ClientSession, gateway: str, model: str) -> str:
    return await eventually_async(lambda: ask_seven(session, gateway, model), timeout=180,
                                  max_interval=3.0, what=f"an answer from {model}")


async def test_a_tenant_cannot_read_sleep_wake_or_start_another_tenants_engine(
        stage: Stage) -> None:
    gateway = stage.rota.gateway_url()
    async with aiohttp.ClientSession() as session:
        # B holds the GPU, then A: rota puts B to sleep, which B's engine records.
        assert (await _answer(session, gateway, MODEL_B)).strip() == "7"
        assert (await _answer(session, gateway, MODEL_A)).strip() == "7"
    holder = f"{stage.victim.namespace}/{stage.victim.name}"
    assert await asyncio.to_thread(_lease, stage) == (holder, naming.STATE_AWAKE)
    [seen] = await asyncio.to_thread(_probe, stage, stage.attacker, [{
        "name": "recorded", "method": "GET", "url": "http://127.0.0.1:8000/sim/headers"}])
    assert seen["status"] == 200, seen
    recorded: dict[str, list[str]] = json.loads(seen["body"])
    print(f"\ncredential headers rota sent tenant B's engine: "
          f"{ {name: len(values) for name, values in recorded.items()} }")
    before = await asyncio.to_thread(_victim_state, stage)

    results = await asyncio.to_thread(_probe, stage, stage.attacker,
                                      _attempts(stage, recorded))
    _print_table(results)

    succeeded = [r for r in results if not _refused(r)]
    assert not succeeded, json.dumps(succeeded, indent=1)
    after = await asyncio.to_thread(_victim_state, stage)
    assert after["sleeping"] is False, after
    assert (after["sleep_count"], after["wake_count"], after["reloads"]) == (
        before["sleep_count"], before["wake_count"], before["reloads"]), (before, after)
    assert await asyncio.to_thread(_lease, stage) == (holder, naming.STATE_AWAKE)
    assert stage.monitor.samples > 0
    assert not stage.monitor.violations, stage.monitor.violations[:10]
