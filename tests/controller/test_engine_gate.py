"""The start gate as an engine container runs it: a separate process in front of the
engine command, talking to a lease controller's start API over a unix socket.

The controller here is a simulator of the start API (the real grant logic runs in the
cluster tests of start-up admission): it answers "not yet" a given number of times, then
grants, and records every question. The engine is a tiny Python command that reports
what it sees.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from controller import engine_gate
from controller.lease.starts import StartReply, StartRequest
from rota.api.start_contract import PATH

pytestmark = [pytest.mark.controller]

ENGINE = [sys.executable, "-c",
          "import os, sys; print(os.environ.get('ROTA_START_TOKEN', 'no token'), "
          "os.environ.get('ROTA_CLAIM_UID')); sys.exit(7)"]
DEADLINE_S = 30.0


@dataclass
class StartApiSimulator:
    """The lease controller's start API, scripted."""

    socket: Path
    refusals: int = 2
    status: int = 200
    questions: list[dict[str, Any]] = field(default_factory=list)
    _runner: web.AppRunner | None = None

    async def _start(self, request: web.Request) -> web.Response:
        body = StartRequest.model_validate_json(await request.read())
        self.questions.append(body.model_dump())
        if self.status != 200:
            return web.json_response(StartReply(reason="unauthorized").model_dump(),
                                     status=self.status)
        granted = len(self.questions) > self.refusals
        return web.json_response(StartReply(granted=granted, reason="" if granted else
                                            "waiting", retry_after_s=0.01).model_dump())

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(PATH, self._start)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket)).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def controller(short_tmp: Path) -> AsyncIterator[StartApiSimulator]:
    sim = StartApiSimulator(short_tmp / "start.sock")
    await sim.start()
    try:
        yield sim
    finally:
        await sim.stop()


def _env(socket: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "ROTA_START_SOCKET": str(socket), "ROTA_START_TOKEN": "t0ken",
            "ROTA_CLAIM_UID": "uid-1", **extra}


async def _gate(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(DEADLINE_S):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


GATE = [sys.executable, "-m", "controller.engine_gate"]


async def test_the_engine_starts_only_when_granted_and_without_the_token(
        controller: StartApiSimulator) -> None:
    code, out, _ = await _gate(*GATE, "--", *ENGINE, env=_env(controller.socket))
    assert code == 7, "the engine itself ran (exec: its exit status is the container's)"
    assert out.split() == ["no", "token", "uid-1"]
    assert len(controller.questions) == 3, "two refusals, then the grant"
    assert [q["attempt"] for q in controller.questions] == [0, 1, 2]
    assert {q["claim_uid"] for q in controller.questions} == {"uid-1"}
    assert {q["token"] for q in controller.questions} == {"t0ken"}


async def test_an_absent_controller_is_asked_again_until_it_listens(short_tmp: Path) -> None:
    sim = StartApiSimulator(short_tmp / "later.sock", refusals=0)
    proc = await asyncio.create_subprocess_exec(
        *GATE, "--", *ENGINE, env=_env(sim.socket), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(DEADLINE_S):
            line = await proc.stderr.readline()  # its first failed question
        assert "did not answer" in json.loads(line)["event"]
        await sim.start()
        async with asyncio.timeout(DEADLINE_S):
            out, _ = await proc.communicate()
    finally:
        await sim.stop()
    assert proc.returncode == 7
    assert out.decode().split()[-1] == "uid-1"


async def test_a_refused_token_never_starts_the_engine(controller: StartApiSimulator) -> None:
    controller.status = 401
    code, out, _ = await _gate(*GATE, "--", *ENGINE, env=_env(controller.socket))
    assert code == engine_gate.EX_CONFIG
    assert out == ""


async def test_no_slot_in_time_exits_for_the_kubelet_to_retry(
        controller: StartApiSimulator) -> None:
    controller.refusals = 10**6
    code, out, _ = await _gate(*GATE, "--max-wait-s=0.5", "--", *ENGINE,
                               env=_env(controller.socket))
    assert code == engine_gate.EX_TEMPFAIL
    assert out == ""


async def test_without_its_environment_the_gate_refuses_unless_told_otherwise(
        short_tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_START_")}
    code, out, _ = await _gate(*GATE, "--", *ENGINE, env=env)
    assert code == engine_gate.EX_CONFIG
    assert out == ""
    code, out, _ = await _gate(*GATE, "--if-configured", "--", *ENGINE, env=env)
    assert code == 7


async def test_the_installed_copy_runs_without_rota(controller: StartApiSimulator,
                                                    short_tmp: Path) -> None:
    target = engine_gate.install(short_tmp / "bin")
    assert os.access(target, os.X_OK)
    bare = {"PATH": os.environ.get("PATH", ""), **{
        k: v for k, v in _env(controller.socket).items() if k.startswith("ROTA_")}}
    code, out, _ = await _gate(sys.executable, "-I", str(target), "--", *ENGINE, env=bare)
    assert code == 7
    assert out.split() == ["no", "token", "uid-1"]
