"""The start-gate socket a twin cannot take (review F4): instances of the lease controller
on one node serve in one directory; the gates dial one fixed path, which must lead to the
leader whatever another instance does there (a surge pod that starts and exits, an older
rota that unlinks the path and binds it itself)."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from controller import engine_gate
from controller.lease import starts
from controller.lease.node import NodeController, StartAnswer
from driver.startgate import SOCKET_NAME
from e2e.harness.waiting import eventually_async
from rota.api.start_contract import StartQuestion

pytestmark = pytest.mark.controller


@pytest.fixture(autouse=True)
def _quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Instances look at the path often here, so the tests wait little."""
    monkeypatch.setattr(starts, "SOCKET_CHECK_S", 0.05, raising=False)


@dataclass
class _FakeElection:
    leader: bool

    def is_leader(self) -> bool:
        return self.leader


@dataclass
class _FakeNode:
    """The node controller as the start API sees it: it grants when it leads and says so
    otherwise, and records who asked."""

    election: _FakeElection
    asked: list[str] = field(default_factory=list)

    async def request_start(self, claim_uid: str, token: str) -> StartAnswer:
        self.asked.append(claim_uid)
        if not self.election.is_leader():
            return StartAnswer(granted=False, reason="not_leader", retry_after_s=1.0)
        return StartAnswer(granted=True)


def _node(*, leader: bool) -> NodeController:
    return cast(NodeController, _FakeNode(_FakeElection(leader)))


def _asked(node: NodeController) -> list[str]:
    return cast(_FakeNode, node).asked


async def _gate_answer(path: Path) -> str:
    """What a gate gets for one question on ``path``: ``granted``, ``not granted`` or the
    connection error (as a gate sees it)."""
    question = StartQuestion(claim_uid="claim-1", token="t0ken", attempt=0)
    try:
        status, answer = await asyncio.to_thread(engine_gate.ask, str(path), question,
                                                 timeout_s=5.0)
    except (OSError, http.client.HTTPException) as exc:
        return repr(exc)
    return "granted" if status == 200 and answer.get("granted") is True else "not granted"


async def test_a_twin_that_exits_leaves_the_gates_the_leader(short_tmp: Path) -> None:
    path = short_tmp / SOCKET_NAME
    leader = _node(leader=True)
    first = await starts.serve(leader, path)
    try:
        twin = await starts.serve(_node(leader=False), path)
        while_twin_lives = await _gate_answer(path)
        await twin.cleanup()  # the twin exits (a crash-looping surge pod, a rollback)
        after_it_exited = await _gate_answer(path)
        assert [while_twin_lives, after_it_exited] == ["granted", "granted"]
        assert _asked(leader) == ["claim-1", "claim-1"]
    finally:
        await first.cleanup()


async def test_a_leader_restores_a_path_taken_from_it(short_tmp: Path) -> None:
    """An older rota unlinks the path and binds its own socket there, then exits: the
    leader points the path back at itself."""
    path = short_tmp / SOCKET_NAME
    leader = _node(leader=True)
    first = await starts.serve(leader, path)
    try:
        path.unlink()
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(str(path))
        squatter.listen(1)
        squatter.close()  # exited: its socket file stays, and refuses

        async def answered() -> bool:
            return await _gate_answer(path) == "granted"
        await eventually_async(answered, timeout=15, what="the leader's path restored")
    finally:
        await first.cleanup()


async def test_a_new_leader_takes_the_path_and_no_follower_does(short_tmp: Path) -> None:
    path = short_tmp / SOCKET_NAME
    old, new = _node(leader=True), _node(leader=False)
    first = await starts.serve(old, path)
    second = await starts.serve(new, path)
    try:
        assert os.readlink(path) == first.path.own.name, "a follower took a live path"
        cast(_FakeNode, old).election.leader = False
        cast(_FakeNode, new).election.leader = True

        async def moved() -> bool:
            return os.readlink(path) == second.path.own.name
        await eventually_async(moved, timeout=15, what="the new leader's path")
        assert await _gate_answer(path) == "granted"
        assert _asked(new) == ["claim-1"]
    finally:
        await second.cleanup()
        await first.cleanup()
    assert not path.is_symlink(), "the last instance left a path"


async def test_dead_instances_sockets_are_removed_and_files_are_left(short_tmp: Path) -> None:
    path = short_tmp / SOCKET_NAME
    dead = starts.instance_socket(path, "dead0000")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(dead))
    gone.close()  # SIGKILLed: nobody removed it
    hour_ago = time.time() - 3600
    os.utime(dead, (hour_ago, hour_ago))
    young = starts.instance_socket(path, "young000")
    born = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    born.bind(str(young))  # a twin between its bind and its listen
    born.close()
    server = await starts.serve(_node(leader=True), path)
    try:
        assert not dead.exists()
        assert young.exists()
    finally:
        await server.cleanup()
    squat = short_tmp / "other"
    squat.mkdir()
    other = squat / SOCKET_NAME
    other.write_text("not a socket\n")
    server = await starts.serve(_node(leader=True), other)
    try:
        assert other.read_text() == "not a socket\n", "a file at the path was replaced"
    finally:
        await server.cleanup()
