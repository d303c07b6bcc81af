"""Secrets the gateway reads from files: client API keys and the activation token.

Both come from mounted Kubernetes Secrets, never from flags or environment values, so they
do not show up in process listings or pod specs. The files are re-read periodically (a
Secret update reaches a mounted volume without a restart); a failed re-read (a missing
file, a published placeholder, bytes that are not UTF-8 text) keeps the last good value,
is logged and counted, and the re-reads go on. Key checks compare in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["PLACEHOLDERS", "ApiKeys", "PlaceholderSecret", "SecretFile", "UnreadableSecret",
           "bearer", "reload_forever"]

log = logging.getLogger(__name__)

PLACEHOLDERS = frozenset({"change-me-before-applying", "change-me", "changeme", "replace-me"})
"""Values published in manifests and docs: known to everyone, so never a credential."""


class PlaceholderSecret(OSError):
    """The file holds a published placeholder. An ``OSError``, so it stops a component at
    start like an unreadable file, and a periodic re-read keeps the last good value."""


class UnreadableSecret(OSError):
    """The file is not UTF-8 text. An ``OSError`` for the same reasons as
    :class:`PlaceholderSecret`."""


class SecretFile:
    """The non-empty, non-comment lines of one file, loaded off the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: tuple[str, ...] = ()

    @property
    def lines(self) -> tuple[str, ...]:
        return self._lines

    async def load(self) -> None:
        """Read the file now.

        Raises:
            OSError: it cannot be read, is not UTF-8 text (:class:`UnreadableSecret`) or
                holds a placeholder (:class:`PlaceholderSecret`); the caller decides
                whether that is fatal.
        """
        raw = await asyncio.to_thread(self.path.read_bytes)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnreadableSecret(f"{self.path} is not UTF-8 text (byte {exc.start} of "
                                   f"{len(raw)})") from None
        lines = tuple(line.strip() for line in text.splitlines()
                      if line.strip() and not line.strip().startswith("#"))
        if PLACEHOLDERS.intersection(lines):
            raise PlaceholderSecret(f"{self.path} holds a published placeholder, not a secret")
        self._lines = lines


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeys:
    """Client API keys; with no file every client is admitted."""

    def __init__(self, secret: SecretFile | None) -> None:
        self.secret = secret

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def admits(self, authorization: str | None) -> bool:
        if self.secret is None:
            return True
        token = bearer(authorization)
        if token is None:
            return False
        presented = token.encode()
        found = False
        for key in self.secret.lines:
            found |= hmac.compare_digest(presented, key.encode())
        return found


async def reload_forever(files: Sequence[SecretFile], every_s: float, *,
                         failed: Callable[[SecretFile, OSError], None] | None = None) -> None:
    """Re-read ``files`` every ``every_s`` seconds until cancelled. A file that cannot be
    read keeps its last value; ``failed`` is told (to count it)."""
    while True:
        await asyncio.sleep(every_s)
        for secret in files:
            try:
                await secret.load()
            except OSError as exc:
                log.warning("could not re-read a secret file; keeping the last value",
                            extra={"path": str(secret.path), "error": str(exc)})
                if failed is not None:
                    failed(secret, exc)
