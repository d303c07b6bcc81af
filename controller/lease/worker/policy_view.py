"""What the switch policy (:func:`controller.lease.policy.decide`) is asked about one GPU,
gathered from the worker's parts, and its decisions counted and logged."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from controller.claimants import Claimant
from controller.lease import metrics, tenants
from controller.lease import policy as switch_policy
from controller.lease.switch import Freezes
from controller.lease.worker.accounting import HolderWork
from controller.lease.worker.callers import CallerQueue
from controller.lease.worker.state import Policy
from rota.api.engine_config import EngineConfig, keeps_requests

log = logging.getLogger("controller.lease.gpu.policy")


class PolicyView:
    """The switch policy's view of one GPU: its holder, its queue, every claim's bounded
    policy, the measured costs and who had the GPU lately."""

    def __init__(self, *, gpu: str, policy: Policy, clock: Callable[[], float],
                 claimants: Callable[[], list[Claimant]],
                 on_gpu: Callable[[], list[Claimant]], work: HolderWork,
                 queue: CallerQueue, freezes: Freezes | None = None) -> None:
        self.gpu = gpu
        self.policy = policy
        self.clock = clock
        self.claimants = claimants
        self.on_gpu = on_gpu
        self.work = work
        self.queue = queue
        self.freezes = freezes
        """The engines of this GPU sleeping with requests kept (None: none are known)."""

    def defaults(self) -> switch_policy.ModelPolicy:
        """The node's default model policy; the old idle TTL is the default keep-alive."""
        models = self.policy.models
        if math.isinf(models.keep_alive_s) and self.policy.idle_sleep_s > 0:
            return dataclasses.replace(models, keep_alive_s=self.policy.idle_sleep_s)
        return models

    def home(self) -> Claimant | None:
        """The GPU's home model's claimant (queued at this worker), if any."""
        here = [c for c in self.on_gpu() if c.gpu == self.gpu and c.serving]
        if self.policy.home_model:
            return next((c for c in here if c.model == self.policy.home_model), None)
        return next((c for c in here if self.bounded(c).home), None)

    def idle_rules(self) -> bool:
        """Whether keep-alive or the home return can act on this GPU."""
        return (self.home() is not None or math.isfinite(self.defaults().keep_alive_s)
                or any(self.bounded(c).keep_alive_seconds is not None
                       for c in self.on_gpu()))

    def bounded(self, c: Claimant) -> EngineConfig:
        """The claim's EngineConfig within the admin's binding: all the policy reads."""
        return tenants.bounded(c, self.defaults(), self.policy.priority_ceilings)

    def input(self, holder: Claimant | None, in_flight: int) -> switch_policy.PolicyInput:
        """What :func:`controller.lease.policy.decide` needs, gathered from the parts."""
        defaults = self.defaults()
        home = self.home()
        work = self.work
        return switch_policy.PolicyInput(
            gpu=switch_policy.GpuView(
                now=self.clock(), holder=holder.ref if holder else None,
                awake_since=work.holder_since, last_request=work.last_busy,
                in_flight=in_flight, idle_since=work.last_busy, woken_in_s=work.woken_in_s,
                drain_estimate_s=work.drains.get(holder.ref, 0.0) if holder else 0.0),
            queues=self.queue.claim_queues(),
            policies={c.ref: self.model_policy(c, defaults) for c in self.claimants()},
            costs=work.costs_for(self.claimants()), default_policy=defaults,
            home=home.ref if home else None, home_idle_s=self.policy.home_idle_s,
            usage_s=work.usage_now(holder), kept=self.kept())

    def model_policy(self, c: Claimant, defaults: switch_policy.ModelPolicy
                     ) -> switch_policy.ModelPolicy:
        """The claim's policy: its bounded EngineConfig, and whether a switch away from
        it may keep its requests (never a gang's)."""
        config = self.bounded(c)
        return switch_policy.policy_for(config, defaults,
                                        keeps=keeps_requests(config, gang=c.spans_gpus))

    def kept(self) -> dict[str, switch_policy.KeptWork]:
        """The sleeping claimants' frozen requests, by claim, as the switches recorded
        them (counted from the engine's gauges before its sleep), each counted at
        :data:`~controller.lease.policy.HOLDER_TOKENS_PER_REQUEST` tokens to recompute:
        the size :meth:`HolderWork.keep_costs` measures their recompute rate at."""
        if self.freezes is None:
            return {}
        per = switch_policy.HOLDER_TOKENS_PER_REQUEST
        return {f.claim: switch_policy.KeptWork(f.kept, f.since, f.kept * per)
                for f in self.freezes.all().values() if f.kept > 0}

    def decide(self, holder: Claimant | None, in_flight: int) -> switch_policy.Decision:
        return switch_policy.decide(self.input(holder, in_flight))

    def decided(self, rule: str, claimant: Claimant, reason: str) -> None:
        """Count and log what was decided for ``claimant`` (a switch, a sleep, a cancel)."""
        metrics.POLICY_DECISIONS.labels(rule).inc()
        log.info("switch policy decided", extra={
            "device": self.gpu, "claim": claimant.ref, "model": claimant.model,
            "rule": rule, "reason": reason})
