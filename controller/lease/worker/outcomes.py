"""A finished switch (or sleep, or start) of one GPU taken in: the GPU's Lease and its last
switch for /v1/state, the holder's tenure, the engines it left unknown, and what is shown
on the claims and pods."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.claimants import Claimant
from controller.lease.switch import SwitchResult
from controller.lease.visibility import GpuVisibility
from controller.lease.worker.accounting import HolderWork
from controller.lease.worker.state import GpuState


class Outcomes:
    """Takes the result of each switch of one GPU into its worker's state."""

    def __init__(self, *, state: GpuState, work: HolderWork,
                 visibility: GpuVisibility | None,
                 on_gpu: Callable[[], list[Claimant]]) -> None:
        self.state = state
        self.work = work
        self.visibility = visibility
        self.on_gpu = on_gpu

    def switched(self, result: SwitchResult, holder: Claimant | None, target: Claimant,
                 *, start: bool = False, also_slept: Sequence[Claimant] = ()) -> None:
        """``also_slept``: the further members of an awake set the switch put to sleep
        (beside ``holder``)."""
        state = self.state
        state.lease = result.lease
        state.last_switch = {
            "ok": result.ok, "from": holder.ref if holder else None, "to": target.ref,
            "reason": result.reason, "fence": result.lease.fence,
            "timings": {k: round(v, 6) for k, v in result.timings.items()}}
        if result.lease.holder != (holder.ref if holder else ""):
            woken_in = result.timings.get("recovery_to_first_token", 0.0)
            self.work.new_tenure(holder.ref if holder is not None else None,
                                 woken_in_s=woken_in if result.ok else 0.0)
        if result.unsettled:
            state.found_unsettled(result.unsettled)
        if self.visibility is not None:
            self.visibility.switched(result, holder, target, start=start, rule=state.rule)
            if also_slept:
                self.visibility.displaced(result, also_slept, target, rule=state.rule)
            self.visibility.settled(self.on_gpu(), result.lease,
                                    unknown=state.unsettled.keys())
        state.rule = ""
