"""vLLM 0.26's development-mode control endpoints, with vLLM's exact quirks.

Served only with ``VLLM_SERVER_DEV_MODE=1`` (``dev_mode``); never authenticated.

- ``POST /sleep`` reads the query only (``level``, default 1; ``mode``, default
  ``abort``); 0.26 has no ``tags``. A JSON body is never read: ``{"level": 2}`` sleeps at
  level 1, as on a real vLLM. Answers 200 with an empty body once the executor slept; a
  sleep whose client leaves first still happens later (see :mod:`.engine`).
- ``POST /wake_up`` takes repeated ``tags`` (``weights``, ``kv_cache``; none means all);
  200 with an empty body; if any named tag is awake the whole call is skipped.
- ``GET /is_sleeping`` is true while the scheduler is paused or any tag sleeps.
- ``POST /collective_rpc`` takes ``{"method", "args", "kwargs", "timeout"}``; only
  ``reload_weights`` is implemented and answers ``{"results": [null]}`` (one per worker).
- ``POST /reset_prefix_cache`` answers ``{"success": bool}`` (false while requests run).
- ``GET /health`` (always served) answers 200 even while asleep: it proves nothing about
  a wake; 503 once the engine core is dead.

Each release speaks its own surface (``--vllm-version``, from the committed surfaces that
``e2e/tools/vllm_routes.py`` read from the wheels): ``GET /version`` (always served) names it;
``GET /openapi.json`` lists its routes (the development ones only in dev mode) with the
query parameters its handlers declare (0.26-0.31 read ``/sleep``'s raw, so none);
from 0.32 ``/sleep`` answers ``{"status": "sleeping", "level": N}`` and ``/wake_up``
``{"status": "awake"|"sleeping", "tags": ...}``. ``--sleep-ignores-requests`` (vLLM RFC
#51476): ``/sleep`` declares ``level`` only and sleeps under running requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from controller.lease.engines.surfaces import Surface, surface_for
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.state import Tag
from e2e.engine_simulator.traffic import PauseMode

__all__ = [
    "control_routes",
    "health_routes",
    "openapi",
    "release_routes",
    "respond_then_crash",
]

log = logging.getLogger(__name__)

_MODES = ("abort", "wait", "keep")


class RpcCall(BaseModel):
    """Body of ``POST /collective_rpc``; unknown keys are ignored, as vLLM ignores them."""

    model_config = ConfigDict(extra="ignore")

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


def _mode(request: web.Request) -> PauseMode:
    mode = request.query.get("mode", "abort")
    if mode not in _MODES:
        raise SimError(f"mode must be one of {', '.join(_MODES)}, not {mode!r}")
    return cast(PauseMode, mode)


def _tags(request: web.Request) -> list[Tag] | None:
    raw = request.query.getall("tags", [])
    if not raw:
        return None
    known = {tag.value: tag for tag in Tag}
    unknown = [t for t in raw if t not in known]
    if unknown:
        raise SimError(f"unknown memory tag(s) {unknown}; known: weights, kv_cache")
    return [known[t] for t in raw]


def _empty_ok() -> web.Response:
    return web.Response(status=200)


async def respond_then_crash(
    request: web.Request, reason: str, body: dict[str, Any] | None = None
) -> web.Response:
    """Send 200 first, then die: the caller sees success from an engine that is gone."""
    response = _empty_ok() if body is None else web.json_response(body)
    await response.prepare(request)
    await response.write_eof()
    asyncio.get_running_loop().call_soon(_engine(request).crash, reason)
    return response


def _omni_refuses(request: web.Request, name: str) -> None:
    if _engine(request).settings.omni:
        # vLLM's route calls engine_client.sleep(level, mode) positionally; AsyncOmni's
        # signature is sleep(stage_ids, level, mode): a TypeError, answered 500.
        raise SimError(f"Call to {name} method failed: TypeError: 'int' object is not "
                       f"iterable (vLLM-Omni: use /v1/omni/{name})", status=500,
                       err_type="InternalServerError")


async def sleep(request: web.Request) -> web.Response:
    _omni_refuses(request, "sleep")
    raw_level = request.query.get("level", "1")
    try:
        level = int(raw_level)
    except ValueError as exc:
        raise SimError(f"invalid literal for int() with base 10: {raw_level!r}") from exc
    if level not in (0, 1, 2):
        raise SimError(f"sleep level must be 0, 1 or 2, not {level}")
    engine = _engine(request)
    await engine.sleep(level=level, mode=_mode(request), request=request)
    body = {"status": "sleeping", "level": level} if _answers(request, "/sleep") else None
    if engine.faults.crash_on_sleep:
        return await respond_then_crash(request, "crash_on_sleep", body)
    return _empty_ok() if body is None else web.json_response(body)


async def wake_up(request: web.Request) -> web.Response:
    _omni_refuses(request, "wake_up")
    engine = _engine(request)
    tags = _tags(request)
    await engine.wake(tags=tags, request=request)
    if not _answers(request, "/wake_up"):
        return _empty_ok()
    return web.json_response({"status": "sleeping" if engine.state.is_sleeping else "awake",
                              "tags": [t.value for t in tags] if tags else None})


def _surface(request: web.Request) -> Surface:
    surface = surface_for(_engine(request).settings.vllm_version)
    assert surface is not None  # Settings checked it
    return surface


def _answers(request: web.Request, path: str) -> bool:
    """Whether this release's ``path`` answers a JSON body (0.32 on)."""
    control = _surface(request).control(path)
    return control is not None and any(r.body == "json" for r in control.replies)


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": _engine(request).is_sleeping})


async def collective_rpc(request: web.Request) -> web.Response:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SimError(f"JSON decode error: {exc}", err_type="Bad Request") from exc
    if not isinstance(body, dict):
        raise SimError("the request body must be a JSON object", err_type="Bad Request")
    if body.get("method") is None:
        raise SimError("Missing 'method' in request body", err_type="Bad Request")
    try:
        call = RpcCall.model_validate(body)
    except ValidationError as exc:
        raise SimError(str(exc), err_type="Bad Request") from exc
    if call.method != "reload_weights":
        raise SimError(
            f"Call to collective_rpc method failed: the engine simulator implements only "
            f"reload_weights, not {call.method!r}",
            status=500, err_type="InternalServerError",
        )
    engine = _engine(request)
    await engine.reload_weights(call.timeout)
    if engine.faults.empty_rpc_answers:
        return _empty_ok()
    return web.json_response({"results": [None]})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    engine = _engine(request)
    success = await engine.reset_prefix_cache()
    if engine.faults.empty_rpc_answers:
        return _empty_ok()
    return web.json_response({"success": success})


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    if mode not in _MODES:
        return web.json_response({"error": f"Invalid pause mode: {mode!r}"}, status=400)
    clear_cache = request.query.get("clear_cache", "true").lower() not in ("false", "0")
    await _engine(request).pause(cast(PauseMode, mode), request=request,
                                 clear_cache=clear_cache)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    await _engine(request).resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": _engine(request).paused})


async def health(request: web.Request) -> web.Response:
    return _empty_ok()


def control_routes() -> list[web.RouteDef]:
    """vLLM's development routes (mounted only in dev mode)."""
    return [
        web.post("/sleep", sleep),
        web.post("/wake_up", wake_up),
        web.get("/is_sleeping", is_sleeping),
        web.post("/collective_rpc", collective_rpc),
        web.post("/reset_prefix_cache", reset_prefix_cache),
        web.post("/pause", pause),
        web.post("/resume", resume),
        web.get("/is_paused", is_paused),
    ]


def health_routes() -> list[web.RouteDef]:
    return [web.get("/health", health)]


_DEV_ROUTES = frozenset({"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc",
                         "/reset_prefix_cache", "/release_kv_cache_memory", "/pause",
                         "/resume", "/is_paused", "/abort_requests"})
_RAW_TYPES = frozenset({"str", "list[str]", "json"})
"""Parameters a handler reads itself (``query_params.get``): FastAPI does not list them."""


def openapi(surface: Surface, *, dev_mode: bool, sleep_ignores_requests: bool
            ) -> dict[str, Any]:
    """The OpenAPI document FastAPI would serve for ``surface``: paths, methods and the
    query parameters each handler declares."""
    paths: dict[str, dict[str, Any]] = {}
    for route in surface.routes:
        if route.method == "WEBSOCKET" or (route.path in _DEV_ROUTES and not dev_mode):
            continue
        control = surface.control(route.path)
        params = [{"name": p.name, "in": "query"} for p in (control.params if control else ())
                  if p.where == "query" and p.type not in _RAW_TYPES]
        if route.path == "/sleep" and sleep_ignores_requests:
            params = [{"name": "level", "in": "query"}]  # RFC #51476: no mode
        paths.setdefault(route.path, {})[route.method.lower()] = {"parameters": params}
    return {"openapi": "3.1.0", "info": {"title": "FastAPI", "version": surface.version},
            "paths": paths}


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _engine(request).settings.vllm_version})


async def openapi_json(request: web.Request) -> web.Response:
    settings = _engine(request).settings
    return web.json_response(openapi(_surface(request), dev_mode=settings.dev_mode,
                                     sleep_ignores_requests=settings.sleep_ignores_requests))


def release_routes() -> list[web.RouteDef]:
    """``/version`` and ``/openapi.json``: always served, as by vLLM."""
    return [web.get("/version", version), web.get("/openapi.json", openapi_json)]
