"""The GPU Lease's named transitions: each state carries exactly the fields it may, so no
writer can leave a stale holder, target or error behind; and the controller writes Leases
through them only (it had nine inline edits that cleared different sets of fields)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rota.api import naming
from rota.api.gpu_lease import AwakeMember, GpuLease, lease_body

ROOT = Path(__file__).resolve().parents[2]

_BUSY = GpuLease(name="n-gpu-0", node="n", device="gpu-0", holder="ns/a", fence=4,
                 state=naming.STATE_SWITCHING, holder_model="a", holder_claim_uid="uid-a",
                 target_model="b", draining_model="a", last_error="probe_failed: x",
                 controller="ctl-1", gang="gpu-0,gpu-1")


def test_opening_raises_the_fence_clears_the_error_and_keeps_the_holder() -> None:
    opened = _BUSY.opening(naming.LeaseState.STARTING, controller="ctl-2", target_model="c",
                           draining_model="")
    assert (opened.state, opened.fence, opened.controller) == ("starting", 5, "ctl-2")
    assert (opened.target_model, opened.draining_model, opened.last_error) == ("c", "", "")
    assert (opened.holder, opened.gang) == ("ns/a", "gpu-0,gpu-1")
    assert _BUSY.opening(naming.LeaseState.SWITCHING, controller="c", target_model="b",
                         draining_model="a", gang="").gang == ""


@pytest.mark.parametrize("state", [naming.LeaseState.AWAKE, naming.LeaseState.IDLE,
                                   naming.LeaseState.FAILED])
def test_only_switching_or_starting_open_a_switch(state: naming.LeaseState) -> None:
    with pytest.raises(ValueError, match="opens as switching or starting"):
        _BUSY.opening(state, controller="c", target_model="b", draining_model="")


def test_serving_names_the_holder_and_nothing_under_way() -> None:
    served = _BUSY.serving(holder="ns/b", model="b", claim_uid="uid-b", gang="")
    assert (served.state, served.holder, served.holder_model, served.holder_claim_uid) == (
        "awake", "ns/b", "b", "uid-b")
    assert (served.target_model, served.draining_model, served.last_error, served.gang) == (
        "", "", "", "")
    assert served.fence == _BUSY.fence
    assert served.controller == "ctl-1"


def test_idle_names_nobody_and_failed_keeps_only_the_target() -> None:
    idle = _BUSY.idle(controller="ctl-2")
    assert (idle.state, idle.holder, idle.holder_model, idle.holder_claim_uid, idle.gang,
            idle.target_model, idle.draining_model, idle.last_error) == (
        "idle", "", "", "", "", "", "", "")
    assert idle.controller == "ctl-2"
    failed = _BUSY.failed("wake_failed: out of memory")
    assert (failed.state, failed.holder, failed.gang, failed.draining_model) == (
        "failed", "", "", "")
    assert (failed.target_model, failed.last_error) == ("b", "wake_failed: out of memory")


def test_new_term_changes_the_fence_and_the_controller_only() -> None:
    term = _BUSY.new_term("ctl-9")
    assert term == _BUSY.with_(fence=5, controller="ctl-9")


def test_the_controller_writes_leases_only_through_named_transitions() -> None:
    """``with_`` (any change of fields) is for tests and tools, never for the controller."""
    offenders = []
    for path in (ROOT / "controller").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "with_"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders


def _read(state: str | None) -> GpuLease:
    annotations = {} if state is None else {naming.STATE: state}
    return GpuLease.from_object({"metadata": {"name": "n-gpu-0", "annotations": annotations},
                                 "spec": {}})


def test_the_state_read_is_typed_and_an_unknown_one_is_switching() -> None:
    assert _read("awake").state is naming.LeaseState.AWAKE
    assert _read(None).state is naming.LeaseState.IDLE
    # A newer writer's state: read as a switch under way (reconcile first; no traffic).
    assert _read("hibernating").state is naming.LeaseState.SWITCHING


@pytest.mark.parametrize("node", ["n", "node-" + "x" * 80])
def test_the_node_selector_picks_the_leases_the_body_labels(node: str) -> None:
    body = lease_body(GpuLease(name=naming.gpu_lease_name(node, "gpu-0"), node=node,
                               device="gpu-0"), "rota-system", labels_node=node,
                      labels_device="gpu-0")
    wanted = dict(term.split("=", 1) for term in naming.gpu_lease_selector(node).split(","))
    assert wanted.items() <= body["metadata"]["labels"].items()
    assert wanted[naming.LABEL_KIND] == naming.KIND_GPU


# -- the awake set (naming.AWAKE_WITH) ------------------------------------------------------

_A, _C = AwakeMember("ns/a", "uid-a", "a"), AwakeMember("ns/c", "uid-c", "c")


def test_the_awake_set_travels_through_the_lease_object() -> None:
    served = _BUSY.serving(holder="ns/b", model="b", claim_uid="uid-b", gang="",
                           companions=(_A, _C))
    body = lease_body(served, "rota-system", labels_node="n", labels_device="gpu-0")
    read = GpuLease.from_object(body)
    assert read.companions == (_A, _C)
    assert [m.uid for m in read.awake_set] == ["uid-b", "uid-a", "uid-c"]
    assert read.names_awake("uid-c")
    assert not read.names_awake("uid-x")
    assert naming.AWAKE_WITH not in read.extra_annotations
    # one awake (the default): no annotation at all
    plain = lease_body(_BUSY.serving(holder="ns/b", model="b", claim_uid="uid-b", gang=""),
                       "rota-system", labels_node="n", labels_device="gpu-0")
    assert naming.AWAKE_WITH not in plain["metadata"]["annotations"]


def test_the_holder_is_never_its_own_companion_and_idle_names_nobody() -> None:
    served = _BUSY.serving(holder="ns/a", model="a", claim_uid="uid-a", gang="",
                           companions=(_A, _C))
    assert served.companions == (_C,)
    assert served.idle().companions == ()
    assert served.idle().awake_set == ()


def test_a_switch_keeps_only_the_companions_it_names_and_failed_keeps_the_untouched() -> None:
    served = _BUSY.serving(holder="ns/b", model="b", claim_uid="uid-b", gang="",
                           companions=(_A, _C))
    opened = served.opening(naming.LeaseState.SWITCHING, controller="c", target_model="d",
                            draining_model="c", companions=(_A,))
    assert opened.companions == (_A,)
    # while switching, the holder is not routable; the companions are
    assert [m.uid for m in opened.awake_set] == ["uid-a"]
    assert served.opening(naming.LeaseState.SWITCHING, controller="c", target_model="d",
                          draining_model="b").companions == ()
    assert opened.failed("wake_failed: x", companions=(_A,)).awake_set == (_A,)
    assert opened.failed("wake_failed: x").awake_set == ()


@pytest.mark.parametrize("value", ["not json", "{}", '[{"claim": "ns/a"}]', '[1]',
                                   '[{"claim": "", "uid": "u", "model": "m"}]'])
def test_an_unreadable_awake_set_reads_as_switching(value: str) -> None:
    body = lease_body(_BUSY.serving(holder="ns/b", model="b", claim_uid="uid-b", gang=""),
                      "rota-system", labels_node="n", labels_device="gpu-0")
    body["metadata"]["annotations"][naming.AWAKE_WITH] = value
    read = GpuLease.from_object(body)
    assert read.state == naming.LeaseState.SWITCHING
    assert read.companions == ()
    assert read.awake_set == ()
