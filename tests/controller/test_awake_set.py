"""The awake set's rules, pure: which members a newcomer displaces (the fewest, idle and
low priority first), the NVML check with members that stay awake (each within its awake
budget, room for the newcomer and for what they may still grow into), and reconciliation
keeping only the companions the Lease names that are awake."""

from __future__ import annotations

from controller.claimants import Claimant
from controller.lease.awake_set import displace, displacement_order, room
from controller.lease.device import GpuProcess, GpuSnapshot, check_before_wake
from controller.lease.reconcile import Seen, plan
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config

GIB = 2**30
TOTAL = 141 * GIB
RESERVE = GIB // 2


def _claimant(name: str, *, awake: int, resident: int = GIB, priority: int | None = None
              ) -> Claimant:
    document = {"apiVersion": API_VERSION, "kind": KIND, "model": f"m/{name}",
                "awakeMemory": awake}
    if priority is not None:
        document["priority"] = priority
    config = parse_engine_config(document)
    return Claimant(claim_uid=f"claim-{name}", namespace="ns", claim_name=name, node="n",
                    device="gpu-0", share_id=None, config=config, model=f"m/{name}",
                    port=8000, sleep_level=1, resident_bytes=resident, pod_name=f"pod-{name}",
                    pod_uid=f"pod-{name}", pod_ip="10.0.0.1", pod_ready=True,
                    pod_deleting=False)


A = _claimant("a", awake=60 * GIB)
B = _claimant("b", awake=60 * GIB)
C = _claimant("c", awake=60 * GIB)
EVERYONE = [A, B, C]


def _plan(newcomer: Claimant, members: list[Claimant], claimants: list[Claimant],
          order: list[Claimant] | None = None) -> tuple[list[str], list[str]] | None:
    planned = displace("gpu-0", TOTAL, newcomer=newcomer, members=members,
                       claimants=claimants, reserve_bytes=RESERVE, order=order)
    if planned is None:
        return None
    return [c.claim_name for c in planned.stay], [c.claim_name for c in planned.sleep]


def test_a_newcomer_that_fits_beside_the_set_displaces_nobody() -> None:
    assert _plan(B, [A], EVERYONE) == (["a"], [])
    assert room("gpu-0", TOTAL, awake=[A, B], claimants=EVERYONE,
                reserve_bytes=RESERVE).fits


def test_a_newcomer_displaces_one_member_when_two_fit_and_three_do_not() -> None:
    # 3 x 60 GiB of 141: two fit (120 + 1 resident + 0.5 reserve), three do not
    assert _plan(C, [A, B], EVERYONE) == (["b"], ["a"])  # the one woken longest ago


def test_the_order_puts_idle_before_busy_and_low_priority_first() -> None:
    low = _claimant("low", awake=60 * GIB, priority=-5)
    high = _claimant("high", awake=60 * GIB, priority=5)
    members = [high, low]
    by_priority = displacement_order(members, load={},
                                     priority=lambda c: c.config.priority or 0)
    assert [c.claim_name for c in by_priority] == ["low", "high"]
    busy_low = displacement_order(members, load={low.claim_uid: 2},
                                  priority=lambda c: c.config.priority or 0)
    assert [c.claim_name for c in busy_low] == ["high", "low"]


def test_only_the_members_needed_are_displaced() -> None:
    small = _claimant("small", awake=10 * GIB)
    big = _claimant("big", awake=100 * GIB)
    newcomer = _claimant("new", awake=60 * GIB)
    everyone = [small, big, newcomer]
    # In the order small, big: putting small to sleep is not enough, big is needed, and
    # then small fits beside the newcomer after all: it stays awake.
    assert _plan(newcomer, [small, big], everyone, order=[small, big]) == (["small"], ["big"])


def test_a_newcomer_too_big_for_the_gpu_alone_has_no_plan() -> None:
    huge = _claimant("huge", awake=141 * GIB)
    assert _plan(huge, [A], [A, huge]) is None


def test_the_plan_counts_every_other_claimants_resident_budget() -> None:
    # two of 60 GiB fit 141 GiB, unless the sleeping claimants' residents leave no room
    heavy = _claimant("heavy", awake=10 * GIB, resident=25 * GIB)
    assert _plan(B, [A], [A, B, heavy]) == ([], ["a"])


# -- the NVML check with members that stay awake -----------------------------------------


def _snapshot(*used: tuple[Claimant, int]) -> GpuSnapshot:
    processes = tuple(GpuProcess(pid=100 + i, used_bytes=n, claim_uid=c.claim_uid,
                                 pod_uid=c.pod_uid or "") for i, (c, n) in enumerate(used))
    total_used = sum(n for _, n in used)
    return GpuSnapshot(uuid="GPU-0", device="gpu-0", total_bytes=TOTAL, used_bytes=total_used,
                       free_bytes=TOTAL - total_used, processes=processes)


def _check(snapshot: GpuSnapshot, *, awake: list[Claimant], target: Claimant = B
           ) -> tuple[str, str] | None:
    problem = check_before_wake(snapshot, target=target, claimants=EVERYONE,
                                tolerance_bytes=GIB, unknown_limit_bytes=RESERVE, awake=awake)
    return None if problem is None else (problem.reason, problem.message)


def test_a_member_awake_within_its_budget_lets_the_newcomer_wake_beside_it() -> None:
    assert _check(_snapshot((A, 60 * GIB), (B, GIB), (C, GIB)), awake=[A]) is None


def test_one_awake_refuses_the_same_gpu() -> None:
    found = _check(_snapshot((A, 60 * GIB), (B, GIB), (C, GIB)), awake=[])
    assert found is not None
    assert found[0] == "memory_not_returned"


def test_a_member_grown_past_its_awake_budget_gets_the_next_wake_refused_with_numbers() -> None:
    found = _check(_snapshot((A, 62 * GIB), (B, GIB), (C, GIB)), awake=[A])
    assert found is not None
    reason, message = found
    assert reason == "awake_over_budget"
    assert "ns/a (m/a)" in message
    assert "62" in message
    assert "60" in message


def test_room_is_kept_for_what_the_members_may_still_grow_into() -> None:
    # A holds only 20 GiB of its 60 GiB budget now: 141 - 20 - 2 leaves 119 GiB free, more
    # than B's 59 GiB, but A may grow by 40 GiB and a third member by as much.
    grower = _claimant("grower", awake=70 * GIB)
    snapshot = _snapshot((A, 20 * GIB), (grower, 10 * GIB), (B, GIB), (C, GIB))
    problem = check_before_wake(snapshot, target=B, claimants=[*EVERYONE, grower],
                                tolerance_bytes=GIB, unknown_limit_bytes=RESERVE,
                                awake=[A, grower])
    assert problem is not None
    assert problem.reason == "insufficient_memory"
    assert "kept for the engines awake beside it" in problem.message


def test_a_member_whose_size_nvml_cannot_tell_stops_the_wake() -> None:
    processes = (GpuProcess(pid=1, used_bytes=0, claim_uid=A.claim_uid, pod_uid="pod-a",
                            used_bytes_unknown=True),)
    snapshot = GpuSnapshot(uuid="GPU-0", device="gpu-0", total_bytes=TOTAL, used_bytes=0,
                           free_bytes=TOTAL, processes=processes)
    problem = check_before_wake(snapshot, target=B, claimants=EVERYONE, tolerance_bytes=GIB,
                                unknown_limit_bytes=RESERVE, awake=[A])
    assert problem is not None
    assert problem.reason == "awake_over_budget"


# -- reconciliation ----------------------------------------------------------------------


def test_reconciliation_keeps_the_awake_companions_the_lease_names_and_no_other() -> None:
    seen = {A.claim_uid: Seen.AWAKE, B.claim_uid: Seen.AWAKE, C.claim_uid: Seen.AWAKE}
    decided = plan(EVERYONE, seen, A.ref, companions=[B.claim_uid])
    assert decided.keep is A
    assert decided.keep_also == (B,)
    assert decided.put_to_sleep == (C,)  # awake, but never woken into the set


def test_reconciliation_with_no_set_in_effect_puts_every_companion_to_sleep() -> None:
    seen = {A.claim_uid: Seen.AWAKE, B.claim_uid: Seen.AWAKE, C.claim_uid: Seen.ASLEEP}
    decided = plan(EVERYONE, seen, A.ref)
    assert decided.keep_also == ()
    assert decided.put_to_sleep == (B,)


def test_a_suspect_companion_is_put_to_sleep_and_an_asleep_one_dropped() -> None:
    seen = {A.claim_uid: Seen.AWAKE, B.claim_uid: Seen.AWAKE, C.claim_uid: Seen.ASLEEP}
    decided = plan(EVERYONE, seen, A.ref, companions=[B.claim_uid, C.claim_uid],
                   suspects={B.claim_uid})
    assert decided.keep_also == ()
    assert decided.put_to_sleep == (B,)
