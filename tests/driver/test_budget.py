"""The two-budget admission checks: the numbers, the messages, the device exclusivity."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from driver.budget import (
    ClaimantBudget,
    check_admission,
    check_awake_fits,
    check_not_overcommitted,
    check_others_still_fit,
)
from driver.claims import AllocatedShare, ClaimPlan
from driver.errors import BudgetError
from rota.api.engine_config import parse_engine_config
from rota.api.errors import ClaimError

GIB = 2**30
GPU = "GPU-aaa"
GPU_MEMORY = 143771 * 2**20  # 140.4 GiB

Check = Callable[..., None]


def share(
    *,
    device: str = "gpu-0",
    share_id: str | None = "s-new",
    resident: int = 2 * GIB,
    gpu: str = GPU,
) -> AllocatedShare:
    return AllocatedShare(
        request="engine",
        pool="node-a",
        device=device,
        share_id=share_id,
        gpu_uuid=gpu,
        consumed_memory_bytes=resident,
        consumed=(("memory", resident),),
    )


def make_plan(
    *shares: AllocatedShare, awake: int | None = 60 * GIB, uid: str = "uid-new"
) -> ClaimPlan:
    chosen = shares or (share(),)
    config = None
    if awake is not None:
        config = parse_engine_config(
            {
                "apiVersion": "gpu.rota.dev/v1alpha1",
                "kind": "EngineConfig",
                "model": "llama",
                "awakeMemory": awake,
            }
        )
    resident = sum(s.consumed_memory_bytes for s in chosen)
    return ClaimPlan(
        uid=uid,
        namespace="team-a",
        name="llama",
        shares=tuple(chosen),
        config=config,
        resident_bytes=resident,
        awake_bytes=awake if awake is not None else resident,
    )


def other(
    name: str,
    resident: int,
    awake: int | None = None,
    devices: tuple[tuple[str, str | None], ...] = (),
    uid: str | None = None,
) -> ClaimantBudget:
    return ClaimantBudget(
        uid=uid or f"uid-{name}",
        namespace="team-b",
        name=name,
        resident_bytes=resident,
        awake_bytes=awake,
        devices=devices,
    )


def run(check: Check, plan: ClaimPlan, others: Sequence[ClaimantBudget], **kw: object) -> None:
    check(plan=plan, gpu_memory_bytes=GPU_MEMORY, others=others, **kw)


@pytest.mark.parametrize(
    ("awake", "others", "fits"),
    [
        (60 * GIB, [], True),
        (140 * GIB, [], True),
        (GPU_MEMORY, [], True),
        (GPU_MEMORY + 1, [], False),
        (60 * GIB, [other("qwen", 80 * GIB)], True),
        (60 * GIB, [other("qwen", 80 * GIB), other("phi", 2 * GIB), other("mix", 2 * GIB)], False),
        (GPU_MEMORY - 4 * GIB, [other("a", 2 * GIB), other("b", 2 * GIB)], True),
        (GPU_MEMORY - 4 * GIB + 1, [other("a", 2 * GIB), other("b", 2 * GIB)], False),
    ],
)
def test_awake_fits(awake: int, others: list[ClaimantBudget], fits: bool) -> None:
    plan = make_plan(awake=awake)
    if fits:
        run(check_awake_fits, plan, others)
    else:
        with pytest.raises(BudgetError):
            run(check_awake_fits, plan, others)


def test_awake_refusal_states_every_number() -> None:
    others = [other("qwen", 80 * GIB), other("phi", 2 * GIB), other("mistral", 2 * GIB)]
    with pytest.raises(BudgetError) as caught:
        run(check_awake_fits, make_plan(awake=60 * GIB), others)
    assert str(caught.value) == (
        "claim team-a/llama needs 60.0 GiB awake; 3 other claimants hold 84.0 GiB resident "
        "(team-b/qwen 80.0 GiB, team-b/mistral 2.0 GiB, team-b/phi 2.0 GiB); "
        "GPU GPU-aaa has 140.4 GiB: 3.6 GiB short"
    )
    assert caught.value.reason == "over_budget"


def test_long_lists_of_claimants_are_shortened() -> None:
    others = [other(f"c{i}", 20 * GIB) for i in range(8)]
    with pytest.raises(BudgetError) as caught:
        run(check_awake_fits, make_plan(awake=60 * GIB), others)
    assert "8 other claimants hold 160.0 GiB resident" in str(caught.value)
    assert "and 3 more" in str(caught.value)


def test_awake_below_resident_counts_as_resident() -> None:
    plan = make_plan(share(resident=100 * GIB), awake=10 * GIB)
    with pytest.raises(BudgetError, match=r"needs 100\.0 GiB awake"):
        run(check_awake_fits, plan, [other("qwen", 41 * GIB)])


def test_the_claim_itself_is_not_counted_twice() -> None:
    plan = make_plan(awake=100 * GIB)
    myself = other("llama", 2 * GIB, uid="uid-new")
    for check in (check_not_overcommitted, check_awake_fits, check_others_still_fit):
        run(check, plan, [myself, other("qwen", 40 * GIB)])


@pytest.mark.parametrize(
    ("resident", "others", "fits"),
    [
        (2 * GIB, [other("a", 138 * GIB)], True),
        (2 * GIB, [other("a", GPU_MEMORY - 2 * GIB)], True),
        (2 * GIB, [other("a", GPU_MEMORY - 2 * GIB + 1)], False),
        (GPU_MEMORY, [], True),
        (GPU_MEMORY, [other("a", 1)], False),
    ],
)
def test_not_overcommitted(resident: int, others: list[ClaimantBudget], fits: bool) -> None:
    plan = make_plan(share(resident=resident), awake=None)
    if fits:
        run(check_not_overcommitted, plan, others)
    else:
        with pytest.raises(BudgetError, match="resident"):
            run(check_not_overcommitted, plan, others)


def test_overcommit_message() -> None:
    plan = make_plan(share(resident=10 * GIB), awake=None)
    with pytest.raises(BudgetError) as caught:
        run(check_not_overcommitted, plan, [other("qwen", 135 * GIB)])
    assert str(caught.value) == (
        "claim team-a/llama holds 10.0 GiB resident; 1 other claimant holds 135.0 GiB resident "
        "(team-b/qwen 135.0 GiB); GPU GPU-aaa has 140.4 GiB: 4.6 GiB short"
    )


@pytest.mark.parametrize(
    ("mine", "theirs", "refused"),
    [
        (("gpu-0", "s-new"), ("gpu-0", "s-old"), False),
        (("gpu-0", "s-new"), ("gpu-1", None), False),
        (("gpu-0", "s-new"), ("gpu-0", None), True),
        (("gpu-0", None), ("gpu-0", "s-old"), True),
        (("gpu-0", None), ("gpu-0", None), True),
        (("gpu-0", "s-same"), ("gpu-0", "s-same"), True),
        (("gpu-0-share-0", None), ("gpu-0-share-1", None), False),
    ],
)
def test_devices_held_whole_are_not_shared(
    mine: tuple[str, str | None], theirs: tuple[str, str | None], refused: bool
) -> None:
    plan = make_plan(share(device=mine[0], share_id=mine[1], resident=GIB), awake=None)
    others = [other("qwen", GIB, devices=(theirs,))]
    if refused:
        with pytest.raises(ClaimError) as caught:
            run(check_not_overcommitted, plan, others)
        assert caught.value.reason == "device_in_use"
        assert "team-b/qwen" in str(caught.value)
        assert not isinstance(caught.value, BudgetError)
    else:
        run(check_not_overcommitted, plan, others)


def test_devices_on_other_gpus_are_not_compared() -> None:
    plan = make_plan(
        share(device="gpu-0", share_id=None, resident=GIB),
        share(device="gpu-1", share_id=None, resident=GIB, gpu="GPU-bbb"),
        awake=None,
    )
    run(check_not_overcommitted, plan, [other("q", GIB, devices=(("gpu-1", None),))], gpu_uuid=GPU)


@pytest.mark.parametrize(
    ("resident", "others", "refused_for"),
    [
        (2 * GIB, [other("qwen", 2 * GIB, awake=130 * GIB)], None),
        (2 * GIB, [other("qwen", 2 * GIB, awake=GPU_MEMORY - 2 * GIB)], None),
        (2 * GIB, [other("qwen", 2 * GIB, awake=GPU_MEMORY - 2 * GIB + 1)], "qwen"),
        (
            10 * GIB,
            [other("qwen", 2 * GIB, awake=100 * GIB), other("phi", 2 * GIB, awake=130 * GIB)],
            "phi",
        ),
        (10 * GIB, [other("plain", 120 * GIB)], None),
    ],
)
def test_others_still_fit(
    resident: int, others: list[ClaimantBudget], refused_for: str | None
) -> None:
    plan = make_plan(share(resident=resident), awake=resident)
    if refused_for is None:
        run(check_others_still_fit, plan, others)
    else:
        with pytest.raises(BudgetError) as caught:
            run(check_others_still_fit, plan, others)
        assert f"leaving claim team-b/{refused_for} " in str(caught.value)
        assert "this one is refused" in str(caught.value)


def test_others_still_fit_message() -> None:
    plan = make_plan(share(resident=20 * GIB), awake=20 * GIB)
    others = [other("qwen", 2 * GIB, awake=100 * GIB), other("phi", 30 * GIB)]
    with pytest.raises(BudgetError) as caught:
        run(check_others_still_fit, plan, others)
    assert str(caught.value) == (
        "claim team-a/llama would hold 20.0 GiB resident on GPU GPU-aaa, leaving claim "
        "team-b/qwen (needs 100.0 GiB awake) unable to wake: the other claimants would hold "
        "50.0 GiB resident and the GPU has 140.4 GiB, 9.6 GiB short; the claim already "
        "prepared keeps its place, this one is refused"
    )


@pytest.mark.parametrize(
    ("plan", "others", "reason", "fragment"),
    [
        (make_plan(awake=60 * GIB), [other("a", 60 * GIB)], None, ""),
        (
            make_plan(share(resident=100 * GIB), awake=None),
            [other("a", 60 * GIB)],
            "over_budget",
            "holds 100.0 GiB resident",
        ),
        (make_plan(awake=100 * GIB), [other("a", 60 * GIB)], "over_budget", "needs 100.0 GiB"),
        (
            make_plan(awake=20 * GIB),
            [other("a", 2 * GIB, awake=139 * GIB)],
            "over_budget",
            "unable to wake",
        ),
        (
            make_plan(share(share_id=None), awake=None),
            [other("a", GIB, devices=(("gpu-0", "x"),))],
            "device_in_use",
            "already holds",
        ),
    ],
)
def test_check_admission_runs_every_check(
    plan: ClaimPlan, others: list[ClaimantBudget], reason: str | None, fragment: str
) -> None:
    if reason is None:
        run(check_admission, plan, others)
        return
    with pytest.raises(ClaimError) as caught:
        run(check_admission, plan, others)
    assert caught.value.reason == reason
    assert fragment in str(caught.value)


def test_a_claim_on_two_gpus_needs_the_gpu_named() -> None:
    plan = make_plan(share(), share(gpu="GPU-bbb", share_id="s2"), awake=GIB)
    with pytest.raises(ValueError, match="touches 2 GPUs"):
        run(check_awake_fits, plan, [])
    run(check_awake_fits, plan, [], gpu_uuid="GPU-bbb")


def test_checks_use_the_resident_on_the_named_gpu() -> None:
    plan = make_plan(
        share(resident=100 * GIB), share(gpu="GPU-bbb", share_id="s2", resident=GIB), awake=None
    )
    run(check_not_overcommitted, plan, [other("a", 100 * GIB)], gpu_uuid="GPU-bbb")
    with pytest.raises(BudgetError):
        run(check_not_overcommitted, plan, [other("a", 100 * GIB)], gpu_uuid=GPU)
