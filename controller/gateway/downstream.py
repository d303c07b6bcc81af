"""The client's side of one request: its answer, started exactly once.

Normally the answer starts with the engine's own status and headers, when the engine's
first bytes arrive, so nothing reaches the client before an engine really serves it (an
engine that holds a request, as vLLM does while asleep, sends 200 headers at once and then
nothing: the gateway does not pass those on until a byte follows).

A streamed request that has to wait — for a place, for a switch, for an engine that holds
it — would leave the client and every proxy in between looking at a silent connection for
as long as a switch takes. After ``keepalive_s`` of waiting the answer starts early instead:
``200`` with ``text/event-stream`` headers, then an SSE comment (``: rota: ...``, which
SSE clients, the OpenAI SDKs among them, skip) every ``keepalive_s`` until the engine's
first bytes follow in the same stream. From then on an error, the gateway's or the
engine's, can no longer change the status: it is sent the way vLLM sends errors inside a
stream, as ``data: {"error": {...}}`` followed by ``data: [DONE]``.

Whether the answer has begun is decided once, under the lock the keep-alive starts the
stream under (:meth:`Downstream.started_early`): the keep-alive is stopped first, never
inside its ``prepare()`` (a start broken off there leaves the connection's writer half set
up for a response that was never sent), and a start in progress is waited out. So a
refusal meets either nothing sent (and is an answer of its own) or a whole ``200`` head
(and is the stream's last events), never half of one.

A request held for a switch (:class:`Held`) carries what it was told in its answer's
headers, whichever answer that is (the engine's, the early stream's, a refusal):

- ``X-Rota-Switched: true``: the request waited for its model to be switched in (woken,
  or a switch to or from it under way) before an engine took it.
- ``X-Rota-Queue-Position``: switches ahead of its own on the GPU when it asked (0: its
  own was next), as the node's lease controller counted them.
- ``X-Rota-Expected-Wait-S``: seconds the controller expected the wait to take when it
  asked, from the switch costs it measured itself (the holder's sleep and drain, the
  model's wake and probe; the switches ahead included).
- ``X-Rota-Waited-S``: seconds the gateway held the request for the switch (absent from an
  early-started stream, whose head left before the wait ended).

The two expectations are absent where the controller gave none (an earlier release, or
the request waited for a switch another request had asked for).

Progress a person can see (opt-in per request, ``X-Rota-Progress: reasoning``, or per
model in the admin's model binding, :mod:`~controller.gateway.binding`; streamed chat
only): instead of each SSE comment, the early stream carries a ``chat.completion.chunk``
whose delta is ``reasoning_content`` (what chat UIs show as the model's thinking, as
llama-swap's loading state does), saying what the request waits for and the expected
wait; the model's real answer follows in the same stream. Off by default: plain SSE
comments, which every client skips. A request's header wins over its model's default
(``X-Rota-Progress: none`` turns it off for a model whose binding turns it on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from controller.gateway.errors import EngineRefused, GatewayError, error_body

__all__ = ["PROGRESS_HEADER", "Downstream", "Held"]

PROGRESS_HEADER = "X-Rota-Progress"
"""The request header that asks for visible progress (``reasoning``), for a comment when a
started stream is frozen (``1``, or ``reasoning``: :mod:`~controller.gateway.proxy`), or
for neither (``none``)."""

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_MAX_NOTE = 200


def _sse(payload: object) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _closing(error: dict[str, Any], dialect: str = "openai") -> bytes:
    """The last events of a stream: the error object ``error``, then ``[DONE]``; in
    Anthropic's dialect (``/v1/messages``) one ``event: error`` as vLLM sends it, whose
    data says ``"type": "error"``."""
    if dialect == "anthropic":
        data = json.dumps({"type": "error"} | error, separators=(",", ":"))
        return f"event: error\ndata: {data}\n\n".encode()
    return _sse(error) + _sse("[DONE]")


def _error_events(err: GatewayError, dialect: str = "openai") -> bytes:
    """``err`` as the last events of a stream: the error (with ``retry_after`` where it has
    one), then ``[DONE]`` (see :func:`_closing`)."""
    body = error_body(err.message, type_=err.type, code=err.code, param=err.param)
    if err.retry_after is not None:
        body["error"]["retry_after"] = str(max(1, round(err.retry_after)))
    return _closing(body, dialect)


@dataclass
class Held:
    """A request held for a switch, and what it was told (see the module)."""

    since: float
    """Event-loop time the hold began."""
    queue_position: int | None = None
    expected_wait_s: float | None = None
    ended: float | None = None
    """Event-loop time the hold ended (an engine took the request, or it was refused)."""

    def left_s(self, now: float) -> float | None:
        """Seconds of the expected wait still to come (None: nothing was expected)."""
        if self.expected_wait_s is None:
            return None
        return max(0.0, self.since + self.expected_wait_s - now)

    def waited_s(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.since

    def headers(self, now: float, *, waited: bool = True) -> dict[str, str]:
        out = {"X-Rota-Switched": "true"}
        if self.queue_position is not None:
            out["X-Rota-Queue-Position"] = str(self.queue_position)
        if self.expected_wait_s is not None:
            out["X-Rota-Expected-Wait-S"] = f"{self.expected_wait_s:.3f}"
        if waited:
            out["X-Rota-Waited-S"] = f"{self.waited_s(now):.3f}"
        return out

    def log_fields(self, now: float) -> dict[str, object]:
        """The access log's fields of a held request."""
        return {"switched": True, "queue_position": self.queue_position,
                "expected_wait_s": self.expected_wait_s,
                "waited_s": round(self.waited_s(now), 3)}


class Downstream:
    """The answer to one client."""

    def __init__(self, request: web.Request, request_id: str, *, stream: bool,
                 keepalive_s: float, progress_model: str | None = None,
                 dialect: str = "openai") -> None:
        self.request = request
        self.dialect = dialect
        """How errors are written inside the stream: ``openai`` or ``anthropic``."""
        self.progress_model = progress_model
        """Set (to the model's name) when the keep-alive sends visible progress, as
        ``reasoning_content`` chunks, instead of SSE comments."""
        self.request_id = request_id
        self.stream = stream
        self.keepalive_s = keepalive_s
        self.response: web.StreamResponse | None = None
        self.early = False
        """Started by the keep-alive (200, SSE) before any engine byte: set, with
        :attr:`response`, before that start's ``prepare()`` is awaited. Read it only once
        the keep-alive is stopped (:meth:`started_early`)."""
        self.note = "waiting"
        """What the request waits for, said in the keep-alive comments."""
        self.comments = 0
        self.held: Held | None = None
        """Set once the request waits for a switch: its answer's ``X-Rota-*`` headers."""
        self._engine = False
        self._stopped = False
        self._lock = asyncio.Lock()
        """Held by each tick (the early start and each comment) and by whatever ends it."""
        self._ticker: asyncio.Task[None] | None = None

    # -- keep-alive ---------------------------------------------------------------------

    def start_keepalive(self) -> None:
        """For a streamed request: start the answer early if the wait lasts."""
        if self.stream and self.keepalive_s > 0 and self._ticker is None:
            self._ticker = asyncio.create_task(self._tick(), name="sse-keepalive")

    async def _tick(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.keepalive_s)
                async with self._lock:
                    if self._engine or self._stopped:
                        return
                    if self.response is None:
                        headers = dict(_SSE_HEADERS) | {"X-Request-Id": self.request_id}
                        if self.held is not None:
                            headers |= self.held.headers(self._now(), waited=False)
                        # Begun from here: the head may reach the wire inside prepare().
                        self.response = web.StreamResponse(status=200, headers=headers)
                        self.early = True
                        await self.response.prepare(self.request)
                    note = self.note.replace("\n", " ")[:_MAX_NOTE]
                    if self.progress_model is not None:
                        await self.response.write(self._progress(note))
                    else:
                        await self.response.write(f": rota: {note}\n\n".encode())
                    self.comments += 1
        except ConnectionError:
            return  # the client left; its handler is being cancelled

    def _progress(self, note: str) -> bytes:
        """One progress event: a chat chunk whose delta is ``reasoning_content``."""
        text = f"rota: {note}"
        left = self.held.left_s(self._now()) if self.held is not None else None
        if left is not None:
            text += f" (about {left:.0f} s left)" if left >= 1 else " (any moment now)"
        delta: dict[str, str] = {"reasoning_content": text + "\n"}
        if self.comments == 0:
            delta = {"role": "assistant"} | delta
        return _sse({"id": f"chatcmpl-rota-{self.request_id}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": self.progress_model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def end_hold(self) -> None:
        """The wait for a switch is over (an engine takes the request now)."""
        if self.held is not None and self.held.ended is None:
            self.held.ended = self._now()

    def rota_headers(self) -> dict[str, str]:
        """The ``X-Rota-*`` headers of this answer (none for a request never held)."""
        return {} if self.held is None else self.held.headers(self._now())

    async def stop_keepalive(self) -> None:
        """Stop the keep-alive for good, waiting out a tick in progress (a tick is never
        cancelled inside its start or its write: only while it sleeps or waits its turn)."""
        ticker, self._ticker = self._ticker, None
        if ticker is None:
            return
        async with self._lock:
            self._stopped = True
            ticker.cancel()
        with suppress(asyncio.CancelledError):
            await ticker

    async def started_early(self) -> bool:
        """Stop the keep-alive (:meth:`stop_keepalive`), then whether it started the
        answer: then anything more, a refusal above all, can only go inside that stream
        (:meth:`fail`), never as an answer of its own."""
        await self.stop_keepalive()
        return self.early

    # -- the engine's answer ------------------------------------------------------------

    async def begin(self, status: int, reason: str | None, headers: CIMultiDict[str]
                    ) -> web.StreamResponse:
        """Start the answer with the engine's status and headers, or go on with the early
        stream (whose status and headers stay).

        Raises:
            ConnectionError: the client is gone.
        """
        async with self._lock:
            self._engine = True
        await self.stop_keepalive()
        if self.response is not None:
            return self.response
        headers = headers.copy()
        headers.update(self.rota_headers())
        response = web.StreamResponse(status=status, reason=reason, headers=headers)
        self.response = response
        await response.prepare(self.request)
        return response

    async def engine_error(self, status: int, body: bytes) -> None:
        """An engine's error answer (status >= 400) inside the early stream.

        Raises:
            ConnectionError: the client is gone.
        """
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        if not (isinstance(payload, dict) and isinstance(payload.get("error"), dict)):
            text = body[:512].decode(errors="replace") or f"HTTP {status}"
            refused = EngineRefused(text, status=status)
            payload = error_body(refused.message, type_=refused.type, code=refused.code)
        assert self.response is not None
        await self.response.write(_closing(payload, self.dialect))
        await self.response.write_eof()

    async def broken_off(self, err: GatewayError, *, at_event_boundary: bool) -> None:
        """The engine broke off an event stream mid-answer: end it with ``err`` as an
        error event and ``[DONE]``, so that the client is told why instead of finding its
        connection cut (an event it had only partly got is ended first, and fails its
        client's parse, as it must).

        Raises:
            ConnectionError: the client is gone.
        """
        assert self.response is not None
        ending = b"" if at_event_boundary else b"\n\n"
        await self.response.write(ending + _error_events(err, self.dialect))
        await self.response.write_eof()

    # -- the gateway's own refusal ------------------------------------------------------

    async def fail(self, err: GatewayError) -> web.StreamResponse:
        """End the early stream with ``err`` as an error event and ``[DONE]`` (only after
        :meth:`started_early` said it has begun)."""
        await self.stop_keepalive()
        assert self.response is not None
        assert self.early
        with suppress(ConnectionError):
            await self.response.write(_error_events(err, self.dialect))
            await self.response.write_eof()
        return self.response
