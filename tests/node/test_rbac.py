"""rota's service accounts with the real, node-bound tokens the kubelet projected into
their pods: each may do what its component does and nothing more (``kubectl auth can-i``
with the pod's token), and the driver's token cannot write another node's ResourceSlice
(RBAC allows slices cluster-wide; the chart's ValidatingAdmissionPolicy keeps each node's
driver to its own node)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.harness.deploy import NAMESPACE, is_ready
from e2e.harness.rota_node import RotaOnNodes, client_with_token, exec_in
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root]

TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
READ_TOKEN = ["python", "-c", f"print(open({TOKEN!r}).read())"]
# (verb, group, resource, namespace or "" for cluster-wide); subresources as "pods/exec".
Check = tuple[str, str, str, str]
NEVER: list[Check] = [
    ("get", "", "secrets", NAMESPACE), ("list", "", "secrets", ""),
    ("create", "", "pods", "default"), ("delete", "", "pods", "default"),
    ("create", "", "pods/exec", "default"), ("update", "", "nodes", ""),
    ("create", "", "serviceaccounts/token", NAMESPACE),
    ("create", "resource.k8s.io", "deviceclasses", ""),
    ("create", "rbac.authorization.k8s.io", "clusterrolebindings", ""),
    ("delete", "coordination.k8s.io", "leases", NAMESPACE),
    ("update", "coordination.k8s.io", "leases", "kube-system"),
]
MUST: dict[str, list[Check]] = {
    "driver": [("get", "", "nodes", ""), ("get", "resource.k8s.io", "resourceclaims", "x"),
               ("list", "", "pods", ""),  # the ledger's garbage collection, by spec.nodeName
               *[(v, "resource.k8s.io", "resourceslices", "")
                 for v in ("list", "watch", "create", "update", "delete")]],
    "controller": [("get", "resource.k8s.io", "resourceclaims", "x"),
                   ("list", "resource.k8s.io", "resourceslices", ""),
                   ("watch", "resource.k8s.io", "resourceslices", ""),
                   ("watch", "", "pods", ""),  # its node's, by spec.nodeName
                   ("update", "resource.k8s.io", "resourceclaims/status", "x"),
                   ("list", "", "pods", ""), ("patch", "", "pods", "x"),
                   ("create", "events.k8s.io", "events", "x"),
                   *[(v, "coordination.k8s.io", "leases", NAMESPACE)
                     for v in ("get", "list", "watch", "create", "update")]],
    "gateway": [("list", "resource.k8s.io", "resourceclaims", ""),
                ("watch", "resource.k8s.io", "resourceclaims", ""),
                ("list", "", "pods", ""), ("watch", "", "pods", ""),
                ("list", "coordination.k8s.io", "leases", NAMESPACE),
                ("watch", "coordination.k8s.io", "leases", NAMESPACE)],
}
MUST_NOT: dict[str, list[Check]] = {
    "driver": [("watch", "", "pods", ""), ("get", "", "pods", "x"),
               ("update", "resource.k8s.io", "resourceclaims", "x"),
               ("create", "coordination.k8s.io", "leases", NAMESPACE)],
    # Claims are read one by one, named by the node's pods: a claim written anywhere in
    # the cluster must not reach every node's controller.
    "controller": [("list", "resource.k8s.io", "resourceclaims", ""),
                   ("watch", "resource.k8s.io", "resourceclaims", ""),
                   ("create", "resource.k8s.io", "resourceslices", ""),
                   ("update", "resource.k8s.io", "resourceclaims", "x"),
                   ("delete", "", "pods", "x")],
    # No engine API key Secret is named in manifests/ (gateway.engineApiKeySecrets).
    "gateway": [("get", "", "secrets", "default"),
                ("create", "coordination.k8s.io", "leases", NAMESPACE),
                ("update", "coordination.k8s.io", "leases", NAMESPACE),
                ("list", "resource.k8s.io", "resourceslices", ""),
                ("patch", "", "pods", "x")],
}


@pytest.fixture(scope="module")
def tokens(kube_api: client.ApiClient, rota_node: RotaOnNodes) -> dict[str, str]:
    """Each component's token, read inside its running pod."""
    out: dict[str, str] = {}
    for component in ("driver", "controller", "gateway"):
        pod = next(p for p in rota_node.deployment.pods(component) if is_ready(p))
        out[component] = exec_in(kube_api, NAMESPACE, pod.metadata.name, READ_TOKEN,
                                 container=component).strip()
    return out


@pytest.fixture
def as_component(rota_node: RotaOnNodes, tokens: dict[str, str]
                 ) -> Iterator[dict[str, client.ApiClient]]:
    clients = {c: client_with_token(rota_node.cluster, t) for c, t in tokens.items()}
    yield clients
    for api in clients.values():
        api.close()


def _can(api: client.ApiClient, check: Check) -> bool:
    verb, group, resource, namespace = check
    resource, _, sub = resource.partition("/")
    attrs: dict[str, str] = {"verb": verb, "group": group, "resource": resource}
    if sub:
        attrs["subresource"] = sub
    if namespace:
        attrs["namespace"] = namespace
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": attrs}})
    return bool(review.status.allowed)


@pytest.mark.parametrize("component", ["driver", "controller", "gateway"])
def test_each_service_account_may_do_its_work_and_no_more(
        as_component: dict[str, client.ApiClient], component: str) -> None:
    api = as_component[component]
    denied = [c for c in MUST[component] if not _can(api, c)]
    allowed = [c for c in NEVER + MUST_NOT[component] if _can(api, c)]
    assert (denied, allowed) == ([], [])


def test_tokens_are_node_bound(kube_api: client.ApiClient, rota_node: RotaOnNodes,
                               tokens: dict[str, str]) -> None:
    for component, token in tokens.items():
        review = client.AuthenticationV1Api(kube_api).create_token_review(
            {"spec": {"token": token}})
        assert review.status.authenticated, component
        assert review.status.user.username == \
            f"system:serviceaccount:{NAMESPACE}:rota-{component}"
        assert review.status.user.extra["authentication.kubernetes.io/node-name"] == \
            [rota_node.node().name], component


def test_the_driver_token_cannot_write_another_nodes_slice(
        as_component: dict[str, client.ApiClient]) -> None:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "forged-slice"},
            "spec": {"driver": "gpu.rota.dev", "nodeName": "some-other-node",
                     "pool": {"name": "some-other-node", "generation": 1,
                              "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}
    objects = client.CustomObjectsApi(as_component["driver"])
    with pytest.raises(client.ApiException) as refused:
        objects.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", body)
    assert refused.value.status in (403, 422)
    assert "may not write ResourceSlices of node some-other-node" in str(refused.value.body)
