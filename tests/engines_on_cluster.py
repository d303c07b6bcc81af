"""Fixtures for tests that need simulated engines on the local cluster: a GPU node with its
driver and node agent, and two engines deployed through claims (loaded as a pytest plugin
by ``tests/conftest.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import Engine, EngineSpec, deploy

MODEL_A = EngineSpec("engine-a", "org/model-a", resident="2Gi", awake="60Gi")
MODEL_B = EngineSpec("engine-b", "org/model-b", resident="1Gi", awake="20Gi")


@pytest.fixture
def engine_node(cluster: LocalCluster, kube_api: client.ApiClient, device_class: str
             ) -> Iterator[GpuNode]:
    """A fresh Node with the fake H200, its driver and its node agent (no controller)."""
    node = GpuNode(cluster=cluster, api=kube_api, name=f"gpu-{uuid.uuid4().hex[:8]}")
    try:
        node.start_driver()
        node.start_agent()
        yield node
    finally:
        node.close()


@pytest.fixture
def two_engines(engine_node: GpuNode, kube_api: client.ApiClient, namespace: str
                ) -> list[Engine]:
    """Engines A (60Gi awake, 2Gi resident) and B (20Gi awake, 1Gi resident), running."""
    return deploy(kube_api, namespace, engine_node.name, [MODEL_A, MODEL_B])
