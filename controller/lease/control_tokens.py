"""Each claim's control token, asked of the node's driver once and kept per claim uid.

The engine guard of a claim admits control calls only with that claim's token
(:mod:`driver.control_tokens`). The controller never reads the driver's key: it asks the
driver's inspection API (``ControlToken``) the first time it calls a claim's engine, keeps
the answer while the claim is on the node, and sends it to that claim's engine only (a
gang's engines, one claim, share it). The token of a claim never changes while the claim
stays prepared, so a kept token is never stale; tokens of claims that left are dropped
(:meth:`ControlTokens.keep_only`), so the cache follows the node's claims.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

__all__ = ["ControlTokens"]

Fetch = Callable[[str], Awaitable[str]]


class ControlTokens:
    """Control tokens by claim uid; concurrent first calls for one claim share one ask."""

    def __init__(self, fetch: Fetch) -> None:
        """``fetch``: asks the driver for a claim's token (raises when it cannot)."""
        self._fetch = fetch
        self._tokens: dict[str, str] = {}
        self._asking: dict[str, asyncio.Future[str]] = {}
        self._generation: dict[str, int] = {}
        """Per claim uid in flight: which ask may store its answer (see :meth:`_ask`)."""
        self._asks = 0

    async def get(self, claim_uid: str) -> str:
        """The token of ``claim_uid``; a failed ask raises and is not kept (the next call
        asks again)."""
        token = self._tokens.get(claim_uid)
        if token is not None:
            return token
        asking = self._asking.get(claim_uid)
        if asking is None:
            self._asks += 1
            self._generation[claim_uid] = self._asks
            asking = asyncio.ensure_future(self._ask(claim_uid, self._asks))
            asking.add_done_callback(_retrieved)
            self._asking[claim_uid] = asking
        # Shielded: one caller that is cancelled (its switch fenced) does not fail the
        # others waiting on the same ask.
        return await asyncio.shield(asking)

    async def _ask(self, claim_uid: str, generation: int) -> str:
        """Ask the driver; keep the answer only while this ask is still the claim's own:
        a claim that :meth:`keep_only` dropped meanwhile (it left the node) must not get
        a token back into the cache after its drop."""
        try:
            token = await self._fetch(claim_uid)
            if self._generation.get(claim_uid) == generation:
                self._tokens[claim_uid] = token
            return token
        finally:
            if self._generation.get(claim_uid) == generation:
                del self._generation[claim_uid]
                self._asking.pop(claim_uid, None)

    def keep_only(self, claim_uids: Collection[str]) -> None:
        """Forget the tokens of every claim not in ``claim_uids`` (claims that left), and
        disown their asks in flight (their answers are not kept)."""
        for uid in [u for u in self._tokens if u not in claim_uids]:
            del self._tokens[uid]
        for uid in [u for u in self._generation if u not in claim_uids]:
            del self._generation[uid]
            self._asking.pop(uid, None)

    def source(self, claim_uid: str) -> Callable[[], Awaitable[str]]:
        """A zero-argument getter of ``claim_uid``'s token, for an engine endpoint."""
        async def token() -> str:
            return await self.get(claim_uid)
        return token


def _retrieved(future: asyncio.Future[str]) -> None:
    """Mark a failed ask's error as seen: every caller may have been cancelled meanwhile,
    and the next call asks again anyway."""
    if not future.cancelled():
        future.exception()
