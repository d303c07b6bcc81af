"""The guard's control credential is its claim's own (review F1): the token rota's driver
writes into the environment of the claim's containers (``ROTA_CONTROL_TOKEN``), never a
Secret shared by every engine pod; and the engine it starts does not inherit it.

The guard runs as the engine container's entrypoint, as shipped. The environment also
names a shared control-token file, as every engine pod had on the old code: that value
must open nothing (on the old code it opened every engine, and the claim's token none)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from e2e.cluster.local import free_port
from e2e.harness.waiting import eventually_async
from rota.api.engine_guard import CONTROL_TOKEN_HEADER
from tests.guard.test_guard_process import DEADLINE, ROOT, _port

CLAIM_TOKEN = "0f" * 32
SHARED_TOKEN = "one-token-for-every-engine"


@asynccontextmanager
async def entrypoint_guard(tmp_path: Path, env_file: Path) -> AsyncIterator[str]:
    """The guard in front of a simulated engine whose command first writes its
    environment to ``env_file``; yields the guard's URL once the engine is healthy."""
    shared = tmp_path / "shared-token"
    shared.write_text(SHARED_TOKEN + "\n")
    engine_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "VLLM_"))}
    env |= {"ROTA_CONTROL_TOKEN": CLAIM_TOKEN, "ROTA_GUARD_CONTROL_TOKEN_FILE": str(shared)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.guard", "--port", "0",
        "--upstream", f"http://127.0.0.1:{engine_port}", "--shutdown-grace-s", "20", "--",
        "/bin/sh", "-c", 'env > "$0" && exec "$@"', str(env_file),
        sys.executable, "-m", "e2e.engine_simulator", "--host", "127.0.0.1",
        "--port", str(engine_port), "--dev-mode", "--log-level", "warning",
        cwd=ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{await _port(proc)}"
        async with aiohttp.ClientSession() as session:
            async def healthy() -> bool:
                try:
                    async with session.get(f"{url}/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually_async(healthy, timeout=DEADLINE, what="the engine behind the guard")
        yield url
    finally:
        # SIGTERM, not SIGKILL: the guard stops its engine, which holds the stderr pipe.
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(DEADLINE):
            await proc.communicate()


async def _is_sleeping(session: aiohttp.ClientSession, url: str, token: str) -> int:
    async with session.get(f"{url}/is_sleeping", headers={CONTROL_TOKEN_HEADER: token}
                           ) as resp:
        return resp.status


async def test_the_claims_token_opens_the_guard_and_a_shared_one_does_not(
        tmp_path: Path) -> None:
    env_file = tmp_path / "engine.env"
    async with entrypoint_guard(tmp_path, env_file) as url, \
            aiohttp.ClientSession() as session:
        assert await _is_sleeping(session, url, SHARED_TOKEN) == 401
        assert await _is_sleeping(session, url, CLAIM_TOKEN) == 200
    engine_env = dict(line.split("=", 1) for line in env_file.read_text().splitlines()
                      if "=" in line)
    assert "ROTA_CONTROL_TOKEN" not in engine_env, "the engine inherited the control token"
    assert CLAIM_TOKEN not in env_file.read_text()


def test_without_the_claims_token_the_guard_does_not_start() -> None:
    from controller.guard.app import MissingControlToken, control_credential

    with pytest.raises(MissingControlToken, match=r"resources\.claims"):
        control_credential({"ROTA_GUARD_CONTROL_TOKEN_FILE": "/etc/rota/control/token"})
    with pytest.raises(MissingControlToken):
        control_credential({"ROTA_CONTROL_TOKEN": "  "})
