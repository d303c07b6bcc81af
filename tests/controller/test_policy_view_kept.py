"""What the GPU worker asks the switch policy (controller/lease/worker/policy_view.py):
the sleeping claimants' kept requests, as the switches recorded them, and whether each
claim keeps its requests (vLLM at level 1 does; a tensor-parallel gang never)."""

from __future__ import annotations

from typing import Any

import pytest

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.switch import Freezes, Frozen, Ports, Switcher
from rota.api.engine_config import parse_engine_config

pytestmark = pytest.mark.controller


def _claimant(name: str, *, level: int = 1) -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": name, "awakeMemory": "8Gi",
                                  "sleepLevel": level})
    return Claimant(claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node="n",
                    device="gpu-0", share_id=None, config=config, model=name, port=8000,
                    sleep_level=level, resident_bytes=1 << 30, pod_name=f"p-{name}",
                    pod_uid=f"pu-{name}", pod_ip="127.0.0.2", pod_ready=True,
                    pod_deleting=False)


def _worker(claimants: list[Claimant], freezes: Freezes) -> GpuWorker:
    unused: Any = None
    switcher = Switcher(ports=Ports(lease=unused, device=unused, engine=unused,
                                    guard=lambda: None, freezes=freezes),
                        limits=unused, identity="me")
    return GpuWorker(gpu="gpu-0", lease_port=unused, switcher=switcher,
                     claimants=lambda: claimants, engine=unused, policy=Policy(),
                     clock=lambda: 1000.0)


def test_the_policy_is_told_of_kept_requests_and_who_keeps() -> None:
    a, b, c = _claimant("a"), _claimant("b"), _claimant("c", level=2)
    freezes = Freezes()
    freezes.froze(b.claim_uid, Frozen(claim=b.ref, model="b", gpu="gpu-0", kept=3,
                                      since=997.5))
    freezes.froze(c.claim_uid, Frozen(claim=c.ref, model="c", gpu="gpu-0", kept=0,
                                      since=999.0))
    worker = _worker([a, b, c], freezes)
    inp = worker.view.input(a, in_flight=2)
    assert inp.kept == {b.ref: switch_policy.KeptWork(3, 997.5)}, \
        "a freeze that kept nothing is no work"
    assert inp.policies[a.ref].keeps_requests, "vLLM at level 1 keeps"
    assert not inp.policies[c.ref].keeps_requests, "level 2 drains"


def test_without_the_switchers_freezes_nothing_is_kept() -> None:
    a = _claimant("a")
    unused: Any = None
    worker = GpuWorker(gpu="gpu-0", lease_port=unused, switcher=unused,
                       claimants=lambda: [a], engine=unused, policy=Policy(),
                       clock=lambda: 1000.0)
    assert worker.view.input(a, in_flight=0).kept == {}
