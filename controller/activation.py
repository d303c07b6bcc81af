"""The activation API: "make model M awake", answered when M serves or the switch failed.

Gateways call it; each node's controller serves it on the address its controller Lease
advertises, or through the API server's pod proxy (``kubectl rota``). It requires the token
when one is configured (a mounted Secret), as ``Authorization: Bearer`` or in
:data:`~controller.activation_api.TOKEN_HEADER`; engine control endpoints are never
reachable through it.

- ``POST /v1/activate``: the contract is :mod:`controller.activation_api`.
- ``GET /v1/state``: the GPU Leases this instance knows and its claimants.
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from controller import metrics
from controller.activation_api import (
    PATH,
    STATE_PATH,
    TOKEN_HEADER,
    ActivateAnswer,
    ActivateRequest,
    ErrorBody,
    ErrorDetail,
)
from controller.gateway.credentials import ApiKeys
from controller.node import NodeController, UnknownModel
from controller.switch import Fenced

log = logging.getLogger(__name__)

NODE: web.AppKey[NodeController] = web.AppKey("node", NodeController)
CALLERS: web.AppKey[ApiKeys] = web.AppKey("callers", ApiKeys)
_MAX_BODY = 16 * 1024


def _error(status: int, kind: str, message: str, *, retry_after: int | None = None
           ) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = ErrorBody(error=ErrorDetail(type=kind, message=message))
    return web.json_response(body.model_dump(), status=status, headers=headers)


def _admitted(callers: ApiKeys, request: web.Request) -> bool:
    if callers.admits(request.headers.get("Authorization")):
        return True
    token = request.headers.get(TOKEN_HEADER, "").strip()
    return bool(token) and " " not in token and callers.admits(f"Bearer {token}")


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path.startswith("/v1/") and not _admitted(request.app[CALLERS], request):
        return _error(401, "unauthorized", "a valid bearer token is required")
    response: web.StreamResponse = await handler(request)
    return response


async def activate(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        raw = await request.read()
        body = ActivateRequest.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])
        return _error(400, "invalid_request", problems[:512])
    try:
        result = await node.activate(body.model, body.claim)
    except UnknownModel as exc:
        return _error(404, "unknown_model", str(exc))
    except Fenced as exc:
        return _error(409, "not_leader", str(exc), retry_after=1)
    if not result.ok:
        return _error(503, result.reason or "switch_failed", result.message or result.reason,
                      retry_after=2)
    claimant = result.claimant
    answer = ActivateAnswer(model=claimant.model, claim=claimant.ref,
                            switched=result.switched, fence=result.fence,
                            timings={k: round(v, 6) for k, v in result.timings.items()})
    return web.json_response(answer.model_dump())


async def state(request: web.Request) -> web.Response:
    node = request.app[NODE]
    claimants = node.claimants()
    return web.json_response({
        "node": node.settings.node_name, "identity": node.settings.identity,
        "leader": node.election.is_leader(),
        "leases": {device: {"holder": w.lease.holder, "state": w.lease.state,
                            "fence": w.lease.fence, "last_error": w.lease.last_error,
                            "last_switch": w.last_switch}
                   for device, w in node.workers.items() if w.lease is not None},
        "claimants": [{"claim": c.ref, "model": c.model, "device": c.device, "gpu": c.gpu,
                       "endpoint": c.endpoint, "serving": c.serving} for c in claimants],
    })


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
    app = web.Application(middlewares=[_auth], client_max_size=_MAX_BODY)
    app[NODE] = node
    app[CALLERS] = callers
    app.router.add_post(PATH, activate)
    app.router.add_get(STATE_PATH, state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    return app
