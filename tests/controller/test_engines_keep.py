"""The vLLM adapter's sleep that keeps requests (``sleep(1, keep=True)``), against the
engine simulator over real HTTP, per supported release: ``/pause?mode=keep`` then
``/sleep?level=1&mode=keep`` (the sequence shown on the real engine; a plain ``/sleep``
after the pause would abort what it kept), the kept stream frozen while asleep and
finished after the wake as a never-slept one; where a release cannot keep, it says so."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from controller.lease.engines import HttpAdapter, Timeouts, VllmAdapter
from controller.lease.engines.dialect import Dialect
from controller.lease.engines.errors import EngineLied
from controller.lease.engines.surfaces import supported, surface_for
from controller.lease.engines.vllm import KEEP_CALLS, keep_calls, serves_keep
from tests.controller.conftest import ENGINE_SIM_DEADLINE_S, EngineSim, EngineSimFactory

VLLM = supported("vllm")
PROMPT = "Tell me about the simulated engine"
SLOW = 40.0
"""Tokens per second: a stream of 12 is still running when the test puts it to sleep
(the test waits for its first token; the pace only keeps the rest in flight)."""


def _dialect(version: str, *, handles: bool = True,
             served: frozenset[tuple[str, str]] | None = None) -> Dialect:
    surface = surface_for(version)
    assert surface is not None
    return Dialect(version=version, surface=surface, served=served,
                   sleep_handles_requests=handles)


@pytest.mark.parametrize("version", VLLM)
def test_every_supported_release_serves_the_kept_sleep(version: str) -> None:
    dialect = _dialect(version)
    assert serves_keep(dialect)
    assert keep_calls(dialect) == KEEP_CALLS
    assert serves_keep(replace(dialect, sleep_handles_requests=False))  # RFC #51476


def test_an_engine_whose_table_lacks_a_call_is_not_kept() -> None:
    dialect = _dialect("0.26.0")
    table = frozenset(route.key for route in dialect.surface.routes)
    for missing in KEEP_CALLS:
        assert not serves_keep(replace(dialect, served=table - {missing})), missing
        assert keep_calls(replace(dialect, served=table - {missing})) == frozenset()
    assert serves_keep(replace(dialect, served=table))


async def _stream(sim: EngineSim, session: aiohttp.ClientSession, *, max_tokens: int
                  ) -> aiohttp.ClientResponse:
    body = {"model": sim.settings.model, "prompt": PROMPT, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    return await session.post(f"{sim.base_url}/v1/completions", json=body)


async def _text(resp: aiohttp.ClientResponse) -> tuple[str, list[str]]:
    """The stream's text and finish reasons, read to ``[DONE]``."""
    text: list[str] = []
    finishes: list[str] = []
    async with asyncio.timeout(ENGINE_SIM_DEADLINE_S):
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event: dict[str, Any] = json.loads(data)
            for choice in event.get("choices") or []:
                text.append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
    return "".join(text), finishes


async def _first_chunk(resp: aiohttp.ClientResponse) -> str:
    """Read up to the stream's first token; its text."""
    async with asyncio.timeout(ENGINE_SIM_DEADLINE_S):
        while True:
            line = (await resp.content.readline()).decode()
            assert line, "the stream ended before its first token"
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                return "".join(c.get("text") or "" for c in event["choices"])


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.34.0"])
async def test_a_kept_stream_freezes_and_finishes_as_a_never_slept_one(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession,
        version: str) -> None:
    sim = await engine_sim_factory(vllm_version=version, tokens_per_second=SLOW)
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    reference = await _stream(sim, engine_session, max_tokens=12)
    expected = await _text(reference)
    assert expected[1] == ["length"]
    assert await adapter.can_keep(1)
    assert not await adapter.can_keep(2)
    kept = await _stream(sim, engine_session, max_tokens=12)
    first = await _first_chunk(kept)
    await adapter.sleep(1, keep=True)
    record = sim.engine.sleeps[-1]
    assert (record["level"], record["mode"]) == (1, "keep")
    assert sim.engine.running == 1  # frozen with the engine, not aborted
    assert sim.engine.generations_aborted == 0
    await adapter.wake(1)
    text, finishes = await _text(kept)
    assert finishes == ["length"]
    assert first + text == expected[0]
    assert not await adapter.is_sleeping()


async def test_an_engine_whose_sleep_is_a_memory_step_is_resumed_by_its_wake(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """RFC #51476: ``/sleep`` takes no mode; the pause keeps, the wake ends with
    ``/resume`` (the engine would otherwise hold its kept requests for ever)."""
    sim = await engine_sim_factory(vllm_version="0.34.0", sleep_ignores_requests=True,
                                   tokens_per_second=SLOW)
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    assert await adapter.can_keep(1)
    kept = await _stream(sim, engine_session, max_tokens=12)
    await _first_chunk(kept)
    await adapter.sleep(1, keep=True)
    assert sim.engine.paused
    woke = await adapter.wake(1)
    assert [s.name for s in woke.steps] == ["wake_up", "resume"]
    assert not sim.engine.paused
    _, finishes = await _text(kept)
    assert finishes == ["length"]


async def test_keep_is_refused_where_not_shown_safe(
        engine_sim: EngineSim, engine_session: aiohttp.ClientSession) -> None:
    adapter = VllmAdapter(engine_sim.endpoint(), engine_session, Timeouts())
    with pytest.raises(ValueError, match="level-1"):
        await adapter.sleep(2, keep=True)
    assert not engine_sim.engine.sleeps
    assert not engine_sim.engine.paused


async def test_a_wake_that_leaves_the_engine_paused_resumes_it(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """Whatever a release's ``/wake_up`` does (here: nothing, ``wake_ignored``), a woken
    engine that says it is paused, its memory awake, is resumed: kept requests never stay
    frozen for want of a ``/resume``."""
    sim = await engine_sim_factory(tokens_per_second=SLOW)
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    kept = await _stream(sim, engine_session, max_tokens=12)
    await _first_chunk(kept)
    async with engine_session.post(f"{sim.base_url}/pause", params={"mode": "keep"}) as resp:
        assert resp.status == 200
    await sim.faults(wake_ignored=True)
    woke = await adapter.wake(1)
    assert [s.name for s in woke.steps] == ["wake_up", "resume"]
    assert not sim.engine.paused
    _, finishes = await _text(kept)
    assert finishes == ["length"]


async def test_a_wake_never_resumes_an_engine_whose_memory_still_sleeps(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The wake answered and did nothing (``wake_ignored``): the engine is paused because
    it sleeps. Resuming it would run requests on unmapped memory; the wake leaves it
    paused and its confirmation says it still sleeps."""
    sim = await engine_sim_factory()
    adapter = VllmAdapter(sim.endpoint(), engine_session, Timeouts())
    await adapter.sleep(1, keep=True)
    await sim.faults(wake_ignored=True)
    with pytest.raises(EngineLied):
        await adapter.wake(1)
    assert sim.engine.paused
    assert sim.engine.dead is None


async def test_the_generic_adapter_keeps_with_vllms_parameter(
        engine_sim: EngineSim, engine_session: aiohttp.ClientSession) -> None:
    """``adapter: http`` with ``keepRequests: true``: ``mode=keep`` on its sleep path."""
    adapter = HttpAdapter(engine_sim.endpoint(), engine_session, Timeouts())
    assert await adapter.can_keep(1)
    assert not await adapter.can_keep(2)
    await adapter.sleep(1, keep=True)
    assert (engine_sim.engine.sleeps[-1]["level"], engine_sim.engine.sleeps[-1]["mode"]) == (
        1, "keep")
