"""The gang chaos campaign in the suite, short: TP=4, TP=2 and one-GPU engines on an 8-GPU
node under faults and controller restarts, through the controller's gang switches (the
full run is ``python -m e2e.chaos.gangs --switches 10000``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from controller.claimants import Claimant
from controller.lease.device import HandbackProblem, check_before_wake
from controller.lease.switch import Switcher
from e2e.chaos import gangs

pytestmark = pytest.mark.controller


async def test_a_short_gang_campaign_keeps_every_promise(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    caplog.set_level(logging.CRITICAL)
    report = await gangs.run(switches=600, seed=7, max_seconds=300)
    print("\n".join(report.lines()))  # the campaign's figures, shown when a check fails
    assert report.switches >= 600
    assert report.violations == [], "two engines awake on one GPU"
    assert report.unanswered == 0
    assert report.unowned == []
    assert report.lingering == 0
    assert report.stalls == 0
    assert not report.timed_out
    assert report.passed(), "\n".join(report.lines())


@pytest.mark.sampled
async def test_the_campaign_sees_a_controller_without_gang_switches(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard can fail: with the controller as it was before gang switches (every
    switch made by the worker of the target's first GPU, which read that GPU alone), the
    campaign finds two engines awake on one GPU."""
    caplog.set_level(logging.CRITICAL)

    async def first_gpu_only(self: Switcher, target: Claimant,
                             claimants: Sequence[Claimant], timings: dict[str, float], *,
                             starting: bool = False, awake: Sequence[Claimant] = ()
                             ) -> HandbackProblem | None:
        snapshot = await self.snapshot(target.gpu, timings)
        return check_before_wake(snapshot, target=target, claimants=claimants,
                                 tolerance_bytes=self.limits.tolerance_bytes,
                                 unknown_limit_bytes=self.limits.unknown_limit_bytes)

    monkeypatch.setattr("controller.lease.gpu.needs_gang", lambda target, holders: False)
    monkeypatch.setattr(Switcher, "check_device", first_gpu_only)
    report = await gangs.run(switches=300, seed=7, max_seconds=120)
    assert report.violations, "\n".join(report.lines())
    assert not report.passed()


async def test_a_short_awake_set_campaign_keeps_the_sets_promise(
        caplog: pytest.LogCaptureFixture) -> None:
    """With awake sets on: sets form (two engines awake on a GPU at most checks), and no
    instant has a GPU's memory over its total, more awake than the budgets fit, or two
    awake beside the TP=2 engine; every GPU ends awake exactly as its Lease says."""
    caplog.set_level(logging.CRITICAL)
    report = await gangs.run(switches=600, seed=7, max_seconds=300, awake_set=True)
    print("\n".join(report.lines()))
    assert report.switches >= 600
    assert report.together > report.checks // 2, "the sets never formed"
    assert report.put_to_sleep > 0, "no newcomer displaced a member"
    assert report.violations == []
    assert report.unowned == []
    assert report.passed(), "\n".join(report.lines())


@pytest.mark.sampled
async def test_the_awake_set_campaign_sees_a_set_that_does_not_fit(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard can fail: with every newcomer let join the set (the fit rule answering
    yes) and the NVML check before the wake skipped, three engines wake together on a
    GPU they overfill, and the campaign says so.

    Whether a campaign gets there depends on its faults and its timing: the engine
    simulator refuses a wake that finds no room (``gpu_oom``), so the GPU is overfilled
    only where an engine's memory is not what its state says (an injected sleep that
    lies). About half the campaigns of 300 switches do, on the old policy as on the new:
    the test runs up to 12 seeds and stops at the first that does."""
    caplog.set_level(logging.CRITICAL)

    async def always_fits(*args: object, **kwargs: object) -> bool:
        return True

    async def no_check(*args: object, **kwargs: object) -> None:
        return None

    monkeypatch.setattr("controller.lease.worker.sets.AwakeSets.fits_beside", always_fits)
    monkeypatch.setattr(Switcher, "check_device", no_check)
    seen: list[str] = []
    for seed in range(7, 19):
        report = await gangs.run(switches=300, seed=seed, max_seconds=120, awake_set=True)
        if any("in use of" in v for v in report.violations):
            assert not report.passed()
            return
        seen.append(f"seed {seed}: " + " / ".join(report.lines()[:4]))
    raise AssertionError("no campaign saw the overfilled GPU:\n" + "\n".join(seen))
