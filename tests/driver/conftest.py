"""Fixtures for driver tests on the local cluster: a GPU node served by the real driver."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness.local_node import GpuNode


@pytest.fixture
def gpu_node(cluster: LocalCluster, kube_api: client.ApiClient, device_class: str
             ) -> Iterator[GpuNode]:
    """A fresh Node with the fake H200, and a running driver (no node agent)."""
    node = GpuNode(cluster=cluster, api=kube_api, name=f"gpu-{uuid.uuid4().hex[:8]}")
    try:
        node.start_driver()
        yield node
    finally:
        node.close()
