"""The lease controller learns its claims from its node's pods, never from a cluster-wide
claim watch: against the real API server, as a user whose RBAC is the chart's (GET on
claims; no list, no watch)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from controller.lease.cache import NodeCache
from e2e.cluster import LocalCluster
from e2e.harness.objects import GROUP, VERSION, claim, create_claim, engine_config
from e2e.harness.waiting import eventually_async

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

DEADLINE_S = 30.0


@pytest.fixture
def scoped_api(cluster: LocalCluster, kube_api: client.ApiClient, namespace: str
               ) -> Iterator[client.ApiClient]:
    """A client acting as a user with the controller's rights on claims, pods, slices and
    its namespace's Leases, and nothing more."""
    user = f"rota-scope-{uuid.uuid4().hex[:8]}"
    rbac = client.RbacAuthorizationV1Api(kube_api)
    role: dict[str, Any] = {"metadata": {"name": user}, "rules": [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]}
    rbac.create_cluster_role(role)
    binding: dict[str, Any] = {
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
    rbac.create_cluster_role_binding(binding)
    api = cluster.api_client()
    api.set_default_header("Impersonate-User", user)
    try:
        yield api
    finally:
        api.close()
        rbac.delete_cluster_role_binding(user)
        rbac.delete_cluster_role(user)


def _pod(name: str, node: str, claim_name: str) -> dict[str, Any]:
    # Bound by name, no kubelet behind it: the pod watch on spec.nodeName sees it.
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node,
                     "containers": [{"name": "engine", "image": "none",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}]}}


def _allocate(api: client.ApiClient, namespace: str, name: str, node: str, pod: Any) -> None:
    """What the scheduler writes before it binds the pod: the allocation on the node's
    pool and the reservation for the pod."""
    objects = client.CustomObjectsApi(api)
    body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, "resourceclaims",
                                                name)
    body["status"] = {
        "allocation": {"devices": {"results": [
            {"driver": "gpu.rota.dev", "pool": node, "device": "gpu-0", "request": "gpu"}]}},
        "reservedFor": [{"resource": "pods", "name": pod.metadata.name,
                         "uid": pod.metadata.uid}]}
    objects.replace_namespaced_custom_object_status(GROUP, VERSION, namespace,
                                                    "resourceclaims", name, body)


def _names(cache: NodeCache) -> set[str]:
    return {c.claim_name for c in cache.claimants()}


async def test_claims_come_from_the_nodes_pods_with_get_alone(
        kube_api: client.ApiClient, scoped_api: client.ApiClient, namespace: str) -> None:
    node = f"scope-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(kube_api)
    create_claim(kube_api, namespace, claim("model-a", memory="20Gi",
                                            config=engine_config(model="org/a", awake="20Gi")))
    pod_a = core.create_namespaced_pod(namespace, _pod("engine-a", node, "model-a"))
    _allocate(kube_api, namespace, "model-a", node, pod_a)
    # A claim of a pod on another node, and one no pod names: never read.
    for other in ("elsewhere", "unused"):
        create_claim(kube_api, namespace, claim(other, memory="20Gi",
                                                config=engine_config(model="org/x",
                                                                     awake="20Gi")))
    core.create_namespaced_pod(namespace, _pod("engine-x", "another-node", "elsewhere"))

    cache = NodeCache(scoped_api, node=node, watch_timeout_s=30)
    cache.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            await cache.wait_synced()  # with a claim watch: 403 on every list, never synced
        assert [(c.claim_name, c.model, c.pod_name) for c in cache.claimants()] == [
            ("model-a", "org/a", "engine-a")]
        assert cache.claim_gets == 1

        # A pod that names its claim before the claim is there: read again until it is
        # allocated and reserved for the pod.
        pod_b = core.create_namespaced_pod(namespace, _pod("engine-b", node, "model-b"))
        async def asked() -> bool:
            return cache.claim_gets >= 2

        await eventually_async(asked, timeout=DEADLINE_S, what="the new pod's claim asked for")
        create_claim(kube_api, namespace, claim("model-b", memory="20Gi",
                                                config=engine_config(model="org/b",
                                                                     awake="20Gi")))
        _allocate(kube_api, namespace, "model-b", node, pod_b)
        assert await cache.wait_for(lambda: "model-b" in _names(cache), DEADLINE_S), \
            "the late claim was never read again"

        # The pod goes: so does its claim.
        core.delete_namespaced_pod("engine-a", namespace, grace_period_seconds=0)
        assert await cache.wait_for(lambda: _names(cache) == {"model-b"}, DEADLINE_S)
    finally:
        await cache.stop()
