"""The chaos campaign's own bookkeeping: how answers and Lease transitions are read."""

from __future__ import annotations

import pytest

from controller import naming
from controller.leases import GpuLease
from e2e.chaos.load import classify
from e2e.chaos.observe import transition
from e2e.chaos.tally import Answer, Tally

DONE = b'data: {"choices": [{"delta": {"content": "7"}}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(("status", "headers", "body", "kind"), [
    (200, {}, DONE, Answer.OK),
    (200, {}, b'data: {"choices": []}\n\n', Answer.UNANSWERED),  # no [DONE]: cut short
    (200, {}, b'data: {"error": {"type": "switch_timeout"}}\n\ndata: [DONE]\n\n',
     Answer.REFUSED),
    (503, {"Retry-After": "2"}, b'{"error": {}}', Answer.REFUSED),
    (429, {"Retry-After": "1"}, b"", Answer.REFUSED),
    (503, {}, b"no hint", Answer.UNANSWERED),
    (500, {"Retry-After": "1"}, b"boom", Answer.UNANSWERED),
])
def test_answers_are_classified_by_the_campaigns_rule(status: int, headers: dict[str, str],
                                                      body: bytes, kind: str) -> None:
    assert classify(status, headers, body)[0] == kind


def _lease(state: str, *, fence: int = 1, controller: str = "ctl-0", error: str = ""
           ) -> GpuLease:
    return GpuLease(name="rota-gpu-n-gpu-0", node="n", device="gpu-0", state=state,
                    fence=fence, controller=controller, last_error=error)


def test_a_switch_ends_when_switching_gives_way() -> None:
    switching = _lease(naming.STATE_SWITCHING)
    ended = transition(switching, _lease(naming.STATE_AWAKE))
    assert ended is not None
    assert ended.ok
    failed = transition(switching, _lease(naming.STATE_AWAKE, error="gpu_oom: no room"))
    assert failed is not None
    assert (failed.ok, failed.reason) == (False, "gpu_oom")
    taken = transition(switching, _lease(naming.STATE_AWAKE, controller="ctl-1"))
    assert taken is not None
    assert (taken.ok, taken.reason) == (False, "controller_crash")


def test_no_switch_ends_without_one_in_progress() -> None:
    assert transition(None, _lease(naming.STATE_AWAKE)) is None
    assert transition(_lease(naming.STATE_AWAKE), _lease(naming.STATE_AWAKE)) is None
    assert transition(_lease(naming.STATE_SWITCHING), _lease(naming.STATE_SWITCHING)) is None


def test_the_report_carries_the_campaigns_targets() -> None:
    tally = Tally()
    tally.switch(ok=True)
    tally.switch(ok=False, reason="memory_not_returned")
    tally.answer(Answer.UNANSWERED, "ClientConnectorError")
    report = tally.report()
    assert report["switches"] == 2
    assert report["failures_by_reason"] == {"memory_not_returned": 1}
    assert report["requests_without_answer"] == 1
    assert report["samples"]["unanswered"] == ["ClientConnectorError"]
