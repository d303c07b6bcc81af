"""The start-gate contract between an engine's gate and its node's lease controller.

Standard library only: the engine-side gate (``rota-engine-gate``) runs inside the engine's
image as a self-contained zipapp, which carries this module. Three parties speak it:

- the driver writes :data:`SOCKET_ENV` and :data:`TOKEN_ENV` (with :data:`CLAIM_UID_ENV`)
  into the CDI environment of every container of a claim with an engine config
  (``driver/cdi.py``, ``driver/startgate.py``);
- the gate (``controller/engine_gate.py``) asks ``POST`` :data:`PATH` on the socket with a
  :class:`StartQuestion` and starts the engine once a :class:`StartAnswer` grants it;
- the lease controller (``controller/lease/starts.py``) answers, its pydantic models
  checked field by field against these (``tests/controller/test_start_contract.py``).

It lives in ``driver/`` because the driver writes it and never imports the controller; the
controller takes it as one of the driver's shared modules.

Compatibility: readers ignore keys they do not know; a key is never reused for another
meaning; a removed key is still read and dropped for one release.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["CLAIM_UID_ENV", "MAX_BODY_BYTES", "PATH", "SOCKET_ENV", "TOKEN_ENV",
           "StartAnswer", "StartQuestion"]

PATH = "/v1/start"
SOCKET_ENV = "ROTA_START_SOCKET"
"""The controller's start-gate socket, as the container sees it (the same host path)."""
TOKEN_ENV = "ROTA_START_TOKEN"
"""The claim's own token (the gate removes it from the engine's environment)."""
CLAIM_UID_ENV = "ROTA_CLAIM_UID"
MAX_BODY_BYTES = 4096
"""A question longer than this is answered 413 (a gate's is about 150 bytes)."""


class StartQuestion(TypedDict):
    claim_uid: str
    token: str
    attempt: int
    """How many times this gate asked before (for logs)."""


class StartAnswer(TypedDict):
    granted: bool
    reason: str
    message: str
    retry_after_s: float
    """Ask again after this long (0: at once; the long poll holds anyway)."""
