"""The lease controller's claim conditions reach claims it may not re-allocate: against the
real API server, as a user with the controller's rights on claims (get; update and patch
of the status; rota's ``status.devices`` entries) and without ``resourceclaims/binding``.

The API server compares a status write's allocation with the stored one, opaque configs
byte for byte: a claim made by kubectl (or the scheduler, copying its configs) stores them
without the spaces Python's JSON encoder writes, so sending the whole claim back changed
its allocation (422 ``status.allocation: Forbidden``) and every condition write failed."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from controller.lease.visible_state_writer import VisibleStateKube
from e2e.cluster import LocalCluster
from e2e.cluster.binaries import locate
from e2e.harness.objects import GROUP, VERSION, claim, create_claim, engine_config, read_claim

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

_STATUS_VERBS = ["update", "patch"]


@pytest.fixture
def controller_api(cluster: LocalCluster, kube_api: client.ApiClient
                   ) -> Iterator[client.ApiClient]:
    """A client acting as a user with the lease controller's rights on claims (as a user
    on no node: ``arbitrary-node`` in place of the chart's ``associated-node``)."""
    user = f"rota-claims-{uuid.uuid4().hex[:8]}"
    rbac = client.RbacAuthorizationV1Api(kube_api)
    rbac.create_cluster_role({"metadata": {"name": user}, "rules": [
        {"apiGroups": [GROUP], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": [GROUP], "resources": ["resourceclaims/status"], "verbs": _STATUS_VERBS},
        {"apiGroups": [GROUP], "resources": ["resourceclaims/driver"],
         "resourceNames": ["gpu.rota.dev"],
         "verbs": [f"arbitrary-node:{verb}" for verb in _STATUS_VERBS]}]})
    rbac.create_cluster_role_binding({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                      "name": user}]})
    api = cluster.api_client()
    api.set_default_header("Impersonate-User", user)
    try:
        yield api
    finally:
        api.close()
        rbac.delete_cluster_role_binding(user)
        rbac.delete_cluster_role(user)


def _kubectl(cluster: LocalCluster, body: dict[str, Any], *args: str) -> None:
    subprocess.run([str(locate() / "kubectl"), "--kubeconfig", str(cluster.kubeconfig),
                    *args, "-f", "-"], input=json.dumps(body), text=True, check=True,
                   capture_output=True, timeout=60)


def _allocated(body: dict[str, Any], node: str) -> dict[str, Any]:
    """``body`` allocated on ``node`` as the scheduler allocates it: the claim's configs
    copied into the allocation."""
    devices = body["spec"]["devices"]
    body["status"] = {"allocation": {"devices": {
        "results": [{"driver": "gpu.rota.dev", "pool": node, "device": "gpu-0",
                     "request": "gpu"}],
        "config": [{"source": "FromClaim", **c} for c in devices["config"]]}}}
    return body


def _entry(node: str, awake: bool) -> dict[str, Any]:
    return {"driver": "gpu.rota.dev", "pool": node, "device": "gpu-0", "conditions": [
        {"type": "Awake", "status": "True" if awake else "False", "reason": "Test",
         "message": "", "lastTransitionTime": "2026-12-07T00:00:00Z"}]}


def _awake(api: client.ApiClient, namespace: str, name: str) -> list[str]:
    devices = read_claim(api, namespace, name)["status"].get("devices") or []
    return [d["conditions"][0]["status"] for d in devices]


def _config() -> dict[str, Any]:
    return engine_config(model="org/model-a", awake="20Gi")


async def test_conditions_are_written_to_a_claim_that_kubectl_made(
        cluster: LocalCluster, kube_api: client.ApiClient, controller_api: client.ApiClient,
        namespace: str) -> None:
    node = f"alloc-{uuid.uuid4().hex[:6]}"
    body = claim("model-a", memory="20Gi", config=_config())
    body["metadata"]["namespace"] = namespace
    _kubectl(cluster, body, "create")
    _kubectl(cluster, _allocated(read_claim(kube_api, namespace, "model-a"), node),
             "replace", "--subresource=status")
    kube = VisibleStateKube(controller_api)

    for awake in (True, False):  # the first from a read claim, the second from a write's
        await kube.set_claim_devices(namespace, "model-a", [_entry(node, awake)])
        assert _awake(kube_api, namespace, "model-a") == ["True" if awake else "False"]


async def test_conditions_are_written_to_a_claim_that_a_python_client_made(
        kube_api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    node = f"alloc-{uuid.uuid4().hex[:6]}"
    create_claim(kube_api, namespace, claim("model-a", memory="20Gi", config=_config()))
    client.CustomObjectsApi(kube_api).replace_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "resourceclaims", "model-a",
        _allocated(read_claim(kube_api, namespace, "model-a"), node))
    kube = VisibleStateKube(controller_api)

    for awake in (True, False):
        await kube.set_claim_devices(namespace, "model-a", [_entry(node, awake)])
        assert _awake(kube_api, namespace, "model-a") == ["True" if awake else "False"]
