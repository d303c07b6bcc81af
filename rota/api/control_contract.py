"""The engine-control contract between the driver and the engine guard.

Standard library only. The driver writes :data:`CONTROL_TOKEN_ENV` into the CDI
environment of every container of a claim with an engine config (``driver/cdi.py``,
``driver/control_tokens.py``); the engine guard (``controller/guard/``) reads it from its
own environment and admits control calls (``/sleep``, ``/wake_up``, ...) only with that
value; the lease controller obtains the same value from its node's driver
(``ControlToken`` of the inspection API) and sends it to that claim's engine only.

Compatibility: the variable's meaning never changes; a new derivation gets a new context
string in ``driver/control_tokens.py``, never a new meaning for this name.
"""

from __future__ import annotations

__all__ = ["CONTROL_TOKEN_ENV"]

CONTROL_TOKEN_ENV = "ROTA_CONTROL_TOKEN"
"""The claim's own control token (the guard removes it from the engine's environment)."""
