"""The routes a switch that keeps requests calls (``/pause``, ``/resume``, ``/is_paused``)
are control calls: only the claim's control token opens them. A tenant that could pause
its engine, or its neighbour's, would stop turns as surely as one that could sleep it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.guard.paths import Access, classify
from controller.lease.engines.vllm import KEEP_CALLS
from rota.api.engine_guard import CONTROL_TOKEN_HEADER
from tests.guard.guard_kit import (
    API_KEY_ONLY,
    CONTROL_ONLY,
    TOKEN,
    GuardedRecorder,
    guard_over_recorder,
)


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[GuardedRecorder]:
    async with guard_over_recorder(tmp_path) as guarded:
        yield guarded


def test_every_call_of_a_kept_sleep_is_a_control_call() -> None:
    for method, path in KEEP_CALLS:
        assert classify(method, path) is Access.CONTROL, (method, path)


@pytest.mark.parametrize(("method", "target"), [
    ("POST", "/pause?mode=keep"), ("POST", "/resume"), ("GET", "/is_paused")])
async def test_a_tenant_cannot_pause_resume_or_read_it(
        guarded: GuardedRecorder, method: str, target: str) -> None:
    for headers in ({}, API_KEY_ONLY, {CONTROL_TOKEN_HEADER: TOKEN + "x"},
                    {"Authorization": f"Bearer {TOKEN}"}):
        answer = await guarded.send(method, target, headers)
        assert answer.status == 401, (target, headers)
    assert guarded.recorder.arrivals == []
    answer = await guarded.send(method, target, CONTROL_ONLY)
    assert answer.status == 200
    assert [a.raw_path for a in guarded.recorder.arrivals] == [target]
