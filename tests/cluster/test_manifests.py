"""Every manifest a cluster admin applies is accepted by the real API server (server-side
dry run: validation, defaulting and admission, nothing stored)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client, utils

from e2e.harness.objects import MANIFESTS

pytestmark = pytest.mark.cluster

FILES = sorted(p for p in MANIFESTS.rglob("*.yaml"))


def test_there_are_manifests() -> None:
    names = {p.name for p in FILES}
    assert {"namespace.yaml", "deviceclass.yaml", "rbac-driver.yaml", "rbac-controller.yaml",
            "rbac-gateway.yaml", "driver-daemonset.yaml", "controller-daemonset.yaml",
            "gateway-deployment.yaml", "networkpolicy-controller.yaml",
            "validatingadmissionpolicy-resourceslices.yaml",
            "validatingadmissionpolicy-leases.yaml", "two-models.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_manifest_is_accepted(kube_api: client.ApiClient, namespace: str, path: Path) -> None:
    core = client.CoreV1Api(kube_api)
    try:
        core.create_namespace({"metadata": {"name": "rota-system"}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, path
    for doc in docs:
        target = doc.get("metadata", {}).get("namespace") or namespace
        try:
            utils.create_from_dict(kube_api, doc, namespace=target, dry_run="All")
        except utils.FailToCreateError as exc:
            # Cluster-scoped objects applied by an earlier test already exist.
            refused = [e.body for e in exc.api_exceptions if e.status != 409]
            if refused:
                pytest.fail(f"{path.name} refused: {refused}")
