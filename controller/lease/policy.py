"""The switch policy of one GPU: one pure decision function, state in, decision out.

:func:`decide` reads a :class:`PolicyInput` (the GPU's holder and its load, the queue of
every claimant waiting for the GPU, each claimant's :class:`ModelPolicy`, the measured
:class:`SwitchCost` of each claimant, the home model) and answers a :class:`Decision`:
stay, switch to a claimant, put the holder to sleep, or cancel a switch whose waiters
left, with the rule that fired (a short stable string, :data:`RULES`: an Event's note
and a metric label) and a reason in words. No I/O and no clock: time is ``now`` in the
input. The lease controller (:mod:`controller.lease.gpu`) and the policy benchmark
(``python -m e2e.bench.policy``) call this same function.

The rules, in the order they are tried:

1. ``cancelled``: a switch decided earlier whose waiters have all left before its wake
   began is not made (unless it is the return of the home model).
2. ``bounded_wait`` (anti-starvation): a waiting claimant whose oldest request, plus the
   switch it needs and the holder's drain, would reach its ``max_wait_s`` is served now,
   whatever the holder's priority or quantum; among several, the one nearest (or past)
   its bound first, so the longest wait weighs more. A claim's bound, like every knob of
   its own that buys GPU time, is within what the admin allows its namespace before it
   reaches this module (:mod:`controller.lease.tenants`): a tenant held to a low
   priority cannot get ahead by asking for a tiny bound.
3. ``priority_preempt``: a waiting claimant of higher priority than the holder is served
   now. The holder's requests in flight finish within the switch's drain deadline (the
   switch closes the holder's admission, drains, then sleeps it); its later requests
   queue like anyone's.
4. ``holder_idle`` (keep-alive never blocks a waiting client): a holder with nothing in
   flight gives the GPU to a waiting claimant at once, whatever its keep-alive or its
   priority (a busy holder of higher priority keeps it, up to the waiter's bound).
5. ``quantum``: a busy holder keeps the GPU for its quantum once woken
   (``max(min_quantum_s, quantum_factor x the measured cost of the switch away)``, the
   holder's measured drain included), so a switch's cost buys a proportionate amount of
   service.
6. ``cost``: past the quantum, the waiter with the highest score (weight x queue length x
   (waiting time + switch cost) / switch cost, times its fair share over its recent
   share of the GPU, clipped to 0.1-10) is served once its waited request-seconds exceed the cost of
   the switch; otherwise the holder stays (``stay``).
7. With nobody waiting: ``keep_alive`` (the holder stays while its last request is
   younger than its keep-alive), ``home_return`` (after ``home_idle_s`` without work the
   GPU's home model is woken, so the most likely next request finds it awake),
   ``idle_sleep`` (a holder past its keep-alive, with no home model to return to, is put
   to sleep), ``idle`` (nothing to do).

A GPU with no awake holder serves the best waiter at once (``first_request`` when one
claimant waits, else the ranking above without the holder's rules).

The node may run the policy in :attr:`PolicyMode.FIRST_COME` instead (``--policy-mode
first-come``): on-demand switching in arrival order, as llama-swap does, the baseline the
policy benchmark compares against. Rules 1-6 give way to one, ``first_come``: whoever
waits longest is served now, the holder drained and put to sleep whatever its load, its
priority or its quantum (no quantum, no bound, no cost). With nobody waiting, rule 7 holds
as in ``rota`` mode (the default keep-alive is forever: llama-swap's ``ttl: 0``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from rota.api.engine_config import EngineConfig

__all__ = [
    "RULES",
    "Action",
    "ClaimQueue",
    "Decision",
    "GpuView",
    "ModelPolicy",
    "PolicyInput",
    "PolicyMode",
    "SwitchCost",
    "decide",
    "policy_for",
    "quantum_of",
]

RULES = ("cancelled", "bounded_wait", "priority_preempt", "holder_idle", "quantum", "cost",
         "stay", "keep_alive", "home_return", "idle_sleep", "idle", "first_request",
         "first_come")
"""Every rule :func:`decide` can name: the values of the metric label ``rule``."""


class Action(StrEnum):
    STAY = "stay"
    """Nothing changes now; ask again at :attr:`Decision.recheck_at` (or on news)."""
    SWITCH = "switch"
    """Make :attr:`Decision.target` the awake engine (the holder, if any, drains and
    sleeps)."""
    SLEEP = "sleep"
    """Put the holder to sleep; the GPU goes idle."""
    CANCEL = "cancel"
    """Do not make the pending switch (its waiters left)."""


class PolicyMode(StrEnum):
    """How a GPU chooses whom to serve next (the node's ``--policy-mode``)."""

    ROTA = "rota"
    """The rules of this module (quantum, bounds, priorities, cost, fair share)."""
    FIRST_COME = "first-come"
    """On-demand switching in arrival order, llama-swap's behaviour: a request for a
    sleeping model drains and sleeps the holder and wakes its model at once."""


@dataclass(frozen=True)
class ModelPolicy:
    """One claimant's policy (from its EngineConfig, with the node's defaults)."""

    priority: int = 0
    """Higher preempts lower (see rule ``priority_preempt``)."""
    keep_alive_s: float = math.inf
    """With nobody waiting, how long the holder keeps the GPU after its last request
    (``inf``: until someone else asks)."""
    quantum_factor: float = 4.0
    """A busy holder keeps the GPU at least this many times the measured switch cost."""
    min_quantum_s: float = 1.0
    """The quantum's floor (for very cheap switches)."""
    max_wait_s: float = 30.0
    """The bound on a request's wait for a switch while the GPU serves others."""
    share_weight: float = 1.0
    """Weight in the fair share under sustained contention."""
    mode: PolicyMode = PolicyMode.ROTA
    """Node-wide: :func:`decide` reads it from :attr:`PolicyInput.default_policy` (the
    node's defaults), never from a claim's own policy; a claim cannot set it."""

    def __post_init__(self) -> None:
        if self.keep_alive_s < 0 or self.quantum_factor < 0 or self.min_quantum_s < 0:
            raise ValueError("keep-alive and quantum must not be negative")
        if self.max_wait_s <= 0 or self.share_weight <= 0:
            raise ValueError("max_wait_s and share_weight must be positive")


@dataclass(frozen=True)
class SwitchCost:
    """What switching costs, per claimant, as the controller measured it (seconds)."""

    sleep_s: float = 0.5
    """Putting this claimant to sleep (a later level-1 sleep)."""
    wake_s: float = 0.6
    """Waking it."""
    probe_s: float = 0.1
    """Its correctness request's first token after the wake."""


@dataclass(frozen=True)
class GpuView:
    """The GPU as its worker sees it at ``now``."""

    now: float
    holder: str | None = None
    """The awake claimant (None: the GPU is idle)."""
    awake_since: float = 0.0
    """When the holder was woken."""
    last_request: float = -math.inf
    """When the holder last had work (a request in flight or arriving)."""
    in_flight: int = 0
    """The holder's requests running or queued inside the engine."""
    drain_estimate_s: float = 0.0
    """How long the holder's in-flight work is expected to take to finish."""
    pending: str | None = None
    """A switch decided earlier and not yet at its wake: its target."""
    idle_since: float = -math.inf
    """When the GPU last had work of anyone (for the home return of an idle GPU)."""


@dataclass(frozen=True)
class ClaimQueue:
    """The requests waiting for one claimant to be woken."""

    claim: str
    length: int
    oldest_since: float
    """When its oldest waiting request arrived."""


@dataclass(frozen=True)
class PolicyInput:
    gpu: GpuView
    queues: tuple[ClaimQueue, ...] = ()
    policies: Mapping[str, ModelPolicy] = field(default_factory=dict)
    costs: Mapping[str, SwitchCost] = field(default_factory=dict)
    default_policy: ModelPolicy = ModelPolicy()
    default_cost: SwitchCost = SwitchCost()
    home: str | None = None
    """The GPU's home model's claimant (None: no home)."""
    home_idle_s: float = 60.0
    """How long without work before the home model is woken."""
    usage_s: Mapping[str, float] = field(default_factory=dict)
    """Recent awake seconds per claimant (for the fair share; empty: not used)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    rule: str
    reason: str
    target: str | None = None
    recheck_at: float | None = None
    """When to decide again if nothing else happens (None: on the next event)."""


def quantum_of(inp: PolicyInput, holder: str, target: str | None) -> float:
    """The holder's quantum against a switch to ``target``."""
    policy = inp.policies.get(holder, inp.default_policy)
    cost = _cost(inp, holder, target) if target else _wake_cost(inp, holder)
    return max(policy.min_quantum_s, policy.quantum_factor * (cost + inp.gpu.drain_estimate_s))


def _policy(inp: PolicyInput, claim: str) -> ModelPolicy:
    return inp.policies.get(claim, inp.default_policy)


def _wake_cost(inp: PolicyInput, claim: str) -> float:
    c = inp.costs.get(claim, inp.default_cost)
    return c.wake_s + c.probe_s


def _cost(inp: PolicyInput, holder: str | None, target: str) -> float:
    """Sleep of the holder + wake of the target + its probe."""
    sleep = inp.costs.get(holder, inp.default_cost).sleep_s if holder else 0.0
    return sleep + _wake_cost(inp, target)


def _wait(inp: PolicyInput, q: ClaimQueue) -> float:
    return max(0.0, inp.gpu.now - q.oldest_since)


def _score(inp: PolicyInput, q: ClaimQueue, holder: str | None) -> float:
    policy = _policy(inp, q.claim)
    cost = max(_cost(inp, holder, q.claim), 1e-3)
    score = policy.share_weight * q.length * (_wait(inp, q) + cost) / cost
    total = sum(inp.usage_s.values())
    if total > 0:
        claims = {*inp.usage_s, *(w.claim for w in inp.queues)}
        weights = sum(_policy(inp, c).share_weight for c in claims)
        entitled = policy.share_weight / weights
        share = inp.usage_s.get(q.claim, 0.0) / total
        score *= min(10.0, max(0.1, entitled / max(share, 1e-9)))
    return score


def _best(inp: PolicyInput, waiters: list[ClaimQueue], holder: str | None) -> ClaimQueue:
    return max(waiters, key=lambda q: (_policy(inp, q.claim).priority,
                                       _score(inp, q, holder), -q.oldest_since))


def decide(inp: PolicyInput) -> Decision:
    """The policy: see the module's docstring for the rules and their order."""
    gpu = inp.gpu
    now = gpu.now
    holder = gpu.holder
    waiters = [q for q in inp.queues if q.length > 0 and q.claim != holder]

    # 1. A pending switch nobody waits for any more.
    if inp.default_policy.mode is PolicyMode.FIRST_COME and waiters:
        q = min(waiters, key=lambda w: w.oldest_since)
        return Decision(Action.SWITCH, "first_come", f"{q.claim}'s request came first "
                        f"({_wait(inp, q):.1f} s ago); "
                        + (f"{holder} ({gpu.in_flight} in flight) drains and sleeps"
                           if holder else "the GPU is idle"), q.claim)

    if gpu.pending is not None and gpu.pending != holder:
        waiting = any(q.claim == gpu.pending and q.length > 0 for q in inp.queues)
        if not waiting and gpu.pending != inp.home:
            return Decision(Action.CANCEL, "cancelled",
                            f"every request for {gpu.pending} left before its wake began")

    if waiters:
        # 2. Bounded waiting, first: the guarantee.
        drain = gpu.drain_estimate_s if holder else 0.0
        urgency = {q.claim: (_wait(inp, q) + _cost(inp, holder, q.claim) + drain)
                   / _policy(inp, q.claim).max_wait_s for q in waiters}
        due = [q for q in waiters if urgency[q.claim] >= 1.0]
        if due and holder is not None:
            q = max(due, key=lambda w: (urgency[w.claim], _policy(inp, w.claim).priority))
            return Decision(Action.SWITCH, "bounded_wait",
                            f"{q.claim}'s oldest request has waited {_wait(inp, q):.1f} s "
                            f"of its {_policy(inp, q.claim).max_wait_s:g} s bound", q.claim)
        if holder is None:
            q = max(due, key=lambda w: urgency[w.claim]) if due else _best(inp, waiters, None)
            rule = "bounded_wait" if due else ("first_request" if len(waiters) == 1
                                               else "cost")
            return Decision(Action.SWITCH, rule, f"the GPU is idle; {q.claim} waits "
                            f"({q.length} requests, oldest {_wait(inp, q):.1f} s)", q.claim)
        held = _policy(inp, holder)
        # 3. Priority with preemption.
        higher = [q for q in waiters if _policy(inp, q.claim).priority > held.priority]
        if higher:
            q = _best(inp, higher, holder)
            return Decision(Action.SWITCH, "priority_preempt",
                            f"{q.claim} (priority {_policy(inp, q.claim).priority}) preempts "
                            f"{holder} (priority {held.priority}); its {gpu.in_flight} "
                            "requests in flight finish within the drain deadline", q.claim)
        # 4. Keep-alive never blocks a waiting client (whatever the holder's priority).
        if gpu.in_flight == 0:
            q = _best(inp, waiters, holder)
            return Decision(Action.SWITCH, "holder_idle", f"{holder} has nothing in flight "
                            f"and {q.claim} waits", q.claim)
        peers = [q for q in waiters if _policy(inp, q.claim).priority == held.priority]
        if not peers:
            return Decision(Action.STAY, "stay", f"only lower-priority claimants wait; "
                            f"{holder} keeps the GPU while it is busy",
                            recheck_at=_next_bound(inp, waiters, holder))
        q = _best(inp, peers, holder)
        # 5. The quantum.
        quantum = quantum_of(inp, holder, q.claim)
        ends = gpu.awake_since + quantum
        if now < ends:
            return Decision(Action.STAY, "quantum", f"{holder} is busy within its "
                            f"{quantum:.1f} s quantum", recheck_at=min(
                                ends, _next_bound(inp, waiters, holder) or ends))
        # 6. Cost-aware choice.
        cost = _cost(inp, holder, q.claim)
        waited = q.length * _wait(inp, q) * _policy(inp, q.claim).share_weight
        if waited >= cost:
            return Decision(Action.SWITCH, "cost", f"{q.claim}: {q.length} requests have "
                            f"waited {waited:.1f} request-s, more than the {cost:.2f} s "
                            "switch", q.claim)
        return Decision(Action.STAY, "stay", f"{q.claim}'s wait is still below the switch "
                        f"cost ({cost:.2f} s)",
                        recheck_at=now + max(1e-3, (cost - waited) / max(q.length, 1)))

    # 7. Nobody waits.
    home = inp.home
    if holder is None:
        if home is not None and now - gpu.idle_since >= inp.home_idle_s:
            return Decision(Action.SWITCH, "home_return", f"the GPU has been idle "
                            f"{now - gpu.idle_since:.0f} s; its home model {home} "
                            "comes back", home)
        return Decision(Action.STAY, "idle", "nobody waits",
                        recheck_at=gpu.idle_since + inp.home_idle_s if home else None)
    if gpu.in_flight > 0:
        return Decision(Action.STAY, "keep_alive", f"{holder} is serving")
    quiet = now - gpu.last_request
    if home is not None and holder != home and quiet >= inp.home_idle_s:
        return Decision(Action.SWITCH, "home_return", f"{holder} has had no work for "
                        f"{quiet:.0f} s; the home model {home} comes back", home)
    keep = _policy(inp, holder).keep_alive_s
    if holder != home and quiet >= keep:
        return Decision(Action.SLEEP, "idle_sleep", f"{holder} has had no work for "
                        f"{quiet:.0f} s (keep-alive {keep:g} s)")
    due_at = [t for t in (gpu.last_request + keep if holder != home else math.inf,
                          gpu.last_request + inp.home_idle_s
                          if home is not None and holder != home else math.inf)
              if math.isfinite(t)]
    return Decision(Action.STAY, "keep_alive", f"{holder} stays awake after its last "
                    "request", recheck_at=min(due_at) if due_at else None)


def _next_bound(inp: PolicyInput, waiters: list[ClaimQueue], holder: str | None
                ) -> float | None:
    """When the first waiter's bound rule will fire."""
    drain = inp.gpu.drain_estimate_s if holder else 0.0
    times = [q.oldest_since + _policy(inp, q.claim).max_wait_s
             - _cost(inp, holder, q.claim) - drain for q in waiters]
    return min(times) if times else None


def policy_for(config: EngineConfig, default: ModelPolicy) -> ModelPolicy:
    """A claimant's policy: its EngineConfig's fields, the node's ``default`` elsewhere.

    The lease controller passes only a config bounded by the admin's binding
    (:func:`controller.lease.tenants.bound`): a claim's own values are the tenant's."""
    return ModelPolicy(
        priority=default.priority if config.priority is None else config.priority,
        keep_alive_s=(default.keep_alive_s if config.keep_alive_seconds is None
                      else config.keep_alive_seconds),
        quantum_factor=default.quantum_factor, min_quantum_s=default.min_quantum_s,
        max_wait_s=default.max_wait_s if config.max_wait_seconds is None
        else config.max_wait_seconds,
        share_weight=default.share_weight if config.share_weight is None
        else config.share_weight, mode=default.mode)
