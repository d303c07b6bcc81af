"""The contract of the engine guard with the lease controller's engine adapters and with
the gateway.

The guard (:mod:`controller.guard`) sits in front of an engine and lets control calls
(sleep, wake, reset) through only with rota's control token; the adapters
(:mod:`controller.lease.engines`) send it. Client requests pass on the paths the gateway
forwards (:mod:`controller.api.client_routes`), with the engine's own API key. Standard
library only: the guard imports nothing of the lease controller or the gateway.
"""

from __future__ import annotations

__all__ = ["CONTROL_TOKEN_HEADER"]

CONTROL_TOKEN_HEADER = "X-Rota-Control-Token"
"""The header carrying rota's control token on control calls (checked by the engine
guard; vLLM ignores it). ``Authorization`` is left to the engine's own API key."""
