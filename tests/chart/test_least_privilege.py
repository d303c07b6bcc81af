"""Least privilege, stated by the chart and held on a real API server (review newcomer #14).

- The gateway's claim access follows ``engineNamespaces``: set, it gets a Role per engine
  namespace (claims and pods) and no ClusterRole, and is told to watch claims only there
  (``ROTA_GATEWAY_CLAIM_NAMESPACES``); empty, a ClusterRole (every namespace).
- ``<release>-status-reader`` is a read-only ClusterRole for ``kubectl rota status`` users
  that grants no Secret (the activation token triggers switches).

On the local cluster, the rendered RBAC is applied as the chart writes it: the gateway's
own KubeSource, with its service account's token, syncs from per-namespace watches and
sees a claim in an engine namespace but none elsewhere (a cluster-wide list is refused);
a user bound to the status reader runs ``kubectl rota status`` and may not read the token.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from controller.gateway.binding import ModelBinding
from controller.gateway.kube_source import KubeSource
from controller.gateway.routing import RoutingState
from controller.gateway.settings import GatewaySettings
from controller.kubectl_rota import main
from e2e.cluster import LocalCluster
from e2e.harness.objects import create_namespace
from e2e.release.chart import Rendered, render
from tests.chart.test_kubectl_rota import _leases

GROUP, VERSION = "resource.k8s.io", "v1"
MODEL = "org/least-privilege"
DEADLINE = 60.0
READ_ONLY = {"get", "list", "watch"}


def _rendered(chart_bin: Path, **sets: str) -> Rendered:
    return render(set_values=sets, bin_dir=chart_bin)


def _gateway_env(rendered: Rendered) -> dict[str, str]:
    [deployment] = rendered.find("Deployment", "rota-gateway")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def test_with_engine_namespaces_the_gateway_reads_claims_only_there(chart_bin: Path) -> None:
    rendered = _rendered(chart_bin, engineNamespaces="{team-a,team-b}")
    assert rendered.find("ClusterRole", "rota-gateway") == []
    assert rendered.find("ClusterRoleBinding", "rota-gateway") == []
    roles = rendered.find("Role", "rota-gateway-pods")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert {("resource.k8s.io", "resourceclaims", "list"),
                ("resource.k8s.io", "resourceclaims", "watch"),
                ("", "pods", "list"), ("", "pods", "watch")} <= _grants(role)
    assert _gateway_env(rendered)["ROTA_GATEWAY_CLAIM_NAMESPACES"] == "team-a,team-b"


def test_without_engine_namespaces_the_gateway_reads_claims_everywhere(
        chart_bin: Path) -> None:
    rendered = _rendered(chart_bin, **{"networkPolicy.enginesOpen": "true"})
    [role] = rendered.find("ClusterRole", "rota-gateway")
    assert {("resource.k8s.io", "resourceclaims", "watch"), ("", "pods", "watch")} \
        <= _grants(role)
    assert rendered.find("Role", "rota-gateway-pods") == []
    assert "ROTA_GATEWAY_CLAIM_NAMESPACES" not in _gateway_env(rendered)


def test_the_status_reader_reads_and_grants_no_secret(chart_bin: Path) -> None:
    rendered = _rendered(chart_bin, engineNamespaces="{inference}")
    [role] = rendered.find("ClusterRole", "rota-status-reader")
    grants = _grants(role)
    assert {verb for _, _, verb in grants} <= READ_ONLY
    assert {resource for _, resource, _ in grants} == {"leases", "resourceclaims", "pods"}
    assert rendered.find("ClusterRoleBinding", "rota-status-reader") == []  # bound by you
    off = _rendered(chart_bin, engineNamespaces="{inference}",
                    **{"statusReaderRole.create": "false"})
    assert off.find("ClusterRole", "rota-status-reader") == []


# -- on the local cluster ----------------------------------------------------------------


def _apply(api: client.ApiClient, docs: list[dict[str, Any]]) -> Callable[[], None]:
    """Create the RBAC objects as rendered; returns what deletes the cluster-scoped ones."""
    rbac = client.RbacAuthorizationV1Api(api)
    made: list[tuple[str, str]] = []
    for doc in docs:
        kind, ns = doc["kind"], doc["metadata"].get("namespace")
        if kind == "ClusterRole":
            rbac.create_cluster_role(doc)
            made.append((kind, doc["metadata"]["name"]))
        elif kind == "ClusterRoleBinding":
            rbac.create_cluster_role_binding(doc)
            made.append((kind, doc["metadata"]["name"]))
        elif kind == "Role":
            rbac.create_namespaced_role(ns, doc)
        elif kind == "RoleBinding":
            rbac.create_namespaced_role_binding(ns, doc)

    def delete() -> None:
        for kind, name in made:
            if kind == "ClusterRole":
                rbac.delete_cluster_role(name)
            else:
                rbac.delete_cluster_role_binding(name)
    return delete


def _token(api: client.ApiClient, namespace: str, account: str) -> str:
    core = client.CoreV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    request = core.create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 600}})
    return str(request.status.token)


def _client(cluster: LocalCluster, token: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = cluster.server
    configuration.ssl_ca_cert = str(cluster.pki.ca_cert)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)


def _kubeconfig(cluster: LocalCluster, token: str, path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "viewer",
        "clusters": [{"name": "local", "cluster": {
            "server": cluster.server, "certificate-authority": str(cluster.pki.ca_cert)}}],
        "users": [{"name": "viewer", "user": {"token": token}}],
        "contexts": [{"name": "viewer", "context": {"cluster": "local", "user": "viewer"}}]}))
    return path


@pytest.fixture
def installed(chart_bin: Path, kube_api: client.ApiClient
              ) -> Iterator[tuple[str, str, list[str]]]:
    """The release's name (its objects' prefix), rota's namespace and two engine
    namespaces (plus one more, not an engine namespace, last), with the chart's RBAC for
    them applied."""
    suffix = uuid.uuid4().hex[:8]
    rota_ns, engines = f"rota-{suffix}", [f"team-a-{suffix}", f"team-b-{suffix}"]
    other = f"other-{suffix}"
    for ns in (rota_ns, *engines, other):
        create_namespace(kube_api, ns)
    release = f"rota{suffix}"
    rendered = render(set_values={"engineNamespaces": "{" + ",".join(engines) + "}"},
                      release=release, namespace=rota_ns, bin_dir=chart_bin)
    files = rendered.by_template()
    docs = [d for name in ("rbac-gateway.yaml", "rbac-status-reader.yaml")
            for d in yaml.safe_load_all(files[name]) if d]
    delete = _apply(kube_api, docs)
    try:
        yield release, rota_ns, [*engines, other]
    finally:
        delete()
        core = client.CoreV1Api(kube_api)
        for ns in (rota_ns, *engines, other):
            core.delete_namespace(ns)


def _allocated_claim(api: client.ApiClient, namespace: str) -> None:
    objects = client.CustomObjectsApi(api)
    config = {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig", "model": MODEL,
              "awakeMemory": "10Gi", "sleepLevel": 1, "enginePort": 8000}
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "resourceclaims", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
        "metadata": {"name": "engine"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.rota.dev"}}],
            "config": [{"requests": ["gpu"],
                        "opaque": {"driver": "gpu.rota.dev", "parameters": config}}]}}})
    objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "resourceclaims", "engine", {"status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": "gpu.rota.dev", "pool": "node-x",
                "device": "gpu-0"}]}}}})


async def _until(state: RoutingState, check: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(DEADLINE):
            while not check():
                await state.wait_changed(state.version, DEADLINE)
    except TimeoutError:
        raise AssertionError(f"{what}: not seen within {DEADLINE}s") from None


@pytest.mark.cluster
async def test_the_gateway_watches_claims_per_engine_namespace_with_its_roles(
        cluster: LocalCluster, kube_api: client.ApiClient,
        installed: tuple[str, str, list[str]]) -> None:
    release, rota_ns, (team_a, team_b, other) = installed
    token = await asyncio.to_thread(_token, kube_api, rota_ns, f"{release}-gateway")
    api = _client(cluster, token)
    try:
        with pytest.raises(client.ApiException) as refused:  # not cluster-wide any more
            await asyncio.to_thread(client.CustomObjectsApi(api).list_cluster_custom_object,
                                    GROUP, VERSION, "resourceclaims")
        assert refused.value.status == 403
        for ns in (team_a, other):
            await asyncio.to_thread(_allocated_claim, kube_api, ns)
        settings = GatewaySettings(controller_namespace=rota_ns, watch_timeout_s=5,
                                   resync_s=30, claim_namespaces=(team_a, team_b))
        state = RoutingState(binding=ModelBinding(namespaces=(team_a, team_b, other)))
        source = asyncio.create_task(KubeSource(settings, api=api).run(state))
        try:
            await _until(state, lambda: state.synced, "the first lists, per namespace")
            await _until(state, lambda: team_a in state.claim_namespaces(),
                         "the claim in an engine namespace")
            assert other not in state.claim_namespaces()
        finally:
            source.cancel()
            await asyncio.gather(source, return_exceptions=True)
    finally:
        await asyncio.to_thread(api.close)


@pytest.mark.cluster
def test_a_user_bound_to_the_status_reader_runs_status_without_the_token(
        cluster: LocalCluster, kube_api: client.ApiClient,
        installed: tuple[str, str, list[str]], tmp_path: Path) -> None:
    release, rota_ns, _ = installed
    # As docs/operations.md says: a RoleBinding in rota's namespace.
    client.RbacAuthorizationV1Api(kube_api).create_namespaced_role_binding(rota_ns, {
        "metadata": {"name": "viewer-rota-status"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": f"{release}-status-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": rota_ns}]})
    token = _token(kube_api, rota_ns, "viewer")
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_secret(rota_ns, {"metadata": {"name": "rota-activation-token"},
                                            "stringData": {"token": "t" * 32}})
    leases = client.CoordinationV1Api(kube_api)
    for body in _leases(rota_ns, dt.datetime.now(dt.UTC)):
        leases.create_namespaced_lease(rota_ns, body)

    out = io.StringIO()
    kubeconfig = _kubeconfig(cluster, token, tmp_path / "viewer.kubeconfig")
    assert main(["status", "-n", rota_ns, "--kubeconfig", str(kubeconfig)], out) == 0
    text = out.getvalue()
    assert "prod/chat" in text
    assert "no activation token" in " ".join(text.split())  # said once, not a 401 a node

    viewer = _client(cluster, token)
    try:
        with pytest.raises(client.ApiException) as refused:
            client.CoreV1Api(viewer).read_namespaced_secret("rota-activation-token", rota_ns)
        assert refused.value.status == 403
    finally:
        viewer.close()
