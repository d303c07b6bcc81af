"""Nobody but the admin decides where a model's traffic goes (review C3).

An attacker's engine simulator stands by in each test; a request it ever receives is a
hijacked prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rota.api import naming
from tests.gateway.conftest import (
    MODEL_A,
    MODEL_B,
    Rig,
    RigFactory,
    Sim,
    claim_obj,
    gpu_lease,
    pod_obj,
    start_sim,
)

pytestmark = pytest.mark.gateway

TENANT = "tenant-x"


async def _attacker(rig: Rig, model: str = MODEL_A) -> Sim:
    sim = await start_sim(model, f"{TENANT}/evil")
    rig.closers.append(sim.client.close)
    return sim


def _tenant_claims(rig: Rig, evil: Sim, model: str = MODEL_A) -> None:
    """A tenant's claim for ``model`` (any server will do) on another GPU, its ready pod,
    and that GPU's Lease naming it the awake holder (it is the only claimant there)."""
    rig.apply("claim", "ADDED", claim_obj("evil", model=model, port=evil.port,
                                          pod_uid="pod-evil", namespace=TENANT,
                                          device="gpu-1"))
    rig.apply("pod", "ADDED", pod_obj("pod-evil", uid="pod-evil", namespace=TENANT))
    rig.apply("lease", "ADDED", gpu_lease(holder=f"{TENANT}/evil", state=naming.STATE_AWAKE,
                                          model=model, device="gpu-1"))


async def test_a_second_namespace_serving_the_same_model_gets_nothing(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    evil = await _attacker(rig)
    _tenant_claims(rig, evil)
    for _ in range(6):
        assert await rig.answer(MODEL_A) == "7"
    assert evil.engine.generations_started == 0
    assert rig.a.engine.generations_started == 6


async def test_a_lease_endpoint_that_is_not_the_pod_ip_is_never_used(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    evil = await _attacker(rig)
    # Whoever can write Leases points the holder's endpoint at their own server.
    rig.apply("lease", "MODIFIED", rig.controller.lease_now(endpoint=evil.url))
    for _ in range(4):
        assert await rig.answer(MODEL_A) == "7"
    assert evil.engine.generations_started == 0
    assert rig.a.engine.generations_started == 4


async def test_a_bound_model_is_not_served_from_another_allowed_namespace(
        make_rig: RigFactory, tmp_path: Path) -> None:
    binding = tmp_path / "binding.yaml"
    binding.write_text(f"models:\n  {MODEL_A}: [engines]\nnamespaces: ['tenant-*']\n")
    rig = await make_rig(serving_namespaces=[], model_binding_file=binding)
    evil = await _attacker(rig)
    _tenant_claims(rig, evil)
    # The tenant's namespace may serve models the binding does not name...
    other = await _attacker(rig, "tenant/own-model")
    rig.apply("claim", "ADDED", claim_obj("own", model="tenant/own-model", port=other.port,
                                          pod_uid="pod-own", namespace=TENANT,
                                          device="gpu-1"))
    rig.apply("pod", "ADDED", pod_obj("pod-own", uid="pod-own", namespace=TENANT))
    models = {m["id"] for m in (await (await rig.gateway.get("/v1/models")).json())["data"]}
    assert models == {MODEL_A, "tenant/own-model"}  # model B is bound nowhere
    # ...but never model A, even with A's own engine not ready.
    assert await rig.answer(MODEL_A) == "7"
    rig.apply("pod", "MODIFIED", pod_obj("pod-claim-a", uid="pod-a", ready=False))
    resp = await rig.chat(MODEL_A)
    assert resp.status == 503, await resp.text()
    assert resp.headers["Retry-After"]
    assert evil.engine.generations_started == 0
    assert rig.controller.calls == 0
    lease = rig.controller.lease_now()
    assert lease["metadata"]["annotations"][naming.HOLDER_MODEL] == MODEL_A
    resp = await rig.chat(MODEL_B)
    assert resp.status == 404  # bound to no namespace: not served at all
