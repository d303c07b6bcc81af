"""The policy simulation (e2e/bench/policy.py) with turns at token granularity: rota's
preemptive policy freezes the holder's stream and continues it after its next wake (a
recompute first), the drain-based one never freezes, all engines awake is the bound; the
policy aims at the objectives the SLO goodput counts. No timing is asserted: the simulated
clock is the simulation's own."""

from __future__ import annotations

import argparse
import math

from e2e.bench import policy as bench_policy
from e2e.bench.policy import Request, engine_models, simulate


def _args() -> argparse.Namespace:
    return argparse.Namespace(step_s=0.02, max_seqs=32, client_timeout_s=60.0,
                              static_period_s=10.0, ttft_slo_s=2.0, longest_freeze_s=3.0)


def _long_stream_then_a_short_one() -> list[Request]:
    """m1 is woken once (its switch costs measured), then m0 streams 3,000 tokens (30 s at
    10 ms a step) and m1 asks for 10 more at 4 s."""
    return [Request(0.0, 1, 100, 10), Request(1.0, 0, 100, 3000), Request(4.0, 1, 100, 10)]


def test_rota_preempts_a_long_stream_and_continues_it_whole() -> None:
    models = engine_models([1.0], 2, 400.0)
    result = simulate("rota", _long_stream_then_a_short_one(), models, _args())
    long, short = result.sim.arrivals[1:]
    assert short.first_token - short.arrival <= 2.0  # served within its objective
    assert math.isfinite(long.frozen_at)  # the holder's stream was frozen for it
    assert 0.0 < long.gap_s <= 3.0  # and resumed within the freeze bound
    assert long.decode_left <= 0  # every token generated: nothing lost
    assert result.rows[0]["frozen"] == 1
    assert result.total_slo_goodput == 3


def test_drain_never_freezes_a_stream() -> None:
    models = engine_models([1.0], 2, 400.0)
    result = simulate("drain", _long_stream_then_a_short_one(), models, _args())
    assert all(not math.isfinite(r.frozen_at) for r in result.sim.arrivals)
    assert all(r.gap_s == 0.0 for r in result.sim.arrivals)
    assert sum(int(str(row["frozen"])) for row in result.rows) == 0
    short = result.sim.arrivals[2]
    assert short.first_token - short.arrival > 2.0  # it waited for the drain


def test_the_policy_aims_at_the_objectives_measured() -> None:
    args = _args()
    args.ttft_slo_s, args.longest_freeze_s = 1.5, 2.5
    aimed = bench_policy.rota_policy("rota", args).default
    assert (aimed.first_token_s, aimed.longest_freeze_s) == (1.5, 2.5)
    assert aimed.keeps_requests
    assert bench_policy.rota_policy("drain", args).default.mode.value == "drain"


def test_all_awake_serves_every_model_at_once() -> None:
    models = engine_models([1.0], 2, 400.0)
    result = simulate("all-awake", _long_stream_then_a_short_one(), models, _args())
    assert result.total_slo_goodput == result.total_goodput == 3
    assert [row["wakes_h"] for row in result.rows] == [0.0, 0.0]
    assert "all-awake" in bench_policy.POLICIES
