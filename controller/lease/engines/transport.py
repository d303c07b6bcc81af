"""The one place engine adapters make HTTP calls: timeouts, credentials, error mapping.

Every call runs on the controller's single ``aiohttp.ClientSession`` (owned by the caller)
under a total timeout and a connect timeout, reads at most :data:`MAX_ANSWER_BYTES` of the
answer, and turns every failure into an :class:`~controller.lease.engines.errors.EngineError`.

Credentials go where the engine (or rota's engine guard) reads them, and nowhere else:
the engine's API key as ``Authorization: Bearer`` on ``/v1*`` paths only (vLLM checks
``--api-key`` there and nowhere else), rota's control token of the endpoint's own claim in
:data:`~controller.lease.engines.base.CONTROL_TOKEN_HEADER` on control calls (vLLM ignores it;
the engine guard checks it), and with it the fences the endpoint is bound to, if any
(:data:`~rota.api.engine_guard.FENCE_HEADER`). A token not known yet is asked of its
source (the driver) before the call; when it cannot be had, the call is not sent and
fails as unreachable (``request_sent=False``): the engine could not be told anything.

Retries, all through :func:`rota.kit.aio.retry` (bounded, jittered):

- an idempotent read is tried again when no connection could be made, or when the
  server closed a kept-alive connection before answering;
- any other call (a control POST) is re-sent **once**, and only when the server closed
  the connection before answering anything: vLLM's uvicorn closes connections idle for
  5 s, and a pooled connection reused at that moment fails that way without the request
  having been read. The pool (:mod:`rota.kit.engine_connections`) lets go of idle
  connections before that moment comes; the re-send is for an engine that closes them
  sooner. A reset is not re-sent: it may come after the request was read.

A call sent again always goes on a new connection of its own: the idle connections to an
engine may all have been closed at the same moment.

A 500 with ``EngineDeadError``'s message becomes
:class:`~controller.lease.engines.errors.EngineDead`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from controller.lease.engines.base import CONTROL_TOKEN_HEADER, EngineEndpoint, Timeouts
from controller.lease.engines.errors import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    error_message,
    is_engine_dead,
    parse_json,
    truncate,
)
from rota.api.engine_guard import FENCE_HEADER, format_fences
from rota.kit.aio import Backoff, retry

__all__ = ["MAX_ANSWER_BYTES", "Answer", "EngineHttp", "api_key_path", "map_client_error"]

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 8 * 2**20
"""Answers longer than this are refused (a vLLM ``/metrics`` page is a few hundred KiB)."""
READ_ATTEMPTS = 3
"""Tries of an idempotent read that could not connect."""
READ_BACKOFF_S = 0.1
"""Pause before the second try of such a read; doubled before each later one."""
RESEND_PAUSE_S = 0.02
"""Pause before re-sending a control call whose kept-alive connection was closed."""
_API_KEY_PREFIXES = ("/v1", "/v2", "/inference")
DEV_ROUTES = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc",
                        "/reset_prefix_cache", "/pause", "/resume", "/is_paused"})
"""vLLM's development routes: served only with ``VLLM_SERVER_DEV_MODE=1`` (404 without)."""

_NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""No connection was made: the request never left."""


def api_key_path(path: str) -> bool:
    """True for the paths vLLM's ``--api-key`` guards (``/v1*``, ``/v2*``, ``/inference*``)."""
    return path.startswith(_API_KEY_PREFIXES)


@dataclass(frozen=True)
class Answer:
    """An engine's answer: status and body text."""

    status: int
    body: str

    def json(self, step: str) -> Any:
        """The body as JSON; :class:`EngineProtocolError` when it is not JSON (or nested too
        deep to parse)."""
        return parse_json(self.body, step=step, status=self.status)


def map_client_error(exc: Exception, *, step: str, timeout_s: float) -> EngineError:
    """The :class:`EngineError` for an aiohttp, socket or timeout failure of ``step``."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return EngineUnreachable(f"{step}: connect timed out ({exc})", step=step)
    if isinstance(exc, TimeoutError):
        return EngineTimeout(f"{step}: no answer within {timeout_s:g} s", step=step,
                             timeout_s=timeout_s)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return EngineUnreachable(f"{step}: connection lost mid-answer ({exc})", step=step,
                                 request_sent=True)
    sent = not isinstance(exc, aiohttp.ClientConnectorError)
    return EngineUnreachable(f"{step}: {type(exc).__name__}: {exc}", step=step,
                             request_sent=sent)


async def _read_limited(resp: aiohttp.ClientResponse) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await resp.content.readany():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise aiohttp.ClientPayloadError(f"answer longer than {MAX_ANSWER_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class EngineHttp:
    """HTTP calls to one engine."""

    def __init__(
        self, endpoint: EngineEndpoint, session: aiohttp.ClientSession, timeouts: Timeouts
    ) -> None:
        self.endpoint = endpoint
        self.session = session
        self.timeouts = timeouts

    def headers(self, path: str, *, token: str | None, control: bool = False
                ) -> dict[str, str]:
        """The credentials a call to ``path`` carries (see the module docstring);
        ``token``: the control token, for a control call; ``control``: a control call (it
        carries the endpoint's fences)."""
        headers: dict[str, str] = {}
        if api_key_path(path) and self.endpoint.api_key:
            headers["Authorization"] = f"Bearer {self.endpoint.api_key}"
        if token:
            headers[CONTROL_TOKEN_HEADER] = token
        if control and self.endpoint.fences:
            headers[FENCE_HEADER] = format_fences(dict(self.endpoint.fences))
        return headers

    async def _control_token(self, step: str) -> str | None:
        """This claim's control token; :class:`EngineUnreachable` (nothing sent) when its
        source cannot give it, however it fails (a gRPC error of any kind, a timeout, ...):
        the call is then not sent, so its outcome is known."""
        try:
            return await self.endpoint.control_token()
        except Exception as exc:  # any failure of the source: nothing was sent
            log.warning("no control token for the engine; the call is not sent",
                        extra=self.endpoint.log_fields() | {"step": step,
                                                            "error": str(exc)[:200]})
            raise EngineUnreachable(f"{step}: no control token for the engine ({exc})",
                                    step=step, request_sent=False) from exc

    async def _send(
        self, method: str, path: str, *, deadline: float, headers: Mapping[str, str],
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None, json_body: Any,
        fresh: bool = False,
    ) -> tuple[int, bytes]:
        """One attempt; ``fresh``: on a new connection of its own, never a pooled one."""
        if fresh:
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(force_close=True)) as session:
                return await self._send_on(session, method, path, deadline=deadline,
                                           headers=headers, params=params,
                                           json_body=json_body)
        return await self._send_on(self.session, method, path, deadline=deadline,
                                   headers=headers, params=params, json_body=json_body)

    async def _send_on(
        self, session: aiohttp.ClientSession, method: str, path: str, *, deadline: float,
        headers: Mapping[str, str],
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None, json_body: Any,
    ) -> tuple[int, bytes]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        timeout = aiohttp.ClientTimeout(
            total=remaining, sock_connect=min(self.timeouts.connect_s, remaining))
        async with session.request(
            method, self.endpoint.url(path), params=params, json=json_body,
            headers=dict(headers), timeout=timeout,
            allow_redirects=False,
        ) as resp:
            return resp.status, await _read_limited(resp)

    async def request(
        self,
        step: str,
        method: str,
        path: str,
        *,
        timeout_s: float,
        control: bool,
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        json_body: Any = None,
        accept: frozenset[int] = frozenset(),
        retry_unconnected: bool = False,
    ) -> Answer:
        """One call; 2xx (or a status in ``accept``) comes back, anything else raises.

        Args:
            step: the name of this call in errors, logs and timings.
            timeout_s: the whole call, connect to last byte, re-sends included.
            control: a control call: send rota's control token, if any.
            params: query parameters.
            json_body: a JSON body; None sends none.
            accept: non-2xx statuses to return instead of raising.
            retry_unconnected: also retry (bounded) when no connection could be made (only
                for idempotent reads).
        """
        if timeout_s <= 0:
            raise EngineTimeout(f"{step}: no time left in the budget", step=step, timeout_s=0.0)
        # The token first: asking the driver for it (bounded by its own timeout) is not the
        # engine's time, and a slow driver must not turn a call never sent into a timeout
        # (an unknown outcome for a sleep).
        token = await self._control_token(step) if control else None
        headers = self.headers(path, token=token, control=control)
        began = time.monotonic()
        deadline = began + timeout_s
        retry_on: tuple[type[BaseException], ...] = (aiohttp.ServerDisconnectedError,)
        backoff = Backoff(first_s=RESEND_PAUSE_S, max_s=RESEND_PAUSE_S, attempts=1)
        if retry_unconnected:
            retry_on += _NOT_CONNECTED
            backoff = Backoff(first_s=READ_BACKOFF_S, max_s=4 * READ_BACKOFF_S,
                              attempts=READ_ATTEMPTS - 1)

        attempts = 0

        def resent(exc: BaseException, pause_s: float) -> None:
            log.info("engine call sent again", extra=self.endpoint.log_fields() | {
                "step": step, "path": path, "error": repr(exc)[:200],
                "pause_s": round(pause_s, 3)})

        async def attempt() -> tuple[int, bytes]:
            # A call sent again goes on a new connection: the server may have closed
            # every idle connection at the same moment (uvicorn's keep-alive timeout),
            # and the pool would hand out the next closed one.
            nonlocal attempts
            attempts += 1
            return await self._send(method, path, deadline=deadline, headers=headers,
                                    params=params, json_body=json_body, fresh=attempts > 1)

        try:
            status, raw = await retry(
                attempt,
                retry_on=retry_on, backoff=backoff, on_retry=resent,
                transient=lambda _exc: deadline - time.monotonic() > 0)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = map_client_error(exc, step=step, timeout_s=timeout_s)
            log.info("engine call failed", extra=self.endpoint.log_fields() | {
                "step": step, "path": path, "error": str(error), "reason": error.reason,
                "seconds": round(time.monotonic() - began, 6)})
            raise error from exc
        body = raw.decode("utf-8", errors="replace")
        seconds = time.monotonic() - began
        log.debug("engine call", extra=self.endpoint.log_fields() | {
            "step": step, "path": path, "status": status, "seconds": round(seconds, 6)})
        if 200 <= status < 300 or status in accept:
            return Answer(status, body)
        message = truncate(error_message(body))
        if status == 404 and path in DEV_ROUTES:
            message = (f"{message} ({path} is one of vLLM's development routes: start the "
                       "engine with VLLM_SERVER_DEV_MODE=1)")
        if status == 500 and is_engine_dead(body):
            log.error("engine core is dead", extra=self.endpoint.log_fields() | {
                "step": step, "path": path, "detail": message})
            raise EngineDead(f"{step}: the engine core is dead (500 EngineDeadError): "
                             f"{message}; only a restart of its pod helps", step=step)
        rejected = EngineRejected(f"{step}: the engine answered {status}: {message}",
                                  step=step, status=status, body=body)
        log.info("engine refused a call", extra=self.endpoint.log_fields() | {
            "step": step, "path": path, "status": status, "reason": rejected.reason,
            "detail": message})
        raise rejected

    async def read(
        self, step: str, path: str, *, control: bool, accept: frozenset[int] = frozenset(),
        params: Sequence[tuple[str, str]] | None = None,
    ) -> Answer:
        """An idempotent GET under the status timeout, retried (bounded, with backoff) only
        when no connection could be made or a kept-alive one was closed."""
        return await self.request(step, "GET", path, timeout_s=self.timeouts.status_s,
                                  control=control, params=params, accept=accept,
                                  retry_unconnected=True)
