"""One model request's way through the gateway: place, route, wake, forward, retry.

1. Take a place in the model's gate (:mod:`~controller.gateway.places`): 429 when the
   queue is full, 503 when no place frees up in time.
2. Ask the routing state (:mod:`~controller.gateway.routing`) what to do: forward to the
   claimant that holds its GPU (the pod IP this gateway watches, under the GPU Lease's
   current fence); wait while a switch to or away from the model runs (a request for a
   model being drained is held, never sent and never failed); or ask the node's lease
   controller to wake it (:mod:`~controller.gateway.activation`). The controller's answer
   only means "done": the request then waits until this gateway's own view of the Lease
   shows the claimant awake under the answer's fence, and is routed from that view. A
   controller that declines for now (409, e.g. minimum residency) is asked again after
   its Retry-After while the request has time left; a failed switch is a 503 with the
   reason; a controller that cannot be reached is lost: the request waits for its Lease
   to change (a gone pod's Lease, taken over by the next controller).
3. Forward (:mod:`~controller.gateway.proxy`), while watching the Lease. If, before the
   engine's first byte, the GPU's Lease settles without naming the engine awake (another
   holder, or an awake set without it: the engine was put to sleep, and holds the
   request), or the engine refused with 503 or could not be reached, the request goes
   back to step 2, which may trigger the next activation. Attempts are
   bounded, and so is every wait, by one deadline per request.

A streamed request that waits gets its answer started early and kept alive with SSE
comments (:mod:`~controller.gateway.downstream`); every refusal carries Retry-After
(:meth:`Dispatcher.retry_after_s`). Once
that stream has begun, every refusal — the gateway's own, an engine's 503 or unreachable
engine passed on, even a defect of the gateway's — is its last events, an error event and
``[DONE]``, never a second answer.

Frozen answers: an engine whose claim keeps its requests across a sleep (the switch
freezes them while another model holds the GPU) leaves a started answer silent for
seconds. Such an answer is watched through this gateway's view of the GPU Lease
(:class:`_EngineWatch`: frozen while the Lease, past the fence it was sent under, has
settled without naming the engine in its awake set; ended at once when the engine's claim
or pod goes, or its pod is deleted while frozen) and paced by
:class:`~controller.gateway.proxy.Pacing`: heartbeats, the ``X-Rota-Progress: 1`` comment
when a freeze begins, and a read timeout that a freeze never runs out
(:meth:`Dispatcher.silence_s`).

Honest waiting: a request held for a switch carries, in its answer's headers, what the
node's lease controller expected of that switch when the gateway asked (its place in the
GPU's queue and the expected wait, from the switch costs the controller measured itself:
:meth:`~controller.gateway.activation.Activator.expect`) and how long it was held
(``X-Rota-*``, see :mod:`~controller.gateway.downstream`), and each held request's end is
logged ("request held for a switch") with those fields.

Every 429 and 503 the gateway sends for a model — queue full, no place in time, a wait that
ran out, a switch that failed or cannot be made now, an engine that refused or cannot be
reached — says when to come back from what was measured, not a constant: the controller's
or the engine's own ``Retry-After`` where one came with the refusal, else
:meth:`Dispatcher.retry_after_s` (the rest of the switch the request, or another request
for the model, was told to expect; else the model's expected switch cost as its
controller measured it, when it is not awake; only when nothing was measured,
``--retry-after-s``). A client
that disconnects takes its request out of the activation it waits for; the last one to
leave cancels it (:class:`~controller.gateway.activation.Activator`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from controller.claimants import Claimant
from controller.gateway import proxy
from controller.gateway.activation import ActivationFailed, Activator, Expectation
from controller.gateway.downstream import PROGRESS_HEADER, Downstream, Held
from controller.gateway.engine_keys import EngineKeys
from controller.gateway.errors import (
    Code,
    EngineRefused,
    GatewayError,
    ModelNotFound,
    Unavailable,
)
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.places import ModelPlaces
from controller.gateway.routing import Action, Decision, RoutingState
from controller.gateway.settings import GatewaySettings
from controller.gateway.surface import Dialect

__all__ = ["Dispatcher", "ModelRequest"]

log = logging.getLogger(__name__)

_WAIT_CODES = frozenset({Code.NO_CONTROLLER, Code.CONTROLLER_LOST})
"""Reasons to wait that name the 503 when the wait runs out (else ``switch_timeout``)."""
_EXPECTATION_GRACE_S = 0.25
"""How long a request whose switch is done waits for the controller's expectation (for its
headers) before going on without it."""
_SWITCH_REASONS = frozenset({"switching", "draining"})
"""Reasons to wait that are a switch to or away from the model (a held request)."""
_NO_NOTES = frozenset({"", "0", "none", "no", "off", "false"})
"""``X-Rota-Progress`` values that ask for no progress (a freeze's comment included)."""
_WATCH_STEP_S = 3600.0


@dataclass(frozen=True)
class ModelRequest:
    """A validated request for one model, ready to route."""

    path: str
    model: str
    stream: bool
    """The answer may be an event stream (``stream: true`` on a path that streams): the
    request may get its answer started early."""
    body: bytes
    request_id: str
    arrived: float
    """``time.perf_counter()`` at arrival."""
    content_type: str = "application/json"
    """The body's Content-Type, passed to the engine (a form's names its boundary)."""
    dialect: Dialect = "openai"
    """How an error is written inside a started stream (Anthropic's on ``/v1/messages``)."""


class Dispatcher:
    """Everything a model request needs on its way, shared by all requests."""

    def __init__(self, settings: GatewaySettings, state: RoutingState, places: ModelPlaces,
                 activator: Activator, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, engine_keys: EngineKeys) -> None:
        self.settings = settings
        self.state = state
        self.places = places
        self.activator = activator
        self.session = session
        self.metrics = metrics
        self.engine_keys = engine_keys
        self._ready_at: dict[str, float] = {}
        """By model: when (event-loop time) the switch it was last expected to wait for
        should be done, as the controller told a held request."""
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.upstream_connect_timeout_s,
            sock_connect=settings.upstream_connect_timeout_s,
            sock_read=settings.upstream_read_timeout_s)

    async def serve(self, request: web.Request, gen: ModelRequest) -> web.StreamResponse:
        """Serve ``gen`` for ``request``.

        Raises:
            GatewayError: the gateway answers itself (queue full, unknown model, ...) and
                the answer has not started yet.
        """
        asked = request.headers.get(PROGRESS_HEADER, "").strip().lower()
        shown = asked or self.state.binding.progress_of(gen.model)
        progress = gen.stream and gen.path == "/v1/chat/completions" and shown == "reasoning"
        downstream = Downstream(request, gen.request_id, stream=gen.stream,
                                keepalive_s=self.settings.stream_keepalive_s,
                                progress_model=gen.model if progress else None,
                                dialect=gen.dialect)
        downstream.start_keepalive()
        extra = {"model": gen.model, "request_id": gen.request_id}
        outcome = "answered"
        try:
            return await self._serve(downstream, gen)
        except GatewayError as err:
            outcome = err.code
            if err.status in (429, 503) and err.retry_after is None:
                err.retry_after = self.retry_after_s(gen.model, downstream.held)
            if not await downstream.started_early():
                err.headers.update(downstream.rota_headers())
                raise
            count_refusal(self.metrics, gen.model, err)
            log.warning("request refused inside its started stream",
                        extra=extra | {"code": err.code})
            return await downstream.fail(err)
        except asyncio.CancelledError:
            outcome = "client_gone"
            raise
        except Exception:
            outcome = "internal_error"
            if not await downstream.started_early():
                raise  # aiohttp's 500
            log.exception("request failed inside its started stream", extra=extra)
            failure = GatewayError("The gateway failed to serve this request.",
                                   code=Code.INTERNAL_ERROR)
            count_refusal(self.metrics, gen.model, failure)
            return await downstream.fail(failure)
        finally:
            await downstream.stop_keepalive()
            if downstream.held is not None:
                log.info("request held for a switch", extra=extra | {"outcome": outcome} | (
                    downstream.held.log_fields(asyncio.get_running_loop().time())))

    def retry_after_s(self, model: str, held: Held | None = None) -> float:
        """Seconds a client refused for ``model`` should wait before asking again, from what
        was measured (see the module): the rest of the switch ``held`` was told to expect;
        else the rest of the switch the controller last told any request for ``model``
        to expect; else, while no engine of ``model`` is awake, its expected switch cost
        as its controller measured it; else ``--retry-after-s``."""
        now = asyncio.get_running_loop().time()
        left = held.left_s(now) if held is not None else None
        if left is not None and left >= 1:
            return left
        ready_at = self._ready_at.get(model)
        if ready_at is not None:
            if ready_at - now >= 1:
                return ready_at - now
            del self._ready_at[model]  # that switch is over, or late
        cost = self.activator.expected_wake_s(model)
        if cost and not self.state.awake(model):
            return max(1.0, cost)
        return float(self.settings.retry_after_s)

    async def _serve(self, downstream: Downstream, gen: ModelRequest) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.max_wait_s
        gate = self.places.gate(gen.model)
        downstream.note = f"waiting for a place to serve model '{gen.model}'"
        async with gate.place(deadline):
            attempt = 0
            while True:
                attempt += 1
                decision = await self._route(gen, deadline, downstream)
                if attempt == 1:
                    self.metrics.queue_wait.labels(gen.model).observe(
                        time.perf_counter() - gen.arrived)
                version = self.state.model_version(gen.model)
                downstream.note = f"model '{gen.model}' is generating"
                with gate.upstream():
                    result = await self._forward(downstream, gen, decision)
                if isinstance(result, proxy.Delivered):
                    outcome = "ok" if result.status < 400 else f"upstream_{result.status}"
                    if result.client_gone:
                        outcome = "client_gone"
                    elif not result.complete:
                        outcome = "upstream_broken"
                    self.metrics.requests.labels(gen.model, outcome).inc()
                    return result.response
                self.metrics.engine_refusals.labels(gen.model, result.reason).inc()
                extra = {"model": gen.model, "request_id": gen.request_id,
                         "upstream": decision.endpoint, "claim": decision.claim,
                         "attempt": attempt, "detail": result.detail}
                remaining = deadline - loop.time()
                moved_on = result.reason == "lost_gpu"
                if attempt >= self.settings.upstream_attempts or remaining <= 0 or not (
                        moved_on or await self.state.wait_changed(
                            version, min(self.settings.lost_gpu_grace_s, remaining),
                            model=gen.model)):
                    log.warning("engine did not serve; passing its refusal on", extra=extra)
                    return await self._refusal(downstream, gen, result)
                log.info("engine no longer serves this model; routing again", extra=extra)
                self.metrics.upstream_retries.labels(gen.model).inc()

    async def _forward(self, downstream: Downstream, gen: ModelRequest,
                       decision: Decision) -> proxy.Delivered | proxy.Refused:
        model = gen.model
        assert decision.endpoint is not None

        def first_byte() -> None:
            self.metrics.first_byte.labels(model).observe(time.perf_counter() - gen.arrived)

        def first_token() -> None:
            if gen.stream:
                self.metrics.first_token.labels(model).observe(
                    time.perf_counter() - gen.arrived)

        engine_key = await self.engine_keys.key_for(decision.namespace, decision.key_secret)
        if not self.state.still_holds(decision):
            return proxy.Refused("lost_gpu", "the GPU changed hands before sending")
        claimant = _claimant_of(self.state, decision)
        freeze_s = self.longest_freeze_s(claimant)
        silence_s = self.silence_s(model, freeze_s)
        limits = aiohttp.ClientTimeout(
            total=None, connect=self._timeout.connect, sock_connect=self._timeout.sock_connect,
            sock_read=silence_s)
        return await proxy.forward(
            downstream, self.session, f"{decision.endpoint}{gen.path}", body=gen.body,
            request_id=gen.request_id, client_timeout=limits, engine_key=engine_key,
            content_type=gen.content_type,
            lost=lambda: self.state.wait_lost(decision), on_first_byte=first_byte,
            on_first_token=first_token,
            log_extra={"model": model, "request_id": gen.request_id,
                       "upstream": decision.endpoint, "claim": decision.claim or ""},
            pacing=self._pacing(downstream, decision, claimant, freeze_s))

    def longest_freeze_s(self, claimant: Claimant | None) -> float:
        """The longest freeze ``claimant``'s claim allows a started answer
        (``longestFreezeSeconds``), else ``--longest-freeze-s``."""
        asked = getattr(claimant.config, "longest_freeze_seconds", None) if claimant else None
        return float(asked) if asked else self.settings.longest_freeze_s

    def silence_s(self, model: str, freeze_s: float) -> float:
        """The longest silence of an engine answering ``model`` before the request ends with
        a timeout: ``--upstream-read-timeout-s`` plus the longest freeze its claim allows
        plus the measured cost of switching ``model`` back in (the controller's expected
        switch), so that a freeze within its bound is never a timeout."""
        margin = self.activator.expected_wake_s(model) or 0.0
        return self.settings.upstream_read_timeout_s + freeze_s + margin

    def _pacing(self, downstream: Downstream, decision: Decision, claimant: Claimant | None,
                freeze_s: float) -> proxy.Pacing:
        """How a started answer from ``decision``'s engine is kept while it is silent."""
        model = decision.model
        asked = downstream.request.headers.get(PROGRESS_HEADER, "").strip().lower()
        shown = asked or self.state.binding.progress_of(model) or ""
        metrics = self.metrics

        def freeze(seconds: float | None) -> None:
            if seconds is None:
                metrics.frozen_streams.labels(model).inc()
                return
            metrics.frozen_streams.labels(model).dec()
            metrics.freeze_seconds.labels(model).observe(seconds)

        return proxy.Pacing(
            model=model, heartbeat_s=self.settings.stream_heartbeat_s,
            progress=shown not in _NO_NOTES, expected_freeze_s=freeze_s,
            watch=_EngineWatch(self.state, decision,
                               claimant.pod_uid if claimant is not None else None),
            retry_after_s=lambda: self.retry_after_s(model),
            on_heartbeat=metrics.heartbeats.labels(model).inc, on_freeze=freeze)

    async def _refusal(self, downstream: Downstream, gen: ModelRequest,
                       refused: proxy.Refused) -> web.StreamResponse:
        """The engine's refusal, passed on as it is when nothing was sent yet.

        Raises:
            Unavailable: the engine gave its GPU up before it answered (``lost_gpu``, on
                every attempt); the engine could not be reached.
            EngineRefused: the answer has begun as an event stream, so the refusal (its
                words, ``upstream_<status>``, its Retry-After) can only be that stream's
                last event.
        """
        if refused.reason == "lost_gpu":
            raise Unavailable(f"The engine serving model '{gen.model}' gave its GPU to "
                              "another model before it answered; try again.",
                              code=Code.LOST_GPU)
        if refused.status is None:
            raise Unavailable(f"The engine serving model '{gen.model}' cannot be reached.",
                              code=Code.UPSTREAM_UNREACHABLE)
        headers = refused.headers
        hint = headers.get("Retry-After", "")
        if await downstream.started_early():
            raise EngineRefused(
                f"The engine serving model '{gen.model}' refused the request "
                f"(HTTP {refused.status}): {_engine_message(refused)}",
                status=refused.status,
                retry_after=int(hint) if hint.isascii() and hint.isdigit() else None)
        self.metrics.requests.labels(gen.model, f"upstream_{refused.status}").inc()
        headers.setdefault("Retry-After", str(max(1, math.ceil(
            self.retry_after_s(gen.model, downstream.held)))))
        headers.update(downstream.rota_headers())
        return web.Response(status=refused.status, body=refused.body, headers=headers)

    async def _wait(self, model: str, until: float, deadline: float, what: str, *,
                    code: str = Code.SWITCH_TIMEOUT) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now >= deadline:
            raise Unavailable(f"Waited too long for model '{model}': {what}.", code=code)
        await self.state.wait_changed(self.state.model_version(model),
                                      min(until, deadline) - now, model=model)

    async def _route(self, gen: ModelRequest, deadline: float,
                     downstream: Downstream) -> Decision:
        """A FORWARD decision for ``gen``, waiting for a switch or waking the model first."""
        loop = asyncio.get_running_loop()
        model = gen.model
        declined_until = 0.0
        activated: tuple[str, int, int] | None = None
        """(claim, fence, state version) of the last activation this request saw done."""
        while True:
            decision = self.state.decide(model)
            if decision.action is Action.FORWARD and decision.endpoint:
                downstream.end_hold()
                return decision
            if decision.action is Action.UNKNOWN:
                raise ModelNotFound(model)
            if decision.action is Action.UNAVAILABLE:
                raise Unavailable(f"Model '{model}' cannot be served now: {decision.reason}.",
                                  code=decision.reason)
            if activated is not None:
                claim, fence, version = activated
                seen = self.state.fence_of(claim)
                if seen is None or seen < fence or (
                        self.state.model_version(model) == version
                        and decision.claim == claim):
                    # Done, says the controller; this gateway has not seen it yet.
                    await self._wait(model, deadline, deadline, "its Lease to show it awake")
                    continue
                activated = None
            if downstream.held is None and (decision.action is Action.ACTIVATE or (
                    decision.action is Action.WAIT and decision.reason in _SWITCH_REASONS)):
                downstream.held = Held(since=loop.time())
            if decision.action is Action.WAIT or loop.time() < declined_until:
                why = decision.reason or "declined for now"
                downstream.note = f"model '{model}' is being switched in ({why})"
                until = deadline if decision.action is Action.WAIT else declined_until
                code = decision.reason if decision.reason in _WAIT_CODES \
                    else Code.SWITCH_TIMEOUT
                await self._wait(model, until, deadline, why, code=code)
                continue
            if not (decision.activation_url and decision.claim):
                raise Unavailable(f"Model '{model}' has no engine to wake.",
                                  code=Code.NO_SERVING_ENGINE)
            downstream.note = f"model '{model}' is being woken"
            expecting = asyncio.create_task(self.activator.expect(
                decision.activation_url, model, decision.claim), name=f"expect {model}")
            expecting.add_done_callback(lambda done: self._told(downstream, model, done))
            try:
                done = await self.activator.activate(
                    decision.activation_url, model, decision.claim, deadline=deadline,
                    request_id=gen.request_id)
            except ActivationFailed as exc:
                expecting.cancel()
                if exc.code == Code.CONTROLLER_UNREACHABLE:
                    # A lost controller, not an answer: wait for its Lease to change.
                    self.state.unreachable(decision.claim, decision.activation_url)
                    continue
                wait = exc.retry_after or self.settings.retry_after_s
                if not exc.refused or loop.time() + wait >= deadline:
                    raise
                log.info("the lease controller declined for now; asking again later",
                         extra={"model": model, "request_id": gen.request_id,
                                "reason": exc.code, "retry_after_s": wait})
                declined_until = loop.time() + wait
                continue
            except BaseException:
                expecting.cancel()
                raise
            if not expecting.done():  # a fast switch: its expectation is on its way
                await asyncio.wait({expecting}, timeout=_EXPECTATION_GRACE_S)
            expecting.cancel()
            activated = (done.claim, done.fence, self.state.model_version(model))

    def _told(self, downstream: Downstream, model: str,
              expecting: asyncio.Task[Expectation | None]) -> None:
        """The controller's expectation reached a held request: what its answer will say,
        and when any refused request for ``model`` should come back."""
        held = downstream.held
        if expecting.cancelled() or held is None or held.expected_wait_s is not None:
            return
        told = expecting.result()
        if told is not None:
            held.queue_position = told.queue_position
            held.expected_wait_s = told.expected_wait_s
            if told.expected_wait_s is not None:
                self._ready_at[model] = held.since + told.expected_wait_s


def _claimant_of(state: RoutingState, decision: Decision) -> Claimant | None:
    """The claimant a FORWARD ``decision`` names, as the routing state has it now."""
    return next((c for c in state.claimants(decision.model)
                 if c.claim_uid == decision.claim_uid), None)


class _EngineWatch:
    """The routing state's view of the engine one answer comes from
    (:class:`~controller.gateway.proxy.EngineWatch`)."""

    def __init__(self, state: RoutingState, decision: Decision, pod_uid: str | None) -> None:
        self._state = state
        self._decision = decision
        self._pod_uid = pod_uid
        self._version = state.model_version(decision.model)

    def view(self) -> proxy.EngineView:
        """Gone when the claim or the pod the answer was sent to is; frozen while the GPU
        Lease, past the answer's fence, has settled without naming the engine in its awake
        set (the engine was put to sleep with the answer kept), and gone then too when the pod is
        being deleted (it will not be woken again)."""
        claimant = _claimant_of(self._state, self._decision)
        if claimant is None:
            return proxy.EngineView(gone="claim_gone")
        if self._pod_uid is not None and claimant.pod_uid != self._pod_uid:
            return proxy.EngineView(gone="pod_gone")
        lease = self._state.lease_of(claimant)
        if self._state.lost(self._decision) is None or lease is None:
            return proxy.EngineView()
        if claimant.pod_deleting:
            return proxy.EngineView(gone="pod_deleted")
        other = lease.holder_model if lease.holder_claim_uid != claimant.claim_uid else ""
        return proxy.EngineView(frozen_at=lease.fence, frozen_for=other)

    async def changed(self) -> None:
        """Return once the answer's model changed (its claimants or their GPUs' Leases)."""
        model = self._decision.model
        while not await self._state.wait_changed(self._version, _WATCH_STEP_S, model=model):
            pass
        self._version = self._state.model_version(model)


def _engine_message(refused: proxy.Refused) -> str:
    """What the engine said in its refusal: its error's message, else its body's start."""
    try:
        payload = json.loads(refused.body)
    except (ValueError, RecursionError):
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str) and message.strip():
        return message.strip()
    return refused.body[:256].decode(errors="replace").strip() or "no details"


def count_refusal(metrics: GatewayMetrics, model: str, err: GatewayError) -> None:
    """Count a request the gateway answered itself."""
    metrics.requests.labels(model, err.code).inc()
