"""The switch policy of one GPU: one pure decision function, state in, decision out.

:func:`decide` reads a :class:`PolicyInput` (the GPU's holder and its load, the queue of
every claimant waiting for the GPU, the requests sleeping claimants keep
(:class:`KeptWork`), each claimant's :class:`ModelPolicy`, the measured
:class:`SwitchCost` of each claimant, the home model) and answers a :class:`Decision`:
stay, switch to a claimant (draining the holder, or preempting it: it sleeps with its
requests kept), put the holder to sleep, or cancel a switch whose waiters left, with the
rule that fired (a short stable string, :data:`RULES`: an Event's note
and a metric label) and a reason in words. No I/O and no clock: time is ``now`` in the
input. The lease controller (:mod:`controller.lease.gpu`) and the policy benchmark
(``python -m e2e.bench.policy``) call this same function.

Every claimant has two service objectives: its requests' first token within
``first_token_s`` and no started stream frozen longer than ``longest_freeze_s`` (a stream
freezes when its engine is preempted: put to sleep with its requests kept, continued at
its next wake). A sleeping claimant's kept requests wait for the GPU like a queue.

The rules, in the order they are tried:

1. ``cancelled``: a switch decided earlier whose waiters have all left before its wake
   began is not made (unless it is the return of the home model, or the target keeps
   frozen requests).
2. ``bounded_wait`` (anti-starvation): a waiting claimant whose oldest request, plus the
   switch it needs and the holder's drain, would reach its ``max_wait_s`` is served now,
   whatever the holder's priority or quantum; among several, the one nearest (or past)
   its bound first, so the longest wait weighs more. A claim's bound, like every knob of
   its own that buys GPU time, is within what the admin allows its namespace before it
   reaches this module (:mod:`controller.lease.tenants`): a tenant held to a low
   priority cannot get ahead by asking for a tiny bound.
   In ``rota`` mode two more bounds join it, and the waiter most past (or nearest) any
   of its bounds is served, the decision's reason naming the others due:
   ``freeze_bound``: a sleeping claimant whose kept streams, plus the switch back and
   their recompute, would be frozen past its ``longest_freeze_s``; and, against a busy
   holder that keeps its requests, ``first_token_due``: a waiter whose oldest request,
   plus the switch, would miss its ``first_token_s`` (only where the preemption fits,
   below).
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
   In ``rota`` mode a holder that keeps its requests has a turn instead: see below.
7. With nobody waiting: ``keep_alive`` (the holder stays while its last request is
   younger than its keep-alive), ``home_return`` (after ``home_idle_s`` without work the
   GPU's home model is woken, so the most likely next request finds it awake),
   ``idle_sleep`` (a holder past its keep-alive, with no home model to return to, is put
   to sleep), ``idle`` (nothing to do).

A GPU with no awake holder serves the best waiter at once (``first_request`` when one
claimant waits, else the ranking above without the holder's rules).

**Preemption** (``rota`` mode, the default). A switch away from a busy holder whose claim
keeps its requests (``keeps_requests``: the claim's effective ``keepRequests``) preempts
it (:attr:`Decision.preempt`) instead of draining it, where that keeps every frozen stream
within its bound: a plan that serves the target a *visit*, then wakes every frozen
claimant (the holder's streams included) in order of its freeze deadline, each given a
visit, must wake each at least ``DUE_MARGIN_S`` before its deadline. A visit lasts until
the frozen streams' bound calls them back (``freeze_bound``): the freeze bound less the
two switches and the recompute. It must be at least what a woken waiter needs for its
first tokens (its probe's first token and the margin) and half the measured switch that
brought it in (``VISIT_SWITCHES``): a shorter visit serves a first token, then freezes the
visitor's own streams past their bound when the holder comes back, for two switches'
cost. A switch not yet measured (the default costs stand in) sets no such floor.

So with the default, unmeasured costs (sleep 0.5, wake 0.6, probe 0.1 s) a holder
streaming one request is preempted: 1.2 s away, a 0.2 s visit, 1.3 s back (its recompute
included) is 2.7 s; a plan that gave the target a whole turn (3 x its switch) would
never fit a 3 s bound. Measured switches are far cheaper (model-small on an H100:
sleep 0.056 s, wake 0.037 s p50); measured switches of a 26.5 GB model (about 0.6 s each
way) leave a visit 0.4 s, under half a switch, and drain: simulated, preempting them gave
96 requests within the SLO where ``drain`` gave 184.

A holder can be preempted only where some waiter's plan fits, or a waiter's wake brings
frozen streams back, and a freeze is begun (not merely continued) only while no other
claimant's streams are frozen, so frozen claimants never cascade. Where no preemption can
be planned the holder is not preemptible and every rule is ``drain``'s, its quantum, cost
rule and bounds included (the holder's drain counted before a frozen claimant's wake): a
policy that does not preempt decides exactly as ``drain`` does, so ``rota`` never does
worse than ``drain`` by preempting nobody. A switch that brings frozen streams back
preempts the holder even where its plan does not fit (a drain would keep them frozen for
the holder's whole generations). The choice of the next waiter follows the plan: while
streams are frozen, a waiter whose visit first would overrun one gives way to the frozen
claimant with the earliest deadline.

Turns bound the switching overhead. A holder on a visit (some frozen streams' return still
fits its plan) gives the GPU back once it has had its visit. Any other preemptible holder
has a turn first: its wake to its first token (the wake, the probe and the kept requests'
recompute, as the switch that woke it measured them; unmeasured, its usual wake and probe)
and its own sleep on both sides of the turn, times ``(1 - switch_share) / switch_share``
(3 x at 25 %), so a freeze is begun only after the holder has had three times what the
switch costs; no rule preempts it before (the bounds that predate preemption,
``bounded_wait`` and ``priority_preempt``, drain it instead), and past it a preemptible
holder gives way to a waiter at once (rule ``cost``). While streams stay frozen, visits
alternate as the freeze bound asks and may spend more than the switch share switching (with
16 GB engines, about 0.8 s a switch, a visit of about 1.2 s); once a return no longer fits,
the holder that returned keeps its whole turn, unless what is left of that turn alone
outlasts a frozen claimant's bound and ending the visit breaks fewer streams than the turn
would (its own counted): a 26.5 GB visitor among 1 GB engines (a 5.2 s turn) gives the GPU
back to their frozen streams instead of keeping them frozen 7 s. A holder with nothing in
flight gives way at once (``holder_idle``), so sequential traffic gets its first token
within the switch's own cost. Where no claim keeps requests, ``rota`` decides exactly as
``drain``.

The node may run the policy in :attr:`PolicyMode.DRAIN` (``--policy-mode drain``): the
rules above without preemption, every switch draining the holder (rota's policy before
turns at token granularity; the baseline the policy comparison measures ``rota`` against).

The node may run the policy in :attr:`PolicyMode.FIRST_COME` instead (``--policy-mode
first-come``): on-demand switching in arrival order, as llama-swap does, the baseline the
policy benchmark compares against. Rules 1-6 give way to one, ``first_come``: whoever
waits longest is served now, the holder drained and put to sleep whatever its load, its
priority or its quantum (no quantum, no bound, no cost). With nobody waiting, rule 7 holds
as in ``rota`` mode (the default keep-alive is forever: llama-swap's ``ttl: 0``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from rota.api.engine_config import EngineConfig

__all__ = [
    "RULES",
    "Action",
    "ClaimQueue",
    "Decision",
    "GpuView",
    "KeptWork",
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
         "first_come", "freeze_bound", "first_token_due")
"""Every rule :func:`decide` can name: the values of the metric label ``rule``."""


class Action(StrEnum):
    STAY = "stay"
    """Nothing changes now; ask again at :attr:`Decision.recheck_at` (or on news)."""
    SWITCH = "switch"
    """Make :attr:`Decision.target` the awake engine (the holder, if any, drains and
    sleeps, or with :attr:`Decision.preempt` sleeps at once with its requests kept)."""
    SLEEP = "sleep"
    """Put the holder to sleep; the GPU goes idle."""
    CANCEL = "cancel"
    """Do not make the pending switch (its waiters left)."""


class PolicyMode(StrEnum):
    """How a GPU chooses whom to serve next (the node's ``--policy-mode``)."""

    ROTA = "rota"
    """The rules of this module (quantum, bounds, priorities, cost, fair share) and the
    service objectives: a holder that keeps its requests may be preempted (the default)."""
    DRAIN = "drain"
    """The same rules without preemption: every switch drains the holder first, whatever
    its claim keeps (rota's policy before turns at token granularity; the baseline)."""
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
    first_token_s: float = 2.0
    """The objective for a request's first token (EngineConfig ``firstTokenSeconds``):
    a waiter due at it preempts a holder that keeps its requests (``first_token_due``)."""
    longest_freeze_s: float = 3.0
    """The longest gap a started stream may suffer while its engine sleeps with the
    stream kept (EngineConfig ``longestFreezeSeconds``); a bound (``freeze_bound``)."""
    keeps_requests: bool = False
    """Whether a switch away from this claimant may keep its requests in flight (sleep
    with them kept, continued at its next wake) instead of draining them."""
    switch_share: float = 0.25
    """Node-wide: the largest share of GPU time a preemptible holder's turn spends on
    switching: its quantum is at least ``(1 - share) / share`` times the switch's cost
    (the kept requests' recompute included), 3 x at 25 %."""
    mode: PolicyMode = PolicyMode.ROTA
    """Node-wide: :func:`decide` reads it from :attr:`PolicyInput.default_policy` (the
    node's defaults), never from a claim's own policy; a claim cannot set it."""

    def __post_init__(self) -> None:
        if self.keep_alive_s < 0 or self.quantum_factor < 0 or self.min_quantum_s < 0:
            raise ValueError("keep-alive and quantum must not be negative")
        if self.max_wait_s <= 0 or self.share_weight <= 0:
            raise ValueError("max_wait_s and share_weight must be positive")
        if self.first_token_s <= 0 or self.longest_freeze_s <= 0:
            raise ValueError("first_token_s and longest_freeze_s must be positive")
        if not 0 < self.switch_share < 1:
            raise ValueError("switch_share must be between 0 and 1")


RECOMPUTE_TOKENS_PER_S = 10_000.0
"""The default rate at which a woken engine recomputes its kept requests: a prefill rate
well below what one H100 does for a small model (tens of thousands of tokens a second),
so the policy errs towards waking a frozen engine early."""

HOLDER_TOKENS_PER_REQUEST = 1024
"""The tokens (prompt and generated) a holder's request in flight is assumed to hold when
the policy weighs preempting it: its exact count is only read at the sleep."""

DUE_MARGIN_S = 0.1
"""How early a first-token or freeze deadline is acted on: the worker's own reaction
(its look at the engine's load, the decision, the first call of the switch)."""


VISIT_SWITCHES = 0.5
"""A visit lasts at least this many times the measured switch that brought it in (the
holder's sleep, the visitor's wake and probe). Simulated over the Azure trace, 0.5 keeps
every scenario tried at or above ``drain`` (26.5 GB engines: no visit fits, exactly
``drain``); 1.0 gave 2-5 % fewer requests within the SLO with 16 GB engines, and 0 (the
first tokens alone) half of ``drain``'s with 26.5 GB engines."""


@dataclass(frozen=True)
class KeptWork:
    """A sleeping claimant's frozen requests: kept by a preemptive switch away from it,
    continued at its next wake."""

    count: int
    frozen_since: float
    """When its engine was put to sleep with them."""
    recompute_tokens: int = 0
    """Their prompt and generated tokens, recomputed after the wake."""


@dataclass(frozen=True)
class SwitchCost:
    """What switching costs, per claimant, as the controller measured it (seconds)."""

    sleep_s: float = 0.5
    """Putting this claimant to sleep (a later level-1 sleep)."""
    wake_s: float = 0.6
    """Waking it."""
    probe_s: float = 0.1
    """Its correctness request's first token after the wake."""
    recompute_tokens_per_s: float = RECOMPUTE_TOKENS_PER_S
    """How fast its engine recomputes kept requests after a wake (prompt and generated
    tokens per second; vLLM preempts them at the sleep and prefills them again)."""


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
    woken_in_s: float = 0.0
    """What the wake that brought the holder in took to its first token, as measured:
    the wake call and the probe, which waited for the recompute of the requests the wake
    brought back (0: not known; its own wake and probe stand in). With its own sleep it
    sizes its turn before it is preempted."""


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
    kept: Mapping[str, KeptWork] = field(default_factory=dict)
    """Sleeping claimants' frozen requests: each waits for its wake like a queue does."""


@dataclass(frozen=True)
class Decision:
    action: Action
    rule: str
    reason: str
    target: str | None = None
    recheck_at: float | None = None
    """When to decide again if nothing else happens (None: on the next event)."""
    preempt: bool = False
    """On :attr:`Action.SWITCH`: switch without draining; the holder sleeps with its
    requests kept. Only ever True when the holder's policy keeps requests."""


def quantum_of(inp: PolicyInput, holder: str, target: str | None) -> float:
    """The holder's quantum against a switch to ``target``.

    A holder that may be preempted (``rota`` mode, its requests kept, busy, and a
    preemption that can be planned: :func:`_preemptible`) has the
    quantum that keeps switching within its ``switch_share`` of GPU time: the switch's
    cost, the target's recompute included, times ``(1 - share) / share``, or what the
    holder's own turn or visit gives it (:func:`_tenure_ends`), if longer; no drain is
    counted since none happens. Any other holder: ``max(min_quantum_s, quantum_factor x
    (the switch's cost + the holder's measured drain))``."""
    policy = inp.policies.get(holder, inp.default_policy)
    if target is not None and _preemptible(inp, holder):
        return max(_tenure_ends(inp, holder) - inp.gpu.awake_since, _turn_quantum(
            inp, policy, _cost(inp, holder, target) + _recompute_s(inp, target)))
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


def _measured_cost(inp: PolicyInput, holder: str | None, target: str) -> float:
    """:func:`_cost` where both ends of the switch were measured, else 0 (unknown: the
    default costs are a cautious stand-in, not a measure to size a visit by)."""
    known = target in inp.costs and (holder is None or holder in inp.costs)
    return _cost(inp, holder, target) if known else 0.0


def _recompute_s(inp: PolicyInput, claim: str, tokens: int | None = None) -> float:
    """How long ``claim``'s engine recomputes its kept requests after its wake."""
    if tokens is None:
        kept = inp.kept.get(claim)
        tokens = kept.recompute_tokens if kept is not None else 0
    rate = inp.costs.get(claim, inp.default_cost).recompute_tokens_per_s
    return tokens / rate if rate > 0 else 0.0


def _turn_quantum(inp: PolicyInput, policy: ModelPolicy, cost: float) -> float:
    """The least service a turn that cost ``cost`` must give, for the switch share."""
    share = inp.default_policy.switch_share
    return cost * (1.0 - share) / share if policy.keeps_requests else 0.0


def _preemptible(inp: PolicyInput, holder: str | None) -> bool:
    """Whether a switch away from ``holder`` may keep its requests: ``rota`` mode, its
    claim keeps requests, it has requests to keep, and a preemption can be made for some
    waiter (its plan keeps every frozen stream within its bound, :func:`_freeze_fits`, or
    it brings frozen streams back). Where none can, the holder is not preemptible and
    every rule is ``drain``'s: a policy that will not preempt decides as ``drain``."""
    if not (holder is not None and inp.default_policy.mode is PolicyMode.ROTA
            and inp.gpu.in_flight > 0 and _policy(inp, holder).keeps_requests):
        return False
    waiters = _waiters(inp, holder)
    if any(_returning(inp, q.claim) for q in waiters):
        return True
    return not _frozen_others(inp, holder) and any(
        _freeze_fits(inp, holder, q.claim)[0] for q in waiters)


def _returning(inp: PolicyInput, claim: str) -> bool:
    """Whether waking ``claim`` brings frozen streams back."""
    kept = inp.kept.get(claim)
    return kept is not None and kept.count > 0


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


def _best(inp: PolicyInput, waiters: list[ClaimQueue], holder: str | None, *,
          preempted: bool = False) -> ClaimQueue:
    """The waiter to serve next by priority and score; while streams are frozen, the
    frozen claimant with the earliest deadline instead when serving the best first
    would keep some stream frozen past its bound (the order of turns is by deadline)."""
    best = max(waiters, key=lambda q: (_policy(inp, q.claim).priority,
                                       _score(inp, q, holder), -q.oldest_since))
    if not inp.kept or inp.default_policy.mode is not PolicyMode.ROTA:
        return best
    if _freeze_fits(inp, holder, best.claim, preempted=preempted)[0]:
        return best
    frozen = [(inp.kept[q.claim].frozen_since + _policy(inp, q.claim).longest_freeze_s, q)
              for q in waiters if q.claim in inp.kept and inp.kept[q.claim].count > 0]
    return min(frozen, key=lambda f: f[0])[1] if frozen else best


def _waiters(inp: PolicyInput, holder: str | None) -> list[ClaimQueue]:
    """Every claimant waiting for the GPU: its queue, and its kept requests (a frozen
    stream waits for its engine's wake like a queued request does)."""
    found = {q.claim: q for q in inp.queues if q.length > 0 and q.claim != holder}
    for claim, kept in inp.kept.items():
        if kept.count <= 0 or claim == holder:
            continue
        q = found.get(claim)
        found[claim] = (ClaimQueue(claim, kept.count, kept.frozen_since) if q is None else
                        ClaimQueue(claim, q.length + kept.count,
                                   min(q.oldest_since, kept.frozen_since)))
    return list(found.values())


@dataclass(frozen=True)
class _Due:
    """A waiter at (or past) one of its bounds: ``urgency`` is its elapsed time plus what
    still stands before it is served, over the bound (>= 1: due)."""

    urgency: float
    rule: str
    queue: ClaimQueue
    note: str


def _queued(inp: PolicyInput, claim: str) -> ClaimQueue | None:
    return next((q for q in inp.queues if q.claim == claim and q.length > 0), None)


def _bounds(inp: PolicyInput, waiters: list[ClaimQueue], holder: str | None,
            preemptible: bool) -> list[_Due]:
    """Every waiter's urgency against each of its bounds, the due ones (rules 2a-2c)."""
    drain = inp.gpu.drain_estimate_s if holder and not preemptible else 0.0
    rota = inp.default_policy.mode is PolicyMode.ROTA
    due: list[_Due] = []
    for q in waiters:
        policy = _policy(inp, q.claim)
        cost = _cost(inp, holder, q.claim)
        urgency = (_wait(inp, q) + cost + drain) / policy.max_wait_s
        if urgency >= 1.0:
            due.append(_Due(urgency, "bounded_wait", q, f"{q.claim}'s oldest request has "
                            f"waited {_wait(inp, q):.1f} s of its {policy.max_wait_s:g} s "
                            "bound"))
        kept = inp.kept.get(q.claim) if rota else None
        if kept is not None and kept.count > 0:
            frozen = max(0.0, inp.gpu.now - kept.frozen_since)
            back = cost + drain + _recompute_s(inp, q.claim) + DUE_MARGIN_S
            urgency = (frozen + back) / policy.longest_freeze_s
            if urgency >= 1.0:
                due.append(_Due(urgency, "freeze_bound", q, f"{q.claim}'s {kept.count} "
                                f"kept requests have been frozen {frozen:.2f} s of their "
                                f"{policy.longest_freeze_s:g} s bound (back in "
                                f"{back:.2f} s)"))
        queued = _queued(inp, q.claim) if preemptible else None
        if queued is not None and holder is not None:
            back = cost + _recompute_s(inp, q.claim) + DUE_MARGIN_S
            urgency = (_wait(inp, queued) + back) / policy.first_token_s
            fits, why = _freeze_fits(inp, holder, q.claim)
            if urgency >= 1.0 and fits:
                due.append(_Due(urgency, "first_token_due", q, f"{q.claim}'s oldest "
                                f"request needs its first token within "
                                f"{policy.first_token_s:g} s (waited "
                                f"{_wait(inp, queued):.2f} s, the switch takes "
                                f"{back:.2f} s)"))
            elif urgency >= 1.0:
                log_note = f"{q.claim}'s first token is due but {why}"
                due.append(_Due(0.0, "", q, log_note))
    return due


def _freeze_fits(inp: PolicyInput, holder: str | None, target: str, *,
                 preempted: bool = True) -> tuple[bool, str]:
    """Whether serving ``target`` next keeps every frozen stream within its longest
    freeze: every claimant's kept streams, and the holder's when it is ``preempted``,
    woken in order of their deadlines (earliest first) after the target's visit, each
    given a visit (:func:`_visit_s`), each woken ``DUE_MARGIN_S`` before its deadline.
    The text says which would overrun."""
    late = _late_after(inp, holder, target, preempted=preempted)
    if not late:
        return True, ""
    claim, overrun, _ = late[0]
    return False, (f"{claim}'s frozen streams would wait {overrun:.2f} s past their "
                   f"{_policy(inp, claim).longest_freeze_s:g} s bound")


_Return = tuple[float, str, int | None, int]
"""A frozen claimant's return in a plan: its deadline, the claim, the tokens it recomputes
(None: its kept requests'), its frozen streams."""
_Late = tuple[str, float, int]
"""A frozen claimant a plan brings back past its bound: the claim, by how many seconds,
its frozen streams."""


def _late_after(inp: PolicyInput, holder: str | None, target: str, *,
                preempted: bool = True) -> list[_Late]:
    """The plan of :func:`_freeze_fits`: the frozen claimants it brings back late."""
    holder_frozen: list[_Return] = [] if holder is None or not preempted else [
        (inp.gpu.now + _policy(inp, holder).longest_freeze_s, holder,
         inp.gpu.in_flight * HOLDER_TOKENS_PER_REQUEST, inp.gpu.in_flight)]
    drain = inp.gpu.drain_estimate_s if holder is not None and not preempted else 0.0
    return _returns_late(inp, _visit_ends(inp, holder, target) + drain, target,
                         (holder, target), holder_frozen)


def _visit_ends(inp: PolicyInput, holder: str | None, target: str) -> float:
    """When a visit of ``target`` that preempts ``holder`` now would end."""
    return (inp.gpu.now + _cost(inp, holder, target) + _recompute_s(inp, target)
            + _visit_s(inp, target, _measured_cost(inp, holder, target)))


def _returns_late(inp: PolicyInput, t: float, previous: str | None,
                  skip: tuple[str | None, ...], extra: Sequence[_Return] = ()
                  ) -> list[_Late]:
    """The frozen claimants (other than ``skip``, with ``extra`` returns) that would come
    back past their bound when, from ``t`` on, the GPU turns from ``previous`` to each
    in order of their deadlines, each given a visit: (claim, overrun s, frozen streams)."""
    returns: list[_Return] = [
        (k.frozen_since + _policy(inp, c).longest_freeze_s, c, None, k.count)
        for c, k in inp.kept.items() if k.count > 0 and c not in skip]
    late: list[_Late] = []
    for deadline, claim, tokens, streams in sorted([*returns, *extra]):
        t += _cost(inp, previous, claim) + _recompute_s(inp, claim, tokens)
        if t + DUE_MARGIN_S > deadline:
            late.append((claim, t + DUE_MARGIN_S - deadline, streams))
        t += _visit_s(inp, claim, _measured_cost(inp, previous, claim))
        previous = claim
    return late


def _visit_s(inp: PolicyInput, claim: str, switch_in_s: float = 0.0) -> float:
    """The least service a turn of ``claim`` gets while streams are frozen (a visit):
    its waiters' first tokens (a woken engine's first token, measured by its probe) and
    the reaction margin, and at least ``VISIT_SWITCHES`` x ``switch_in_s`` (the measured
    switch that brings it in; 0 when unknown). A visit's length is bounded above by the
    frozen streams' bound (rule ``freeze_bound`` ends it)."""
    return max(VISIT_SWITCHES * switch_in_s,
               inp.costs.get(claim, inp.default_cost).probe_s + DUE_MARGIN_S)


def _frozen_others(inp: PolicyInput, holder: str) -> bool:
    return any(k.count > 0 for c, k in inp.kept.items() if c != holder)


def _visited(inp: PolicyInput, holder: str) -> bool:
    """Whether ``holder`` holds the GPU on a visit: preempting it now for some frozen
    claimant brings every frozen stream, the holder's own included, back within its
    bound. Or no plan does, but what is left of the holder's whole turn alone outlasts
    the bound of streams it would keep frozen past it, and ending the visit breaks fewer
    streams (the holder's own then counted) than the whole turn does: a visitor slow to
    switch back, woken while engines quick to switch were frozen, would otherwise keep
    them frozen for its whole turn once no plan keeps every bound to the letter."""
    plans = [_late_after(inp, holder, c) for c, k in inp.kept.items()
             if k.count > 0 and c != holder]
    if not plans:
        return False
    if any(not late for late in plans):
        return True
    turn_ends = _turn_ends(inp, holder)
    after_turn = _returns_late(inp, max(inp.gpu.now, turn_ends), holder, (holder,))
    outlasts = any(turn_ends - inp.gpu.now > _policy(inp, c).longest_freeze_s
                   for c, _, _ in after_turn)
    broken_by_visit_end = min(sum(n for _, _, n in late) for late in plans)
    return outlasts and broken_by_visit_end < sum(n for _, _, n in after_turn)


def _tenure_ends(inp: PolicyInput, holder: str) -> float:
    """When a preemptible holder has had the least service its turn buys: before, no
    rule preempts it, so every turn makes progress and the switching stays within the
    switch share even when the bounds cannot all be kept. A holder woken while others'
    streams are frozen is on a visit (:func:`_visit_s`): the plans of
    :func:`_freeze_fits` give it that much before the frozen streams come back."""
    if _visited(inp, holder):
        return inp.gpu.awake_since + _visit_s(inp, holder)
    return _turn_ends(inp, holder)


def _turn_ends(inp: PolicyInput, holder: str) -> float:
    """When the holder's whole turn ends, the least service a turn gets: its wake to the
    first token (as the wake that brought it in measured it, its kept requests' recompute
    included; else its usual wake and probe) and its sleep on both sides of the turn (its
    own sleep stands in for the previous holder's: a quick engine woken after a slow one
    is not held awake for the slow one's sleep), stretched so that they are at most the
    switch share of the turn."""
    sleep = inp.costs.get(holder, inp.default_cost).sleep_s
    woken_in = inp.gpu.woken_in_s or _wake_cost(inp, holder)
    return inp.gpu.awake_since + _turn_quantum(inp, _policy(inp, holder),
                                               sleep + woken_in + sleep)


def _switch(inp: PolicyInput, rule: str, reason: str, target: str, holder: str | None,
            preemptible: bool) -> Decision:
    """A switch to ``target``: preemptive when the holder may be preempted
    (:func:`_preemptible`), has had its turn or visit (:func:`_tenure_ends`) and every
    frozen stream stays within its bound; drained (as always) otherwise. A switch that
    brings frozen streams back preempts whatever follows: a drain would keep them frozen
    for the holder's whole generations, a certain overrun against a possible one. Before
    the holder's turn is over, the bounds that predate preemption (the wait's and a
    priority's) drain it as always; the others wait for the turn's end."""
    if not preemptible or holder is None:
        return Decision(Action.SWITCH, rule, reason, target)
    tenure = _tenure_ends(inp, holder)
    if inp.gpu.now < tenure:
        if rule in ("bounded_wait", "priority_preempt"):
            return Decision(Action.SWITCH, rule, f"{reason}; {holder} drains (its turn is "
                            "too young to preempt)", target)
        return Decision(Action.STAY, "quantum", f"{reason}; {holder} is preempted once it "
                        f"has had the service its switch buys, in "
                        f"{tenure - inp.gpu.now:.2f} s", recheck_at=tenure)
    fits, why = _freeze_fits(inp, holder, target)
    if not fits and _returning(inp, target):
        return Decision(Action.SWITCH, rule, f"{reason}; {holder} is preempted, its "
                        f"{inp.gpu.in_flight} requests kept, though {why}", target,
                        preempt=True)
    if not fits:
        return Decision(Action.SWITCH, rule, f"{reason}; {holder} drains ({why} if it "
                        "were preempted)", target)
    return Decision(Action.SWITCH, rule, f"{reason}; {holder} is preempted, its "
                    f"{inp.gpu.in_flight} requests kept", target, preempt=True)


def _most_urgent(inp: PolicyInput, due: list[_Due], holder: str | None,
                 preemptible: bool) -> Decision:
    """The waiter past (or nearest) its bound is served; the others due are named."""
    top = max(due, key=lambda d: (d.urgency, _policy(inp, d.queue.claim).priority))
    others = [f"{d.queue.claim} ({d.rule}, {d.urgency:.2f} x its bound)" for d in due
              if d is not top and d.queue.claim != top.queue.claim]
    reason = top.note + (f"; served before {', '.join(others)}, nearer their bounds"
                         if others else "")
    return _switch(inp, top.rule, reason, top.queue.claim, holder, preemptible)


def decide(inp: PolicyInput) -> Decision:
    """The policy: see the module's docstring for the rules and their order."""
    gpu = inp.gpu
    now = gpu.now
    holder = gpu.holder
    waiters = _waiters(inp, holder)

    if inp.default_policy.mode is PolicyMode.FIRST_COME and waiters:
        q = min(waiters, key=lambda w: w.oldest_since)
        return Decision(Action.SWITCH, "first_come", f"{q.claim}'s request came first "
                        f"({_wait(inp, q):.1f} s ago); "
                        + (f"{holder} ({gpu.in_flight} in flight) drains and sleeps"
                           if holder else "the GPU is idle"), q.claim)

    # 1. A pending switch nobody waits for any more.
    if gpu.pending is not None and gpu.pending != holder:
        waiting = any(q.claim == gpu.pending for q in waiters)
        if not waiting and gpu.pending != inp.home:
            return Decision(Action.CANCEL, "cancelled",
                            f"every request for {gpu.pending} left before its wake began")

    if waiters:
        preemptible = _preemptible(inp, holder)
        # 2. The bounds, first: the guarantees (a request's wait, a frozen stream's gap,
        # and, against a holder that may be preempted, the first token's objective).
        bounds = _bounds(inp, waiters, holder, preemptible)
        due = [d for d in bounds if d.rule]
        if due and holder is not None:
            return _most_urgent(inp, due, holder, preemptible)
        if holder is None:
            if due:
                return _most_urgent(inp, due, None, False)
            q = _best(inp, waiters, None)
            rule = "first_request" if len(waiters) == 1 else "cost"
            return Decision(Action.SWITCH, rule, f"the GPU is idle; {q.claim} waits "
                            f"({q.length} requests, oldest {_wait(inp, q):.1f} s)", q.claim)
        held = _policy(inp, holder)
        # 3. Priority with preemption.
        higher = [q for q in waiters if _policy(inp, q.claim).priority > held.priority]
        if higher:
            q = _best(inp, higher, holder, preempted=preemptible)
            if preemptible:
                return _switch(inp, "priority_preempt", f"{q.claim} (priority "
                               f"{_policy(inp, q.claim).priority}) preempts {holder} "
                               f"(priority {held.priority})", q.claim, holder, True)
            return Decision(Action.SWITCH, "priority_preempt",
                            f"{q.claim} (priority {_policy(inp, q.claim).priority}) preempts "
                            f"{holder} (priority {held.priority}); its {gpu.in_flight} "
                            "requests in flight finish within the drain deadline", q.claim)
        # 4. Keep-alive never blocks a waiting client (whatever the holder's priority).
        if gpu.in_flight == 0:
            q = _best(inp, waiters, holder)
            return Decision(Action.SWITCH, "holder_idle", f"{holder} has nothing in flight "
                            f"and {q.claim} waits", q.claim)
        held_back = "".join(f"; {d.note}" for d in bounds if not d.rule)
        peers = [q for q in waiters if _policy(inp, q.claim).priority == held.priority]
        if not peers:
            return Decision(Action.STAY, "stay", f"only lower-priority claimants wait; "
                            f"{holder} keeps the GPU while it is busy{held_back}",
                            recheck_at=_next_bound(inp, waiters, holder))
        q = _best(inp, peers, holder, preempted=preemptible)
        # 5. The quantum.
        quantum = quantum_of(inp, holder, q.claim)
        ends = gpu.awake_since + quantum
        if now < ends:
            return Decision(Action.STAY, "quantum", f"{holder} is busy within its "
                            f"{quantum:.1f} s quantum{held_back}", recheck_at=min(
                                ends, _next_bound(inp, waiters, holder) or ends))
        # 6. Cost-aware choice (a preemptible holder's quantum already pays for the switch).
        if preemptible:
            return _switch(inp, "cost", f"{holder}'s turn of {quantum:.2f} s is over and "
                           f"{q.claim} waits ({q.length} requests)", q.claim, holder, True)
        cost = _cost(inp, holder, q.claim)
        waited = q.length * _wait(inp, q) * _policy(inp, q.claim).share_weight
        if waited >= cost:
            return _switch(inp, "cost", f"{q.claim}: {q.length} requests have waited "
                           f"{waited:.1f} request-s, more than the {cost:.2f} s switch",
                           q.claim, holder, preemptible)
        return Decision(Action.STAY, "stay", f"{q.claim}'s wait is still below the switch "
                        f"cost ({cost:.2f} s){held_back}",
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
    """When the first waiter's bound rule will fire (a frozen stream's and, against a
    holder that may be preempted, a first token's deadline included)."""
    preemptible = _preemptible(inp, holder)
    drain = inp.gpu.drain_estimate_s if holder and not preemptible else 0.0
    times = [q.oldest_since + _policy(inp, q.claim).max_wait_s
             - _cost(inp, holder, q.claim) - drain for q in waiters]
    if inp.default_policy.mode is PolicyMode.ROTA:
        for q in waiters:
            back = _cost(inp, holder, q.claim) + _recompute_s(inp, q.claim) + DUE_MARGIN_S
            kept = inp.kept.get(q.claim)
            if kept is not None and kept.count > 0:
                times.append(kept.frozen_since + _policy(inp, q.claim).longest_freeze_s
                             - back)
            queued = _queued(inp, q.claim) if preemptible and holder else None
            if queued is not None and holder is not None:
                times.append(max(queued.oldest_since + _policy(inp, q.claim).first_token_s
                                 - back, _tenure_ends(inp, holder)))
    return min(times) if times else None


def policy_for(config: EngineConfig, default: ModelPolicy, *, keeps: bool = False
               ) -> ModelPolicy:
    """A claimant's policy: its EngineConfig's fields, the node's ``default`` elsewhere;
    ``keeps``: whether a switch away from it may keep its requests (the claim's effective
    ``keepRequests``, which the caller resolves: a gang's claim never keeps).

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
        else config.share_weight,
        first_token_s=(default.first_token_s if config.first_token_seconds is None
                       else config.first_token_seconds),
        longest_freeze_s=(default.longest_freeze_s if config.longest_freeze_seconds is None
                          else config.longest_freeze_seconds),
        keeps_requests=keeps, switch_share=default.switch_share, mode=default.mode)
