"""The policy comparison's correctness check on a stream frozen for real: its client
(``e2e.gpu.policy_replay.read_stream``) reads a greedy completion from the engine
simulator while the engine is put to sleep with its requests kept and woken; the stream
is counted frozen and compared with the same request to a never-slept engine. With the
simulator's ``keep_fault`` test knob, the check must catch the damage."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from e2e.gpu.policy_replay import Arrival, ClientSettings, completion_body, read_stream
from e2e.gpu.policy_slo import Bounds, StreamTrace, Verdict, reference_of, verdict, was_frozen
from tests.simulator.conftest import DEADLINE, MODEL, Sim, SimFactory

REQUEST = Arrival(at=0.0, model=0, context=24, generated=12)


async def _read(sim: Sim, session: aiohttp.ClientSession, trace: StreamTrace,
                first: asyncio.Event | None = None) -> None:
    loop = asyncio.get_running_loop()
    url = str(sim.client.make_url("/v1/completions"))
    async with asyncio.timeout(DEADLINE):
        await read_stream(session, url, completion_body(MODEL, REQUEST, ClientSettings()),
                          first or asyncio.Event(), trace, loop.time)


async def _frozen(sim: Sim, session: aiohttp.ClientSession) -> tuple[StreamTrace, float]:
    """The request's stream, its engine slept with the request kept once it has begun
    (``/sleep?level=1&mode=keep``, as rota's preemptive switch does) and woken."""
    loop = asyncio.get_running_loop()
    trace = StreamTrace(started=loop.time())
    first = asyncio.Event()
    reading = asyncio.create_task(_read(sim, session, trace, first))
    async with asyncio.timeout(DEADLINE):
        await first.wait()
    await sim.faults(stall_generation=True)  # no token more until it is asleep
    slept_at = loop.time()
    await sim.post_empty("/sleep", level=1, mode="keep")
    await sim.faults(stall_generation=False)
    assert not reading.done()  # frozen: the stream waits for the wake
    await sim.post_empty("/wake_up")
    await reading
    return trace, slept_at


@pytest.mark.parametrize(("fault", "expected"), [(None, "identical"),
                                                 ("duplicate-token", "altered"),
                                                 ("lose-token", "lost"),
                                                 ("abort", "lost")])
async def test_a_frozen_stream_is_checked_against_a_never_slept_reference(
        make_sim: SimFactory, fault: str | None, expected: Verdict) -> None:
    never_slept = await make_sim(tokens_per_second=200.0)
    kept = await make_sim(tokens_per_second=50.0, keep_fault=fault)
    async with aiohttp.ClientSession() as session:
        reference_trace = StreamTrace(started=0.0)
        await _read(never_slept, session, reference_trace)
        trace, slept_at = await _frozen(kept, session)
    reference = reference_of(reference_trace)
    assert reference is not None
    assert reference.tokens == REQUEST.generated
    assert was_frozen(trace, [slept_at], Bounds())
    assert verdict(trace, reference) == expected
