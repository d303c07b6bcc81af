"""The one place engine adapters make HTTP calls: timeouts, credentials, error mapping.

Every call runs on the controller's single ``aiohttp.ClientSession`` (owned by the caller)
under a total timeout and a connect timeout, sends the control credential only to control
endpoints, reads at most :data:`MAX_ANSWER_BYTES` of the answer, and turns every failure
into an :class:`~controller.engines.errors.EngineError`. Only idempotent reads are retried,
a bounded number of times, and only when no connection could be made.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from controller.engines.base import EngineEndpoint, Timeouts
from controller.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    error_message,
    truncate,
)

__all__ = ["MAX_ANSWER_BYTES", "Answer", "EngineHttp", "map_client_error"]

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 8 * 2**20
"""Answers longer than this are refused (a vLLM ``/metrics`` page is a few hundred KiB)."""
READ_ATTEMPTS = 3
"""Tries of an idempotent read that could not connect."""
READ_BACKOFF_S = 0.1
"""Pause before the second try of such a read; doubled before each later one."""


@dataclass(frozen=True)
class Answer:
    """An engine's answer: status and body text."""

    status: int
    body: str

    def json(self, step: str) -> Any:
        """The body as JSON; :class:`EngineProtocolError` when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise EngineProtocolError(
                f"{step}: the engine answered {self.status} with a body that is not JSON",
                step=step, body=self.body,
            ) from exc


def map_client_error(exc: Exception, *, step: str, timeout_s: float) -> EngineError:
    """The :class:`EngineError` for an aiohttp, socket or timeout failure of ``step``."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return EngineUnreachable(f"{step}: connect timed out ({exc})", step=step)
    if isinstance(exc, TimeoutError):
        return EngineTimeout(f"{step}: no answer within {timeout_s:g} s", step=step,
                             timeout_s=timeout_s)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return EngineUnreachable(f"{step}: connection lost mid-answer ({exc})", step=step)
    return EngineUnreachable(f"{step}: {type(exc).__name__}: {exc}", step=step)


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

    def _headers(self, control: bool) -> dict[str, str]:
        if control and self.endpoint.token:
            return {"Authorization": f"Bearer {self.endpoint.token}"}
        return {}

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
    ) -> Answer:
        """One call; 2xx (or a status in ``accept``) comes back, anything else raises.

        Args:
            step: the name of this call in errors, logs and timings.
            timeout_s: the whole call, connect to last byte.
            control: a control endpoint: send the bearer token, if any.
            params: query parameters.
            json_body: a JSON body; None sends none.
            accept: non-2xx statuses to return instead of raising.
        """
        if timeout_s <= 0:
            raise EngineTimeout(f"{step}: no time left in the budget", step=step, timeout_s=0.0)
        timeout = aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(self.timeouts.connect_s, timeout_s)
        )
        began = time.monotonic()
        try:
            async with self.session.request(
                method, self.endpoint.url(path), params=params, json=json_body,
                headers=self._headers(control), timeout=timeout, allow_redirects=False,
            ) as resp:
                raw = await _read_limited(resp)
                status = resp.status
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
        rejected = EngineRejected(f"{step}: the engine answered {status}: {message}",
                                  step=step, status=status, body=body)
        log.info("engine refused a call", extra=self.endpoint.log_fields() | {
            "step": step, "path": path, "status": status, "reason": rejected.reason,
            "detail": message})
        raise rejected

    async def read(
        self, step: str, path: str, *, control: bool, accept: frozenset[int] = frozenset()
    ) -> Answer:
        """An idempotent GET under the status timeout, retried (bounded, with backoff) only
        when no connection could be made."""
        delay = READ_BACKOFF_S
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return await self.request(step, "GET", path, timeout_s=self.timeouts.status_s,
                                          control=control, accept=accept)
            except EngineUnreachable:
                if attempt == READ_ATTEMPTS:
                    raise
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover
