"""The awake set of one GPU as its worker sees it (``--awake-set``): whether it is in
effect, who is in it, and whom a newcomer displaces (:mod:`controller.lease.awake_set`).

It is in effect only where the admin allows it and no claimant of the GPU spans GPUs: a
tensor-parallel engine takes its GPUs alone (its gang switch puts to sleep whoever holds
them, and reconciliation puts to sleep every companion of a GPU where no set is in
effect)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from controller.claimants import Claimant
from controller.lease.awake_set import Displacement, displace, displacement_order, room
from controller.lease.engines.errors import EngineError
from rota.api import naming
from rota.api.gpu_lease import GpuLease

if TYPE_CHECKING:
    from controller.lease.gpu import GpuWorker

log = logging.getLogger("controller.lease.gpu.sets")


class AwakeSets:
    """The awake-set view of one GPU's worker."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self._total_bytes: int | None = None

    def in_effect(self, on_gpu: Sequence[Claimant] | None = None) -> bool:
        """More than one engine may be awake on this GPU now."""
        if not self.worker.policy.awake_set:
            return False
        return not any(c.spans_gpus for c in (on_gpu if on_gpu is not None
                                              else self.worker.on_gpu()))

    @staticmethod
    def members(lease: GpuLease, on_gpu: Sequence[Claimant]) -> list[Claimant]:
        """The claimants ``lease`` names awake, in wake order (the companions, then the
        holder while it is awake: it was woken last)."""
        by_uid = {c.claim_uid: c for c in on_gpu}
        order = [m.uid for m in lease.companions]
        if lease.state == naming.LeaseState.AWAKE and lease.holder_claim_uid:
            order.append(lease.holder_claim_uid)
        return [by_uid[uid] for uid in order if uid in by_uid]

    async def total_bytes(self) -> int:
        """The GPU's memory, read once through the inspection API."""
        if self._total_bytes is None:
            snapshot = await self.worker.switcher.snapshot(self.worker.gpu, {})
            self._total_bytes = snapshot.total_bytes
        return self._total_bytes

    async def fits_beside(self, target: Claimant, lease: GpuLease,
                          on_gpu: Sequence[Claimant]) -> bool:
        """Whether ``target`` fits awake beside every member (budgets only: no engine is
        read, so the turn loop may ask for every queued claim on each look)."""
        members = [c for c in self.members(lease, on_gpu) if c.claim_uid != target.claim_uid]
        return room(self.worker.gpu, await self.total_bytes(), awake=[*members, target],
                    claimants=on_gpu,
                    reserve_bytes=self.worker.switcher.limits.unknown_limit_bytes).fits

    async def plan(self, target: Claimant, lease: GpuLease, on_gpu: Sequence[Claimant]
                   ) -> Displacement:
        """Whom a wake of ``target`` puts to sleep: the fewest members by
        :func:`displace`; every member when ``target`` does not fit even alone (the wake
        check then says why)."""
        members = [c for c in self.members(lease, on_gpu) if c.claim_uid != target.claim_uid]
        load = {c.claim_uid: await self._load(c) for c in members}
        order = displacement_order(members, load=load,
                                   priority=lambda c: self.worker.view.bounded(c).priority or 0)
        planned = displace(self.worker.gpu, await self.total_bytes(), newcomer=target,
                           members=members, claimants=on_gpu,
                           reserve_bytes=self.worker.switcher.limits.unknown_limit_bytes,
                           order=order)
        if planned is None:
            log.warning("the newcomer does not fit the GPU even with every engine asleep; "
                        "all are put to sleep and the wake check decides",
                        extra={"device": self.worker.gpu, "claim": target.ref,
                               "model": target.model})
            alone = room(self.worker.gpu, await self.total_bytes(), awake=[target],
                         claimants=on_gpu,
                         reserve_bytes=self.worker.switcher.limits.unknown_limit_bytes)
            return Displacement(stay=(), sleep=tuple(order), room=alone)
        return planned

    async def _load(self, member: Claimant) -> int:
        try:
            return await self.worker.engine(member).in_flight() or 0
        except EngineError:
            return 0  # unknown: counted as idle, as the turn loop counts a holder
