"""Unbuffered passthrough of one request to an engine, JSON and SSE alike.

The engine's status, body and (end-to-end) headers reach the client as they come: each
chunk read from the engine is written to the client at once, so a stream is never held back
and an error the engine sends inside a 200 stream passes through as it is. The answer to
the client starts only with the engine's first body bytes
(:class:`~controller.gateway.downstream.Downstream`).

Until then the request may still be routed again, and :class:`Refused` says why:

- the engine could not be reached, or dropped the connection before answering
  (``unreachable``);
- it answered 503 (``http_503``: an engine that refuses while asleep);
- ``lost`` returned first (``lost_gpu``): the GPU's Lease settled with another holder, so
  the engine was put to sleep, and an engine that is asleep **holds** requests (vLLM sends
  200 headers and then nothing until woken). The engine connection is dropped, which is how
  vLLM learns to abort a request.

An engine that took the request and then stays silent longer than the read timeout is not
asked again (it may still be generating): that is
:class:`~controller.gateway.errors.GatewayTimeout`.

If the client leaves, the engine request is closed with it. If the engine breaks mid-
answer, the client never sees a seemingly complete answer: an event stream ends with an
error event (``engine_broke_off``) and ``[DONE]``, as vLLM ends a stream whose generation
failed; any other answer, whose status and length went out already, has its connection
closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from controller.gateway.downstream import Downstream
from controller.gateway.errors import Code, GatewayTimeout, Unavailable

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

RefusalReason = Literal["unreachable", "http_503", "lost_gpu"]


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
    """Nothing of the engine's answer reached the client; the request may go elsewhere."""

    reason: RefusalReason
    detail: str
    status: int | None = None
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
        if isinstance(obj, dict) and obj.get("type") == "response.output_text.delta":
            return True  # the Responses API's stream
        delta = obj.get("delta") if isinstance(obj, dict) else None
        if obj.get("type") == "content_block_delta" and isinstance(delta, dict) and (
                delta.get("text") or delta.get("thinking")):
            return True  # Anthropic's Messages stream (/v1/messages)
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


def _request_headers(request: web.Request, request_id: str, engine_key: str | None,
                     content_type: str) -> dict[str, str]:
    headers = {"Content-Type": content_type, "Accept-Encoding": "identity",
               "X-Request-Id": request_id}
    for name in _PASSED_REQUEST_HEADERS:
        if name in request.headers:
            headers[name] = request.headers[name]
    if engine_key:
        headers["Authorization"] = f"Bearer {engine_key}"
    return headers


def _response_headers(upstream: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in upstream.items() if k.lower() not in _HOP_BY_HOP)
    headers["X-Request-Id"] = request_id
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        headers["X-Accel-Buffering"] = "no"  # tell a buffering proxy in front to stand back
    return headers


@dataclass
class _Opened:
    upstream: aiohttp.ClientResponse
    first: bytes
    """The first body bytes (empty: the body is empty), or the 503's body."""


async def _open(session: aiohttp.ClientSession, url: str, *, body: bytes,
                headers: dict[str, str], limits: aiohttp.ClientTimeout) -> _Opened:
    upstream = await session.post(url, data=body, timeout=limits, headers=headers)
    try:
        if upstream.status == 503:
            try:
                raw = await read_bounded(upstream, _REFUSAL_BODY_LIMIT)
            except (aiohttp.ClientError, TimeoutError):
                raw = b""
            return _Opened(upstream, raw)
        return _Opened(upstream, await upstream.content.readany())
    except BaseException:
        upstream.close()
        raise


async def _first_of(opening: Awaitable[_Opened],
                    lost: Callable[[], Awaitable[str]] | None) -> _Opened | str:
    """The engine's first bytes, or ``lost``'s reason if that comes first."""
    opener = asyncio.ensure_future(opening)
    if lost is None:
        return await opener
    watcher = asyncio.ensure_future(lost())
    try:
        await asyncio.wait({opener, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (opener, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(opener, watcher, return_exceptions=True)
    if opener.cancelled():
        return watcher.result()
    failure = opener.exception()
    if failure is None:
        return opener.result()
    if watcher.done() and not watcher.cancelled():
        return watcher.result()  # lost anyway: route again rather than report the failure
    raise failure


async def _broken_off(downstream: Downstream, upstream: aiohttp.ClientResponse, tail: bytes,
                      exc: BaseException, log_extra: dict[str, str]) -> None:
    """The engine broke off its answer: an event stream (200) ends with an error event
    the client can read; anything else, whose status and length were sent already, can
    only be cut."""
    streamed = downstream.early or (
        upstream.status == 200
        and upstream.headers.get("Content-Type", "").startswith("text/event-stream"))
    log.warning("engine broke off its answer", extra=log_extra | {
        "error": repr(exc)[:200], "ending": "error event" if streamed else "connection cut"})
    if streamed:
        with suppress(ConnectionError):
            await downstream.broken_off(Unavailable(
                f"The engine broke off its answer ({type(exc).__name__}); the answer is "
                "incomplete. Ask again.", code=Code.ENGINE_BROKE_OFF, retry_after=1),
                at_event_boundary=tail.endswith((b"\n\n", b"\r\n\r\n")))
            return
    transport = downstream.request.transport
    if transport is not None:
        transport.close()


async def forward(downstream: Downstream, session: aiohttp.ClientSession, url: str, *,
                  body: bytes, request_id: str, client_timeout: aiohttp.ClientTimeout,
                  engine_key: str | None = None, content_type: str = "application/json",
                  lost: Callable[[], Awaitable[str]] | None = None,
                  on_first_byte: Callable[[], None], on_first_token: Callable[[], None],
                  log_extra: dict[str, str]) -> Delivered | Refused:
    """Send ``body`` to ``url`` and pass the answer to ``downstream``'s client.

    Raises:
        GatewayTimeout: the engine took the request and did not answer in time.
    """
    request = downstream.request
    try:
        opened = await _first_of(_open(session, url, body=body, limits=client_timeout,
                                       headers=_request_headers(request, request_id,
                                                                engine_key, content_type)),
                           lost)
    except aiohttp.SocketTimeoutError:
        raise GatewayTimeout(
            f"The engine took the request but sent nothing for "
            f"{client_timeout.sock_read:g} seconds; it was not sent again.",
            code=Code.UPSTREAM_TIMEOUT) from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Refused("unreachable", f"engine unreachable: {exc!r:.200}")
    if isinstance(opened, str):
        return Refused("lost_gpu", f"the engine lost its GPU before answering ({opened})")
    upstream = opened.upstream
    finished = False
    try:
        if upstream.status == 503:
            return Refused("http_503", "engine answered 503", 503, opened.first,
                           _response_headers(upstream.headers, request_id))
        try:
            response = await downstream.begin(upstream.status, upstream.reason,
                                              _response_headers(upstream.headers, request_id))
            if downstream.early and upstream.status >= 400:
                rest = await read_bounded(upstream, _REFUSAL_BODY_LIMIT)
                await downstream.engine_error(upstream.status, opened.first + rest)
                finished = True
                return Delivered(response, upstream.status, complete=True)
        except ConnectionError:
            return Delivered(downstream.response or web.StreamResponse(), upstream.status,
                             complete=False, client_gone=True)
        spotter = TokenSpotter()
        chunk = opened.first
        tail = b""
        if chunk:
            on_first_byte()
        while chunk:
            if spotter.feed(chunk):
                on_first_token()
            try:
                await response.write(chunk)
            except ConnectionError:
                return Delivered(response, upstream.status, complete=False, client_gone=True)
            tail = (tail + chunk)[-4:]
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                await _broken_off(downstream, upstream, tail, exc, log_extra)
                return Delivered(response, upstream.status, complete=False)
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
            with suppress(Exception):
                upstream.close()  # drop the engine connection: it aborts the generation
