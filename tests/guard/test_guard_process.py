"""rota-engine-guard as an engine container's entrypoint wrapper: it starts the engine on
loopback, serves in front of it, forwards SIGTERM, and exits with the engine's status."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from controller.lease.engines import CONTROL_TOKEN_HEADER
from e2e.cluster.local import free_port
from e2e.harness.waiting import eventually_async

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 60.0


async def _port(proc: asyncio.subprocess.Process) -> int:
    assert proc.stderr is not None
    async with asyncio.timeout(DEADLINE):
        while True:
            line = await proc.stderr.readline()
            assert line, "the guard exited before listening"
            event = json.loads(line)
            if event["event"] == "engine guard listening":
                return int(event["port"])


@asynccontextmanager
async def guard(tmp_path: Path, *engine_args: str
                ) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    engine_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "VLLM_"))}
    env["ROTA_CONTROL_TOKEN"] = "t0ken"  # what the driver's CDI spec gives the container
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.guard", "--port", "0",
        "--upstream", f"http://127.0.0.1:{engine_port}",
        "--shutdown-grace-s", "20", "--",
        sys.executable, "-m", "e2e.engine_simulator", "--host", "127.0.0.1",
        "--port", str(engine_port), "--dev-mode", "--log-level", "warning", *engine_args,
        cwd=ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{await _port(proc)}"
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
        async with asyncio.timeout(DEADLINE):
            await proc.communicate()


async def _exit_code(proc: asyncio.subprocess.Process) -> int:
    assert proc.stderr is not None
    async with asyncio.timeout(DEADLINE):
        await proc.stderr.read()
        return await proc.wait()


async def test_it_serves_in_front_of_the_engine_and_passes_sigterm_on(tmp_path: Path) -> None:
    async with guard(tmp_path) as (proc, url), aiohttp.ClientSession() as session:
        async def healthy() -> bool:
            try:
                async with session.get(f"{url}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await eventually_async(healthy, timeout=DEADLINE, what="the engine behind the guard")
        async with session.post(f"{url}/sleep") as resp:
            assert resp.status == 401
        async with session.post(f"{url}/sleep", headers={CONTROL_TOKEN_HEADER: "t0ken"}
                                ) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await _exit_code(proc) == 0  # the engine's own clean exit


async def test_it_exits_with_the_engines_status(tmp_path: Path) -> None:
    async with guard(tmp_path, "--crash-now") as (proc, _url):
        assert await _exit_code(proc) == 70
