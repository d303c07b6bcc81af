"""Start-up admission at one GPU's worker (controller/lease/worker/start_gate.py): which
waiting start is served when (its claim's back-off), which gate's question is an engine
really starting (once per run of its container), and the back-off over."""

from __future__ import annotations

import dataclasses
from typing import Any

from controller.claimants import Claimant
from controller.lease.admission import StartTicket
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.worker.start_gate import START_QUIET_S, StartGate
from rota.api.engine_config import parse_engine_config


def _claimant(name: str, restarts: int = 0) -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": name, "awakeMemory": "8Gi"})
    return Claimant(claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node="n",
                    device="gpu-0", share_id=None, config=config, model=name, port=8000,
                    sleep_level=1, resident_bytes=1 << 30, pod_name=f"p-{name}",
                    pod_uid=f"pu-{name}", pod_ip="127.0.0.2", pod_ready=True,
                    pod_deleting=False, restarts=restarts)


class _Gate:
    def __init__(self) -> None:
        self.now = 1000.0
        self.claimants = [_claimant("a")]
        unused: Any = None
        self.worker = GpuWorker(gpu="gpu-0", lease_port=unused, switcher=unused,
                                claimants=lambda: self.claimants, engine=unused,
                                policy=Policy(), clock=lambda: self.now)
        self.gate: StartGate = self.worker.starts

    def waits(self, uid: str = "uid-a") -> StartTicket:
        ticket = StartTicket(uid, created=self.now, last_poll=self.now)
        self.gate.tickets[uid] = ticket
        return ticket


def test_each_start_of_a_claim_waits_longer_and_starts_over_after_quiet() -> None:
    g = _Gate()
    a = g.claimants[0]
    g.waits()
    assert g.gate.ready() == "uid-a", "a first start goes at once"
    g.gate.done(a, ok=True, reason="", came_up=False)
    first = g.gate.allowed_at("uid-a") - g.now
    assert first > 0
    assert g.gate.ready() is None, "the next start waits"
    assert g.gate.next_at() == g.gate.allowed_at("uid-a")
    g.now = g.gate.allowed_at("uid-a")
    assert g.gate.ready() == "uid-a"
    g.gate.done(a, ok=False, reason="crashed", came_up=False)
    second = g.gate.allowed_at("uid-a") - g.now
    # jittered (start_backoff: equal jitter, factor 2): the first pause is drawn from
    # [2.5, 5] s, the second from [5, 10] s; a margin over the first fails now and then
    assert first <= 5.0 + 1e-6 <= second + 2e-6, "a crash loop waits longer each time"
    g.now = g.gate.allowed_at("uid-a") + START_QUIET_S + 1.0
    g.gate.done(a, ok=True, reason="", came_up=False)
    assert g.gate.allowed_at("uid-a") - g.now < second, "quiet long enough: over"


def test_a_gate_asking_again_in_the_run_its_engine_came_up_in_is_no_start() -> None:
    g = _Gate()
    a = g.claimants[0]
    g.gate.done(a, ok=True, reason="", came_up=True)
    g.now = g.gate.allowed_at("uid-a")
    g.waits()
    assert not g.gate.really_starting("uid-a")
    assert not g.gate.at_gate("uid-a"), "its engine runs"
    assert g.gate.ready() is None
    assert g.gate.next_at() == float("inf")
    g.claimants = [dataclasses.replace(a, restarts=1)]  # its container restarted
    assert g.gate.really_starting("uid-a")
    assert g.gate.at_gate("uid-a")
    assert g.gate.ready() == "uid-a"


def test_the_start_state_of_a_claim_that_left_is_forgotten() -> None:
    g = _Gate()
    g.claimants = [_claimant("a"), _claimant("b")]
    for c in g.claimants:
        g.gate.done(c, ok=True, reason="", came_up=True)
    g.waits("uid-b")
    g.claimants = [_claimant("a")]
    g.gate.forget()
    assert set(g.gate.backoff) == {"uid-a", "uid-b"}, "b's start is still waiting"
    g.gate.tickets.clear()
    g.gate.forget()
    assert set(g.gate.backoff) == set(g.gate.started) == {"uid-a"}


async def test_no_start_while_the_worker_takes_no_work() -> None:
    g = _Gate()
    assert not await g.gate.request(g.claimants[0], hold_s=0.01)
    assert not g.gate.tickets
