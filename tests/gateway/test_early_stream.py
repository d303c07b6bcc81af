"""The early, kept-alive event stream (``downstream.py``) on the wire: once its ``200`` is
sent, every refusal ends it as an error event and ``[DONE]`` (never a second response head),
however the refusal and the stream's start meet; and only the paths that stream get it.

Each answer is read as raw bytes and parsed strictly (``wire.py``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, NoReturn

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.gateway import keys
from controller.gateway.activation import ActivationFailed
from controller.gateway.routes import MODEL_PATHS, STREAMING_PATHS
from e2e.harness.wire import Answer, Exchange, closing_error, parse_answer, parse_sse
from tests.gateway.conftest import DEADLINE, MODEL_B, Rig, RigFactory, claim_obj
from tests.gateway.surface_cases import (
    JSON_CASES,
    REFUSES_UNKNOWN_FIELDS,
    STREAMED_BODIES,
    rig_for,
)

pytestmark = pytest.mark.gateway

KEEPALIVE_S = 0.05
CHAT = {"model": MODEL_B, "messages": [{"role": "user", "content": "What is 3 + 4?"}],
        "stream": True}


def _port(rig: Rig) -> int:
    port = rig.gateway.port
    assert port is not None
    return port


async def _answer(exchange: Exchange) -> Answer:
    try:
        return parse_answer(await exchange.read_all())
    finally:
        await exchange.close()


def _early_stream(answer: Answer) -> None:
    assert answer.status == 200, answer
    assert answer.headers["content-type"].startswith("text/event-stream"), answer.headers


async def test_an_engine_503_after_the_early_start_ends_the_stream_with_an_error_event(
        make_rig: RigFactory) -> None:
    """R2: B is "woken" but keeps refusing (503) and nothing changes within the grace:
    the refusal is passed on inside the stream already started, not as a second head."""
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, lost_gpu_grace_s=0)
    await rig.b.faults(wake_ignored=True, refuse_while_asleep=True)
    rig.controller.hold_switch = asyncio.Event()
    exchange = await Exchange.post(_port(rig), "/v1/chat/completions", CHAT)
    await exchange.read_until(b": rota: ")  # the answer has begun: 200, event stream
    rig.controller.hold_switch.set()
    answer = await _answer(exchange)
    _early_stream(answer)
    events = parse_sse(answer.body)
    assert events[0].comments
    assert events[0].data is None
    error = closing_error(events)
    assert error["code"] == "upstream_503"
    assert error["retry_after"] == "2"  # the gateway's retry_after_s: the engine gave none
    assert "sleeping" in error["message"]  # the engine's own words
    metrics = await (await rig.gateway.get("/metrics")).text()
    assert (f'rota_gateway_requests_total{{model_name="{MODEL_B}",outcome="upstream_503"}} '
            "1.0") in metrics


async def test_the_engine_s_own_words_and_retry_after_reach_the_started_stream(
        make_rig: RigFactory) -> None:
    """An engine (not vLLM-shaped) that refuses with a plain-text 503 and a Retry-After:
    both are what the stream's error event says."""
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, lost_gpu_grace_s=0)

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=503, text="busy, come back later",
                            headers={"Retry-After": "9"})

    engine = web.Application()
    engine.router.add_post("/v1/chat/completions", refuse)
    server = TestServer(engine, host="127.0.0.1", port=0)
    await server.start_server()
    rig.closers.append(server.close)
    assert server.port is not None
    rig.apply("claim", "MODIFIED", claim_obj("claim-b", model=MODEL_B, port=server.port,
                                             pod_uid="pod-b"))
    rig.controller.hold_switch = asyncio.Event()
    exchange = await Exchange.post(_port(rig), "/v1/chat/completions", CHAT)
    await exchange.read_until(b": rota: ")
    rig.controller.hold_switch.set()
    answer = await _answer(exchange)
    _early_stream(answer)
    error = closing_error(parse_sse(answer.body))
    assert (error["code"], error["retry_after"]) == ("upstream_503", "9")
    assert error["message"].endswith("(HTTP 503): busy, come back later")


async def test_an_engine_503_before_any_start_passes_through_as_it_is(
        make_rig: RigFactory) -> None:
    """Without an early start the engine's 503 still reaches the client unchanged."""
    rig = await make_rig(stream_keepalive_s=0, lost_gpu_grace_s=0)
    await rig.b.faults(wake_ignored=True, refuse_while_asleep=True)
    answer = await _answer(await Exchange.post(_port(rig), "/v1/chat/completions", CHAT))
    assert answer.status == 503, answer
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.headers["retry-after"] == "2"
    assert b"sleeping" in answer.body


async def test_a_refusal_while_the_stream_is_being_started_is_an_error_event(
        make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """R12: the keep-alive is inside its first ``prepare()`` (held there by a prepare
    hook) when the request is refused. Whichever way that meets, the client gets one
    answer: here the stream the keep-alive started, ended by the refusal's event."""
    inside, refused = asyncio.Event(), asyncio.Event()
    held: list[str] = []

    async def hold_the_start(request: web.Request, response: web.StreamResponse) -> None:
        if response.content_type != "text/event-stream" or inside.is_set():
            return
        inside.set()
        try:
            await refused.wait()
        except asyncio.CancelledError:
            held.append("cancelled")  # the start was broken off halfway
            raise
        held.append("finished")

    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, on_prepare=hold_the_start)
    dispatcher = rig.app[keys.DISPATCHER]

    async def activate(*args: Any, **kwargs: Any) -> NoReturn:
        await inside.wait()
        refused.set()  # the start resumes only once the refusal is on its way
        raise ActivationFailed("The switch failed.", code="gpu_oom", retry_after=7)

    monkeypatch.setattr(dispatcher.activator, "activate", activate)
    answer = await _answer(await Exchange.post(_port(rig), "/v1/chat/completions", CHAT))
    _early_stream(answer)
    error = closing_error(parse_sse(answer.body))
    assert (error["code"], error["retry_after"]) == ("gpu_oom", "7")
    assert held == ["finished"]  # the start was never broken off halfway


async def test_an_unexpected_failure_after_the_early_start_is_an_error_event(
        make_rig: RigFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A defect of the gateway itself is a 500 before the start; after it, the stream
    still ends readably rather than with a cut connection."""
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S)
    dispatcher = rig.app[keys.DISPATCHER]
    fail = asyncio.Event()

    async def activate(*args: Any, **kwargs: Any) -> NoReturn:
        await fail.wait()
        raise RuntimeError("a bug")

    monkeypatch.setattr(dispatcher.activator, "activate", activate)
    exchange = await Exchange.post(_port(rig), "/v1/chat/completions", CHAT)
    await exchange.read_until(b": rota: ")
    fail.set()
    answer = await _answer(exchange)
    _early_stream(answer)
    error = closing_error(parse_sse(answer.body))
    assert (error["code"], error["type"]) == ("internal_error", "server_error")


NOT_STREAMING = [(path, body, field) for path, body, field in JSON_CASES
                 if path not in STREAMING_PATHS]


def test_the_paths_that_stream_are_served_paths_and_the_others_are_not() -> None:
    assert set(MODEL_PATHS) >= STREAMING_PATHS
    assert {path for path, _, _ in NOT_STREAMING} == set(MODEL_PATHS) - STREAMING_PATHS


@pytest.mark.parametrize(("path", "body", "field"), NOT_STREAMING)
async def test_stream_true_on_a_path_that_never_streams_gets_no_early_start(
        make_rig: RigFactory, path: str, body: dict[str, Any], field: str) -> None:
    """R11: the request waits for a switch as long as a chat stream that is kept alive
    (whose keep-alive was armed after its own, with the same period), yet its answer is
    the engine's JSON, not a ``200`` event stream with JSON inside."""
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, **rig_for(path))
    rig.controller.hold_switch = asyncio.Event()
    port = _port(rig)
    exchange = await Exchange.post(port, path, body | {"model": MODEL_B, "stream": True})
    async with asyncio.timeout(DEADLINE):
        await rig.controller.switching.wait()  # it waits for B's switch
    chat = await Exchange.post(port, "/v1/chat/completions", CHAT)
    try:
        await chat.read_until(b": rota: ")
    finally:
        await chat.close()
    rig.controller.hold_switch.set()
    answer = await _answer(exchange)
    assert answer.headers["content-type"].startswith("application/json"), answer
    assert b": rota:" not in answer.body
    if path in REFUSES_UNKNOWN_FIELDS:  # the engine's own 400: it knows no 'stream'
        assert answer.status == 400, answer
        return
    assert answer.status == 200, answer
    assert field in json.loads(answer.body)


@pytest.mark.parametrize(("path", "body"), sorted(STREAMED_BODIES.items()))
async def test_the_paths_that_stream_are_kept_alive_while_they_wait(
        make_rig: RigFactory, path: str, body: dict[str, Any]) -> None:
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, **rig_for(path))
    rig.controller.hold_switch = asyncio.Event()
    exchange = await Exchange.post(_port(rig), path,
                                   body | {"model": MODEL_B, "stream": True})
    await exchange.read_until(b": rota: ")
    rig.controller.hold_switch.set()
    answer = await _answer(exchange)
    _early_stream(answer)
    events = parse_sse(answer.body)
    assert events[0].comments
    data = [e.data for e in events if e.data is not None]
    assert data, events
    assert not any(isinstance(d, dict) and "error" in d for d in data), events
