"""Errors the simulator answers with, in vLLM's JSON shape.

vLLM answers errors as ``{"error": {"message", "type", "param", "code"}}``. ``type`` is an
OpenAI-style class name (``BadRequestError``, ``NotFoundError``, ``InternalServerError``)
for errors raised by the serving code, and the HTTP reason phrase (``Bad Request``) for
FastAPI ``HTTPException`` s such as ``/collective_rpc``'s. A :class:`SimError` raised by any
handler is turned into that body by :func:`error_middleware`.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

__all__ = [
    "SimError",
    "engine_dead_error",
    "error_body",
    "error_middleware",
    "error_response",
    "wake_oom_error",
]

log = logging.getLogger(__name__)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(message: str, err_type: str, code: int) -> web.Response:
    return web.json_response(error_body(message, err_type, code), status=code)


class SimError(Exception):
    """An error answer. Raise it from a handler; the middleware renders it."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status)


def wake_oom_error(*, simulated: bool = True) -> SimError:
    """The 500 a vLLM wake answers when the device has no room for its memory (vLLM
    rewrites absolute paths to ``<path>``). ``simulated``: forced by the ``wake_fails``
    fault rather than a GPU that really ran out."""
    suffix = " (simulated fault: wake_fails)" if simulated else ""
    return SimError(
        f"Call to wake_up method failed: CUDA Error: out of memory at <path>:163{suffix}",
        status=500,
        err_type="InternalServerError",
    )


ENGINE_DEAD_MESSAGE = ("EngineCore encountered an issue. See stack trace (above) for the "
                       "root cause.")


def engine_dead_error() -> SimError:
    """What every call to an engine whose core died answers: vLLM's handler of
    ``EngineDeadError`` renders it through ``create_error_response``, which names only the
    status (``InternalServerError``); the exception's message is all that tells it apart
    (as seen on vLLM 0.26 on an H200)."""
    return SimError(ENGINE_DEAD_MESSAGE, status=500, err_type="InternalServerError")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SimError as exc:
        log.info("request refused", extra={"path": request.path, "status": exc.status,
                                           "reason": exc.message})
        return web.json_response(exc.body(), status=exc.status)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        # The router's answers for unknown routes and methods, in FastAPI's shape.
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response({"detail": exc.reason}, status=exc.status, headers=allow)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.exception("request failed", extra={"path": request.path})
        return error_response(f"{type(exc).__name__}: {exc}", "InternalServerError", 500)
