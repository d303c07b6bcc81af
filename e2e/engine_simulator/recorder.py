"""What a hostile engine learns: every credential header sent to this simulator.

rota sends credentials to engines (the engine's API key on forwarded requests, rota's
control credential on control calls). A tenant runs its own engine, so a tenant can
record whatever reaches its pod's port. The simulator always records them, as a hostile
engine would, and ``GET /sim/headers`` shows the distinct values per header name; the
tenant-isolation tests then try those values against other tenants' engines.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = ["RECORDED_KEY", "recorded_headers", "recorder_middleware"]

RECORDED_KEY = web.AppKey("recorded_headers", dict[str, set[str]])
MAX_VALUES = 16
"""Distinct values kept per header (a bound, not a log)."""
_RECORDED = ("authorization", "x-rota-control-token", "x-rota-fence")


def recorder_middleware(app: web.Application) -> Middleware:
    app[RECORDED_KEY] = {}

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        seen = request.app[RECORDED_KEY]
        for name in _RECORDED:
            value = request.headers.get(name)
            if value is not None:
                values = seen.setdefault(name, set())
                if len(values) < MAX_VALUES:
                    values.add(value)
        return await handler(request)

    return record


async def recorded_headers(request: web.Request) -> web.Response:
    return web.json_response({name: sorted(values)
                              for name, values in request.app[RECORDED_KEY].items()})
