"""The OpenAI endpoints: SSE format, usage, the correctness answer, vLLM's error shapes."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.simulator.conftest import (
    MODEL,
    Sim,
    SimFactory,
    content_of,
    finish_reasons,
    next_event,
    read_events,
)

PROBE = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
         "messages": [{"role": "user", "content": "What is 3 plus 4? Answer with a number."}]}


async def test_streamed_chat_answers_seven_with_usage_and_done(sim: Sim) -> None:
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        events = await read_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert len(chunks) == len(events) - 1
    assert content_of(events) == "7"
    assert finish_reasons(events) == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 1
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for chunk in chunks[:-1]:
        assert chunk["object"] == "chat.completion.chunk"
        assert "usage" not in chunk  # vLLM 0.26 omits it (no "usage": null)
        assert chunk["model"] == MODEL
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


async def test_streamed_chat_without_usage_has_no_usage_field(sim: Sim) -> None:
    payload = {k: v for k, v in PROBE.items() if k != "stream_options"}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        events = await read_events(resp)
    assert content_of(events) == "7"
    assert all("usage" not in e for e in events if isinstance(e, dict))


async def test_streamed_completion(sim: Sim) -> None:
    payload = {"model": MODEL, "prompt": "Q: what is 3 + 4?\nA:", "stream": True,
               "stream_options": {"include_usage": True}}
    async with sim.client.post("/v1/completions", json=payload) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert content_of(events) == "7"
    assert finish_reasons(events) == ["stop"]
    usage_chunk = events[-2]
    assert isinstance(usage_chunk, dict)
    assert usage_chunk["object"] == "text_completion"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 1


async def test_non_streamed_answers(sim: Sim) -> None:
    body = await sim.ask("WHAT IS 3 PLUS 4")
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "7", "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 1

    async with sim.client.post("/v1/completions", json={"model": MODEL, "prompt": "3+4="}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "7"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 1


async def test_other_prompts_get_deterministic_filler(sim: Sim) -> None:
    first = await sim.answer("Tell me about the sea.")
    second = await sim.answer("Tell me about the sea.")
    assert first == second
    assert first
    assert first != "7"
    assert "7" not in await sim.answer("What is 30 + 45?")


async def test_ignore_eos_gives_exactly_max_tokens(sim: Sim) -> None:
    payload = PROBE | {"max_tokens": 17, "ignore_eos": True}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        events = await read_events(resp)
    token_chunks = [e for e in events if isinstance(e, dict) and e["choices"]
                    and e["choices"][0]["delta"].get("content")]
    assert len(token_chunks) == 17
    assert content_of(events).startswith("7")
    assert finish_reasons(events) == ["length"]
    usage_chunk = events[-2]
    assert isinstance(usage_chunk, dict)
    assert usage_chunk["usage"]["completion_tokens"] == 17

    body = await sim.ask("Say something long.", max_tokens=128, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 128
    assert body["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_cuts_a_long_answer(sim: Sim) -> None:
    body = await sim.ask("Say something.", max_tokens=3)
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    body = await sim.ask("Say something.", max_completion_tokens=2)
    assert body["usage"]["completion_tokens"] == 2


async def test_wrong_model_is_404(sim: Sim) -> None:
    payload = PROBE | {"model": "other/model"}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        assert resp.status == 404
        body = await resp.json()
    assert body["error"] == {"message": "The model `other/model` does not exist.",
                             "type": "NotFoundError", "param": None, "code": 404}


async def test_malformed_requests_are_400(sim: Sim) -> None:
    bad_bodies: list[Any] = [
        b"{\"model\": ",
        {"model": MODEL},
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
         "stream_options": {"include_usage": True}},
    ]
    for bad in bad_bodies:
        kwargs: dict[str, Any] = {"data": bad} if isinstance(bad, bytes) else {"json": bad}
        async with sim.client.post("/v1/chat/completions", **kwargs) as resp:
            assert resp.status == 400, bad
            body = await resp.json()
            assert body["error"]["type"] == "BadRequestError"
            assert body["error"]["code"] == 400


async def test_unknown_sampling_fields_are_accepted(sim: Sim) -> None:
    body = await sim.ask(temperature=0.0, top_p=1.0, seed=7, min_tokens=1)
    assert body["choices"][0]["message"]["content"] == "7"


async def test_models_lists_the_simulator(sim: Sim) -> None:
    async with sim.client.get("/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert "simulator" in body["data"][0]["owned_by"]


async def test_asleep_holds_a_plain_request_until_woken(sim: Sim) -> None:
    """vLLM 0.26 never refuses a request because it sleeps: it waits in the scheduler's
    queue and is answered after the wake (verified on the H200)."""
    await sim.post_empty("/sleep", level=1)
    pending = asyncio.create_task(sim.answer())
    await sim.until(lambda: sim.engine.waiting == 1)
    assert not pending.done()
    await sim.post_empty("/wake_up")
    async with asyncio.timeout(10):
        assert await pending == "7"


async def test_asleep_stream_gets_200_headers_at_once_then_nothing_until_woken(
    sim: Sim,
) -> None:
    await sim.post_empty("/sleep", level=1)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        assert resp.status == 200  # headers before the scheduler runs the request
        assert resp.content_type == "text/event-stream"
        await sim.until(lambda: sim.engine.waiting == 1)
        assert not resp.content.is_eof()
        assert resp.content.total_bytes == 0  # not a byte of the body yet
        await sim.post_empty("/wake_up")
        events = await read_events(resp)
    assert content_of(events) == "7"


async def test_refuse_while_asleep_is_a_named_kinder_fault(make_sim: SimFactory) -> None:
    sim = await make_sim(faults={"refuse_while_asleep": True})
    await sim.post_empty("/sleep", level=1)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body["error"]["type"] == "ServiceUnavailableError"
    assert body["error"]["code"] == 503
    async with sim.client.post("/v1/completions", json={"prompt": "3 + 4"}) as resp:
        assert resp.status == 503


async def test_sleep_abort_ends_a_running_stream(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    payload = PROBE | {"max_tokens": 50, "ignore_eos": True}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        first = await next_event(resp)
        assert isinstance(first, dict)
        assert sim.engine.running == 1
        await sim.post_empty("/sleep", level=1, mode="abort")
        events = [first, *await read_events(resp)]
    assert finish_reasons(events) == ["abort"]
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert isinstance(usage_chunk, dict)
    assert usage_chunk["usage"]["completion_tokens"] == 0
    state = await sim.state()
    assert state["sleeping"]
    assert state["in_flight"] == 0
    assert state["generations_aborted"] == 1


async def test_sleep_wait_lets_a_running_stream_finish(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    payload = PROBE | {"max_tokens": 5, "ignore_eos": True}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        await next_event(resp)
        sleeping = asyncio.create_task(sim.post_empty("/sleep", level=1, mode="wait"))
        await sim.until(lambda: sim.engine.pending_sleeps == 1)
        assert not sim.engine.state.is_sleeping
        assert await sim.is_sleeping()  # true as soon as the scheduler pauses
        held = asyncio.create_task(sim.answer())  # held, not refused, while it drains
        await sim.until(lambda: sim.engine.waiting == 1)
        await sim.faults(stall_generation=False)
        events = await read_events(resp)
    async with asyncio.timeout(10):
        await sleeping
    assert finish_reasons(events) == ["length"]
    assert content_of(events).startswith("7")
    assert await sim.is_sleeping()
    assert not held.done()
    await sim.post_empty("/wake_up")
    async with asyncio.timeout(10):
        assert await held == "7"


async def test_sleep_keep_freezes_and_wake_resumes(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    payload = PROBE | {"max_tokens": 4, "ignore_eos": True}
    async with sim.client.post("/v1/chat/completions", json=payload) as resp:
        await next_event(resp)
        await sim.post_empty("/sleep", level=1, mode="keep")
        await sim.faults(stall_generation=False)
        assert sim.engine.running == 1  # frozen, not aborted
        await sim.post_empty("/wake_up")
        events = await read_events(resp)
    assert finish_reasons(events) == ["length"]


async def test_error_after_200_is_sent_in_the_stream(sim: Sim) -> None:
    await sim.faults(fail_mid_stream=True)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict)
    assert error["error"]["code"] == 500
    assert not finish_reasons(events)
    async with sim.client.post("/v1/completions", json={"prompt": "3 + 4"}) as resp:
        assert resp.status == 500


async def test_timing_knobs_still_answer(make_sim: SimFactory) -> None:
    sim = await make_sim(ttft_seconds=0.01, tokens_per_second=1000.0)
    body = await sim.ask(max_tokens=5, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 5


async def test_paused_engine_holds_requests_until_resumed(sim: Sim) -> None:
    async with sim.client.post("/pause", params={"mode": "wait"}) as resp:
        assert resp.status == 200
    held = asyncio.create_task(sim.answer())
    await sim.until(lambda: sim.engine.waiting == 1)
    assert not held.done()
    async with sim.client.post("/resume") as resp:
        assert resp.status == 200
    async with asyncio.timeout(10):
        assert await held == "7"


async def test_pause_abort_ends_a_running_stream(sim: Sim) -> None:
    await sim.faults(stall_generation=True)
    async with sim.client.post("/v1/chat/completions", json=PROBE) as resp:
        await next_event(resp)
        async with sim.client.post("/pause", params={"mode": "abort"}) as paused:
            assert paused.status == 200
        events = await read_events(resp)
    assert finish_reasons(events) == ["abort"]
    assert await sim.is_sleeping()  # vLLM 0.26: true while the scheduler is paused
