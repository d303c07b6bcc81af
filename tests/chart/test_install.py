"""``helm install``, ``upgrade`` and ``uninstall`` against the real API server, and least
privilege proven with real tokens.

Service-account tokens are minted with the TokenRequest API, bound to Pod objects bound to
Node objects, exactly as the kubelet asks for a pod's token: the API server then puts the
node's name in the token (``authentication.kubernetes.io/node-name``), which the
ValidatingAdmissionPolicies read. Nothing here needs a kubelet: no pod runs (the release's
pods stay Pending on nodes nobody labelled), only the API's answers are checked.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from controller.credentials import PLACEHOLDERS
from e2e.cluster import LocalCluster
from e2e.cluster.nodes import create_node, node_body
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import claim
from e2e.harness.rota_node import client_with_token
from e2e.harness.scenario import deploy
from e2e.harness.waiting import eventually
from e2e.release.chart import CHART, run_tool
from rota.api import naming
from rota.api.gpu_lease import GpuLease, lease_body
from tests.engines_on_cluster import MODEL_A, MODEL_B

pytestmark = pytest.mark.cluster

GROUP, VERSION = "resource.k8s.io", "v1"
ENGINE_KEY = "engine-api-key"
"""The one engine API key Secret name the release lets the gateway read."""


@dataclass
class Release:
    name: str
    namespace: str
    engines: str
    nodes: tuple[str, str]
    cluster: LocalCluster
    api: client.ApiClient
    bin_dir: Path
    env: dict[str, str]
    installed: bool = False

    @property
    def fullname(self) -> str:
        return f"{self.name}-rota"

    def sa(self, component: str) -> str:
        return f"{self.fullname}-{component}"

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_tool("helm", [*args, "--kubeconfig", str(self.cluster.kubeconfig)],
                        bin_dir=self.bin_dir, env=self.env, timeout_s=300, check=check)

    def values(self, *extra: str) -> list[str]:
        args = ["--namespace", self.namespace,
                # The DeviceClass is shared by the session's other tests.
                "--set", "deviceClass.create=false",
                "--set", f"engineNamespaces={{{self.engines}}}",
                "--set", f"gateway.engineApiKeySecrets={{{ENGINE_KEY}}}",
                # Nothing runs these pods: keep the gateway off every test node.
                "--set-string", "gateway.nodeSelector.rota\\.test/nowhere=true"]
        for item in extra:
            args += ["--set", item]
        return args

    def token(self, component: str, node: str | None) -> str:
        """A token of the component's service account; bound to a pod on ``node`` (so
        node-bound) or, with no node, bound to nothing."""
        core = client.CoreV1Api(self.api)
        spec: dict[str, Any] = {"expirationSeconds": 3600}
        if node is not None:
            pod = core.create_namespaced_pod(self.namespace, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{component}-{node[:40].rstrip('.-')}-"
                                     f"{uuid.uuid4().hex[:6]}"},
                "spec": {"serviceAccountName": self.sa(component), "nodeName": node,
                         "automountServiceAccountToken": False,
                         "containers": [{"name": component, "image": "rota/none:0"}]}})
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1",
                                      "name": pod.metadata.name, "uid": pod.metadata.uid}
        answer = core.create_namespaced_service_account_token(
            self.sa(component), self.namespace, {"spec": spec})
        return str(answer.status.token)

    def as_token(self, token: str) -> client.ApiClient:
        return client_with_token(self.cluster, token)


@pytest.fixture(scope="module")
def release(cluster: LocalCluster, kube_api: client.ApiClient, chart_bin: Path,
            helm_home: dict[str, str]) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:8]
    rel = Release(name=f"rt{suffix}", namespace=f"rota-rt{suffix}", engines=f"eng-{suffix}",
                  nodes=(f"gpu-a-{suffix}", f"gpu-b-{suffix}"), cluster=cluster,
                  api=kube_api, bin_dir=chart_bin, env=helm_home)
    core = client.CoreV1Api(kube_api)
    for ns in (rel.namespace, rel.engines):
        core.create_namespace({"metadata": {"name": ns}})
    for node in rel.nodes:
        create_node(kube_api, node)
    try:
        rel.helm("install", rel.name, str(CHART), *rel.values())
        rel.installed = True
        yield rel
    finally:
        if rel.installed:
            rel.helm("uninstall", rel.name, "--namespace", rel.namespace, check=False)
        for ns in (rel.namespace, rel.engines):
            core.delete_namespace(ns)
        for node in rel.nodes:
            core.delete_node(node)


def _token_of(release: Release) -> str:
    secret = client.CoreV1Api(release.api).read_namespaced_secret(
        f"{release.fullname}-activation-token", release.namespace)
    return base64.b64decode(secret.data["token"]).decode()


def test_install_generates_a_random_token_and_upgrade_keeps_it(release: Release) -> None:
    token = _token_of(release)
    assert token not in PLACEHOLDERS
    assert len(token) == 48
    apps = client.AppsV1Api(release.api)
    before = apps.read_namespaced_daemon_set(f"{release.fullname}-controller", release.namespace)

    release.helm("upgrade", release.name, str(CHART), *release.values(
        "controller.minResidencySeconds=7"))

    assert _token_of(release) == token
    after = apps.read_namespaced_daemon_set(f"{release.fullname}-controller", release.namespace)
    env = {e.name: e.value for e in after.spec.template.spec.containers[0].env}
    assert env["ROTA_MIN_RESIDENCY_S"] == "7"
    assert after.metadata.generation == before.metadata.generation + 1  # a rolling update
    driver = apps.read_namespaced_daemon_set(f"{release.fullname}-driver", release.namespace)
    assert driver.metadata.generation == 1  # a controller setting leaves the driver alone


# -- least privilege: RBAC ----------------------------------------------------------------

Rule = tuple[str, str, str, str]  # (api group, resource, verb, resource name or "")


def _rules(api: client.ApiClient, namespace: str) -> set[Rule]:
    review = client.AuthorizationV1Api(api).create_self_subject_rules_review(
        {"spec": {"namespace": namespace}})
    out: set[Rule] = set()
    for rule in review.status.resource_rules:
        for group in rule.api_groups:
            for resource in rule.resources:
                for verb in rule.verbs:
                    for name in rule.resource_names or [""]:
                        out.add((group, resource, verb, name))
    return out


def _expected(release: Release) -> dict[str, dict[str, set[Rule]]]:
    """Per service account and namespace: every rule it holds beyond what any service
    account holds (discovery, self reviews)."""
    rs, core, coord, ev = "resource.k8s.io", "", "coordination.k8s.io", "events.k8s.io"
    driver = {(core, "nodes", "get", ""), (rs, "resourceclaims", "get", ""),
              (core, "pods", "list", ""),
              *((rs, "resourceslices", v, "") for v in ("list", "watch", "create", "update",
                                                         "delete"))}
    controller = {(rs, "resourceclaims", "get", ""),
                  (rs, "resourceslices", "list", ""), (rs, "resourceslices", "watch", ""),
                  (rs, "resourceclaims/status", "update", ""),
                  (rs, "resourceclaims/status", "patch", ""),
                  (rs, "resourceclaims/driver", "associated-node:update", "gpu.rota.dev"),
                  (rs, "resourceclaims/driver", "associated-node:patch", "gpu.rota.dev"),
                  (core, "pods", "list", ""), (core, "pods", "watch", ""),
                  (core, "pods", "patch", ""),
                  (ev, "events", "create", ""), (ev, "events", "patch", "")}
    leases_rw = {(coord, "leases", v, "") for v in ("get", "list", "watch", "create", "update")}
    # Claims only in engineNamespaces, as pods (a Role each; no ClusterRole).
    gateway = {(rs, "resourceclaims", "list", ""), (rs, "resourceclaims", "watch", "")}
    leases_ro = {(coord, "leases", v, "") for v in ("list", "watch")}
    pods_ro = {(core, "pods", v, "") for v in ("list", "watch")}
    return {
        "driver": {release.namespace: driver, release.engines: driver, "default": driver},
        "controller": {release.namespace: controller | leases_rw,
                       release.engines: controller, "default": controller},
        "gateway": {release.namespace: leases_ro,
                    release.engines: gateway | pods_ro | {(core, "secrets", "get", ENGINE_KEY)},
                    "default": set()},
    }


def test_each_service_account_holds_exactly_what_it_uses(release: Release) -> None:
    client.CoreV1Api(release.api).create_namespaced_service_account(
        release.namespace, {"metadata": {"name": "nobody"}})
    nobody = release.as_token(str(client.CoreV1Api(release.api)
                                  .create_namespaced_service_account_token(
                                      "nobody", release.namespace, {"spec": {}})
                                  .status.token))
    for component, namespaces in _expected(release).items():
        api = release.as_token(release.token(component, None))
        for namespace, want in namespaces.items():
            extra = _rules(api, namespace) - _rules(nobody, namespace)
            assert extra == want, (component, namespace, sorted(extra ^ want))


CAN_I: list[tuple[str, str, str, str, str, bool]] = [
    # component, verb, group, resource[/subresource][:name], namespace ("" cluster,
    # "@" release, "+" engines)
    ("driver", "create", "resource.k8s.io", "resourceslices", "", True),
    ("driver", "patch", "resource.k8s.io", "resourceslices", "", False),
    ("driver", "deletecollection", "resource.k8s.io", "resourceslices", "", False),
    ("driver", "get", "resource.k8s.io", "resourceclaims", "+", True),
    ("driver", "list", "resource.k8s.io", "resourceclaims", "", False),
    ("driver", "list", "", "pods", "", True),  # with spec.nodeName=<node>, for the ledger GC
    ("driver", "get", "", "pods", "+", False),
    ("driver", "watch", "", "pods", "", False),
    ("driver", "get", "", "secrets", "@", False),
    ("driver", "update", "coordination.k8s.io", "leases", "@", False),
    ("controller", "update", "coordination.k8s.io", "leases", "@", True),
    ("controller", "update", "coordination.k8s.io", "leases", "default", False),
    ("controller", "delete", "coordination.k8s.io", "leases", "@", False),
    ("controller", "list", "", "pods", "", True),
    ("controller", "watch", "", "pods", "", True),  # with spec.nodeName=<node>: its cache
    # Claims come from its node's pods, one GET each: never a cluster-wide watch.
    ("controller", "watch", "resource.k8s.io", "resourceclaims", "", False),
    ("controller", "list", "resource.k8s.io", "resourceclaims", "", False),
    ("controller", "watch", "coordination.k8s.io", "leases", "@", True),
    ("controller", "watch", "resource.k8s.io", "resourceslices", "", True),
    ("controller", "update", "resource.k8s.io", "resourceslices", "", False),
    ("controller", "patch", "", "pods", "+", True),
    ("controller", "delete", "", "pods", "+", False),
    ("controller", "create", "", "pods", "+", False),
    ("controller", "get", "", "secrets", "@", False),
    ("controller", "update", "resource.k8s.io", "resourceclaims/status", "+", True),
    ("controller", "update", "resource.k8s.io", "resourceclaims", "+", False),
    ("controller", "create", "resource.k8s.io", "resourceslices", "", False),
    ("controller", "create", "events.k8s.io", "events", "+", True),
    ("controller", "create", "", "namespaces", "", False),
    ("gateway", "watch", "resource.k8s.io", "resourceclaims", "", False),
    ("gateway", "watch", "resource.k8s.io", "resourceclaims", "+", True),
    ("gateway", "list", "resource.k8s.io", "resourceclaims", "default", False),
    ("gateway", "watch", "", "pods", "+", True),
    ("gateway", "list", "", "pods", "default", False),
    ("gateway", "watch", "coordination.k8s.io", "leases", "@", True),
    ("gateway", "update", "coordination.k8s.io", "leases", "@", False),
    ("gateway", "get", "", "secrets", "@", False),
    ("gateway", "get", "", f"secrets:{ENGINE_KEY}", "+", True),
    ("gateway", "get", "", "secrets:db-password", "+", False),
    ("gateway", "get", "", "secrets", "+", False),
    ("gateway", "get", "", f"secrets:{ENGINE_KEY}", "default", False),
    ("gateway", "get", "", f"secrets:{ENGINE_KEY}", "@", False),
    ("gateway", "list", "", "secrets", "+", False),
    ("gateway", "patch", "", "pods", "+", False),
]


def test_can_i_table(release: Release) -> None:
    authz = client.AuthorizationV1Api(release.api)
    wrong = []
    for component, verb, group, resource, where, allowed in CAN_I:
        namespace = {"": None, "@": release.namespace, "+": release.engines}.get(where, where)
        resource, _, name = resource.partition(":")
        resource_name, _, sub = resource.partition("/")
        attrs = {"verb": verb, "group": group, "resource": resource_name,
                 "subresource": sub or None, "namespace": namespace, "name": name or None}
        user = f"system:serviceaccount:{release.namespace}:{release.sa(component)}"
        review = authz.create_subject_access_review({"spec": {
            "user": user, "groups": ["system:serviceaccounts", "system:authenticated",
                                     f"system:serviceaccounts:{release.namespace}"],
            "resourceAttributes": {k: v for k, v in attrs.items() if v is not None}}})
        if review.status.allowed != allowed:
            wrong.append((component, verb, resource, where, review.status.allowed))
    assert not wrong


# -- least privilege: admission policies --------------------------------------------------


def _refused(call: Any) -> str:
    """The message of the 4xx the API server answers ``call()`` with."""
    with pytest.raises(client.ApiException) as caught:
        call()
    assert caught.value.status in (403, 422), caught.value.body
    return str(caught.value.body)


def _slice(node: str, *, driver: str = "gpu.rota.dev", pool: str | None = None
           ) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}-{uuid.uuid4().hex[:6]}"},
            "spec": {"driver": driver, "nodeName": node, "devices": [],
                     "pool": {"name": pool or node, "generation": 1,
                              "resourceSliceCount": 1}}}


def _wait_for_policy(call: Any) -> None:
    """A new policy takes effect once the API server's policy cache has it."""
    def refused() -> bool:
        try:
            call()
        except client.ApiException as exc:
            return exc.status in (403, 422) and "may not" in str(exc.body)
        return False
    eventually(refused, timeout=30, what="the admission policy in effect")


def test_a_driver_writes_only_its_own_nodes_slices(release: Release) -> None:
    node_a, node_b = release.nodes
    admin = client.CustomObjectsApi(release.api)
    theirs = admin.create_cluster_custom_object(GROUP, VERSION, "resourceslices", _slice(node_b))
    driver_a = client.CustomObjectsApi(release.as_token(release.token("driver", node_a)))
    _wait_for_policy(lambda: driver_a.create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", _slice(node_b), dry_run="All"))

    mine = driver_a.create_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                 _slice(node_a))
    mine["spec"]["pool"]["generation"] = 2
    mine = driver_a.replace_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                  mine["metadata"]["name"], mine)

    assert f"node {node_b}" in _refused(lambda: driver_a.create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", _slice(node_b)))
    theirs["spec"]["pool"]["generation"] = 2
    _refused(lambda: driver_a.replace_cluster_custom_object(
        GROUP, VERSION, "resourceslices", theirs["metadata"]["name"], theirs))
    _refused(lambda: driver_a.delete_cluster_custom_object(
        GROUP, VERSION, "resourceslices", theirs["metadata"]["name"]))
    moved = dict(mine, spec={**mine["spec"], "nodeName": node_b})
    _refused(lambda: driver_a.replace_cluster_custom_object(
        GROUP, VERSION, "resourceslices", mine["metadata"]["name"], moved))
    assert "driver gpu.nvidia.com" in _refused(lambda: driver_a.create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", _slice(node_a, driver="gpu.nvidia.com")))
    unbound = client.CustomObjectsApi(release.as_token(release.token("driver", None)))
    assert "no node" in _refused(lambda: unbound.create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", _slice(node_a)))
    # Devices are known by driver/pool/device: a slice of its own node naming another
    # node's pool would take that node's GPU identity (the scheduler counts the forged
    # node-b/gpu-0 as allocated; controllers and gateways read the node from the pool).
    assert f"pool {node_b}" in _refused(lambda: driver_a.create_cluster_custom_object(
        GROUP, VERSION, "resourceslices", _slice(node_a, pool=node_b)))
    renamed = dict(mine, spec={**mine["spec"], "pool": {**mine["spec"]["pool"],
                                                        "name": node_b}})
    _refused(lambda: driver_a.replace_cluster_custom_object(
        GROUP, VERSION, "resourceslices", mine["metadata"]["name"], renamed))
    forged = admin.create_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                _slice(node_a, pool=node_b))
    forged["spec"]["pool"]["name"] = node_a  # the old object counts too
    _refused(lambda: driver_a.replace_cluster_custom_object(
        GROUP, VERSION, "resourceslices", forged["metadata"]["name"], forged))
    admin.delete_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                       forged["metadata"]["name"])

    driver_a.delete_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                          mine["metadata"]["name"])
    admin.delete_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                       theirs["metadata"]["name"])


def _gpu_lease(release: Release, node: str, device: str = "gpu-0") -> dict[str, Any]:
    lease = GpuLease(name=naming.gpu_lease_name(node, device), node=node, device=device)
    return lease_body(lease, release.namespace, labels_node=node, labels_device=device)


def _controller_lease(release: Release, node: str) -> dict[str, Any]:
    """A controller Lease as controller.lease.election writes it."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": naming.controller_lease_name(node),
                         "namespace": release.namespace,
                         "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
                                    naming.LABEL_KIND: naming.KIND_CONTROLLER,
                                    naming.LABEL_NODE: naming.label_value(node)},
                         "annotations": {naming.NODE_NAME: node}},
            "spec": {"holderIdentity": "controller-0", "leaseDurationSeconds": 15}}


def test_a_controller_writes_only_its_own_nodes_leases(release: Release) -> None:
    node_a, node_b = release.nodes
    ns = release.namespace
    admin = client.CoordinationV1Api(release.api)
    theirs = admin.create_namespaced_lease(ns, _gpu_lease(release, node_b))
    leases_a = client.CoordinationV1Api(release.as_token(release.token("controller", node_a)))
    _wait_for_policy(lambda: leases_a.create_namespaced_lease(
        ns, _gpu_lease(release, node_b), dry_run="All"))

    leases_a.create_namespaced_lease(ns, _controller_lease(release, node_a))
    mine = leases_a.create_namespaced_lease(ns, _gpu_lease(release, node_a))
    mine.spec.lease_transitions = 1
    leases_a.replace_namespaced_lease(mine.metadata.name, ns, mine)

    _refused(lambda: leases_a.create_namespaced_lease(ns, _controller_lease(release, node_b)))
    theirs.spec.holder_identity = "prod/hijack"
    _refused(lambda: leases_a.replace_namespaced_lease(theirs.metadata.name, ns, theirs))
    # Its own node's label on another node's Lease name, and the reverse.
    forged = _gpu_lease(release, node_b)
    forged["metadata"]["labels"][naming.LABEL_NODE] = node_a
    _refused(lambda: leases_a.create_namespaced_lease(ns, forged))
    relabelled = _gpu_lease(release, node_a, "gpu-1")
    relabelled["metadata"]["labels"][naming.LABEL_NODE] = node_b
    _refused(lambda: leases_a.create_namespaced_lease(ns, relabelled))
    # A name that only starts like one of its own.
    lookalike = _gpu_lease(release, node_a)
    lookalike["metadata"]["name"] = f"rota-gpu-{node_a}-b-gpu-0"
    _refused(lambda: leases_a.create_namespaced_lease(ns, lookalike))


def _long_node(prefix: str, length: int) -> str:
    """A valid node name of ``length`` characters (DNS labels of at most 63)."""
    labels, left = [], length
    while left > 0:
        size = min(63, left if left <= 63 else 62)
        labels.append("x" * size)
        left -= size + 1
    name = ".".join(labels)
    return (prefix + name[len(prefix):])[:length]


def test_a_controller_on_a_long_named_node_writes_only_its_own_leases(
        release: Release) -> None:
    """Past 63 characters the node label is hashed, past ~236 the Lease names are too:
    the node-name annotation (compared exactly) and the names (compared for every
    length, by their cut prefix where hashed) keep such a controller to its node."""
    ns = release.namespace
    long_a = _long_node(f"a{uuid.uuid4().hex[:6]}-pool-abcdefghijklmnopqrstuvwxyz0123", 75)
    short_c = long_a[:40] + "c"  # shares A's first 40 characters
    huge_1 = _long_node(f"h{uuid.uuid4().hex[:6]}-", 245)
    huge_2 = huge_1[:-1] + "z"  # shares all but the last character
    nodes = (long_a, short_c, huge_1, huge_2)
    for node in nodes:
        body = node_body(node)
        body["metadata"]["labels"]["kubernetes.io/hostname"] = node.split(".")[0]
        client.CoreV1Api(release.api).create_node(body)
    admin = client.CoordinationV1Api(release.api)
    try:
        theirs = admin.create_namespaced_lease(ns, _gpu_lease(release, short_c))
        huge_theirs = admin.create_namespaced_lease(ns, _controller_lease(release, huge_2))
        leases_a = client.CoordinationV1Api(release.as_token(release.token("controller",
                                                                           long_a)))
        _wait_for_policy(lambda: leases_a.create_namespaced_lease(
            ns, _gpu_lease(release, release.nodes[1]), dry_run="All"))

        leases_a.create_namespaced_lease(ns, _controller_lease(release, long_a))
        mine = leases_a.create_namespaced_lease(ns, _gpu_lease(release, long_a))
        mine.spec.lease_transitions = 1
        leases_a.replace_namespaced_lease(mine.metadata.name, ns, mine)
        # Another node's Lease name with A's label on it.
        forged = _controller_lease(release, release.nodes[1])
        forged["metadata"]["labels"][naming.LABEL_NODE] = naming.label_value(long_a)
        forged["metadata"]["annotations"][naming.NODE_NAME] = long_a
        _refused(lambda: leases_a.create_namespaced_lease(ns, forged))
        # The GPU Lease of a node whose name starts with A's first 40 characters.
        theirs.spec.holder_identity = "attacker/x"
        _refused(lambda: leases_a.replace_namespaced_lease(theirs.metadata.name, ns, theirs))
        # Its own Lease name, annotated for another node.
        other = _gpu_lease(release, long_a, "gpu-1")
        other["metadata"]["annotations"][naming.NODE_NAME] = short_c
        _refused(lambda: leases_a.create_namespaced_lease(ns, other))
        # A Lease of its own written before the annotation existed stays its own.
        older = _gpu_lease(release, long_a, "gpu-2")
        del older["metadata"]["annotations"][naming.NODE_NAME]
        older = admin.create_namespaced_lease(ns, older)
        older.spec.lease_transitions = 3
        leases_a.replace_namespaced_lease(older.metadata.name, ns, older)

        # Hashed Lease names: the cut prefixes of the two nodes are the same.
        assert naming.controller_lease_name(huge_1)[:-11] == \
            naming.controller_lease_name(huge_2)[:-11]
        leases_1 = client.CoordinationV1Api(release.as_token(release.token("controller",
                                                                           huge_1)))
        leases_1.create_namespaced_lease(ns, _controller_lease(release, huge_1))
        huge_theirs.spec.holder_identity = "controller-evil"
        _refused(lambda: leases_1.replace_namespaced_lease(huge_theirs.metadata.name, ns,
                                                           huge_theirs))
    finally:
        for lease in admin.list_namespaced_lease(ns).items:
            annotations = lease.metadata.annotations or {}
            if annotations.get(naming.NODE_NAME) in nodes or \
                    lease.metadata.labels.get(naming.LABEL_NODE) in \
                    {naming.label_value(n) for n in nodes}:
                admin.delete_namespaced_lease(lease.metadata.name, ns)
        for node in nodes:
            client.CoreV1Api(release.api).delete_node(node)


def test_a_controller_changes_only_the_state_label_of_its_nodes_pods(release: Release) -> None:
    node_a, node_b = release.nodes
    core = client.CoreV1Api(release.api)
    pods = {}
    for node in release.nodes:
        # An engine pod: it uses a claim (what the kubelet would prepare is not needed).
        pods[node] = core.create_namespaced_pod(release.engines, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"engine-{node}", "labels": {"app": "engine"}},
            "spec": {"nodeName": node,
                     "containers": [{"name": "e", "image": "e:0",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu",
                                         "resourceClaimName": f"claim-of-{node}"}]}})
    core.create_namespaced_pod(release.engines, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"not-an-engine-{node_a}", "labels": {"app": "web"}},
        "spec": {"nodeName": node_a, "containers": [{"name": "w", "image": "w:0"}]}})
    controller_a = client.CoreV1Api(release.as_token(release.token("controller", node_a)))
    state = {"metadata": {"labels": {"gpu.rota.dev/state": "awake"}}}
    _wait_for_policy(lambda: controller_a.patch_namespaced_pod(
        f"engine-{node_b}", release.engines, state, dry_run="All"))

    patched = controller_a.patch_namespaced_pod(f"engine-{node_a}", release.engines, state)
    assert patched.metadata.labels["gpu.rota.dev/state"] == "awake"
    # Only engine pods of its node, and only to a state rota writes (review 2026-12 R9).
    assert "only of engine pods" in _refused(lambda: controller_a.patch_namespaced_pod(
        f"not-an-engine-{node_a}", release.engines, state))
    _refused(lambda: controller_a.patch_namespaced_pod(
        f"engine-{node_a}", release.engines,
        {"metadata": {"labels": {"gpu.rota.dev/state": "pwned"}}}))
    _refused(lambda: controller_a.patch_namespaced_pod(
        f"engine-{node_a}", release.engines, {"metadata": {"labels": {"app": "evil"}}}))
    _refused(lambda: controller_a.patch_namespaced_pod(
        f"engine-{node_a}", release.engines,
        {"spec": {"containers": [{"name": "e", "image": "evil:0"}]}}))
    _refused(lambda: controller_a.patch_namespaced_pod(
        f"engine-{node_b}", release.engines, state))
    # A finalizer pins the pod; an ownerReference to a missing owner makes the garbage
    # collector delete it (RBAC denies delete, not these).
    mine = f"engine-{node_a}"
    _refused(lambda: controller_a.patch_namespaced_pod(
        mine, release.engines, {"metadata": {"finalizers": ["rota.test/pin"]}}))
    _refused(lambda: controller_a.patch_namespaced_pod(mine, release.engines, {"metadata": {
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "gone",
                             "uid": str(uuid.uuid4())}]}}))
    _refused(lambda: controller_a.patch_namespaced_pod(
        mine, release.engines, {"metadata": {"annotations": {"rota.test/a": "b"}}}))
    assert core.read_namespaced_pod(mine, release.engines).metadata.finalizers is None


def test_a_controller_writes_conditions_only_on_its_nodes_claims(release: Release) -> None:
    node_a, node_b = release.nodes
    objs = client.CustomObjectsApi(release.api)
    for node in release.nodes:
        created = objs.create_namespaced_custom_object(
            GROUP, VERSION, release.engines, "resourceclaims", claim(f"claim-{node}", memory=None))
        # As the scheduler allocates a node-local device: the node in the node selector.
        created["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "gpu.rota.dev", "pool": node,
                                     "device": "gpu-0"}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
        objs.replace_namespaced_custom_object_status(GROUP, VERSION, release.engines,
                                                     "resourceclaims", f"claim-{node}", created)
    controller_a = client.CustomObjectsApi(release.as_token(release.token("controller", node_a)))

    def with_conditions(node: str) -> dict[str, Any]:
        current = objs.get_namespaced_custom_object(GROUP, VERSION, release.engines,
                                                    "resourceclaims", f"claim-{node}")
        current["status"]["devices"] = [{
            "driver": "gpu.rota.dev", "pool": node, "device": "gpu-0",
            "conditions": [{"type": "Awake", "status": "True", "reason": "Holder",
                            "message": "holds the GPU", "observedGeneration": 1,
                            "lastTransitionTime": "2026-12-01T09:00:00Z"}]}]
        return dict(current)

    def write(node: str, dry_run: str | None = None) -> Any:
        kwargs = {"dry_run": dry_run} if dry_run else {}
        return controller_a.replace_namespaced_custom_object_status(
            GROUP, VERSION, release.engines, "resourceclaims", f"claim-{node}",
            with_conditions(node), **kwargs)

    written = write(node_a)
    assert written["status"]["devices"][0]["conditions"][0]["type"] == "Awake"
    # The API server itself keeps a driver's status writes to claims of its own node.
    assert "arbitrary-node:update" in _refused(lambda: write(node_b))


def test_a_controller_changes_nothing_but_rotas_entries_of_its_nodes_claims(
        release: Release) -> None:
    """resourceclaims/status update is cluster-wide in RBAC. From 1.36 the API server also
    asks for resourceclaims/binding (allocation, reservedFor) and resourceclaims/driver
    (status.devices, per driver and node); on 1.34 and 1.35 it asks for nothing more. The
    local cluster runs 1.37, so 1.35 is stood in for by granting the controller those
    permissions for every driver and node: the chart's policy is then the only check, and
    it must keep the controller to rota's entries of its own node's claims (review 2026-12
    R9)."""
    node_a, node_b = release.nodes
    objs = client.CustomObjectsApi(release.api)
    rbac = client.RbacAuthorizationV1Api(release.api)
    unchecked = f"{release.fullname}-test-as-on-1-35"
    rbac.create_cluster_role({"metadata": {"name": unchecked}, "rules": [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/binding"],
         "verbs": ["update"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
         "verbs": ["associated-node:update", "arbitrary-node:update"]}]})
    rbac.create_cluster_role_binding({
        "metadata": {"name": unchecked},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": unchecked},
        "subjects": [{"kind": "ServiceAccount", "name": release.sa("controller"),
                      "namespace": release.namespace}]})
    try:
        for node in release.nodes:
            created = objs.create_namespaced_custom_object(
                GROUP, VERSION, release.engines, "resourceclaims",
                claim(f"status-{node}", memory=None))
            created["status"] = {"allocation": {
                "devices": {"results": [
                    {"request": "gpu", "driver": "gpu.rota.dev", "pool": node,
                     "device": "gpu-0"},
                    {"request": "gpu", "driver": "other.example.com", "pool": node,
                     "device": "nic-0"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
            objs.replace_namespaced_custom_object_status(
                GROUP, VERSION, release.engines, "resourceclaims", f"status-{node}", created)
        controller_a = client.CustomObjectsApi(
            release.as_token(release.token("controller", node_a)))

        def changed(node: str, change: Callable[[dict[str, Any]], None], *,
                    dry_run: bool = False) -> Callable[[], Any]:
            def write() -> Any:
                current = objs.get_namespaced_custom_object(
                    GROUP, VERSION, release.engines, "resourceclaims", f"status-{node}")
                change(current["status"])
                kwargs = {"dry_run": "All"} if dry_run else {}
                return controller_a.replace_namespaced_custom_object_status(
                    GROUP, VERSION, release.engines, "resourceclaims", f"status-{node}",
                    current, **kwargs)
            return write

        def reserve(status: dict[str, Any]) -> None:
            status["reservedFor"] = [{"resource": "pods", "name": "someone-else",
                                      "uid": str(uuid.uuid4())}]

        def reallocate(status: dict[str, Any]) -> None:
            status["allocation"]["devices"]["results"][0]["device"] = "gpu-1"

        def entry(driver: str, pool: str, device: str) -> dict[str, Any]:
            return {"driver": driver, "pool": pool, "device": device,
                    "conditions": [{"type": "Ready", "status": "True",
                                    "reason": "Initialised", "message": "ok",
                                    "observedGeneration": 1,
                                    "lastTransitionTime": "2026-12-01T09:00:00Z"}]}

        def ours(node: str) -> Callable[[dict[str, Any]], None]:
            def change(status: dict[str, Any]) -> None:
                status["devices"] = [entry("gpu.rota.dev", node, "gpu-0")]
            return change

        def another_drivers(status: dict[str, Any]) -> None:
            status["devices"] = [entry("other.example.com", node_a, "nic-0")]

        _wait_for_policy(changed(node_a, reserve, dry_run=True))
        # Which pod a claim is reserved for decides where the gateway sends its traffic.
        assert "may not change a claim but" in _refused(changed(node_a, reserve))
        _refused(changed(node_a, reallocate))  # the API server: immutable once set
        assert "may not change a claim but" in _refused(changed(node_a, another_drivers))
        # Another node's claims: nothing at all.
        assert "not allocated in its pool" in _refused(changed(node_b, ours(node_b)))
        assert "not allocated in its pool" in _refused(changed(node_b, reserve))
        # rota's own entry on its own node's claim is what it may write.
        written = changed(node_a, ours(node_a))()
        assert [d["driver"] for d in written["status"]["devices"]] == ["gpu.rota.dev"]
        assert "reservedFor" not in written["status"]
    finally:
        rbac.delete_cluster_role_binding(unchecked)
        rbac.delete_cluster_role(unchecked)


def _kubeconfig(release: Release, token: str, path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": {
            "server": release.cluster.server,
            "certificate-authority": str(release.cluster.workdir / "pki" / "ca.crt")}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}]}))
    return path


@pytest.mark.slow
def test_the_components_run_with_their_own_service_accounts(
        release: Release, device_class: str) -> None:
    """Driver, controller and gateway run as the chart's service accounts, with tokens
    bound to pods on their node, under the chart's RBAC and admission policies: the driver
    publishes its slices and prepares claims, the controller leads and switches, the
    gateway routes a request for each model."""
    node = GpuNode(cluster=release.cluster, api=release.api, name=f"gpu-{uuid.uuid4().hex[:8]}")
    try:
        configs = {c: _kubeconfig(release, release.token(c, node.name),
                                  node.dirs.root / f"{c}.kubeconfig")
                   for c in ("driver", "controller", "gateway")}
        node.start_driver(extra=[f"--kubeconfig={configs['driver']}"])  # slices published
        node.start_agent()
        engines = deploy(release.api, release.engines, node.name, [MODEL_A, MODEL_B])
        token = node.dirs.root / "activation-token"
        token.write_text(f"{uuid.uuid4().hex}\n")
        node.start_controller(extra=[f"--kubeconfig={configs['controller']}",
                                     f"--namespace={release.namespace}",
                                     f"--token-file={token}"])
        leases = client.CoordinationV1Api(release.api)

        def leading() -> bool:
            lease = leases.read_namespaced_lease(naming.controller_lease_name(node.name),
                                                 release.namespace)
            return bool(lease.spec.holder_identity == "controller-0")

        eventually(leading, timeout=90, interval=0.5, what="the controller leading")
        url = node.start_gateway(token_file=token, extra=[
            f"--kubeconfig={configs['gateway']}",
            f"--controller-namespace={release.namespace}",
            f"--serving-namespaces={release.engines}",
            # As the chart's Deployment sets it: its RBAC grants claims per namespace only.
            f"--claim-namespaces={release.engines}"])
        for spec in (MODEL_A, MODEL_B, MODEL_A):
            body = json.dumps({"model": spec.model, "max_tokens": 4,
                               "messages": [{"role": "user", "content": "What is 3 + 4?"}]})
            request = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as resp:
                    answer = json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                logs = {p.name: p.read_text()[-3000:] for p in node.dirs.logs.iterdir()}
                raise AssertionError(f"{exc.code} {exc.read()!r} {logs}") from exc
            assert answer["choices"][0]["message"]["content"].startswith("7")
        assert {e.spec.model for e in engines} == {MODEL_A.model, MODEL_B.model}
        for log in ("driver.log", "controller-controller-0.log", "gateway-0.log"):
            text = (node.dirs.logs / log).read_text()
            assert "forbidden" not in text.lower(), f"{log}: {text[-2000:]}"
    finally:
        node.close()


def test_uninstall_leaves_nothing_behind(release: Release) -> None:
    release.helm("uninstall", release.name, "--namespace", release.namespace)
    release.installed = False
    selector = f"app.kubernetes.io/instance={release.name}"
    core = client.CoreV1Api(release.api)
    rbac = client.RbacAuthorizationV1Api(release.api)
    admission = client.AdmissionregistrationV1Api(release.api)
    left: list[str] = []
    listings: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("secrets", lambda: core.list_namespaced_secret(release.namespace,
                                                            label_selector=selector)),
            ("serviceaccounts", lambda: core.list_namespaced_service_account(
                release.namespace, label_selector=selector)),
            ("clusterroles", lambda: rbac.list_cluster_role(label_selector=selector)),
            ("clusterrolebindings", lambda: rbac.list_cluster_role_binding(
                label_selector=selector)),
            ("roles", lambda: rbac.list_role_for_all_namespaces(label_selector=selector)),
            ("policies", lambda: admission.list_validating_admission_policy(
                label_selector=selector)),
            ("bindings", lambda: admission.list_validating_admission_policy_binding(
                label_selector=selector)),
            ("daemonsets", lambda: client.AppsV1Api(release.api).list_namespaced_daemon_set(
                release.namespace, label_selector=selector)),
            ("networkpolicies", lambda: client.NetworkingV1Api(release.api)
             .list_network_policy_for_all_namespaces(label_selector=selector)))
    for what, listing in listings:
        left += [f"{what}/{item.metadata.name}" for item in listing().items]
    # Helm's own release records are gone too.
    left += [s.metadata.name for s in core.list_namespaced_secret(
        release.namespace, label_selector=f"owner=helm,name={release.name}").items]
    assert not left
