"""The gateway's own errors and their one mapping to OpenAI-shaped HTTP answers.

Clients of an OpenAI-compatible server expect ``{"error": {"message", "type", "param",
"code"}}``. Every refusal the gateway makes itself is a :class:`GatewayError` carrying its
status, a stable ``code`` (also the ``outcome`` label of the request metric) and, for
429/503, how long to wait; :func:`error_response` is the only place that turns one into a
response. Answers that come from an engine are never rewritten: they pass through.

Every fixed code is a :class:`Code`, and :data:`CODES` gives each its status and type: the
one table the raising code and docs/api.md's error table are both checked against (a code
added here and not documented fails tests/docs). Codes that are not fixed come from
elsewhere: a controller's switch failure reason, and ``upstream_<status>``
(:class:`EngineRefused`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import NamedTuple

from aiohttp import web

__all__ = [
    "CODES",
    "BadRequest",
    "Code",
    "EngineRefused",
    "GatewayError",
    "GatewayTimeout",
    "ModelNotFound",
    "NotFound",
    "Overloaded",
    "RotaGatewayError",
    "Shape",
    "Unauthorized",
    "Unavailable",
    "error_body",
    "error_response",
]

_MAX_MESSAGE = 512


class Code(StrEnum):
    """Every fixed ``code`` of an answer the gateway gives itself."""

    INVALID_JSON = "invalid_json"
    MISSING_MODEL = "missing_model"
    INVALID_FORM = "invalid_form"
    INVALID_BODY = "invalid_body"
    INVALID_VALUE = "invalid_value"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    ROUTE_NOT_ROUTED = "route_not_routed"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TIMEOUT = "request_timeout"
    REQUEST_TOO_LARGE = "request_too_large"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    NOT_READY = "not_ready"
    NO_SERVING_ENGINE = "no_serving_engine"
    SWITCH_TIMEOUT = "switch_timeout"
    NO_CONTROLLER = "no_controller"
    CONTROLLER_LOST = "controller_lost"
    CONTROLLER_UNREACHABLE = "controller_unreachable"
    BAD_ACTIVATION_REQUEST = "bad_activation_request"
    BAD_ACTIVATION_ANSWER = "bad_activation_answer"
    ACTIVATION_UNAUTHORIZED = "activation_unauthorized"
    ACTIVATION_HTTP_4XX = "activation_http_4xx"
    ACTIVATION_HTTP_5XX = "activation_http_5xx"
    ACTIVATION_HTTP_OTHER = "activation_http_other"
    OTHER = "other"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    LOST_GPU = "lost_gpu"
    ENGINE_KEY_UNAVAILABLE = "engine_key_unavailable"
    ENGINE_KEY_PLACEHOLDER = "engine_key_placeholder"
    ENGINE_BROKE_OFF = "engine_broke_off"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    INTERNAL_ERROR = "internal_error"


class Shape(NamedTuple):
    """The HTTP status and OpenAI error ``type`` of a code."""

    status: int
    type: str


_BAD = "invalid_request_error"
_DOWN = "service_unavailable"
CODES: Mapping[Code, Shape] = MappingProxyType({
    Code.INVALID_JSON: Shape(400, _BAD),
    Code.MISSING_MODEL: Shape(400, _BAD),
    Code.INVALID_FORM: Shape(400, _BAD),
    Code.INVALID_BODY: Shape(400, _BAD),
    Code.INVALID_VALUE: Shape(400, _BAD),
    Code.INVALID_API_KEY: Shape(401, "authentication_error"),
    Code.MODEL_NOT_FOUND: Shape(404, _BAD),
    Code.ROUTE_NOT_ROUTED: Shape(404, _BAD),
    Code.NOT_FOUND: Shape(404, _BAD),
    Code.METHOD_NOT_ALLOWED: Shape(405, _BAD),
    Code.REQUEST_TIMEOUT: Shape(408, _BAD),
    Code.REQUEST_TOO_LARGE: Shape(413, _BAD),
    Code.QUEUE_FULL: Shape(429, "rate_limit_error"),
    **{code: Shape(503, _DOWN) for code in (
        Code.QUEUE_TIMEOUT, Code.NOT_READY, Code.NO_SERVING_ENGINE, Code.SWITCH_TIMEOUT,
        Code.NO_CONTROLLER, Code.CONTROLLER_LOST, Code.CONTROLLER_UNREACHABLE,
        Code.BAD_ACTIVATION_REQUEST, Code.BAD_ACTIVATION_ANSWER, Code.ACTIVATION_UNAUTHORIZED,
        Code.ACTIVATION_HTTP_4XX, Code.ACTIVATION_HTTP_5XX, Code.ACTIVATION_HTTP_OTHER,
        Code.OTHER, Code.UPSTREAM_UNREACHABLE, Code.LOST_GPU, Code.ENGINE_KEY_UNAVAILABLE,
        Code.ENGINE_KEY_PLACEHOLDER, Code.ENGINE_BROKE_OFF)},
    Code.UPSTREAM_TIMEOUT: Shape(504, "timeout_error"),
    Code.INTERNAL_ERROR: Shape(500, "server_error"),
})
"""The status and type of every :class:`Code`: a :class:`GatewayError` with a fixed code
takes both from here, whatever its class says (the classes stay for ``except``)."""
_FIXED = frozenset(str(code) for code in Code)


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
        if code in _FIXED:
            self.status, self.type = CODES[Code(code)]
        self.param = param
        self.retry_after = retry_after
        self.headers: dict[str, str] = {}
        """More headers of the answer (a held request's ``X-Rota-*``)."""


class BadRequest(GatewayError):
    """400, 408 or 413: the request itself is wrong; its code's :data:`CODES` row gives
    the status."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist.", code=Code.MODEL_NOT_FOUND,
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


class EngineRefused(GatewayError):
    """An engine's refusal (``upstream_<status>``, the engine's status) that can only be
    the last event of an event stream already begun: nothing of the engine's answer was
    sent yet when the gateway started the stream during a switch. When the engine said why
    in OpenAI's error shape, its own error object is sent instead."""

    type = "upstream_error"

    def __init__(self, message: str, *, status: int, retry_after: float | None = None) -> None:
        super().__init__(message, code=f"upstream_{status}", retry_after=retry_after)
        self.status = status


class GatewayTimeout(GatewayError):
    """504: the engine took the request but did not answer in time; it is not sent again
    (the engine may still be working on it)."""

    status = 504
    type = "timeout_error"
