"""rota's gateway: an OpenAI-compatible server that routes each request to the awake engine.

One per cluster (several replicas are safe: the GPU Leases are the only truth they route
by). It learns every model from ResourceClaims and their pods, who is awake from the lease
controllers' GPU Leases, and asks a node's lease controller to switch when a request is for
a sleeping model. Entry points: :func:`~controller.gateway.app.make_app` (tests, embedding)
and ``python -m controller.gateway``.
"""

from __future__ import annotations

from controller.gateway.app import make_app, serve
from controller.gateway.routing import RoutingSource, RoutingState, StaticSource
from controller.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "RoutingSource", "RoutingState", "StaticSource", "make_app",
           "serve"]
