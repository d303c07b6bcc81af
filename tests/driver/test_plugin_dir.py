"""The driver creates its plugin data directory when it is missing (a node where the
kubelet's plugins directory has no entry for rota yet) instead of exiting."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness.local_node import GpuNode

pytestmark = [pytest.mark.cluster, pytest.mark.driver]


def test_a_missing_plugin_data_dir_is_created(cluster: LocalCluster,
                                              kube_api: client.ApiClient,
                                              device_class: str) -> None:
    node = GpuNode(cluster=cluster, api=kube_api, name=f"gpu-{uuid.uuid4().hex[:8]}")
    missing = node.dirs.root / "not-yet" / "gpu.rota.dev"
    try:
        node.start_driver(extra=[f"--plugin-data-dir={missing}"])
        assert missing.is_dir()
        assert (missing / "dra.sock").exists()
    finally:
        node.close()
