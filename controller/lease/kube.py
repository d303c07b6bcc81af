"""The lease controller's calls to the Kubernetes API.

It extends the driver's facade (same threads, timeouts and error mapping) with the Leases
the controller reads and writes with a compare-and-swap on ``resourceVersion``. Claims,
pods and slices are not listed here: :mod:`controller.lease.cache` watches them.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

from rota.kit.errors import KubeConflictError, KubeError
from rota.kit.kube import Kube, Obj


class ControllerKube(Kube):
    def __init__(self, api: client.ApiClient, *, timeout_s: float = 10.0) -> None:
        super().__init__(api, timeout_s=timeout_s)
        self._coordination = client.CoordinationV1Api(api)

    async def get_lease(self, namespace: str, name: str) -> Obj:
        resp = await self._call(f"get lease {namespace}/{name}",
                                self._coordination.read_namespaced_lease, name, namespace,
                                _preload_content=False)
        return dict(json.loads(resp.data))

    async def create_lease(self, namespace: str, body: Obj) -> Obj:
        resp = await self._call(f"create lease {namespace}/{body['metadata']['name']}",
                                self._coordination.create_namespaced_lease, namespace, body,
                                _preload_content=False)
        return dict(json.loads(resp.data))

    async def replace_lease(self, namespace: str, body: Obj) -> Obj:
        """Update; ``body.metadata.resourceVersion`` makes it a compare-and-swap (409 when
        someone else wrote first)."""
        name = body["metadata"]["name"]
        resp = await self._call(f"update lease {namespace}/{name}",
                                self._coordination.replace_namespaced_lease, name, namespace,
                                body, _preload_content=False)
        return dict(json.loads(resp.data))

    async def list_leases(self, namespace: str, selector: str) -> list[Obj]:
        resp = await self._call("list leases", self._coordination.list_namespaced_lease,
                                namespace, label_selector=selector, _preload_content=False)
        return list(json.loads(resp.data).get("items", []))

    async def ensure_namespace(self, name: str) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace",
                                "metadata": {"name": name}}
        try:
            await self._call(f"create namespace {name}", self._core.create_namespace, body)
        except KubeConflictError:
            return  # it exists
        except KubeError as exc:
            if exc.status != 403:
                raise
            # Installed with least privilege: the namespace is the admin's to create.
