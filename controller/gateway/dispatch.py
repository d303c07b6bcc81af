"""One generation request's way through the gateway: place, route, wake, forward, retry.

1. Take a place in the model's gate (:mod:`~controller.gateway.admission`): 429 when the
   queue is full, 503 when no place frees up in time.
2. Ask the routing state (:mod:`~controller.gateway.routing`) what to do:
   forward to the awake engine; wait while a switch to or away from the model runs (a
   request for a model being drained is held, never sent and never failed); or ask the
   node's lease controller to wake it (:mod:`~controller.gateway.activation`) and forward
   to the endpoint it answers with. A controller that declines for now (409, e.g. minimum
   residency) is asked again after its Retry-After while the request has time left; a
   failed switch is a 503 with the reason.
3. Forward (:mod:`~controller.gateway.proxy`). If the engine refused with 503 or could not
   be reached before any byte reached the client, the request lost its GPU (a switch began
   before this replica saw it): once the Lease shows a change it goes back to step 2, which
   may trigger the next activation. Attempts are bounded, and so is every wait, by one
   deadline per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from controller.gateway import proxy
from controller.gateway.activation import ActivationFailed, Activator
from controller.gateway.admission import Admission
from controller.gateway.errors import GatewayError, ModelNotFound, Unavailable
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.routing import Action, RoutingState
from controller.gateway.settings import GatewaySettings

__all__ = ["Dispatcher", "GenerationRequest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request, ready to route."""

    path: str
    model: str
    stream: bool
    body: bytes
    request_id: str
    arrived: float
    """``time.perf_counter()`` at arrival."""


class Dispatcher:
    """Everything a generation request needs on its way, shared by all requests."""

    def __init__(self, settings: GatewaySettings, state: RoutingState, admission: Admission,
                 activator: Activator, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.state = state
        self.admission = admission
        self.activator = activator
        self.session = session
        self.metrics = metrics
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.upstream_connect_timeout_s,
            sock_connect=settings.upstream_connect_timeout_s,
            sock_read=settings.upstream_read_timeout_s)

    async def serve(self, request: web.Request, gen: GenerationRequest) -> web.StreamResponse:
        """Serve ``gen`` for ``request``.

        Raises:
            GatewayError: the gateway answers itself (queue full, unknown model, ...).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.max_wait_s
        gate = self.admission.gate(gen.model)
        async with gate.place(deadline):
            attempt = 0
            while True:
                attempt += 1
                endpoint = await self._endpoint_for(gen, deadline)
                version = self.state.version
                if attempt == 1:
                    self.metrics.queue_wait.labels(gen.model).observe(
                        time.perf_counter() - gen.arrived)
                with gate.upstream():
                    result = await self._forward(request, gen, endpoint)
                if isinstance(result, proxy.Delivered):
                    outcome = "ok" if result.status < 400 else f"upstream_{result.status}"
                    if result.client_gone:
                        outcome = "client_gone"
                    elif not result.complete:
                        outcome = "upstream_broken"
                    self.metrics.requests.labels(gen.model, outcome).inc()
                    return result.response
                self.metrics.engine_refusals.labels(
                    gen.model, "unreachable" if result.status is None else "http_503").inc()
                extra = {"model": gen.model, "request_id": gen.request_id,
                         "upstream": endpoint, "attempt": attempt, "detail": result.detail}
                remaining = deadline - loop.time()
                if attempt >= self.settings.upstream_attempts or remaining <= 0 or not (
                        await self.state.wait_changed(
                            version, min(self.settings.lost_gpu_grace_s, remaining))):
                    log.warning("engine did not serve; passing its refusal on", extra=extra)
                    return self._refusal(gen, result)
                log.info("engine no longer serves this model; routing again", extra=extra)
                self.metrics.upstream_retries.labels(gen.model).inc()

    async def _forward(self, request: web.Request, gen: GenerationRequest,
                       endpoint: str) -> proxy.Delivered | proxy.Refused:
        model = gen.model

        def first_byte() -> None:
            self.metrics.first_byte.labels(model).observe(time.perf_counter() - gen.arrived)

        def first_token() -> None:
            if gen.stream:
                self.metrics.first_token.labels(model).observe(
                    time.perf_counter() - gen.arrived)

        return await proxy.forward(
            request, self.session, f"{endpoint}{gen.path}", body=gen.body,
            request_id=gen.request_id, client_timeout=self._timeout, on_first_byte=first_byte,
            on_first_token=first_token,
            log_extra={"model": model, "request_id": gen.request_id, "upstream": endpoint})

    def _refusal(self, gen: GenerationRequest, refused: proxy.Refused) -> web.StreamResponse:
        if refused.status is None:
            raise Unavailable(f"The engine serving model '{gen.model}' cannot be reached.",
                              code="upstream_unreachable",
                              retry_after=self.settings.retry_after_s)
        self.metrics.requests.labels(gen.model, f"upstream_{refused.status}").inc()
        return web.Response(status=refused.status, body=refused.body, headers=refused.headers)

    async def _endpoint_for(self, gen: GenerationRequest, deadline: float) -> str:
        """Where to send ``gen`` now, waiting for a switch or waking the model first."""
        loop = asyncio.get_running_loop()
        model = gen.model
        declined_until = 0.0
        while True:
            decision = self.state.decide(model)
            if decision.action is Action.FORWARD and decision.endpoint:
                return decision.endpoint
            if decision.action is Action.UNKNOWN:
                raise ModelNotFound(model)
            if decision.action is Action.UNAVAILABLE:
                raise Unavailable(f"Model '{model}' cannot be served now: {decision.reason}.",
                                  code=decision.reason, retry_after=self.settings.retry_after_s)
            now = loop.time()
            if decision.action is Action.WAIT or now < declined_until:
                until = deadline if decision.action is Action.WAIT else declined_until
                if now >= deadline:
                    raise Unavailable(f"Waited too long for model '{model}' to be switched in.",
                                      code="switch_timeout",
                                      retry_after=self.settings.retry_after_s)
                await self.state.wait_changed(self.state.version, min(until, deadline) - now)
                continue
            if not (decision.activation_url and decision.claim):
                raise Unavailable(f"Model '{model}' has no engine to wake.",
                                  code="no_serving_engine",
                                  retry_after=self.settings.retry_after_s)
            try:
                activation = await self.activator.activate(
                    decision.activation_url, model, decision.claim, deadline=deadline,
                    request_id=gen.request_id)
            except ActivationFailed as exc:
                wait = exc.retry_after or self.settings.retry_after_s
                if not exc.refused or loop.time() + wait >= deadline:
                    raise
                log.info("the lease controller declined for now; asking again later",
                         extra={"model": model, "request_id": gen.request_id,
                                "reason": exc.code, "retry_after_s": wait})
                declined_until = loop.time() + wait
                continue
            return activation.endpoint


def count_refusal(metrics: GatewayMetrics, model: str, err: GatewayError) -> None:
    """Count a request the gateway answered itself."""
    metrics.requests.labels(model, err.code).inc()
