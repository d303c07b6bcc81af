"""What kubectl shows while the lease controller switches: Events on the engine pods
(``SwitchedIn``, ``SwitchedOut``, ``SwitchFailed`` with a CamelCase cause), the
``gpu.rota.dev/state`` label of every engine pod and the ``Awake``/``Ready`` conditions of
each claim's device, written by the real controller process to the real API server."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from kubernetes import client

from controller.lease.visible_state import LABEL_STATE
from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import Engine, activate, set_faults
from e2e.harness.waiting import eventually, eventually_async
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

SHORT = '--timeouts={"wake_s": 3, "sleep_s": 5, "probe_s": 5, "drain_s": 2}'


def _labels(kube_api: client.ApiClient, namespace: str) -> dict[str, str]:
    pods = client.CoreV1Api(kube_api).list_namespaced_pod(namespace).items
    return {p.metadata.name: (p.metadata.labels or {}).get(LABEL_STATE, "") for p in pods}


def _reasons(kube_api: client.ApiClient, namespace: str) -> set[tuple[str, str, str]]:
    """(pod, reason, first word of the note) of every Event rota's controller wrote."""
    events = client.EventsV1Api(kube_api).list_namespaced_event(namespace).items
    return {(e.regarding.name, e.reason, (e.note or "").split(":")[0]) for e in events
            if e.reporting_controller == "gpu.rota.dev/lease-controller"}


def _conditions(kube_api: client.ApiClient, namespace: str, claim: str) -> dict[str, str]:
    obj: dict[str, Any] = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(
        "resource.k8s.io", "v1", namespace, "resourceclaims", claim)
    found: dict[str, str] = {}
    for device in obj.get("status", {}).get("devices") or []:
        if device.get("driver") == "gpu.rota.dev":
            found |= {c["type"]: c["status"] for c in device.get("conditions") or []}
    return found


async def test_switches_show_in_events_labels_and_claim_conditions(
        kube_api: client.ApiClient, engine_node: GpuNode, two_engines: list[Engine],
        namespace: str) -> None:
    a, b = two_engines
    engine_node.start_controller(extra=[SHORT])
    url = engine_node.controller_url()
    async with aiohttp.ClientSession() as session:
        async def serves(model: str) -> bool:
            status, _ = await activate(session, url, model)
            return status == 200

        await eventually_async(lambda: serves(MODEL_A.model), timeout=60, what="A serving")
        eventually(lambda: _labels(kube_api, namespace) == {
            a.spec.name: "awake", b.spec.name: "asleep"}, timeout=30, what="labels A awake")
        assert await serves(MODEL_B.model)
        eventually(lambda: _labels(kube_api, namespace) == {
            a.spec.name: "asleep", b.spec.name: "awake"}, timeout=30, what="labels B awake")
        eventually(lambda: {(b.spec.name, "SwitchedIn"), (a.spec.name, "SwitchedOut")} <= {
            (pod, reason) for pod, reason, _ in _reasons(kube_api, namespace)},
            timeout=30, what="SwitchedIn and SwitchedOut Events")
        eventually(lambda: _conditions(kube_api, namespace, b.spec.name) == {
            "Awake": "True", "Ready": "True"}, timeout=30, what="B's claim Awake")
        eventually(lambda: _conditions(kube_api, namespace, a.spec.name) == {
            "Awake": "False", "Ready": "True"}, timeout=30, what="A's claim asleep")

        # A wake that runs out of GPU memory: a Warning with a CamelCase cause on A's pod.
        await set_faults(session, a, wake_fails=True)
        status, body = await activate(session, url, MODEL_A.model)
        assert status == 503, body
        eventually(lambda: (a.spec.name, "SwitchFailed", "GPUOutOfMemory")
                   in _reasons(kube_api, namespace), timeout=30, what="SwitchFailed Event")
        # B was woken back: it is the holder again and says so.
        eventually(lambda: _labels(kube_api, namespace)[b.spec.name] == "awake",
                   timeout=30, what="B awake again")
