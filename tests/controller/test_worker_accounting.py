"""The holder's work accounting of one GPU's worker (controller/lease/worker/accounting.py):
callers just answered count as the holder's work until its engine shows work or the grace
passes; tenure and decaying usage; the measured switch costs, the recompute a probe
after kept requests measures, and the costs of a claim not measured yet, estimated from
its peers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.switch import SwitchResult
from controller.lease.worker.accounting import (
    ANSWERED_GRACE_S,
    USAGE_DECAY_S,
    HolderWork,
    with_estimates,
)
from rota.api.engine_config import parse_engine_config
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


def _sized(name: str, awake: str) -> Claimant:
    c = claimant(name)
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                  "kind": "EngineConfig", "model": name, "awakeMemory": awake})
    return dataclasses.replace(c, config=config)


LEASE = GpuLease(name="l", node="n", device="gpu-0")
MEASURED = {"later_sleep": 0.02, "wake_call": 0.04, "probe_ttft": 0.09}


def test_a_probe_behind_kept_requests_measures_their_recompute_not_the_probe() -> None:
    work = HolderWork(_Clock())
    a, b = claimant("a"), claimant("b")
    work.measured(SwitchResult(True, LEASE, timings=MEASURED), a, b)
    # b's wake brings 4 kept requests back: its probe queued behind their recompute
    slow = MEASURED | {"probe_ttft": 0.13}
    work.measured(SwitchResult(True, LEASE, timings=slow, resumed=4), a, b)
    assert work.costs["ns/b"].probe_s == 0.09, "the probe's own cost is not the recompute's"
    per = switch_policy.HOLDER_TOKENS_PER_REQUEST
    assert work.costs["ns/b"].recompute_tokens_per_s == pytest.approx(4 * per / 0.04)
    # a resumed wake of a claimant whose plain probe was never measured cannot be split
    work.measured(SwitchResult(True, LEASE, timings=slow, resumed=4), b, a)
    assert work.costs["ns/a"].probe_s == switch_policy.SwitchCost().probe_s
    assert work.costs["ns/a"].recompute_tokens_per_s == switch_policy.RECOMPUTE_TOKENS_PER_S


def test_a_claim_not_measured_yet_is_estimated_from_its_measured_peers() -> None:
    work = HolderWork(_Clock())
    a, b = _sized("a", "8Gi"), _sized("b", "8Gi")
    big, alone = _sized("big", "16Gi"), _sized("alone", "8Gi")
    work.measured(SwitchResult(True, LEASE, timings=MEASURED), a, b)
    work.measured(SwitchResult(True, LEASE, timings=MEASURED | {"probe_ttft": 0.14},
                               resumed=2), a, b)
    costs = work.costs_for([a, b, big])
    assert costs["ns/b"] == dataclasses.replace(work.costs["ns/b"], sleep_s=0.02), \
        "b's wake, probe and recompute stand as measured; its sleep, never measured, is a's"
    assert costs["ns/a"].sleep_s == 0.02
    assert (costs["ns/a"].wake_s, costs["ns/a"].probe_s) == (0.04, 0.09), \
        "a's wake was never measured: b's stands in (the same awake memory)"
    assert costs["ns/big"].wake_s == pytest.approx(0.08), "twice the memory, twice the wake"
    assert costs["ns/big"].sleep_s == pytest.approx(0.04)
    assert costs["ns/big"].recompute_tokens_per_s == pytest.approx(
        costs["ns/b"].recompute_tokens_per_s / 2), "and half the recompute rate"
    assert HolderWork(_Clock()).costs_for([alone]) == {}, \
        "with nobody measured, the policy's defaults stand"


def test_estimates_take_the_most_cautious_peer() -> None:
    fast = switch_policy.SwitchCost(sleep_s=0.02, wake_s=0.04, probe_s=0.09,
                                    recompute_tokens_per_s=200_000.0)
    slow = dataclasses.replace(fast, wake_s=0.06, recompute_tokens_per_s=100_000.0)
    fields = {"sleep_s", "wake_s", "probe_s", "recompute_tokens_per_s"}
    out = with_estimates({"f": fast, "s": slow}, {"f": fields, "s": fields},
                         {"f": 100, "s": 100, "new": 100, "nothing": 0})
    assert out["new"].wake_s == 0.06
    assert out["new"].recompute_tokens_per_s == 100_000.0
    assert "nothing" not in out, "a claim of no known size is not estimated"
