"""The connection pool of every client of inference engines: the lease controller's
engine calls and the gateway's forwarded requests.

vLLM's server (uvicorn) closes a connection idle for 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``).
aiohttp keeps an idle connection for 15 s and hands out the one idle longest first, so
a call made 5 s after the last one on a connection is sent into a socket the engine is
closing at that moment: it fails as a close or as a reset. The engine never read it, but
a reset cannot be told from a connection broken after the request arrived, so a sleep
sent that way has an unknown outcome and leaves its GPU unsettled. A pool that never
reuses a connection idle for :data:`IDLE_CONNECTION_S` never meets that moment.
"""

from __future__ import annotations

import aiohttp

__all__ = ["IDLE_CONNECTION_S", "engine_connector"]

IDLE_CONNECTION_S = 2.0
"""A pooled connection idle longer than this is closed, not reused: well within the 5 s
after which vLLM closes it (an engine run with a keep-alive below this gets closes and
resets again)."""


def engine_connector(*, limit: int = 256, enable_cleanup_closed: bool = False
                     ) -> aiohttp.TCPConnector:
    """A connector for calls to engines (``limit``: connections open at once, 0 for no
    bound); made with a running event loop."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=IDLE_CONNECTION_S,
                                enable_cleanup_closed=enable_cleanup_closed)
