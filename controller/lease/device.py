"""What is on a GPU right now, read through the driver's node inspection API, and the
pure check the switch makes before every wake."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.errors import LeaseControllerError
from rota.api.quantity import format_bytes
from rota.kit.grpc_services import unary_client
from rota.pb.rota.v1 import inspect_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["NodeInspection"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int
    claim_uid: str
    """The claim the process names in its own environment (anyone can set it)."""
    pod_uid: str
    """The pod the kernel puts the process in (its cgroup); empty for none."""
    used_bytes_unknown: bool = False
    """NVML cannot tell what the process holds (``used_bytes`` is then 0): anything."""


@dataclass(frozen=True)
class GpuSnapshot:
    uuid: str
    device: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    processes: tuple[GpuProcess, ...]

    def used_by(self, claim_uid: str) -> int:
        """Memory of the processes that name ``claim_uid`` themselves: a report, not proof,
        only for the memory metrics (every decision attributes by pod: :meth:`held_by`)."""
        return sum(p.used_bytes for p in self.processes if p.claim_uid == claim_uid)

    def processes_of(self, claimant: Claimant, claimants: Sequence[Claimant]
                     ) -> tuple[GpuProcess, ...]:
        """The processes on this GPU that belong to ``claimant`` by :func:`owner_of` (its
        pod), among ``claimants``: what a co-tenant writes into its environment does not
        count."""
        everyone = _with(claimants, claimant)
        return tuple(p for p in self.processes
                     if (owner := owner_of(p, everyone)) is not None
                     and owner.claim_uid == claimant.claim_uid)

    def held_by(self, claimant: Claimant, claimants: Sequence[Claimant]) -> int:
        """Memory of :meth:`processes_of` ``claimant``."""
        return sum(p.used_bytes for p in self.processes_of(claimant, claimants))


def _with(claimants: Sequence[Claimant], claimant: Claimant) -> list[Claimant]:
    if any(c.claim_uid == claimant.claim_uid for c in claimants):
        return list(claimants)
    return [*claimants, claimant]


class DeviceError(LeaseControllerError):
    """The inspection API did not answer."""


class DeviceReader:
    """Client of the driver's inspection socket (one channel for the process)."""

    def __init__(self, socket: Path, *, timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    async def read(self) -> dict[str, GpuSnapshot]:
        """Every GPU of the node, by device name."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        try:
            answer: pb.InspectGpusResponse = await unary_client(
                self._channel, SERVICE, "InspectGpus")(pb.InspectGpusRequest(),
                                                       timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise DeviceError(f"inspection API at {self.socket}: {exc.code().name}: "
                              f"{exc.details()}") from exc
        return {g.device: GpuSnapshot(
            uuid=g.uuid, device=g.device, total_bytes=g.total_bytes, used_bytes=g.used_bytes,
            free_bytes=g.free_bytes,
            processes=tuple(GpuProcess(p.pid, p.used_bytes, p.claim_uid, p.pod_uid,
                                       p.used_bytes_unknown)
                            for p in g.processes)) for g in answer.gpus}

    async def verify_start_token(self, claim_uid: str, token: str) -> bool:
        """Whether ``token`` is the start-gate token the driver gave ``claim_uid``."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        try:
            answer: pb.VerifyStartTokenResponse = await unary_client(
                self._channel, SERVICE, "VerifyStartToken")(
                pb.VerifyStartTokenRequest(claim_uid=claim_uid, token=token),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise DeviceError(f"inspection API at {self.socket}: {exc.code().name}: "
                              f"{exc.details()}") from exc
        return bool(answer.valid)

    async def control_token(self, claim_uid: str) -> str:
        """The control token the driver gave ``claim_uid``'s containers (the engine guard
        admits control calls with it, and with nothing else).

        Raises:
            DeviceError: the inspection API did not answer, or gave no token.
        """
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        try:
            answer: pb.ControlTokenResponse = await unary_client(
                self._channel, SERVICE, "ControlToken")(
                pb.ControlTokenRequest(claim_uid=claim_uid), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise DeviceError(f"inspection API at {self.socket}: {exc.code().name}: "
                              f"{exc.details()}") from exc
        if not answer.token:
            raise DeviceError(f"inspection API at {self.socket} gave no control token for "
                              f"claim {claim_uid}")
        return str(answer.token)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None


@dataclass(frozen=True)
class HandbackProblem:
    """Why the GPU is not ready for a wake; ``reason`` is a metric label."""

    reason: str
    message: str


def owner_of(process: GpuProcess, claimants: Sequence[Claimant]) -> Claimant | None:
    """The claimant a process on the GPU belongs to, or None (a stranger).

    The process must run in the claimant's pod, by the pod uid the kernel gives it (its
    cgroup) and the claim's own reservation: a process can write any ``ROTA_CLAIM_UID``
    into its environment, not its cgroup. A process that names a claim is that claim's only
    in the claim's pod; one that names none (a child that dropped its environment) is the
    claimant's whose pod it runs in, if exactly one claimant's."""
    if not process.pod_uid:
        return None
    in_pod = [c for c in claimants if c.pod_uid == process.pod_uid]
    if process.claim_uid:
        return next((c for c in in_pod if c.claim_uid == process.claim_uid), None)
    return in_pod[0] if len(in_pod) == 1 else None


def check_before_wake(snapshot: GpuSnapshot, *, target: Claimant,
                      claimants: Sequence[Claimant], tolerance_bytes: int,
                      unknown_limit_bytes: int, starting: bool = False,
                      awake: Sequence[Claimant] = ()) -> HandbackProblem | None:
    """The NVML check of step 4 on one GPU: every other claimant is down to its resident
    footprint on that GPU, no unknown process holds memory, and free memory covers the
    target's wake. Processes are attributed by :func:`owner_of`. A process whose size NVML
    cannot tell may hold anything: a stranger's stops the wake, another claimant's has not
    handed its memory back, and the target's own counts as nothing held (its whole wake
    must fit). For a ``starting`` engine nothing its pod holds now is memory it reuses (a
    previous container still exiting): its whole awake budget must be free.

    ``awake``: the engines of an awake set that stay awake beside the target (none: one
    awake). Each must be at or under its awake budget + tolerance instead of its resident
    footprint, and the free memory must cover the target's wake *and* what they may still
    grow into up to their awake budgets: the set fits the GPU on their budgets, not only
    on this reading."""
    everyone = _with(claimants, target)
    staying = {c.claim_uid: c for c in awake if c.claim_uid != target.claim_uid}
    owners = [(p, owner_of(p, everyone)) for p in snapshot.processes]

    def used_by(claimant: Claimant) -> int:
        return sum(p.used_bytes for p, owner in owners
                   if owner is not None and owner.claim_uid == claimant.claim_uid)

    for claimant in claimants:
        if claimant.claim_uid == target.claim_uid:
            continue
        used = used_by(claimant)
        if claimant.claim_uid in staying:
            problem = _over_awake_budget(claimant, used, snapshot.device, tolerance_bytes,
                                         unsized=any(
                                             p.used_bytes_unknown for p, owner in owners
                                             if owner is not None
                                             and owner.claim_uid == claimant.claim_uid))
            if problem is not None:
                return problem
            continue
        resident = claimant.resident_on(snapshot.device)
        limit = resident + tolerance_bytes
        if any(p.used_bytes_unknown for p, owner in owners
               if owner is not None and owner.claim_uid == claimant.claim_uid):
            return HandbackProblem(
                "memory_not_returned",
                f"{claimant.ref} ({claimant.model}) has a process on {snapshot.device} that "
                f"holds an unknown amount (NVML cannot tell): its memory may not be handed "
                f"back")
        if used > limit:
            return HandbackProblem(
                "memory_not_returned",
                f"{claimant.ref} ({claimant.model}) holds {format_bytes(used)} on "
                f"{snapshot.device}, above its resident {format_bytes(resident)}"
                f" + {format_bytes(tolerance_bytes)}: its memory was not handed back")
    strangers = [p for p, owner in owners if owner is None]
    held = sum(p.used_bytes for p in strangers)
    unsized = [p for p in strangers if p.used_bytes_unknown]
    if unsized:
        return HandbackProblem(
            "unknown_process",
            f"processes that belong to no claimant hold an unknown amount (NVML cannot "
            f"tell) on {snapshot.device}: {', '.join(str(p.pid) for p in unsized[:5])}")
    if held > unknown_limit_bytes:
        pids = ", ".join(f"{p.pid} ({format_bytes(p.used_bytes)})" for p in strangers[:5])
        return HandbackProblem(
            "unknown_process",
            f"processes that belong to no claimant hold {format_bytes(held)} on "
            f"{snapshot.device}: {pids}")
    reused = 0 if starting else used_by(target)
    needed = max(0, target.config.awake_memory - reused)
    growth = sum(max(0, c.config.awake_memory - used_by(c)) for c in staying.values())
    if needed + growth > snapshot.free_bytes:
        kept = (f", of which {format_bytes(growth)} is kept for the engines awake beside "
                f"it to reach their awake budgets" if growth else "")
        return HandbackProblem(
            "insufficient_memory",
            f"{target.ref} needs {format_bytes(needed)} more to wake; {snapshot.device} has "
            f"{format_bytes(snapshot.free_bytes)} free{kept}")
    return None


def _over_awake_budget(claimant: Claimant, used: int, device: str, tolerance_bytes: int, *,
                       unsized: bool) -> HandbackProblem | None:
    """A member of an awake set that stays awake beside a wake holds more than its awake
    budget + tolerance (or an amount NVML cannot tell): the set no longer fits as
    planned, and the wake is refused with the numbers."""
    budget = claimant.config.awake_memory
    if unsized:
        return HandbackProblem(
            "awake_over_budget",
            f"{claimant.ref} ({claimant.model}) is awake beside the wake and has a process "
            f"on {device} that holds an unknown amount (NVML cannot tell): the awake set "
            f"may not fit")
    if used > budget + tolerance_bytes:
        return HandbackProblem(
            "awake_over_budget",
            f"{claimant.ref} ({claimant.model}) is awake beside the wake and holds "
            f"{format_bytes(used)} on {device}, above its awake budget "
            f"{format_bytes(budget)} + {format_bytes(tolerance_bytes)}: the awake set no "
            f"longer fits as planned")
    return None


# -- footprint creep ----------------------------------------------------------------------

FOOTPRINT_WARN_FRACTION = 0.9
"""Default of ``--footprint-warn-fraction``: the notice comes once a claimant holds more
than this share of its budget + tolerance (the line past which a wake is refused)."""
REARM_MARGIN = 0.05
"""Hysteresis: a claimant that was warned about is warned again only after its footprint
fell this share of its budget + tolerance below the warning line (a restart, a raised
budget), so a footprint that hovers at the line gives one notice, not one per switch."""
ASLEEP = "asleep"
AWAKE = "awake"


@dataclass(frozen=True)
class FootprintNotice:
    """A claimant's measured footprint on one GPU has passed the warning line: it creeps
    toward the point where the wake check refuses a wake because of it."""

    claimant: Claimant
    device: str
    state: str
    """:data:`ASLEEP` (measured against its resident budget) or :data:`AWAKE` (the engine
    about to be woken, against its awake budget)."""
    used_bytes: int
    budget_bytes: int
    limit_bytes: int
    """Budget + tolerance: above it, an asleep claimant stops every wake on the GPU."""

    @property
    def message(self) -> str:
        """What the numbers are and what to do (the Event's note, the log line's text)."""
        c = self.claimant
        share = self.used_bytes / self.limit_bytes if self.limit_bytes else 1.0
        budget = "resident" if self.state == ASLEEP else "awake"
        what = ("wakes on this GPU are refused once it holds more than"
                if self.state == ASLEEP else
                "the other engines' budgets leave it no more than")
        return (f"{c.ref} ({c.model}) holds {format_bytes(self.used_bytes)} {self.state} on "
                f"{self.device}: {share:.0%} of its {budget} budget "
                f"{format_bytes(self.budget_bytes)} + tolerance "
                f"{format_bytes(self.limit_bytes - self.budget_bytes)}; {what} "
                f"{format_bytes(self.limit_bytes)}. Its footprint grows across sleep/wake "
                f"cycles (the engine leaks): restart the engine's pod, or raise its "
                f"{budget} budget in its EngineConfig")


def footprints(snapshot: GpuSnapshot, *, target: Claimant, claimants: Sequence[Claimant],
               starting: bool = False, awake: Sequence[Claimant] = ()
               ) -> list[tuple[Claimant, str, int, int]]:
    """What the wake check measures, per claimant on ``snapshot``'s GPU: (claimant, state,
    used bytes, budget bytes). The claimants other than ``target`` are asleep (their
    resident budget); ``target`` is measured against its awake budget, except when it is
    ``starting`` (its pod's memory is a previous container's), and so are the ``awake``
    members of an awake set. A claimant with a process whose size NVML cannot tell is left
    out (the wake check refuses it anyway)."""
    everyone = _with(claimants, target)
    awake_uids = {c.claim_uid for c in awake}
    owned: dict[str, list[GpuProcess]] = {}
    for process in snapshot.processes:
        owner = owner_of(process, everyone)
        if owner is not None:
            owned.setdefault(owner.claim_uid, []).append(process)
    measured = []
    for claimant in everyone:
        is_target = claimant.claim_uid == target.claim_uid
        if is_target and starting:
            continue
        if snapshot.device not in claimant.gpus:
            continue
        processes = owned.get(claimant.claim_uid, [])
        if any(p.used_bytes_unknown for p in processes):
            continue
        used = sum(p.used_bytes for p in processes)
        if is_target or claimant.claim_uid in awake_uids:
            measured.append((claimant, AWAKE, used, claimant.config.awake_memory))
        else:
            measured.append((claimant, ASLEEP, used, claimant.resident_on(snapshot.device)))
    return measured


def warning_line(budget: int, limit: int, fraction: float) -> float:
    """The footprint past which a notice comes: ``fraction`` of budget + tolerance, and
    never below the budget itself (an awake engine fills its awake budget by design)."""
    return max(float(budget), fraction * limit)


@dataclass
class FootprintWatch:
    """Notices a claimant's footprint creeping toward its budget, from the snapshots the
    wake check reads anyway (no NVML read of its own): the ratio gauge on every read, and
    once per crossing of the warning line (hysteresis: :data:`REARM_MARGIN`) a JSON log
    line and ``notify`` (the lease controller's Warning Event)."""

    fraction: float = FOOTPRINT_WARN_FRACTION
    notify: Callable[[FootprintNotice], None] | None = None
    warned: set[tuple[str, str, str]] = field(default_factory=set)
    """(claim uid, device, state) past the line and already told."""
    series: dict[tuple[str, str], set[tuple[str, str, str, str]]] = field(
        default_factory=dict)
    """The gauge's label values per (claim uid, device)."""

    def observe(self, snapshot: GpuSnapshot, *, target: Claimant,
                claimants: Sequence[Claimant], tolerance_bytes: int,
                starting: bool = False, awake: Sequence[Claimant] = ()
                ) -> list[FootprintNotice]:
        """Measure every claimant on the snapshot; the notices of those that just crossed
        the warning line (each also logged and passed to ``notify``)."""
        self._forget_gone(snapshot.device, {c.claim_uid for c in _with(claimants, target)})
        notices = []
        for claimant, state, used, budget in footprints(
                snapshot, target=target, claimants=claimants, starting=starting,
                awake=awake):
            labels = (claimant.ref, claimant.model, snapshot.device, state)
            self.series.setdefault((claimant.claim_uid, snapshot.device), set()).add(labels)
            metrics.FOOTPRINT_RATIO.labels(*labels).set(used / budget if budget else 0.0)
            limit = budget + tolerance_bytes
            notice = self._crossed(FootprintNotice(claimant, snapshot.device, state, used,
                                                   budget, limit))
            if notice is not None:
                notices.append(notice)
                self._tell(notice)
        return notices

    def _crossed(self, notice: FootprintNotice) -> FootprintNotice | None:
        """``notice`` when its footprint is newly past the line; re-arms one that fell back."""
        key = (notice.claimant.claim_uid, notice.device, notice.state)
        line = warning_line(notice.budget_bytes, notice.limit_bytes, self.fraction)
        if notice.used_bytes > line:
            if key in self.warned:
                return None
            self.warned.add(key)
            return notice
        if notice.used_bytes <= line - REARM_MARGIN * notice.limit_bytes:
            self.warned.discard(key)
        return None

    def _tell(self, notice: FootprintNotice) -> None:
        c = notice.claimant
        log.warning(notice.message, extra={
            "event": "footprint_creeping", "claim": c.ref, "pod": c.pod_name,
            "device": notice.device, "model": c.model, "state": notice.state,
            "used_bytes": notice.used_bytes, "budget_bytes": notice.budget_bytes,
            "limit_bytes": notice.limit_bytes})
        if self.notify is not None:
            self.notify(notice)

    def _forget_gone(self, device: str, present: set[str]) -> None:
        """Drop what is remembered on ``device`` of claims not among ``present`` (the wake
        check is given every claimant of the GPU): a new claim starts unwarned, and the
        gauge keeps no series of a claim that left."""
        self.warned = {k for k in self.warned if k[1] != device or k[0] in present}
        for key in [k for k in self.series if k[1] == device and k[0] not in present]:
            for labels in self.series.pop(key):
                try:
                    metrics.FOOTPRINT_RATIO.remove(*labels)
                except KeyError:
                    pass
