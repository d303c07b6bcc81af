"""What the admin lets each namespace take of a shared GPU: the tenant binding.

A claim's EngineConfig is written by its tenant, and seven of its fields buy GPU time:
``priority`` (preempts lower), ``maxWaitSeconds`` (a waiter due at its bound is served
whatever the holder's priority), ``shareWeight`` (the fair share), ``keepAliveSeconds``
(the GPU stays with it while nobody waits), ``home`` (woken on an idle GPU), and the
service objectives ``firstTokenSeconds`` (a waiter due at it preempts a holder that keeps
its requests) and ``longestFreezeSeconds`` (a frozen stream due at it is woken first; a
holder whose freeze bound no preemption can keep is drained, never preempted). Bounding
only ``priority`` left the others open: with ``maxWaitSeconds: 0.001`` every request of a
tenant held to priority 0 was due at once and preempted a busy priority-100 holder.

So every one of them is bounded here, in one place, before the switch policy
(:mod:`controller.lease.policy`) reads the claim: :func:`bound` turns a claim's
EngineConfig into the EngineConfig the policy uses, and the lease controller's worker
reads nothing else of a claim's policy. The admin's binding is the lease controller's
``--policy-priority-ceilings`` (chart: ``controller.policy.priorityCeilings``): namespace
names or shell patterns (``team-*``, ``*``) to what that namespace's claims may take,
either a number (the priority ceiling alone) or a :class:`TenantLimits` object. A
namespace's own name is looked up first, then the patterns in order.

- **No binding at all** (the default): a trusted cluster. Every claim's values stand, but
  ``maxWaitSeconds`` is raised to :data:`MAX_WAIT_FLOOR_S` and the objectives to
  :data:`OBJECTIVE_FLOOR_S` (or the node's own defaults, when those are shorter). A bound
  shorter than the switch it needs cannot be kept: it only makes every request due at
  once, which turns the quantum, the priorities and the cost rule off for everyone else
  on the GPU.
- **A binding**: a namespace takes no more than its entry grants, and where the entry (or
  a plain number) says nothing of a knob, no more than the node's default: priority up to
  ``--policy-priority``, a bound no shorter than ``--policy-max-wait-s``, a weight up to
  ``--policy-share-weight``, a keep-alive up to the node's, objectives no tighter than
  ``--first-token-objective-s`` and ``--longest-freeze-s``, and no ``home``. A namespace
  no entry names is held to the node's defaults in the same way.

What a bound changed is logged once per claim (``switch policy bounded by the admin``,
the values asked and given); the decisions' notes show the values used.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from controller.claimants import Claimant
from controller.lease.policy import ModelPolicy, policy_for
from rota.api.engine_config import EngineConfig

__all__ = [
    "MAX_WAIT_FLOOR_S",
    "OBJECTIVE_FLOOR_S",
    "Binding",
    "Bounded",
    "Limits",
    "Priority",
    "TenantLimits",
    "bound",
    "bounded",
    "limits_for",
]

log = logging.getLogger(__name__)

MAX_WAIT_FLOOR_S = 5.0
"""The shortest ``maxWaitSeconds`` a claim takes when the admin bound nothing. The
switches rota measured take 0.5-0.7 s for a small model woken from level 1 and a few
seconds for a large one; the bound rule fires once the wait plus that switch reach the
bound, so a bound near the switch's own cost is due at once. 5 s leaves a busy holder
its default quantum (4 x a ~1 s switch) before a waiter of lower priority takes the GPU,
and stays well below the default 30 s bound. An admin may grant less per namespace."""

OBJECTIVE_FLOOR_S = 1.0
"""The tightest ``firstTokenSeconds`` and ``longestFreezeSeconds`` a claim takes when the
admin bound nothing. A small model's switch costs 0.1-0.7 s one way and a freeze spans
two (away and back): a first-token objective below this is due on arrival, preempting
the holder as soon as its turn allows, and a freeze bound below it makes the claim's
own holder impossible to preempt (it drains, keeping the GPU for its whole generations)."""

_MEMO_LIMIT = 4096

Priority = Annotated[int, Field(strict=True, ge=-1000, le=1000)]


class TenantLimits(BaseModel):
    """What the claims of one namespace may take (the admin's entry for it).

    Each field left out is held to the node's default; see the module's docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              validate_by_alias=True, validate_by_name=True)

    priority: Priority | None = None
    """The highest ``priority`` its claims may take."""
    max_wait_seconds: float | None = Field(default=None, gt=0, le=3600)
    """The shortest ``maxWaitSeconds`` its claims may ask for (a floor: a shorter bound
    is served sooner, ahead of everyone else)."""
    share_weight: float | None = Field(default=None, gt=0, le=1000)
    """The largest ``shareWeight`` its claims may take."""
    keep_alive_seconds: float | None = Field(default=None, ge=0, le=86400)
    """The longest ``keepAliveSeconds`` its claims may take."""
    home: bool | None = None
    """Whether its claims may name themselves their GPU's home model (``home: true``)."""
    first_token_seconds: float | None = Field(default=None, gt=0, le=3600)
    """The tightest ``firstTokenSeconds`` its claims may ask for (a floor)."""
    longest_freeze_seconds: float | None = Field(default=None, gt=0, le=3600)
    """The tightest ``longestFreezeSeconds`` its claims may ask for (a floor)."""


Binding = Mapping[str, int | TenantLimits]
"""Namespace name or shell pattern → its priority ceiling, or its :class:`TenantLimits`."""


@dataclass(frozen=True)
class Limits:
    """The bounds that apply to one namespace, every one resolved."""

    entry: str
    """The binding's key that applied ("": none; the node's defaults or the floor)."""
    priority: int | None
    """The priority ceiling (None: no bound)."""
    min_wait_s: float
    share_weight: float
    keep_alive_s: float
    home: bool
    min_first_token_s: float
    min_freeze_s: float


@dataclass(frozen=True)
class Bounded:
    """A claim's EngineConfig as the policy may use it, and what the bound changed."""

    config: EngineConfig
    limits: Limits
    changed: Mapping[str, tuple[Any, Any]]
    """Field (its JSON name) → (the value asked, the value given); empty: nothing."""


def _entry(namespace: str, binding: Binding) -> tuple[str, TenantLimits] | None:
    """The binding's entry for ``namespace``: its own name, else the first pattern."""
    keys = [namespace] if namespace in binding else [
        k for k in binding if fnmatch.fnmatchcase(namespace, k)][:1]
    if not keys:
        return None
    value = binding[keys[0]]
    return keys[0], value if isinstance(value, TenantLimits) else TenantLimits(priority=value)


def limits_for(namespace: str, binding: Binding, default: ModelPolicy) -> Limits:
    """The bounds on the claims of ``namespace`` (see the module's docstring)."""
    if not binding:
        return Limits(entry="", priority=None,
                      min_wait_s=min(MAX_WAIT_FLOOR_S, default.max_wait_s),
                      share_weight=math.inf, keep_alive_s=math.inf, home=True,
                      min_first_token_s=min(OBJECTIVE_FLOOR_S, default.first_token_s),
                      min_freeze_s=min(OBJECTIVE_FLOOR_S, default.longest_freeze_s))
    found = _entry(namespace, binding)
    key, granted = found if found is not None else ("", TenantLimits())
    return Limits(
        entry=key,
        priority=default.priority if granted.priority is None else granted.priority,
        min_wait_s=(default.max_wait_s if granted.max_wait_seconds is None
                    else granted.max_wait_seconds),
        share_weight=(default.share_weight if granted.share_weight is None
                      else granted.share_weight),
        keep_alive_s=(default.keep_alive_s if granted.keep_alive_seconds is None
                      else granted.keep_alive_seconds),
        home=bool(granted.home),
        min_first_token_s=(default.first_token_s if granted.first_token_seconds is None
                           else granted.first_token_seconds),
        min_freeze_s=(default.longest_freeze_s if granted.longest_freeze_seconds is None
                      else granted.longest_freeze_seconds))


def bound(config: EngineConfig, namespace: str, default: ModelPolicy, binding: Binding
          ) -> Bounded:
    """``config`` with every field that buys GPU time within what ``namespace`` may take.

    A field the claim left out takes the node's ``default``, and that too is bounded (a
    namespace held to priority -5 is at -5 even where the default is 0)."""
    limits = limits_for(namespace, binding, default)
    asked = policy_for(config, default)
    changes: dict[str, Any] = {}
    changed: dict[str, tuple[Any, Any]] = {}

    def give(field: str, name: str, value_asked: Any, value: Any) -> None:
        changes[field] = value
        changed[name] = (value_asked, value)

    if limits.priority is not None and asked.priority > limits.priority:
        give("priority", "priority", asked.priority, limits.priority)
    if asked.max_wait_s < limits.min_wait_s:
        give("max_wait_seconds", "maxWaitSeconds", asked.max_wait_s, limits.min_wait_s)
    if asked.share_weight > limits.share_weight:
        give("share_weight", "shareWeight", asked.share_weight, limits.share_weight)
    if asked.keep_alive_s > limits.keep_alive_s:
        give("keep_alive_seconds", "keepAliveSeconds", asked.keep_alive_s,
             limits.keep_alive_s)
    if config.home and not limits.home:
        give("home", "home", True, False)
    if asked.first_token_s < limits.min_first_token_s:
        give("first_token_seconds", "firstTokenSeconds", asked.first_token_s,
             limits.min_first_token_s)
    if asked.longest_freeze_s < limits.min_freeze_s:
        give("longest_freeze_seconds", "longestFreezeSeconds", asked.longest_freeze_s,
             limits.min_freeze_s)
    return Bounded(config.model_copy(update=changes) if changes else config, limits, changed)


_logged: dict[str, Mapping[str, tuple[Any, Any]]] = {}
"""What was last logged per claim, so a bound is logged when it starts or changes."""


def bounded(claimant: Claimant, default: ModelPolicy, binding: Binding) -> EngineConfig:
    """The claimant's EngineConfig as the switch policy may use it (see :func:`bound`);
    what the bound changed is logged once per claim and change."""
    result = bound(claimant.config, claimant.namespace, default, binding)
    if _logged.get(claimant.claim_uid) != result.changed:
        if len(_logged) >= _MEMO_LIMIT:
            _logged.clear()
        _logged[claimant.claim_uid] = result.changed
        if result.changed:
            log.info("switch policy bounded by the admin", extra={
                "claim": claimant.ref, "namespace": claimant.namespace,
                "entry": result.limits.entry or None,
                "asked": {k: v[0] for k, v in result.changed.items()},
                "given": {k: v[1] for k, v in result.changed.items()}})
    return result.config

