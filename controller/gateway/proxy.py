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
- ``lost`` returned first (``lost_gpu``): the GPU's Lease settled without naming the
  engine awake (another holder, or an awake set without it), so the engine was put to
  sleep, and an engine that is asleep **holds** requests (vLLM sends 200 headers and then
  nothing until woken). The engine connection is dropped, which is how
  vLLM learns to abort a request.

An engine that took the request and then stays silent longer than the read timeout is not
asked again (it may still be generating): that is
:class:`~controller.gateway.errors.GatewayTimeout`.

If the client leaves, the engine request is closed with it. If the engine breaks mid-
answer, the client never sees a seemingly complete answer: an event stream ends with an
error event (``engine_broke_off``) and ``[DONE]``, as vLLM ends a stream whose generation
failed; any other answer, whose status and length went out already, has its connection
closed.

**Frozen answers** (:class:`Pacing`). An engine whose requests are kept across a sleep
(vLLM's ``mode=keep``) sends nothing while another model holds the GPU, for seconds. So
that the answer stays open and well-formed through that:

- An event stream is passed on **whole events** only: bytes after the last event boundary
  (a blank line) wait for the rest of their event (at most :data:`_PARTIAL_LIMIT`; an
  engine's chunks are whole events, so this costs nothing in practice). The client has
  therefore always read whole events, and whatever the gateway adds goes between them.
- While the engine sends nothing, a **heartbeat** (``: rota heartbeat``, an SSE comment,
  skipped by every SSE client) every ``heartbeat_s``, so that proxies and load balancers
  with idle timeouts keep the connection.
- When the GPU Lease shows the engine put to sleep while the answer is open (its awake
  set no longer names the answer's claim), the answer is **frozen** until the engine's next
  bytes; a client that asked (``X-Rota-Progress: 1``) is told with a comment
  ``: rota paused model=<m> for=<other model> expected_s=<x>``.
- The engine's **silence** is bounded by the read timeout the dispatcher gives (the
  ``--upstream-read-timeout-s`` plus the freeze the claim allows): past it an event stream
  ends with an error event (``upstream_timeout``) and ``[DONE]``.
- An engine that is **stopped** while the answer is open (its claim or pod gone, or its
  pod deleted while frozen: it will never be woken) ends an event stream at once with an
  error event (``engine_broke_off``, ``retry_after``) and ``[DONE]``, instead of a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Literal, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from controller.gateway.downstream import Downstream
from controller.gateway.errors import (
    Code,
    GatewayError,
    GatewayTimeout,
    RotaGatewayError,
    Unavailable,
)

__all__ = ["HEARTBEAT", "Delivered", "EngineView", "EngineWatch", "Pacing", "Refused",
           "TokenSpotter", "forward", "paused_note", "read_bounded"]

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

_PARTIAL_LIMIT = 256 * 1024
"""Bytes of an unfinished event held back at most (beyond: not an event stream we
understand, passed on as it comes)."""
_BOUNDARIES = (b"\n\n", b"\r\n\r\n", b"\r\r")
HEARTBEAT = b": rota heartbeat\n\n"
"""What a silent event stream gets every ``heartbeat_s``: an SSE comment."""

RefusalReason = Literal["unreachable", "http_503", "lost_gpu"]


def paused_note(model: str, other: str, expected_s: float) -> bytes:
    """The progress comment of a freeze: ``model``'s engine sleeps while ``other`` holds
    the GPU, for at most about ``expected_s``."""
    clean = [name.replace("\n", " ").replace("\r", " ") or "(none)" for name in (model, other)]
    return f": rota paused model={clean[0]} for={clean[1]} expected_s={expected_s:g}\n\n".encode()


@dataclass(frozen=True)
class EngineView:
    """What the routing state says of the engine an answer comes from."""

    frozen_at: int | None = None
    """Set while the engine is asleep with the answer kept: the GPU Lease's fence then."""
    frozen_for: str = ""
    """The model that holds the GPU meanwhile ("" when none)."""
    gone: str | None = None
    """Why the engine will never finish the answer (its claim or pod is gone)."""


class EngineWatch(Protocol):
    """The routing state's view of one answer's engine."""

    def view(self) -> EngineView:
        """What is known now."""

    async def changed(self) -> None:
        """Return once something the view is made from may have changed."""


def _ignore() -> None:
    return None


def _ignore_freeze(seconds: float | None) -> None:
    return None


@dataclass
class Pacing:
    """How a started answer is kept while its engine is silent (see the module)."""

    model: str = ""
    heartbeat_s: float = 0.0
    """0: no heartbeats."""
    progress: bool = False
    """The client asked to be told of freezes."""
    expected_freeze_s: float = 0.0
    """What a freeze is expected to last at most (the claim's longest freeze)."""
    watch: EngineWatch | None = None
    retry_after_s: Callable[[], float] = lambda: 1.0
    """When a client whose engine stopped should ask again."""
    on_heartbeat: Callable[[], None] = _ignore
    on_freeze: Callable[[float | None], None] = _ignore_freeze
    """Called with None when a freeze begins, with its seconds when it ends."""


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


class _Ended(RotaGatewayError):
    """Raised in the reader when the answer was ended beside it."""


def _streamed(downstream: Downstream, upstream: aiohttp.ClientResponse) -> bool:
    """The client's answer is an event stream (its own engine's, or the early one)."""
    return downstream.early or (
        upstream.status == 200
        and upstream.headers.get("Content-Type", "").startswith("text/event-stream"))


def _last_boundary(data: bytes | bytearray) -> int:
    """The end of the last whole event in ``data`` (0: none)."""
    ends = [at + len(mark) for mark in _BOUNDARIES if (at := data.rfind(mark)) >= 0]
    return max(ends, default=0)


class _Relay:
    """Passes one started answer from the engine to the client (see the module)."""

    def __init__(self, downstream: Downstream, upstream: aiohttp.ClientResponse,
                 response: web.StreamResponse, pacing: Pacing, silence_s: float | None,
                 on_first_token: Callable[[], None], log_extra: dict[str, str]) -> None:
        self.downstream = downstream
        self.upstream = upstream
        self.response = response
        self.pacing = pacing
        self.silence_s = silence_s
        self.on_first_token = on_first_token
        self.log_extra = log_extra
        self.streamed = _streamed(downstream, upstream)
        self.spotter = TokenSpotter()
        self.partial = bytearray()
        """Bytes of an event not yet whole (event streams only), held back."""
        self.at_boundary = True
        """The client has read whole events only (nothing of an event is pending)."""
        self.frozen_since: float | None = None
        self.frozen_fence: int | None = None
        self.spoke = False
        """The engine sent bytes since the freeze began."""
        self.last_sent = self._now()
        self.lock = asyncio.Lock()
        """Held by whatever writes to the client: the reader and the pacer."""
        self.ended = False
        """The pacer ended the answer (an error event, or the client left)."""
        self.client_gone = False

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def run(self, first: bytes) -> Delivered:
        """Relay ``first`` and the rest; Delivered says how it ended."""
        try:
            return await self._relay(first)
        except ConnectionError:
            return self._delivered(complete=False, client_gone=True)
        finally:
            self._thaw()

    def _delivered(self, *, complete: bool, client_gone: bool = False) -> Delivered:
        return Delivered(self.response, self.upstream.status, complete=complete,
                         client_gone=client_gone)

    async def _relay(self, chunk: bytes) -> Delivered:
        """Read the engine and pass on what it sends; a pacer (:meth:`_pace`) beside it
        writes heartbeats and acts on the engine's view, under :attr:`lock`."""
        pacer = None
        if self.pacing.watch is not None or self._beat_in() is not None:
            pacer = asyncio.create_task(self._pace(), name="stream-pacer")
        try:
            while chunk:
                async with self.lock:
                    if self.ended:
                        break
                    await self._pass(chunk)
                try:
                    chunk = await self.upstream.content.readany()
                except _Ended:
                    break
                except (aiohttp.ClientError, TimeoutError) as exc:
                    await self._stop(pacer)
                    if not self.ended:
                        await self._broken_off(exc)
                    return self._delivered(complete=False)
        finally:
            await self._stop(pacer)
        if self.ended:
            return self._delivered(complete=False, client_gone=self.client_gone)
        if self.partial:
            await self.response.write(bytes(self.partial))  # the engine's last bytes as sent
            self.partial.clear()
        await self.response.write_eof()
        return self._delivered(complete=True)

    async def _stop(self, pacer: asyncio.Task[None] | None) -> None:
        """Stop the pacer, never inside what it writes (it is cancelled only while it
        waits)."""
        if pacer is None or pacer.done():
            return
        async with self.lock:
            pacer.cancel()
        with suppress(asyncio.CancelledError):
            await pacer

    async def _pace(self) -> None:
        """Heartbeats while the engine is silent; the engine's view acted on as it
        changes. Ends the relay (:meth:`_end_relay`) when the answer was ended here."""
        watch = self.pacing.watch
        watcher: asyncio.Future[None] | None = None
        try:
            while not self.ended:
                if watch is not None and watcher is None:
                    watcher = asyncio.ensure_future(watch.changed())
                beat_in = self._beat_in()
                if watcher is None:
                    await asyncio.sleep(beat_in or 0.0)
                else:
                    await asyncio.wait({watcher}, timeout=beat_in)
                async with self.lock:
                    if self.ended:
                        return
                    if watcher is not None and watcher.done():
                        watcher.result()
                        watcher = None
                        assert watch is not None
                        if not await self._judge(watch.view()):
                            self._end_relay()
                            return
                    elif (due := self._beat_in()) is not None and due <= 0:
                        await self._heartbeat()
        except ConnectionError:
            self.client_gone = True
            self._end_relay()
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()

    def _end_relay(self) -> None:
        """The answer was ended beside the reader: wake it (its read raises :class:`_Ended`)."""
        self.ended = True
        self.upstream.content.set_exception(_Ended())

    async def _pass(self, chunk: bytes) -> None:
        """Pass the engine's bytes on (an event stream's whole events only)."""
        if self.frozen_since is not None:
            self.spoke = True
            watch = self.pacing.watch
            if watch is None or watch.view().frozen_at is None:
                self._thaw()  # (bytes still in flight when the freeze began do not end it)
        if self.spotter.feed(chunk):
            self.on_first_token()
        if not self.streamed:
            out = chunk
        else:
            self.partial += chunk
            cut = _last_boundary(self.partial)
            if len(self.partial) > _PARTIAL_LIMIT:
                cut = len(self.partial)  # not events we understand: pass it as it is
            out = bytes(self.partial[:cut])
            del self.partial[:cut]
            if out:
                self.at_boundary = _last_boundary(out) == len(out)
        if out:
            await self.response.write(out)
            self.last_sent = self._now()

    def _beat_in(self) -> float | None:
        """Seconds until the next heartbeat is due (None: never)."""
        if not (self.streamed and self.pacing.heartbeat_s > 0):
            return None
        return max(0.0, self.last_sent + self.pacing.heartbeat_s - self._now())

    async def _heartbeat(self) -> None:
        """The engine sent nothing for ``heartbeat_s``: a comment, between two events."""
        if not self.at_boundary:
            self.last_sent = self._now()  # mid-event (an engine out of step): skip one
            return
        await self.response.write(HEARTBEAT)
        self.last_sent = self._now()
        self.pacing.on_heartbeat()

    async def _judge(self, view: EngineView) -> bool:
        """Act on a new view of the engine; False when the answer was ended for it."""
        if view.gone is not None:
            await self._engine_gone(view.gone)
            return False
        if view.frozen_at is None:
            if self.spoke:
                self._thaw()  # the engine spoke before this gateway saw it woken
            return True
        if view.frozen_at == self.frozen_fence:
            return True
        self.frozen_fence = view.frozen_at
        if self.frozen_since is None:
            self.frozen_since = self._now()
            self.spoke = False
            self.pacing.on_freeze(None)
            log.info("engine put to sleep with the answer kept", extra=self.log_extra | {
                "for_model": view.frozen_for})
        if self.streamed and self.pacing.progress and self.at_boundary:
            await self.response.write(paused_note(self.pacing.model, view.frozen_for,
                                                  self.pacing.expected_freeze_s))
            self.last_sent = self._now()
        return True

    def _thaw(self) -> None:
        """The engine was woken and sent bytes again (or the answer ended): a freeze is
        over."""
        if self.frozen_since is not None:
            self.pacing.on_freeze(self._now() - self.frozen_since)
            self.frozen_since = None

    async def _engine_gone(self, why: str) -> None:
        frozen = self.frozen_since is not None
        log.warning("the engine of an answer in progress stopped", extra=self.log_extra | {
            "reason": why, "frozen": frozen})
        await self._end(Unavailable(
            f"The engine serving this answer stopped ({why}) while the answer was "
            f"{'frozen for another model' if frozen else 'in progress'}; the answer is "
            "incomplete. Ask again.", code=Code.ENGINE_BROKE_OFF,
            retry_after=self.pacing.retry_after_s()))

    async def _broken_off(self, exc: BaseException) -> None:
        """The engine broke off its answer, or stayed silent past the read timeout."""
        err: GatewayError
        if isinstance(exc, TimeoutError):
            limit = f"{self.silence_s:g}" if self.silence_s is not None else "too many"
            err = GatewayTimeout(
                f"The engine sent nothing more for {limit} seconds (the read timeout plus "
                "the longest freeze its claim allows); the answer is incomplete.",
                code=Code.UPSTREAM_TIMEOUT)
            err.retry_after = self.pacing.retry_after_s()
        else:
            err = Unavailable(
                f"The engine broke off its answer ({type(exc).__name__}); the answer is "
                "incomplete. Ask again.", code=Code.ENGINE_BROKE_OFF, retry_after=1)
        log.warning("engine broke off its answer", extra=self.log_extra | {
            "error": repr(exc)[:200], "code": err.code,
            "ending": "error event" if self.streamed else "connection cut"})
        await self._end(err)

    async def _end(self, err: GatewayError) -> None:
        """End the answer early: an event stream with ``err`` as an error event and
        ``[DONE]`` after its last whole event (an unfinished one is dropped); anything
        else, whose status and length were sent already, can only be cut."""
        if self.streamed:
            self.partial.clear()
            with suppress(ConnectionError):
                await self.downstream.broken_off(err, at_event_boundary=self.at_boundary)
                return
        transport = self.downstream.request.transport
        if transport is not None:
            transport.close()


async def forward(downstream: Downstream, session: aiohttp.ClientSession, url: str, *,
                  body: bytes, request_id: str, client_timeout: aiohttp.ClientTimeout,
                  engine_key: str | None = None, content_type: str = "application/json",
                  lost: Callable[[], Awaitable[str]] | None = None,
                  on_first_byte: Callable[[], None], on_first_token: Callable[[], None],
                  log_extra: dict[str, str], pacing: Pacing | None = None
                  ) -> Delivered | Refused:
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
        if opened.first:
            on_first_byte()
        relay = _Relay(downstream, upstream, response, pacing or Pacing(),
                       client_timeout.sock_read, on_first_token, log_extra)
        delivered = await relay.run(opened.first)
        finished = delivered.complete
        return delivered
    finally:
        if finished:
            upstream.release()
        else:
            with suppress(Exception):
                upstream.close()  # drop the engine connection: it aborts the generation
