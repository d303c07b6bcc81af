"""How ``python -m e2e.gpu.policy_run`` chooses its windows: by rule (every
``--window-every`` seconds from ``--window-from``), and how long each may be within the
budget (shrunk evenly, then dropped from the end), never by what they hold."""

from __future__ import annotations

from pathlib import Path

from e2e.gpu.policy_replay import Arrival
from e2e.gpu.policy_run import (
    MIN_WINDOW_S,
    POLICIES,
    TAIL_S,
    mode_of,
    parser,
    plan,
    window_starts,
    windows_of,
    write_trace,
)


def test_the_default_run_fits_three_windows_of_four_policies_in_one_call() -> None:
    args = parser().parse_args([])
    assert window_starts(args) == [600.0, 1800.0, 3000.0]
    assert args.policies.split(",") == list(POLICIES)
    # about 1-2 minutes for three engines to start leave some 400 s of the 540 s budget
    count, window = plan(400.0, 3, POLICIES, 3, True, args.window_s)
    assert (count, window) == (3, args.window_s)
    assert count * len(POLICIES) * (window + TAIL_S) <= 400.0


def test_windows_shrink_evenly_then_are_dropped_from_the_end() -> None:
    count, window = plan(300.0, 3, POLICIES, 3, True, 20.0)
    assert count == 3
    assert MIN_WINDOW_S <= window < 20.0
    count, window = plan(150.0, 3, POLICIES, 3, True, 20.0)
    assert count < 3
    assert window >= MIN_WINDOW_S
    # no all-awake bound (does not fit): each window also takes its references
    without, with_bound = (plan(400.0, 3, POLICIES, 3, fits, 20.0) for fits in (False, True))
    assert without[0] * without[1] < with_bound[0] * with_bound[1]
    assert plan(10.0, 3, POLICIES, 3, True, 20.0) == (1, MIN_WINDOW_S)
    assert plan(1000.0, 3, POLICIES, 3, True, 5.0) == (3, 5.0)  # never longer than asked


def test_windows_of_a_trace_file_are_cut_by_the_same_rule(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    write_trace([Arrival(float(t), t % 3, 10, 5) for t in range(0, 100, 5)], path)
    args = parser().parse_args(["--trace", str(path), "--windows", "2", "--window-from",
                                "10", "--window-every", "50", "--window-s", "20"])
    (first, a), (second, b) = windows_of(args)
    assert (first, second) == (10.0, 60.0)
    assert [x.at for x in a] == [0.0, 5.0, 10.0, 15.0]
    assert [x.at for x in b] == [0.0, 5.0, 10.0, 15.0]
    assert [x.model for x in b] == [0, 2, 1, 0]


def test_each_policy_runs_as_a_lease_controller_mode() -> None:
    assert mode_of("first-come").value == "first-come"
    assert mode_of("rota").value == "rota"
    assert mode_of("drain").value in ("drain", "rota")  # rota's drain-based rules
