"""The awake set's fit rule: which engines may be awake on one GPU together, and which a
newcomer displaces. Pure.

With ``--awake-set`` a GPU may have more than one engine awake where their **awake
budgets** fit it together: the awake budget of every member and of the newcomer, the
resident budget of every other claimant, and the room the wake check leaves strangers
(``--unknown-process-bytes``) sum to no more than the GPU's memory. The plan is made on
budgets, not on what NVML reads now: an awake engine may grow up to its awake budget (a
KV cache allocated late, a CUDA graph captured at its first long prompt), and a set
planned on today's reading would not hold tomorrow's. NVML still has the last word before
every wake (:func:`controller.lease.device.check_before_wake` with the members that stay
awake): each member at or under its awake budget, each other claimant at its resident
footprint, and free memory, less what the members may still grow into, covering the
newcomer.

A switch puts to sleep only as many engines as the newcomer needs room for
(:func:`displace`): members in the order of :func:`displacement_order` (idle before busy,
lower priority first, then the one woken longest ago) until the rest fit, then every one
that turns out not to be needed is kept awake after all, so the newcomer never displaces
an engine it has room beside.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controller.claimants import Claimant
from rota.api.quantity import format_bytes


@dataclass(frozen=True)
class Room:
    """What the budgets of one GPU come to (bytes)."""

    total: int
    """The GPU's memory."""
    awake: int
    """The awake budgets of the members that stay and of the newcomer."""
    resident: int
    """The resident budgets of every other claimant."""
    reserve: int
    """Left to processes of no claimant (the wake check's limit for them)."""

    @property
    def needed(self) -> int:
        return self.awake + self.resident + self.reserve

    @property
    def fits(self) -> bool:
        return self.needed <= self.total

    def describe(self) -> str:
        return (f"awake budgets {format_bytes(self.awake)} + resident "
                f"{format_bytes(self.resident)} + reserve {format_bytes(self.reserve)} = "
                f"{format_bytes(self.needed)} of {format_bytes(self.total)}")


def room(gpu: str, total_bytes: int, *, awake: Sequence[Claimant],
         claimants: Sequence[Claimant], reserve_bytes: int) -> Room:
    """The budgets of ``gpu`` with ``awake`` awake and every other claimant of
    ``claimants`` (those on ``gpu``) asleep at its resident budget."""
    awake_uids = {c.claim_uid for c in awake}
    return Room(total=total_bytes,
                awake=sum(c.config.awake_memory for c in awake),
                resident=sum(c.resident_on(gpu) for c in claimants
                             if c.claim_uid not in awake_uids and gpu in c.gpus),
                reserve=reserve_bytes)


@dataclass(frozen=True)
class Displacement:
    """How a newcomer joins the awake set of one GPU."""

    stay: tuple[Claimant, ...]
    """Members that stay awake beside it, in wake order."""
    sleep: tuple[Claimant, ...]
    """Members put to sleep for it, in the order they are put to sleep."""
    room: Room
    """The budgets once the newcomer is awake beside ``stay``."""


def displacement_order(members: Sequence[Claimant], *, load: Mapping[str, int],
                       priority: Callable[[Claimant], int]) -> list[Claimant]:
    """``members`` (in wake order, the holder last) in the order a newcomer displaces
    them: idle before busy (a busy one's requests wait, or are frozen), lower priority
    first, then the one woken longest ago."""
    woken = {c.claim_uid: i for i, c in enumerate(members)}
    return sorted(members, key=lambda c: (load.get(c.claim_uid, 0) > 0, priority(c),
                                          woken[c.claim_uid]))


def displace(gpu: str, total_bytes: int, *, newcomer: Claimant,
             members: Sequence[Claimant], claimants: Sequence[Claimant],
             reserve_bytes: int, order: Sequence[Claimant] | None = None
             ) -> Displacement | None:
    """The fewest ``members`` (the engines awake on ``gpu``, in wake order) to put to
    sleep so that ``newcomer`` fits awake beside the rest; None when it does not fit even
    with every member asleep (the wake check would refuse it: the caller puts them all to
    sleep and lets the check say why). ``order``: the members in the order they are
    displaced (:func:`displacement_order`; default: wake order)."""
    members = [m for m in members if m.claim_uid != newcomer.claim_uid]
    order = [m for m in (order if order is not None else members) if m in members]

    def budgets(stay: Sequence[Claimant]) -> Room:
        return room(gpu, total_bytes, awake=[*stay, newcomer], claimants=claimants,
                    reserve_bytes=reserve_bytes)

    if not budgets([]).fits:
        return None
    asleep: list[Claimant] = []
    for member in order:
        if budgets([m for m in members if m not in asleep]).fits:
            break
        asleep.append(member)
    # Keep awake every one not needed after all (a later, larger one made the room).
    for member in reversed(list(asleep)):
        trial = [m for m in asleep if m is not member]
        if budgets([m for m in members if m not in trial]).fits:
            asleep = trial
    stay = tuple(m for m in members if m not in asleep)
    return Displacement(stay=stay, sleep=tuple(asleep), room=budgets(stay))
