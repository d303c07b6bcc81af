"""Who a rota process is to the API server, and how fast it may talk to it.

Every process names itself in the User-Agent (``rota-driver/<version>``,
``rota-controller/<version>``, ``rota-gateway/<version>``, ``kubectl-rota/<version>``), so
the API server's metrics and audit log attribute rota's load per component, and sends its
requests through a token bucket (``qps`` refilled per second, at most ``burst`` at once), as
client-go's default client does: a relist or a controller start queues here instead of
arriving at the API server all at once. A watch costs one token when it opens.

The bucket sits under the official client's REST layer, which runs in worker threads
(:mod:`rota.kit.kube` calls it through ``asyncio.to_thread``), so waiting for a token blocks a
worker thread, never the event loop. The version comes from the installed package's
metadata, whose one source is ``pyproject.toml``.

Each ``__main__`` calls :func:`use` once with its settings; :func:`load_api_client` in
:mod:`rota.kit.kube` then applies it to every client the process builds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

PACKAGE = "rota"


def version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@dataclass(frozen=True)
class ClientAgent:
    component: str
    """``rota-driver``, ``rota-controller``, ``rota-gateway`` or ``kubectl-rota``."""
    qps: float = 0.0
    """Requests per second on average; 0 means no client-side limit."""
    burst: int = 1
    """Requests that may go out at once after a quiet spell."""

    @property
    def user_agent(self) -> str:
        return f"{self.component}/{version()}"


class TokenBucket:
    """Thread-safe: ``take`` blocks the calling thread until a token is there."""

    def __init__(self, *, qps: float, burst: int,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs qps > 0 and burst >= 1 ({qps}, {burst})")
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()

    def reserve(self) -> float:
        """Take a token (possibly one not yet there); the seconds to wait before using it."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1.0
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def take(self) -> None:
        wait = self.reserve()
        if wait > 0:
            self._sleep(wait)


_process_agent = ClientAgent(component="rota")


def use(agent: ClientAgent) -> None:
    """Set this process's identity and limit (from ``__main__``, once)."""
    global _process_agent
    _process_agent = agent


def process_agent() -> ClientAgent:
    return _process_agent


def apply(api: Any, agent: ClientAgent | None = None) -> Any:
    """``api`` (the official client's ``ApiClient``; this module does not import the
    client, see ``tests/test_layering.py``) sends ``agent``'s User-Agent and waits for
    ``agent``'s bucket before each request."""
    agent = agent or _process_agent
    api.user_agent = agent.user_agent
    if agent.qps > 0:
        bucket = TokenBucket(qps=agent.qps, burst=agent.burst)
        rest = api.rest_client
        send = rest.request

        def limited(*args: Any, **kwargs: Any) -> Any:
            bucket.take()
            return send(*args, **kwargs)

        rest.request = limited
    return api
