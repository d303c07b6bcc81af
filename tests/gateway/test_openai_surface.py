"""The OpenAI surface users expect, each path routed by ``model`` with the same places,
queueing and switching as chat; streamed requests kept alive while a switch runs; the
OpenAI Python SDK through the gateway."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import APIError, AsyncOpenAI

from tests.gateway.conftest import (
    DEADLINE,
    MODEL_A,
    MODEL_B,
    Failure,
    Rig,
    RigFactory,
    content_of,
    eventually,
    read_events,
)
from tests.gateway.surface_cases import JSON_CASES, rig_for

pytestmark = pytest.mark.gateway

CASES = JSON_CASES


@pytest.mark.parametrize(("path", "body", "field"), CASES)
async def test_each_path_is_routed_by_model_and_switches(
        make_rig: RigFactory, path: str, body: dict[str, Any], field: str) -> None:
    rig = await make_rig(**rig_for(path))
    for model in (MODEL_B, MODEL_A, MODEL_B):
        async with rig.gateway.post(path, json=body | {"model": model}) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert field in answer
        if "model" in answer:
            assert answer["model"] == model
    assert rig.controller.switches == 3
    assert rig.controller.max_awake == 1
    text = await (await rig.gateway.get("/metrics")).text()
    assert f'rota_gateway_requests_total{{model_name="{MODEL_B}",outcome="ok"}} 2.0' in text


async def test_the_new_paths_need_a_model_and_a_known_one(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for path, body, _ in CASES:
        async with rig.gateway.post(path, json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "missing_model"
        async with rig.gateway.post(path, json=body | {"model": "no/such"}) as resp:
            assert resp.status == 404
    assert rig.controller.calls == 0


def _sdk(rig: Rig) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(rig.gateway.make_url("/v1")), api_key="unused",
                       max_retries=0, timeout=DEADLINE)


async def test_the_openai_sdk_calls_embeddings_and_responses_through_the_gateway(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with _sdk(rig) as sdk:
        # B is asleep: each first call of a model waits for its switch.
        embedded = await sdk.embeddings.create(model=MODEL_B, input=["3 + 4", "hello"])
        assert [len(e.embedding) for e in embedded.data] == [16, 16]  # base64, decoded
        assert embedded.model == MODEL_B
        answered = await sdk.responses.create(model=MODEL_A, input="What is 3 + 4?")
        assert answered.output_text == "7"
        assert answered.status == "completed"
        stream = await sdk.responses.create(model=MODEL_B, input="What is 3 + 4?",
                                            stream=True)
        deltas, kinds = [], []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        assert "".join(deltas) == "7"
        assert kinds[0] == "response.created"
        assert kinds[-1] == "response.completed"
        chat = await sdk.chat.completions.create(
            model=MODEL_A, messages=[{"role": "user", "content": "What is 3 + 4?"}])
        assert chat.choices[0].message.content == "7"
    assert rig.controller.switches == 4  # B, A, B, A
    assert rig.controller.max_awake == 1


async def _read_until_comment(resp: Any) -> bytes:
    seen = bytearray()
    async with asyncio.timeout(DEADLINE):
        while b": rota:" not in seen:
            chunk = await resp.content.readany()
            assert chunk, "the stream ended before any keep-alive"
            seen += chunk
    return bytes(seen)


async def test_a_stream_waiting_for_a_switch_is_kept_alive_then_served(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=0.05)
    rig.controller.hold_switch = asyncio.Event()
    resp = await rig.chat(MODEL_B, stream=True)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    head = await _read_until_comment(resp)
    assert b"sim/model-b" in head
    assert rig.controller.switches == 0
    rig.controller.hold_switch.set()
    events, _ = await read_events(resp)
    assert content_of(events) == "7"
    assert events[-1] == "[DONE]"


async def test_the_sdk_skips_keep_alives_and_reads_a_failed_switch_in_the_stream(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=0.05)
    rig.controller.hold_switch = asyncio.Event()
    async with _sdk(rig) as sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL_B, messages=[{"role": "user", "content": "3 + 4"}], stream=True)
        await eventually(lambda: rig.controller.switching.is_set(), "the switch started")
        rig.controller.hold_switch.set()
        text = "".join([c.choices[0].delta.content or "" async for c in stream
                        if c.choices])
        assert text == "7"
    rig.controller.hold_switch = None
    # A switch that fails after the stream started: an error event with its reason.
    rig.controller.failure = Failure(503, "gpu_oom", retry_after=7)
    rig.controller.hold_answer = asyncio.Event()
    resp = await rig.chat(MODEL_A, stream=True)
    assert resp.status == 200
    await _read_until_comment(resp)
    rig.controller.hold_answer.set()
    events, _ = await read_events(resp)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["code"], error["retry_after"]) == ("gpu_oom", "7")
    # The SDK raises it while reading the stream.
    rig.controller.hold_answer = asyncio.Event()
    async with _sdk(rig) as sdk:
        failing = await sdk.chat.completions.create(
            model=MODEL_A, messages=[{"role": "user", "content": "3 + 4"}], stream=True)
        rig.controller.hold_answer.set()
        with pytest.raises(APIError, match="switch failed"):
            async for _ in failing:
                pass
