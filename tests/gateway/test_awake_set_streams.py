"""A stream from an engine awake beside the holder (an awake set): switches beside it raise
the GPU Lease's fence without touching it, and the gateway neither freezes nor refuses its
answer; the Lease that settles without it freezes the answer, as a holder's is frozen."""

from __future__ import annotations

import pytest
from aiohttp import ClientResponse

from rota.api import naming
from tests.gateway.conftest import MODEL_A, MODEL_B, Rig, RigFactory, eventually
from tests.gateway.test_frozen_streams import blocks, read_rest, read_until, sample

pytestmark = pytest.mark.gateway

FROZEN = "rota_gateway_frozen_streams"
FREEZES = "rota_gateway_stream_freeze_duration_seconds_count"


def _publish(rig: Rig, **changes: object) -> None:
    """The next Lease of the GPU (A the holder unless ``changes`` say otherwise)."""
    rig.controller.fence += 1
    rig.apply("lease", "MODIFIED", rig.controller.lease_now(**changes))


async def _heartbeats(rig: Rig, more: int) -> None:
    """Wait (bounded) for ``more`` heartbeats of B's stream: its pacing has looked at the
    Lease since it last changed."""
    name = "rota_gateway_stream_heartbeats_total"
    goal = sample(rig, name, MODEL_B) + more
    await eventually(lambda: sample(rig, name, MODEL_B) >= goal, f"{more} heartbeats")


async def _stream_of_b(rig: Rig) -> ClientResponse:
    resp = await rig.gateway.post("/v1/chat/completions", json={
        "model": MODEL_B, "stream": True, "messages": [{"role": "user", "content": "3 + 4?"}]})
    assert resp.status == 200, await resp.text()
    return resp


async def test_a_companions_stream_survives_switches_beside_it(make_rig: RigFactory) -> None:
    rig = await make_rig(stream_heartbeat_s=0.01)
    async with rig.b.client.post("/wake_up") as resp:
        assert resp.status == 200
    beside = [(rig.b.claim, MODEL_B)]
    _publish(rig, awake_with=beside)
    await rig.b.faults(stall_generation=True)
    stream = await _stream_of_b(rig)
    raw = bytearray()
    await read_until(stream, raw, b"\n\n")  # started: the role chunk
    assert rig.controller.calls == 0, "B was awake: no activation"
    # A switch beside B (A drained for another model) and its end: B stays awake.
    _publish(rig, state=naming.STATE_SWITCHING, target=MODEL_A, draining=MODEL_A,
             awake_with=beside)
    await _heartbeats(rig, 2)
    _publish(rig, awake_with=beside)
    await _heartbeats(rig, 2)
    assert sample(rig, FROZEN, MODEL_B) == 0, "a switch beside B does not freeze its answer"
    # Then a switch that puts B to sleep with its request kept: the answer is frozen ...
    _publish(rig)
    await eventually(lambda: sample(rig, FROZEN, MODEL_B) == 1, "B's stream frozen")
    # ... and goes on once B is awake beside A again (and sends its next bytes).
    _publish(rig, awake_with=beside)
    await rig.b.faults(stall_generation=False)
    await read_rest(stream, raw)
    assert blocks(bytes(raw))[-1] == "data: [DONE]"
    assert sample(rig, FROZEN, MODEL_B) == 0
    assert sample(rig, FREEZES, MODEL_B) == 1, "frozen once: by the sleep, not the switches"
    assert rig.controller.calls == 0
