"""The driver's part in start-up admission: what a claim's containers get to ask for a
start slot, and how the lease controller checks that the asker is that claim.

An engine container that starts through rota's start gate asks the node's lease
controller for a slot over a unix socket in :attr:`StartGate.directory` (the controller
listens there; the driver's CDI spec bind-mounts the directory, host path = container
path, into every container of every claim with an engine config). The question carries
the claim's uid and a token that only that claim's containers get, in their CDI
environment:

- ``ROTA_START_SOCKET``: the socket's path;
- ``ROTA_START_TOKEN``: HMAC-SHA256 of the claim uid under a node key.

The node key is 32 random bytes in the driver's data directory, created once (mode 0600)
and kept across restarts, so an idempotent prepare writes a byte-identical spec. The
controller never reads the key: it asks the driver through the inspection API
(``VerifyStartToken``). Pure except :func:`load_or_create_key`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.disk import fsync_dir
from rota.api.start_contract import SOCKET_ENV, TOKEN_ENV

__all__ = ["KEY_BYTES", "SOCKET_NAME", "START_GATE_DIR_MODE", "StartGate", "claim_token",
           "load_or_create_key", "prepare_start_gate_dir"]

KEY_BYTES = 32
SOCKET_NAME = "start.sock"
"""The socket's name in the start-gate directory (the lease controller listens on it)."""
_CONTEXT = b"rota start gate v1\0"


@dataclass(frozen=True)
class StartGate:
    """Where the start-gate socket lives, and the key its tokens derive from."""

    directory: Path
    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < KEY_BYTES:
            raise ValueError(f"a start-gate key has at least {KEY_BYTES} bytes")
        if not self.directory.is_absolute():
            raise ValueError(f"the start-gate directory must be absolute: {self.directory}")

    @property
    def socket(self) -> Path:
        return self.directory / SOCKET_NAME

    def token(self, claim_uid: str) -> str:
        """The token of one claim: deterministic, so a re-prepare writes the same bytes."""
        return claim_token(self.key, _CONTEXT, claim_uid)

    def verify(self, claim_uid: str, token: str) -> bool:
        """True when ``token`` is the token of ``claim_uid`` (compared in constant time)."""
        if not claim_uid or not token:
            return False
        return hmac.compare_digest(self.token(claim_uid).encode(), token.encode())

    def environment(self, claim_uid: str) -> dict[str, str]:
        return {SOCKET_ENV: str(self.socket), TOKEN_ENV: self.token(claim_uid)}

    def mount(self) -> dict[str, Any]:
        """The CDI mount of the directory: read-only (connecting to a unix socket needs no
        write access to the mount), no devices, no set-uid, nothing executable."""
        return {"hostPath": str(self.directory), "containerPath": str(self.directory),
                "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]}


def claim_token(key: bytes, context: bytes, claim_uid: str) -> str:
    """HMAC-SHA256 of ``claim_uid`` under the node key, in ``context``: the one derivation
    of a claim's tokens (the start gate's here, the control token's in
    :mod:`driver.control_tokens`), each with a context of its own so they never agree."""
    return hmac.new(key, context + claim_uid.encode(), hashlib.sha256).hexdigest()


def _create_once(path: Path, content: bytes) -> None:
    """Write ``content`` to ``path`` unless it exists: a complete file appears at once (a
    hard link of a synced temp file), and of two drivers that race (a rolling update) the
    first one's key wins, so no token is ever invalidated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fchmod(handle.fileno(), 0o600)
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    fsync_dir(path.parent)


START_GATE_DIR_MODE = 0o771
"""The start-gate directory: the lease controller (group 0, not root) creates its socket
there; an engine's process (any user) only needs to reach the socket by its path."""


def prepare_start_gate_dir(directory: Path) -> None:
    """Create the start-gate directory if missing and give it :data:`START_GATE_DIR_MODE`
    (a hostPath volume makes it 0755 root-owned, where a non-root controller cannot
    listen)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, START_GATE_DIR_MODE)


def load_or_create_key(path: Path) -> bytes:
    """The node key at ``path``; created (random, mode 0600, written atomically) when
    missing. A key file that is too short is an error, never silently replaced: every
    running engine's token derives from it."""
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        _create_once(path, secrets.token_bytes(KEY_BYTES))
        key = path.read_bytes()
    if len(key) < KEY_BYTES:
        raise ValueError(f"start-gate key {path} holds {len(key)} bytes; {KEY_BYTES} needed")
    os.chmod(path, 0o600)
    return key
