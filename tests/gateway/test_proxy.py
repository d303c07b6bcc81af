"""Passthrough: streams chunk by chunk, engine errors as they are, disconnects propagate."""

from __future__ import annotations

import asyncio
import json

import pytest

from controller.gateway import keys
from controller.gateway.proxy import TokenSpotter
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    RigFactory,
    Sim,
    content_of,
    eventually,
    read_events,
)

pytestmark = pytest.mark.gateway


async def _next_event(resp: object) -> str:
    content = resp.content  # type: ignore[attr-defined]
    async with asyncio.timeout(DEADLINE):
        while True:
            line = (await content.readline()).decode()
            assert line, "the stream ended"
            if line.strip():
                return str(line.strip())


async def test_stream_chunks_pass_before_the_engine_finishes(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.a.faults(stall_generation=True)
    resp = await rig.chat(MODEL_A, stream=True)
    assert resp.status == 200
    first = await _next_event(resp)  # the role chunk, sent before any token
    assert first.startswith("data: {")
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert rig.a.engine.running == 1, "the engine should still be generating"
    await rig.a.faults(stall_generation=False)
    events, _ = await read_events(resp)
    assert events[-1] == "[DONE]"
    assert content_of(events) == "7"


async def test_error_inside_a_200_stream_passes_through(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.a.faults(fail_mid_stream=True)
    resp = await rig.chat(MODEL_A, stream=True, max_tokens=4, ignore_eos=True)
    assert resp.status == 200
    events, _ = await read_events(resp)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1
    assert events[-1] == "[DONE]"


async def test_engine_errors_pass_through_with_their_body(make_rig: RigFactory) -> None:
    rig = await make_rig()
    resp = await rig.gateway.post("/v1/chat/completions",
                                  json={"model": MODEL_A, "messages": []})
    assert resp.status == 400
    body = await resp.json()
    assert "messages" in json.dumps(body)  # the engine's own validation message
    assert resp.headers["X-Request-Id"]


async def test_completions_pass_through(make_rig: RigFactory) -> None:
    rig = await make_rig()
    resp = await rig.gateway.post("/v1/completions",
                                  json={"model": MODEL_A, "prompt": "3 + 4 ="})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "7"
    resp = await rig.gateway.post("/v1/completions", json={
        "model": MODEL_A, "prompt": "3 + 4 =", "stream": True})
    events, _ = await read_events(resp)
    assert content_of(events) == "7"
    assert events[-1] == "[DONE]"


async def test_client_disconnect_cancels_the_engine_request(make_rig: RigFactory) -> None:
    rig = await make_rig()
    await rig.a.faults(stall_generation=True)
    resp = await rig.chat(MODEL_A, stream=True)
    assert resp.status == 200
    await _next_event(resp)
    assert rig.a.engine.running == 1
    resp.close()  # the client goes away mid-stream
    await rig.a.idle()  # the engine saw its client (the gateway) leave and stopped
    gate = rig.app[keys.PLACES].gate(MODEL_A)
    await eventually(lambda: gate.running == 0 and gate.in_flight == 0, "the place freed")
    await rig.a.faults(stall_generation=False)
    assert await rig.answer(MODEL_A) == "7"


def _cut_engine_connections(sim: Sim) -> int:
    """Drop every connection the engine holds, as an engine whose process dies does."""
    server = sim.client.server.runner.server  # type: ignore[union-attr]
    assert server is not None
    cut = 0
    for handler in list(server.connections):
        if handler.transport is not None:
            handler.transport.abort()
            cut += 1
    return cut


async def test_an_engine_that_breaks_off_a_stream_ends_it_with_an_error_event(
        make_rig: RigFactory) -> None:
    """The engine dies mid-stream: the client's stream ends with an error event it can
    read and ``[DONE]``, not with a cut connection (which the OpenAI clients report as a
    network failure, not as the engine's)."""
    rig = await make_rig()
    await rig.a.faults(stall_generation=True)
    resp = await rig.chat(MODEL_A, stream=True)
    assert resp.status == 200
    await _next_event(resp)
    assert _cut_engine_connections(rig.a) >= 1
    events, _ = await read_events(resp)
    assert events[-1] == "[DONE]"
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert [e["code"] for e in errors] == ["engine_broke_off"], events
    assert errors[0]["type"] == "service_unavailable"


def test_token_spotter_finds_the_first_text_event() -> None:
    spotter = TokenSpotter()
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"delta":{"content":"7"}}]}\n\n'
    assert not spotter.feed(role)
    assert not spotter.feed(token[:10])
    assert spotter.feed(token[10:])
    assert not spotter.feed(token)  # only once
    text = TokenSpotter()
    assert text.feed(b'data: {"choices":[{"text":"7","index":0}]}\r\n\r\n')
    error = TokenSpotter()
    assert not error.feed(b'data: {"error":{"message":"boom"}}\n\ndata: [DONE]\n\n')
