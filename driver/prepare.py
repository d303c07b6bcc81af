"""Prepare and unprepare: the only place where the driver's side effects happen.

Order for prepare, under the node-wide lock (one ledger read, two ledger writes a batch):

1. every claim is fetched from the API server (concurrently, before the lock) and planned
   purely (:func:`driver.claims.plan_claim`);
2. under the lock, every ``PrepareStarted`` record is stale (its prepare died or failed,
   nobody else can be preparing): it is rolled back first, its CDI spec removed;
3. claims already ``PrepareCompleted`` answer from the ledger (idempotent), unless the
   claim now holds other devices (allocated anew): that record is replaced;
4. each new claim passes the budget checks against every claim in the ledger, earlier
   claims of the same batch included;
5. the admitted claims are written ``PrepareStarted``; their CDI specs are written; they
   are written ``PrepareCompleted``; only then are the answers built.

A failing disk (``ENOSPC``, ``EIO``) at any of these writes gives every claim whose state
did not reach disk an error: a claim whose CDI spec cannot be written is dropped from the
batch; a failed ledger write fails every admitted claim, and the batch is undone (the
ledger written back as it was, then the batch's CDI specs removed), so that an error
answer leaves nothing behind. Claims answered from the ledger keep their answer.

Unprepare removes the ledger record first, then the CDI spec. A driver killed at any
instant therefore leaves either a ``PrepareStarted`` record (rolled back by the next
prepare or by :meth:`Preparer.restore`) or a CDI spec without a record (removed by
:meth:`Preparer.restore` and the ledger garbage collection). An answer is only ever given
for a state that is already on disk.

Overlapping calls of one claim (the kubelet's may overlap): every call takes a ticket on
arrival, before it reads its claims (:class:`driver.calls.CallBook`), and under the lock
a call of a claim that a later call of the other verb has already prepared or unprepared
does nothing for it and answers ``superseded``: an unprepare that overtakes a prepare
still reading its claim wins, and the prepare leaves no record or spec behind.

Cancellation (the kubelet's deadline): the work of a call runs in a worker thread that
cannot be stopped half-way, so a cancelled call keeps the lock until its thread has
finished (:func:`rota.kit.aio.finish_first`), and a later call of the same claim always sees
its outcome. A call whose deadline passed before it got the node-wide lock does nothing.
A call still in flight well past its deadline (a worker thread stuck in a hung disk
write) makes :meth:`Preparer.stalled` say so, and the liveness probe fail.
One claim never fails the batch: each gets its own outcome, a malformed uid included.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from driver import cdi, metrics
from driver.budget import check_admission
from driver.calls import Call, CallBook
from driver.claims import ClaimPlan, PublishedDevice, plan_claim
from driver.control_tokens import ControlTokens
from driver.disk import OS_DISK, Disk, remove_temp_files
from driver.errors import LedgerError
from driver.ledger import (
    ClaimRecord,
    Ledger,
    LedgerState,
    PreparedDevice,
    PrepareState,
    file_lock,
)
from driver.startgate import StartGate
from rota.api.errors import ClaimError
from rota.kit.aio import finish_first
from rota.kit.errors import KubeError, KubeNotFoundError

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
                 fetch_concurrency: int = 16, disk: Disk = OS_DISK,
                 cdi_edits: cdi.ExtraEdits | None = None,
                 calls: CallBook | None = None, dev_view: Path | None = None,
                 start_gate: StartGate | None = None,
                 control: ControlTokens | None = None) -> None:
        """``dev_root``: the host's device node directory, named in CDI specs; ``dev_view``:
        where this process sees it live (default: ``dev_root``); ``control``: derives the
        control token every claim with an engine config gets (its engine guard checks it)."""
        self.kube = kube
        self.ledger = ledger
        self.cdi_root = cdi_root
        self.dev_root = dev_root
        self.dev_view = dev_view
        self.cdi_edits = cdi_edits
        self.start_gate = start_gate
        self.control = control
        self.driver_name = driver_name
        self.pool = pool
        self.devices = devices
        self.lock_path = lock_path
        self.lock_timeout_s = lock_timeout_s
        self.disk = disk
        self._fetch_slots = asyncio.Semaphore(fetch_concurrency)
        self._lock = asyncio.Lock()
        self._state: LedgerState | None = None
        self._answered: dict[str, float] = {}  # uid -> when last answered prepared
        self.calls = calls or CallBook()

    @property
    def state(self) -> LedgerState | None:
        """The ledger as last read or written by this process (for inspection)."""
        return self._state

    # -- start-up ------------------------------------------------------------------------

    async def restore(self) -> LedgerState:
        """Roll back half-done prepares, remove CDI specs that no record backs and temp
        files of interrupted writes."""
        async with self._lock:
            return await finish_first(asyncio.to_thread(self._restore_locked))

    def _restore_locked(self) -> LedgerState:
        with file_lock(self.lock_path, self.lock_timeout_s, disk=self.disk):
            on_disk = self.ledger.read()
            state = self._roll_back_started(on_disk, strict=True)
            if state != on_disk:
                self._write(state)
            remove_temp_files(self.ledger.path, self.disk)
            self._remove_orphan_specs(state, strict=True)
            self._remember(state)
            return state

    def _roll_back_started(self, state: LedgerState, *, strict: bool = False) -> LedgerState:
        """``state`` without its ``PrepareStarted`` records, whose CDI specs are removed.

        Call under the node-wide lock: then no prepare is in progress anywhere, and every
        such record is left by a prepare that died or failed. A record whose spec cannot be
        removed stays (unless ``strict``: then the error is raised).
        """
        for record in [r for r in state.claims.values() if r.state != "PrepareCompleted"]:
            try:
                cdi.remove_spec(self.cdi_root, record.uid, disk=self.disk)
            except (OSError, ValueError) as exc:
                if strict:
                    raise
                log.warning("cannot roll back a half-done prepare yet",
                            extra={"claim_uid": record.uid, "claim": record.ref,
                                   "error": str(exc)})
                continue
            state = state.without(record.uid)
            log.warning("rolled back a prepare that did not finish",
                        extra={"claim_uid": record.uid, "claim": record.ref})
        return state

    def _remove_orphan_specs(self, state: LedgerState, *, strict: bool = False) -> list[str]:
        """Remove CDI specs (and temp files) of claims without a record; under the lock."""
        removed = []
        for uid in sorted(cdi.list_spec_claim_uids(self.cdi_root, disk=self.disk)
                          - set(state.claims)):
            try:
                cdi.remove_spec(self.cdi_root, uid, disk=self.disk)
            except OSError as exc:
                if strict:
                    raise
                log.warning("cannot remove a CDI spec with no ledger record yet",
                            extra={"claim_uid": uid, "error": str(exc)})
                continue
            removed.append(uid)
            log.warning("removed a CDI spec with no ledger record", extra={"claim_uid": uid})
        return removed

    # -- prepare -------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef], *, deadline: float | None = None
                      ) -> dict[str, Sequence[DeviceAnswer] | Exception]:
        """Prepare a batch; one outcome per claim (its devices, or why not).

        Args:
            claims: the claims the kubelet named.
            deadline: ``time.monotonic()`` after which the caller no longer waits; a batch
                that only gets the node-wide lock later does nothing.
        """
        started = time.perf_counter()
        with self.calls.arrive("prepare", [ref.uid for ref in claims], deadline) as call:
            fetched = await asyncio.gather(*(self._fetch(ref) for ref in claims))
            outcomes = await self._locked("prepare", claims, self._prepare_locked,
                                          list(zip(claims, fetched, strict=True)), deadline,
                                          call)
        elapsed = time.perf_counter() - started
        for ref in claims:
            outcome = outcomes[ref.uid]
            reason = _reason(outcome)
            metrics.OPERATION_SECONDS.labels("prepare", reason).observe(elapsed)
            if isinstance(outcome, Exception):
                log.warning("prepare refused", extra={**ref.fields, "reason": reason,
                                                      "error": str(outcome)})
        return outcomes

    async def _locked(self, what: str, claims: Sequence[ClaimRef],
                      fn: Callable[..., _Outcomes], *args: Any) -> _Outcomes:
        """Run ``fn`` in a worker thread under the asyncio lock; a cancelled caller keeps
        the lock until the thread is done."""
        def cancelled() -> None:
            log.warning(f"{what} cancelled by its caller; finishing the work in progress "
                        "first, the lock stays held until then",
                        extra={"claims": [ref.fields for ref in claims][:16]})

        async with self._lock:
            return await finish_first(asyncio.to_thread(fn, *args), on_cancel=cancelled)

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

    def _prepare_locked(self, batch: list[tuple[ClaimRef, dict[str, Any] | ClaimError]],
                        deadline: float | None, call: Call
                        ) -> dict[str, Sequence[DeviceAnswer] | Exception]:
        outcomes = self._prepare_batch(batch, deadline, call)
        for uid, outcome in outcomes.items():
            if not isinstance(outcome, Exception):
                self.calls.took_effect(call, uid)
        return outcomes

    def _prepare_batch(self, batch: list[tuple[ClaimRef, dict[str, Any] | ClaimError]],
                       deadline: float | None, call: Call
                       ) -> dict[str, Sequence[DeviceAnswer] | Exception]:
        outcomes: dict[str, Sequence[DeviceAnswer] | Exception] = {}
        devices = self.devices()
        try:
            with file_lock(self.lock_path, self.lock_timeout_s, disk=self.disk):
                if _expired(deadline):
                    return {ref.uid: _too_late("prepare") for ref, _ in batch}
                on_disk = self.ledger.read()
                state = base = self._roll_back_started(on_disk)
                admitted: list[tuple[ClaimPlan, ClaimRecord]] = []
                outdated: list[str] = []
                for ref, claim in batch:
                    if self.calls.overtaken(call, ref.uid):
                        outcomes[ref.uid] = _overtaken("prepare", ref)
                        continue
                    record = state.get(ref.uid)
                    if record is not None and self._outdated(record, ref, claim, devices):
                        # Its spec goes once the ledger no longer has the record.
                        log.warning("the claim was allocated anew; preparing it again",
                                    extra=ref.fields)
                        outdated.append(ref.uid)
                        state, base = state.without(ref.uid), base.without(ref.uid)
                        record = None
                    if record is not None and record.state == "PrepareCompleted":
                        outcomes[ref.uid] = record.devices
                        self._answered[ref.uid] = time.monotonic()
                        continue
                    if record is not None:
                        outcomes[ref.uid] = ClaimError(
                            f"an earlier prepare of claim {ref.namespace}/{ref.name} cannot "
                            "be rolled back yet (the node cannot remove its CDI spec)",
                            reason="node_error", permanent=False)
                        continue
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
                    except ValueError as exc:  # a name CDI cannot carry
                        outcomes[ref.uid] = ClaimError(
                            f"claim {ref.namespace}/{ref.name} cannot be prepared: {exc}",
                            reason="invalid_name")
                        continue
                    state = state.with_record(record)
                    admitted.append((plan, record))
                again = {plan.uid for plan, _ in admitted}
                leftover = [uid for uid in outdated if uid not in again]
                if admitted:
                    self._commit(state, base, admitted, devices, outcomes, leftover)
                elif base == on_disk:
                    self._remember(base)
                elif self._write_quietly(base):  # only removals: else the next batch does
                    self._drop_specs(leftover)
        except (LedgerError, OSError) as exc:
            # The lock or the ledger could not be read; nothing of this batch was written.
            error = _node_error("prepare", exc)
            for ref, _ in batch:
                outcomes.setdefault(ref.uid, error)
            log.error("prepare batch failed", extra={"error": str(exc)})
        return outcomes

    def _outdated(self, record: ClaimRecord, ref: ClaimRef,
                  claim: dict[str, Any] | ClaimError,
                  devices: Mapping[str, PublishedDevice]) -> bool:
        """True when a completed record describes an allocation the claim no longer has
        (it was deallocated and allocated anew on this node). A claim that cannot be read
        or planned now keeps its record: the kubelet re-sends prepares of running pods."""
        if record.state != "PrepareCompleted" or isinstance(claim, ClaimError):
            return False
        try:
            plan = self._plan(ref, claim, devices)
        except ClaimError:
            return False
        now = {(s.device, s.share_id) for s in plan.shares}
        return now != {(d.device_name, d.share_id) for d in record.devices}

    def _commit(self, state: LedgerState, base: LedgerState,
                admitted: list[tuple[ClaimPlan, ClaimRecord]],
                devices: Mapping[str, PublishedDevice],
                outcomes: dict[str, Sequence[DeviceAnswer] | Exception],
                leftover: list[str]) -> None:
        """Write the admitted claims (started, CDI specs, completed); set their outcomes
        only for what reached disk. ``leftover``: specs whose records ``state`` no longer
        has, removed once that is written."""
        try:
            self._write(state)
        except LedgerError as exc:
            self._fail_batch(admitted, exc, outcomes, base, leftover)
            return
        self._drop_specs(leftover)
        final = state
        done: list[tuple[ClaimPlan, ClaimRecord]] = []
        for plan, record in admitted:
            try:
                spec = cdi.build_claim_spec(
                    plan, devices, dev_root=str(self.dev_root),
                    dev_view=str(self.dev_view) if self.dev_view else None,
                    extra=self.cdi_edits, start_gate=self.start_gate,
                    control=self.control)
                cdi.write_spec(self.cdi_root, plan.uid, spec, disk=self.disk)
            except (OSError, ValueError) as exc:
                outcomes[plan.uid] = _node_error("prepare", exc)
                if self._remove_spec(plan.uid):  # else its started record stays, rolled back later
                    final = final.without(plan.uid)
                continue
            completed = record.model_copy(update={"state": "PrepareCompleted"})
            final = final.with_record(completed)
            done.append((plan, completed))
        try:
            self._write(final)
        except LedgerError as exc:
            self._fail_batch(admitted, exc, outcomes, base, [])
            return
        now = time.monotonic()
        for plan, completed in done:
            outcomes[plan.uid] = completed.devices
            self._answered[plan.uid] = now
            log.info("prepared claim", extra={
                "claim_uid": plan.uid, "claim": f"{plan.namespace}/{plan.name}",
                "devices": [s.device for s in plan.shares],
                "resident_bytes": plan.resident_bytes, "awake_bytes": plan.awake_bytes})

    def _remove_spec(self, uid: str) -> bool:
        """Remove a claim's CDI spec; False (logged) when the disk refuses."""
        try:
            cdi.remove_spec(self.cdi_root, uid, disk=self.disk)
        except OSError as exc:
            log.warning("cannot remove the CDI spec of a claim not prepared (yet)",
                        extra={"claim_uid": uid, "error": str(exc)})
            return False
        return True

    def _drop_specs(self, uids: list[str]) -> None:
        """Remove specs whose records are gone from disk (best effort: orphan specs are
        removed by the next restore or garbage collection)."""
        for uid in uids:
            self._remove_spec(uid)

    def _fail_batch(self, admitted: list[tuple[ClaimPlan, ClaimRecord]], exc: Exception,
                    outcomes: dict[str, Sequence[DeviceAnswer] | Exception],
                    base: LedgerState, leftover: list[str]) -> None:
        """A ledger write failed: every admitted claim gets an error, and the batch is
        undone (ledger first, then specs), so the error leaves nothing behind."""
        error = _node_error("prepare", exc)
        for plan, _ in admitted:
            outcomes[plan.uid] = error
        log.error("prepare batch failed; undoing it",
                  extra={"error": str(exc), "claim_uids": [p.uid for p, _ in admitted]})
        if not self._write_quietly(base):
            return  # the records on disk (started or completed) still match the specs
        self._drop_specs([plan.uid for plan, _ in admitted] + leftover)

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

    async def unprepare(self, claims: Sequence[ClaimRef], *, deadline: float | None = None
                        ) -> dict[str, Exception | None]:
        """Unprepare a batch; per claim None (done, or nothing to do) or why not."""
        started = time.perf_counter()
        with self.calls.arrive("unprepare", [ref.uid for ref in claims], deadline) as call:
            outcomes = await self._locked("unprepare", claims, self._unprepare_locked,
                                          list(claims), deadline, call)
        elapsed = time.perf_counter() - started
        for ref in claims:
            outcome = outcomes[ref.uid]
            metrics.OPERATION_SECONDS.labels("unprepare", _reason(outcome)).observe(elapsed)
            if outcome is not None:
                log.warning("unprepare failed", extra={**ref.fields, "reason": _reason(outcome),
                                                       "error": str(outcome)})
        return outcomes

    def _unprepare_locked(self, claims: list[ClaimRef], deadline: float | None, call: Call
                          ) -> dict[str, Exception | None]:
        outcomes = self._unprepare_batch(claims, deadline, call)
        for uid, outcome in outcomes.items():
            if outcome is None:
                self.calls.took_effect(call, uid)
        return outcomes

    def _unprepare_batch(self, claims: list[ClaimRef], deadline: float | None, call: Call
                         ) -> dict[str, Exception | None]:
        outcomes: dict[str, Exception | None] = {}
        usable: list[ClaimRef] = []
        for ref in claims:
            try:
                cdi.spec_path(self.cdi_root, ref.uid)
            except ValueError as exc:
                outcomes[ref.uid] = ClaimError(
                    f"claim {ref.namespace}/{ref.name}: {exc}; nothing is prepared under it",
                    reason="invalid_uid")
                continue
            usable.append(ref)
        try:
            with file_lock(self.lock_path, self.lock_timeout_s, disk=self.disk):
                if _expired(deadline):
                    outcomes.update({ref.uid: _too_late("unprepare") for ref in usable})
                    return outcomes
                for ref in [r for r in usable if self.calls.overtaken(call, r.uid)]:
                    outcomes[ref.uid] = _overtaken("unprepare", ref)
                    usable.remove(ref)
                state = self.ledger.read()
                known = {ref.uid for ref in usable if state.get(ref.uid) is not None}
                if known:
                    self._write(LedgerState(state.boot_id, {
                        uid: r for uid, r in state.claims.items() if uid not in known}))
                else:
                    self._remember(state)
                for ref in usable:  # the records are gone: now the specs
                    try:
                        removed = cdi.remove_spec(self.cdi_root, ref.uid, disk=self.disk)
                    except OSError as exc:
                        outcomes[ref.uid] = _node_error("unprepare", exc)
                        continue
                    outcomes[ref.uid] = None
                    self._answered.pop(ref.uid, None)
                    if removed or ref.uid in known:
                        log.info("unprepared claim", extra=ref.fields)
        except (LedgerError, OSError) as exc:
            error = _node_error("unprepare", exc)
            for ref in usable:
                outcomes.setdefault(ref.uid, error)
        return outcomes

    # -- garbage collection --------------------------------------------------------------

    async def collect(self, uids: Collection[str], *, decided_at: float) -> list[str]:
        """Remove the records and CDI specs of ``uids`` (claims the caller found gone),
        under the same locks as prepare; also roll back stale started records and remove
        specs without a record. A claim answered prepared after ``decided_at``
        (``time.monotonic()``) is kept: the kubelet holds it.

        Returns:
            The uids whose records were removed.

        Raises:
            LedgerError: the lock or the ledger could not be read or written.
        """
        with self.calls.arrive("collect", uids):
            async with self._lock:
                return await finish_first(asyncio.to_thread(self._collect_locked, set(uids),
                                                            decided_at))

    def _collect_locked(self, uids: set[str], decided_at: float) -> list[str]:
        with file_lock(self.lock_path, self.lock_timeout_s, disk=self.disk):
            on_disk = self.ledger.read()
            state = self._roll_back_started(on_disk)
            gone = sorted(uid for uid in uids
                          if (r := state.get(uid)) is not None and r.state == "PrepareCompleted"
                          and self._answered.get(uid, -math.inf) < decided_at)
            for uid in gone:
                state = state.without(uid)
            if state != on_disk:
                self._write(state)
            for uid in gone:
                self._answered.pop(uid, None)
                record = on_disk.claims[uid]
                log.warning("collected the ledger record of a claim that is gone",
                            extra={"claim_uid": uid, "claim": record.ref})
            self._remove_orphan_specs(state)
            return gone

    def stalled(self) -> str:
        """Empty unless a call is still in flight well past its deadline (a worker thread
        stuck in a hung disk write); then what is wedged. See :mod:`driver.calls`."""
        return self.calls.stalled()

    def records(self) -> LedgerState:
        """The ledger as on disk now (read without the lock: writes are atomic renames)."""
        return self.ledger.read()

    # -- bookkeeping ---------------------------------------------------------------------

    def _write(self, state: LedgerState) -> None:
        size = self.ledger.write(state)
        metrics.LEDGER_BYTES.set(size)
        self._remember(state)

    def _write_quietly(self, state: LedgerState) -> bool:
        try:
            self._write(state)
        except LedgerError as exc:
            log.error("cannot write the ledger", extra={"error": str(exc)})
            return False
        return True

    def _remember(self, state: LedgerState) -> None:
        self._state = state
        metrics.CLAIMS_PREPARED.set(
            sum(1 for r in state.claims.values() if r.state == "PrepareCompleted"))


_Outcomes = TypeVar("_Outcomes")


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _too_late(what: str) -> ClaimError:
    return ClaimError(f"the caller's deadline passed before the {what} could start; nothing "
                      "was done", reason="deadline", permanent=False)


def _overtaken(what: str, ref: ClaimRef) -> ClaimError:
    other = "unprepare" if what == "prepare" else "prepare"
    return ClaimError(f"a {other} of claim {ref.namespace}/{ref.name} that arrived after this "
                      f"{what} has already run; this {what} was overtaken and did nothing",
                      reason="superseded", permanent=False)


def _node_error(what: str, exc: Exception) -> ClaimError:
    return ClaimError(f"{what} failed on the node: {exc}", reason="node_error",
                      permanent=False)


def _reason(outcome: object) -> str:
    if isinstance(outcome, ClaimError):
        return outcome.reason
    return "error" if isinstance(outcome, Exception) else "ok"
