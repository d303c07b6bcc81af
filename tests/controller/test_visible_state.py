"""What kubectl shows of rota: the bodies (pure), and the writes against the real API server."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import pytest
from kubernetes import client

from controller.claimants import Claimant, claimants_from
from controller.lease.visible_state import (
    LABEL_STATE,
    EngineState,
    EventReason,
    Occurrence,
    camel_cause,
    claim_ref,
    event_body,
    merged_devices,
    pod_ref,
)
from controller.lease.visible_state_writer import VisibleStateKube, VisibleStateWriter
from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import Engine

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(("reason", "cause"), [
    ("gpu_oom", "GPUOutOfMemory"), ("memory_not_returned", "MemoryNotReturned"),
    ("host_oom", "HostOutOfMemory"), ("probe_wrong_content", "ProbeWrongContent"),
    ("engine_dead", "EngineDead"), ("", "Unknown"), ("!!", "Unknown"),
])
def test_failure_reasons_become_camel_case_causes(reason: str, cause: str) -> None:
    assert camel_cause(reason) == cause


def _claimant(**changes: object) -> Claimant:
    claim = {"metadata": {"uid": "c-1", "namespace": "ns", "name": "model-a"},
             "spec": {"devices": {"config": [{"opaque": {"driver": "gpu.rota.dev", "parameters": {
                 "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                 "model": "org/a", "awakeMemory": "20Gi"}}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"driver": "gpu.rota.dev", "pool": "node-1", "device": "gpu-0",
                  "request": "gpu"}]}},
                 "reservedFor": [{"resource": "pods", "name": "pod-a", "uid": "p-1"}]}}
    pod = {"metadata": {"uid": "p-1", "name": "pod-a", "namespace": "ns"},
           "status": {"podIP": "10.0.0.1"}}
    (found,) = claimants_from([claim], {"p-1": pod})
    return found


def test_a_failed_switch_is_a_warning_about_the_pod_related_to_its_claim() -> None:
    claimant = _claimant()
    ref = pod_ref(claimant)
    assert ref is not None
    body = event_body(Occurrence(ref, EventReason.SWITCH_FAILED, "GPUOutOfMemory: no room",
                                 related=claim_ref(claimant)), instance="ctl-0", now=NOW)
    assert body["type"] == "Warning"
    assert body["reason"] == "SwitchFailed"
    assert body["regarding"]["kind"] == "Pod"
    assert body["related"]["kind"] == "ResourceClaim"
    assert body["eventTime"].startswith("2026-12-01T12:00:00")
    assert body["note"].startswith("GPUOutOfMemory")


@pytest.fixture
async def writer(kube_api: client.ApiClient) -> AsyncIterator[VisibleStateWriter]:
    stop = asyncio.Event()
    visible = VisibleStateWriter(VisibleStateKube(kube_api), instance="test-controller")
    task = asyncio.create_task(visible.run(stop))
    try:
        yield visible
    finally:
        stop.set()
        await task


def _claimants(kube_api: client.ApiClient, node: GpuNode) -> list[Claimant]:
    claims = client.CustomObjectsApi(kube_api).list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceclaims")["items"]
    pods = {p.metadata.uid: kube_api.sanitize_for_serialization(p) for p in
            client.CoreV1Api(kube_api).list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node.name}").items}
    return claimants_from(claims, pods, node=node.name)


async def _settled(writer: VisibleStateWriter) -> None:
    async with asyncio.timeout(30):
        await writer.idle.wait()


@pytest.mark.cluster
@pytest.mark.controller
async def test_events_labels_and_conditions_reach_the_api(
        kube_api: client.ApiClient, engine_node: GpuNode, two_engines: list[Engine],
        namespace: str, writer: VisibleStateWriter) -> None:
    a, b = _claimants(kube_api, engine_node)
    for _ in range(3):  # repeats join one Event's series
        ref = pod_ref(a)
        assert ref is not None
        writer.record(Occurrence(ref, EventReason.SWITCHED_IN, "woke org/model-a",
                                 related=claim_ref(a)))
        await _settled(writer)
    writer.pod_state(a, EngineState.AWAKE)
    writer.pod_state(b, EngineState.ASLEEP)
    writer.claim_conditions(a, awake=True, ready=True, reason="SwitchedIn", message="holder")
    writer.claim_conditions(b, awake=False, ready=True, reason="SwitchedOut", message="asleep")
    await _settled(writer)

    events = client.EventsV1Api(kube_api).list_namespaced_event(namespace).items
    switched = [e for e in events if e.reason == "SwitchedIn"]
    assert len(switched) == 1
    assert switched[0].series.count == 3
    assert switched[0].regarding.uid == a.pod_uid

    core = client.CoreV1Api(kube_api)
    assert a.pod_name is not None
    assert b.pod_name is not None
    assert core.read_namespaced_pod(a.pod_name, namespace).metadata.labels[LABEL_STATE] == "awake"
    assert core.read_namespaced_pod(b.pod_name, namespace).metadata.labels[LABEL_STATE] == "asleep"

    claim = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(
        "resource.k8s.io", "v1", namespace, "resourceclaims", a.claim_name)
    (device,) = claim["status"]["devices"]
    assert (device["driver"], device["pool"], device["device"]) == (
        "gpu.rota.dev", engine_node.name, a.device)
    conditions = {c["type"]: c["status"] for c in device["conditions"]}
    assert conditions == {"Awake": "True", "Ready": "True"}
    assert claim["status"]["allocation"]  # the apply left the allocation alone


def test_other_drivers_device_entries_are_kept() -> None:
    theirs = {"driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0",
              "conditions": []}
    stale = {"driver": "gpu.rota.dev", "pool": "node-1", "device": "gpu-0",
             "conditions": [{"type": "Awake", "status": "False"}]}
    ours = {"driver": "gpu.rota.dev", "pool": "node-1", "device": "gpu-0",
            "conditions": [{"type": "Awake", "status": "True"}]}
    assert merged_devices([theirs, stale], [ours]) == [theirs, ours]
