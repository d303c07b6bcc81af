"""Gang switches: the switches that change more than one GPU Lease at once.

A tensor-parallel engine holds several GPUs (:attr:`Claimant.gpus`) and is awake only as
the holder of every one. Waking it takes all of its GPUs in one switch; putting one to
sleep so that another engine can have one of its GPUs gives back all of them. Both are
gang switches, made here; a switch between two one-GPU engines stays with
:class:`controller.lease.switch.Switcher` alone.

The GPUs of a gang switch (its *set*) are the target's GPUs and, of every engine it puts
to sleep, the GPUs whose Lease names that engine. The caller holds the locks of all of them
(:class:`controller.lease.gpu_locks.GpuLocks`, taken in GPU order), so no other step of this
controller touches them meanwhile. The steps, as for one GPU:

1. every Lease of the set says ``switching`` (or ``starting``) under a new fencing number,
   written in GPU order;
2. every holder drains, then sleeps (all at once), each sleep confirmed;
3. every GPU of the target is read: each holder is down to its resident footprint there,
   no unknown process, the target's awake budget free on each;
4. the target wakes and answers the correctness request;
5. the target's Leases name it (``awake``, with :data:`naming.GANG`); the set's other
   GPUs are ``idle``.

Fencing covers the whole set: before every sleep and wake, every Lease of the set is read
from the API server and must carry this switch's fencing number. A start's grant is first
recorded on every Lease of the set (``gpu.rota.dev/start-granted``, by compare-and-swap,
which is the grant's fencing check), as a one-GPU start records it on its Lease: an
instance that takes over while the newcomer comes up wakes nobody on its GPUs until the
newcomer is known (:mod:`controller.lease.gpu`).

Failure keeps one owner on every GPU: a sleep whose outcome is unknown wakes nobody (every
Lease of the set says ``failed``, the engine is unsettled); a target that fails is put back
to sleep; and each old holder is woken back only after every GPU it holds is read again.
One that cannot be stays asleep, and its Leases say ``failed``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from controller.claimants import Claimant, gpu_order
from controller.lease.admission import StartSwitch, StartTicket
from controller.lease.engines.base import EngineAdapter
from controller.lease.errors import LeaseControllerError
from controller.lease.switch import (
    Fenced,
    LeasePort,
    SleepUnknown,
    Switcher,
    SwitchFailed,
    gang_of,
    reason_of,
)
from rota.api import naming
from rota.api.gpu_lease import GpuLease

log = logging.getLogger(__name__)


@dataclass
class GangResult:
    """The outcome of a gang switch: the Lease of every GPU of its set, as written."""

    ok: bool
    leases: dict[str, GpuLease]
    reason: str = ""
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    unsettled: tuple[Claimant, ...] = ()
    holders: tuple[Claimant, ...] = ()
    """The engines this switch put to sleep (or tried to)."""


def holders_of(target: Claimant, leases: Mapping[str, GpuLease],
               claimants: Sequence[Claimant]) -> tuple[Claimant, ...]:
    """The awake engines a switch to ``target`` must put to sleep: the holder of each of
    the target's GPUs (other than the target), once each, in GPU order."""
    by_ref = {c.ref: c for c in claimants}
    found: list[Claimant] = []
    for gpu in target.gpus:
        lease = leases.get(gpu)
        if lease is None or lease.state != naming.STATE_AWAKE or lease.holder == target.ref:
            continue
        holder = by_ref.get(lease.holder)
        if holder is not None and holder not in found:
            found.append(holder)
    return tuple(found)


def gang_set(target: Claimant, holders: Sequence[Claimant],
             leases: Mapping[str, GpuLease]) -> tuple[str, ...]:
    """The GPUs whose Lease a switch to ``target`` writes: the target's, and every GPU
    whose Lease names one of ``holders`` (``leases`` must cover the holders' GPUs)."""
    refs = {h.ref for h in holders}
    gpus = set(target.gpus) | {g for h in holders for g in h.gpus
                               if g in leases and leases[g].holder in refs}
    return tuple(sorted(gpus, key=gpu_order))


def needs_gang(target: Claimant, holders: Sequence[Claimant]) -> bool:
    """Whether a switch to ``target`` changes more than one GPU Lease."""
    return target.spans_gpus or any(h.spans_gpus for h in holders)


class GangSwitcher(Switcher):
    """The switch's steps, with a fencing check over every Lease of a gang's set."""

    def __init__(self, base: Switcher, ports: Mapping[str, LeasePort]) -> None:
        super().__init__(ports=base.ports, limits=base.limits, identity=base.identity)
        self._slept_before = base._slept_before  # first sleeps are the engine's, not ours
        self.lease_ports = dict(ports)
        self.fences: dict[str, int] = {}

    async def fenced_engine(self, claimant: Claimant, fence: int, timings: dict[str, float]
                            ) -> EngineAdapter:
        self.ports.guard()
        gpus = sorted(self.fences, key=gpu_order)
        current = await self._step(
            "fence", asyncio.gather(*(self.lease_ports[g].read() for g in gpus)),
            self.limits.timeouts.lease_s, timings)
        for gpu, lease in zip(gpus, current, strict=True):
            if lease.fence != self.fences[gpu]:
                self.ports.observer.fenced()
                raise Fenced(f"fence {self.fences[gpu]} is stale: the GPU Lease {lease.name} "
                             f"carries {lease.fence} (written by "
                             f"{lease.controller or 'unknown'})")
        self.ports.guard()
        # Every GPU Lease of the set travels with the calls, as one GPU's does
        # (Switcher.fenced_engine): the guard refuses a call older than one it accepted.
        return self.ports.engine(claimant).fenced(
            {lease.name: self.fences[gpu] for gpu, lease in zip(gpus, current, strict=True)})

    async def write_gpu(self, gpu: str, lease: GpuLease, timings: dict[str, float]
                        ) -> GpuLease:
        self.ports.guard()
        return await self._step("lease", self.lease_ports[gpu].write(lease),
                                self.limits.timeouts.lease_s, timings)


def holder_timings(timings: Mapping[str, float], holder: Claimant) -> dict[str, float]:
    """The steps of one holder in a gang switch's ``timings`` (see ``_sleep_all``)."""
    suffix = f":{holder.ref}"
    return {key.removesuffix(suffix): seconds for key, seconds in timings.items()
            if key.endswith(suffix)}


class GangSwitch:
    """Runs one gang switch (or start) over the Leases of its set."""

    def __init__(self, base: Switcher, ports: Mapping[str, LeasePort]) -> None:
        self.sw = GangSwitcher(base, ports)

    # -- Leases of the set -------------------------------------------------------------

    async def _open(self, leases: Mapping[str, GpuLease], state: naming.LeaseState, *,
                    holders: Sequence[Claimant], target: Claimant,
                    timings: dict[str, float]) -> dict[str, GpuLease]:
        opened: dict[str, GpuLease] = {}
        for gpu in sorted(leases, key=gpu_order):
            lease = leases[gpu]
            draining = next((h for h in holders if h.ref == lease.holder), None)
            mine = gpu in target.gpus
            opened[gpu] = await self.sw.write_gpu(gpu, lease.opening(
                state, controller=self.sw.identity,
                target_model=target.model if mine else "",
                draining_model=draining.model if draining else "",
                gang=gang_of(target) if mine else None), timings)
            self.sw.fences[gpu] = opened[gpu].fence
        return opened

    async def _close(self, opened: Mapping[str, GpuLease], *, awake: Sequence[Claimant],
                     state_without: naming.LeaseState, last_error: str,
                     timings: dict[str, float]
                     ) -> dict[str, GpuLease]:
        """Write every Lease of the set: the GPUs of ``awake`` engines name them, the
        others say ``state_without`` with no holder."""
        final: dict[str, GpuLease] = {}
        for gpu in sorted(opened, key=gpu_order):
            lease = opened[gpu]
            keeper = next((c for c in awake if gpu in c.gpus), None)
            if keeper is not None:
                lease = Switcher.serving(lease, keeper, last_error=last_error)
            elif state_without == naming.STATE_FAILED:
                lease = lease.failed(last_error)
            else:
                lease = lease.idle(last_error=last_error)
            final[gpu] = await self.sw.write_gpu(gpu, lease, timings)
        return final

    async def _fail(self, opened: Mapping[str, GpuLease], reason: str, message: str, *,
                    holders: Sequence[Claimant], restored: Sequence[Claimant] = (),
                    unsettled: tuple[Claimant, ...] = (), timings: dict[str, float]
                    ) -> GangResult:
        self.sw.ports.observer.switched(reason)
        final = await self._close(opened, awake=restored, state_without=naming.LeaseState.FAILED,
                                  last_error=f"{reason}: {message}", timings=timings)
        log.error("gang switch failed", extra={
            "device": ",".join(final), "reason": reason, "error": message,
            "holder": [c.ref for c in restored] or None,
            "unsettled": [c.ref for c in unsettled] or None})
        return GangResult(False, final, reason, message, timings, unsettled, tuple(holders))

    # -- steps --------------------------------------------------------------------------

    async def _sleep_all(self, holders: Sequence[Claimant], timings: dict[str, float]
                         ) -> None:
        """Drain and sleep every holder at once: ``drain`` and ``sleep`` in ``timings`` are
        the wall times of the two phases, each holder's own steps are keyed
        ``<step>:<holder ref>`` (:func:`holder_timings` reads them back). Raises
        :class:`Fenced` first, then the first :class:`SleepUnknown` (its ``unsettled``
        lists every engine whose sleep may still fire), then any other error."""
        if not holders:
            return
        own: dict[str, dict[str, float]] = {h.ref: {} for h in holders}
        clock = self.sw.ports.clock
        began = clock()
        try:
            await asyncio.gather(*(self.sw.drain(h, 0, own[h.ref]) for h in holders))
            drained = clock()
            timings["drain"] = drained - began
            outcomes = await asyncio.gather(*(self.sw.sleep(h, 0, own[h.ref])
                                              for h in holders), return_exceptions=True)
            timings["sleep"] = clock() - drained
        finally:
            # The phases' wall times above; each holder's own steps under "<step>:<ref>".
            timings.update({f"{step}:{ref}": seconds for ref, steps in own.items()
                            for step, seconds in steps.items()})
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        for kind in (Fenced, SleepUnknown, BaseException):
            first = next((e for e in errors if isinstance(e, kind)), None)
            if first is not None:
                if isinstance(first, SleepUnknown):
                    raise _SleepsUnknown(first, tuple(e.claimant for e in errors
                                                      if isinstance(e, SleepUnknown)))
                raise first

    async def _wake_back(self, holders: Sequence[Claimant], claimants: Sequence[Claimant],
                         timings: dict[str, float]) -> tuple[list[Claimant], list[str]]:
        """Wake every old holder back, each only after every GPU it holds is read again:
        the holders woken, and a note for each that stays asleep."""
        restored: list[Claimant] = []
        notes: list[str] = []
        for holder in holders:
            problem = await self.sw.check_restore(holder, claimants, timings)
            if problem is not None:
                notes.append(f"{holder.ref} stays asleep: {problem.message}")
                continue
            try:
                await self.sw.wake_and_probe(holder, 0, timings)
            except Fenced:
                raise
            except Exception as again:
                notes.append(f"waking {holder.ref} back failed: {again}")
                continue
            restored.append(holder)
        return restored, notes

    async def _restore(self, opened: Mapping[str, GpuLease], holders: Sequence[Claimant],
                       exc: BaseException, claimants: Sequence[Claimant],
                       timings: dict[str, float]) -> GangResult:
        """The switch failed: the old holders come back (:meth:`_wake_back`)."""
        restored, notes = await self._wake_back(holders, claimants, timings)
        message = "; ".join([str(exc) or type(exc).__name__, *notes])
        return await self._fail(opened, reason_of(exc), message, holders=holders,
                                restored=restored, timings=timings)

    async def _back_out(self, opened: Mapping[str, GpuLease], holders: Sequence[Claimant],
                        target: Claimant, exc: BaseException, claimants: Sequence[Claimant],
                        timings: dict[str, float]) -> GangResult:
        """The target was (maybe partly) woken and failed: sleep it, then restore."""
        try:
            await self.sw.sleep(target, 0, timings)
        except Fenced:
            raise
        except SleepUnknown as unknown:
            if not await self.sw.asleep_or_gone(unknown, 0, timings):
                return await self._fail(opened, reason_of(exc), f"{exc}; {unknown}",
                                        holders=holders, unsettled=(target,), timings=timings)
        except Exception as sleep_exc:
            log.warning("could not put the failed target back to sleep",
                        extra={"claim": target.ref, "error": str(sleep_exc)})
        return await self._restore(opened, holders, exc, claimants, timings)

    async def _record_grant(self, opened: Mapping[str, GpuLease], newcomer: Claimant,
                            timings: dict[str, float]) -> dict[str, GpuLease]:
        """The gate's go, recorded on every Lease of the set in GPU order before it is
        handed over (:meth:`StartSwitch.record_grants`): an instance that takes over while
        the newcomer imports finds the record on each GPU where it may come up awake, and
        wakes nobody there until it is known. The compare-and-swap writes are the fencing
        check over the whole set; a GPU of the set that the newcomer does not hold drops
        the record at its next reconciliation. Returns the set's Leases as written."""
        async def write(gpu: str, record: GpuLease) -> GpuLease:
            return await self.sw.write_gpu(gpu, record, timings)

        ordered = {gpu: opened[gpu] for gpu in sorted(opened, key=gpu_order)}
        return await StartSwitch.record_grants(ordered, write, newcomer)

    # -- the switch ---------------------------------------------------------------------

    async def switch(self, leases: Mapping[str, GpuLease], *, holders: Sequence[Claimant],
                     target: Claimant, claimants: Sequence[Claimant]) -> GangResult:
        """Make ``target`` the awake engine of every GPU it holds; ``leases`` are the
        Leases of the set (:func:`gang_set`) as last read or written."""
        sw = self.sw
        timings: dict[str, float] = {}
        begin = sw.ports.clock()
        opened = await self._open(leases, naming.LeaseState.SWITCHING, holders=holders,
                                  target=target, timings=timings)
        log.info("gang switch started", extra={
            "device": ",".join(opened), "from": [h.ref for h in holders] or None,
            "to": target.ref, "model": target.model})
        try:
            await self._sleep_all(holders, timings)
            handoff_start = sw.ports.clock()
            problem = await sw.check_device(target, claimants, timings)
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
        except Fenced:
            raise
        except _SleepsUnknown as exc:
            return await self._fail(opened, exc.first.reason, str(exc.first), holders=holders,
                                    unsettled=exc.claimants, timings=timings)
        except Exception as exc:
            return await self._restore(opened, holders, exc, claimants, timings)
        try:
            first_token_at = await sw.wake_and_probe(target, 0, timings)
        except Fenced:
            raise
        except Exception as exc:
            return await self._back_out(opened, holders, target, exc, claimants, timings)
        timings["handoff_to_first_token"] = first_token_at - handoff_start
        sw.ports.observer.handed_off(target.model, timings["handoff_to_first_token"])
        final = await self._close(opened, awake=[target], state_without=naming.LeaseState.IDLE,
                                  last_error="", timings=timings)
        timings["total"] = sw.ports.clock() - begin
        sw.ports.observer.switched(None)
        log.info("gang switch done", extra={
            "device": ",".join(final), "holder": target.ref, "model": target.model,
            "timings": {k: round(v, 4) for k, v in timings.items()}})
        return GangResult(True, final, timings=timings, holders=tuple(holders))

    async def start(self, leases: Mapping[str, GpuLease], *, holders: Sequence[Claimant],
                    newcomer: Claimant, claimants: Sequence[Claimant], ticket: StartTicket,
                    starter: StartSwitch, wanted: Callable[[], bool]) -> GangResult:
        """Start-up admission across the set: every holder of the newcomer's GPUs sleeps,
        its whole awake budget is free on each GPU, the gate is granted, the newcomer
        answers ``/health`` and the probe and sleeps once; then the newcomer stays awake
        if requests wait for it (or nobody held its GPUs), else the old holders are woken
        back, each after its GPUs are read again."""
        sw = self.sw
        timings: dict[str, float] = {}
        opened = await self._open(leases, naming.LeaseState.STARTING, holders=holders,
                                  target=newcomer, timings=timings)
        others = [c for c in claimants if c.claim_uid != newcomer.claim_uid]
        try:
            await self._sleep_all(holders, timings)
            problem = await sw.check_device(newcomer, others, timings, starting=True)
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
            opened = await self._record_grant(opened, newcomer, timings)
            await starter.hand_over(newcomer, ticket)
        except Fenced:
            ticket.refuse()
            raise
        except _SleepsUnknown as exc:
            ticket.refuse()
            sw.ports.observer.started("refused")
            return await self._fail(opened, exc.first.reason, str(exc.first), holders=holders,
                                    unsettled=exc.claimants, timings=timings)
        except Exception as exc:
            ticket.refuse()
            sw.ports.observer.started("refused")
            return await self._restore(opened, holders, exc, others, timings)
        try:
            started = await starter.until_up(newcomer, ticket, 0, timings)
            await sw.probe(started, 0, timings)
            await sw.sleep(started, 0, timings)  # the first sleep, before any user
        except Fenced:
            raise
        except SleepUnknown as exc:
            sw.ports.observer.started("failed")
            return await self._fail(opened, exc.reason, str(exc), holders=holders,
                                    unsettled=(exc.claimant,), timings=timings)
        except Exception as exc:
            sw.ports.observer.started("failed")
            return await self._back_out(opened, holders, newcomer, exc, others, timings)
        sw.ports.observer.started("ok")
        if not holders or wanted():
            return await self._wake_one(opened, started, others, holders, timings)
        restored, notes = await self._wake_back(holders, [*others, started], timings)
        message = "; ".join(notes)
        final = await self._close(opened, awake=restored,
                                  state_without=naming.LeaseState.FAILED if notes
                                  else naming.LeaseState.IDLE,
                                  last_error=f"restore_failed: {message}" if notes else "",
                                  timings=timings)
        return GangResult(not notes, final, "restore_failed" if notes else "", message,
                          timings, holders=tuple(holders))

    async def _wake_one(self, opened: Mapping[str, GpuLease], target: Claimant,
                        claimants: Sequence[Claimant], holders: Sequence[Claimant],
                        timings: dict[str, float]) -> GangResult:
        try:
            problem = await self.sw.check_device(target, claimants, timings)
            if problem is not None:
                raise SwitchFailed(problem.reason, problem.message)
            await self.sw.wake_and_probe(target, 0, timings)
        except Fenced:
            raise
        except Exception as exc:
            return await self._fail(opened, reason_of(exc), f"{target.ref} started and "
                                    f"sleeps; waking it failed: {exc}", holders=holders,
                                    timings=timings)
        final = await self._close(opened, awake=[target], state_without=naming.LeaseState.IDLE,
                                  last_error="", timings=timings)
        return GangResult(True, final, timings=timings, holders=tuple(holders))


class _SleepsUnknown(LeaseControllerError):
    def __init__(self, first: SleepUnknown, claimants: tuple[Claimant, ...]) -> None:
        super().__init__(str(first))
        self.first = first
        self.claimants = claimants
