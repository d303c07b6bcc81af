"""The correctness probe: a real generation that proves a woken engine works.

A control call answering 200 proves nothing (an engine can answer a wake and then produce
garbage from stale weights or a stale prefix cache). So after every wake the controller
asks the engine a question, streamed, and accepts the engine only when all of these hold:

- HTTP 200 and no ``data: {"error": ...}`` chunk inside the stream (vLLM reports errors
  after the 200 that way): else ``http_error`` / ``stream_error``;
- the stream ends with ``data: [DONE]``: else ``no_done``;
- in ``answer`` mode (the default), the streamed content, with surrounding whitespace
  stripped, is the expected answer (the reference experiment's ``7`` unless the claim's
  ``probe.expect`` says otherwise), optionally followed by whitespace and sentence
  punctuation (``7.``, ``7!``, ``7。``); anything else, including markdown (``**7**``) or
  words (``The answer is 7``), is ``wrong_content``: the probe asks at temperature 0 for
  just that; in ``structure`` mode (models whose answer cannot be predicted) any
  non-empty content passes, and :attr:`ProbeResult.mode` says the probe checked only
  the stream's structure;
- a usage chunk with integer ``prompt_tokens``, ``completion_tokens`` and ``total_tokens``
  arrived: else ``no_usage``.

The prompt, the expected answer and the token budget come from the claim's ``probe``
section (:class:`rota.api.engine_config.ProbeConfig`): a reasoning model may put nothing in
``content`` within 8 tokens, so give it a budget, and with ``reasoningCounts`` its
``reasoning_content`` (``reasoning``) counts as content.

When several fail, the first in the order ``stream_error``, ``no_done``, ``wrong_content``,
``no_usage`` is reported. Time to first content token is measured from sending the
request; the whole probe is bounded by ``Timeouts.probe_total_s`` and the first token by
``Timeouts.probe_first_token_s`` (both give ``timeout``). A connection that cannot be made
gives ``unreachable``. A sleeping vLLM holds the probe (200 headers, then nothing): that is
a ``timeout``. The probe carries the engine's API key (``Authorization: Bearer``) when the
claim names one: vLLM's ``--api-key`` guards ``/v1*``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from controller.lease.engines.base import EngineEndpoint, Timeouts
from controller.lease.engines.errors import (
    EngineProtocolError,
    ProbeFailed,
    error_message,
    parse_json,
    truncate,
)
from controller.lease.engines.sse import SseParser
from controller.lease.engines.transport import api_key_path
from controller.lease.errors import LeaseControllerError
from rota.api.engine_config import (
    DEFAULT_PROBE_ANSWER,
    DEFAULT_PROBE_MAX_TOKENS,
    DEFAULT_PROBE_PROMPT,
    ProbeConfig,
)

__all__ = [
    "PROBE_MAX_TOKENS",
    "PROBE_QUESTION",
    "ProbeMode",
    "ProbeReason",
    "ProbeResult",
    "Usage",
    "content_is_correct",
    "probe_payload",
    "run_probe",
]

log = logging.getLogger(__name__)

PROBE_QUESTION = DEFAULT_PROBE_PROMPT
PROBE_MAX_TOKENS = DEFAULT_PROBE_MAX_TOKENS
"""Room for ``7``, punctuation and an end-of-sequence token; a long answer is wrong anyway."""
_TRAILING = r"[\s.,;:!\u3002\uff01]*"  # ASCII and CJK full stop and bang
_PROBE_PATH = "/v1/chat/completions"
_REASONING_FIELDS = ("reasoning_content", "reasoning")


class ProbeMode(enum.StrEnum):
    """What the probe checked: the answer, or only the stream's structure."""

    ANSWER = "answer"
    STRUCTURE = "structure"


class ProbeReason(enum.StrEnum):
    """Why a probe failed; stable labels (the controller's metrics add ``probe_``)."""

    WRONG_CONTENT = "wrong_content"
    NO_DONE = "no_done"
    NO_USAGE = "no_usage"
    STREAM_ERROR = "stream_error"
    TIMEOUT = "timeout"
    HTTP_ERROR = "http_error"
    UNREACHABLE = "unreachable"
    UNSUPPORTED_ENGINE = "unsupported_engine"
    """The engine's release or configuration is one rota cannot drive (found before any
    generation is sent: see :mod:`controller.lease.engines.dialect`)."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class ProbeResult:
    """The probe's verdict and measurements.

    Attributes:
        ok: the probe passed.
        mode: ``answer``, or ``structure`` when only the stream's structure was checked
            (state it next to a success: the engine's answers were not verified).
        reason: why it failed; None when it passed.
        content: the streamed content, concatenated (cut to 256 characters).
        ttft_s: request start to the first non-empty content token; None if none came.
        total_s: request start to the end of the probe.
        usage: the usage block, if a valid one arrived.
        status: the HTTP status, if an answer came.
        detail: a short explanation of a failure (engine error messages cut to 256 chars).
    """

    ok: bool
    mode: ProbeMode
    reason: ProbeReason | None
    content: str
    ttft_s: float | None
    total_s: float
    usage: Usage | None
    status: int | None = None
    detail: str = ""

    def raise_for_failure(self) -> None:
        """Raise :class:`~controller.lease.engines.errors.ProbeFailed` unless the probe passed."""
        if not self.ok:
            reason = self.reason or ProbeReason.HTTP_ERROR
            raise ProbeFailed(f"correctness probe failed ({reason}): {self.detail}",
                              probe_reason=reason.value)


def content_is_correct(content: str, expect: str = DEFAULT_PROBE_ANSWER) -> bool:
    """True for ``expect`` with only whitespace around it and punctuation after it."""
    return re.fullmatch(re.escape(expect) + _TRAILING, content.strip()) is not None


def probe_payload(model: str, *, max_tokens: int | None = None,
                  config: ProbeConfig | None = None) -> dict[str, Any]:
    """The probe's request body."""
    probe = config if config is not None else ProbeConfig()
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": probe.prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens if max_tokens is not None else probe.max_tokens,
    }
    if probe.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = dict(probe.chat_template_kwargs)
    return body


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _usage(raw: object) -> Usage | None:
    """A usage block with three non-negative integers (booleans and floats refused)."""
    if not isinstance(raw, dict):
        return None
    prompt = _count(raw.get("prompt_tokens"))
    completion = _count(raw.get("completion_tokens"))
    total = _count(raw.get("total_tokens"))
    if prompt is None or completion is None or total is None:
        return None
    return Usage(prompt, completion, total)


class _Stream:
    """What the probe has read so far."""

    def __init__(self, started: float, config: ProbeConfig) -> None:
        self.started = started
        self.config = config
        self.fields = ("content", *_REASONING_FIELDS) if (
            config.reasoning_counts or config.mode == "structure") else ("content",)
        self.parts: list[str] = []
        self.ttft_s: float | None = None
        self.usage: Usage | None = None
        self.bad_usage = False
        self.done = False
        self.error: str | None = None

    @property
    def content(self) -> str:
        return "".join(self.parts)

    def take(self, data: str, now: float) -> bool:
        """Take one event's data; True once the stream is decided (``[DONE]`` or an error)."""
        if data.strip() == "[DONE]":
            self.done = True
            return True
        try:
            chunk = parse_json(data, step="probe")
        except EngineProtocolError:
            self.error = f"a chunk is not JSON: {truncate(data, 80)!r}"
            return True
        if not isinstance(chunk, dict):
            self.error = f"a chunk is not a JSON object: {truncate(data, 80)!r}"
            return True
        if chunk.get("error") is not None:
            self.error = "the engine reported an error mid-stream: " + truncate(
                error_message(json.dumps({"error": chunk["error"]})))
            return True
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            for name in self.fields:
                text = delta.get(name)
                if isinstance(text, str) and text:
                    if self.ttft_s is None:
                        self.ttft_s = now - self.started
                    self.parts.append(text)
        if chunk.get("usage") is not None:
            usage = _usage(chunk["usage"])
            if usage is None:
                self.bad_usage = True
            else:
                self.usage = usage
        return False

    def take_all(self, events: list[str], now: float) -> bool:
        """Take events that arrived at ``now`` up to the one that decides the stream."""
        return any(self.take(data, now) for data in events)

    def verdict(self) -> tuple[ProbeReason | None, str]:
        if self.error is not None:
            return ProbeReason.STREAM_ERROR, self.error
        if not self.done:
            return ProbeReason.NO_DONE, "the stream ended without data: [DONE]"
        if self.config.mode == "structure":
            if not self.content.strip():
                return ProbeReason.WRONG_CONTENT, "the stream carried no content at all"
        elif not content_is_correct(self.content, self.config.expect):
            return ProbeReason.WRONG_CONTENT, (
                f"expected {truncate(self.config.expect, 40)!r}, got "
                f"{truncate(self.content, 80)!r}")
        if self.usage is None:
            what = "an invalid usage block" if self.bad_usage else "no usage block"
            return ProbeReason.NO_USAGE, f"the stream carried {what}"
        return None, ""


async def run_probe(
    session: aiohttp.ClientSession,
    endpoint: EngineEndpoint,
    timeouts: Timeouts,
    *,
    config: ProbeConfig | None = None,
    max_tokens: int | None = None,
) -> ProbeResult:
    """Send the correctness request to ``endpoint`` and judge the stream. Never raises for
    a failed probe (only on cancellation); see :meth:`ProbeResult.raise_for_failure`.

    Args:
        config: the claim's probe section; the reference question when None.
        max_tokens: overrides the token budget of ``config``.
    """
    probe = config if config is not None else ProbeConfig()
    mode = ProbeMode(probe.mode)
    loop = asyncio.get_running_loop()
    started = loop.time()
    first_deadline = started + min(timeouts.probe_first_token_s, timeouts.probe_total_s)
    total_deadline = started + timeouts.probe_total_s
    stream = _Stream(started, probe)
    headers = {"Accept": "text/event-stream"}
    if endpoint.api_key and api_key_path(_PROBE_PATH):
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    status: int | None = None
    reason: ProbeReason | None
    detail = ""
    try:
        async with asyncio.timeout_at(first_deadline) as deadline:
            async with session.post(
                endpoint.url(_PROBE_PATH),
                json=probe_payload(endpoint.model, max_tokens=max_tokens, config=probe),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
                allow_redirects=False,
            ) as resp:
                status = resp.status
                if status != 200:
                    body = (await resp.content.read(4096)).decode("utf-8", errors="replace")
                    raise _HttpError(f"the engine answered {status}: "
                                     f"{truncate(error_message(body))}")
                parser = SseParser()
                while True:
                    chunk = await resp.content.readany()
                    events = parser.feed(chunk) if chunk else parser.close()
                    decided = stream.take_all(events, loop.time())
                    if stream.ttft_s is not None:
                        deadline.reschedule(total_deadline)
                    if decided or not chunk:
                        break
        reason, detail = stream.verdict()
    except _HttpError as exc:
        reason, detail = ProbeReason.HTTP_ERROR, str(exc)
    except aiohttp.ConnectionTimeoutError as exc:
        reason, detail = ProbeReason.UNREACHABLE, f"connect timed out: {exc}"
    except TimeoutError:
        reason = ProbeReason.TIMEOUT
        if stream.ttft_s is None:
            detail = f"no content token within {timeouts.probe_first_token_s:g} s"
        else:
            detail = f"the stream did not finish within {timeouts.probe_total_s:g} s"
    except aiohttp.ClientPayloadError as exc:
        reason, detail = ProbeReason.NO_DONE, f"the stream broke off: {exc}"
    except (aiohttp.ClientError, OSError) as exc:
        if status is None:
            reason, detail = ProbeReason.UNREACHABLE, f"{type(exc).__name__}: {exc}"
        else:
            reason, detail = ProbeReason.NO_DONE, f"the stream broke off: {exc}"
    result = ProbeResult(
        ok=reason is None, mode=mode, reason=reason, content=truncate(stream.content),
        ttft_s=stream.ttft_s, total_s=loop.time() - started, usage=stream.usage,
        status=status, detail=detail,
    )
    fields = endpoint.log_fields() | {
        "ok": result.ok, "mode": mode.value, "reason": str(reason) if reason else None,
        "detail": detail,
        "ttft_s": result.ttft_s, "total_s": round(result.total_s, 6), "status": status}
    if result.ok:
        log.info("correctness probe passed", extra=fields)
    else:
        log.warning("correctness probe failed", extra=fields)
    return result


class _HttpError(LeaseControllerError):
    """The probe got a non-200 answer."""
