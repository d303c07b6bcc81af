"""The NVML check before a wake attributes a process to a claimant only when the process
runs in the claimant's pod (the pod uid the kernel gives, which the inspection API reports)
and does not name another claim: a process can set its own ROTA_CLAIM_UID, not its cgroup."""

from __future__ import annotations

from controller.claimants import Claimant
from controller.lease.device import GpuProcess, GpuSnapshot, HandbackProblem, check_before_wake
from rota.api.engine_config import API_VERSION, KIND, parse_engine_config

GIB = 2**30
TOTAL = 141 * GIB


def _claimant(name: str, *, awake: int, resident: int) -> Claimant:
    config = parse_engine_config({"apiVersion": API_VERSION, "kind": KIND, "model": f"m/{name}",
                                  "awakeMemory": awake})
    return Claimant(claim_uid=f"claim-{name}", namespace="ns", claim_name=name, node="n",
                    device="gpu-0", share_id=None, config=config, model=f"m/{name}",
                    port=8000, sleep_level=1, resident_bytes=resident, pod_name=f"pod-{name}",
                    pod_uid=f"pod-{name}", pod_ip="10.0.0.1", pod_ready=True,
                    pod_deleting=False)


A = _claimant("a", awake=60 * GIB, resident=2 * GIB)
"""Asleep, down to its resident footprint."""
B = _claimant("b", awake=100 * GIB, resident=2 * GIB)
"""The wake target."""


def _check(*processes: GpuProcess) -> HandbackProblem | None:
    used = sum(p.used_bytes for p in processes)
    snapshot = GpuSnapshot(uuid="GPU-0", device="gpu-0", total_bytes=TOTAL, used_bytes=used,
                           free_bytes=TOTAL - used, processes=processes)
    return check_before_wake(snapshot, target=B, claimants=[A, B], tolerance_bytes=GIB,
                             unknown_limit_bytes=GIB // 2)


def _reason(problem: HandbackProblem | None) -> str | None:
    return None if problem is None else problem.reason


def test_the_claimants_own_processes_pass() -> None:
    assert _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                  GpuProcess(2, 2 * GIB, B.claim_uid, "pod-b")) is None


def test_a_process_naming_the_targets_claim_from_another_pod_is_a_stranger() -> None:
    """The forged uid would have made its 60 GiB count as the target's own, and the
    100 GiB wake would have been let into 79 GiB free."""
    problem = _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                     GpuProcess(2, 60 * GIB, B.claim_uid, "pod-tenant"))
    assert _reason(problem) == "unknown_process"
    assert problem is not None
    assert "2 (60.0 GiB)" in problem.message


def test_a_process_naming_the_target_outside_any_pod_is_a_stranger() -> None:
    problem = _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                     GpuProcess(2, 60 * GIB, B.claim_uid, ""))
    assert _reason(problem) == "unknown_process"


def test_a_process_naming_a_sleeping_claim_from_another_pod_is_not_that_claim() -> None:
    """Counting it as A's would blame A (memory_not_returned) for memory A does not hold."""
    problem = _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                     GpuProcess(2, 30 * GIB, A.claim_uid, "pod-tenant"))
    assert _reason(problem) == "unknown_process"


def test_a_process_in_one_claimants_pod_naming_another_claim_is_a_stranger() -> None:
    problem = _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                     GpuProcess(2, 60 * GIB, B.claim_uid, "pod-a"))
    assert _reason(problem) == "unknown_process"


def test_a_process_of_the_claimants_pod_that_names_no_claim_is_the_claimants() -> None:
    """A child that dropped its environment still runs in the engine's pod: its memory is
    the claimant's (here: A's, not handed back), not an unknown process's."""
    problem = _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                     GpuProcess(3, 20 * GIB, "", "pod-a"))
    assert _reason(problem) == "memory_not_returned"
    assert _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                  GpuProcess(3, GIB // 4, "", "pod-a")) is None


def test_a_claimant_without_a_known_pod_owns_no_process() -> None:
    podless = Claimant(**{**B.__dict__, "pod_uid": None})
    problem = check_before_wake(
        GpuSnapshot(uuid="GPU-0", device="gpu-0", total_bytes=TOTAL, used_bytes=60 * GIB,
                    free_bytes=TOTAL - 60 * GIB,
                    processes=(GpuProcess(2, 60 * GIB, B.claim_uid, ""),)),
        target=podless, claimants=[A, podless], tolerance_bytes=GIB,
        unknown_limit_bytes=GIB // 2)
    assert _reason(problem) == "unknown_process"


def test_a_stranger_of_unknown_size_stops_the_wake() -> None:
    """NVML could not tell its memory (usedGpuMemory not available): it may hold anything."""
    problem = _check(GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                     GpuProcess(2, 0, "", "", used_bytes_unknown=True))
    assert _reason(problem) == "unknown_process"
    assert problem is not None
    assert "unknown amount" in problem.message


def test_a_sleeping_claimant_of_unknown_size_has_not_handed_its_memory_back() -> None:
    problem = _check(GpuProcess(1, 0, A.claim_uid, "pod-a", used_bytes_unknown=True))
    assert _reason(problem) == "memory_not_returned"


def test_the_targets_own_memory_of_unknown_size_counts_as_none_held() -> None:
    """Its wake then needs its whole awake budget free: 100 GiB wanted, 99 GiB free."""
    snapshot = GpuSnapshot(uuid="GPU-0", device="gpu-0", total_bytes=TOTAL,
                           used_bytes=TOTAL - 99 * GIB, free_bytes=99 * GIB, processes=(
                               GpuProcess(1, 2 * GIB, A.claim_uid, "pod-a"),
                               GpuProcess(2, 0, B.claim_uid, "pod-b",
                                          used_bytes_unknown=True)))
    problem = check_before_wake(snapshot, target=B, claimants=[A, B], tolerance_bytes=GIB,
                                unknown_limit_bytes=GIB // 2)
    assert _reason(problem) == "insufficient_memory"
