"""The holder's work accounting of one GPU's worker (controller/lease/worker/accounting.py):
callers just answered count as the holder's work until its engine shows work or the grace
passes; tenure and decaying usage; the measured switch costs."""

from __future__ import annotations

import math

import pytest

from controller.lease.switch import SwitchResult
from controller.lease.worker.accounting import ANSWERED_GRACE_S, USAGE_DECAY_S, HolderWork
from rota.api.gpu_lease import GpuLease
from tests.controller.worker_kit import FakeEngine, claimant


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_answered_callers_count_as_work_until_the_engine_shows_them() -> None:
    clock = _Clock()
    work = HolderWork(clock)
    a, b = claimant("a"), claimant("b")
    work.answered("uid-a", 3)
    assert work.in_flight_seen(b, 0) == 0, "another claim's callers are not b's work"
    assert work.in_flight_seen(a, 0) == 3, "their requests are on their way"
    clock.now += ANSWERED_GRACE_S / 2
    assert await work.load(a, FakeEngine(0)) == 3  # type: ignore[arg-type]
    assert work.last_busy == clock.now, "work seen is the holder busy now"
    assert await work.load(a, FakeEngine(1)) == 1  # type: ignore[arg-type]
    assert work.in_flight_seen(a, 0) == 0, "once the engine showed work, its metrics rule"


def test_the_grace_ends() -> None:
    clock = _Clock()
    work = HolderWork(clock)
    a = claimant("a")
    work.answered("uid-a", 2)
    clock.now += ANSWERED_GRACE_S + 0.01
    assert work.in_flight_seen(a, 0) == 0


def test_tenure_and_decaying_usage() -> None:
    clock = _Clock()
    work = HolderWork(clock)
    a, b = claimant("a"), claimant("b")
    clock.now += 40.0
    assert work.usage_now(a) == {"ns/a": 40.0}, "the current tenure counts"
    work.new_tenure("ns/a")
    assert work.holder_since == work.last_busy == clock.now
    clock.now += 10.0
    usage = work.usage_now(b)
    assert usage["ns/b"] == 10.0
    assert usage["ns/a"] == pytest.approx(40.0 * math.exp(-10.0 / USAGE_DECAY_S))
    work.new_tenure()  # a gang switch: no tenure of this GPU's is counted
    assert "ns/b" not in work.usage_now(None)


def test_measured_costs_per_claim() -> None:
    work = HolderWork(_Clock())
    a, b = claimant("a"), claimant("b")
    default = work.switch_cost("ns/a", "ns/b")
    lease = GpuLease(name="l", node="n", device="gpu-0")
    timings = {"drain": 0.2, "later_sleep": 0.5, "wake_call": 0.6, "probe_ttft": 0.1}
    work.measured(SwitchResult(False, lease, timings=timings), a, b)
    assert work.switch_cost("ns/a", "ns/b") == default, "a failed switch measures nothing"
    work.measured(SwitchResult(True, lease, timings=timings), a, b)
    assert work.costs["ns/a"].sleep_s == 0.5
    assert work.drains["ns/a"] == 0.2
    assert work.switch_cost("ns/a", "ns/b") == pytest.approx(0.5 + 0.2 + 0.6 + 0.1)
    assert work.switch_cost(None, "ns/b") == pytest.approx(0.6 + 0.1), "nobody to sleep"
