"""Node objects for a cluster without kubelets.

A Node needs no Ready condition for the scheduler; it needs allocatable resources (pods
included) and no taint the pods do not tolerate. The apiserver accepts status on create,
so one call makes a schedulable Node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes import client


def node_body(name: str, *, labels: Mapping[str, str] | None = None, cpu: str = "32",
              memory: str = "256Gi", pods: str = "110") -> dict[str, Any]:
    resources = {"cpu": cpu, "memory": memory, "pods": pods}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       **(labels or {})},
        },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "RotaLocalNode",
                            "message": "static node of rota's local cluster"}],
        },
    }


def create_node(api: client.ApiClient, name: str, **kwargs: Any) -> dict[str, Any]:
    """Create (or return the existing) schedulable Node called ``name``."""
    core = client.CoreV1Api(api)
    try:
        existing = core.read_node(name)
        return dict(api.sanitize_for_serialization(existing))
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    created = core.create_node(node_body(name, **kwargs))
    return dict(api.sanitize_for_serialization(created))
