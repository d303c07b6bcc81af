"""The ledger: rota's crash-safe record of the claims it prepared on this node.

Prepare and unprepare must be idempotent and must survive the driver being killed at any
instant. The ledger is the driver's own memory of what it answered: a claim is recorded as
``PrepareStarted`` before any side effect (CDI spec), and as ``PrepareCompleted`` once
everything is in place. A retry that finds ``PrepareStarted`` rolls back and starts again;
unprepare removes the record last. The budget checks read the resident and awake budgets
of every claim prepared on a GPU from here.

File format (an API, versioned)::

    {"apiVersion": "ledger.gpu.rota.dev/v1", "kind": "Ledger",
     "checksum": "sha256:<hex>", "data": {"bootID": "...", "claims": {"<uid>": {...}}}}

``checksum`` covers the canonical JSON of ``data`` (sorted keys, no whitespace, UTF-8), so
a torn or edited file is detected. A corrupt, unparsable or unknown-version file is an
error, never an empty ledger: treating it as empty would let the driver over-commit GPUs
that are in use. A ledger written under another boot id is empty: a reboot undid every
preparation.

Compatibility rule: a reader accepts every older apiVersion; a writer writes a version the
previous release can read. A release that adds ``v2`` therefore first ships a reader for
it, and writes it only in the release after; upgrades and downgrades by one release both
work. Versions: ``ledger.gpu.rota.dev/v1`` (this release reads and writes it).

Writes are atomic (temp file in the same directory, fsync, rename, fsync the directory) and
must happen under :func:`file_lock`, which serialises driver processes on the node (a
rolling update runs two).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from driver.budget import ClaimantBudget
from driver.disk import OS_DISK, Disk, atomic_write, fsync_dir, remove_temp_files
from driver.errors import LedgerError

__all__ = [
    "API_VERSION",
    "KIND",
    "READABLE_VERSIONS",
    "ClaimRecord",
    "Ledger",
    "LedgerState",
    "PrepareState",
    "PreparedDevice",
    "atomic_write",
    "current_boot_id",
    "file_lock",
    "fsync_dir",
    "remove_temp_files",
]

log = logging.getLogger(__name__)

API_VERSION = "ledger.gpu.rota.dev/v1"
KIND = "Ledger"
READABLE_VERSIONS = (API_VERSION,)
"""Every apiVersion this release reads."""

PrepareState = Literal["PrepareStarted", "PrepareCompleted"]

_ALIASES = {
    "boot_id": "bootID",
    "gpu_uuid": "gpuUUID",
    "gpu_uuids": "gpuUUIDs",
    "share_id": "shareID",
    "cdi_device_ids": "cdiDeviceIDs",
}


def _alias(name: str) -> str:
    return _ALIASES.get(name) or to_camel(name)


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=_alias,
        validate_by_alias=True,
        validate_by_name=True,
    )


class PreparedDevice(_Model):
    """One device (or share of one) handed to the kubelet for a claim."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    share_id: str | None = None
    cdi_device_ids: tuple[str, ...]
    gpu_uuid: str
    """The physical GPU behind the device."""
    resident_bytes: int = Field(ge=0)
    """Memory the claim holds on that GPU through this device."""


class ClaimRecord(_Model):
    """What the driver did for one claim."""

    uid: str = Field(min_length=1)
    namespace: str
    name: str
    state: PrepareState
    devices: tuple[PreparedDevice, ...]
    gpu_uuids: tuple[str, ...]
    resident_bytes: int = Field(ge=0)
    """The claim's resident budget, summed over its devices."""
    awake_bytes: int = Field(ge=0)
    """The claim's awake budget per GPU (``awakeMemory``, or its resident without a config)."""
    exclusive: bool
    """True when the claim holds a device whole."""
    prepared_at: AwareDatetime
    """When prepare started, UTC."""

    @field_validator("prepared_at")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @field_serializer("prepared_at")
    def _rfc3339(self, value: datetime) -> str:
        return value.isoformat().replace("+00:00", "Z")

    @property
    def ref(self) -> str:
        """``namespace/name`` for messages."""
        return f"{self.namespace}/{self.name}"

    def resident_bytes_on(self, gpu_uuid: str) -> int:
        """Memory the claim holds on one GPU all the time."""
        return sum(d.resident_bytes for d in self.devices if d.gpu_uuid == gpu_uuid)

    def budget_on(self, gpu_uuid: str) -> ClaimantBudget:
        """The claim as the budget checks see it on one GPU."""
        return ClaimantBudget(
            uid=self.uid,
            namespace=self.namespace,
            name=self.name,
            resident_bytes=self.resident_bytes_on(gpu_uuid),
            awake_bytes=self.awake_bytes,
            devices=tuple(
                (d.device_name, d.share_id) for d in self.devices if d.gpu_uuid == gpu_uuid
            ),
        )


class _LedgerData(_Model):
    boot_id: str
    claims: dict[str, ClaimRecord]

    @model_validator(mode="after")
    def _keys_are_uids(self) -> _LedgerData:
        for uid, record in self.claims.items():
            if uid != record.uid:
                raise ValueError(f"claim stored under {uid!r} has uid {record.uid!r}")
        return self


@dataclass(frozen=True)
class LedgerState:
    """The ledger's content: the boot it belongs to and the claims prepared in it.

    Immutable; :meth:`with_record` and :meth:`without` return new states.
    """

    boot_id: str
    claims: Mapping[str, ClaimRecord] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "claims", MappingProxyType(dict(self.claims)))

    def get(self, uid: str) -> ClaimRecord | None:
        """The record of one claim, or None."""
        return self.claims.get(uid)

    def with_record(self, record: ClaimRecord) -> LedgerState:
        """A state with ``record`` added, replacing any record of the same uid."""
        return LedgerState(self.boot_id, {**self.claims, record.uid: record})

    def without(self, uid: str) -> LedgerState:
        """A state without the claim ``uid`` (the same state when it is absent)."""
        return LedgerState(self.boot_id, {k: v for k, v in self.claims.items() if k != uid})

    def on_gpu(self, gpu_uuid: str) -> list[ClaimRecord]:
        """The records of claims that touch one GPU, sorted by uid."""
        return [r for _, r in sorted(self.claims.items()) if gpu_uuid in r.gpu_uuids]

    def budgets_on(self, gpu_uuid: str, *, exclude_uid: str | None = None) -> list[ClaimantBudget]:
        """Every other claimant of one GPU, ready for the budget checks."""
        return [r.budget_on(gpu_uuid) for r in self.on_gpu(gpu_uuid) if r.uid != exclude_uid]


def _canonical(data: object) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _checksum(data: object) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


class Ledger:
    """The ledger file of one node. Call :meth:`read` and :meth:`write` under :func:`file_lock`."""

    def __init__(self, path: Path | str, *, boot_id: str, disk: Disk = OS_DISK) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.disk = disk

    def empty(self) -> LedgerState:
        """An empty state for the current boot."""
        return LedgerState(self.boot_id)

    def read(self) -> LedgerState:
        """Load the ledger.

        Returns:
            The recorded state; an empty one when the file does not exist or was written
            under another boot.

        Raises:
            LedgerError: the file is unreadable, corrupt, fails its checksum, or has an
                apiVersion this release does not read.
        """
        try:
            raw = self.disk.read_bytes(self.path)
        except FileNotFoundError:
            return self.empty()
        except OSError as exc:
            raise LedgerError(f"cannot read ledger {self.path}: {exc.strerror}") from exc
        try:
            envelope = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LedgerError(f"ledger {self.path} is not valid JSON: {exc}") from None
        if not isinstance(envelope, dict):
            raise LedgerError(f"ledger {self.path} is not a JSON object")
        api_version = envelope.get("apiVersion")
        if api_version not in READABLE_VERSIONS:
            raise LedgerError(
                f"ledger {self.path} has apiVersion {str(api_version)[:64]!r}, which this "
                f"release cannot read (it reads {', '.join(READABLE_VERSIONS)}); it was "
                "written by a newer rota: roll forward, or move the file away to start over"
            )
        if envelope.get("kind") != KIND:
            raise LedgerError(f"ledger {self.path} has kind {str(envelope.get('kind'))[:64]!r}")
        if set(envelope) != {"apiVersion", "kind", "checksum", "data"}:
            raise LedgerError(f"ledger {self.path} has unexpected top-level fields")
        data = envelope["data"]
        if envelope["checksum"] != _checksum(data):
            raise LedgerError(f"ledger {self.path} fails its checksum: the file is corrupt")
        try:
            parsed = _LedgerData.model_validate(data)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(part) for part in first["loc"])[:200]
            raise LedgerError(
                f"ledger {self.path} does not match {API_VERSION}: {exc.error_count()} "
                f"error(s), first at {where or 'data'}: {first['msg']}"
            ) from None
        if parsed.boot_id != self.boot_id:
            log.warning(
                "ledger written under another boot; the node rebooted, so every claim it "
                "records is no longer prepared",
                extra={
                    "ledger": str(self.path),
                    "ledger_boot_id": parsed.boot_id,
                    "boot_id": self.boot_id,
                    "dropped_claims": sorted(parsed.claims),
                },
            )
            return self.empty()
        return LedgerState(parsed.boot_id, parsed.claims)

    def render(self, state: LedgerState) -> bytes:
        """The file content for ``state``."""
        data = _LedgerData(boot_id=state.boot_id, claims=dict(state.claims)).model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
        envelope: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "checksum": _checksum(data),
            "data": data,
        }
        return json.dumps(envelope, sort_keys=True, indent=2, ensure_ascii=False).encode() + b"\n"

    def write(self, state: LedgerState) -> int:
        """Replace the ledger with ``state`` atomically; return the size written in bytes.

        Temp files left by a crashed earlier write are removed first.

        Raises:
            LedgerError: ``state`` belongs to another boot, or the file cannot be written.
        """
        if state.boot_id != self.boot_id:
            raise LedgerError(
                f"refusing to write a ledger of boot {state.boot_id} during boot {self.boot_id}"
            )
        content = self.render(state)
        try:
            self.disk.makedirs(self.path.parent)
            removed = remove_temp_files(self.path, self.disk)
            if removed:
                log.info(
                    "removed temp files of an interrupted ledger write",
                    extra={"ledger": str(self.path), "count": removed},
                )
            atomic_write(self.path, content, disk=self.disk)
        except OSError as exc:
            raise LedgerError(f"cannot write ledger {self.path}: {exc.strerror}") from exc
        return len(content)


@contextlib.contextmanager
def file_lock(
    path: Path | str,
    timeout_s: float,
    *,
    poll_s: float = 0.005,
    max_poll_s: float = 0.1,
    disk: Disk = OS_DISK,
) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block.

    Waits at most ``timeout_s``, polling with a non-blocking attempt and a backoff from
    ``poll_s`` up to ``max_poll_s``. It blocks the calling thread: from asyncio, take it in a
    worker thread. The lock is also exclusive between two opens in one process. Waiters are
    not served in any order: a newer waiter may get the lock before an older one.

    Raises:
        LedgerError: the lock was not obtained in time, or the file cannot be opened.
    """
    lock_path = Path(path)
    try:
        fd = disk.open_lock(lock_path)
    except OSError as exc:
        raise LedgerError(f"cannot open lock file {lock_path}: {exc.strerror}") from exc
    try:
        deadline = time.monotonic() + timeout_s
        delay = poll_s
        while True:
            try:
                if disk.try_lock(fd):
                    break
            except OSError as exc:
                raise LedgerError(f"cannot lock {lock_path}: {exc.strerror}") from exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LedgerError(
                    f"timed out after {timeout_s:g} s waiting for lock {lock_path}; another "
                    "driver process holds it"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, max_poll_s)
        try:
            yield
        finally:
            disk.unlock(fd)
    finally:
        disk.close(fd)


def current_boot_id(proc_root: Path | str = "/proc") -> str:
    """The kernel's boot id (``<proc_root>/sys/kernel/random/boot_id``).

    Raises:
        LedgerError: the file cannot be read or is empty.
    """
    path = Path(proc_root) / "sys" / "kernel" / "random" / "boot_id"
    try:
        boot_id = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(f"cannot read boot id from {path}: {exc}") from exc
    if not boot_id:
        raise LedgerError(f"boot id file {path} is empty")
    return boot_id
