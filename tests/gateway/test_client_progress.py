"""Progress a person can see, opt-in: a streamed chat request that waits for a switch and
asks for it (``X-Rota-Progress: reasoning``) gets ``reasoning_content`` deltas in proper
``chat.completion.chunk`` events while it waits, then the model's real answer in the same
stream; without the header, SSE comments only, unless the admin's model binding turns
progress on for the model (a request's header still wins). Real gateway, fake controller switching
real engine simulators, and the OpenAI SDK reading the stream."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from controller.gateway.binding import BindingError, ModelBinding, parse_binding
from controller.gateway.downstream import PROGRESS_HEADER
from e2e.harness.wire import parse_sse
from tests.gateway.conftest import (
    DEADLINE,
    MODEL_B,
    NAMESPACE,
    Rig,
    RigFactory,
    content_of,
    eventually,
    read_events,
)

pytestmark = pytest.mark.gateway

KEEPALIVE_S = 0.2


def _reasoning(events: list[Any]) -> list[str]:
    return [choice["delta"]["reasoning_content"] for e in events if isinstance(e, dict)
            for choice in e.get("choices") or []
            if "reasoning_content" in (choice.get("delta") or {})]


async def _held_switch(rig: Rig) -> asyncio.Event:
    """Hold the next switch; released after a few keep-alive ticks."""
    held = asyncio.Event()
    rig.controller.hold_switch = held
    return held


async def test_a_waiting_stream_that_asks_sees_progress_then_the_answer(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S)
    held = await _held_switch(rig)
    payload = {"model": MODEL_B, "stream": True,
               "messages": [{"role": "user", "content": "What is 3 + 4?"}]}
    resp = await rig.gateway.post("/v1/chat/completions", json=payload,
                                  headers={PROGRESS_HEADER: "reasoning"})
    assert resp.status == 200
    await eventually(lambda: rig.controller.switching.is_set(), "the switch began")
    await asyncio.sleep(3 * KEEPALIVE_S)  # a few progress ticks while the switch is held
    held.set()
    events, _ = await read_events(resp)
    progress = _reasoning(events)
    assert progress, events
    assert all(MODEL_B in line for line in progress)
    chunks = [e for e in events if isinstance(e, dict)]
    assert {e["object"] for e in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content_of(events), "the model's real answer follows the progress"
    assert events[-1] == "[DONE]"


async def test_without_the_header_a_waiting_stream_gets_comments_only(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S)
    held = await _held_switch(rig)
    resp = await rig.chat(MODEL_B, stream=True)
    assert resp.status == 200
    await eventually(lambda: rig.controller.switching.is_set(), "the switch began")
    await asyncio.sleep(3 * KEEPALIVE_S)
    held.set()
    events, _ = await read_events(resp)
    assert _reasoning(events) == []
    assert content_of(events)


async def test_the_openai_sdk_reads_the_progress_and_the_answer(make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S)
    held = await _held_switch(rig)
    sdk = AsyncOpenAI(base_url=str(rig.gateway.make_url("/v1")), api_key="unused",
                      max_retries=0, timeout=DEADLINE)

    async def release() -> None:
        await eventually(lambda: rig.controller.switching.is_set(), "the switch began")
        await asyncio.sleep(3 * KEEPALIVE_S)
        held.set()

    releasing = asyncio.ensure_future(release())
    try:
        stream = await sdk.chat.completions.create(
            model=MODEL_B, messages=[{"role": "user", "content": "What is 3 + 4?"}],
            stream=True, extra_headers={PROGRESS_HEADER: "reasoning"})
        reasoning, content = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                if "reasoning_content" in extra:
                    reasoning.append(extra["reasoning_content"])
                content.append(choice.delta.content or "")
    finally:
        await releasing
        await sdk.close()
    assert reasoning
    assert "".join(content)


# -- progress per model, in the admin's model binding --------------------------------------


async def _stream_through_a_switch(rig: Rig, headers: dict[str, str]) -> tuple[bytes, Any]:
    """A streamed chat request for B, its switch held until the stream has begun and shown
    what it shows while waiting (a comment or a progress chunk)."""
    held = await _held_switch(rig)
    payload = {"model": MODEL_B, "stream": True,
               "messages": [{"role": "user", "content": "What is 3 + 4?"}]}
    resp = await rig.gateway.post("/v1/chat/completions", json=payload, headers=headers)
    assert resp.status == 200
    seen = b""
    async with asyncio.timeout(DEADLINE):
        while b"rota: " not in seen:
            chunk = await resp.content.readany()
            assert chunk, seen
            seen += chunk
    held.set()
    return seen + await resp.content.read(), resp


def _binding(tmp_path: Path, progress: str) -> Path:
    path = tmp_path / "binding.yaml"
    path.write_text(f"namespaces: [{NAMESPACE}]\nprogress:\n{progress}")
    return path


async def test_the_binding_turns_progress_on_for_a_model(make_rig: RigFactory,
                                                         tmp_path: Path) -> None:
    binding = _binding(tmp_path, f"  {MODEL_B}: reasoning\n  'sim/*': none\n")
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, serving_namespaces=[],
                         model_binding_file=binding)
    body, _ = await _stream_through_a_switch(rig, headers={})
    events = [e.data for e in parse_sse(body)]
    progress = _reasoning(events)
    assert progress, events
    assert all(MODEL_B in line for line in progress)
    assert content_of(events) == "7"
    assert events[-1] == "[DONE]"


async def test_a_request_s_header_wins_over_its_model_s_binding(make_rig: RigFactory,
                                                                tmp_path: Path) -> None:
    binding = _binding(tmp_path, "  'sim/*': reasoning\n")
    rig = await make_rig(stream_keepalive_s=KEEPALIVE_S, serving_namespaces=[],
                         model_binding_file=binding)
    body, _ = await _stream_through_a_switch(rig, headers={PROGRESS_HEADER: "none"})
    events = parse_sse(body)
    assert _reasoning([e.data for e in events]) == []
    assert any(e.comments for e in events), "SSE comments while it waited"
    assert content_of([e.data for e in events]) == "7"


def test_the_binding_reads_progress_per_model_exact_names_first() -> None:
    binding = parse_binding("namespaces: [a]\nprogress:\n  'org/*': reasoning\n"
                            "  org/quiet: none\n")
    assert binding.progress_of("org/chatty") == "reasoning"
    assert binding.progress_of("org/quiet") == "none"  # its name wins over the pattern
    assert binding.progress_of("other/model") is None
    with_settings = ModelBinding(namespaces=("b",)).with_file(
        "progress: {org/x: reasoning}\n")
    assert with_settings.progress_of("org/x") == "reasoning"
    for wrong in ("progress: {org/x: loud}\n", "progress: {'bad name!': none}\n"):
        with pytest.raises(BindingError):
            parse_binding(wrong)
