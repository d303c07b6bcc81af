"""What kubectl shows of an awake set: every engine the GPU Lease names awake (the holder
of an ``awake`` Lease and the engines beside it) has the ``awake`` label and a true
``Awake`` condition, the rest ``asleep``; a switch's Events follow the Lease it wrote. The
same calls with a one-awake Lease show what they always did."""

from __future__ import annotations

from dataclasses import dataclass, replace

from controller.claimants import Claimant, claimants_from
from controller.lease.switch import SwitchResult
from controller.lease.visibility import GpuVisibility
from controller.lease.visible_state import EngineState, Occurrence
from controller.lease.visible_state_writer import VisibleStateWriter
from rota.api import naming
from rota.api.gpu_lease import AwakeMember, GpuLease

GPU = "gpu-0"


@dataclass(frozen=True)
class Shown:
    awake: bool
    reason: str
    message: str


class _Recorded(VisibleStateWriter):
    """What the writer would send, without an API server: the last label and conditions
    of each claimant, and every Event (pod name, reason, note)."""

    def __init__(self) -> None:
        self.labels: dict[str, EngineState] = {}
        self.conditions: dict[str, Shown] = {}
        self.events: list[tuple[str, str, str]] = []

    def pod_state(self, claimant: Claimant, state: EngineState) -> None:
        self.labels[claimant.claim_name] = state

    def claim_conditions(self, claimant: Claimant, *, awake: bool, ready: bool, reason: str,
                         message: str) -> None:
        self.conditions[claimant.claim_name] = Shown(awake, reason, message)

    def record(self, occurrence: Occurrence) -> None:
        self.events.append((occurrence.regarding.name, occurrence.reason.value,
                            occurrence.note))


def _claimant(name: str) -> Claimant:
    claim = {"metadata": {"uid": f"uid-{name}", "namespace": "ns", "name": name},
             "spec": {"devices": {"config": [{"opaque": {"driver": "gpu.rota.dev", "parameters": {
                 "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                 "model": f"org/{name}", "awakeMemory": "20Gi"}}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"driver": "gpu.rota.dev", "pool": "node-1", "device": GPU,
                  "request": "gpu"}]}},
                 "reservedFor": [{"resource": "pods", "name": f"pod-{name}",
                                  "uid": f"p-{name}"}]}}
    pod = {"metadata": {"uid": f"p-{name}", "name": f"pod-{name}", "namespace": "ns"},
           "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    (found,) = claimants_from([claim], {f"p-{name}": pod})
    return found


A, B, C = _claimant("a"), _claimant("b"), _claimant("c")
ON_GPU = [A, B, C]


def _member(claimant: Claimant) -> AwakeMember:
    return AwakeMember(claimant.ref, claimant.claim_uid, claimant.model)


def _lease(holder: Claimant | None, *beside: Claimant, fence: int = 7) -> GpuLease:
    lease = GpuLease(name="rota-gpu-node-1-gpu-0", node="node-1", device=GPU, fence=fence)
    if holder is None:
        return lease.idle().with_(companions=tuple(_member(c) for c in beside))
    return lease.serving(holder=holder.ref, model=holder.model, claim_uid=holder.claim_uid,
                         gang="", companions=tuple(_member(c) for c in beside))


def _shown(lease: GpuLease) -> _Recorded:
    writer = _Recorded()
    GpuVisibility(writer, GPU).settled(ON_GPU, lease)
    return writer


def test_every_member_of_the_awake_set_is_labelled_and_conditioned_awake() -> None:
    writer = _shown(_lease(A, B))
    assert writer.labels == {"a": EngineState.AWAKE, "b": EngineState.AWAKE,
                             "c": EngineState.ASLEEP}
    assert writer.conditions["a"] == Shown(
        True, "Holder", "awake on gpu-0 (fencing number 7), with ns/b awake beside")
    assert writer.conditions["b"] == Shown(
        True, "AwakeWith", "awake on gpu-0 beside ns/a (fencing number 7)")
    assert writer.conditions["c"] == Shown(
        False, "Asleep", "asleep; ns/a holds gpu-0, with ns/b awake beside")


def test_one_awake_labels_and_conditions_are_as_before() -> None:
    writer = _shown(_lease(A))
    assert writer.labels == {"a": EngineState.AWAKE, "b": EngineState.ASLEEP,
                             "c": EngineState.ASLEEP}
    assert writer.conditions["a"] == Shown(True, "Holder", "awake on gpu-0 (fencing number 7)")
    assert writer.conditions["b"] == Shown(False, "Asleep", "asleep; ns/a holds gpu-0")


def test_companions_stay_awake_while_a_switch_beside_them_runs() -> None:
    """A Lease that says ``switching`` (from A to C) with B beside: B is awake, A not."""
    lease = _lease(A, B).opening(naming.LeaseState.SWITCHING, controller="ctl",
                                 target_model=C.model, draining_model=A.model,
                                 companions=(_member(B),))
    writer = _shown(lease)
    assert writer.labels == {"a": EngineState.ASLEEP, "b": EngineState.AWAKE,
                             "c": EngineState.ASLEEP}
    assert writer.conditions["b"].awake
    # Its engines as the worker marks them when the switch begins; B keeps its label.
    visibility = GpuVisibility(writer, GPU)
    visibility.switching(A, C)
    visibility.displacing([])
    assert writer.labels == {"a": EngineState.SWITCHING, "b": EngineState.AWAKE,
                             "c": EngineState.SWITCHING}


def test_a_companion_of_a_namesake_claim_is_not_awake() -> None:
    lease = _lease(A).with_(companions=(AwakeMember(B.ref, "uid-an-older-b", B.model),))
    assert _shown(lease).labels["b"] is EngineState.ASLEEP


def test_a_switch_that_keeps_the_holder_awake_records_no_switched_out() -> None:
    """C fits beside A and B: it holds the GPU now, A and B stay awake beside it."""
    writer = _Recorded()
    result = SwitchResult(True, _lease(C, A, B, fence=8))
    GpuVisibility(writer, GPU).switched(result, None, C)
    assert [(pod, reason) for pod, reason, _ in writer.events] == [("pod-c", "SwitchedIn")]
    # The holder handed in although the Lease names it beside the newcomer: still awake.
    writer.events.clear()
    GpuVisibility(writer, GPU).switched(result, A, C)
    assert [(pod, reason) for pod, reason, _ in writer.events] == [("pod-c", "SwitchedIn")]


def test_the_members_a_switch_displaces_are_switched_out() -> None:
    """C displaces B (the one the switch names) and A (put to sleep first): each gets
    SwitchedOut; a member still named awake does not."""
    writer = _Recorded()
    visibility = GpuVisibility(writer, GPU)
    visibility.displacing([A])
    assert writer.labels == {"a": EngineState.SWITCHING}
    result = SwitchResult(True, _lease(C, fence=8))
    visibility.switched(result, B, C, rule="slo")
    visibility.displaced(result, [A], C, rule="slo")
    assert writer.events == [
        ("pod-b", "SwitchedOut", "put to sleep on gpu-0 for org/c (policy: slo)"),
        ("pod-c", "SwitchedIn", "awake on gpu-0 (policy: slo)"),
        ("pod-a", "SwitchedOut", "put to sleep on gpu-0 for org/c (policy: slo)")]
    writer.events.clear()
    visibility.displaced(SwitchResult(True, _lease(C, A, fence=9)), [A], C)
    visibility.displaced(SwitchResult(False, _lease(None, fence=9), "gpu_oom"), [A], C)
    assert writer.events == []


def test_a_newcomer_woken_beside_the_holder_is_switched_in() -> None:
    writer = _Recorded()
    GpuVisibility(writer, GPU).switched(SwitchResult(True, _lease(A, C)), None, C)
    assert [(pod, reason) for pod, reason, _ in writer.events] == [("pod-c", "SwitchedIn")]


def test_one_awake_switch_events_are_as_before() -> None:
    writer = _Recorded()
    visibility = GpuVisibility(writer, GPU)
    visibility.switched(SwitchResult(True, _lease(C, fence=8)), A, C)
    assert writer.events == [("pod-a", "SwitchedOut", "put to sleep on gpu-0 for org/c"),
                             ("pod-c", "SwitchedIn", "awake on gpu-0")]
    writer.events.clear()
    visibility.switched(SwitchResult(True, _lease(None, fence=9), "idle"), C, C)
    assert writer.events == [("pod-c", "SwitchedOut", "put to sleep on gpu-0 (idle)")]
    writer.events.clear()
    # A start whose newcomer sleeps after its first sleep while A is woken back.
    visibility.switched(SwitchResult(True, _lease(A, fence=10)), A, C, start=True)
    assert [(pod, reason) for pod, reason, _ in writer.events] == [
        ("pod-a", "SwitchedOut"), ("pod-c", "StartAdmitted")]


def test_a_claim_created_again_under_the_holders_name_is_not_shown_awake() -> None:
    """The Lease names claim ``a`` of uid ``uid-a`` awake; ``a`` is deleted and created
    again (a new uid, a new pod, its engine asleep) before the Lease is rewritten: the new
    engine is shown asleep, not awake under its predecessor's name. A Lease that records
    no holder uid (written before the controller recorded one) still matches by name."""
    again = replace(A, claim_uid="uid-a-again", pod_uid="p-a-again")
    shown = _Recorded()
    GpuVisibility(shown, GPU).settled([again, B], _lease(A))
    assert shown.labels == {"a": EngineState.ASLEEP, "b": EngineState.ASLEEP}
    assert not shown.conditions["a"].awake
    legacy = _lease(A).with_(holder_claim_uid="")
    GpuVisibility(shown, GPU).settled([A], legacy)
    assert shown.labels["a"] is EngineState.AWAKE
