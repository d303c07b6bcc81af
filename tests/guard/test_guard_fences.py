"""The engine guard checks the fences a control call carries (the review's hypothesis of a
paused controller's stale wake).

A control call may carry ``X-Rota-Fence: <GPU Lease>=<fence>[,...]``; the guard remembers,
per Lease, the highest fence of a control call it let through and refuses (409, never
forwarded) one whose fence is lower. A recording upstream shows what reached the engine.
The header's name is written out here, so that these tests run (and fail on the stale
call reaching the engine) against a guard that does not know it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.guard.guard_kit import (
    API_KEY_ONLY,
    CONTROL_ONLY,
    Answer,
    GuardedRecorder,
    guard_over_recorder,
)

FENCE = "X-Rota-Fence"
GPU0 = "rota-gpu-node-a-gpu-0"
GPU1 = "rota-gpu-node-a-gpu-1"


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[GuardedRecorder]:
    async with guard_over_recorder(tmp_path) as guarded:
        yield guarded


async def _wake(guarded: GuardedRecorder, fences: str | None) -> Answer:
    headers = dict(CONTROL_ONLY)
    if fences is not None:
        headers[FENCE] = fences
    return await guarded.send("POST", "/wake_up", headers)


def _error(answer: Answer) -> dict[str, object]:
    error: dict[str, object] = json.loads(answer.body)["error"]
    return error


def test_the_header_is_the_contracts() -> None:
    from rota.api.engine_guard import FENCE_HEADER, format_fences, parse_fences
    assert FENCE_HEADER == FENCE
    fences = {GPU1: 7, GPU0: 12}
    assert format_fences(fences) == f"{GPU0}=12,{GPU1}=7"
    assert parse_fences(format_fences(fences)) == fences
    assert parse_fences(f" {GPU0}=3 , {GPU1}=0") == {GPU0: 3, GPU1: 0}


async def test_a_lower_fence_is_refused_and_never_forwarded(
        guarded: GuardedRecorder, caplog: pytest.LogCaptureFixture) -> None:
    assert (await _wake(guarded, f"{GPU0}=5")).status == 200
    arrived = len(guarded.recorder.arrivals)
    with caplog.at_level(logging.WARNING, logger="controller.guard.proxy"):
        stale = await _wake(guarded, f"{GPU0}=4")
    assert len(guarded.recorder.arrivals) == arrived  # old guard: forwarded, 200
    assert stale.status == 409
    error = _error(stale)
    assert (error["type"], error["code"]) == ("ConflictError", 409)
    assert "stale fence" in str(error["message"])
    assert f"{GPU0} 4 < 5" in str(error["message"])
    record = next(r for r in caplog.records if "fence" in r.getMessage())
    assert (record.__dict__["fences"], record.__dict__["highest"]) == ({GPU0: 4}, {GPU0: 5})


async def test_an_equal_or_higher_fence_is_accepted(guarded: GuardedRecorder) -> None:
    for fences in (f"{GPU0}=5", f"{GPU0}=5", f"{GPU0}=6", f"{GPU0}=6"):
        assert (await _wake(guarded, fences)).status == 200
    assert len(guarded.recorder.arrivals) == 4
    assert (await _wake(guarded, f"{GPU0}=5")).status == 409


async def test_a_call_without_the_header_is_accepted(guarded: GuardedRecorder) -> None:
    assert (await _wake(guarded, f"{GPU0}=9")).status == 200
    assert (await _wake(guarded, None)).status == 200
    assert len(guarded.recorder.arrivals) == 2


async def test_fences_are_kept_per_lease(guarded: GuardedRecorder) -> None:
    assert (await _wake(guarded, f"{GPU0}=9")).status == 200
    assert (await _wake(guarded, f"{GPU1}=1")).status == 200  # another Lease's numbers
    assert (await _wake(guarded, f"{GPU1}=0")).status == 409
    assert (await _wake(guarded, f"{GPU0}=8")).status == 409


async def test_a_gang_header_is_refused_when_any_lease_is_behind(
        guarded: GuardedRecorder) -> None:
    assert (await _wake(guarded, f"{GPU0}=5,{GPU1}=3")).status == 200
    refused = await _wake(guarded, f"{GPU0}=6,{GPU1}=2")
    assert refused.status == 409
    assert f"{GPU1} 2 < 3" in str(_error(refused)["message"])
    # The refused call raised nothing: GPU0's 5 is still good enough.
    assert (await _wake(guarded, f"{GPU0}=5")).status == 200
    assert (await _wake(guarded, f"{GPU1}=3,{GPU0}=5")).status == 200
    assert len(guarded.recorder.arrivals) == 3


@pytest.mark.parametrize("fences", [
    "", ",", f"{GPU0}", f"{GPU0}=", f"={GPU0}", "=5", f"{GPU0}=x", f"{GPU0}=-1",
    f"{GPU0}=+1", f"{GPU0}=1.5", f"{GPU0}=1e3", "ROTA-GPU=1", f"{GPU0}=1;{GPU1}=2",
    f"{GPU0}=1,{GPU0}=2", f"{GPU0}=1,", f"{GPU0}=99999999999999999999",
    f"{GPU0}=9223372036854775808", f"{GPU0}==1", "a b=1",
    ",".join(f"lease-{i}=1" for i in range(65)),
])
async def test_a_malformed_header_is_a_400(guarded: GuardedRecorder, fences: str) -> None:
    answer = await _wake(guarded, fences)
    assert (answer.status, guarded.recorder.arrivals) == (400, [])
    error = _error(answer)
    assert (error["type"], error["code"]) == ("BadRequestError", 400)


async def test_only_an_authenticated_control_call_moves_the_fence(
        guarded: GuardedRecorder) -> None:
    """A caller without the control token cannot raise the fence and lock rota out."""
    unauthenticated = await guarded.send("POST", "/wake_up", {FENCE: f"{GPU0}=2000000000"})
    assert unauthenticated.status == 401
    assert (await _wake(guarded, f"{GPU0}=1")).status == 200


async def test_client_calls_are_not_fenced(guarded: GuardedRecorder) -> None:
    assert (await _wake(guarded, f"{GPU0}=5")).status == 200
    answer = await guarded.send("GET", "/v1/models", API_KEY_ONLY | {FENCE: f"{GPU0}=1"})
    assert answer.status == 200
