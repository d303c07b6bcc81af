"""Fixtures for tests on a real node (loaded as a pytest plugin by ``tests/conftest.py``):
rota's images, a real node of the session's cluster, and rota deployed on it from its
manifests. Session-scoped: the node starts once (seconds) and rota is deployed once; each
test uses its own namespace (the ``namespace`` fixture) and leaves rota as it found it.

    def test_x(rota_node: RotaOnNodes, namespace: str) -> None:
        engines = rota_node.deploy_engines(namespace)      # manifests/examples/two-models
        url = rota_node.gateway_url()
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.cluster.binaries import locate
from e2e.cluster.realnode import RealNode
from e2e.harness.deploy import deploy
from e2e.harness.rota_node import RotaOnNodes, build_rota_images
from e2e.images import BuiltImages

REAL_NODE = "rota-node-1"
MISSING = [tool for tool in ("unshare", "nsenter", "socat", "runc", "ip", "iptables")
           if shutil.which(tool) is None]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or bool(MISSING),
    reason=f"a real node needs root and {', '.join(MISSING) or 'nothing missing'} "
           "(run e2e/toolchain/setup-host.sh)")


@pytest.fixture(scope="session")
def rota_images() -> BuiltImages:
    """rota's pause, rota and engine-simulator images (built or found in the cache)."""
    return build_rota_images()


@pytest.fixture(scope="session")
def real_node(cluster: LocalCluster, rota_images: BuiltImages) -> Iterator[RealNode]:
    """A real node (kubelet, containerd, runc, CNI) with a fake GPU, attached to the
    session's cluster."""
    node = RealNode(cluster, REAL_NODE, rota_images, bin_dir=locate())
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def rota_node(cluster: LocalCluster, kube_api: client.ApiClient, real_node: RealNode
              ) -> RotaOnNodes:
    """rota deployed from ``manifests/`` on the real node, every pod Ready."""
    rota = RotaOnNodes(cluster, [real_node],
                       deploy(kube_api, nodes=[real_node.name], gateway_nodes=[real_node.name]))
    rota.wait_ready()
    return rota
