"""Unbuffered passthrough of one request to an engine, JSON and SSE alike.

The engine's status, body and (end-to-end) headers reach the client as they come: each
chunk read from the engine is written to the client at once, so a stream is never held back
and an error the engine sends inside a 200 stream passes through as it is. Non-2xx answers
pass through with their bodies, except one case: a 503 before anything reached the client
is handed back as :class:`Refused` (the engine is asleep or going to sleep: the request
lost its GPU and may be routed again), as is an engine that cannot be reached at all.

If the client leaves, the engine request is closed with it (the connection to the engine
is dropped, which is how vLLM learns to abort a generation); if the engine breaks mid-
answer, the client's connection is closed too, so it sees a truncated answer, never a
seemingly complete one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["Delivered", "Refused", "TokenSpotter", "forward", "read_bounded"]

log = logging.getLogger(__name__)

_REFUSAL_BODY_LIMIT = 64 * 1024
_SPOTTER_LIMIT = 256 * 1024
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "content-length", "server", "date",
    "set-cookie",
})
_PASSED_REQUEST_HEADERS = ("Accept", "traceparent", "tracestate", "OpenAI-Organization",
                           "OpenAI-Project")


@dataclass
class Delivered:
    """The engine's answer went (at least partly) to the client."""

    response: web.StreamResponse
    status: int
    complete: bool
    """False when the engine broke off mid-answer or the client left."""
    client_gone: bool = False


@dataclass
class Refused:
    """Nothing reached the client: the engine is unreachable (status None) or said 503."""

    status: int | None
    detail: str
    body: bytes = b""
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of a body (the rest is dropped with the connection)."""
    data = bytearray()
    while len(data) < limit:
        chunk = await resp.content.read(limit - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _has_text(event: bytes) -> bool:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            continue
        choices = obj.get("choices") if isinstance(obj, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict) and delta.get("content"):
                return True
            if choice.get("text"):
                return True
    return False


class TokenSpotter:
    """Finds the first server-sent event that carries generated text (time to first token)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        """True exactly once: for the chunk that completes the first event with text."""
        if self.done:
            return False
        self._buffer += chunk.replace(b"\r\n", b"\n")
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event = bytes(self._buffer[:end])
            del self._buffer[:end + 2]
            if _has_text(event):
                self.done = True
                self._buffer.clear()
                return True
        if len(self._buffer) > _SPOTTER_LIMIT:
            self.done = True  # not an event stream we understand; stop looking
            self._buffer.clear()
        return False


def _request_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",
               "X-Request-Id": request_id}
    for name in _PASSED_REQUEST_HEADERS:
        if name in request.headers:
            headers[name] = request.headers[name]
    return headers


def _response_headers(upstream: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in upstream.items() if k.lower() not in _HOP_BY_HOP)
    headers["X-Request-Id"] = request_id
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        headers["X-Accel-Buffering"] = "no"  # tell a buffering proxy in front to stand back
    return headers


async def forward(request: web.Request, session: aiohttp.ClientSession, url: str, *,
                  body: bytes, request_id: str, client_timeout: aiohttp.ClientTimeout,
                  on_first_byte: Callable[[], None], on_first_token: Callable[[], None],
                  log_extra: dict[str, str]) -> Delivered | Refused:
    """Send ``body`` to ``url`` and pass the answer to the client of ``request``."""
    try:
        upstream = await session.post(url, data=body, timeout=client_timeout,
                                      headers=_request_headers(request, request_id))
    except (aiohttp.ClientConnectionError, TimeoutError) as exc:
        return Refused(None, f"engine unreachable: {exc!r:.200}")
    finished = False
    try:
        if upstream.status == 503:
            try:
                raw = await read_bounded(upstream, _REFUSAL_BODY_LIMIT)
            except (aiohttp.ClientError, TimeoutError):
                raw = b""
            return Refused(503, "engine answered 503", raw,
                           _response_headers(upstream.headers, request_id))
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=_response_headers(upstream.headers, request_id))
        try:
            await response.prepare(request)
        except ConnectionError:
            return Delivered(response, upstream.status, complete=False, client_gone=True)
        spotter = TokenSpotter()
        first = True
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("engine broke off its answer; closing the client's connection",
                            extra=log_extra | {"error": repr(exc)[:200]})
                if request.transport is not None:
                    request.transport.close()
                return Delivered(response, upstream.status, complete=False)
            if not chunk:
                break
            if first:
                first = False
                on_first_byte()
            if spotter.feed(chunk):
                on_first_token()
            try:
                await response.write(chunk)
            except ConnectionError:
                return Delivered(response, upstream.status, complete=False, client_gone=True)
        finished = True
        try:
            await response.write_eof()
        except ConnectionError:
            return Delivered(response, upstream.status, complete=False, client_gone=True)
        return Delivered(response, upstream.status, complete=True)
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()  # drop the engine connection: it aborts the generation
