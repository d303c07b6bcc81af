"""Routing to an engine that spans GPUs (tensor parallel): it gets traffic only while the
Lease of every GPU it holds names it awake."""

from __future__ import annotations

from typing import Any

import pytest

from controller.gateway.binding import ModelBinding
from controller.gateway.routing import Action, RoutingState
from rota.api import naming
from tests.gateway.conftest import claim_obj, controller_lease, gpu_lease, pod_obj

pytestmark = pytest.mark.gateway

TP = "org/tp"


def _tp_claim() -> dict[str, Any]:
    claim = claim_obj("tp", model=TP, port=8000, pod_uid="ptp")
    results = claim["status"]["allocation"]["devices"]["results"]
    results.append(dict(results[0], device="gpu-1"))
    return claim


def _state(*leases: dict[str, Any]) -> RoutingState:
    state = RoutingState(binding=ModelBinding(namespaces=("engines",)), clock=lambda: 100.0)
    state.replace("claim", [_tp_claim()])
    state.replace("pod", [pod_obj("pod-tp", uid="ptp", ip="10.1.0.1")])
    state.replace("lease", [*leases, controller_lease("http://10.0.0.9:8085/")])
    state.mark_synced()
    return state


def _lease(device: str, holder: str, **changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"holder": holder, "state": naming.STATE_AWAKE, "model": TP,
                              "fence": 3, "device": device}
    return gpu_lease(**(values | changes))


def test_a_tp_engine_named_by_every_gpus_lease_is_forwarded() -> None:
    state = _state(_lease("gpu-0", "engines/tp"), _lease("gpu-1", "engines/tp", fence=9))
    decision = state.decide(TP)
    assert decision.action is Action.FORWARD
    assert decision.fence == 3, "the fence of its first GPU's Lease"


def test_a_tp_engine_that_holds_only_one_of_its_gpus_gets_no_traffic() -> None:
    state = _state(_lease("gpu-0", "engines/tp"),
                   _lease("gpu-1", "engines/other", holder_uid="uid-other"))
    assert state.decide(TP).action is Action.ACTIVATE


def test_a_tp_engine_whose_second_gpu_is_still_switching_waits() -> None:
    state = _state(_lease("gpu-0", "engines/tp"),
                   _lease("gpu-1", "", state=naming.STATE_SWITCHING, target=TP))
    assert state.decide(TP).action is not Action.FORWARD
