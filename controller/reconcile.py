"""Start-up and expiry reconciliation: before anything else, at most one engine awake.

A controller that starts, takes over a node, or finds a holder's pod gone does not trust
the Lease alone: it asks every claimant whether it sleeps. :func:`plan` decides, purely,
which engine keeps the GPU and which must be put to sleep first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controller.claimants import Claimant


@dataclass(frozen=True)
class ReconcilePlan:
    keep: Claimant | None
    """The engine left awake (it becomes or stays the holder); None: nobody is awake."""
    put_to_sleep: tuple[Claimant, ...]
    unknown: tuple[Claimant, ...]
    """Engines that did not answer; they are neither trusted nor woken."""


def plan(claimants: Sequence[Claimant], sleeping: Mapping[str, bool | None],
         holder: str) -> ReconcilePlan:
    """``sleeping`` maps claim uid to the engine's ``/is_sleeping`` (None: no answer).

    The Lease's holder keeps the GPU when it is awake; otherwise the first awake engine in
    claimant order does (a deterministic choice, so two racing instances agree). Every
    other awake engine is put to sleep.
    """
    awake = [c for c in claimants if sleeping.get(c.claim_uid) is False]
    unknown = tuple(c for c in claimants if sleeping.get(c.claim_uid) is None)
    keep = next((c for c in awake if c.ref == holder), awake[0] if awake else None)
    return ReconcilePlan(keep=keep,
                         put_to_sleep=tuple(c for c in awake if c is not keep),
                         unknown=unknown)
