"""Prepare and unprepare: the only place where the driver's side effects happen.

Order for prepare, under the node-wide lock (one ledger read, two ledger writes a batch):

1. every claim is fetched from the API server (concurrently, before the lock) and planned
   purely (:func:`driver.claims.plan_claim`);
2. claims already ``PrepareCompleted`` answer from the ledger (idempotent);
3. each new claim passes the budget checks against every claim in the ledger, earlier
   claims of the same batch included;
4. the admitted claims are written ``PrepareStarted``; their CDI specs are written; they
   are written ``PrepareCompleted``; only then does the kubelet get an answer.

Unprepare removes the ledger record first, then the CDI spec. A driver killed at any
instant therefore leaves either a ``PrepareStarted`` record (rolled back by
:meth:`Preparer.restore` or by the next prepare of that claim) or a CDI spec without a
record (removed by :meth:`Preparer.restore`). An answer is only ever given for a state
that is already on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from driver import cdi, metrics
from driver.budget import check_admission
from driver.claims import ClaimPlan, PublishedDevice, plan_claim
from driver.errors import ClaimError, KubeError, KubeNotFoundError, LedgerError
from driver.ledger import (
    ClaimRecord,
    Ledger,
    LedgerState,
    PreparedDevice,
    PrepareState,
    file_lock,
)
from driver.startgate import StartGate

log = logging.getLogger(__name__)

DeviceAnswer = PreparedDevice
"""What the kubelet is told per device: request names, pool, device, shareID, CDI ids."""


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    @property
    def fields(self) -> dict[str, str]:
        return {"claim_uid": self.uid, "claim": f"{self.namespace}/{self.name}"}


class ClaimReader(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


def _fetch_error(ref: ClaimRef, exc: KubeError) -> ClaimError:
    if isinstance(exc, KubeNotFoundError):
        return ClaimError(f"claim {ref.namespace}/{ref.name} does not exist (any more)",
                          reason="not_found")
    return ClaimError(f"cannot read claim {ref.namespace}/{ref.name}: {exc}",
                      reason="api_error", permanent=False)


class Preparer:
    """Prepares claims for the devices ``devices()`` returns (those published right now)."""

    def __init__(self, *, kube: ClaimReader, ledger: Ledger, cdi_root: Path, dev_root: Path,
                 driver_name: str, pool: str,
                 devices: Callable[[], Mapping[str, PublishedDevice]],
                 lock_path: Path, lock_timeout_s: float = 10.0,
                 fetch_concurrency: int = 16, start_gate: StartGate | None = None) -> None:
        self.kube = kube
        self.ledger = ledger
        self.cdi_root = cdi_root
        self.dev_root = dev_root
        self.driver_name = driver_name
        self.pool = pool
        self.devices = devices
        self.lock_path = lock_path
        self.lock_timeout_s = lock_timeout_s
        self.start_gate = start_gate
        self._fetch_slots = asyncio.Semaphore(fetch_concurrency)
        self._lock = asyncio.Lock()
        self._state: LedgerState | None = None

    @property
    def state(self) -> LedgerState | None:
        """The ledger as last read or written by this process (for inspection)."""
        return self._state

    # -- start-up ------------------------------------------------------------------------

    async def restore(self) -> LedgerState:
        """Roll back half-done prepares and remove CDI specs that no record backs."""
        async with self._lock:
            return await asyncio.to_thread(self._restore_locked)

    def _restore_locked(self) -> LedgerState:
        with file_lock(self.lock_path, self.lock_timeout_s):
            state = self.ledger.read()
            started = [r for r in state.claims.values() if r.state != "PrepareCompleted"]
            for record in started:
                cdi.remove_spec(self.cdi_root, record.uid)
                state = state.without(record.uid)
                log.warning("rolled back a prepare interrupted by a restart",
                            extra={"claim_uid": record.uid, "claim": record.ref})
            if started:
                self._write(state)
            for uid in sorted(cdi.list_spec_claim_uids(self.cdi_root) - set(state.claims)):
                cdi.remove_spec(self.cdi_root, uid)
                log.warning("removed a CDI spec with no ledger record",
                            extra={"claim_uid": uid})
            self._remember(state)
            return state

    # -- prepare -------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]
                      ) -> dict[str, Sequence[DeviceAnswer] | Exception]:
        started = time.perf_counter()
        fetched = await asyncio.gather(*(self._fetch(ref) for ref in claims))
        async with self._lock:
            outcomes = await asyncio.to_thread(self._prepare_locked, list(zip(claims, fetched,
                                                                            strict=True)))
        elapsed = time.perf_counter() - started
        for ref in claims:
            outcome = outcomes[ref.uid]
            reason = outcome.reason if isinstance(outcome, ClaimError) else (
                "error" if isinstance(outcome, Exception) else "ok")
            metrics.OPERATION_SECONDS.labels("prepare", reason).observe(elapsed)
            if isinstance(outcome, Exception):
                log.warning("prepare refused", extra={**ref.fields, "reason": reason,
                                                      "error": str(outcome)})
        return outcomes

    async def _fetch(self, ref: ClaimRef) -> dict[str, Any] | ClaimError:
        async with self._fetch_slots:
            try:
                return await self.kube.get_claim(ref.namespace, ref.name)
            except KubeError as exc:
                return _fetch_error(ref, exc)

    def _plan(self, ref: ClaimRef, claim: dict[str, Any],
              devices: Mapping[str, PublishedDevice]) -> ClaimPlan:
        return plan_claim(claim, expected_uid=ref.uid, namespace=ref.namespace, name=ref.name,
                          driver=self.driver_name, pool=self.pool, devices=devices)

    def _prepare_locked(self, batch: list[tuple[ClaimRef, dict[str, Any] | ClaimError]]
                        ) -> dict[str, Sequence[DeviceAnswer] | Exception]:
        outcomes: dict[str, Sequence[DeviceAnswer] | Exception] = {}
        devices = self.devices()
        try:
            with file_lock(self.lock_path, self.lock_timeout_s):
                state = self.ledger.read()
                admitted: list[tuple[ClaimPlan, ClaimRecord]] = []
                for ref, claim in batch:
                    record = state.get(ref.uid)
                    if record is not None and record.state == "PrepareCompleted":
                        outcomes[ref.uid] = record.devices
                        continue
                    if record is not None:  # a prepare of this claim died half-way
                        cdi.remove_spec(self.cdi_root, ref.uid)
                        state = state.without(ref.uid)
                    if isinstance(claim, ClaimError):
                        outcomes[ref.uid] = claim
                        continue
                    try:
                        plan = self._plan(ref, claim, devices)
                        for gpu in plan.gpu_uuids:
                            device = next(d for d in devices.values() if d.gpu_uuid == gpu)
                            check_admission(plan=plan, gpu_memory_bytes=device.gpu_memory_bytes,
                                            others=state.budgets_on(gpu, exclude_uid=ref.uid),
                                            gpu_uuid=gpu)
                        record = self._record(plan, "PrepareStarted")
                    except ClaimError as exc:
                        outcomes[ref.uid] = exc
                        continue
                    state = state.with_record(record)
                    admitted.append((plan, record))
                if not admitted:
                    self._remember(state)
                    return outcomes
                self._write(state)
                for plan, record in admitted:
                    spec = cdi.build_claim_spec(plan, devices, dev_root=str(self.dev_root),
                                                start_gate=self.start_gate)
                    cdi.write_spec(self.cdi_root, plan.uid, spec)
                    done = record.model_copy(update={"state": "PrepareCompleted"})
                    state = state.with_record(done)
                    outcomes[plan.uid] = done.devices
                self._write(state)
                for plan, _ in admitted:
                    log.info("prepared claim", extra={
                        "claim_uid": plan.uid, "claim": f"{plan.namespace}/{plan.name}",
                        "devices": [s.device for s in plan.shares],
                        "resident_bytes": plan.resident_bytes, "awake_bytes": plan.awake_bytes})
        except (LedgerError, OSError, ValueError) as exc:
            # Nothing answered yet is on disk as completed; the kubelet retries.
            error = ClaimError(f"prepare failed on the node: {exc}", reason="node_error",
                               permanent=False)
            for ref, _ in batch:
                outcomes.setdefault(ref.uid, error)
            log.error("prepare batch failed", extra={"error": str(exc)})
        return outcomes

    def _record(self, plan: ClaimPlan, state: PrepareState) -> ClaimRecord:
        devices = tuple(
            PreparedDevice(
                request_names=(share.request,), pool_name=share.pool,
                device_name=share.device, share_id=share.share_id,
                cdi_device_ids=(cdi.qualified_id(cdi.share_device_name(plan.uid, share)),),
                gpu_uuid=share.gpu_uuid, resident_bytes=share.consumed_memory_bytes)
            for share in plan.shares)
        return ClaimRecord(uid=plan.uid, namespace=plan.namespace, name=plan.name,
                           state=state, devices=devices, gpu_uuids=plan.gpu_uuids,
                           resident_bytes=plan.resident_bytes, awake_bytes=plan.awake_bytes,
                           exclusive=plan.exclusive, prepared_at=datetime.now(UTC))

    # -- unprepare -----------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, Exception | None]:
        started = time.perf_counter()
        async with self._lock:
            outcomes = await asyncio.to_thread(self._unprepare_locked, list(claims))
        elapsed = time.perf_counter() - started
        for ref in claims:
            metrics.OPERATION_SECONDS.labels(
                "unprepare", "ok" if outcomes[ref.uid] is None else "node_error"
            ).observe(elapsed)
        return outcomes

    def _unprepare_locked(self, claims: list[ClaimRef]) -> dict[str, Exception | None]:
        try:
            with file_lock(self.lock_path, self.lock_timeout_s):
                state = self.ledger.read()
                known = [ref for ref in claims if state.get(ref.uid) is not None]
                for ref in known:
                    state = state.without(ref.uid)
                if known:
                    self._write(state)
                else:
                    self._remember(state)
                for ref in claims:
                    if cdi.remove_spec(self.cdi_root, ref.uid) or ref in known:
                        log.info("unprepared claim", extra=ref.fields)
        except (LedgerError, OSError) as exc:
            error = ClaimError(f"unprepare failed on the node: {exc}", reason="node_error",
                               permanent=False)
            return {ref.uid: error for ref in claims}
        return {ref.uid: None for ref in claims}

    # -- bookkeeping ---------------------------------------------------------------------

    def _write(self, state: LedgerState) -> None:
        size = self.ledger.write(state)
        metrics.LEDGER_BYTES.set(size)
        self._remember(state)

    def _remember(self, state: LedgerState) -> None:
        self._state = state
        metrics.CLAIMS_PREPARED.set(
            sum(1 for r in state.claims.values() if r.state == "PrepareCompleted"))
