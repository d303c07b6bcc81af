"""A claim's traffic goes only to the pod the claim really is reserved for."""

from __future__ import annotations

from typing import Any

import pytest

from controller.claimants import claimants_from


def _claim(reserved: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"uid": "c-1", "namespace": "prod", "name": "llama"},
            "spec": {"devices": {"config": [{"opaque": {"driver": "gpu.rota.dev", "parameters": {
                "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                "model": "org/llama", "awakeMemory": "20Gi"}}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"driver": "gpu.rota.dev", "pool": "node-1", "device": "gpu-0",
                 "request": "gpu"}]}},
                "reservedFor": [{"resource": "pods", **reserved}]}}


def _pod(namespace: str, name: str, node: str = "node-1") -> dict[str, Any]:
    return {"metadata": {"uid": "p-1", "name": name, "namespace": namespace},
            "spec": {"nodeName": node},
            "status": {"podIP": "10.9.9.9", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_the_reserved_pod_serves() -> None:
    (claimant,) = claimants_from([_claim({"uid": "p-1", "name": "engine"})],
                                 {"p-1": _pod("prod", "engine")})
    assert claimant.endpoint == "http://10.9.9.9:8000"
    assert claimant.serving


@pytest.mark.parametrize("pod", [
    _pod("team-b", "engine"),            # another namespace's pod with that uid
    _pod("prod", "evil"),                # a name reservedFor does not give
    _pod("prod", "engine", node="node-2"),  # running on another node than the allocation
], ids=["other-namespace", "other-name", "other-node"])
def test_a_pod_that_is_not_the_claims_own_gets_nothing(pod: dict[str, Any]) -> None:
    (claimant,) = claimants_from([_claim({"uid": "p-1", "name": "engine"})], {"p-1": pod})
    assert claimant.endpoint is None
    assert not claimant.serving


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_a_finished_pod_gets_no_endpoint(phase: str) -> None:
    """An evicted (Failed) or completed pod keeps status.podIP, but its address may belong
    to another tenant's pod now: the claim's control token must not be sent there."""
    pod = _pod("prod", "engine")
    pod["status"]["phase"] = phase
    (claimant,) = claimants_from([_claim({"uid": "p-1", "name": "engine"})], {"p-1": pod})
    assert claimant.endpoint is None
    assert claimant.pod_ip is None
    assert not claimant.serving
