"""The optional control credential (``--control-token``).

rota's controller reaches an engine's control endpoints with a credential, so the
simulator can require one: with a token set, every control endpoint answers 401 unless the
request carries ``Authorization: Bearer <token>``. The OpenAI endpoints, ``/health``,
``/metrics`` and ``/sim/*`` stay open. The comparison takes constant time.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

__all__ = ["CONTROL_PATHS", "control_auth_middleware", "is_control_path"]

log = logging.getLogger(__name__)

CONTROL_PATHS = frozenset({
    "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
    "/pause", "/resume", "/is_paused",
})
_CONTROL_PREFIXES = ("/v1/omni/",)


def is_control_path(path: str) -> bool:
    return path in CONTROL_PATHS or path.startswith(_CONTROL_PREFIXES)


def control_auth_middleware(token: str) -> Middleware:
    """A middleware that guards the control endpoints with ``token``."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_control_path(request.path):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                log.warning("control call refused: missing or wrong bearer token",
                            extra={"path": request.path})
                return web.json_response({"error": "Unauthorized"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return guard
