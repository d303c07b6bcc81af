"""Fixtures for the engine simulator's tests: a real simulator on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from e2e.engine_simulator import Settings, create_app
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.keys import ENGINE_KEY

MODEL = "sim/test-model"
PID = 424242  # registered pid for in-process simulators (the test process may run several)
GIB = 2**30
DEADLINE = 10.0


@dataclass
class Sim:
    client: TestClient[Any, Any]
    engine: Engine
    settings: Settings
    exits: list[int] = field(default_factory=list)
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    async def state(self) -> dict[str, Any]:
        async with self.client.get("/sim/state") as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    async def faults(self, **changes: bool) -> dict[str, Any]:
        async with self.client.post("/sim/faults", json=changes) as resp:
            assert resp.status == 200, await resp.text()
            body: dict[str, Any] = await resp.json()
            return body

    async def post_empty(self, path: str, **params: Any) -> None:
        """POST a control call that must answer 200 with an empty body."""
        async with self.client.post(path, params=params) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.read() == b""

    async def post_json(self, path: str, body: Any = None, **params: Any) -> Any:
        """POST a control call that must answer 200 with a JSON body; the body."""
        async with self.client.post(path, params=params, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def reset_prefix_cache(self) -> None:
        assert await self.post_json("/reset_prefix_cache") == {"success": True}

    async def reload_weights(self) -> None:
        body = await self.post_json("/collective_rpc", {"method": "reload_weights"})
        assert body == {"results": [None]}

    async def is_sleeping(self) -> bool:
        async with self.client.get("/is_sleeping") as resp:
            assert resp.status == 200
            body = await resp.json()
            assert isinstance(body["is_sleeping"], bool)
            return bool(body["is_sleeping"])

    async def ask(self, prompt: str = "What is 3 + 4?", **extra: Any) -> dict[str, Any]:
        """A non-streamed chat completion that must succeed."""
        payload = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]} | extra
        async with self.client.post("/v1/chat/completions", json=payload) as resp:
            assert resp.status == 200, await resp.text()
            body: dict[str, Any] = await resp.json()
            return body

    async def answer(self, prompt: str = "What is 3 + 4?") -> str:
        body = await self.ask(prompt)
        return str(body["choices"][0]["message"]["content"])

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait (bounded) until the engine's state satisfies ``predicate``."""
        async with asyncio.timeout(DEADLINE):
            await self.engine.wait_for(predicate)


async def next_event(resp: ClientResponse) -> dict[str, Any] | str:
    """The next server-sent event's data: a JSON object, or the string ``[DONE]``."""
    async with asyncio.timeout(DEADLINE):
        while True:
            line = (await resp.content.readline()).decode()
            assert line, "stream ended without [DONE]"
            line = line.rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return data
            event: dict[str, Any] = json.loads(data)
            return event


async def read_events(resp: ClientResponse) -> list[dict[str, Any] | str]:
    """Every event up to and including ``[DONE]``; asserts nothing follows it."""
    events: list[dict[str, Any] | str] = []
    while True:
        event = await next_event(resp)
        events.append(event)
        if event == "[DONE]":
            break
    async with asyncio.timeout(DEADLINE):
        assert (await resp.content.read()).strip() == b""
    return events


def content_of(events: list[dict[str, Any] | str]) -> str:
    text = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                delta = choice.get("delta")
                text.append(delta.get("content") or "" if delta is not None else choice["text"])
    return "".join(text)


def finish_reasons(events: list[dict[str, Any] | str]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict)
            for c in e.get("choices") or [] if c.get("finish_reason")]


SimFactory = Callable[..., Awaitable[Sim]]


@pytest.fixture
def nvml_dir(tmp_path: Path) -> Path:
    return tmp_path / "nvml"


@pytest.fixture
async def live_pid() -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Pids of real, idle processes: the fake NVML counts only the memory of live pids, so
    in-process simulators that must see each other register under these."""
    children: list[asyncio.subprocess.Process] = []

    async def spawn() -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; sys.stdin.read()",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
        children.append(proc)
        return proc.pid

    try:
        yield spawn
    finally:
        for proc in children:
            assert proc.stdin is not None
            proc.stdin.close()
            async with asyncio.timeout(DEADLINE):
                await proc.wait()


@pytest.fixture
async def make_sim(nvml_dir: Path) -> AsyncIterator[SimFactory]:
    """Start simulators with some knobs changed; every one is closed after the test."""
    started: list[Sim] = []

    async def make(**overrides: Any) -> Sim:
        values: dict[str, Any] = {
            "model": MODEL, "fake_nvml_dir": nvml_dir, "nvml_pid": PID,
            "awake_memory_bytes": 10 * GIB, "resident_memory_bytes": 1 * GIB,
            "weights_bytes": 6 * GIB, "shutdown_grace_seconds": 0.0,
            "dev_mode": True,  # VLLM_SERVER_DEV_MODE=1, as rota requires of its engines
        }
        settings = Settings.model_validate(values | overrides)
        sim_exits: list[int] = []
        exited = asyncio.Event()

        def record_exit(code: int) -> None:
            sim_exits.append(code)
            exited.set()

        app = create_app(settings, exit_process=record_exit)
        client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        sim = Sim(client, app[ENGINE_KEY], settings, sim_exits, exited)
        started.append(sim)
        return sim

    try:
        yield make
    finally:
        for sim in started:
            await sim.client.close()


@pytest.fixture
async def sim(make_sim: SimFactory) -> Sim:
    return await make_sim()
