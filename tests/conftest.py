"""Fixtures shared by every test: the local cluster, a namespace per test, short socket dirs;
every async test fails when it leaks an asyncio task (:mod:`tests.leaks`).

The cluster is started once per test session from real binaries (built and cached by
``e2e/toolchain/build-k8s.sh`` on first use) and only when a test asks for it, so unit tests run
without it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness.objects import MANIFESTS, apply_manifest, create_namespace

pytest_plugins = [
    "pytester", "tests.engines_on_cluster", "tests.leaks", "tests.real_node", "tests.sampling",
]

# Tests start processes while gRPC channels are open; gRPC's note about skipping its fork
# handlers is expected then, and only noise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    local = LocalCluster()
    try:
        local.start()
        yield local
    finally:
        local.cleanup()


@pytest.fixture(scope="session")
def kube_api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    api = cluster.api_client()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def device_class(kube_api: client.ApiClient) -> str:
    """rota's DeviceClass, applied from the manifest an admin would apply."""
    apply_manifest(kube_api, MANIFESTS / "deviceclass.yaml")
    return "gpu.rota.dev"


@pytest.fixture
def namespace(kube_api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(kube_api)
    create_namespace(kube_api, name)
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: unix socket paths must stay under ~108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rota-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_report_header() -> str:
    return f"rota: ROTA_K8S_BIN={os.environ.get('ROTA_K8S_BIN', '(build cache)')}"
