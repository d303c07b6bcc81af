"""The holder's work and tenure on one GPU, and what its switches cost: what the switch
policy weighs (how long the holder has been awake, when it last had work, who had the GPU
lately, the measured cost of each claim's sleep, drain, wake, probe and recompute).

A claim not measured yet is not given the policy's cautious defaults (a 1.2 s switch)
while its peers on the GPU were measured: :meth:`HolderWork.costs_for` scales their costs
by its awake memory. Held to the defaults, a model that had not been woken lately (the
long tail a shared GPU exists for) could never be fitted between the frozen streams of
busy peers and waited for the 30 s bound (five models of the Azure trace, simulated: 39
of 63 requests of a window within the SLO; with the estimate, 63)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from controller.claimants import Claimant
from controller.lease import policy as switch_policy
from controller.lease.engines.base import EngineAdapter
from controller.lease.switch import SwitchResult

USAGE_DECAY_S = 300.0
"""The fair share looks at roughly the last five minutes of who was awake."""
ANSWERED_GRACE_S = 1.0
"""How long the callers an activation answered count as the holder's work while its
engine's metrics show none (their requests are on their way)."""
MIN_RECOMPUTE_S = 0.005
"""The least time a measured recompute is taken to have cost (a probe that came back no
slower than usual after a wake with requests kept measures a fast recompute, not a free
one)."""


class HolderWork:
    """The holder's work accounting on one GPU, and the measured switch costs."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.holder_since = clock()
        """When the GPU's current holder (or nobody) took it."""
        self.woken_in_s = 0.0
        """What the wake that brought the current holder in took to its first token, as
        measured: the wake call and the probe, which waited for the recompute of the
        requests the wake brought back (0: not measured, as after a start)."""
        self.last_busy = clock()
        """When the holder was last seen with work."""
        self.costs: dict[str, switch_policy.SwitchCost] = {}
        """Measured switch costs per claimant (from this controller's SwitchResult timings)."""
        self._measured: dict[str, set[str]] = {}
        """Which fields of each claimant's costs were measured (the others are defaults)."""
        self.drains: dict[str, float] = {}
        self._usage: dict[str, float] = {}
        """Awake seconds per claimant, decaying (time constant USAGE_DECAY_S): the fair
        share's measure of who had the GPU lately."""
        self._usage_at = clock()
        self._answered: tuple[str, int, float] | None = None
        """The claim uid an activation last answered ok, how many callers, and when."""

    # -- the holder's work -------------------------------------------------------------

    def answered(self, uid: str, callers: int) -> None:
        """An activation of ``uid`` was answered ok for ``callers`` callers just now."""
        self._answered = (uid, callers, self.clock())

    def in_flight_seen(self, holder: Claimant, measured: int) -> int:
        """The holder's work in flight: what its engine reports, or, until the engine shows
        work or :data:`ANSWERED_GRACE_S` has passed, the callers an activation just
        answered for it. Their requests are on their way: an engine's metrics count them
        only once they arrive, and a policy that read the holder as idle meanwhile would
        put it to sleep under the requests it was woken for."""
        if self._answered is None or self._answered[0] != holder.claim_uid:
            return measured
        _, callers, at = self._answered
        if measured > 0 or self.clock() - at > ANSWERED_GRACE_S:
            self._answered = None
            return measured
        return callers

    async def load(self, holder: Claimant, engine: EngineAdapter) -> int:
        """The holder's work in flight now (see :meth:`in_flight_seen`); work seen counts
        as the holder busy now. Raises the engine's errors."""
        in_flight = self.in_flight_seen(holder, await engine.in_flight() or 0)
        if in_flight:
            self.last_busy = self.clock()
        return in_flight

    # -- tenure and usage --------------------------------------------------------------

    def new_tenure(self, ended: str | None = None, *, woken_in_s: float = 0.0) -> None:
        """The GPU changed hands now; ``ended`` (a claim ref) was awake until now, and the
        new holder's wake took ``woken_in_s`` to its first token (0: not measured)."""
        if ended is not None:
            self.used(ended, self.clock() - self.holder_since)
        self.holder_since = self.last_busy = self.clock()
        self.woken_in_s = woken_in_s

    def used(self, ref: str, seconds: float) -> None:
        """Count ``seconds`` awake for ``ref``; everyone's count decays meanwhile."""
        now = self.clock()
        decay = math.exp(-max(0.0, now - self._usage_at) / USAGE_DECAY_S)
        self._usage = {k: v * decay for k, v in self._usage.items() if v * decay > 1e-3}
        self._usage_at = now
        if seconds > 0:
            self._usage[ref] = self._usage.get(ref, 0.0) + seconds

    def usage_now(self, holder: Claimant | None) -> dict[str, float]:
        """Recent awake seconds per claimant, the holder's current tenure included."""
        self.used("", 0.0)
        usage = dict(self._usage)
        if holder is not None:
            usage[holder.ref] = usage.get(holder.ref, 0.0) + max(
                0.0, self.clock() - self.holder_since)
        return usage

    # -- switch costs ------------------------------------------------------------------

    def switch_cost(self, holder: str | None, target: str | None) -> float:
        """The expected cost of a switch from ``holder`` (None: nobody awake) to ``target``
        (None: a claimant not known yet): the holder's sleep and drain, the target's wake and
        probe, as this worker measured them (the policy's defaults otherwise)."""
        default = switch_policy.SwitchCost()
        costs = self.costs
        sleep = 0.0 if holder is None else (costs.get(holder, default).sleep_s
                                            + self.drains.get(holder, 0.0))
        woken = costs.get(target, default) if target is not None else default
        return sleep + woken.wake_s + woken.probe_s

    def measured(self, result: SwitchResult, holder: Claimant | None, target: Claimant
                 ) -> None:
        """Keep the measured costs of a finished switch per claimant."""
        if result.ok:
            self.keep_costs(result.timings, holder, target, resumed=result.resumed)

    def keep_costs(self, t: Mapping[str, float], holder: Claimant | None,
                   target: Claimant, *, resumed: int = 0) -> None:
        """Keep a switch's timings as costs. ``resumed``: requests the target's wake
        brought back (kept by an earlier preemptive switch away from it). Its probe
        queued behind their recompute, so that probe does not measure the probe: what it
        took beyond the target's usual probe is their recompute, kept as its rate
        (:data:`~controller.lease.policy.HOLDER_TOKENS_PER_REQUEST` tokens a request, the
        size the policy counts them at)."""
        if holder is not None:
            cost = self.costs.get(holder.ref, switch_policy.SwitchCost())
            if "later_sleep" in t:
                cost = self._set(holder.ref, cost, sleep_s=t["later_sleep"])
            self.costs[holder.ref] = cost
            if "drain" in t:
                self.drains[holder.ref] = t["drain"]
        ref = target.ref
        cost = self.costs.get(ref, switch_policy.SwitchCost())
        if "wake_call" in t:
            cost = self._set(ref, cost, wake_s=t["wake_call"])
        if "probe_ttft" in t and resumed <= 0:
            cost = self._set(ref, cost, probe_s=t["probe_ttft"])
        elif "probe_ttft" in t and "probe_s" in self._measured.get(ref, set()):
            seconds = max(MIN_RECOMPUTE_S, t["probe_ttft"] - cost.probe_s)
            tokens = resumed * switch_policy.HOLDER_TOKENS_PER_REQUEST
            cost = self._set(ref, cost, recompute_tokens_per_s=tokens / seconds)
        self.costs[ref] = cost

    def _set(self, ref: str, cost: switch_policy.SwitchCost, **fields: float
             ) -> switch_policy.SwitchCost:
        self._measured.setdefault(ref, set()).update(fields)
        return dataclasses.replace(cost, **fields)

    def costs_for(self, claimants: Sequence[Claimant]) -> dict[str, switch_policy.SwitchCost]:
        """Every claimant's costs for the policy (:func:`with_estimates`): measured where
        measured, estimated from its measured peers by awake memory elsewhere."""
        return with_estimates(self.costs, self._measured,
                              {c.ref: c.config.awake_memory for c in claimants})


COST_FIELDS = tuple(f.name for f in dataclasses.fields(switch_policy.SwitchCost))
"""Every field of a claimant's switch costs: each is measured, or estimated, alone."""


def with_estimates(costs: Mapping[str, switch_policy.SwitchCost],
                   measured: Mapping[str, set[str]], sizes: Mapping[str, int]
                   ) -> dict[str, switch_policy.SwitchCost]:
    """Every claimant's costs: ``costs``, with each field not ``measured`` for a claimant
    of ``sizes`` (its awake bytes) estimated from the claimants whose field was, scaled
    by awake memory (the bytes a wake maps back and a sleep releases; a model twice the
    size recomputes at half the rate), the most cautious of them; the policy's default
    where nobody's was measured."""
    out = dict(costs)
    for ref, size in sizes.items():
        known = measured.get(ref, set())
        estimated = {f: v for f in COST_FIELDS if f not in known
                     for v in [_estimate(costs, measured, f, size, sizes)] if v is not None}
        if estimated:
            out[ref] = dataclasses.replace(costs.get(ref, switch_policy.SwitchCost()),
                                           **estimated)
    return out


def _estimate(costs: Mapping[str, switch_policy.SwitchCost], measured: Mapping[str, set[str]],
              field: str, size: int, sizes: Mapping[str, int]) -> float | None:
    """``field`` of a claimant of ``size`` bytes awake, from its measured peers."""
    if size <= 0:
        return None
    scaled = [float(getattr(costs[ref], field)) * (
        peer / size if field == "recompute_tokens_per_s" else size / peer)
        for ref, fields in measured.items() if field in fields and ref in costs
        for peer in [sizes.get(ref, 0)] if peer > 0]
    if not scaled:
        return None
    return min(scaled) if field == "recompute_tokens_per_s" else max(scaled)
