"""The engine adapters against engines that answer badly on purpose or fail midway.

A tenant's engine is not trusted: an answer nested so deep that the JSON parser gives up
must become the adapters' protocol error (not a ``RecursionError`` that stops the
controller serving the whole GPU), and a malformed route table must not crash the release
read. What is learnt of an engine's release is kept per run of its pod and pruned with the
node's claimants. A sleep that fails after its pause resumes the engine. A slow or broken
control-token source is not the engine's fault: it neither eats the call's time nor escapes
as anything but "unreachable, nothing sent"."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import grpc.aio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.lease.engines import dialect as dialects
from controller.lease.engines import transport
from controller.lease.engines.base import EngineEndpoint, Timeouts
from controller.lease.engines.errors import (
    EngineProtocolError,
    EngineRejected,
    EngineUnreachable,
    error_message,
    is_engine_dead,
)
from controller.lease.engines.probe import run_probe
from controller.lease.engines.transport import Answer, EngineHttp
from controller.lease.engines.vllm import VllmAdapter
from e2e.engine_simulator import Settings, create_app
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.loopback import SimulatorServer
from tests.controller.conftest import ENGINE_SIM_DEADLINE_S, ENGINE_SIM_GIB, ENGINE_SIM_MODEL
from tests.controller.test_control_tokens import UID_A, claimant

pytestmark = pytest.mark.controller

DEPTH = 5000
DEEP = "[" * DEPTH + "]" * DEPTH
"""Valid JSON the standard parser cannot read: it raises RecursionError, not ValueError."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeEngine:
    """A tiny engine at a real address: each path answers what the test says; every
    request that arrives is recorded."""

    answers: dict[str, Callable[[], web.StreamResponse]] = field(default_factory=dict)
    arrivals: list[str] = field(default_factory=list)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.arrivals.append(request.path)
        make = self.answers.get(request.path)
        return make() if make is not None else web.json_response({}, status=404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        return app


@pytest.fixture
async def fake_engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    server = TestServer(engine.app(), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield engine, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _deep() -> web.Response:
    return web.Response(text=DEEP, content_type="application/json")


def _version(version: str) -> Callable[[], web.Response]:
    return lambda: web.json_response({"version": version})


# -- 1. answers nested too deep; malformed route tables ---------------------------------------


def test_the_parser_turns_deep_nesting_into_the_protocol_error() -> None:
    with pytest.raises(EngineProtocolError) as caught:
        Answer(200, DEEP).json("is_sleeping")
    assert caught.value.reason == "bad_response"
    assert error_message(DEEP) == DEEP  # an error answer nested too deep is quoted raw
    assert not is_engine_dead(DEEP)


async def test_a_deep_is_sleeping_answer_is_a_protocol_error(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession) -> None:
    engine, url = fake_engine
    engine.answers["/is_sleeping"] = _deep
    adapter = VllmAdapter(EngineEndpoint(base_url=url, model="m", claim="ns/c"),
                          engine_session, Timeouts())
    with pytest.raises(EngineProtocolError):
        await adapter.is_sleeping()


async def test_a_deep_route_table_is_a_protocol_error(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession) -> None:
    engine, url = fake_engine
    engine.answers |= {"/version": _version("0.34.0"), "/openapi.json": _deep}
    adapter = VllmAdapter(EngineEndpoint(base_url=url, model="m", claim="ns/c"),
                          engine_session, Timeouts())
    with pytest.raises(EngineProtocolError):
        await adapter.preflight()


async def test_a_deep_error_answer_is_a_refusal(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession) -> None:
    engine, url = fake_engine
    engine.answers["/is_sleeping"] = lambda: web.Response(
        text=DEEP, status=500, content_type="application/json")
    adapter = VllmAdapter(EngineEndpoint(base_url=url, model="m", claim="ns/c"),
                          engine_session, Timeouts())
    with pytest.raises(EngineRejected):
        await adapter.is_sleeping()


async def test_a_deep_stream_chunk_fails_the_probe(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession) -> None:
    engine, url = fake_engine
    engine.answers["/v1/chat/completions"] = lambda: web.Response(
        text=f"data: {DEEP}\n\ndata: [DONE]\n\n", content_type="text/event-stream")
    result = await run_probe(engine_session,
                             EngineEndpoint(base_url=url, model="m", claim="ns/c"), Timeouts())
    assert not result.ok
    assert "not JSON" in result.detail


def test_malformed_route_table_entries_are_skipped() -> None:
    table = {"paths": {
        "/sleep": {"post": {"parameters": 5}},
        "/wake_up": {"post": {"parameters": [{"in": "query", "name": 3},
                                             {"in": "query", "name": ["tags"]},
                                             {"in": "query", "name": "tags"}]}},
    }}
    assert dialects.served_routes(table) == {("POST", "/sleep"): frozenset(),
                                             ("POST", "/wake_up"): frozenset({"tags"})}


# -- 2. the release learnt per run of the engine, pruned with the claimants ------------------


async def test_the_release_is_read_again_for_a_new_run_and_pruned_runs_are_forgotten(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession) -> None:
    engine, url = fake_engine

    async def release(run: str) -> str:
        endpoint = EngineEndpoint(base_url=url, model="m", claim="ns/c", pod="ns/engine",
                                  run=run)
        return (await dialects.detect(EngineHttp(endpoint, engine_session, Timeouts()))
                ).version

    engine.answers["/version"] = _version("0.26.0")
    assert await release("pod-1/0") == "0.26.0"
    engine.answers["/version"] = _version("0.34.0")  # the container restarted, upgraded
    assert await release("pod-1/1") == "0.34.0"
    assert await release("pod-1/0") == "0.26.0"  # kept while that run is a claimant
    dialects.keep_only({"pod-1/1"})
    engine.answers["/version"] = _version("0.30.0")
    assert await release("pod-1/0") == "0.30.0"  # pruned: read again
    assert await release("pod-1/1") == "0.34.0"  # kept


def test_a_run_is_the_pod_uid_and_its_restarts() -> None:
    """The node names each engine's run so, on the adapter's endpoint and when pruning."""
    from controller.lease.node import engine_run

    running = claimant(UID_A, 8000)
    assert engine_run(running) == f"{running.pod_uid}/0"
    assert engine_run(dataclasses.replace(running, restarts=2)) == f"{running.pod_uid}/2"
    assert engine_run(dataclasses.replace(running, pod_uid=None)) is None


# -- 3. a sleep that fails after its pause resumes the engine --------------------------------


def _sleep_fails_simulator() -> web.Application:
    """The engine simulator of an RFC #51476 engine (pause, then a pure-memory sleep) whose
    ``/sleep`` fails as vLLM's does when host memory runs out: HTTP 500."""
    settings = Settings.model_validate({
        "model": ENGINE_SIM_MODEL, "awake_memory_bytes": 10 * ENGINE_SIM_GIB,
        "resident_memory_bytes": 1 * ENGINE_SIM_GIB, "weights_bytes": 6 * ENGINE_SIM_GIB,
        "shutdown_grace_seconds": 0.0, "dev_mode": True, "vllm_version": "0.34.0",
        "sleep_ignores_requests": True})
    app = create_app(settings, exit_process=lambda _code: None)

    @web.middleware
    async def sleep_fails(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/sleep":
            return web.json_response({"error": {
                "message": "DefaultCPUAllocator: can't allocate memory", "type":
                "InternalServerError", "code": 500}}, status=500)
        return await handler(request)

    app.middlewares.append(sleep_fails)
    return app


async def test_a_failed_sleep_after_a_pause_resumes_the_engine(
        engine_session: aiohttp.ClientSession) -> None:
    app = _sleep_fails_simulator()
    server = SimulatorServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        engine = app[ENGINE_KEY]
        endpoint = EngineEndpoint(base_url=str(server.make_url("")).rstrip("/"),
                                  model=ENGINE_SIM_MODEL, claim="ns/c")
        adapter = VllmAdapter(endpoint, engine_session, Timeouts())
        with pytest.raises(EngineRejected) as caught:
            await adapter.sleep(1)
        assert caught.value.reason == "host_oom"
        assert not engine.paused  # resumed: it serves again, and nothing sleeps
    finally:
        await server.close()


# -- 4. the control token: fetched before the call's time starts; any failure unreachable ---


class FakeClock:
    """``time`` as the transport sees it, moved on by the fake driver's slowness."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s


async def test_a_slow_token_source_does_not_eat_the_calls_time(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, url = fake_engine
    engine.answers["/is_sleeping"] = lambda: web.json_response({"is_sleeping": False})
    clock = FakeClock()
    monkeypatch.setattr(transport, "time", clock)
    timeouts = Timeouts(status_s=ENGINE_SIM_DEADLINE_S)

    async def slow_driver() -> str:
        clock.offset_s += 2 * timeouts.status_s  # the driver took longer than the call may
        return "token"

    endpoint = EngineEndpoint(base_url=url, model="m", claim="ns/c", token_source=slow_driver)
    assert await VllmAdapter(endpoint, engine_session, timeouts).is_sleeping() is False
    assert engine.arrivals == ["/is_sleeping"]


async def test_any_failure_of_the_token_source_is_unreachable_with_nothing_sent(
        fake_engine: tuple[FakeEngine, str], engine_session: aiohttp.ClientSession) -> None:
    engine, url = fake_engine
    engine.answers["/is_sleeping"] = lambda: web.json_response({"is_sleeping": False})

    async def broken_driver() -> str:
        raise grpc.aio.UsageError("Channel is closed")

    endpoint = EngineEndpoint(base_url=url, model="m", claim="ns/c",
                              token_source=broken_driver)
    with pytest.raises(EngineUnreachable, match="no control token") as caught:
        await VllmAdapter(endpoint, engine_session, Timeouts()).is_sleeping()
    assert not caught.value.request_sent
    assert engine.arrivals == []
