"""What the GPU worker asks the switch policy (controller/lease/worker/policy_view.py):
the sleeping claimants' kept requests, as the switches recorded them, and whether each
claim keeps its requests (vLLM at level 1 does; a tensor-parallel gang never); the costs
of a claim not woken yet, estimated from its measured peers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.switch import Freezes, Frozen, Ports, Switcher, SwitchResult
from rota.api.engine_config import parse_engine_config
from rota.api.gpu_lease import GpuLease

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
    per = switch_policy.HOLDER_TOKENS_PER_REQUEST
    assert inp.kept == {b.ref: switch_policy.KeptWork(3, 997.5, 3 * per)}, \
        "a freeze that kept nothing is no work; each kept request is counted at the size "\
        "its recompute rate is measured at"
    assert inp.policies[a.ref].keeps_requests, "vLLM at level 1 keeps"
    assert not inp.policies[c.ref].keeps_requests, "level 2 drains"


def test_without_the_switchers_freezes_nothing_is_kept() -> None:
    a = _claimant("a")
    unused: Any = None
    worker = GpuWorker(gpu="gpu-0", lease_port=unused, switcher=unused,
                       claimants=lambda: [a], engine=unused, policy=Policy(),
                       clock=lambda: 1000.0)
    assert worker.view.input(a, in_flight=0).kept == {}


def test_a_model_not_woken_yet_is_fitted_between_frozen_peers_by_their_measured_costs(
        ) -> None:
    """Four models turn with their streams frozen by turns; a fifth, never woken by this
    worker, has a request whose first token is due. Its peers' switches were measured
    (0.15 s each way, a fast recompute), so its visit fits before the frozen streams come
    back: it is served now. With the policy's default costs standing for it (a 1.2 s
    switch) no plan fitted, and it waited for the 30 s bound while the four turned."""
    a, b, c, d = (_claimant(n) for n in "abcd")
    freezes = Freezes()
    for who, since in ((b, 998.2), (c, 999.0)):
        freezes.froze(who.claim_uid, Frozen(claim=who.ref, model=who.model, gpu="gpu-0",
                                            kept=5, since=since))
    worker = _worker([a, b, c, d], freezes)
    lease = GpuLease(name="l", node="n", device="gpu-0")
    timings = {"later_sleep": 0.02, "wake_call": 0.04, "probe_ttft": 0.09}
    for holder, target in ((a, b), (b, c), (c, a)):
        worker.work.measured(SwitchResult(True, lease, timings=timings), holder, target)
        worker.work.measured(SwitchResult(True, lease, timings=timings | {
            "probe_ttft": 0.13}, resumed=4), holder, target)
    inp = worker.view.input(a, in_flight=5)
    inp = dataclasses.replace(
        inp, gpu=dataclasses.replace(inp.gpu, awake_since=999.5),
        queues=(switch_policy.ClaimQueue(d.ref, 3, oldest_since=998.1),))
    assert inp.costs[d.ref].wake_s == 0.04, "d's wake is estimated from its peers'"
    decision = switch_policy.decide(inp)
    assert (decision.action, decision.rule, decision.target, decision.preempt) == (
        switch_policy.Action.SWITCH, "first_token_due", d.ref, True), decision.reason


def test_the_policy_is_told_what_the_holders_wake_took_to_its_first_token() -> None:
    """The holder's turn is sized from its wake to its first token, the recompute of the
    requests the wake brought back included (the probe after the wake waited for it).
    Without it the policy stood in the holder's usual wake and probe, which leave the
    recompute out, and under overload 53 % of a simulated GPU's time went to switching
    (the share is 25 %)."""
    a, b = _claimant("a"), _claimant("b")
    worker = _worker([a, b], Freezes())
    lease = GpuLease(name="l", node="n", device="gpu-0")
    assert worker.view.input(a, in_flight=1).gpu.woken_in_s == 0.0, "nothing measured yet"
    timings = {"wake_call": 0.2, "probe_ttft": 0.9, "recovery_to_first_token": 1.1,
               "handoff_to_first_token": 1.4}
    worker.outcomes.switched(SwitchResult(True, Switcher.serving(lease, b), timings=timings),
                             a, b)
    assert worker.view.input(b, in_flight=1).gpu.woken_in_s == 1.1
    worker.outcomes.switched(SwitchResult(True, lease.idle(), timings={}), b, b)
    assert worker.view.input(None, in_flight=0).gpu.woken_in_s == 0.0, \
        "a holder put to sleep: nobody was woken"
