"""Fixtures for the controller's tests.

Engine simulators: ``engine_sim_factory`` starts real simulators (aiohttp apps from
``e2e.engine_simulator``) on 127.0.0.1, port 0; ``engine_sim`` is one with default knobs;
``engine_session`` is the single ``aiohttp.ClientSession`` adapters share, as in the
controller. Adapters reach the simulators over real HTTP; tests set faults and wait on the
simulator's state in process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from controller.lease.engines.base import EngineEndpoint
from controller.lease.engines.dialect import forget_all
from e2e.engine_simulator import Settings, create_app
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.loopback import SimulatorServer
from e2e.engine_simulator.settings import Faults, FaultsPatch
from rota.kit.engine_connections import engine_connector

ENGINE_SIM_MODEL = "sim/adapter-model"
ENGINE_SIM_CLAIM = "default/claim-a"
ENGINE_SIM_DEADLINE_S = 10.0
"""Upper bound of every wait on a simulator's state (a bound, not a pace)."""
ENGINE_SIM_GIB = 2**30


@dataclass
class EngineSim:
    """One running simulator and handles on it."""

    server: TestServer
    engine: Engine
    settings: Settings
    exits: list[int]

    @property
    def base_url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def endpoint(self, *, token: str | None = None, api_key: str | None = None
                 ) -> EngineEndpoint:
        return EngineEndpoint(base_url=self.base_url, model=self.settings.model,
                              claim=ENGINE_SIM_CLAIM, pod="default/engine-a", token=token,
                              api_key=api_key)

    async def faults(self, **changes: bool) -> Faults:
        return await self.engine.set_faults(FaultsPatch.model_validate(changes))

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait (bounded) until the simulator's state satisfies ``predicate``."""
        async with asyncio.timeout(ENGINE_SIM_DEADLINE_S):
            await self.engine.wait_for(predicate)

    async def stop(self) -> None:
        """Stop listening, as if the engine process died."""
        await self.server.close()


EngineSimFactory = Callable[..., Awaitable[EngineSim]]


@pytest.fixture
async def engine_session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=engine_connector()) as session:
        yield session


@pytest.fixture
async def engine_sim_factory() -> AsyncIterator[EngineSimFactory]:
    """Start simulators with some knobs changed; every one is stopped after the test."""
    started: list[EngineSim] = []

    async def start(**overrides: Any) -> EngineSim:
        values: dict[str, Any] = {
            "model": ENGINE_SIM_MODEL, "awake_memory_bytes": 10 * ENGINE_SIM_GIB,
            "resident_memory_bytes": 1 * ENGINE_SIM_GIB, "weights_bytes": 6 * ENGINE_SIM_GIB,
            "shutdown_grace_seconds": 0.0,
            "dev_mode": True,  # VLLM_SERVER_DEV_MODE=1, as rota requires of its engines
        }
        settings = Settings.model_validate(values | overrides)
        exits: list[int] = []
        app = create_app(settings, exit_process=exits.append)
        server = SimulatorServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        sim = EngineSim(server, app[ENGINE_KEY], settings, exits)
        started.append(sim)
        return sim

    try:
        yield start
    finally:
        for sim in started:
            await sim.server.close()


@pytest.fixture
async def engine_sim(engine_sim_factory: EngineSimFactory) -> EngineSim:
    return await engine_sim_factory()



@pytest.fixture(autouse=True)
def _engine_releases_forgotten() -> None:
    """Adapters remember each engine's release by address; tests reuse ports."""
    forget_all()
