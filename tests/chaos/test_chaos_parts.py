"""The chaos campaign's own bookkeeping: how answers and Lease transitions are read, how
its monitor reads the GPU (for one awake and for an awake set), the rig's budgets and the
settle check of either mode."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
from kubernetes import client

from driver.nvml import fixture_path
from driver.nvml.fake import load_fixture, register_process
from e2e.chaos.campaign import _count_samples, owner_problem
from e2e.chaos.evidence import engine_log, unreachable_engine
from e2e.chaos.load import classify
from e2e.chaos.observe import transition
from e2e.chaos.proxy import FlakyRelay
from e2e.chaos.rig import FAST_ENGINE, NodeRig, Rig, RigOptions, slow_starters
from e2e.chaos.tally import AWAKE_SET, Answer, Tally
from e2e.cluster import LocalCluster
from e2e.engine_simulator.settings import settings_from_args
from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, awake_set_capacity
from rota.api import naming
from rota.api.gpu_lease import AwakeMember, GpuLease
from rota.api.quantity import parse_quantity

DONE = b'data: {"choices": [{"delta": {"content": "7"}}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(("status", "headers", "body", "kind"), [
    (200, {}, DONE, Answer.OK),
    (200, {}, b'data: {"choices": []}\n\n', Answer.UNANSWERED),  # no [DONE]: cut short
    (200, {}, b'data: {"error": {"type": "switch_timeout"}}\n\ndata: [DONE]\n\n',
     Answer.REFUSED),
    (503, {"Retry-After": "2"}, b'{"error": {}}', Answer.REFUSED),
    (429, {"Retry-After": "1"}, b"", Answer.REFUSED),
    (503, {}, b"no hint", Answer.UNANSWERED),
    (500, {"Retry-After": "1"}, b"boom", Answer.UNANSWERED),
])
def test_answers_are_classified_by_the_campaigns_rule(status: int, headers: dict[str, str],
                                                      body: bytes, kind: str) -> None:
    assert classify(status, headers, body)[0] == kind


def _lease(state: naming.LeaseState, *, fence: int = 1, controller: str = "ctl-0",
           error: str = "") -> GpuLease:
    return GpuLease(name="rota-gpu-n-gpu-0", node="n", device="gpu-0", state=state,
                    fence=fence, controller=controller, last_error=error)


def test_a_switch_ends_when_switching_gives_way() -> None:
    switching = _lease(naming.STATE_SWITCHING)
    ended = transition(switching, _lease(naming.STATE_AWAKE))
    assert ended is not None
    assert ended.ok
    failed = transition(switching, _lease(naming.STATE_AWAKE, error="gpu_oom: no room"))
    assert failed is not None
    assert (failed.ok, failed.reason) == (False, "gpu_oom")
    taken = transition(switching, _lease(naming.STATE_AWAKE, controller="ctl-1"))
    assert taken is not None
    assert (taken.ok, taken.reason) == (False, "controller_crash")


def test_no_switch_ends_without_one_in_progress() -> None:
    assert transition(None, _lease(naming.STATE_AWAKE)) is None
    assert transition(_lease(naming.STATE_AWAKE), _lease(naming.STATE_AWAKE)) is None
    assert transition(_lease(naming.STATE_SWITCHING), _lease(naming.STATE_SWITCHING)) is None


def test_the_report_carries_the_campaigns_targets() -> None:
    tally = Tally()
    tally.switch(ok=True)
    tally.switch(ok=False, reason="memory_not_returned")
    tally.answer(Answer.UNANSWERED, "ClientConnectorError")
    report = tally.report()
    assert report["switches"] == 2
    assert report["failures_by_reason"] == {"memory_not_returned": 1}
    assert report["requests_without_answer"] == 1
    assert report["samples"]["unanswered"] == ["ClientConnectorError"]


@pytest.mark.parametrize("separate_process", [False, True], ids=["thread", "process"])
def test_the_registry_monitor_sees_two_engines_awake(tmp_path: Path, separate_process: bool
                                                     ) -> None:
    """The campaign's monitor reads the fake GPU's registry itself: one engine above its
    resident memory is fine, two are counted, with what each held; in a child process
    as well, whose counts come back at its end."""
    procs = tmp_path / "procs"
    engines = [Engine(EngineSpec(f"e{i}", f"m/{i}", resident="2Gi", awake="60Gi"), "ns",
                      claim_uid=f"claim-{i}") for i in range(2)]
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, "ROTA_CLAIM_UID": e.claim_uid})
                for e in engines]
    uuid = load_fixture(fixture_path("h200")).devices[0].uuid
    try:
        register_process(procs, children[0].pid, uuid, 60 * 2**30)
        register_process(procs, children[1].pid, uuid, 2 * 2**30)
        with AwakeMonitor(tmp_path / "no-socket", engines, registry=procs,
                          fixture=fixture_path("h200"),
                          separate_process=separate_process) as monitor:
            monitor.wait_next()
            assert monitor.violations == []
            register_process(procs, children[1].pid, uuid, 60 * 2**30)
            monitor.wait_next()
        assert monitor.violations, "two engines awake went unseen"
        assert "claim-0" in monitor.violations[0]
        assert "claim-1" in monitor.violations[0]
        assert monitor.gaps, "the gaps between samples are recorded"
        assert monitor.samples >= 4
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_failed_campaign_keeps_what_the_logs_say_of_an_unreachable_engine(
        short_tmp: Path) -> None:
    """The node agent's lines about the pod, the container's last lines, each controller's
    lines about the claim (its start ticket) and where the gates' path leads: here a dead
    socket a twin left (review F4), beside a live instance socket."""
    logs, gate = short_tmp / "logs", short_tmp / "start"
    logs.mkdir()
    gate.mkdir()
    engine = Engine(EngineSpec("e0-1", "m/1", resident="2Gi", awake="40Gi"), "ns",
                    claim_uid="claim-1")
    (logs / "node-agent.log").write_text('{"pod": "ns/e0-0", "msg": "started"}\n'
                                         '{"pod": "ns/e0-1", "msg": "engine exited"}\n')
    engine_log(logs, engine).write_text(
        '{"event": "the lease controller did not answer; asking again", '
        '"error": "ConnectionRefusedError(111)"}\n')
    (logs / "controller-controller-0.log").write_text(
        '{"msg": "start slot granted", "claim": "claim-1"}\n{"msg": "other", "claim": "c2"}\n')
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(gate / "start.sock"))
    dead.close()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(gate / "start-abc.sock"))
    live.listen(1)
    try:
        found = unreachable_engine(logs, gate, engine)
    finally:
        live.close()
    assert found["node_agent"] == ['{"pod": "ns/e0-1", "msg": "engine exited"}']
    assert "ConnectionRefusedError" in found["container"][0]
    assert found["start_ticket"] == {
        "controller-controller-0.log": ['{"msg": "start slot granted", "claim": "claim-1"}']}
    assert found["start_gate"] == ["start-abc.sock: socket (answers)",
                                   "start.sock: socket (refuses)"]
    tally = Tally()
    tally.unowned_gpus.append("n: an engine or the Lease cannot be read")
    assert not tally.clean()
    tally.unreachable.append(found)
    assert tally.report()["samples"]["unreachable_engines"] == [found]
    assert any("e0-1" in line and "start.sock: socket (refuses)" in line
               for line in tally.lines())


def test_the_last_engine_of_each_gpu_is_a_slow_starter_that_fits_beside_another() -> None:
    """F3's shape needs a start that outlasts the election Lease, by an engine whose awake
    budget fits beside another's (so a stale wake shows as two awake)."""
    options = RigOptions()
    rig = Rig(cast(LocalCluster, None), cast(client.ApiClient, None), "ns", options)
    specs = [rig._spec(0, k) for k in range(options.engines_per_gpu)]
    node = NodeRig(cast(GpuNode, None), cast(FlakyRelay, None), Path("kubeconfig"),
                   engines=[Engine(spec, "ns") for spec in specs])
    assert [e.spec.name for e in slow_starters(node)] == [specs[-1].name]
    slow = settings_from_args([*specs[-1].args])
    assert slow.start_seconds == options.slow_start_s > 4.0  # the rig's election Lease
    assert settings_from_args([*specs[0].args]).start_seconds == 0
    h200 = 141 * 2**30
    assert (parse_quantity(options.awake) + parse_quantity(options.slow_awake)
            + 2 * parse_quantity(options.resident) <= h200)


def _set_engines() -> list[Engine]:
    """The engines of one GPU in the awake-set rig, as the monitor knows them."""
    options = RigOptions.for_awake_set()
    rig = Rig(cast(LocalCluster, None), cast(client.ApiClient, None), "ns", options)
    return [Engine(rig._spec(0, k), "ns", claim_uid=f"claim-{k}")
            for k in range(options.engines_per_gpu)]


def test_the_awake_set_rig_lets_any_two_engines_be_awake_but_never_three() -> None:
    """Two of the set rig's engines fit the fake H200 awake together (the third at its
    resident budget, the wake check's reserve beside them), three never do; so every third
    model asked for displaces one. The simulators' own capacity check is lifted (an
    overcommitted set shows as memory over the GPU's total), the controllers run with
    --awake-set; the one-awake rig keeps neither."""
    h200 = load_fixture(fixture_path("h200")).devices[0].memory_total
    reserve = 512 * 2**20  # the controller's --unknown-process-bytes default
    engines = _set_engines()
    assert awake_set_capacity(engines, h200) == 2
    for pair in itertools.combinations(engines, 2):
        (other,) = [e for e in engines if e not in pair]
        assert (sum(parse_quantity(e.spec.awake) for e in pair) + other.resident_bytes
                + reserve <= h200), pair
    options = RigOptions.for_awake_set()
    assert options.awake_set
    assert options.mode == "awake-set"
    assert all(settings_from_args([*e.spec.args]).gpu_memory_bytes == 1024 * 2**30
               for e in engines)
    assert [e.spec.name for e in slow_starters(NodeRig(
        cast(GpuNode, None), cast(FlakyRelay, None), Path("k"), engines=engines))] == ["e0-2"]

    one = RigOptions()
    assert (one.awake_set, one.engine_gpu_limit, one.mode) == (False, "", "one-awake")
    rig = Rig(cast(LocalCluster, None), cast(client.ApiClient, None), "ns", one)
    assert [rig._spec(0, k).args for k in range(2)] == [
        FAST_ENGINE, (*FAST_ENGINE, f"--start-seconds={one.slow_start_s}")]


@pytest.mark.parametrize("separate_process", [False, True], ids=["thread", "process"])
def test_the_awake_set_monitor_counts_memory_over_the_gpu_and_too_many_awake(
        tmp_path: Path, separate_process: bool) -> None:
    """In awake-set mode two engines above resident are what the set allows; a third
    above resident is counted as crowded, and the GPU's memory in use over its total as
    a violation (each can happen without the other)."""
    procs = tmp_path / "procs"
    engines = _set_engines()
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, "ROTA_CLAIM_UID": e.claim_uid})
                for e in engines]
    uuid = load_fixture(fixture_path("h200")).devices[0].uuid
    gib = 2**30
    try:
        for child, used in zip(children, (60 * gib, 60 * gib, 2 * gib), strict=True):
            register_process(procs, child.pid, uuid, used)
        with AwakeMonitor(tmp_path / "no-socket", engines, registry=procs,
                          fixture=fixture_path("h200"), separate_process=separate_process,
                          awake_set=True) as monitor:
            monitor.wait_next()
            assert (monitor.violations, monitor.crowded) == ([], [])
            register_process(procs, children[2].pid, uuid, 10 * gib)  # 130.6 GiB in use
            monitor.wait_next()
            assert monitor.violations == []
            register_process(procs, children[2].pid, uuid, 40 * gib)  # 160.6 GiB
            monitor.wait_next()
        assert monitor.violations, "memory over the GPU's total went unseen"
        assert "160.6 GiB in use of 140.4 GiB" in monitor.violations[-1]
        assert monitor.crowded, "three engines awake went unseen"
        assert all(f"claim-{k}" in monitor.crowded[0] for k in range(3))
        assert monitor.above_resident[2] >= 1
        assert monitor.above_resident[3] >= 2
        assert monitor.peak_used_bytes > monitor.peak_total_bytes == 150754820096
    finally:
        for child in children:
            child.kill()
            child.wait()


def _set_lease(state: naming.LeaseState, holder: str = "", companions: tuple[str, ...] = ()
               ) -> GpuLease:
    return _lease(state).with_(
        holder=holder, holder_claim_uid=f"uid-{holder}" if holder else "",
        companions=tuple(AwakeMember(c, f"uid-{c}", f"m/{c}") for c in companions))


def test_a_settled_gpu_has_its_true_owner_in_either_mode() -> None:
    """One awake: the holder is the only engine awake, or none is and the Lease is idle
    (as before). Awake set: the engines awake are exactly those the Lease names awake,
    no switch in progress."""
    pair = _set_lease(naming.LeaseState.AWAKE, "ns/a", ("ns/b",))
    assert owner_problem(pair, ["ns/b", "ns/a"], awake_set=True) is None
    assert owner_problem(pair, ["ns/a"], awake_set=True) is not None  # b named, asleep
    assert owner_problem(pair, ["ns/a", "ns/b", "ns/c"], awake_set=True) is not None
    assert owner_problem(_set_lease(naming.LeaseState.SWITCHING, "ns/a", ("ns/b",)),
                         ["ns/b"], awake_set=True) is not None
    idle = _set_lease(naming.LeaseState.IDLE)
    assert owner_problem(idle, [], awake_set=True) is None
    assert owner_problem(idle, ["ns/a"], awake_set=True) is not None

    alone = _set_lease(naming.LeaseState.AWAKE, "ns/a")
    assert owner_problem(alone, ["ns/a"], awake_set=False) is None
    assert owner_problem(alone, ["ns/a", "ns/b"], awake_set=False) is not None
    assert owner_problem(idle, [], awake_set=False) is None
    assert owner_problem(idle, ["ns/a"], awake_set=False) is not None
    assert owner_problem(_set_lease(naming.LeaseState.FAILED), [], awake_set=False) is not None


def test_the_report_says_the_mode_and_holds_its_targets() -> None:
    one = Tally()
    assert one.report()["mode"] == "one-awake"
    assert "double_awake_instants" in one.report()
    assert "over_gpu_instants" not in one.report()
    assert one.clean()
    one.double_awake = 1
    assert not one.clean()

    sets = Tally(mode=AWAKE_SET)
    monitor = AwakeMonitor(Path("no-socket"), [], awake_set=True)
    monitor.samples, monitor.above_resident = 10, {1: 4, 2: 6}
    _count_samples(sets, "n", monitor)
    report = sets.report()
    assert report["mode"] == "awake-set"
    assert "double_awake_instants" not in report
    assert report["samples_by_engines_above_resident"] == {1: 4, 2: 6}
    assert sets.clean()
    assert any(line.startswith("mode") and "awake-set" in line for line in sets.lines())
    monitor.crowded = ["t gpu-0: {...}"]
    _count_samples(sets, "n", monitor)
    assert sets.crowded == 1
    assert not sets.clean()
    over = Tally(mode=AWAKE_SET)
    monitor.crowded, monitor.violations = [], ["t gpu-0: 160.6 GiB in use of 140.4 GiB"]
    _count_samples(over, "n", monitor)
    assert over.report()["over_gpu_instants"] == 1
    assert over.report()["samples"]["over_gpu"] == [f"n {monitor.violations[0]}"]
    assert not over.clean()
