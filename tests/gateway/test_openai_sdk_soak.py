"""A soak through the official ``openai`` SDK: chat and completion requests, streamed and
not, for two models that share one GPU, so that the gateway switches between them all
along; the SDK's own retries and timeouts are on, as a client author leaves them.

The rig is the gateway's usual one (``conftest.py``): the real gateway app on real HTTP,
two engine simulators on one GPU and a fake lease controller that switches between them
for real. The gateway is made tight (4 requests at once per engine, 6 more may wait, a
streamed request's head sent after 0.5 s of waiting) so that refusals with ``Retry-After``
happen, and for a while the controller's switches fail (``gpu_oom``, Retry-After 1 s).

Every request must end with a valid answer (the model's own text, as many tokens as asked,
a finish reason, the usage) or with an error the SDK raises whose status and code are in
the gateway's documented error table (``docs/api.md``): no hung stream, no malformed chunk,
no connection error. Every retry the SDK makes after a refusal with ``Retry-After`` must
come at least that long after the refusal.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx2
import pytest
from aiohttp import web
from openai import APIError, APIStatusError, AsyncOpenAI

from controller.gateway import keys
from tests.gateway.conftest import MODEL_A, MODEL_B, Failure, RigFactory

pytestmark = pytest.mark.gateway

SOAK_S = 12.0
"""How long new requests are started."""
CLIENTS = 16
MAX_TOKENS = 12
PROMPT = "What is 3 + 4?"
REQUEST_BOUND_S = 45.0
"""Longer than the SDK's worst case here (5 retries of a 10 s wait, 1 s apart): a request
still running after it has hung."""
RETRY_AFTER_SLACK_S = 0.05
FAILING_FROM_S = 4.0
FAILED_SWITCHES = 3
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"

Kind = Literal["chat", "chat_stream", "completion", "completion_stream"]
KINDS: tuple[Kind, ...] = ("chat", "chat_stream", "completion", "completion_stream")


def documented_errors() -> dict[str, int]:
    """Error code -> status, from the gateway's error table in ``docs/api.md``."""
    section = DOCS.read_text().partition("\n## Errors\n")[2].partition("\n## ")[0]
    codes: dict[str, int] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("|") and len(cells) == 4 and cells[0].isdigit():
            for code in re.findall(r"`([a-z0-9_]+)`", cells[2]):
                codes[code] = int(cells[0])
    return codes


@dataclass(frozen=True)
class Attempt:
    """One answer the gateway began, as its ``on_response_prepare`` saw it."""

    request_id: str
    retry: int
    status: int
    retry_after: str | None
    at: float


@dataclass
class Soak:
    attempts: list[Attempt] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    """What must not happen: an invalid answer, an undocumented error, a hang."""

    async def record(self, request: web.Request, response: web.StreamResponse) -> None:
        request_id = request.headers.get("X-Request-Id", "")
        if request_id.startswith("soak-"):
            self.attempts.append(Attempt(
                request_id, int(request.headers.get("x-stainless-retry-count", "0")),
                response.status, response.headers.get("Retry-After"), time.monotonic()))


def _check_text(text: str, finish: str | None, completion_tokens: int | None) -> str | None:
    """Why an answer is not the simulator's valid one (None: it is)."""
    if not text.startswith("7"):
        return f"text {text[:40]!r}"
    if finish != "length":
        return f"finish_reason {finish!r}"
    if completion_tokens != MAX_TOKENS:
        return f"completion_tokens {completion_tokens!r}"
    return None


async def _chat(sdk: AsyncOpenAI, model: str, request_id: str) -> str | None:
    answer = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": request_id})
    if answer.model != model or answer.object != "chat.completion":
        return f"model {answer.model!r}, object {answer.object!r}"
    choice = answer.choices[0]
    return _check_text(choice.message.content or "", choice.finish_reason,
                       answer.usage.completion_tokens if answer.usage else None)


async def _chat_stream(sdk: AsyncOpenAI, model: str, request_id: str) -> str | None:
    stream = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": request_id})
    text, finish, usage, contents = "", None, None, 0
    async for chunk in stream:
        if chunk.model != model or chunk.object != "chat.completion.chunk":
            return f"chunk of model {chunk.model!r}, object {chunk.object!r}"
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                contents += 1
            finish = choice.finish_reason or finish
    if contents != MAX_TOKENS:
        return f"{contents} content chunks"
    return _check_text(text, finish, usage)


async def _completion(sdk: AsyncOpenAI, model: str, request_id: str) -> str | None:
    answer = await sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id})
    if answer.model != model or answer.object != "text_completion":
        return f"model {answer.model!r}, object {answer.object!r}"
    choice = answer.choices[0]
    return _check_text(choice.text, choice.finish_reason,
                       answer.usage.completion_tokens if answer.usage else None)


async def _completion_stream(sdk: AsyncOpenAI, model: str, request_id: str) -> str | None:
    stream = await sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id})
    text, finish, usage, contents = "", None, None, 0
    async for chunk in stream:
        if chunk.model != model or chunk.object != "text_completion":
            return f"chunk of model {chunk.model!r}, object {chunk.object!r}"
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.text:
                text += choice.text
                contents += 1
            finish = choice.finish_reason or finish
    if contents != MAX_TOKENS:
        return f"{contents} text chunks"
    return _check_text(text, finish, usage)


CALLS = {"chat": _chat, "chat_stream": _chat_stream, "completion": _completion,
         "completion_stream": _completion_stream}


async def _one(sdk: AsyncOpenAI, soak: Soak, documented: dict[str, int], kind: Kind,
               model: str, request_id: str) -> None:
    what = f"{request_id} ({kind}, {model})"
    try:
        async with asyncio.timeout(REQUEST_BOUND_S):
            problem = await CALLS[kind](sdk, model, request_id)
    except TimeoutError:
        soak.wrong.append(f"{what}: no end after {REQUEST_BOUND_S} s")
        return
    except APIStatusError as error:  # an error answer, after the SDK's retries
        code = str(error.code)
        if documented.get(code) != error.status_code:
            soak.wrong.append(f"{what}: undocumented {error.status_code} {code}")
        soak.outcomes[f"{kind}: {error.status_code} {code}"] += 1
        return
    except APIError as error:  # an error event inside a stream the gateway had begun
        code = str(error.code)
        if code not in documented or type(error) is not APIError:
            soak.wrong.append(f"{what}: {type(error).__name__} {code}: {error}")
        soak.outcomes[f"{kind}: in-stream {code}"] += 1
        return
    if problem is not None:
        soak.wrong.append(f"{what}: {problem}")
    soak.outcomes[f"{kind}: answered" if problem is None else f"{kind}: invalid"] += 1


async def test_the_openai_sdk_through_switches_gets_answers_or_documented_errors(
        make_rig: RigFactory) -> None:
    soak = Soak()
    documented = documented_errors()
    assert {"queue_full", "switch_timeout", "gpu_oom"} <= documented.keys()
    paced = {"ttft_seconds": 0.01, "tokens_per_second": 200.0}
    rig = await make_rig(sim_a=paced, sim_b=paced, on_prepare=soak.record,
                         max_concurrency_per_engine=4, queue_size=6, retry_after_s=1,
                         max_wait_s=10.0, stream_keepalive_s=0.5)
    sdk = AsyncOpenAI(base_url=str(rig.gateway.make_url("/v1")), api_key="unused",
                      max_retries=5, timeout=httpx2.Timeout(20.0, connect=5.0))
    rng = random.Random(19)
    started = time.monotonic()
    numbers = iter(range(1_000_000))

    async def client(index: int) -> None:
        # Each client keeps to one model for a while, so that switches are asked for in
        # waves rather than by every other request.
        while (now := time.monotonic() - started) < SOAK_S:
            model = (MODEL_A, MODEL_B)[(index + int(now / 1.5)) % 2]
            await _one(sdk, soak, documented, rng.choice(KINDS), model,
                       f"soak-{next(numbers)}")

    async def failing_switches() -> None:
        await asyncio.sleep(FAILING_FROM_S)
        rig.controller.failure = Failure(503, "gpu_oom", retry_after=1,
                                         times=FAILED_SWITCHES)

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(failing_switches())
            for index in range(CLIENTS):
                group.create_task(client(index))
    finally:
        await sdk.close()
    print(f"soak: {sum(soak.outcomes.values())} requests in "
          f"{time.monotonic() - started:.1f} s, {rig.controller.switches} switches, "
          f"{len(soak.attempts)} attempts; {dict(sorted(soak.outcomes.items()))}")

    assert soak.wrong == []
    answered = sum(n for k, n in soak.outcomes.items() if k.endswith(": answered"))
    assert answered >= sum(soak.outcomes.values()) // 2, soak.outcomes
    assert all(soak.outcomes[f"{kind}: answered"] > 0 for kind in KINDS), soak.outcomes
    assert rig.controller.switches >= 4
    assert rig.controller.max_awake == 1
    assert rig.controller.failure is not None
    assert rig.controller.failure.times == 0, "the failing switches were asked for"
    assert rig.app[keys.STATE].synced

    # The SDK's retries honour Retry-After: each retry's answer began no sooner than the
    # refusal's Retry-After after the refusal.
    by_request: dict[str, list[Attempt]] = {}
    for attempt in soak.attempts:
        by_request.setdefault(attempt.request_id, []).append(attempt)
    honoured = 0
    for attempts in by_request.values():
        attempts.sort(key=lambda a: a.retry)
        for refused, retried in itertools.pairwise(attempts):
            if refused.retry_after is None or retried.retry != refused.retry + 1:
                continue
            assert refused.status in (429, 503), refused
            waited = retried.at - refused.at
            assert waited >= int(refused.retry_after) - RETRY_AFTER_SLACK_S, (refused, retried)
            honoured += 1
    assert honoured > 0, "no refusal with Retry-After was retried"
    refusals = Counter(f"{a.status} Retry-After {a.retry_after}" for a in soak.attempts
                       if a.status != 200)
    print(f"soak: refusals {dict(refusals)}; {honoured} retries after a Retry-After, each "
          f"at least that long after")
