"""The real entry point in a child process: port file, signals, registry cleanup, crashes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.simulator.conftest import content_of, finish_reasons, next_event, read_events

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 30.0


@dataclass
class Child:
    proc: asyncio.subprocess.Process
    port: int
    url: str


async def _listening_port(proc: asyncio.subprocess.Process) -> int:
    assert proc.stderr is not None
    async with asyncio.timeout(DEADLINE):
        while True:
            line = await proc.stderr.readline()
            assert line, "the simulator exited before listening"
            event = json.loads(line)
            if event["event"] == "engine simulator listening":
                return int(event["port"])


@asynccontextmanager
async def child(*args: str, extra_env: dict[str, str] | None = None) -> AsyncIterator[Child]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ROTA_", "VLLM_")) and k != "NVIDIA_VISIBLE_DEVICES"}
    env.update(extra_env or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "e2e.engine_simulator", "--port", "0", *args,
        cwd=ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        port = await _listening_port(proc)
        yield Child(proc, port, f"http://127.0.0.1:{port}")
    finally:
        if proc.returncode is None:
            proc.kill()
        async with asyncio.timeout(DEADLINE):
            await proc.communicate()


async def exit_code(proc: asyncio.subprocess.Process) -> int:
    assert proc.stderr is not None
    async with asyncio.timeout(DEADLINE):
        await proc.stderr.read()  # drain, so the child never blocks on a full pipe
        return await proc.wait()


async def test_sigterm_cleans_up(tmp_path: Path) -> None:
    nvml_dir, port_file = tmp_path / "nvml", tmp_path / "port"
    async with child("--port-file", str(port_file), "--fake-nvml-dir", str(nvml_dir),
                     "--gpu-uuid", "GPU-child", "--model", "child/model", "--dev-mode") as sim:
        assert port_file.read_text().strip() == str(sim.port)
        record = json.loads((nvml_dir / f"{sim.proc.pid}.json").read_text())
        assert record == {"pid": sim.proc.pid, "gpu_uuid": "GPU-child",
                          "used_bytes": 8 * 2**30}
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{sim.url}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "child/model"
            async with session.post(f"{sim.url}/sleep") as resp:
                assert resp.status == 200
        record = json.loads((nvml_dir / f"{sim.proc.pid}.json").read_text())
        assert record["used_bytes"] == 2**30
        sim.proc.send_signal(signal.SIGTERM)
        assert await exit_code(sim.proc) == 0
    assert not (nvml_dir / f"{sim.proc.pid}.json").exists()
    assert not port_file.exists()


async def test_sigterm_aborts_a_stuck_stream_after_the_grace(tmp_path: Path) -> None:
    payload: dict[str, Any] = {"prompt": "3 + 4", "stream": True, "max_tokens": 3,
                               "ignore_eos": True}
    async with child("--stall-generation", "--shutdown-grace-seconds", "0") as sim, \
            aiohttp.ClientSession() as session:
        async with session.post(f"{sim.url}/v1/completions", json=payload) as resp:
            sim.proc.send_signal(signal.SIGTERM)
            events = await read_events(resp)
        assert finish_reasons(events) == ["abort"]
        assert await exit_code(sim.proc) == 0


async def test_sigterm_lets_a_running_stream_finish(tmp_path: Path) -> None:
    payload: dict[str, Any] = {"prompt": "3 + 4", "stream": True, "max_tokens": 3,
                               "ignore_eos": True}
    async with child("--tokens-per-second", "20", "--shutdown-grace-seconds", "20") as sim, \
            aiohttp.ClientSession() as session:
        async with session.post(f"{sim.url}/v1/completions", json=payload) as resp:
            first = await next_event(resp)
            sim.proc.send_signal(signal.SIGTERM)
            events = [first, *await read_events(resp)]
        assert finish_reasons(events) == ["length"]
        assert content_of(events).startswith("7")
        assert await exit_code(sim.proc) == 0


async def test_crash_on_sleep_exits_after_answering(tmp_path: Path) -> None:
    nvml_dir = tmp_path / "nvml"
    async with child("--crash-on-sleep", "--fake-nvml-dir", str(nvml_dir),
                     "--dev-mode") as sim:
        async with aiohttp.ClientSession() as session, \
                session.post(f"{sim.url}/sleep", params={"level": "1"}) as resp:
            assert resp.status == 200
        assert await exit_code(sim.proc) == 70
    # A dead engine leaves its entry, as a killed process would; NVML ignores dead pids.
    assert (nvml_dir / f"{sim.proc.pid}.json").exists()


async def test_crash_now_at_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "e2e.engine_simulator", "--port", "0", "--crash-now",
        cwd=ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    assert await exit_code(proc) == 70


async def test_a_start_that_does_not_fit_exits_like_vllm(tmp_path: Path) -> None:
    """Engine A holds the GPU; B's start runs out of memory, logs vLLM's messages and exits
    with status 1, while A keeps serving."""
    nvml_dir = tmp_path / "nvml"
    common = ("--fake-nvml-dir", str(nvml_dir), "--gpu-uuid", "GPU-small",
              "--gpu-memory-bytes", "16Gi")
    async with child(*common, "--awake-memory-bytes", "10Gi") as a:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "e2e.engine_simulator", "--port", "0", *common,
            "--awake-memory-bytes", "8Gi", cwd=ROOT, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        async with asyncio.timeout(DEADLINE):
            _, err = await proc.communicate()
        assert proc.returncode == 1
        text = err.decode()
        assert "torch.OutOfMemoryError: CUDA out of memory" in text
        assert "CUDA Error: out of memory at" in text
        assert "Engine core initialization failed" in text
        assert not (nvml_dir / f"{proc.pid}.json").exists()
        async with aiohttp.ClientSession() as session, \
                session.get(f"{a.url}/health") as resp:
            assert resp.status == 200


async def test_dev_routes_need_vllm_server_dev_mode() -> None:
    async with child() as plain, aiohttp.ClientSession() as session:
        async with session.post(f"{plain.url}/sleep") as resp:
            assert resp.status == 404
            assert await resp.json() == {"detail": "Not Found"}
        async with session.get(f"{plain.url}/health") as resp:
            assert resp.status == 200
    async with child(extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as dev, \
            aiohttp.ClientSession() as session, session.post(f"{dev.url}/sleep") as resp:
        assert resp.status == 200
