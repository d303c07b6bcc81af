"""What one GPU does while nobody waits: the policy's keep-alive puts a holder without
work to sleep, and an idle GPU (or one whose holder has been idle long enough) queues the
return of its home model."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.engines.errors import EngineError
from rota.api import naming

if TYPE_CHECKING:
    from controller.lease.gpu import GpuWorker

log = logging.getLogger("controller.lease.gpu.idle")


class IdleRules:
    """Keep-alive and the home return of one GPU."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self.state = worker.state
        self.view = worker.view

    def active(self) -> bool:
        """Whether a look is worth taking (an idle TTL, keep-alive or a home model)."""
        return self.worker.policy.idle_sleep_s > 0 or self.view.idle_rules()

    def home_return(self, holder: Claimant | None) -> bool:
        """Queue the home model's return when the policy says so (nobody waits)."""
        decision = self.view.decide(holder, 0)
        home = self.view.home()
        if (decision.action is not switch_policy.Action.SWITCH or home is None
                or decision.rule != "home_return"):
            return False
        self.worker.queue.add_home(home)
        return True

    async def check(self) -> None:
        """Put an idle holder to sleep, or queue the home return, as the policy says."""
        worker, state = self.worker, self.state
        lease = state.lease = await worker.lease_now()
        if not lease.holder or lease.state != naming.STATE_AWAKE:
            if lease.state == naming.STATE_IDLE:
                self.home_return(None)
            return
        holder = next((c for c in worker.on_gpu() if c.ref == lease.holder), None)
        if holder is None or holder.gpu != state.gpu:
            return  # an engine that spans GPUs is timed by the worker of its first GPU
        try:
            busy = await worker.work.load(holder, worker.engine(holder))
        except EngineError as exc:
            log.info("holder's load unknown; not putting it to sleep",
                     extra={"device": state.gpu, "error": str(exc)})
            return
        if busy or self.home_return(holder):
            return
        decision = self.view.decide(holder, 0)
        if decision.action is not switch_policy.Action.SLEEP:
            return
        state.rule = decision.rule
        self.view.decided(decision.rule, holder, decision.reason)
        state.switching = True
        try:
            result = await worker.switcher.sleep_holder(lease, holder, reason="idle")
        finally:
            state.switching = False
        worker.outcomes.switched(result, holder, holder)
        for gpu in holder.gpus[1:]:  # its other GPUs' Leases still name it
            worker.sibling(gpu).mark_dirty()
