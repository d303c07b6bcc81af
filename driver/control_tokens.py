"""Control tokens: one per claim, so that what one engine learns opens no other.

The engine guard admits control calls (sleep, wake, ``collective_rpc``, ...) only with its
claim's control token, and the lease controller sends each engine only its own claim's
token. An engine is tenant code at an address the tenant chooses (its pod IP and
``enginePort``), so whatever the controller sends there must be worth nothing anywhere
else: a token shared by every engine, recorded by one tenant, would open every other
tenant's engine.

The token is HMAC-SHA256 of the claim uid under the node key (the start gate's key, in the
driver's data directory, never mounted into any container), with a context string of its
own so that it is never equal to the claim's start-gate token. It is deterministic: an
idempotent prepare writes byte-identical CDI specs, and a restarted driver or controller
derives the same value. It lives as long as the claim's preparation on this node; a new
node key (the key file removed) gives every claim prepared afterwards a new token, and
the engines prepared before keep the old one until their claims are prepared again. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from driver.startgate import KEY_BYTES, claim_token
from rota.api.control_contract import CONTROL_TOKEN_ENV

__all__ = ["ControlTokens"]

_CONTEXT = b"rota engine control v1\0"


@dataclass(frozen=True)
class ControlTokens:
    """Derives claims' control tokens from the node key."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < KEY_BYTES:
            raise ValueError(f"a control-token key has at least {KEY_BYTES} bytes")

    def token(self, claim_uid: str) -> str:
        """The control token of one claim.

        Raises:
            ValueError: ``claim_uid`` is empty (no claim to bind the token to).
        """
        if not claim_uid:
            raise ValueError("a control token needs a claim uid")
        return claim_token(self.key, _CONTEXT, claim_uid)

    def environment(self, claim_uid: str) -> dict[str, str]:
        """The CDI environment entry that gives a claim's containers their token."""
        return {CONTROL_TOKEN_ENV: self.token(claim_uid)}
