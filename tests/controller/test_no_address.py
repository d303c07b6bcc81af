"""A claimant whose pod has no IP (not started yet, or restarting) has an engine that
cannot be reached, not a fence: every call fails as a connection that could not be made,
so each caller does what it does for an engine that does not answer."""

from __future__ import annotations

from typing import Any

import pytest

from controller.claimants import Claimant
from controller.lease.engines.base import SleepStateKind
from controller.lease.engines.errors import EngineUnreachable
from controller.lease.node import NodeController
from controller.lease.settings import LeaseSettings
from controller.lease.switch import Fenced
from rota.api.engine_config import parse_engine_config

pytestmark = pytest.mark.controller


def _claimant(pod_ip: str | None) -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": "org/a",
                                  "awakeMemory": "8Gi"})
    return Claimant(claim_uid="uid-a", namespace="ns", claim_name="a", node="node-a",
                    device="gpu-0", share_id=None, config=config, model="org/a", port=8000,
                    sleep_level=1, resident_bytes=1 << 30, pod_name="engine-a",
                    pod_uid="pod-a", pod_ip=pod_ip, pod_ready=False, pod_deleting=False)


async def test_an_engine_without_a_pod_ip_is_unreachable_not_fenced() -> None:
    unused: Any = None
    node = NodeController(settings=LeaseSettings(node_name="node-a"), kube=unused,
                          election=unused, device=unused, session=unused, cache=unused)
    engine = node.engine(_claimant(None))  # on the old code: Fenced, before any call
    for call in (engine.is_sleeping(), engine.sleep(1), engine.wake(1), engine.in_flight()):
        with pytest.raises(EngineUnreachable, match="engine-a has no IP") as caught:
            await call
        assert not isinstance(caught.value, Fenced)
        assert not caught.value.request_sent
    assert (await engine.sleep_state()).kind is SleepStateKind.UNKNOWN
    assert not await engine.health()
    assert not (await engine.probe()).ok
    assert engine.endpoint.claim == "ns/a"
