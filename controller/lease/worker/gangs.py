"""Gang entry: the switches and starts of one GPU's worker that change several GPU Leases
(an engine that spans GPUs, or whose GPUs' holders do; see :mod:`controller.lease.gang`).
The worker of the target's first GPU runs them, holding the locks of its whole domain;
every worker of the set is marked switching meanwhile and takes its GPU's new Lease after."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from controller.claimants import Claimant
from controller.lease.admission import StartTicket
from controller.lease.gang import GangResult, GangSwitch, gang_set, holder_timings
from controller.lease.switch import SwitchResult
from controller.lease.worker.state import Activation
from controller.lease.worker.turns import Turn
from rota.api.gpu_lease import GpuLease

if TYPE_CHECKING:
    from controller.lease.gpu import GpuWorker


class GangEntry:
    """The gang switches and starts run from one GPU's worker."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker

    async def _leases(self, target: Claimant, holders: tuple[Claimant, ...]
                      ) -> dict[str, GpuLease]:
        gpus = {*target.gpus, *(g for h in holders for g in h.gpus)}
        return {gpu: await self.worker.lease_of(gpu) for gpu in gpus}

    def _blockers(self, gpus: tuple[str, ...], uid: str) -> list[str]:
        return sorted(b for gpu in gpus for b in self.worker.sibling(gpu).state.blockers(uid))

    def _begins(self, gpus: tuple[str, ...], target: Claimant) -> None:
        for gpu in gpus:
            state = self.worker.sibling(gpu).state
            state.switching, state.switching_to = True, target.claim_uid

    def _ends(self, gpus: tuple[str, ...], *, cut_short: bool) -> None:
        """The set's workers take work again; after a switch cut short (fenced, failed
        or cancelled) each reads its Lease anew and reconciles."""
        for gpu in gpus:
            state = self.worker.sibling(gpu).state
            state.switching = False
            if cut_short:
                state.lease = None
                state.mark_dirty()

    def _gang(self, gpus: tuple[str, ...]) -> GangSwitch:
        return GangSwitch(self.worker.switcher,
                          {g: self.worker.sibling(g).lease_port for g in gpus})

    def _claimants(self, gpus: tuple[str, ...]) -> list[Claimant]:
        return [c for c in self.worker.claimants() if c.pod_ip and set(c.gpus) & set(gpus)]

    # -- switches ----------------------------------------------------------------------

    async def turn(self, turn: Turn, holders: tuple[Claimant, ...]) -> Turn | None:
        """``turn`` as a gang switch over the GPUs it changes, or None when its callers
        were answered now (engines in an unknown state on one of them)."""
        target, uid = turn.target, turn.target.claim_uid
        leases = await self._leases(target, holders)
        gpus = gang_set(target, holders, leases)
        blockers = self._blockers(gpus, uid)
        if blockers:
            worker = self.worker
            worker.queue.take(uid)
            worker.queue.resolve(turn.waiting, Activation(
                False, target, False,
                leases[worker.gpu].fence if worker.gpu in leases else 0, "state_unknown",
                f"engines on {', '.join(gpus)} are in an unknown state (possibly awake): "
                f"{', '.join(blockers)}; no wake until they are known"))
            return None
        return dataclasses.replace(turn, gpus=gpus, holders=holders, leases=leases)

    async def switch(self, turn: Turn) -> None:
        """Run a gang switch (see :meth:`controller.lease.worker.turns.TurnLoop.switch`)
        and answer its callers."""
        worker, target, gpus = self.worker, turn.target, turn.gpus
        worker.queue.take(target.claim_uid)
        self._begins(gpus, target)
        if worker.visibility is not None:
            worker.visibility.switching(turn.holders[0] if turn.holders else None, target)
        result: GangResult | None = None
        try:
            result = await self._gang(gpus).switch(
                {g: turn.leases[g] for g in gpus}, holders=turn.holders, target=target,
                claimants=self._claimants(gpus))
        finally:
            self._ends(gpus, cut_short=result is None)
            if result is None:
                worker.turns.fenced_off(turn.waiting, target, turn.leases[gpus[0]].fence)
        self.switched(result, turn.holders, target)
        home = result.leases.get(worker.gpu) or next(iter(result.leases.values()))
        worker.queue.resolve(turn.waiting, Activation(
            result.ok, target, switched=result.ok, fence=home.fence, reason=result.reason,
            message=result.message, timings=result.timings))

    # -- starts ------------------------------------------------------------------------

    async def start(self, ticket: StartTicket, newcomer: Claimant,
                    holders: tuple[Claimant, ...]) -> None:
        """Start-up admission of an engine that spans GPUs, or whose GPUs' holders do:
        across every GPU of the set (see :meth:`controller.lease.gang.GangSwitch.start`)."""
        worker = self.worker
        starts = worker.starts
        assert worker.starter is not None
        uid = newcomer.claim_uid
        leases = await self._leases(newcomer, holders)
        gpus = gang_set(newcomer, holders, leases)
        blockers = self._blockers(gpus, uid)
        if blockers:
            starts.held(uid, ticket, newcomer, blockers, device=",".join(gpus))
            return
        self._begins(gpus, newcomer)
        if worker.visibility is not None:
            worker.visibility.switching(holders[0] if holders else None, newcomer,
                                        starting=True)
        result: GangResult | None = None
        try:
            result = await self._gang(gpus).start(
                {g: leases[g] for g in gpus}, holders=holders, newcomer=newcomer,
                claimants=self._claimants(gpus), ticket=ticket, starter=worker.starter,
                wanted=lambda: uid in worker.queue)
        finally:
            self._ends(gpus, cut_short=result is None)
            starts.ended(uid, ticket, refused=result is None)
        self.switched(result, holders, newcomer, start=True)
        starts.done(newcomer, ok=result.ok, reason=result.reason, came_up=result.ok)

    # -- outcomes ----------------------------------------------------------------------

    def switched(self, result: GangResult, holders: tuple[Claimant, ...],
                 target: Claimant, *, start: bool = False) -> None:
        """Every worker of the set takes its GPU's new Lease and shows it, and keeps the
        measured costs of the holders it had and of the target."""
        for gpu, lease in result.leases.items():
            self._taken(self.worker.sibling(gpu), gpu, lease, result, holders, target)
        visibility = self.worker.visibility
        if visibility is not None:
            home = result.leases.get(self.worker.gpu) or next(iter(result.leases.values()))
            visibility.switched(
                SwitchResult(result.ok, home, result.reason, result.message, result.timings,
                             result.unsettled), holders[0] if holders else None, target,
                start=start)

    @staticmethod
    def _taken(worker: GpuWorker, gpu: str, lease: GpuLease, result: GangResult,
               holders: tuple[Claimant, ...], target: Claimant) -> None:
        """One worker of the set takes its GPU's part of a gang switch's result."""
        if result.ok and lease.holder == target.ref:
            # The target's own wake (a start that kept the old holders woke them,
            # not the target: their steps are not its costs).
            target_steps = {k: v for k, v in result.timings.items() if ":" not in k}
            worker.work.keep_costs(target_steps, None, target)
        if result.ok:
            for holder in holders:
                if gpu in holder.gpus:
                    worker.work.keep_costs(holder_timings(result.timings, holder), holder,
                                           target)
        state = worker.state
        previous = state.lease.holder if state.lease is not None else ""
        if lease.holder != previous:
            worker.work.new_tenure()
        state.lease = lease
        state.found_unsettled(c for c in result.unsettled if gpu in c.gpus)
        state.last_switch = {"ok": result.ok, "from": [h.ref for h in holders],
                             "to": target.ref, "reason": result.reason,
                             "fence": lease.fence, "gang": list(result.leases),
                             "timings": {k: round(v, 6) for k, v in result.timings.items()}}
        if worker.visibility is not None:
            worker.visibility.settled(worker.on_gpu(), lease, unknown=state.unsettled.keys())
