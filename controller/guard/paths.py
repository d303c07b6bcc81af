"""Which requests the engine guard lets through, and with which credential. Pure.

- ``client``: the surface the gateway forwards (``/v1*`` and every path of
  :data:`controller.api.client_routes.CLIENT_PATHS`: pooling, scoring, reranking, tokens,
  ...): the engine's API key, when one is configured;
- ``control``: rota's control calls: rota's control token;
- ``health``: ``GET /health``, open (kubelet probes; vLLM answers 503 once dead);
- ``hidden``: everything else (vLLM's ``/pause``, ``/resume``, ``/abort_requests``,
  ``/update_weights``, profiling, ...): 404, never forwarded.
"""

from __future__ import annotations

import enum

from controller.api.client_routes import CLIENT_PATHS

__all__ = ["CONTROL_CALLS", "Access", "classify"]


class Access(enum.StrEnum):
    CLIENT = "client"
    CONTROL = "control"
    HEALTH = "health"
    HIDDEN = "hidden"


CONTROL_CALLS: frozenset[tuple[str, str]] = frozenset({
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("GET", "/metrics"),
    ("GET", "/metrics/"),
})
"""What rota's engine adapters call (vLLM's development routes they need, and metrics)."""
_CONTROL_PREFIX = "/v1/omni/"
"""vLLM-Omni's stage-aware sleep and wakeup: control calls, though under ``/v1``."""


def classify(method: str, path: str) -> Access:
    """How the guard treats ``method path``."""
    if path.startswith(_CONTROL_PREFIX):
        return Access.CONTROL if method == "POST" else Access.HIDDEN
    if (method, path) in CONTROL_CALLS:
        return Access.CONTROL
    if path == "/health" and method in ("GET", "HEAD"):
        return Access.HEALTH
    if path == "/v1" or path.startswith("/v1/") or path in CLIENT_PATHS:
        return Access.CLIENT
    return Access.HIDDEN
