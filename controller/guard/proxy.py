"""The engine guard's HTTP side: check the credential a path needs, then pass the request
to the engine on loopback and its answer back, unbuffered.

- Request bodies are read whole but bounded (413 above the limit): an OpenAI request or a
  control call is small, and a bounded read cannot be used to exhaust the pod's memory.
- Answers stream through chunk by chunk as the engine sends them (SSE included), with the
  engine's status and headers (hop-by-hop ones dropped; bytes not decompressed).
- Every upstream call has a connect timeout and a read timeout (the longest silence
  between two pieces of the answer); control calls also a total one. A new connection per
  call (loopback): no pooled connection can be closed under a request by the engine's 5 s
  keep-alive.
- A client that goes away cancels its upstream call (vLLM then aborts the request).
- The path is classified and forwarded as one: the request target as received, refused
  (400) unless it is canonical (:func:`controller.guard.paths.target`), is sent byte for
  byte (a yarl URL built ``encoded=True``, which the client does not normalise again), so
  the engine routes on exactly the path the guard classified.
- Credentials: the engine's API key (``Authorization``) is passed to the engine, which may
  check it too; rota's control token (``X-Rota-Control-Token``) never leaves the guard.
- Fences: an accepted control call that carries ``X-Rota-Fence`` (the fencing numbers of
  the GPU Leases the controller acts under, :func:`rota.api.engine_guard.parse_fences`)
  raises the highest fence the guard remembers per Lease name; a control call whose fence
  for a Lease is lower than that is refused (409) and never forwarded. This closes what the
  controller's own fencing check cannot: an instance paused between reading its Lease and
  calling the engine, whose call lands after a newer instance has taken the Lease and has
  called this engine. A call without the header is not checked (the engine's own tooling, a
  controller older than the header during an upgrade): only holders of the claim's control
  token can send control calls at all, and a holder can already sleep and wake the engine
  as it likes, so the header protects rota from its own stale calls, not from a tenant.
  The memory lives as long as the guard: an engine that restarts starts awake anyway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from controller.credentials import Credential, bearer
from controller.guard.paths import Access, PathRefused, Target, classify, target
from controller.guard.settings import GuardSettings
from rota.api.engine_guard import (
    CONTROL_TOKEN_HEADER,
    FENCE_HEADER,
    FenceHeaderError,
    parse_fences,
)

__all__ = ["CREDENTIALS", "FENCES", "SESSION", "SETTINGS", "make_app"]

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", GuardSettings)
SESSION = web.AppKey("session", aiohttp.ClientSession)
CREDENTIALS = web.AppKey("credentials", dict[str, Credential | None])
FENCES = web.AppKey("fences", dict[str, int])
"""GPU Lease name to the highest fence of a control call this guard let through."""

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "transfer-encoding",
                         "upgrade", "host", "content-length"})


def _error(status: int, message: str, err_type: str) -> web.Response:
    """An error in vLLM's shape, so that clients read it as an engine's."""
    return web.json_response({"error": {"message": message, "type": err_type, "param": None,
                                        "code": status}}, status=status)


def _unauthorized() -> web.Response:
    return web.json_response({"error": "Unauthorized"}, status=401)


def _upstream_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        if name.lower() in _HOP_BY_HOP or name.lower() == CONTROL_TOKEN_HEADER.lower():
            continue
        headers.add(name, value)
    return headers


def _answer_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers.items():
        if name.lower() not in _HOP_BY_HOP:
            headers.add(name, value)
    return headers


async def _allowed(request: web.Request, access: Access) -> bool:
    credentials = request.app[CREDENTIALS]
    if access is Access.CONTROL:
        token = credentials["control"]
        return token is not None and await token.accepts(
            request.headers.get(CONTROL_TOKEN_HEADER))
    if access is Access.CLIENT:
        key = credentials["api_key"]
        return key is None or await key.accepts(bearer(request.headers.get("Authorization")))
    return access is Access.HEALTH


async def _body(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None when it is longer than ``limit``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _refused_path(request: web.Request, exc: PathRefused) -> web.Response:
    log.warning("request refused: the path is not canonical", extra={
        "path": request.raw_path[:200], "method": request.method, "reason": str(exc)})
    return _error(400, f"{exc}: the engine guard forwards only canonical paths",
                  "BadRequestError")


def _fenced_off(request: web.Request, fields: dict[str, Any]) -> web.Response | None:
    """The refusal of an authenticated control call whose fences are malformed (400) or
    lower, for some Lease, than one already let through (409); None to forward it, with
    its fences remembered. Check and update run without an ``await`` between them: no
    other call can slip in between."""
    value = request.headers.get(FENCE_HEADER)
    if value is None:
        return None
    try:
        fences = parse_fences(value)
    except FenceHeaderError as exc:
        log.warning("control call refused: malformed fence header", extra=fields | {
            "error": str(exc)})
        return _error(400, str(exc), "BadRequestError")
    highest = request.app[FENCES]
    stale = {name: fence for name, fence in fences.items() if fence < highest.get(name, fence)}
    if stale:
        seen = {name: highest[name] for name in stale}
        log.warning("control call refused: its fence is older than one already accepted",
                    extra=fields | {"fences": stale, "highest": seen})
        detail = ", ".join(f"{name} {fence} < {seen[name]}" for name, fence in stale.items())
        return _error(409, f"stale fence: a control call under a newer fence of the same GPU "
                      f"Lease was already accepted ({detail}); the sender no longer acts for "
                      "this GPU", "ConflictError")
    for name, fence in fences.items():
        highest[name] = max(fence, highest.get(name, fence))
    return None


async def forward(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    try:
        where = target(request.raw_path)
    except PathRefused as exc:
        return _refused_path(request, exc)
    access = classify(request.method, where.path)
    fields: dict[str, Any] = {"path": where.path, "method": request.method,
                              "access": access.value}
    if access is Access.HIDDEN:
        return web.json_response({"detail": "Not Found"}, status=404)
    if not await _allowed(request, access):
        log.warning("request refused: missing or wrong credential", extra=fields)
        return _unauthorized()
    control = access is Access.CONTROL
    if control and (refused := _fenced_off(request, fields)) is not None:
        return refused
    limit = settings.max_control_body_bytes if control else settings.max_body_bytes
    body = await _body(request, limit)
    if body is None:
        return _error(413, f"request body larger than {limit} bytes", "PayloadTooLarge")
    timeout = aiohttp.ClientTimeout(total=settings.control_timeout_s if control else None,
                                    sock_connect=settings.connect_timeout_s,
                                    sock_read=settings.read_timeout_s)
    began = time.monotonic()
    session = request.app[SESSION]
    response: web.StreamResponse | None = None
    try:
        async with session.request(request.method, _upstream_url(settings, where),
                                   headers=_upstream_headers(request), data=body or None,
                                   timeout=timeout, allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers=_answer_headers(upstream))
            await response.prepare(request)
            async for chunk in _chunks(upstream):
                await response.write(chunk)
            await response.write_eof()
            status = upstream.status
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        log.warning("engine not reachable", extra=fields | {"error": str(exc)[:200]})
        return _error(502, "the engine is not reachable", "BadGateway")
    except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        timed_out = isinstance(exc, TimeoutError)
        log.warning("engine did not answer in time" if timed_out else
                    "engine connection broke", extra=fields | {
                        "error": repr(exc)[:200],
                        "seconds": round(time.monotonic() - began, 3)})
        if response is not None and response.prepared:
            # The answer had started: cut the connection, so that the client sees a
            # broken answer and never mistakes the part it got for the whole.
            if request.transport is not None:
                request.transport.close()
            return response
        if timed_out:
            return _error(504, "the engine did not answer in time", "GatewayTimeout")
        return _error(502, "the engine closed the connection", "BadGateway")
    log.info("forwarded", extra=fields | {"status": status,
                                          "seconds": round(time.monotonic() - began, 6)})
    return response


def _upstream_url(settings: GuardSettings, where: Target) -> URL:
    """The engine's URL for ``where``, taken as already encoded: a client that normalised
    it (dot segments, percent-encoding) could send another path than the one classified."""
    return URL(settings.upstream + where.raw, encoded=True)


async def _chunks(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    async for chunk in upstream.content.iter_any():
        yield chunk


async def _session(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        app[SESSION] = session
        yield


def make_app(settings: GuardSettings, *, control: Credential,
             api_key: Credential | None) -> web.Application:
    """The guard as an aiohttp application; ``control`` and ``api_key`` already loaded."""
    app = web.Application(client_max_size=max(settings.max_body_bytes,
                                              settings.max_control_body_bytes) + 1)
    app[SETTINGS] = settings
    app[CREDENTIALS] = {"control": control, "api_key": api_key}
    app[FENCES] = {}
    app.cleanup_ctx.append(_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app
