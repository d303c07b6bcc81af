"""Credentials from mounted Secret files, compared in constant time: one home for the
gateway's client API keys and activation token, the controller's activation token and the
guard's two credentials (its API key from a file; its control token, the claim's own, a
:class:`FixedCredential` from its environment).

Secrets come from mounted Kubernetes Secrets, never from flags or environment values, so
they do not show up in process listings or pod specs. Every non-empty, non-comment line of
a file is a valid value (old and new overlap during a rotation). A failed re-read (a
missing file, a published placeholder, bytes that are not UTF-8 text) keeps the last good
value, is logged, and the re-reads go on. Two ways to follow a rotation:

- :func:`reload_forever` re-reads files periodically (the gateway, the controller);
- :class:`Credential` looks at its file again (inode, size, modification time: a Secret
  volume swaps a symlink) at most once per ``recheck_s``, and at once when a value matches
  nothing (the guard): a rotated Secret takes effect as soon as the volume has it, and a
  removed value stops working, without a restart.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["FIX", "PLACEHOLDERS", "PLACEHOLDER_VALUES", "PLACEHOLDER_WORDS", "ApiKeys",
           "Credential", "FixedCredential", "PlaceholderSecret", "SecretFile",
           "UnreadableSecret", "bearer", "matches", "placeholder_reason", "reload_forever"]

log = logging.getLogger(__name__)

PLACEHOLDERS = frozenset({"change-me-before-applying", "change-me", "changeme", "replace-me",
                          "replace-me-with-a-random-key"})
"""Values rota's manifests and docs once published: known to everyone, so never a
credential (each is also caught by :func:`placeholder_reason`'s rule)."""

PLACEHOLDER_WORDS = ("changeme", "replaceme", "placeholder", "yourkey", "yourapikey",
                     "yourtoken", "yoursecret", "yourpassword", "randomkey", "goeshere",
                     "inserthere", "insertkey", "redacted", "dummykey", "examplekey")
"""Words that mark a value someone was told to replace, compared with the value's letters
and digits only, lower-cased (``CHANGE_ME``, ``<your-key>``, ``Your API Key`` all match).
Each is eight letters or more, so a random key contains one by chance with a probability
below 10^-10."""

PLACEHOLDER_VALUES = frozenset({"apikey", "key", "secret", "token", "password", "example",
                                "test", "dummy", "todo", "fixme", "none", "null", "default"})
"""Whole values (letters and digits, lower-cased) that are a word, not a secret."""

_TEMPLATE = re.compile(r"^(<.*>|\$\{.*\}|\{\{.*\}\}|\[.*\])$")
"""``<your-key>``, ``${API_KEY}``, ``{{ key }}``, ``[key]``: a template never filled in."""

FIX = ('put a random value in the Secret instead, e.g. kubectl create secret generic <name> '
       '--from-literal=<key>="$(openssl rand -hex 32)"')
"""What the refusal tells the user to do."""


def placeholder_reason(value: str) -> str | None:
    """Why ``value`` is a placeholder someone forgot to replace, or None when it may be a
    secret. A rule, not a list of the strings seen so far: a template left unfilled, one
    character repeated (``xxx``, ``****``), a bare word (``secret``, ``token``) or a value
    containing a word that says to replace it (:data:`PLACEHOLDER_WORDS`), whatever its
    case and separators. The reason never repeats the value (a real key that matched by
    mistake stays out of the logs)."""
    stripped = value.strip()
    letters = re.sub(r"[^a-z0-9]", "", stripped.lower())
    if stripped in PLACEHOLDERS:
        return "a placeholder published in rota's manifests"
    if _TEMPLATE.match(stripped):
        return "a template placeholder (<...>, ${...}, {{...}}) never filled in"
    if len(set(stripped)) == 1 and len(stripped) > 1:
        return "one character repeated, a placeholder"
    if letters in PLACEHOLDER_VALUES:
        return "a placeholder word, not a secret"
    word = next((w for w in PLACEHOLDER_WORDS if w in letters), None)
    if word is not None:
        return f"a placeholder: it contains '{word}'"
    return None


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
        for number, line in enumerate(lines, 1):
            reason = placeholder_reason(line)
            if reason is not None:
                raise PlaceholderSecret(f"{self.path} value {number} is {reason}; {FIX}")
        self._lines = lines


def matches(given: str, values: Sequence[str]) -> bool:
    """True when ``given`` is one of ``values``, in time that depends on neither: every
    value is compared, each in constant time."""
    wanted = given.encode()
    found = False
    for value in values:
        found |= hmac.compare_digest(wanted, value.encode())
    return found


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
        return matches(token, self.secret.lines)


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


_Stamp = tuple[int, int, int]


def _stamp(path: Path) -> _Stamp | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


class Credential:
    """The valid values of one credential: the lines of one file."""

    def __init__(self, path: Path, *, recheck_s: float) -> None:
        self._file = SecretFile(path)
        self._recheck_s = recheck_s
        self._checked_at = float("-inf")
        self._stamp: _Stamp | None = None
        self._lock = asyncio.Lock()

    @property
    def path(self) -> Path:
        return self._file.path

    async def load(self) -> None:
        """Read the file now (at start: a file that cannot be read stops the guard)."""
        stamp = await asyncio.to_thread(_stamp, self._file.path)
        await self._file.load()
        if not self._file.lines:
            raise OSError(f"{self._file.path} holds no credential")
        self._stamp, self._checked_at = stamp, time.monotonic()

    def _matches(self, given: str) -> bool:
        return matches(given, self._file.lines)

    async def _refresh(self, *, force: bool) -> None:
        async with self._lock:
            if not force and time.monotonic() - self._checked_at < self._recheck_s:
                return
            self._checked_at = time.monotonic()
            stamp = await asyncio.to_thread(_stamp, self._file.path)
            if stamp is None or stamp == self._stamp:
                return
            try:
                await self._file.load()
            except OSError as exc:
                log.warning("cannot re-read a credential file; keeping the values it had",
                            extra={"path": str(self._file.path), "error": str(exc)[:200]})
                return
            self._stamp = stamp
            log.info("credential file re-read", extra={"path": str(self._file.path),
                                                       "values": len(self._file.lines)})

    async def accepts(self, given: str | None) -> bool:
        """True when ``given`` is one of the file's values as it is now."""
        if not given:
            return False
        await self._refresh(force=False)
        if self._matches(given):
            return True
        await self._refresh(force=True)
        return self._matches(given)


class FixedCredential(Credential):
    """One value known at start, never re-read: the engine guard's control token, which
    rota's driver wrote into the guard's environment for the claim's whole life (it follows
    the node key, not a Secret, so there is no file to watch)."""

    def __init__(self, value: str) -> None:  # no file: the base's state is not needed
        value = value.strip()
        if not value:
            raise ValueError("a credential cannot be empty")
        if value in PLACEHOLDERS:
            raise PlaceholderSecret("the credential is a published placeholder, not a secret")
        self._value = value

    async def load(self) -> None:
        """Nothing to read: the value was given."""

    async def accepts(self, given: str | None) -> bool:
        """True when ``given`` is the value (compared in constant time)."""
        return bool(given) and matches(given or "", (self._value,))
