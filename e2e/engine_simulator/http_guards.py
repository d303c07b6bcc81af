"""What vLLM's HTTP server does before any route: the API key, a dead engine core, and
(as a fault) the keep-alive race.

- **API key** (``--api-key`` / ``VLLM_API_KEY``): vLLM's ``AuthenticationMiddleware``
  guards only paths starting ``/v1``, ``/v2`` or ``/inference`` and answers 401
  ``{"error": "Unauthorized"}`` without ``Authorization: Bearer <key>``. Its development
  routes (``/sleep``, ``/wake_up``, ``/collective_rpc``, ...), ``/health`` and
  ``/metrics`` are **never** authenticated: only the network protects them. The
  comparison takes constant time.
- **Dead engine core**: once the engine core died, every call answers 500
  ``EngineDeadError`` and ``/health`` 503 (``/metrics`` and ``/sim/*`` still answer)
  until the server ends, which an answer of ``EngineDeadError`` hastens (see
  :meth:`~.engine.Engine._watchdog`).
- **Keep-alive race** (fault ``drop_reused_connections``): a request arriving on a
  connection that already served one is dropped without an answer, as when a pooled
  connection is reused just as the server's 5 s keep-alive closes it.
"""

from __future__ import annotations

import hmac
import logging
import weakref
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from e2e.engine_simulator.errors import engine_dead_error
from e2e.engine_simulator.keys import ENGINE_KEY

__all__ = ["API_KEY_PREFIXES", "api_key_middleware", "dead_engine_middleware",
           "is_api_key_path", "reused_connection_middleware"]

log = logging.getLogger(__name__)

API_KEY_PREFIXES = ("/v1", "/v2", "/inference")
"""The only paths vLLM's ``--api-key`` guards."""


def is_api_key_path(path: str) -> bool:
    return path.startswith(API_KEY_PREFIXES)


def api_key_middleware(key: str) -> Middleware:
    """vLLM's ``--api-key`` check on ``/v1*``, ``/v2*``, ``/inference*``."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_api_key_path(request.path):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                log.warning("request refused: missing or wrong API key",
                            extra={"path": request.path})
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return guard


def _served_when_dead(path: str) -> bool:
    """What vLLM's HTTP server still answers once its engine core died: its metrics (the
    instrumentator's ``/metrics`` and prometheus_client's Mount behind it), and the
    simulator's own ``/sim/*``."""
    return path == "/metrics" or path.startswith(("/metrics/", "/sim/"))


@web.middleware
async def dead_engine_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    if engine.dead is not None and not _served_when_dead(request.path):
        if request.path == "/health":
            return web.Response(status=503)
        error = engine_dead_error()
        engine.answered_dead()
        return web.json_response(error.body(), status=error.status)
    response = await handler(request)
    if engine.dead is not None and response.status == 500:
        engine.answered_dead()  # the request that met the core's death (not a stream's 200)
    return response


def reused_connection_middleware() -> Middleware:
    """Drop a request that arrives on an already used connection while the fault is on."""
    seen: weakref.WeakSet[Any] = weakref.WeakSet()

    @web.middleware
    async def drop(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        reused = transport is not None and transport in seen
        if transport is not None:
            seen.add(transport)
        if reused and request.app[ENGINE_KEY].faults.drop_reused_connections:
            log.warning("dropping a request on a reused connection (fault "
                        "drop_reused_connections)", extra={"path": request.path})
            assert transport is not None
            transport.close()  # the client sees the connection closed without an answer
            return web.Response(status=500)
        return await handler(request)

    return drop
