"""The correctness probe: against the simulator, against scripted streams, and its parser."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.lease.engines import (
    EngineEndpoint,
    EngineLied,
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    ProbeFailed,
    ProbeReason,
    Timeouts,
    VllmAdapter,
    run_probe,
)
from controller.lease.engines.probe import PROBE_QUESTION, ProbeMode, content_is_correct
from controller.lease.engines.sse import SseParser
from rota.api.engine_config import ProbeConfig
from tests.controller.conftest import EngineSim, EngineSimFactory

QUICK = Timeouts(probe_total_s=5.0, probe_first_token_s=0.3)


async def test_passes_on_a_healthy_engine(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    result = await run_probe(engine_session, engine_sim.endpoint(), Timeouts())
    assert (result.ok, result.reason, result.content, result.status) == (True, None, "7", 200)
    assert result.usage is not None
    assert result.usage.completion_tokens == 1
    assert result.usage.total_tokens == result.usage.prompt_tokens + 1
    assert result.ttft_s is not None
    assert 0 <= result.ttft_s <= result.total_s
    result.raise_for_failure()  # passes silently


async def test_error_inside_a_200_stream_fails(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    await engine_sim.faults(fail_mid_stream=True)
    result = await run_probe(engine_session, engine_sim.endpoint(), Timeouts())
    assert (result.ok, result.reason, result.status) == (False, ProbeReason.STREAM_ERROR, 200)
    assert "fail_mid_stream" in result.detail
    with pytest.raises(ProbeFailed) as caught:
        result.raise_for_failure()
    assert (caught.value.reason, caught.value.probe_reason) == ("probe_stream_error",
                                                                 "stream_error")


async def test_fails_while_asleep(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    """vLLM holds the request of a sleeping engine: 200 headers, then nothing."""
    adapter = VllmAdapter(engine_sim.endpoint(), engine_session,
                          Timeouts(probe_first_token_s=0.2))
    await adapter.sleep(1)
    result = await adapter.probe()
    assert (result.reason, result.status) == (ProbeReason.TIMEOUT, 200)
    assert "no content token" in result.detail
    assert result.ttft_s is None


async def test_no_first_token_in_time(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    await engine_sim.faults(stall_generation=True)
    result = await run_probe(engine_session, engine_sim.endpoint(), QUICK)
    assert (result.reason, result.ttft_s) == (ProbeReason.TIMEOUT, None)
    assert "first" in result.detail or "no content token" in result.detail
    await engine_sim.until(lambda: engine_sim.engine.running == 0)  # the engine let it go


async def test_a_stream_slower_than_the_total_budget(
    engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession
) -> None:
    # Garbage weights (level-2 wake without reload) answer eight "!" tokens, one every 10 s.
    sim = await engine_sim_factory(tokens_per_second=0.1)
    await VllmAdapter(sim.endpoint(), engine_session, Timeouts()).sleep(2)
    async with engine_session.post(sim.base_url + "/wake_up") as resp:
        assert resp.status == 200
    budget = Timeouts(probe_total_s=1.0, probe_first_token_s=1.0)
    result = await run_probe(engine_session, sim.endpoint(), budget)
    assert result.reason is ProbeReason.TIMEOUT
    assert result.ttft_s is not None
    assert result.content == "!"
    assert "did not finish" in result.detail


# -- scripted streams: a real HTTP server that sends exactly the bytes a test gives ------

Script = Sequence[bytes]
ServeScript = Callable[..., Awaitable[EngineEndpoint]]


def sse(payload: object) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def delta(text: str) -> dict[str, object]:
    return {"id": "x", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            "usage": None}


USAGE = {"id": "x", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}}


@pytest.fixture
async def serve_script() -> AsyncIterator[ServeScript]:
    servers: list[TestServer] = []

    async def serve(script: Script, *, status: int = 200) -> EngineEndpoint:
        async def chat(request: web.Request) -> web.StreamResponse:
            await request.read()
            response = web.StreamResponse(status=status,
                                          headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for part in script:
                await response.write(part)
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return EngineEndpoint(base_url=str(server.make_url("")), model="scripted",
                              claim="ns/scripted")

    try:
        yield serve
    finally:
        for server in servers:
            await server.close()


def split_everywhere(stream: bytes, size: int) -> list[bytes]:
    return [stream[i:i + size] for i in range(0, len(stream), size)]


GOOD = sse(delta("")) + sse(delta("7")) + b": keep-alive\n\n" + sse(USAGE) + sse("[DONE]")


@pytest.mark.parametrize("size", [1, 3, 7, len(GOOD)])
async def test_chunks_split_anywhere_and_comments_are_fine(
    serve_script: ServeScript, engine_session: aiohttp.ClientSession, size: int
) -> None:
    endpoint = await serve_script(split_everywhere(GOOD, size))
    result = await run_probe(engine_session, endpoint, Timeouts())
    assert result.ok, result


async def test_the_request_is_the_reference_question(
    engine_session: aiohttp.ClientSession,
) -> None:
    seen: list[object] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(status=500, text='{"error": {"message": "boom"}}')

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        endpoint = EngineEndpoint(base_url=str(server.make_url("")), model="m", claim="c")
        result = await run_probe(engine_session, endpoint, Timeouts())
    finally:
        await server.close()
    assert (result.reason, result.status, result.detail) == (
        ProbeReason.HTTP_ERROR, 500, "the engine answered 500: boom")
    [body] = seen
    assert isinstance(body, dict)
    assert body["messages"] == [{"role": "user", "content": PROBE_QUESTION}]
    assert (body["stream"], body["stream_options"], body["temperature"]) == (
        True, {"include_usage": True}, 0)
    assert body["model"] == "m"
    assert 1 <= body["max_tokens"] <= 16


@pytest.mark.parametrize(("script", "reason"), [
    ([sse(delta("7")), sse(USAGE)], ProbeReason.NO_DONE),
    ([sse(delta("7")), sse("[DONE]")], ProbeReason.NO_USAGE),
    ([sse(delta("7")), sse({"choices": [], "usage": {"prompt_tokens": 1.5,
      "completion_tokens": 1, "total_tokens": 2.5}}), sse("[DONE]")], ProbeReason.NO_USAGE),
    ([sse(delta("7")), sse({"choices": [], "usage": {"prompt_tokens": True,
      "completion_tokens": 1, "total_tokens": 2}}), sse("[DONE]")], ProbeReason.NO_USAGE),
    ([sse(delta("The answer is 7")), sse(USAGE), sse("[DONE]")], ProbeReason.WRONG_CONTENT),
    ([sse(USAGE), sse("[DONE]")], ProbeReason.WRONG_CONTENT),
    ([sse(delta("7")), b"data: {not json\n\n", sse("[DONE]")], ProbeReason.STREAM_ERROR),
    ([sse(delta("7")), sse({"error": {"message": "engine died", "code": 500}}),
      sse("[DONE]")], ProbeReason.STREAM_ERROR),
    ([b'{"choices": [{"message": {"content": "7"}}]}'], ProbeReason.NO_DONE),
])
async def test_scripted_failures(
    serve_script: ServeScript, engine_session: aiohttp.ClientSession, script: Script,
    reason: ProbeReason,
) -> None:
    endpoint = await serve_script(script)
    result = await run_probe(engine_session, endpoint, Timeouts())
    assert (result.ok, result.reason) == (False, reason), result


async def test_done_without_its_blank_line_still_counts(
    serve_script: ServeScript, engine_session: aiohttp.ClientSession
) -> None:
    endpoint = await serve_script([sse(delta("7")), sse(USAGE), b"data: [DONE]"])
    assert (await run_probe(engine_session, endpoint, Timeouts())).ok


async def test_usage_chunk_with_null_choices_is_accepted(
    serve_script: ServeScript, engine_session: aiohttp.ClientSession
) -> None:
    usage = dict(USAGE, choices=None)
    endpoint = await serve_script([sse(delta("7")), sse(delta(".")), sse(usage), sse("[DONE]")])
    result = await run_probe(engine_session, endpoint, Timeouts())
    assert (result.ok, result.content) == (True, "7.")


# -- pure parts ---------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "correct"), [
    ("7", True), (" 7\n", True), ("7.", True), ("7!", True), ("7 .", True),
    ("7\u3002", True), ("", False), ("77", False), ("17", False), ("**7**", False),
    ("The answer is 7", False), ("7 apples", False), ("42", False), ("7.5", False),
])
def test_content_rule(content: str, correct: bool) -> None:
    assert content_is_correct(content) is correct


def test_sse_parser_handles_line_endings_comments_and_multiline_data() -> None:
    stream = (": hello\r\n\r\ndata: a\r\ndata:b\r\nid: 3\r\n\r\n"
              "event: x\rdata: c\r\rdata: \u00e9\u20ac\n\n").encode()
    for size in (1, 2, 5, len(stream)):
        parser = SseParser()
        events = [e for part in split_everywhere(stream, size) for e in parser.feed(part)]
        events += parser.close()
        assert events == ["a\nb", "c", "\u00e9\u20ac"], size


def test_sse_parser_flushes_an_unterminated_event_at_the_end() -> None:
    parser = SseParser()
    assert parser.feed(b"data: [DO") == []
    assert parser.feed(b"NE]\r") == []
    assert parser.close() == ["[DONE]"]


def test_error_reasons_are_distinct() -> None:
    engine = {EngineUnreachable.reason, EngineTimeout.reason, EngineLied.reason,
              EngineProtocolError.reason, "rejected", "gpu_oom", "unauthorized", "ack_error"}
    probe = {f"probe_{r}" for r in ProbeReason}
    assert len(engine) == 8
    assert not engine & probe
    assert {EngineRejected("x", step="s", status=s, body=b).reason for s, b in [
        (500, '{"error": {"message": "CUDA Error: out of memory at x.cpp:62"}}'),
        (401, '{"error": "Unauthorized"}'), (400, "bad"), (409, ""),
    ]} == {"gpu_oom", "unauthorized", "rejected"}


def test_rejected_body_is_cut() -> None:
    error = EngineRejected("x", step="s", status=500, body="y" * 10_000)
    assert len(error.body) == 256


async def test_probe_does_not_outlive_cancellation(
    engine_sim: EngineSim, engine_session: aiohttp.ClientSession
) -> None:
    await engine_sim.faults(stall_generation=True)
    task = asyncio.create_task(run_probe(engine_session, engine_sim.endpoint(), Timeouts()))
    await engine_sim.until(lambda: engine_sim.engine.running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine_sim.until(lambda: engine_sim.engine.running == 0)


# -- the claim's probe section (issue 11 #6) ---------------------------------------------


def reasoning(text: str) -> dict[str, object]:
    return {"id": "x", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"reasoning_content": text},
                         "finish_reason": None}]}


async def test_the_request_follows_the_claim(engine_session: aiohttp.ClientSession) -> None:
    seen: list[Any] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(status=500, text='{"error": {"message": "boom"}}')

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    config = ProbeConfig(prompt="Capital of France, one word?", expect="Paris",
                         max_tokens=300, chat_template_kwargs={"enable_thinking": False})
    try:
        endpoint = EngineEndpoint(base_url=str(server.make_url("")), model="m", claim="c")
        await run_probe(engine_session, endpoint, Timeouts(), config=config)
    finally:
        await server.close()
    [body] = seen
    assert body["messages"] == [{"role": "user", "content": "Capital of France, one word?"}]
    assert body["max_tokens"] == 300
    assert body["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(("content", "expect", "ok"), [
    ("Paris", "Paris", True), (" Paris.\n", "Paris", True), ("paris", "Paris", False),
    ("It is Paris", "Paris", False), ("7", "Paris", False), ("42!", "42", True),
])
def test_the_expected_answer_is_configurable(content: str, expect: str, ok: bool) -> None:
    assert content_is_correct(content, expect) is ok


async def test_reasoning_content_counts_only_where_configured(
    serve_script: ServeScript, engine_session: aiohttp.ClientSession
) -> None:
    """A reasoning model with a reasoning parser streams its thoughts in
    ``reasoning_content`` and may put nothing in ``content`` within the budget."""
    script = [sse(reasoning("7")), sse(USAGE), sse("[DONE]")]
    plain = await run_probe(engine_session, await serve_script(script), Timeouts())
    assert (plain.reason, plain.content) == (ProbeReason.WRONG_CONTENT, "")
    counted = await run_probe(engine_session, await serve_script(script), Timeouts(),
                              config=ProbeConfig(reasoning_counts=True))
    assert (counted.ok, counted.content) == (True, "7")
    assert counted.ttft_s is not None


async def test_structure_mode_takes_any_content_and_says_so(
    serve_script: ServeScript, engine_session: aiohttp.ClientSession
) -> None:
    structure = ProbeConfig(mode="structure")
    noise = [sse(delta("ĠxQ")), sse(delta("zz")), sse(USAGE), sse("[DONE]")]
    result = await run_probe(engine_session, await serve_script(noise), Timeouts(),
                             config=structure)
    assert (result.ok, result.mode) == (True, ProbeMode.STRUCTURE)
    answer = await run_probe(engine_session, await serve_script(noise), Timeouts())
    assert (answer.ok, answer.mode) == (False, ProbeMode.ANSWER)
    for broken, reason in (([sse(USAGE), sse("[DONE]")], ProbeReason.WRONG_CONTENT),
                           ([sse(delta("x")), sse(USAGE)], ProbeReason.NO_DONE),
                           ([sse(delta("x")), sse("[DONE]")], ProbeReason.NO_USAGE)):
        failed = await run_probe(engine_session, await serve_script(broken), Timeouts(),
                                 config=structure)
        assert failed.reason is reason


async def test_the_probe_sends_the_api_key_as_a_bearer(
    engine_session: aiohttp.ClientSession,
) -> None:
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"error": "Unauthorized"}, status=401)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        base = str(server.make_url(""))
        keyed = EngineEndpoint(base_url=base, model="m", claim="c", api_key="sk-1",
                               token="rota-control")
        result = await run_probe(engine_session, keyed, Timeouts())
        await run_probe(engine_session, EngineEndpoint(base_url=base, model="m", claim="c"),
                        Timeouts())
    finally:
        await server.close()
    assert seen == ["Bearer sk-1", None]
    assert (result.reason, result.status) == (ProbeReason.HTTP_ERROR, 401)
    assert "sk-1" not in result.detail
