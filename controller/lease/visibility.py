"""What kubectl shows about one GPU's engines, from what its worker does.

A :class:`GpuVisibility` turns a GPU worker's steps into the visible state that
:mod:`controller.lease.visible_state` defines: Events (``SwitchedIn``, ``SwitchedOut``,
``SwitchFailed`` with a CamelCase cause, ``StartWaiting``, ``StartAdmitted``, the Warning
``FootprintCreeping``), the
``gpu.rota.dev/state`` label of every engine pod on the GPU, and the ``Awake`` and
``Ready`` conditions of each claim's device. It only queues writes
(:class:`controller.lease.visible_state_writer.VisibleStateWriter` sends them off the switch's
path); a failed write never delays or fails a switch.

The labels follow the GPU Lease: after every Lease write every engine of its awake set
(the holder of an ``awake`` Lease, and the engines awake beside the holder,
:attr:`~rota.api.gpu_lease.GpuLease.companions`, in any state) is ``awake``, the model a
``failed`` Lease names and every engine in an unknown state are ``failed``, every other
engine is ``asleep``; while a switch runs its two engines are ``switching`` (a start's
newcomer is ``starting``), and the engines of an awake set it does not touch stay
``awake``. The Events follow the Lease the same way: ``SwitchedIn`` for a target the Lease
names awake (holder or beside it), ``SwitchedOut`` for an engine it no longer does.

Notes carry no per-switch numbers (fencing number, timings: ``kubectl rota status`` and the
metrics have them), so that repeated switches join one Event's series instead of writing a
new Event each time.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from controller.claimants import Claimant
from controller.lease.device import FootprintNotice
from controller.lease.switch import SwitchResult
from controller.lease.visible_state import (
    EngineState,
    EventReason,
    Occurrence,
    camel_cause,
    claim_ref,
    pod_ref,
)
from controller.lease.visible_state_writer import VisibleStateWriter
from rota.api import naming
from rota.api.gpu_lease import GpuLease

__all__ = ["GpuVisibility"]


class GpuVisibility:
    """The visible state of the engines of one GPU (``gpu``), written through ``writer``."""

    def __init__(self, writer: VisibleStateWriter, gpu: str) -> None:
        self.writer = writer
        self.gpu = gpu

    # -- labels and conditions ------------------------------------------------------------------

    def settled(self, on_gpu: Sequence[Claimant], lease: GpuLease, *,
                unknown: Collection[str] = ()) -> None:
        """After a Lease write: every engine's label and conditions from ``lease``;
        ``unknown`` are the claim uids of engines that may be awake."""
        for claimant in on_gpu:
            state = _state_of(claimant, lease, unknown=unknown)
            self.writer.pod_state(claimant, state)
            reason, message = self._condition_words(claimant, state, lease)
            self.writer.claim_conditions(claimant, awake=state is EngineState.AWAKE,
                                         ready=claimant.serving, reason=reason,
                                         message=message)

    def switching(self, holder: Claimant | None, target: Claimant, *,
                  starting: bool = False) -> None:
        """A switch from ``holder`` to ``target`` begins (a start when ``starting``). In an
        awake set, ``holder`` is the engine put to sleep for ``target`` (None: none is);
        the members that stay awake keep their label."""
        if holder is not None and holder is not target:
            self.writer.pod_state(holder, EngineState.SWITCHING)
        self.writer.pod_state(target, EngineState.STARTING if starting
                              else EngineState.SWITCHING)

    def displacing(self, members: Sequence[Claimant]) -> None:
        """The further members of an awake set a switch puts to sleep (beside the one
        :meth:`switching` names) are ``switching`` while it runs."""
        for member in members:
            self.writer.pod_state(member, EngineState.SWITCHING)

    def _condition_words(self, claimant: Claimant, state: EngineState, lease: GpuLease
                         ) -> tuple[str, str]:
        if not claimant.serving:
            return "NotReady", "the engine's pod is not ready"
        if state is EngineState.AWAKE and _beside(lease, claimant):
            return "AwakeWith", (f"awake on {self.gpu} beside "
                                 f"{_others(lease, claimant) or 'nobody'} "
                                 f"(fencing number {lease.fence})")
        if state is EngineState.AWAKE and lease.companions:
            return "Holder", (f"awake on {self.gpu} (fencing number {lease.fence}), with "
                              f"{_others(lease, claimant)} awake beside")
        if state is EngineState.AWAKE:
            return "Holder", f"awake on {self.gpu} (fencing number {lease.fence})"
        if state is EngineState.FAILED:
            return "SwitchFailed", lease.last_error or "the engine's state is unknown"
        holder = lease.holder if lease.state == naming.STATE_AWAKE else ""
        if lease.companions:
            return "Asleep", (f"asleep; {holder or 'nobody'} holds {self.gpu}, with "
                              f"{', '.join(m.claim for m in lease.companions)} awake beside")
        return "Asleep", f"asleep; {holder or 'nobody'} holds {self.gpu}"

    # -- events -------------------------------------------------------------------------------

    def switched(self, result: SwitchResult, holder: Claimant | None, target: Claimant, *,
                 start: bool = False, rule: str = "") -> None:
        """The Events of a finished switch (or start) from ``holder`` to ``target``;
        ``rule`` is the switch policy's rule that made it
        (:data:`controller.lease.policy.RULES`)."""
        why = f" (policy: {rule})" if rule else ""
        if not result.ok:
            self._record(target, EventReason.SWITCH_FAILED,
                         f"{camel_cause(result.reason)}: {result.message}"
                         f" (switch to {target.model or target.ref} on {self.gpu})")
            return
        lease = result.lease
        if holder is not None and holder is not target and not _beside(lease, holder):
            self._record(holder, EventReason.SWITCHED_OUT,
                         f"put to sleep on {self.gpu} for {target.model or target.ref}{why}")
        if holder is target and lease.holder != target.ref and not _beside(lease, target):
            self._record(target, EventReason.SWITCHED_OUT,
                         f"put to sleep on {self.gpu} ({result.reason or 'idle'}){why}")
            return
        if start:
            self._record(target, EventReason.START_ADMITTED,
                         f"started on {self.gpu} and proved by the probe")
        if lease.holder == target.ref or _beside(lease, target):
            self._record(target, EventReason.SWITCHED_IN,
                         f"awake on {self.gpu}{why}")

    def displaced(self, result: SwitchResult, members: Sequence[Claimant], target: Claimant,
                  *, rule: str = "") -> None:
        """The ``SwitchedOut`` Events of the further members of an awake set a finished
        switch to ``target`` put to sleep (beside the one :meth:`switched` names): each
        that its Lease no longer names awake."""
        if not result.ok:
            return
        why = f" (policy: {rule})" if rule else ""
        for member in members:
            if member is target or _names_awake(result.lease, member):
                continue
            self._record(member, EventReason.SWITCHED_OUT,
                         f"put to sleep on {self.gpu} for {target.model or target.ref}{why}")

    def start_waiting(self, claimant: Claimant, holder: str) -> None:
        """``claimant``'s start gate asked for a start slot; it waits for one."""
        self._record(claimant, EventReason.START_WAITING,
                     f"waiting at the start gate until {holder or 'the GPU'} is put to sleep "
                     f"on {self.gpu}")

    def footprint_creeping(self, notice: FootprintNotice) -> None:
        """A claimant's footprint passed the warning line (a Warning Event, once per
        crossing: :class:`controller.lease.device.FootprintWatch`)."""
        self._record(notice.claimant, EventReason.FOOTPRINT_CREEPING, notice.message)

    def _record(self, claimant: Claimant, reason: EventReason, note: str) -> None:
        claim = claim_ref(claimant)
        pod = pod_ref(claimant)
        self.writer.record(Occurrence(pod or claim, reason, note,
                                      related=claim if pod is not None else None))


def _beside(lease: GpuLease, claimant: Claimant) -> bool:
    """``lease`` names ``claimant`` (ref and uid) among the engines awake beside its holder."""
    return bool(claimant.claim_uid) and any(
        m.claim == claimant.ref and m.uid == claimant.claim_uid for m in lease.companions)


def _names_awake(lease: GpuLease, claimant: Claimant) -> bool:
    """``lease`` names ``claimant`` in its awake set: the holder of an ``awake`` Lease (by
    claim and, where the Lease records it, uid: a claim created again under the holder's
    name is another engine), or an engine beside it (in any state)."""
    holds = lease.state == naming.STATE_AWAKE and lease.holder == claimant.ref and (
        not lease.holder_claim_uid or lease.holder_claim_uid == claimant.claim_uid)
    return holds or _beside(lease, claimant)


def _others(lease: GpuLease, claimant: Claimant) -> str:
    """The rest of ``lease``'s awake set beside ``claimant``, by claim."""
    return ", ".join(m.claim for m in lease.awake_set if m.uid != claimant.claim_uid)


def _state_of(claimant: Claimant, lease: GpuLease, *, unknown: Collection[str]
              ) -> EngineState:
    if _names_awake(lease, claimant):
        return EngineState.AWAKE
    if claimant.claim_uid in unknown:
        return EngineState.FAILED
    if lease.state == naming.STATE_FAILED and claimant.model and (
            claimant.model == lease.target_model):
        return EngineState.FAILED
    return EngineState.ASLEEP

