"""Frozen answers: an engine asleep with its requests kept leaves a started stream silent
while another model holds the GPU; the gateway keeps that stream open and well-formed.

The rig is the gateway's usual one (``conftest.py``). Where a test needs an engine that
stops in the middle of an event, or dies at a chosen moment, the claim of model A is
pointed at a :class:`ScriptedEngineSimulator`: an engine over real HTTP whose event stream
the test writes piece by piece (no timed stalls: it is silent until the test writes).
A freeze is what the lease controller publishes when it puts an engine to sleep with its
requests kept: the GPU Lease, at a newer fence, names the other model's claim as holder.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from controller.gateway import keys
from controller.gateway.proxy import HEARTBEAT
from rota.api import naming
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    MODEL_B,
    NAMESPACE,
    Rig,
    RigFactory,
    claim_obj,
    content_of,
    eventually,
    gpu_lease,
    pod_obj,
    read_events,
)

pytestmark = pytest.mark.gateway

PROGRESS = {"X-Rota-Progress": "1"}
ROLE = b'data: {"id":"c1","object":"chat.completion.chunk","model":"sim/model-a",' \
       b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
WORD = b'data: {"id":"c1","object":"chat.completion.chunk","model":"sim/model-a",' \
       b'"choices":[{"index":0,"delta":{"content":"seven"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"
HALF = WORD.index(b"sev") + 3


# -- a scripted engine --------------------------------------------------------------------


@dataclass
class ScriptedEngineSimulator:
    """An engine that answers every chat request with ``200`` event-stream headers, then
    exactly the bytes the test writes (:meth:`write`), each as one chunk; :meth:`end` ends
    the answer, :meth:`die` drops its connection as a dying process does."""

    client: TestClient[Any, Any] | None = None
    streams: asyncio.Queue[web.StreamResponse] = field(default_factory=asyncio.Queue)
    script: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the gateway dropped the engine connection of an answer."""
    headers_only: bool = False
    """Send the headers, then die (an engine that dies before its first byte)."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.headers_only:
            assert request.transport is not None
            request.transport.abort()
            return response
        await self.streams.put(response)
        try:
            while (piece := await self.script.get()) is not None:
                await response.write(piece)
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.closed.set()
            raise
        return response

    async def write(self, piece: bytes) -> None:
        await self.script.put(piece)

    async def end(self) -> None:
        await self.script.put(None)

    def die(self) -> None:
        """Drop every connection, as an engine whose process dies does."""
        assert self.client is not None
        server = self.client.server.runner.server  # type: ignore[union-attr]
        assert server is not None
        for handler in list(server.connections):
            if handler.transport is not None:
                handler.transport.abort()

    @property
    def port(self) -> int:
        assert self.client is not None
        assert self.client.port is not None
        return self.client.port


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedEngineSimulator]:
    engine = ScriptedEngineSimulator()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.chat)
    engine.client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await engine.client.start_server()
    try:
        yield engine
    finally:
        await engine.client.close()


def serve_a_from(rig: Rig, port: int, *, longest_freeze_s: float | None = None) -> None:
    """Claim A's engine now listens on ``port`` (its claim changed, as a watch delivers)."""
    claim = claim_obj("claim-a", model=MODEL_A, port=port, pod_uid="pod-a")
    if longest_freeze_s is not None:
        opaque = claim["spec"]["devices"]["config"][0]["opaque"]
        opaque["parameters"]["longestFreezeSeconds"] = longest_freeze_s
    rig.apply("claim", "MODIFIED", claim)


def freeze_a(rig: Rig) -> None:
    """The lease controller put A to sleep with its requests kept; B holds the GPU."""
    rig.controller.fence += 1
    rig.apply("lease", "MODIFIED", gpu_lease(
        holder=rig.b.claim, state=naming.STATE_AWAKE, model=MODEL_B,
        fence=rig.controller.fence))


def thaw_a(rig: Rig) -> None:
    """A holds the GPU again, its kept requests resumed."""
    rig.controller.fence += 1
    rig.apply("lease", "MODIFIED", rig.controller.lease_now())


def sample(rig: Rig, name: str, model: str = MODEL_A) -> float:
    value = rig.app[keys.METRICS].registry.get_sample_value(name, {"model_name": model})
    return value or 0.0


async def heartbeats_after(rig: Rig, more: int) -> None:
    """Wait (bounded) until the gateway wrote ``more`` heartbeats more than it has now."""
    name = "rota_gateway_stream_heartbeats_total"
    goal = sample(rig, name) + more
    await eventually(lambda: sample(rig, name) >= goal, f"{more} heartbeats")


async def read_until(resp: ClientResponse, raw: bytearray, marker: bytes, count: int = 1
                     ) -> None:
    """Read the stream into ``raw`` until ``marker`` appeared ``count`` times (bounded)."""
    async with asyncio.timeout(DEADLINE):
        while raw.count(marker) < count:
            chunk = await resp.content.readany()
            assert chunk, f"the stream ended before {count} x {marker!r}: {bytes(raw)!r}"
            raw += chunk


async def read_rest(resp: ClientResponse, raw: bytearray) -> None:
    async with asyncio.timeout(DEADLINE):
        while chunk := await resp.content.readany():
            raw += chunk


def blocks(raw: bytes) -> list[str]:
    """The stream's events; each must be whole: a comment, or data that parses."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        for line in block.split("\n"):
            assert line.startswith((":", "data: ")), f"not an SSE line: {line!r} in {raw!r}"
            data = line.removeprefix("data: ")
            if not line.startswith(":") and data != "[DONE]":
                json.loads(data)  # a half event would not parse
        out.append(block)
    return out


def errors_in(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(b.removeprefix("data: "))["error"] for b in blocks(raw)
            if b.startswith("data: {") and '"error"' in b]


async def start_stream(rig: Rig, headers: dict[str, str] | None = None) -> ClientResponse:
    resp = await rig.gateway.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL_A, "stream": True, "messages": [{"role": "user", "content": "3 + 4?"}]})
    assert resp.status == 200, await resp.text()
    return resp


# -- heartbeats -----------------------------------------------------------------------------


async def test_heartbeats_fill_a_stall_and_never_split_an_event(
        make_rig: RigFactory, scripted: ScriptedEngineSimulator) -> None:
    """The engine stops in the middle of an event: the client has whole events only,
    heartbeats arrive between them while the engine is silent, and the event follows
    whole once the engine goes on."""
    rig = await make_rig(stream_heartbeat_s=0.02)
    serve_a_from(rig, scripted.port)
    await scripted.write(ROLE)  # the engine's first event, sent as soon as it is asked
    resp = await start_stream(rig)
    raw = bytearray()
    await read_until(resp, raw, b"\n\n")
    await scripted.write(WORD[:HALF])  # half an event, then silence
    await read_until(resp, raw, HEARTBEAT, 3)
    assert b'"content":"sev' not in raw, "half an event reached the client"
    await scripted.write(WORD[HALF:] + DONE)
    await scripted.end()
    await read_rest(resp, raw)
    events = blocks(bytes(raw))
    assert events[0].startswith("data: ")
    assert events[-1] == "data: [DONE]"
    assert sum(e == HEARTBEAT.decode().strip() for e in events) >= 3
    assert WORD in raw  # whole, as the engine wrote it
    assert sample(rig, "rota_gateway_stream_heartbeats_total") >= 3


async def test_the_openai_sdk_reads_a_heartbeat_laced_stream_unchanged(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_heartbeat_s=0.01)
    sdk = AsyncOpenAI(base_url=str(rig.gateway.make_url("/v1")), api_key="unused",
                      max_retries=0, timeout=httpx2.Timeout(DEADLINE, connect=5.0))
    messages: Any = [{"role": "user", "content": "Tell me about the sea."}]

    async def text(stalled: bool) -> tuple[str, int]:
        await rig.a.faults(stall_generation=stalled)  # the role chunk still comes
        stream = await sdk.chat.completions.create(
            model=MODEL_A, messages=messages, stream=True, max_tokens=8)
        parts, chunks = [], 0
        async with asyncio.timeout(DEADLINE):
            async for chunk in stream:
                chunks += 1
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if stalled and chunks == 1:
                    await heartbeats_after(rig, 5)
                    await rig.a.faults(stall_generation=False)
        return "".join(parts), chunks

    reference = await text(stalled=False)
    laced = await text(stalled=True)
    assert laced == reference
    assert laced[0]
    await sdk.close()


# -- progress ---------------------------------------------------------------------------------


async def test_a_freeze_is_told_only_to_a_client_that_asked(make_rig: RigFactory) -> None:
    rig = await make_rig(stream_heartbeat_s=0)
    await rig.a.faults(stall_generation=True)
    asked = await start_stream(rig, PROGRESS)
    plain = await start_stream(rig)
    raws = [bytearray(), bytearray()]
    for resp, raw in zip((asked, plain), raws, strict=True):
        await read_until(resp, raw, b"\n\n")  # started: the role chunk
    freeze_a(rig)
    await eventually(lambda: sample(rig, "rota_gateway_frozen_streams") == 2,
                     "both streams frozen")
    await read_until(asked, raws[0], b": rota paused")
    thaw_a(rig)
    await rig.a.faults(stall_generation=False)
    for resp, raw in zip((asked, plain), raws, strict=True):
        await read_rest(resp, raw)
    note = next(b for b in blocks(bytes(raws[0])) if b.startswith(": rota paused"))
    assert note == f": rota paused model={MODEL_A} for={MODEL_B} expected_s=3"
    assert b"rota paused" not in raws[1]
    for raw in raws:
        assert blocks(bytes(raw))[-1] == "data: [DONE]"
    assert sample(rig, "rota_gateway_frozen_streams") == 0
    assert sample(rig, "rota_gateway_stream_freeze_duration_seconds_count") == 2


# -- silence bounds ---------------------------------------------------------------------------


async def test_a_silence_within_the_freeze_bound_is_not_a_timeout(
        make_rig: RigFactory, scripted: ScriptedEngineSimulator) -> None:
    """Silent for several read timeouts, but within the claim's longest freeze: the
    stream goes on (the heartbeats count the silence)."""
    rig = await make_rig(stream_heartbeat_s=0.05, upstream_read_timeout_s=0.1)
    serve_a_from(rig, scripted.port, longest_freeze_s=30.0)
    await scripted.write(ROLE)  # the engine's first event, sent as soon as it is asked
    resp = await start_stream(rig)
    raw = bytearray()
    await read_until(resp, raw, b"\n\n")
    freeze_a(rig)
    await read_until(resp, raw, HEARTBEAT, 10)  # 0.5 s: five read timeouts
    thaw_a(rig)
    await scripted.write(WORD + DONE)
    await scripted.end()
    await read_rest(resp, raw)
    assert errors_in(bytes(raw)) == []
    assert blocks(bytes(raw))[-1] == "data: [DONE]"
    assert WORD in raw


async def test_a_silence_far_past_the_freeze_bound_ends_with_an_error_event(
        make_rig: RigFactory, scripted: ScriptedEngineSimulator) -> None:
    rig = await make_rig(stream_heartbeat_s=0, upstream_read_timeout_s=0.1)
    serve_a_from(rig, scripted.port, longest_freeze_s=0.2)
    await scripted.write(ROLE)  # the engine's first event, sent as soon as it is asked
    resp = await start_stream(rig)
    raw = bytearray()
    await read_until(resp, raw, b"\n\n")
    freeze_a(rig)  # and never woken: the engine stays silent
    await read_rest(resp, raw)
    [error] = errors_in(bytes(raw))
    assert error["code"] == "upstream_timeout"
    assert "0.3 seconds" in error["message"]
    assert int(error["retry_after"]) >= 1
    assert blocks(bytes(raw))[-1] == "data: [DONE]"


# -- engines that die or are stopped -------------------------------------------------------------


async def test_an_engine_that_dies_mid_freeze_ends_the_stream_with_whole_events(
        make_rig: RigFactory, scripted: ScriptedEngineSimulator) -> None:
    rig = await make_rig(stream_heartbeat_s=0)
    serve_a_from(rig, scripted.port)
    await scripted.write(ROLE + WORD[:HALF])  # an event and a half, then silence
    resp = await start_stream(rig, PROGRESS)
    raw = bytearray()
    await read_until(resp, raw, b"\n\n")
    freeze_a(rig)
    await read_until(resp, raw, b": rota paused")
    assert sample(rig, "rota_gateway_frozen_streams") == 1
    scripted.die()
    await read_rest(resp, raw)
    events = blocks(bytes(raw))  # whole events only: the half one was never passed on
    assert [e["code"] for e in errors_in(bytes(raw))] == ["engine_broke_off"]
    assert events[-1] == "data: [DONE]"
    assert sample(rig, "rota_gateway_frozen_streams") == 0


async def test_an_engine_stopped_while_frozen_ends_the_stream_at_once(
        make_rig: RigFactory, scripted: ScriptedEngineSimulator) -> None:
    """Its pod is deleted while the engine sleeps with the stream kept: nothing will wake
    it, so the stream ends now with an error the client can act on, not at the timeout."""
    rig = await make_rig(stream_heartbeat_s=0)
    serve_a_from(rig, scripted.port)
    await scripted.write(ROLE)  # the engine's first event, sent as soon as it is asked
    resp = await start_stream(rig)
    raw = bytearray()
    await read_until(resp, raw, b"\n\n")
    freeze_a(rig)
    await eventually(lambda: sample(rig, "rota_gateway_frozen_streams") == 1, "frozen")
    rig.apply("pod", "DELETED", pod_obj("pod-claim-a", uid="pod-a", namespace=NAMESPACE))
    await read_rest(resp, raw)
    [error] = errors_in(bytes(raw))
    assert error["code"] == "engine_broke_off"
    assert "frozen for another model" in error["message"]
    assert int(error["retry_after"]) >= 1
    assert blocks(bytes(raw))[-1] == "data: [DONE]"
    async with asyncio.timeout(DEADLINE):
        await scripted.closed.wait()  # the engine request was dropped with it


async def test_an_engine_that_dies_before_its_first_byte_is_a_503_with_retry_after(
        make_rig: RigFactory, scripted: ScriptedEngineSimulator) -> None:
    rig = await make_rig(upstream_attempts=2, lost_gpu_grace_s=0)
    serve_a_from(rig, scripted.port)
    scripted.headers_only = True
    resp = await rig.gateway.post("/v1/chat/completions", json={
        "model": MODEL_A, "messages": [{"role": "user", "content": "3 + 4?"}]})
    assert resp.status == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert (await resp.json())["error"]["code"] == "upstream_unreachable"


async def test_a_stream_through_a_real_engine_is_unchanged_by_the_pacing(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_heartbeat_s=0.01)
    resp = await rig.chat(MODEL_A, stream=True, max_tokens=4, ignore_eos=True)
    events, _ = await read_events(resp)
    assert events[-1] == "[DONE]"
    assert content_of(events)
