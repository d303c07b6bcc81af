"""The gateway's own errors and their one mapping to OpenAI-shaped HTTP answers.

Clients of an OpenAI-compatible server expect ``{"error": {"message", "type", "param",
"code"}}``. Every refusal the gateway makes itself is a :class:`GatewayError` carrying its
status, a stable ``code`` (also the ``outcome`` label of the request metric) and, for
429/503, how long to wait; :func:`error_response` is the only place that turns one into a
response. Answers that come from an engine are never rewritten: they pass through.
"""

from __future__ import annotations

import math

from aiohttp import web

__all__ = [
    "BadRequest",
    "GatewayError",
    "GatewayTimeout",
    "ModelNotFound",
    "NotFound",
    "Overloaded",
    "RotaGatewayError",
    "Unauthorized",
    "Unavailable",
    "error_body",
    "error_response",
]

_MAX_MESSAGE = 512


class RotaGatewayError(Exception):
    """Base of every error the gateway raises on purpose (one root per process): the
    answers it gives itself (:class:`GatewayError`), a binding file it cannot read, a
    start it cannot make, a form it cannot parse."""


class GatewayError(RotaGatewayError):
    """A request the gateway answers itself, with an OpenAI-style error body."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, code: str, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message[:_MAX_MESSAGE]
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.headers: dict[str, str] = {}
        """More headers of the answer (a held request's ``X-Rota-*``)."""


class BadRequest(GatewayError):
    """400, 408 or 413: the request itself is wrong; the status is given per instance."""

    type = "invalid_request_error"

    def __init__(self, message: str, *, code: str, status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(message, code=code, param=param)
        self.status = status


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist.", code="model_not_found",
                         param="model")


class Overloaded(GatewayError):
    """429: too many requests are already waiting for this model."""

    status = 429
    type = "rate_limit_error"


class Unavailable(GatewayError):
    """503: the model cannot serve now (a switch failed or took too long, no engine)."""

    status = 503
    type = "service_unavailable"


def error_body(message: str, *, type_: str, code: str | None,
               param: str | None = None) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: GatewayError, *, request_id: str | None = None,
                   dialect: str = "openai") -> web.Response:
    """The HTTP answer for ``err``; ``Retry-After`` in whole seconds when it has one.

    In the ``anthropic`` dialect (``/v1/messages``) the body also says ``"type": "error"``,
    which makes the same body Anthropic's error shape (``{"type": "error", "error":
    {"type", "message"}}``) as well as OpenAI's."""
    headers: dict[str, str] = dict(err.headers)
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    if request_id:
        headers["X-Request-Id"] = request_id
    body: dict[str, object] = dict(error_body(err.message, type_=err.type, code=err.code,
                                              param=err.param))
    if dialect == "anthropic":
        body["type"] = "error"
    return web.json_response(body, status=err.status, headers=headers)


class GatewayTimeout(GatewayError):
    """504: the engine took the request but did not answer in time; it is not sent again
    (the engine may still be working on it)."""

    status = 504
    type = "timeout_error"
