"""The start-gate API: where engines that start through rota's gate ask for a start slot.

The lease controller serves it on a unix socket in a host directory that the driver's CDI
spec mounts (read-only, host path = container path) into every container of every claim
with an engine config; see :mod:`driver.startgate` and :mod:`controller.lease.admission`.

``POST /v1/start`` with :class:`StartRequest`: the claim's uid and its token (both from the
container's CDI environment). The controller checks the token with the driver, finds the
claim's GPU, and holds the request (a long poll, ``--start-hold-s``) until the engine may
start. Answers, always :class:`StartReply`:

- 200 ``granted: true``: start now (the gate execs the engine);
- 200 ``granted: false``: ask again after ``retry_after_s`` (the GPU is busy, the
  instance does not lead the node, the claim is not known yet);
- 400 ``invalid_request`` a malformed request, 413 ``request_too_large`` a body over
  :data:`MAX_BODY_BYTES`, 401 a token that is not the claim's, 503 the driver's inspection
  API did not answer (ask again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.lease.device import DeviceError
from controller.lease.node import NodeController
from driver.start_contract import MAX_BODY_BYTES, PATH

__all__ = ["MAX_BODY_BYTES", "PATH", "StartReply", "StartRequest", "make_app", "serve"]

log = logging.getLogger(__name__)

NODE: web.AppKey[NodeController] = web.AppKey("node", NodeController)


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    claim_uid: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")
    token: str = Field(min_length=1, max_length=256)
    attempt: int = Field(default=0, ge=0)
    """How many times this gate asked before (for logs)."""


class StartReply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    granted: bool = False
    reason: str = ""
    message: str = ""
    retry_after_s: float = 0.0


def _reply(reply: StartReply, status: int = 200) -> web.Response:
    return web.json_response(reply.model_dump(), status=status)


async def start(request: web.Request) -> web.Response:
    try:
        body = StartRequest.model_validate_json(await request.read())
    except web.HTTPRequestEntityTooLarge:
        return _reply(StartReply(reason="request_too_large", message=f"the request body is "
                                 f"longer than {MAX_BODY_BYTES} bytes"), 413)
    except ValidationError as exc:
        return _reply(StartReply(reason="invalid_request", message=str(exc)[:300]), 400)
    try:
        answer = await request.app[NODE].request_start(body.claim_uid, body.token)
    except DeviceError as exc:
        return _reply(StartReply(reason="driver_unavailable", message=str(exc)[:300],
                                 retry_after_s=1.0), 503)
    if answer.granted:
        log.info("start slot granted", extra={"claim": body.claim_uid,
                                              "attempt": body.attempt})
    return _reply(StartReply(granted=answer.granted, reason=answer.reason,
                             message=answer.message, retry_after_s=answer.retry_after_s),
                  answer.status)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


def make_app(node: NodeController) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[NODE] = node
    app.router.add_post(PATH, start)
    app.router.add_get("/healthz", healthz)
    return app


def _clear(socket: Path) -> None:
    socket.parent.mkdir(parents=True, exist_ok=True)
    if socket.is_socket():
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()


async def serve(node: NodeController, socket: Path) -> web.AppRunner:
    """Listen on ``socket`` (a stale socket file of an earlier instance is replaced);
    every local user may connect: the token decides."""
    await asyncio.to_thread(_clear, socket)
    runner = web.AppRunner(make_app(node), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(socket)).start()
    await asyncio.to_thread(os.chmod, socket, 0o666)
    log.info("start gate listening", extra={"socket": str(socket)})
    return runner
