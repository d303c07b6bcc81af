"""The gateway's HTTP surface: vLLM's model routes, health, readiness and metrics.

Served, each routed by the request's ``model`` with the same places, queueing and
switching: every model-bearing route of the supported vLLM releases, 0.26 on
(:data:`MODEL_PATHS`, from :mod:`~controller.gateway.surface`: chat, completions,
responses, Anthropic's messages, audio transcriptions and translations, embeddings,
pooling, classify, score and rerank, tokenize and detokenize, Cohere's chat, decisions,
...; a GPU often holds a chat model next to an embedder or a reranker), each to the same
path on the engine; and ``/v1/models``. vLLM's other routes —
engines' control paths (``/sleep``, ``/wake_up``, ``/collective_rpc``, ...) above all — get
a 404 that names the route and why (:data:`~controller.gateway.surface.REFUSED`); any other
path a plain 404. No path is ever proxied by pattern, so no control call can slip through.

The model is read from the JSON body's ``model``, or from the ``model`` field of a
``multipart/form-data`` upload (the audio routes; the upload, up to
``--max-upload-bytes``, is passed on as it came, boundary and all). Only the paths that
stream (:data:`STREAMING_PATHS`) may get their answer started early as an event stream:
``stream: true`` elsewhere goes to the engine as it is, and its JSON answer is never
started early.

A model request is checked before it takes any place: API key (401), body size (413,
the body is read in bounded pieces and never past the limit), body arrival time (408),
body shape (400, JSON nested too deep or a form without its boundary included) and model
(404). Each refusal is an OpenAI-style error body and touches nothing another request
uses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from controller.gateway import keys
from controller.gateway.activation import Activator
from controller.gateway.dispatch import ModelRequest, count_refusal
from controller.gateway.errors import (
    CODES,
    BadRequest,
    Code,
    GatewayError,
    ModelNotFound,
    NotFound,
    Unauthorized,
    Unavailable,
    error_body,
    error_response,
)
from controller.gateway.forms import FormError, form_fields
from controller.gateway.metrics import UNKNOWN_MODEL
from controller.gateway.routing import ModelInfo
from controller.gateway.surface import OWN, REFUSED, ROUTED, Dialect, Routed

__all__ = ["MODEL_PATHS", "STREAMING_PATHS", "error_middleware", "routes"]

log = logging.getLogger(__name__)

MODEL_PATHS = tuple(route.path for route in ROUTED)
"""Paths routed by ``model``; each goes to the same path on the engine."""
STREAMING_PATHS = frozenset(route.path for route in ROUTED if route.streams)
"""The paths whose answer is an event stream when the body asks ``stream: true`` (the
others always answer JSON): only these may have their answer started early
(:mod:`~controller.gateway.downstream`)."""
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_READ_PIECE = 64 * 1024
_STARTED = int(time.time())

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Envelope(BaseModel):
    """The fields of a generation request the gateway looks at; the rest passes as is."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=512)
    stream: StrictBool | None = False


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def _authorize(request: web.Request) -> None:
    if not request.app[keys.API_KEYS].admits(request.headers.get("Authorization")):
        raise Unauthorized("Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                           code=Code.INVALID_API_KEY)


async def _read_body(request: web.Request, limit: int) -> bytes:
    settings = request.app[keys.SETTINGS]
    too_large = BadRequest(f"The request body exceeds {limit} bytes.",
                           code=Code.REQUEST_TOO_LARGE)
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    data = bytearray()
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            while chunk := await request.content.read(_READ_PIECE):
                data += chunk
                if len(data) > limit:
                    raise too_large
    except TimeoutError:
        raise BadRequest(f"The request body did not arrive within {settings.body_timeout_s:g} "
                         "seconds.", code=Code.REQUEST_TIMEOUT) from None
    except web.RequestPayloadError as exc:
        # aiohttp decodes the Content-Encoding (and the chunked framing) as it reads: a
        # body that does not decode is the client's error, not the gateway's 500.
        raise BadRequest(f"The request body could not be read: {_cause(exc)}",
                         code=Code.INVALID_BODY) from None
    return bytes(data)


def _cause(exc: BaseException) -> str:
    """What went wrong reading a body, in one short line (aiohttp's message spans lines)."""
    cause = exc.__cause__ or exc
    text = " ".join(str(getattr(cause, "message", "") or cause).split())
    return text[:200] or type(cause).__name__


_TRUE = frozenset({"true", "1", "yes", "on", "t", "y"})
"""A form's ``stream`` values that mean yes (as pydantic reads a form's booleans)."""


def _parse_form(raw: bytes, content_type: str) -> _Envelope:
    """The ``model`` and ``stream`` fields of a ``multipart/form-data`` upload."""
    try:
        fields = form_fields(raw, content_type, ("model", "stream"))
    except FormError as exc:
        raise BadRequest(f"The body is not a readable form: {exc}.",
                         code=Code.INVALID_FORM) from None
    model = fields.get("model", "").strip()
    if not model:
        raise BadRequest("The 'model' form field is required (a non-empty string).",
                         code=Code.MISSING_MODEL, param="model")
    try:
        return _Envelope(model=model,
                         stream=fields.get("stream", "").strip().lower() in _TRUE)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise BadRequest(f"Invalid request: model: {err['msg']}", code=Code.INVALID_VALUE,
                         param="model") from None


def _parse(raw: bytes) -> _Envelope:
    try:
        obj: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"The body is not valid JSON: {exc}", code=Code.INVALID_JSON) from None
    except RecursionError:
        raise BadRequest("The body is nested too deeply.", code=Code.INVALID_JSON) from None
    if not isinstance(obj, dict):
        raise BadRequest("The body must be a JSON object.", code=Code.INVALID_JSON)
    if not isinstance(obj.get("model"), str) or not obj["model"]:
        raise BadRequest("The 'model' field is required (a non-empty string).",
                         code=Code.MISSING_MODEL, param="model")
    try:
        return _Envelope.model_validate(obj)
    except RecursionError:
        raise BadRequest("The body is nested too deeply.", code=Code.INVALID_JSON) from None
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise BadRequest(f"Invalid request: {param}: {err['msg']}", code=Code.INVALID_VALUE,
                         param=param) from None


async def _refuse(request: web.Request, err: GatewayError, model: str,
                  request_id: str, *, dialect: Dialect = "openai") -> web.Response:
    count_refusal(request.app[keys.METRICS], model, err)
    level = logging.WARNING if err.status >= 500 else logging.INFO
    log.log(level, "request refused", extra={
        "model": model, "request_id": request_id, "status": err.status, "code": err.code})
    response = error_response(err, request_id=request_id, dialect=dialect)
    if err.status in (408, 413) or err.code == "invalid_body":
        # The rest of the body was not read: answer, then close the connection at once
        # rather than linger reading what a slow or oversized client still sends.
        response.force_close()
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            pass
        if request.transport is not None:
            request.transport.close()
    return response


async def _model_request(request: web.Request, route: Routed) -> web.StreamResponse:
    arrived = time.perf_counter()
    request_id = _request_id(request)
    state = request.app[keys.STATE]
    settings = request.app[keys.SETTINGS]
    model = UNKNOWN_MODEL
    try:
        _authorize(request)
        if route.body == "form":
            content_type = request.headers.get("Content-Type", "")
            raw = await _read_body(request, settings.max_upload_bytes)
            envelope = _parse_form(raw, content_type)
        else:
            content_type = "application/json"
            raw = await _read_body(request, settings.max_body_bytes)
            envelope = _parse(raw)
        if not state.knows(envelope.model):
            if not state.synced:
                raise Unavailable("The gateway has not yet learned where models live.",
                                  code=Code.NOT_READY,
                                  retry_after=request.app[keys.SETTINGS].retry_after_s)
            raise ModelNotFound(envelope.model)
        model = envelope.model
        gen = ModelRequest(path=route.path, model=model,
                           stream=bool(envelope.stream) and route.streams,
                           body=raw, request_id=request_id, arrived=arrived,
                           content_type=content_type, dialect=route.dialect)
        return await request.app[keys.DISPATCHER].serve(request, gen)
    except GatewayError as err:
        return await _refuse(request, err, model, request_id, dialect=route.dialect)
    except asyncio.CancelledError:
        # The client left while the request waited or streamed; its place and its engine
        # request are already given back by the blocks it was cancelled in.
        request.app[keys.METRICS].requests.labels(model, "client_gone").inc()
        log.info("client left", extra={"model": model, "request_id": request_id})
        raise


def _handler(route: Routed) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _model_request(request, route)

    handle.__name__ = "model_request_" + route.path.strip("/").replace("/", "_")
    return handle


def _not_routed(path: str, reasons: dict[str, str]) -> Handler:
    """A vLLM route the gateway refuses: 404 naming the route and why (``reasons`` by
    method; any other method gets the first reason)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        method = "WEBSOCKET" if request.headers.get("Upgrade", "").lower() == "websocket" \
            else request.method
        reason = reasons.get(method) or next(iter(reasons.values()))
        return error_response(
            NotFound(f"The gateway does not route {request.method} {path}: {reason}.",
                     code=Code.ROUTE_NOT_ROUTED), request_id=_request_id(request))

    handle.__name__ = "not_routed_" + path.strip("/").replace("/", "_")
    return handle


def _refused_routes() -> list[web.RouteDef]:
    """One handler per refused path, answering every method (vLLM's own methods name
    their reason)."""
    by_path: dict[str, dict[str, str]] = {}
    for (method, path), reason in REFUSED.items():
        by_path.setdefault(path, {})[method] = reason
    own = {path for _, path in OWN}
    return [web.route("*", path, _not_routed(path, reasons))
            for path, reasons in by_path.items() if path not in own]


def _model_object(info: ModelInfo, activator: Activator) -> dict[str, Any]:
    """One model in the OpenAI shape, with rota's view of it under ``rota`` (a key OpenAI
    clients ignore): see :func:`list_models`."""
    expected = 0.0 if info.state == "awake" else activator.expected_wake_s(info.model)
    rota: dict[str, Any] = {"state": info.state, "gpus": list(info.gpus),
                            "nodes": sorted({gpu.partition("/")[0] for gpu in info.gpus}),
                            "awake_on": list(info.awake_on),
                            "awake_with": list(info.awake_with),
                            "expected_wake_s": expected}
    if info.last_error:
        rota["last_error"] = info.last_error
    return {"id": info.model, "object": "model", "created": _STARTED, "owned_by": "rota",
            "rota": rota}


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: ``{"object": "list", "data": [model, ...]}``, each model
    ``{"id", "object": "model", "created", "owned_by": "rota", "rota": {...}}`` where
    ``rota`` holds:

    - ``state``: ``awake`` (an engine serves it now), ``asleep`` (a request wakes it),
      ``starting`` (an engine of it is starting up, admitted by its node's controller),
      ``switching`` (a switch to or from it runs), ``failed`` (its last switch failed);
    - ``gpus``: ``<node>/<gpu>`` of every GPU where one of its engines runs; ``nodes``: those
      nodes;
    - ``awake_on``: the GPUs where an engine of it is awake now (empty unless ``awake``);
      ``awake_with``: the other models awake on those GPUs, the rest of their awake sets
      (empty where one engine is awake per GPU, rota's default);
    - ``expected_wake_s``: seconds a request should expect to wait for it to be switched in,
      from the switch costs its node's controller measured (0 when awake; null when no
      controller has said yet);
    - ``last_error``: the reason of the last failed switch, when it failed.
    """
    request_id = _request_id(request)
    try:
        _authorize(request)
    except GatewayError as err:
        return await _refuse(request, err, UNKNOWN_MODEL, request_id)
    infos = request.app[keys.STATE].model_infos()
    activator = request.app[keys.DISPATCHER].activator
    return web.json_response({"object": "list",
                              "data": [_model_object(i, activator) for i in infos]},
                             headers={"X-Request-Id": request_id})


async def get_model(request: web.Request) -> web.Response:
    request_id = _request_id(request)
    wanted = request.match_info["model"]
    try:
        _authorize(request)
        for info in request.app[keys.STATE].model_infos():
            if info.model == wanted:
                return web.json_response(
                    _model_object(info, request.app[keys.DISPATCHER].activator),
                                         headers={"X-Request-Id": request_id})
        raise ModelNotFound(wanted)
    except GatewayError as err:
        return await _refuse(request, err, UNKNOWN_MODEL, request_id)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    if request.app[keys.STATE].synced and not request.app[keys.STOPPING].is_set():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not_ready"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    known = request.app[keys.STATE].models()
    request.app[keys.PLACES].prune(known)
    metrics = request.app[keys.METRICS]
    metrics.prune(known)
    metrics.ignored_claimants.set(request.app[keys.STATE].ignored_claimants)
    return web.Response(body=metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unrouted paths and wrong methods answer in the OpenAI error shape."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(NotFound(f"Not found: {request.path[:200]}", code=Code.NOT_FOUND))
    except web.HTTPMethodNotAllowed as exc:
        return web.json_response(
            error_body(f"Method {request.method} not allowed here.",
                       type_=CODES[Code.METHOD_NOT_ALLOWED].type,
                       code=Code.METHOD_NOT_ALLOWED),
            status=CODES[Code.METHOD_NOT_ALLOWED].status,
            headers={"Allow": ",".join(sorted(exc.allowed_methods))})


def routes() -> list[web.RouteDef]:
    return [
        *(web.post(route.path, _handler(route)) for route in ROUTED),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", get_model),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        *_refused_routes(),
    ]
