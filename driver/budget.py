"""The two-budget admission check run at prepare, per physical GPU.

Every claimant of a shared GPU has two budgets: what its engine holds all the time, asleep
or awake (*resident*: the claim's consumed ``memory``), and what it holds while awake
(*awake*: ``awakeMemory`` from its opaque config, never less than its resident). One
claimant is awake at a time, so a GPU works when, for every claimant, its awake budget plus
everyone else's resident budget fits. The scheduler only sums resident budgets; this module
adds the rest. Three checks, all pure, each refusing with a message that states the numbers:

- :func:`check_not_overcommitted`: the resident budgets of all claimants, the newcomer
  included, fit on the GPU, and no device held whole (no shareID) is held by two claims.
  The scheduler guarantees this; the driver checks again as the last line of defence
  (a stale allocation, a change of sharing mode, a ledger from another driver version).
- :func:`check_awake_fits`: the newcomer's awake budget plus everyone else's resident fits.
- :func:`check_others_still_fit`: after the newcomer's resident is added, every claimant
  already prepared can still be woken. When one cannot, the newcomer is refused, not the
  claimant already there: that claimant's pod is running and was admitted under the old
  numbers; admitting the newcomer would leave it unable ever to wake, a failure that would
  surface later, at a switch, far from its cause. Refusing at prepare keeps the failure on
  the pod whose arrival caused it, with a message that names the claimant it would starve.

:func:`check_admission` runs the three in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from driver.claims import ClaimPlan
from driver.errors import BudgetError
from rota.api.errors import ClaimError
from rota.api.quantity import format_bytes

__all__ = [
    "ClaimantBudget",
    "check_admission",
    "check_awake_fits",
    "check_not_overcommitted",
    "check_others_still_fit",
]

_LISTED = 5


@dataclass(frozen=True)
class ClaimantBudget:
    """Another claim already prepared on the same physical GPU, as the checks see it."""

    uid: str
    namespace: str
    name: str
    resident_bytes: int
    """Memory it holds on this GPU all the time."""
    awake_bytes: int | None = None
    """Memory it needs on this GPU while awake; None when it has no awake budget of its own
    (no engine config), which counts as its resident."""
    devices: tuple[tuple[str, str | None], ...] = ()
    """The (device name, shareID) pairs it holds on this GPU; shareID None = held whole."""

    @property
    def ref(self) -> str:
        """``namespace/name`` for messages."""
        return f"{self.namespace}/{self.name}"

    @property
    def awake(self) -> int:
        """The awake budget to check, never less than the resident one."""
        return max(self.awake_bytes or 0, self.resident_bytes)


def _gpu(plan: ClaimPlan, gpu_uuid: str | None) -> str:
    if gpu_uuid is not None:
        return gpu_uuid
    gpus = plan.gpu_uuids
    if len(gpus) != 1:
        raise ValueError(f"claim {plan.uid} touches {len(gpus)} GPUs; name the one to check")
    return gpus[0]


def _others(plan: ClaimPlan, others: Sequence[ClaimantBudget]) -> list[ClaimantBudget]:
    return sorted(
        (o for o in others if o.uid != plan.uid),
        key=lambda o: (-o.resident_bytes, o.namespace, o.name, o.uid),
    )


def _listing(claimants: Sequence[ClaimantBudget]) -> str:
    shown = [f"{c.ref} {format_bytes(c.resident_bytes)}" for c in claimants[:_LISTED]]
    if len(claimants) > _LISTED:
        shown.append(f"and {len(claimants) - _LISTED} more")
    return ", ".join(shown)


def _holders(claimants: Sequence[ClaimantBudget]) -> str:
    count = len(claimants)
    if count == 0:
        return "no other claimant holds memory"
    noun = "claimant holds" if count == 1 else "claimants hold"
    total = sum(c.resident_bytes for c in claimants)
    return f"{count} other {noun} {format_bytes(total)} resident ({_listing(claimants)})"


def check_not_overcommitted(
    *,
    plan: ClaimPlan,
    gpu_memory_bytes: int,
    others: Sequence[ClaimantBudget],
    gpu_uuid: str | None = None,
) -> None:
    """Refuse the claim when the resident budgets on the GPU, its own included, exceed it.

    Also refuses when the claim and another claimant hold the same device and either holds
    it whole, or hold the very same share.

    Args:
        plan: the claim to prepare.
        gpu_memory_bytes: the GPU's total memory.
        others: the other claims prepared on this GPU (the claim itself is skipped).
        gpu_uuid: the GPU to check; may be left out when the claim touches one GPU.

    Raises:
        ClaimError: reason ``device_in_use`` when a device is held by another claim.
        BudgetError: the resident budgets do not fit.
    """
    gpu = _gpu(plan, gpu_uuid)
    rest = _others(plan, others)
    for share in plan.shares:
        if share.gpu_uuid != gpu:
            continue
        for other in rest:
            for device, share_id in other.devices:
                if device != share.device:
                    continue
                if share.share_id is None or share_id is None or share_id == share.share_id:
                    raise ClaimError(
                        f"claim {plan.namespace}/{plan.name} is allocated {share.device}, which "
                        f"claim {other.ref} already holds "
                        f"{'whole' if share_id is None else 'through the same share'}; "
                        "it will not be shared",
                        reason="device_in_use",
                    )
    mine = plan.resident_bytes_on(gpu)
    held = sum(o.resident_bytes for o in rest)
    if mine + held > gpu_memory_bytes:
        raise BudgetError(
            f"claim {plan.namespace}/{plan.name} holds {format_bytes(mine)} resident; "
            f"{_holders(rest)}; GPU {gpu} has {format_bytes(gpu_memory_bytes)}: "
            f"{format_bytes(mine + held - gpu_memory_bytes)} short"
        )


def check_awake_fits(
    *,
    plan: ClaimPlan,
    gpu_memory_bytes: int,
    others: Sequence[ClaimantBudget],
    gpu_uuid: str | None = None,
) -> None:
    """Refuse the claim when its awake budget plus the others' resident exceeds the GPU.

    Args:
        plan: the claim to prepare.
        gpu_memory_bytes: the GPU's total memory.
        others: the other claims prepared on this GPU (the claim itself is skipped).
        gpu_uuid: the GPU to check; may be left out when the claim touches one GPU.

    Raises:
        BudgetError: the message states the claim's awake budget, every other claimant's
            resident budget, the GPU's size and the shortfall.
    """
    gpu = _gpu(plan, gpu_uuid)
    rest = _others(plan, others)
    awake = plan.awake_bytes_on(gpu)
    held = sum(o.resident_bytes for o in rest)
    if awake + held > gpu_memory_bytes:
        raise BudgetError(
            f"claim {plan.namespace}/{plan.name} needs {format_bytes(awake)} awake; "
            f"{_holders(rest)}; GPU {gpu} has {format_bytes(gpu_memory_bytes)}: "
            f"{format_bytes(awake + held - gpu_memory_bytes)} short"
        )


def check_others_still_fit(
    *,
    plan: ClaimPlan,
    gpu_memory_bytes: int,
    others: Sequence[ClaimantBudget],
    gpu_uuid: str | None = None,
) -> None:
    """Refuse the claim when its resident budget would leave another claimant unable to wake.

    For each other claimant: its awake budget plus the resident budgets of everyone else,
    this claim included, must fit. See the module docstring for why the newcomer is refused.

    Raises:
        BudgetError: naming the claimant that could no longer wake, and the numbers.
    """
    gpu = _gpu(plan, gpu_uuid)
    rest = _others(plan, others)
    mine = plan.resident_bytes_on(gpu)
    total_resident = mine + sum(o.resident_bytes for o in rest)
    for other in sorted(rest, key=lambda o: (-o.awake, o.namespace, o.name, o.uid)):
        need = other.awake + total_resident - other.resident_bytes
        if need > gpu_memory_bytes:
            raise BudgetError(
                f"claim {plan.namespace}/{plan.name} would hold {format_bytes(mine)} resident "
                f"on GPU {gpu}, leaving claim {other.ref} (needs {format_bytes(other.awake)} "
                f"awake) unable to wake: the other claimants would hold "
                f"{format_bytes(total_resident - other.resident_bytes)} resident and the GPU "
                f"has {format_bytes(gpu_memory_bytes)}, {format_bytes(need - gpu_memory_bytes)} "
                f"short; the claim already prepared keeps its place, this one is refused"
            )


def check_admission(
    *,
    plan: ClaimPlan,
    gpu_memory_bytes: int,
    others: Sequence[ClaimantBudget],
    gpu_uuid: str | None = None,
) -> None:
    """Run every check for one GPU: not over-committed, own awake fits, others still fit."""
    for check in (check_not_overcommitted, check_awake_fits, check_others_still_fit):
        check(plan=plan, gpu_memory_bytes=gpu_memory_bytes, others=others, gpu_uuid=gpu_uuid)
