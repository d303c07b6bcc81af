"""The activation API: "make model M awake", answered when M serves or the switch failed.

Gateways call it; each node's controller serves it on the address its controller Lease
advertises, or through the API server's pod proxy (``kubectl rota``). It requires the token
when one is configured (a mounted Secret), as ``Authorization: Bearer`` or in
:data:`~rota.api.activation.TOKEN_HEADER`; engine control endpoints are never
reachable through it.

- ``POST /v1/activate``: the contract is :mod:`rota.api.activation`.
- ``GET /v1/state``: :class:`~rota.api.activation.StateAnswer`, the GPU Leases this
  instance knows and its claimants, each with its expected switch (:meth:`GpuWorker.expectation`:
  the costs this controller measured per claim, the ones its policy decides with).

A caller that disconnects while its activation waits is gone from its switch's queue (the
server runs with ``handler_cancellation``: the handler, and with it the caller's place in
the GPU worker's queue, is cancelled); a switch whose callers have all gone before its
wake began is not made (the policy's ``cancelled`` rule).
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.

Every error below ``/v1/`` (a refused token, a body over the limit, an unknown path, a
failed switch) is an :class:`~rota.api.activation.ErrorBody` sent with the status and
``Retry-After`` that :data:`~rota.api.activation.ERRORS` gives its code: the code
decides, never the moment or the path that produced it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from controller.claimants import Claimant
from controller.credentials import ApiKeys
from controller.lease import metrics
from controller.lease.node import NodeController, UnknownModel
from controller.lease.switch import Fenced
from rota.api.activation import (
    MAX_BODY_BYTES,
    PATH,
    STATE_PATH,
    TOKEN_HEADER,
    ActivateAnswer,
    ActivateRequest,
    ClaimantState,
    ErrorBody,
    LastSwitch,
    LeaseState,
    StateAnswer,
    refusal_of,
    wire_reason,
)

log = logging.getLogger(__name__)

NODE: web.AppKey[NodeController] = web.AppKey("node", NodeController)
CALLERS: web.AppKey[ApiKeys] = web.AppKey("callers", ApiKeys)


def _error(code: str, message: str) -> web.Response:
    """The error answer of ``code``: its status and ``Retry-After`` come from the table."""
    row = refusal_of(code)
    return web.json_response(ErrorBody.of(code, message).model_dump(), status=row.status,
                             headers=row.headers() or None)


def _admitted(callers: ApiKeys, request: web.Request) -> bool:
    if callers.admits(request.headers.get("Authorization")):
        return True
    token = request.headers.get(TOKEN_HEADER, "").strip()
    return bool(token) and " " not in token and callers.admits(f"Bearer {token}")


@web.middleware
async def _contract(request: web.Request, handler: Any) -> web.StreamResponse:
    """Below ``/v1/``: the token first, then every error in the contract's shape."""
    if not request.path.startswith("/v1/"):
        response: web.StreamResponse = await handler(request)
        return response
    if not _admitted(request.app[CALLERS], request):
        return _error("unauthorized", "a valid bearer token is required")
    try:
        response = await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return _error("request_too_large",
                      f"the request body is longer than {MAX_BODY_BYTES} bytes")
    except web.HTTPMethodNotAllowed:
        return _error("method_not_allowed", f"{request.method} {request.path}: not allowed")
    except web.HTTPNotFound:
        return _error("not_found", f"{request.method} {request.path}: no such path")
    return response


async def activate(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        raw = await request.read()
        body = ActivateRequest.model_validate_json(raw)
    except web.RequestPayloadError as exc:  # a Content-Encoding that does not decode
        return _error("invalid_request", f"the request body cannot be read: {exc}"[:512])
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])
        return _error("invalid_request", problems[:512])
    try:
        result = await node.activate(body.model, body.claim)
    except UnknownModel as exc:
        return _error("unknown_model", str(exc))
    except Fenced as exc:
        return _error("not_leader", str(exc))
    if not result.ok:
        code = wire_reason(result.reason)
        return _error(code, result.message or result.reason or code)
    claimant = result.claimant
    answer = ActivateAnswer(model=claimant.model, claim=claimant.ref,
                            switched=result.switched, fence=result.fence,
                            timings={k: round(v, 6) for k, v in result.timings.items()})
    return web.json_response(answer.model_dump())


def _claimant_state(node: NodeController, claimant: Claimant) -> ClaimantState:
    state = ClaimantState(claim=claimant.ref, model=claimant.model, device=claimant.device,
                          gpu=claimant.gpu, endpoint=claimant.endpoint,
                          serving=claimant.serving)
    worker = node.workers.get(claimant.gpu)
    if worker is None:
        return state
    switch_s, position, wait_s = worker.expectation(claimant)
    return state.model_copy(update={"expected_switch_s": switch_s, "queue_position": position,
                                    "expected_wait_s": wait_s})


def state_of(node: NodeController) -> StateAnswer:
    """What ``GET /v1/state`` answers: the GPU Leases this instance read and its claimants."""
    return StateAnswer(
        node=node.settings.node_name, identity=node.settings.identity,
        leader=node.election.is_leader(),
        leases={device: LeaseState(
                    holder=w.lease.holder, state=w.lease.state, fence=w.lease.fence,
                    awake_with=[m.claim for m in w.lease.companions],
                    last_error=w.lease.last_error,
                    last_switch=LastSwitch.model_validate(w.last_switch)
                    if w.last_switch else None)
                for device, w in node.workers.items() if w.lease is not None},
        claimants=[_claimant_state(node, c) for c in node.claimants()])


async def state(request: web.Request) -> web.Response:
    return web.json_response(state_of(request.app[NODE]).model_dump(mode="json"))


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if node.election.is_leader() and not node.reconciled:
        return web.Response(status=503, text="reconciling\n")
    return web.Response(text="ok\n")


async def metrics_page(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(generate_latest, metrics.REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(node: NodeController, *, callers: ApiKeys) -> web.Application:
    """``callers`` holds the accepted tokens (every line of the token file, so a rotation
    can overlap); with no file the API is open."""
    app = web.Application(middlewares=[_contract], client_max_size=MAX_BODY_BYTES)
    app[NODE] = node
    app[CALLERS] = callers
    app.router.add_post(PATH, activate)
    app.router.add_get(STATE_PATH, state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    return app
