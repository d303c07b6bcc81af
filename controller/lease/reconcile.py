"""Reconciliation of one GPU: before anything else, at most one engine awake (in an awake
set, only the engines the Lease names, as far as their budgets fit).

A controller that starts, takes over a node, finds a holder's pod gone, or sees a
claimant change does not trust the Lease alone: it asks every claimant on the GPU whether
it sleeps and reads the GPU. :func:`classify` turns each answer into what is known of the
engine; :func:`plan` decides, purely, which engine keeps the GPU and which must be put to
sleep first.

An engine that did not answer but holds GPU memory is **unknown**: possibly awake (a wake
may be running in it; vLLM's ``/is_sleeping`` waits behind it), possibly about to fall
asleep (a sleep whose caller gave up). It is never dropped: it keeps the GPU if it holds
the Lease, it is sent a sleep otherwise, and no other engine is woken on its GPU until it
is known again.

A **suspect** is an engine that a call may still reach: the engines of a switch whose
controller never finished it, and every engine a switch left unsettled (a sleep or wake
that timed out). Whatever it answers now (a hung wake leaves ``/is_sleeping`` true and
the memory at rest until it lands), it is settled only by a sleep of ours that completes:
an engine handles control calls in order, so a completed sleep proves that whatever was
sent before it has been done, and leaves the engine asleep.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from controller.claimants import Claimant


class Seen(StrEnum):
    """What reconciliation knows of one engine."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    """It says it sleeps and the GPU shows it at its resident footprint."""
    UNKNOWN = "unknown"
    """No answer (or an answer the GPU contradicts) while it holds GPU memory."""
    ABSENT = "absent"
    """No answer and no process on the GPU: not running, so not awake."""


def classify(sleeping: bool | None, *, used_bytes: int, has_process: bool,
             resident_bytes: int, tolerance_bytes: int) -> Seen:
    """``sleeping`` is the engine's ``/is_sleeping`` (None: no answer); ``used_bytes`` and
    ``has_process`` are what NVML shows of the claim's processes."""
    if sleeping is False:
        return Seen.AWAKE
    if sleeping is True:
        if used_bytes <= resident_bytes + tolerance_bytes:
            return Seen.ASLEEP
        return Seen.UNKNOWN  # paused but not (yet) handed back: a sleep may still fire
    return Seen.UNKNOWN if has_process else Seen.ABSENT


@dataclass(frozen=True)
class ReconcilePlan:
    keep: Claimant | None
    """The engine that holds the GPU (awake, or unknown and holding the Lease); None:
    nobody."""
    put_to_sleep: tuple[Claimant, ...]
    """Every other engine that is or may be awake, and every suspect."""
    unknown: tuple[Claimant, ...]
    """Engines whose state is unknown; no wake on their GPU until they are known."""
    keep_also: tuple[Claimant, ...] = ()
    """An awake set: the companions the Lease names that are awake and stay so beside
    ``keep`` (in the Lease's order; whether their budgets fit is checked by the caller)."""


def plan(claimants: Sequence[Claimant], seen: Mapping[str, Seen], holder: str, *,
         suspects: Collection[str] = (), may_not_keep: Collection[str] = (),
         companions: Sequence[str] = ()) -> ReconcilePlan:
    """``seen`` maps claim uid to :class:`Seen`; ``holder`` is the Lease's holder ref;
    ``suspects`` are the claim uids of suspects (see the module docstring);
    ``may_not_keep`` those of engines that may not keep this GPU whatever they are (an
    engine spanning GPUs that another of its GPUs' Leases does not name): awake or
    unknown, they are put to sleep like any extra engine. ``companions``: the claim uids
    the Lease names awake beside its holder, where an awake set is in effect (else none).

    The Lease's holder keeps the GPU when it is awake and serving, or when it is unknown
    and nobody else is awake (it may well be awake: never strike it on a missed answer).
    Otherwise the first awake serving engine in claimant order does (a deterministic
    choice, so two racing instances agree). Suspects never keep the GPU. In an awake set,
    every companion the Lease names that is awake, serving and no suspect stays awake
    beside it (only an engine the Lease names: one it does not was never woken into the
    set). Every other awake or unknown engine is put to sleep, and so is every suspect
    that is not absent.
    """
    def state(c: Claimant) -> Seen:
        return seen.get(c.claim_uid, Seen.ABSENT)

    barred = {*suspects, *may_not_keep}
    awake = [c for c in claimants if state(c) is Seen.AWAKE and c.claim_uid not in barred]
    unknown = tuple(c for c in claimants if state(c) is Seen.UNKNOWN)
    current = next((c for c in claimants if c.ref == holder
                    and c.claim_uid not in barred), None)
    keep: Claimant | None = None
    if current is not None and current.serving and state(current) is Seen.AWAKE:
        keep = current
    elif next((c for c in awake if c.serving), None) is not None:
        keep = next(c for c in awake if c.serving)
    elif current is not None and state(current) is Seen.UNKNOWN:
        keep = current
    by_uid = {c.claim_uid: c for c in claimants}
    also = tuple(c for uid in companions if (c := by_uid.get(uid)) is not None
                 and c is not keep and keep is not None and c.serving
                 and state(c) is Seen.AWAKE and uid not in barred)
    to_sleep = [c for c in claimants if c is not keep and c not in also and (
        state(c) in (Seen.AWAKE, Seen.UNKNOWN)
        or (c.claim_uid in suspects and state(c) is not Seen.ABSENT))]
    return ReconcilePlan(keep=keep, put_to_sleep=tuple(to_sleep), unknown=unknown,
                         keep_also=also)
