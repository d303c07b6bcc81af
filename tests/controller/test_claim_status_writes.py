"""The claim conditions a switch shows cost one request per change: the claim as the last
status write returned it is the base of the next compare-and-swap. Against the real API
server, with another driver writing the same claim's status in between."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from kubernetes import client

from controller.lease.visible_state_writer import VisibleStateKube
from e2e.harness.objects import GROUP, VERSION, claim, create_claim, read_claim

pytestmark = [pytest.mark.cluster, pytest.mark.controller]

T = TypeVar("T")


class _CountingKube(VisibleStateKube):
    """The real writer's facade, counting the claims it reads."""

    reads = 0

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if what.startswith("get resourceclaim"):
            self.reads += 1
        return await super()._call(what, fn, *args, **kwargs)


def _entry(driver: str, node: str, awake: bool, device: str = "gpu-0") -> dict[str, Any]:
    return {"driver": driver, "pool": node, "device": device, "conditions": [
        {"type": "Awake", "status": "True" if awake else "False", "reason": "Test",
         "message": "", "lastTransitionTime": "2026-12-06T00:00:00Z"}]}


def _conditions(body: dict[str, Any]) -> dict[str, str]:
    return {d["driver"]: d["conditions"][0]["status"] for d in body["status"]["devices"]}


async def test_each_condition_change_is_one_write_and_other_drivers_entries_stay(
        kube_api: client.ApiClient, namespace: str) -> None:
    node = f"writes-{uuid.uuid4().hex[:6]}"
    create_claim(kube_api, namespace, claim("model-a", memory="20Gi"))
    body = read_claim(kube_api, namespace, "model-a")
    body["status"] = {"allocation": {"devices": {"results": [
        {"driver": "gpu.rota.dev", "pool": node, "device": "gpu-0", "request": "gpu"},
        {"driver": "net.example.com", "pool": node, "device": "nic-0", "request": "gpu"}]}}}
    objects = client.CustomObjectsApi(kube_api)
    objects.replace_namespaced_custom_object_status(GROUP, VERSION, namespace,
                                                    "resourceclaims", "model-a", body)
    kube = _CountingKube(kube_api)

    for awake in (True, False, True, False):
        await kube.set_claim_devices(namespace, "model-a", [_entry("gpu.rota.dev", node, awake)])
    assert kube.reads == 1, f"{kube.reads} reads for 4 writes"  # 4 on the old code
    assert _conditions(read_claim(kube_api, namespace, "model-a")) == {"gpu.rota.dev": "False"}

    # Another writer in between: the next write conflicts, reads again and keeps its entry.
    other = read_claim(kube_api, namespace, "model-a")
    other["status"]["devices"].append(_entry("net.example.com", node, True, "nic-0"))
    objects.replace_namespaced_custom_object_status(GROUP, VERSION, namespace,
                                                    "resourceclaims", "model-a", other)
    await kube.set_claim_devices(namespace, "model-a", [_entry("gpu.rota.dev", node, True)])
    assert kube.reads == 2
    assert _conditions(read_claim(kube_api, namespace, "model-a")) == {
        "gpu.rota.dev": "True", "net.example.com": "True"}
