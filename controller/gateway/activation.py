"""Client of the lease controllers' activation API: "make this claimant the awake one".

``POST <activation-url>/v1/activate`` with :class:`~rota.api.activation.ActivateRequest`
and the bearer token from the mounted Secret. The controller answers once the claimant
holds its GPU (200, :class:`~rota.api.activation.ActivateAnswer`: the fencing number,
no address) or with an error code (:data:`~rota.api.activation.ERRORS`, with
Retry-After): a failed switch, or "ask again" (a standby, a stopping instance, a switch
cut short: the node's next leader answers), which the dispatcher does after Retry-After
while the request's deadline allows. The code decides, by the contract's table, whatever
the status it came with; a code the table does not know is "ask again" only with a 409.
An answer means only "done": where to send the request is decided again from what this
gateway watches (the claimant's pod IP, the GPU Lease). The controller serialises
switches per GPU and lets concurrent callers share one switch; this replica also shares
one call among its own requests for the same (controller, model, claim), which only saves
connections: every replica may call, and correctness rests on the controller and its Lease.

While a request waits, :meth:`Activator.expect` reads the controller's ``GET /v1/state``
once (bounded by the connect timeout) for the claimant's expected switch, as the
controller measured it (``expected_switch_s``, ``queue_position``, ``expected_wait_s``):
what the dispatcher tells the held clients. A controller of an earlier release sends none
of them: then nothing is promised. The last expectation of each model is kept for
``/v1/models`` (:meth:`Activator.expected_wake_s`).

A call nobody waits for is cancelled: when every request sharing a call was cancelled
(its client disconnected) before the answer, the call's connection is closed, so the
controller sees its caller gone and drops the switch if its wake has not begun. A request
whose own deadline passes leaves the call running (it was told when to come back).

A call that cannot reach the controller is retried a bounded number of times with
jittered backoff (:class:`rota.kit.aio.Backoff`); connecting has its own short timeout, so a
controller whose address does not answer costs seconds, not the request's whole wait; the
dispatcher then counts that controller lost until its Lease changes
(:meth:`~controller.gateway.routing.RoutingState.unreachable`). A refusal is not retried
here: it becomes :class:`ActivationFailed` carrying the controller's reason and
Retry-After (``refused`` when the code says "ask again").
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError

from controller.credentials import SecretFile
from controller.gateway.errors import Code, Unavailable
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.proxy import read_bounded
from rota.api.activation import (
    ERRORS,
    PATH,
    STATE_PATH,
    SWITCH_FAILURE_REASONS,
    ActivateAnswer,
    ActivateRequest,
    ErrorBody,
    StateAnswer,
    asks_again,
)
from rota.kit.aio import Backoff

__all__ = ["ACTIVATION_CODES", "KNOWN_OUTCOMES", "ActivationFailed", "Activator",
           "Expectation"]

log = logging.getLogger(__name__)

_MAX_ANSWER = 64 * 1024
_MAX_STATE = 1024 * 1024
_BACKOFF_S = 0.2
_BACKOFF_MAX_S = 2.0
_UNSAFE = re.compile(r"[^a-z0-9_]")

ACTIVATION_CODES = frozenset({
    Code.CONTROLLER_UNREACHABLE, Code.BAD_ACTIVATION_REQUEST, Code.BAD_ACTIVATION_ANSWER,
    Code.ACTIVATION_UNAUTHORIZED, Code.ACTIVATION_HTTP_4XX, Code.ACTIVATION_HTTP_5XX,
    Code.ACTIVATION_HTTP_OTHER, Code.OTHER})
"""The gateway's own codes for an activation that failed (``other``: anything a controller
may say that is not in :data:`KNOWN_OUTCOMES`)."""

KNOWN_OUTCOMES = frozenset({
    # Answers of the gateway itself.
    "switched", "already_awake", "error", *ACTIVATION_CODES,
    # Every error code of the activation API's contract, every reason a switch may fail
    # with, and "fenced" (an earlier release's).
    *ERRORS, *SWITCH_FAILURE_REASONS, "fenced",
})
"""Every value an activation's outcome (a metric label and the client's error code) takes:
a controller's answer names its reason freely, so anything not listed here is ``other``
(the reason itself stays in the error message)."""


@dataclass(frozen=True)
class Expectation:
    """What the controller expects of a switch to one claimant (its ``/v1/state``)."""

    queue_position: int | None
    """Switches ahead of it on its GPU."""
    expected_wait_s: float | None
    """Seconds until it is expected to serve (the switches ahead included)."""
    expected_switch_s: float | None
    """Seconds its own switch is expected to take (0: it is awake)."""


class ActivationFailed(Unavailable):
    """The controller could not or would not make the model serve (503 to the client).

    ``refused`` marks an answer whose code means "ask again"
    (:func:`rota.api.activation.asks_again`: another instance acts for the node, this
    one is stopping, the switch was cut short, or a policy declined for now) rather than a
    failed switch; a caller with time left may ask again after ``retry_after``.
    """

    def __init__(self, message: str, *, code: str, retry_after: float | None,
                 refused: bool = False) -> None:
        super().__init__(message, code=code, retry_after=retry_after)
        # A controller's code names its own API's answer (its ``not_found`` was a 404 of
        # the controller's): to the client it is a 503 whatever the gateway's table says.
        self.status, self.type = Unavailable.status, Unavailable.type
        self.refused = refused


def _retry_after(value: str | None, default: float | None) -> float | None:
    """The controller's Retry-After, else ``default``."""
    try:
        return max(1.0, float(value)) if value else default
    except ValueError:
        return default


def _cleaned(value: str) -> str:
    return _UNSAFE.sub("_", value.lower())[:48].strip("_")


def _label(value: str) -> str:
    """A reason from the controller as a metric label and error code: one of
    :data:`KNOWN_OUTCOMES`."""
    cleaned = _cleaned(value)
    return cleaned if cleaned in KNOWN_OUTCOMES else Code.OTHER


def _http_label(status: int) -> str:
    if 400 <= status <= 499:
        return Code.ACTIVATION_HTTP_4XX
    return Code.ACTIVATION_HTTP_5XX if 500 <= status <= 599 else Code.ACTIVATION_HTTP_OTHER


def _error_of(payload: Any) -> tuple[str | None, str | None]:
    try:
        body = ErrorBody.model_validate(payload)
    except ValidationError:
        return None, None
    return body.error.type or None, body.error.message or None


class Activator:
    """Calls controllers' activation APIs on one shared ``ClientSession``."""

    def __init__(self, session: aiohttp.ClientSession, token: SecretFile | None, *,
                 timeout_s: float, connect_timeout_s: float, attempts: int,
                 metrics: GatewayMetrics, retry_after: float | None = None) -> None:
        """``retry_after``: what a refusal the controller gave no Retry-After for says
        (None, as the gateway runs it: the dispatcher says when to come back, from the
        switch costs measured, :meth:`~controller.gateway.dispatch.Dispatcher.retry_after_s`)."""
        self._session = session
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s,
                                              sock_connect=connect_timeout_s)
        self._attempts = attempts
        self._retry_after = retry_after
        self._metrics = metrics
        self._calls: dict[tuple[str, str, str], asyncio.Task[ActivateAnswer]] = {}
        self._waiters: dict[tuple[str, str, str], int] = {}
        self._state_timeout = aiohttp.ClientTimeout(total=connect_timeout_s)
        self._expected: dict[str, float] = {}
        """By model: the last expected switch a controller gave while it was asleep."""

    async def activate(self, url: str, model: str, claim: str, *, deadline: float,
                       request_id: str = "") -> ActivateAnswer:
        """Ask the controller at ``url`` to make ``claim`` serve ``model``; wait until
        ``deadline`` (event-loop time) at most.

        Raises:
            ActivationFailed: the controller refused, failed the switch, or was unreachable.
            Unavailable: the deadline passed first (the switch goes on without us).
        """
        key = (url, model, claim)
        call = self._calls.get(key)
        if call is None:
            call = asyncio.create_task(self._call(url, model, claim, request_id),
                                       name=f"activate {model}")
            self._calls[key] = call
            call.add_done_callback(lambda done: self._finished(key, done))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(call)
        except TimeoutError:
            raise Unavailable(f"Waited too long for model '{model}' to be woken.",
                              code=Code.SWITCH_TIMEOUT, retry_after=self._retry_after) from None
        except asyncio.CancelledError:
            # This request's client left. The last one to leave closes the call: the
            # controller sees its caller gone and drops a switch whose wake has not begun.
            if self._waiters.get(key, 0) <= 1 and not call.done():
                log.info("every request waiting for this activation left; cancelling it",
                         extra={"model": model, "claim": claim, "upstream": url,
                                "request_id": request_id})
                call.cancel()
                # A request for the same switch from now on starts a call of its own,
                # never joins this one as it ends cancelled.
                if self._calls.get(key) is call:
                    del self._calls[key]
            raise
        finally:
            left = self._waiters.get(key, 0) - 1
            if left > 0:
                self._waiters[key] = left
            else:
                self._waiters.pop(key, None)

    async def expect(self, url: str, model: str, claim: str) -> Expectation | None:
        """The controller's expectation of a switch to ``claim`` (None: it said nothing,
        or could not be asked within the connect timeout)."""
        try:
            async with self._session.get(f"{url}{STATE_PATH}", headers=self._headers(""),
                                         timeout=self._state_timeout) as resp:
                if resp.status != 200:
                    return None
                state = StateAnswer.model_validate_json(await read_bounded(resp, _MAX_STATE))
        except (aiohttp.ClientError, TimeoutError, ValidationError, ValueError) as exc:
            log.debug("no switch expectation from the lease controller",
                      extra={"model": model, "upstream": url, "error": repr(exc)[:200]})
            return None
        found = next((c for c in state.claimants if c.claim == claim), None)
        if found is None:
            return None
        if found.expected_switch_s:
            self._expected[model] = found.expected_switch_s
        return Expectation(found.queue_position, found.expected_wait_s,
                           found.expected_switch_s)

    def expected_wake_s(self, model: str) -> float | None:
        """The last expected switch to ``model`` a controller gave (None: none yet)."""
        return self._expected.get(model)

    def learned(self, model: str, timings: dict[str, float]) -> None:
        """A switch to ``model`` was made: its measured cost, until a controller says."""
        spent = sum(timings.get(k, 0.0) for k in ("drain", "later_sleep", "wake_call",
                                                   "probe_ttft"))
        if spent > 0:
            self._expected[model] = round(spent, 3)

    def _finished(self, key: tuple[str, str, str], call: asyncio.Task[ActivateAnswer]) -> None:
        if self._calls.get(key) is call:
            del self._calls[key]
        if not call.cancelled():
            call.exception()  # retrieved: every waiter may have left already

    async def close(self) -> None:
        """Cancel the calls still running (application shutdown)."""
        calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    async def _call(self, url: str, model: str, claim: str, request_id: str) -> ActivateAnswer:
        start = time.perf_counter()
        outcome = "error"
        try:
            result = await self._attempt_all(url, model, claim, request_id)
            outcome = "switched" if result.switched else "already_awake"
            log.info("activation answered", extra={
                "model": model, "claim": claim, "upstream": url,
                "switched": result.switched, "fence": result.fence, "request_id": request_id})
            return result
        except ActivationFailed as exc:
            outcome = exc.code
            raise
        finally:
            self._metrics.activations.labels(model, outcome).inc()
            self._metrics.activation_seconds.labels(model, outcome).observe(
                time.perf_counter() - start)

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        token = self._token.lines[0] if self._token is not None and self._token.lines else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if request_id:
            headers["X-Request-Id"] = request_id
        return headers

    async def _attempt_all(self, url: str, model: str, claim: str,
                           request_id: str) -> ActivateAnswer:
        target = f"{url}{PATH}"
        try:
            body = ActivateRequest(model=model, claim=claim).model_dump()
        except ValidationError as exc:
            raise ActivationFailed(f"Model '{model}' cannot be named to a lease controller.",
                                   code=Code.BAD_ACTIVATION_REQUEST,
                                   retry_after=self._retry_after) from exc
        last: Exception | None = None
        pauses = Backoff(first_s=_BACKOFF_S, max_s=_BACKOFF_MAX_S)
        for attempt in range(self._attempts):
            if attempt:
                await pauses.sleep()
            try:
                async with self._session.post(
                        target, json=body,
                        headers=self._headers(request_id), timeout=self._timeout) as resp:
                    raw = await read_bounded(resp, _MAX_ANSWER)
                    return self._interpret(resp.status, resp.headers.get("Retry-After"), raw,
                                           model, claim, url)
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = exc
                log.warning("activation call failed; retrying", extra={
                    "model": model, "claim": claim, "upstream": url, "attempt": attempt + 1,
                    "error": repr(exc)[:200], "request_id": request_id})
        raise ActivationFailed(
            f"Model '{model}' could not be woken: its lease controller at {url} cannot be "
            f"reached ({last!r:.200}).", code=Code.CONTROLLER_UNREACHABLE,
            retry_after=self._retry_after)

    def _interpret(self, status: int, retry_after: str | None, raw: bytes, model: str,
                   claim: str, url: str) -> ActivateAnswer:
        try:
            payload: Any = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        if status == 200:
            try:
                answer = ActivateAnswer.model_validate(payload)
            except ValidationError as exc:
                raise ActivationFailed(
                    f"Model '{model}': the lease controller's answer is not understood.",
                    code=Code.BAD_ACTIVATION_ANSWER, retry_after=self._retry_after) from exc
            if answer.switched:
                self.learned(answer.model, answer.timings)
            return answer
        kind, message = _error_of(payload)
        if status in (401, 403):
            log.error("the lease controller refused the activation token",
                      extra={"model": model, "claim": claim, "upstream": url,
                             "status": status})
            kind = Code.ACTIVATION_UNAUTHORIZED
        reason = _label(kind) if kind else _http_label(status)
        detail = message or raw[:200].decode(errors="replace") or f"HTTP {status}"
        said = f" ({_cleaned(kind)})" if kind and reason == Code.OTHER else ""
        raise ActivationFailed(f"Model '{model}' could not be woken: {reason}{said}: {detail}",
                               code=reason, refused=asks_again(_cleaned(kind) if kind else None,
                                                               status),
                               retry_after=_retry_after(retry_after, self._retry_after))
