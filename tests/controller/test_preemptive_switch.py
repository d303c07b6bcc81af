"""The preemptive switch (``Switcher.switch(..., preempt=True)``) on in-memory ports and
engine simulators over real HTTP: the holder is put to sleep with its requests kept (no
drain), the target woken and proven as in every switch; the kept streams finish after the
holder's next wake exactly as never-slept ones do; a holder that cannot keep (level 2,
a gang, vLLM-Omni, a claim that says no) is drained; a keep sleep that fails is not
counted as a freeze."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
import pytest

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.engines.base import Timeouts
from controller.lease.metrics import SwitchMetrics
from controller.lease.switch import Frozen
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config
from tests.controller.conftest import ENGINE_SIM_DEADLINE_S, EngineSim, EngineSimFactory
from tests.controller.switch_kit import Kit, make_kit

pytestmark = [pytest.mark.controller]

PROMPT = "Tell me about the simulated engine"
TOKENS = 12
SLOW = 40.0
"""Tokens per second of the holder: its streams are still running when the switch begins
(the test waits for their first tokens; the pace only keeps the rest in flight)."""


class FreezeRecorder(SwitchMetrics):
    """The switch's metrics, with its freezes and thaws remembered."""

    def __init__(self) -> None:
        self.frozen: list[Frozen] = []
        self.thawed_after: list[tuple[Frozen, float]] = []

    def froze(self, frozen: Frozen) -> None:
        super().froze(frozen)
        self.frozen.append(frozen)

    def thawed(self, frozen: Frozen, seconds: float) -> None:
        super().thawed(frozen, seconds)
        self.thawed_after.append((frozen, seconds))


async def _kit(engine_sim_factory: EngineSimFactory, session: aiohttp.ClientSession,
               engine_timeouts: Timeouts | None = None, **holder: Any
               ) -> tuple[Kit, EngineSim, EngineSim, FreezeRecorder]:
    """Simulators ``m/a`` (awake, the holder, slow) and ``m/b`` (asleep)."""
    a = await engine_sim_factory(model="m/a", tokens_per_second=SLOW, **holder)
    b = await engine_sim_factory(model="m/b")
    kit = make_kit(session, [("a", a), ("b", b)], engine_timeouts=engine_timeouts)
    await kit.switcher.ports.engine(kit.claimants[1]).sleep(1)
    recorder = FreezeRecorder()
    kit.switcher.ports.observer = recorder
    return kit, a, b, recorder


async def _stream(sim: EngineSim, session: aiohttp.ClientSession, prompt: str
                  ) -> aiohttp.ClientResponse:
    body = {"model": sim.settings.model, "prompt": prompt, "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True}
    return await session.post(f"{sim.base_url}/v1/completions", json=body)


async def _read(resp: aiohttp.ClientResponse, *, until_first: bool = False
                ) -> tuple[str, list[str]]:
    """The stream's text and finish reasons: to ``[DONE]``, or to its first token."""
    text: list[str] = []
    finishes: list[str] = []
    async with asyncio.timeout(ENGINE_SIM_DEADLINE_S):
        while True:
            line = (await resp.content.readline()).decode()
            assert line, "the stream ended without [DONE]"
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ").strip()
            if data == "[DONE]":
                return "".join(text), finishes
            for choice in json.loads(data).get("choices") or []:
                text.append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
            if until_first and text:
                return "".join(text), finishes


def _prompts(n: int) -> list[str]:
    return [f"{PROMPT} number {i}" for i in range(n)]


async def test_a_preempted_holders_streams_finish_as_never_slept_ones_after_its_wake(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, a, b, recorder = await _kit(engine_sim_factory, engine_session)
    ca, cb = kit.claimants
    prompts = _prompts(3)
    references = [await _read(await _stream(a, engine_session, p)) for p in prompts]
    streams = [await _stream(a, engine_session, p) for p in prompts]
    firsts = [(await _read(s, until_first=True))[0] for s in streams]
    await a.until(lambda: a.engine.running == len(prompts))

    result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                       claimants=kit.claimants, preempt=True)
    assert result.ok, (result.reason, result.message)
    assert result.holder == cb.ref
    assert result.kept == len(prompts)  # what the holder's gauges said before its sleep
    assert "drain" not in result.timings
    assert {"kept", "sleep", "sleep_confirm", "inspect", "wake", "probe"} <= set(
        result.timings)
    assert (a.engine.state.is_sleeping, b.engine.state.is_sleeping) == (True, False)
    assert a.engine.sleeps[-1]["mode"] == "keep"
    assert a.engine.generations_aborted == 0
    assert a.engine.running == len(prompts)  # frozen with their engine
    assert [f.kept for f in recorder.frozen] == [len(prompts)]
    frozen = kit.switcher.ports.freezes.get(ca.claim_uid)
    assert frozen is not None
    assert (frozen.claim, frozen.model, frozen.kept) == (ca.ref, ca.model, len(prompts))

    back = await kit.switcher.switch(kit.lease.current, holder=cb, target=ca,
                                     claimants=kit.claimants, preempt=True)
    assert back.ok, (back.reason, back.message)
    assert back.kept == 0
    assert (result.resumed, back.resumed) == (0, len(prompts)), \
        "the wake of a brought its kept requests back: its probe waited for their recompute"
    for first, stream, reference in zip(firsts, streams, references, strict=True):
        text, finishes = await _read(stream)
        assert (first + text, finishes) == reference
    assert [f.claim for f, _ in recorder.thawed_after] == [ca.ref]
    assert kit.switcher.ports.freezes.get(ca.claim_uid) is None


def _as(claimant: Claimant, **fields: Any) -> Claimant:
    config = parse_engine_config({
        "apiVersion": API_VERSION, "kind": KIND, "model": claimant.model,
        "awakeMemory": claimant.config.awake_memory, "enginePort": claimant.port,
        **fields})
    return dataclasses.replace(claimant, config=config,
                               sleep_level=config.sleep_level)


async def test_a_holder_that_cannot_keep_is_drained(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """Level 2 (its wake reloads the weights: keeping is not shown safe there) and a
    claim that says no are drained as before: the sleep waits for the stream."""
    kit, a, _, recorder = await _kit(engine_sim_factory, engine_session)
    ca, cb = kit.claimants
    for holder in (_as(ca, sleepLevel=2), _as(ca, keepRequests=False)):
        assert not await kit.switcher.keeps(holder)
    level2 = _as(ca, sleepLevel=2)
    kit.claimants[0] = level2
    stream = await _stream(a, engine_session, PROMPT)
    await _read(stream, until_first=True)
    result = await kit.switcher.switch(kit.holding(level2), holder=level2, target=cb,
                                       claimants=kit.claimants, preempt=True)
    assert result.ok, (result.reason, result.message)
    assert result.kept == 0
    assert "drain" in result.timings
    assert (a.engine.sleeps[-1]["level"], a.engine.sleeps[-1]["mode"]) == (2, "wait")
    _, finishes = await _read(stream)  # finished before the sleep
    assert finishes == ["length"]
    assert recorder.frozen == []
    assert kit.switcher.ports.freezes.all() == {}


async def test_gangs_and_vllm_omni_are_never_kept(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    kit, _, _, _ = await _kit(engine_sim_factory, engine_session)
    ca = kit.claimants[0]
    gang = dataclasses.replace(_as(ca, keepRequests=True),
                               resident_on_gpu=(("gpu-0", 2**30), ("gpu-1", 2**30)))
    assert gang.spans_gpus
    assert not await kit.switcher.keeps(gang)
    omni = _as(ca, adapter="vllm-omni", omniStageIds=[0, 1])
    assert not await kit.switcher.keeps(omni)
    assert await kit.switcher.keeps(ca)


async def test_a_keep_sleep_that_fails_is_not_counted_as_asleep(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The engine answers the sleep and keeps its memory (``sleep_lies``): the GPU read
    fails the switch as it does every sleep that lies, the holder is restored (its wake
    resumes the kept stream), and no freeze is recorded."""
    kit, a, b, recorder = await _kit(engine_sim_factory, engine_session)
    ca, cb = kit.claimants
    reference = await _read(await _stream(a, engine_session, PROMPT))
    stream = await _stream(a, engine_session, PROMPT)
    first, _ = await _read(stream, until_first=True)
    await a.faults(sleep_lies=True)
    result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                       claimants=kit.claimants, preempt=True)
    assert not result.ok
    assert result.kept == 0
    assert result.unsettled == ()
    assert result.holder == ca.ref  # restored
    assert recorder.frozen == []
    assert kit.switcher.ports.freezes.all() == {}
    assert b.engine.state.is_sleeping  # never woken beside the holder
    text, finishes = await _read(stream)
    assert (first + text, finishes) == reference


async def test_a_keep_sleep_of_unknown_outcome_leaves_the_holder_unsettled(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    """The holder's sleep does not answer within its budget (it may still take effect):
    nobody is woken, the holder is unsettled, as for every such sleep; no freeze."""
    kit, a, b, recorder = await _kit(engine_sim_factory, engine_session,
                                     engine_timeouts=Timeouts(sleep_s=0.2),
                                     first_sleep_seconds=3.0)
    ca, cb = kit.claimants
    stream = await _stream(a, engine_session, PROMPT)
    await _read(stream, until_first=True)
    result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                       claimants=kit.claimants, preempt=True)
    assert not result.ok
    assert result.reason == "state_unknown"
    assert [c.ref for c in result.unsettled] == [ca.ref]
    assert result.kept == 0
    assert b.engine.state.is_sleeping  # never woken beside a holder that may be awake
    assert recorder.frozen == []
    assert a.engine.generations_aborted == 0
    stream.close()


async def test_a_frozen_claim_that_left_the_gpu_is_forgotten_with_its_series(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    a = await engine_sim_factory(model="m/a", tokens_per_second=SLOW)
    b = await engine_sim_factory(model="m/b")
    c = await engine_sim_factory(model="m/c")
    kit = make_kit(engine_session, [("a", a), ("b", b), ("c", c)])
    ca, cb, cc = kit.claimants
    for asleep in (cb, cc):
        await kit.switcher.ports.engine(asleep).sleep(1)
    stream = await _stream(a, engine_session, PROMPT)
    await _read(stream, until_first=True)
    result = await kit.switcher.switch(kit.holding(ca), holder=ca, target=cb,
                                       claimants=kit.claimants, preempt=True)
    assert result.ok, (result.reason, result.message)
    assert _kept_series(ca) == 1.0
    del kit.device.sims[ca.claim_uid]  # A's claim and pod left the GPU
    stream.close()
    result = await kit.switcher.switch(kit.lease.current, holder=cb, target=cc,
                                       claimants=[cb, cc])
    assert result.ok, (result.reason, result.message)
    assert kit.switcher.ports.freezes.all() == {}
    assert _kept_series(ca) is None


def _kept_series(claimant: Claimant) -> float | None:
    return metrics.REGISTRY.get_sample_value(
        "rota_controller_kept_requests",
        {"gpu": claimant.gpu, "claim": claimant.ref, "model_name": claimant.model})
