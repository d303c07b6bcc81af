"""The driver's liveness probe fails while the preparer is wedged (a call stuck far past
its deadline, e.g. a worker thread in a hung disk write), so that the kubelet restarts the
container instead of every later prepare queueing behind the stuck one forever."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from driver.calls import CallBook
from driver.probes import make_app


class ClockSimulator:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_healthz_fails_while_a_call_is_stuck_past_its_deadline(tmp_path: Path) -> None:
    clock = ClockSimulator()
    book = CallBook(clock=clock, default_deadline_s=45.0, stall_grace_s=15.0)
    app = make_app(registration_socket=tmp_path / "reg.sock", dra_socket=tmp_path / "dra.sock",
                   ready=lambda: "", wedged=book.stalled)
    async with TestClient(TestServer(app)) as http:
        with book.arrive("prepare", ["uid-1"]):
            clock.now += 61.0
            answer = await http.get("/healthz")
            assert answer.status == 503
            assert "wedged" in await answer.text()
        # Once the stuck call has finished, the probe checks the sockets again (none here).
        answer = await http.get("/healthz")
        assert answer.status == 503
        assert "wedged" not in await answer.text()
