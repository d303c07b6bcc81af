"""The campaign's clients: streamed chat requests through the gateway, alternating between
the models of one GPU so that every few requests force a switch, each one classified by
how it ended (:class:`~e2e.chaos.tally.Answer`)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence

import aiohttp

from e2e.chaos.tally import Answer, Tally

__all__ = ["Record", "classify", "client_loop", "into_tally"]

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def classify(status: int, headers: dict[str, str], body: bytes) -> tuple[str, str]:
    """How one answer ended, and a line about it when it is not a plain success."""
    text = body.decode(errors="replace")
    if status == 200:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return Answer.UNANSWERED, f"200 stream cut short: {text[-200:]!r}"
        for event in events[:-1]:
            try:
                parsed = json.loads(event)
            except ValueError:
                return Answer.UNANSWERED, f"200 stream with a bad event: {event[:200]!r}"
            error = parsed.get("error") if isinstance(parsed, dict) else None
            if isinstance(error, dict) and error.get("type"):
                return Answer.REFUSED, f"in-stream error {error.get('type')}"
        return Answer.OK, ""
    if status in (429, 503) and headers.get("Retry-After"):
        return Answer.REFUSED, f"{status} {_error_type(text)}"
    return Answer.UNANSWERED, f"HTTP {status} without Retry-After: {text[:200]!r}"


def _error_type(text: str) -> str:
    """The ``error.type`` of an OpenAI-style error body (``?`` when there is none)."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return "?"
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else "?"


async def one_request(session: aiohttp.ClientSession, gateway: str, model: str, *,
                      timeout_s: float) -> tuple[str, str]:
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{gateway}/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            return classify(resp.status, dict(resp.headers), raw)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer.UNANSWERED, f"{type(exc).__name__}: {exc}"[:300]


Record = Callable[[str, str, str], None]
"""Told of every answer: (model, kind, detail)."""


def into_tally(tally: Tally) -> Record:
    return lambda model, kind, detail: tally.answer(kind, f"{model}: {detail}")


async def client_loop(session: aiohttp.ClientSession, gateways: Sequence[str],
                      models: Sequence[str], record: Record, stop: asyncio.Event, *,
                      rng: random.Random, timeout_s: float) -> None:
    """Alternate between ``models`` (each request through a random gateway) until
    ``stop``; a refused request is retried after its pause, as a well-behaved client does."""
    index = rng.randrange(len(models))
    while not stop.is_set():
        model = models[index % len(models)]
        kind, detail = await one_request(session, rng.choice(list(gateways)), model,
                                         timeout_s=timeout_s)
        record(model, kind, detail)
        if kind == Answer.REFUSED:
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        else:
            index += 1
