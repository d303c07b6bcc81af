"""An engine whose footprint creeps across sleep/wake cycles is noticed before the wake
check refuses a wake for it (issue 27, "Memory over many turns"): the ratio gauge on every
read before a wake, and one notice (a JSON log line, a Warning Event) per crossing of the
warning line, from the same GPU read the check makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import aiohttp
import pytest

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.device import (
    ASLEEP,
    AWAKE,
    FootprintNotice,
    FootprintWatch,
    GpuProcess,
    GpuSnapshot,
)
from controller.lease.visibility import GpuVisibility
from controller.lease.visible_state import EventReason, Occurrence
from controller.lease.visible_state_writer import VisibleStateWriter
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config
from tests.controller.conftest import ENGINE_SIM_GIB, EngineSimFactory
from tests.controller.switch_kit import claimant_of, make_kit

pytestmark = [pytest.mark.controller]

MIB = 2**20
GIB = ENGINE_SIM_GIB
TOLERANCE = 512 * MIB
"""The kit's resident tolerance: a sleeping engine above resident + this stops wakes."""


def _claimant(name: str, *, resident: int = GIB, awake: int = 10 * GIB) -> Claimant:
    config = parse_engine_config({"apiVersion": API_VERSION, "kind": KIND, "model": f"m/{name}",
                                  "awakeMemory": awake, "sleepLevel": 1, "enginePort": 8000,
                                  "adapter": "vllm"})
    return Claimant(claim_uid=f"uid-{name}", namespace="ns", claim_name=name, node="node-a",
                    device="gpu-0", share_id=None, config=config, model=f"m/{name}",
                    port=8000, sleep_level=1, resident_bytes=resident, pod_name=f"pod-{name}",
                    pod_uid=f"pod-uid-{name}", pod_ip="127.0.0.1", pod_ready=True,
                    pod_deleting=False)


def _snapshot(held: dict[Claimant, int], *, unknown: frozenset[str] = frozenset()
              ) -> GpuSnapshot:
    processes = tuple(GpuProcess(pid=100 + i, used_bytes=used, claim_uid=c.claim_uid,
                                 pod_uid=c.pod_uid or "", used_bytes_unknown=c.claim_uid in unknown)
                      for i, (c, used) in enumerate(held.items()))
    used = sum(p.used_bytes for p in processes)
    return GpuSnapshot(uuid="GPU-x", device="gpu-0", total_bytes=80 * GIB, used_bytes=used,
                       free_bytes=80 * GIB - used, processes=processes)


def _ratio(claimant: Claimant, state: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(
        "rota_controller_footprint_ratio",
        {"claim": claimant.ref, "model_name": claimant.model, "device": "gpu-0",
         "state": state})


def test_a_sleeping_footprint_past_the_line_is_told_once_per_crossing() -> None:
    a, b = _claimant("a"), _claimant("b")
    told: list[FootprintNotice] = []
    watch = FootprintWatch(fraction=0.9, notify=told.append)

    def read(a_holds: int) -> list[FootprintNotice]:
        return watch.observe(_snapshot({a: a_holds, b: GIB}), target=b, claimants=[a, b],
                             tolerance_bytes=TOLERANCE)

    assert read(GIB + 300 * MIB) == []  # 0.87 of resident + tolerance
    assert _ratio(a, ASLEEP) == pytest.approx((GIB + 300 * MIB) / GIB)
    first = read(GIB + 400 * MIB)  # 0.93: past the line, still under the refusal
    assert [(n.claimant.ref, n.state, n.used_bytes, n.limit_bytes) for n in first] == [
        ("ns/a", ASLEEP, GIB + 400 * MIB, GIB + TOLERANCE)]
    assert told == first
    assert "restart" in first[0].message
    assert "resident budget" in first[0].message
    assert read(GIB + 450 * MIB) == []
    assert read(GIB + 380 * MIB) == []
    assert read(GIB + 350 * MIB) == []  # within the margin: not re-armed
    assert read(GIB + 400 * MIB) == []
    assert read(GIB) == []  # restarted: re-armed
    assert len(read(GIB + 400 * MIB)) == 1
    assert len(told) == 2


def test_an_engine_that_fills_its_awake_budget_is_not_warned_about() -> None:
    a, b = _claimant("c"), _claimant("d")
    watch = FootprintWatch(fraction=0.9)
    # b, about to wake, already holds its whole awake budget (a reconciliation's view)
    assert watch.observe(_snapshot({a: GIB, b: 10 * GIB}), target=b, claimants=[a, b],
                         tolerance_bytes=TOLERANCE) == []
    assert _ratio(b, AWAKE) == pytest.approx(1.0)
    over = watch.observe(_snapshot({a: GIB, b: 10 * GIB + 100 * MIB}), target=b,
                         claimants=[a, b], tolerance_bytes=TOLERANCE)
    assert [(n.claimant.ref, n.state) for n in over] == [("ns/d", AWAKE)]


def test_a_starting_engine_and_an_unsized_process_are_not_measured() -> None:
    a, b = _claimant("unsized"), _claimant("starting")
    watch = FootprintWatch(fraction=0.5)
    notices = watch.observe(_snapshot({a: 5 * GIB, b: 12 * GIB},
                                      unknown=frozenset({"uid-unsized"})),
                            target=b, claimants=[a], tolerance_bytes=TOLERANCE, starting=True)
    assert notices == []
    assert _ratio(a, ASLEEP) is None
    assert _ratio(b, AWAKE) is None


def test_a_claim_that_left_loses_its_series_and_its_warning() -> None:
    a, b = _claimant("gone"), _claimant("stays")
    watch = FootprintWatch(fraction=0.9)
    assert len(watch.observe(_snapshot({a: 2 * GIB, b: GIB}), target=b, claimants=[a, b],
                             tolerance_bytes=TOLERANCE)) == 1
    assert _ratio(a, ASLEEP) is not None
    watch.observe(_snapshot({b: GIB}), target=b, claimants=[b], tolerance_bytes=TOLERANCE)
    assert _ratio(a, ASLEEP) is None
    assert watch.warned == set()


@dataclass
class _FakeWriter:
    """Records what the visible-state writer would send (nothing is sent)."""

    events: list[Occurrence] = field(default_factory=list)

    def record(self, occurrence: Occurrence) -> None:
        self.events.append(occurrence)


def test_the_notice_is_a_warning_event_on_the_engine_pod() -> None:
    a = _claimant("a")
    writer = _FakeWriter()
    visibility = GpuVisibility(cast(VisibleStateWriter, writer), "gpu-0")
    notice = FootprintNotice(a, "gpu-0", ASLEEP, GIB + 400 * MIB, GIB, GIB + TOLERANCE)
    visibility.footprint_creeping(notice)
    [event] = writer.events
    assert (event.reason, event.type) == (EventReason.FOOTPRINT_CREEPING, "Warning")
    assert event.regarding.name == "pod-a"
    assert "1.4" in event.note
    assert "restart" in event.note


async def test_a_leaking_engine_is_noticed_before_a_wake_is_refused_for_it(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The simulator's leak knob grows A's resident footprint 100 MiB at every wake; A and
    B take turns until the check refuses a wake because of A: the notice about A came
    before, once."""
    a = await engine_sim_factory(model="m/a", leak_per_cycle_mib=100)
    b = await engine_sim_factory(model="m/b")
    kit = make_kit(engine_session, [("a", a), ("b", b)])
    await kit.switcher.ports.engine(kit.claimants[1]).sleep(1)
    told: list[FootprintNotice] = []
    kit.switcher.ports.footprint = FootprintWatch(fraction=0.9, notify=told.append)
    ca, cb = kit.claimants
    assert ca == claimant_of(a, "a")
    holder, target = ca, cb
    refused_at, told_at = None, None
    for turn in range(20):
        result = await kit.switcher.switch(kit.holding(holder), holder=holder, target=target,
                                           claimants=kit.claimants)
        if told and told_at is None:
            told_at = turn
        if not result.ok:
            assert result.reason == "memory_not_returned", result.message
            assert "ns/a" in result.message
            refused_at = turn
            break
        holder, target = target, holder
    assert refused_at is not None, "the leak never got a wake refused"
    assert told_at is not None
    assert told_at < refused_at
    assert [(n.claimant.ref, n.state) for n in told] == [("ns/a", ASLEEP)]
    assert told[0].used_bytes <= told[0].limit_bytes
    assert a.engine.memory.describe()["leaked_bytes"] >= 4 * 100 * MIB
