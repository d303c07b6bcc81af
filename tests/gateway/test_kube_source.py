"""On the local cluster: the gateway's routing state follows claims, pods and Leases."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from controller.claimants import claimants_from
from controller.gateway import kube_source
from controller.gateway.binding import ModelBinding
from controller.gateway.kube_source import KubeSource
from controller.gateway.routing import Action, RoutingState
from controller.gateway.settings import GatewaySettings
from e2e.cluster import create_node
from rota.api import naming
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease

pytestmark = [pytest.mark.cluster, pytest.mark.gateway]

GROUP, VERSION = "resource.k8s.io", "v1"
MODEL = "org/model-x"
DEADLINE = 60.0


async def _until(state: RoutingState, check: Callable[[], bool], what: str) -> None:
    """Wait for watch events until ``check`` holds (bounded)."""
    try:
        async with asyncio.timeout(DEADLINE):
            while not check():
                await state.wait_changed(state.version, DEADLINE)
    except TimeoutError:
        raise AssertionError(f"{what}: not seen within {DEADLINE}s") from None


def _claim(name: str, port: int) -> dict[str, Any]:
    config = {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig", "model": MODEL,
              "awakeMemory": "10Gi", "sleepLevel": 1, "enginePort": port}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.rota.dev"}}],
            "config": [{"requests": ["gpu"],
                        "opaque": {"driver": "gpu.rota.dev", "parameters": config}}]}},
    }


def _pod(name: str, node: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeName": node,
                 "containers": [{"name": "engine", "image": "rota/engine-simulator",
                                 "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]},
    }


async def test_routing_state_follows_watch_events(kube_api: client.ApiClient,
                                                  namespace: str) -> None:
    objects = client.CustomObjectsApi(kube_api)
    core = client.CoreV1Api(kube_api)
    leases = client.CoordinationV1Api(kube_api)
    node = f"gw-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(create_node, kube_api, node)

    settings = GatewaySettings(controller_namespace=namespace, watch_timeout_s=5,
                               resync_s=30)
    state = RoutingState(binding=ModelBinding(namespaces=(namespace,)))
    source = asyncio.create_task(KubeSource(settings, api=kube_api).run(state))
    try:
        await _until(state, lambda: state.synced, "first lists")
        assert not state.knows(MODEL)

        # A claim allocated by rota's driver, reserved for a pod that runs and is ready.
        claim = await asyncio.to_thread(objects.create_namespaced_custom_object, GROUP,
                                        VERSION, namespace, "resourceclaims",
                                        _claim("engine-x", 8000))
        pod = await asyncio.to_thread(core.create_namespaced_pod, namespace,
                                      _pod("engine-x", node, "engine-x"))
        await asyncio.to_thread(
            objects.patch_namespaced_custom_object_status, GROUP, VERSION, namespace,
            "resourceclaims", "engine-x", {"status": {
                "allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": "gpu.rota.dev", "pool": node,
                    "device": "gpu-0"}]}},
                "reservedFor": [{"resource": "pods", "name": "engine-x",
                                 "uid": pod.metadata.uid}]}})
        await _until(state, lambda: state.knows(MODEL), "the claim")
        # Other tests of the session may hold claims in their own namespaces.
        assert namespace in state.claim_namespaces()
        await asyncio.to_thread(core.patch_namespaced_pod_status, "engine-x", namespace, {
            "status": {"phase": "Running", "podIP": "10.9.0.5", "podIPs": [{"ip": "10.9.0.5"}],
                       "conditions": [{"type": "Ready", "status": "True"}]}})
        await _until(state, lambda: state.decide(MODEL).reason == "no_controller",
                     "the pod serving (watched in the claim's namespace)")

        # The node's controller Lease gives the activation URL: the model can be woken.
        ctl = controller_lease("http://10.9.0.1:8085", node=node)
        ctl["metadata"]["namespace"] = namespace
        await asyncio.to_thread(leases.create_namespaced_lease, namespace, ctl)
        await _until(state, lambda: state.decide(MODEL).action is Action.ACTIVATE,
                     "the controller Lease")
        assert state.decide(MODEL).activation_url == "http://10.9.0.1:8085"

        # The GPU Lease names the claim as holder: requests go straight to the engine.
        ref = f"{namespace}/engine-x"
        lease = gpu_lease(holder=ref, state=naming.STATE_AWAKE, model=MODEL,
                          endpoint="http://10.9.0.77:9999", node=node,
                          holder_uid=claim["metadata"]["uid"])
        lease["metadata"]["namespace"] = namespace
        await asyncio.to_thread(leases.create_namespaced_lease, namespace, lease)
        await _until(state, lambda: state.decide(MODEL).action is Action.FORWARD,
                     "the GPU Lease")
        assert state.decide(MODEL).endpoint == "http://10.9.0.5:8000"  # the pod IP

        # A switch away from it: its requests are held.
        await asyncio.to_thread(
            leases.patch_namespaced_lease, lease["metadata"]["name"], namespace,
            {"metadata": {"annotations": {naming.STATE: naming.STATE_SWITCHING,
                                          naming.DRAINING_MODEL: MODEL,
                                          naming.TARGET_MODEL: "org/other"}}})
        await _until(state, lambda: state.decide(MODEL).action is Action.WAIT, "the switch")

        # The claim goes away: so does the model, and the pod watch of its namespace.
        await asyncio.to_thread(objects.delete_namespaced_custom_object, GROUP, VERSION,
                                namespace, "resourceclaims", "engine-x")
        await _until(state, lambda: not state.knows(MODEL), "the claim's deletion")
        assert namespace not in state.claim_namespaces()
    finally:
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)
        await asyncio.to_thread(core.delete_node, node)


async def test_lists_are_read_page_by_page(kube_api: client.ApiClient, namespace: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of two objects: five GPU Leases take three pages, and all five are kept."""
    monkeypatch.setattr(kube_source, "LIST_PAGE", 2)
    leases = client.CoordinationV1Api(kube_api)
    nodes = [f"paged-{i}" for i in range(5)]
    for node in nodes:
        lease = gpu_lease(holder=None, state=naming.STATE_IDLE, node=node)
        lease["metadata"]["namespace"] = namespace
        await asyncio.to_thread(leases.create_namespaced_lease, namespace, lease)
    settings = GatewaySettings(controller_namespace=namespace, watch_timeout_s=5, resync_s=30)
    state = RoutingState(binding=ModelBinding(namespaces=(namespace,)))
    source = asyncio.create_task(KubeSource(settings, api=kube_api).run(state))
    try:
        await _until(state, lambda: state.synced, "first lists")
        found = claimants_from([claim_obj(f"c-{node}", model=MODEL, port=8000,
                                          pod_uid=f"p-{node}", node=node)
                                for node in nodes], {})
        assert len(found) == len(nodes)
        assert all(state.lease_of(c) is not None for c in found)
    finally:
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)
